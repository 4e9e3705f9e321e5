#!/usr/bin/env python3
"""Python peer of docent's `POST /v1/search` for `docent bench query`: the same job as a typical
Python service would do it.

  serve   FastAPI on uvicorn (one process, the endpoint a plain `def`, so requests run on
          Starlette's thread pool), JSON in and out;
  embed   the question with the same ONNX file: tokenizers (truncation --max-length), onnxruntime
          (intra-op --threads, inter-op 1, all graph optimizations), mean pooling, L2 norm
          (the Embedder of bench_ingest_peer.py);
  sparse  the question's BM25 vector from qdrant-edge-py's Bm25 (the embedder docent uses, from
          the same engine version);
  search  --store edge (default): qdrant-edge-py 0.7.2 (the Python binding of the Qdrant engine
          docent embeds) opened on docent's own index files (--shard, read only in practice);
          --store client: qdrant-client 1.20 in local mode (in memory, pure Python + numpy), the
          usual choice of a Python service without a server, loaded with every point of that
          index (same vectors, same BM25 vectors, IDF modifier) before serving.
          Either way: one hybrid query (dense and BM25 prefetch of top_k x --candidates each,
          fused with --fusion) with payloads, and the dense and BM25 candidate lists without
          payloads for each hit's per-ranking scores, as docent reports them. Hidden
          (half-written) documents: none exist in a finished bench index, so no filter.

Request:  {"question": "...", "retrieval": {"top_k": 5, "mode": "hybrid"}}
Response: {"mode": "hybrid", "hits": [{document_id, source, title, chunk_index, span, text,
          score, scores: {dense, sparse, fused}}], "retrieval_ms": ...}

Usage (environment: bash scripts/bench-peer-venv.sh):
  models/.venv-peer/bin/python scripts/bench_query_peer.py --shard DATA_DIR/qdrant \\
      --model-dir models/all-MiniLM-L6-v2 --port 8099
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import uvicorn  # noqa: E402
from fastapi import FastAPI, HTTPException  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from qdrant_edge import (  # noqa: E402
    Bm25, Bm25Config, EdgeShard, Fusion, Prefetch, Query, QueryRequest,
)

import bench_ingest_peer  # noqa: E402

DENSE, SPARSE = "dense", "bm25"


class Retrieval(BaseModel):
    top_k: int = Field(5, ge=1, le=100)
    mode: str = "hybrid"


class SearchRequest(BaseModel):
    question: str = Field(min_length=1)
    retrieval: Retrieval = Retrieval()


def build_app(args):
    bench_ingest_peer.MAX_LENGTH = args.max_length
    embedder = bench_ingest_peer.Embedder(args.model_dir, args.threads)
    bm25 = Bm25(Bm25Config())
    shard = EdgeShard.load(args.shard)
    query = edge_query(shard, args) if args.store == "edge" else client_query(shard, args, embedder.dim)
    app = FastAPI()

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.post("/v1/search")
    def search(req: SearchRequest):
        if req.retrieval.mode != "hybrid":
            raise HTTPException(422, "the peer does hybrid search only")
        started = time.perf_counter()
        dense = embedder.embed([req.question])[0].tolist()
        sparse = bm25.embed_query(req.question)
        fused, dense_scores, sparse_scores = query(dense, sparse, req.retrieval.top_k)
        hits = []
        for p in fused:
            pl = p.payload or {}
            hits.append({
                "document_id": pl.get("document_id"), "source": pl.get("source"),
                "title": pl.get("title"), "chunk_index": pl.get("chunk_index"),
                "span": pl.get("span"), "text": pl.get("text"), "score": p.score,
                "scores": {"dense": dense_scores.get(p.id), "sparse": sparse_scores.get(p.id),
                           "fused": p.score},
            })
        return {"mode": "hybrid", "hits": hits, "retrieval_ms": (time.perf_counter() - started) * 1e3}

    return app


def edge_query(shard, args):
    fusion = Fusion.Dbsf() if args.fusion == "dbsf" else Fusion.Rrf(k=args.rrf_k)

    def query(dense, sparse, k):
        depth = k * args.candidates
        fused = shard.query(QueryRequest(
            prefetches=[Prefetch(query=Query.Nearest(dense, using=DENSE), limit=depth),
                        Prefetch(query=Query.Nearest(sparse, using=SPARSE), limit=depth)],
            query=fusion, limit=k, with_payload=True))
        dense_list = shard.query(QueryRequest(query=Query.Nearest(dense, using=DENSE), limit=depth,
                                              with_payload=False))
        sparse_list = shard.query(QueryRequest(query=Query.Nearest(sparse, using=SPARSE), limit=depth,
                                               with_payload=False))
        return fused, {p.id: p.score for p in dense_list}, {p.id: p.score for p in sparse_list}
    return query


def client_query(shard, args, dim):
    from qdrant_client import QdrantClient, models
    from qdrant_edge import ScrollRequest
    client = QdrantClient(":memory:")
    client.create_collection("chunks", vectors_config={DENSE: models.VectorParams(size=dim, distance=models.Distance.COSINE)},
                             sparse_vectors_config={SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)})
    offset, loaded = None, 0
    while True:
        records, offset = shard.scroll(ScrollRequest(offset=offset, limit=1024, with_payload=True, with_vector=True))
        points = []
        for r in records:
            v = r.vector
            sv = v[SPARSE]
            points.append(models.PointStruct(id=r.id, payload=r.payload, vector={
                DENSE: list(v[DENSE]),
                SPARSE: models.SparseVector(indices=list(sv.indices), values=list(sv.values))}))
        if points:
            client.upsert("chunks", points=points, wait=True)
            loaded += len(points)
        if offset is None:
            break
    print(f"bench_query_peer: loaded {loaded} points into qdrant-client local mode", file=sys.stderr)
    fusion = (models.FusionQuery(fusion=models.Fusion.DBSF) if args.fusion == "dbsf"
              else models.RrfQuery(rrf=models.Rrf(k=args.rrf_k)))

    def query(dense, sparse, k):
        depth = k * args.candidates
        sv = models.SparseVector(indices=list(sparse.indices), values=list(sparse.values))
        fused = client.query_points("chunks", prefetch=[
            models.Prefetch(query=dense, using=DENSE, limit=depth),
            models.Prefetch(query=sv, using=SPARSE, limit=depth)],
            query=fusion, limit=k, with_payload=True).points
        dense_list = client.query_points("chunks", query=dense, using=DENSE, limit=depth).points
        sparse_list = client.query_points("chunks", query=sv, using=SPARSE, limit=depth).points
        return fused, {p.id: p.score for p in dense_list}, {p.id: p.score for p in sparse_list}
    return query


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard", required=True, help="docent's index: DATA_DIR/qdrant")
    ap.add_argument("--model-dir", required=True, help="directory with model.onnx and tokenizer.json")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per question, special tokens included")
    ap.add_argument("--candidates", type=int, default=8, help="each ranking's list is top_k x this deep")
    ap.add_argument("--fusion", choices=["dbsf", "rrf"], default="dbsf")
    ap.add_argument("--store", choices=["edge", "client"], default="edge",
                    help="edge: qdrant-edge-py on the index files; client: qdrant-client local mode")
    ap.add_argument("--rrf-k", type=int, default=60, help="k of --fusion rrf")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(build_app(args), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
