#!/usr/bin/env python3
"""Recall of docent's dense search against an exact one, per HNSW beam (retrieval.ann).

    python3 scripts/ann-recall.py --config models/bench-indexes/query-10000-…/bench-serve.toml \
        eval/rust-book-natural/queries.jsonl [more queries.jsonl …] [--efs 100,256,512] [--k 24]

Starts `docent serve` once per setting (exact first, then each beam) on the config's
index (set [store] to the index you measure; its bind address is used), asks every
question in dense mode for the top k, and prints, per question set, the share of the
exact top k found, how often the top hit is the exact one, and the request p50 (one
client, each question asked twice, the second timed).
"""
import argparse, json, os, statistics, subprocess, sys, time, tomllib, urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--docent", default=os.path.expanduser("~/.cache/docent-target/debug/docent"))
ap.add_argument("--efs", default="32,64,100,128,200,256,512")
ap.add_argument("--k", type=int, default=24)
ap.add_argument("queries", nargs="+")
a = ap.parse_args()
base = "http://" + tomllib.load(open(a.config, "rb"))["server"]["bind"]
sets = {q: [json.loads(l)["text"] for l in open(q)] for q in a.queries}


def serve(env):
    e = dict(os.environ, RUST_LOG="warn", DOCENT_RETRIEVAL__MAX_TOP_K=str(max(a.k, 20)), **env)
    p = subprocess.Popen([a.docent, "--config", a.config, "serve"], env=e,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/readyz", timeout=1)
            return p
        except Exception:
            if p.poll() is not None:
                sys.exit("docent serve exited")
            time.sleep(0.2)
    sys.exit("docent serve did not become ready")


def search(q):
    body = {"question": q, "retrieval": {"top_k": a.k, "mode": "dense", "min_score": -1}}
    r = urllib.request.Request(base + "/v1/search", data=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    t = time.perf_counter()
    hits = json.load(urllib.request.urlopen(r))["hits"]
    return [(h["document_id"], h["chunk_index"]) for h in hits], (time.perf_counter() - t) * 1000


settings = [("exact", {"DOCENT_RETRIEVAL__ANN__EXACT": "true"})]
settings += [(f"ef {ef}", {"DOCENT_RETRIEVAL__ANN__EF": ef}) for ef in a.efs.split(",")]
truth = {}
for name, env in settings:
    p = serve(env)
    try:
        for path, questions in sets.items():
            recall, same, lat = [], 0, []
            for i, q in enumerate(questions):
                search(q)
                ids, ms = search(q)
                lat.append(ms)
                ref = truth.setdefault((path, i), ids)
                recall.append(len(set(ids) & set(ref)) / max(1, len(ref)))
                same += bool(ids) and bool(ref) and ids[0] == ref[0]
            print(f"{name:>7}  {path}: recall@{a.k} {statistics.mean(recall):.4f}, same top hit "
                  f"{same}/{len(questions)}, p50 {statistics.median(lat):.2f} ms", flush=True)
    finally:
        p.terminate()
        p.wait()
