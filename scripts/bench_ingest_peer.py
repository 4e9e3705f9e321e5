#!/usr/bin/env python3
"""Python peer of `docent ingest` for benchmarks: the same job with the usual Python libraries.

  read    every .md/.markdown/.txt file below --corpus (recursive, sorted by path components, as
          docent's loader walks), UTF-8 (BOM stripped, bad bytes replaced);
  split   semantic-text-splitter (the Python bindings of text-splitter, which docent uses):
          MarkdownSplitter for Markdown, TextSplitter otherwise, sized in tokens by the model's own
          tokenizer (padding and truncation off), capacity --max-tokens, overlap --overlap;
          whitespace-only chunks are dropped, as docent does;
  embed   each document's chunks in batches of --batch-size, in document order (docent batches per
          document too): tokenizers (truncation 256, padding to the batch's longest), ONNX Runtime
          (intra-op --threads, inter-op 1, all graph optimizations), mean pooling over the attention
          mask, L2 normalisation;
  store   qdrant-client in local mode (in-process, persisted under a temp directory): one collection,
          384-d cosine vectors, payload {source, chunk_index, text}, upserted --upsert-batch points at
          a time.

Unlike docent, the peer is sequential (docent splits on worker threads while it embeds), computes no
BM25 sparse vectors and does no content-hash deduplication.

Timing (time.perf_counter):
  seconds        the whole job: discovering and reading files, splitting, embedding, opening the
                 store, creating the collection, all upserts and closing the store. Excluded:
                 interpreter start, imports, loading the ONNX model and the tokenizers, and removing
                 the temp directory afterwards.
  split_seconds  reading + decoding files and splitting them
  embed_seconds  tokenizing batches, ONNX Runtime, pooling and normalisation
  store_seconds  opening the store, creating the collection, building points, upserts, closing
  mb_per_s       input bytes (file sizes) / 1e6 / seconds

Usage (environment: bash scripts/bench-peer-venv.sh):
  models/.venv-peer/bin/python scripts/bench_ingest_peer.py --corpus DIR --model-dir models/all-MiniLM-L6-v2 [--json]
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from qdrant_client import QdrantClient, models
from semantic_text_splitter import MarkdownSplitter, TextSplitter
from tokenizers import Tokenizer

MAX_LENGTH = 256     # model input limit in tokens, special tokens included (docent's default)
SPECIAL_TOKENS = 2   # [CLS] and [SEP]
MARKDOWN = {".md", ".markdown"}
TEXT = {".txt"}


def discover(corpus):
    files = [p for p in Path(corpus).rglob("*") if p.is_file() and p.suffix.lower() in MARKDOWN | TEXT]
    return sorted(files, key=lambda p: p.parts)


class Embedder:
    def __init__(self, model_dir, threads):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(os.path.join(model_dir, "model.onnx"), opts,
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.output = "last_hidden_state" if "last_hidden_state" in outputs else outputs[0]
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=MAX_LENGTH)
        self.tokenizer.enable_padding(pad_id=0, pad_type_id=0, pad_token="[PAD]")  # to the batch's longest
        self.dim = self.embed(["dimension probe"]).shape[1]

    def embed(self, texts):
        encs = self.tokenizer.encode_batch(texts)
        arr = lambda key: np.array([getattr(e, key) for e in encs], dtype=np.int64)
        feed = {"input_ids": arr("ids"), "attention_mask": arr("attention_mask"), "token_type_ids": arr("type_ids")}
        hidden = self.session.run([self.output], {k: v for k, v in feed.items() if k in self.inputs})[0]
        mask = feed["attention_mask"][..., None].astype(np.float32)
        pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="directory of .md/.txt files")
    ap.add_argument("--model-dir", required=True, help="directory with model.onnx and tokenizer.json")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    ap.add_argument("--batch-size", type=int, default=8, help="chunks per ONNX run")
    ap.add_argument("--max-tokens", type=int, default=200, help="chunk capacity in tokens")
    ap.add_argument("--overlap", type=int, default=24, help="tokens shared by neighbouring chunks")
    ap.add_argument("--upsert-batch", type=int, default=64, help="points per qdrant upsert")
    ap.add_argument("--json", action="store_true", help="print only one JSON line")
    args = ap.parse_args()
    if not 0 < args.max_tokens <= MAX_LENGTH - SPECIAL_TOKENS or not 0 <= args.overlap < args.max_tokens:
        ap.error(f"need 0 < --max-tokens <= {MAX_LENGTH - SPECIAL_TOKENS} and 0 <= --overlap < --max-tokens")

    # Set-up, not timed: model, tokenizers, splitters.
    embedder = Embedder(args.model_dir, args.threads)
    sizer = Tokenizer.from_file(os.path.join(args.model_dir, "tokenizer.json"))
    sizer.no_padding()      # tokenizer.json pads to 128 ...
    sizer.no_truncation()   # ... and truncates at 128: count real tokens, as docent's splitter does
    splitters = {fmt: cls.from_huggingface_tokenizer(sizer, args.max_tokens, args.overlap)
                 for fmt, cls in (("markdown", MarkdownSplitter), ("text", TextSplitter))}
    store_dir = tempfile.TemporaryDirectory(prefix="bench-peer-qdrant-")

    t_split = t_embed = t_store = 0.0
    n_files = n_bytes = n_chunks = 0
    pending = []
    t0 = time.perf_counter()

    t = time.perf_counter()
    client = QdrantClient(path=store_dir.name)
    client.create_collection("chunks", vectors_config=models.VectorParams(size=embedder.dim,
                                                                          distance=models.Distance.COSINE))
    t_store += time.perf_counter() - t

    def flush(force=False):
        nonlocal pending
        while pending and (force or len(pending) >= args.upsert_batch):
            client.upsert("chunks", points=pending[:args.upsert_batch], wait=True)
            pending = pending[args.upsert_batch:]

    t = time.perf_counter()
    files = discover(args.corpus)
    t_split += time.perf_counter() - t
    for path in files:
        t = time.perf_counter()
        raw = path.read_bytes()
        text = raw.decode("utf-8-sig", errors="replace")
        splitter = splitters["markdown" if path.suffix.lower() in MARKDOWN else "text"]
        chunks = [c for c in splitter.chunks(text) if c.strip()]
        t_split += time.perf_counter() - t
        n_files, n_bytes = n_files + 1, n_bytes + len(raw)
        source = str(path.resolve())

        for start in range(0, len(chunks), args.batch_size):
            batch = chunks[start:start + args.batch_size]
            t = time.perf_counter()
            vectors = embedder.embed(batch)
            t_embed += time.perf_counter() - t

            t = time.perf_counter()
            pending.extend(
                models.PointStruct(id=n_chunks + start + i, vector=v.tolist(),
                                   payload={"source": source, "chunk_index": start + i, "text": c})
                for i, (c, v) in enumerate(zip(batch, vectors)))
            flush()
            t_store += time.perf_counter() - t
        n_chunks += len(chunks)

    t = time.perf_counter()
    flush(force=True)
    stored = client.count("chunks").count
    client.close()
    t_store += time.perf_counter() - t
    seconds = time.perf_counter() - t0
    store_dir.cleanup()
    if stored != n_chunks:
        sys.exit(f"ERROR: stored {stored} points for {n_chunks} chunks")

    result = {"files": n_files, "bytes": n_bytes, "chunks": n_chunks, "seconds": round(seconds, 3),
              "chunks_per_s": round(n_chunks / seconds, 2), "mb_per_s": round(n_bytes / 1e6 / seconds, 4),
              "embed_seconds": round(t_embed, 3), "split_seconds": round(t_split, 3),
              "store_seconds": round(t_store, 3)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{n_files} files, {n_bytes / 1e6:.2f} MB -> {n_chunks} chunks in {seconds:.1f} s "
              f"({result['chunks_per_s']} chunks/s, {result['mb_per_s']} MB/s): split {t_split:.1f} s, "
              f"embed {t_embed:.1f} s, store {t_store:.1f} s")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
