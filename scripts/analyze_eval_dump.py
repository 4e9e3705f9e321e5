#!/usr/bin/env python3
"""Offline analysis of `docent eval --dump FILE` candidate lists (issue 18).

Each dump line holds one question's dense and BM25 candidate lists as docent retrieved
them (chunk rows `[document, chunk index, score, gold answer in chunk, share of the
question's BM25 terms in the chunk, characters]`, best first). This script compares
fusion and document-aggregation rules on those lists without re-running retrieval:
document MRR@10 (as `docent eval` computes it: chunks mapped to their documents, first
occurrence kept), the gold answer in the top-3 chunks, and refusal signals (the share
of unanswerable questions refused at <= 10 % false refusals).

    python3 scripts/analyze_eval_dump.py NAME=dump.jsonl [NAME=dump.jsonl ...]

Standard library only. Nothing here is used at run time: rules that win are
implemented in docent and measured again with `docent eval`.
"""
import json
import math
import sys
from collections import defaultdict


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def dbsf_norm(rows):
    """Qdrant's DBSF: scores mapped between mean -/+ 3 sample std devs."""
    if len(rows) < 2:
        return {(r[0], r[1]): 0.5 for r in rows}
    scores = [r[2] for r in rows]
    mean = sum(scores) / len(scores)
    var = sum((s - mean) ** 2 for s in scores) / (len(scores) - 1)
    sd = math.sqrt(var)
    lo, hi = mean - 3 * sd, mean + 3 * sd
    if hi == lo:
        return {(r[0], r[1]): 0.5 for r in rows}
    return {(r[0], r[1]): (r[2] - lo) / (hi - lo) for r in rows}


def fuse_dbsf(q, wd=1.0, ws=1.0):
    out = defaultdict(float)
    for k, v in dbsf_norm(q["dense"]).items():
        out[k] += wd * v
    for k, v in dbsf_norm(q["sparse"]).items():
        out[k] += ws * v
    return out


def fuse_rrf(q, k=60):
    out = defaultdict(float)
    for lst in (q["dense"], q["sparse"]):
        for i, r in enumerate(lst):
            out[(r[0], r[1])] += 1.0 / (i + k)
    return out


def gap_conf(rows):
    """How many standard deviations the best score stands above the other candidates."""
    if len(rows) < 3:
        return 1.0
    s = [r[2] for r in rows]
    rest = s[1:]
    m = sum(rest) / len(rest)
    sd = math.sqrt(sum((x - m) ** 2 for x in rest) / (len(rest) - 1)) or 1e-6
    return max(0.0, (s[0] - m) / sd)


def fuse_conf(q, alpha):
    """DBSF with per-query weights from each list's confidence, `alpha` of the way from
    equal weights to proportional ones."""
    cd, cs = gap_conf(q["dense"]), gap_conf(q["sparse"])
    tot = cd + cs or 1.0
    wd = (1 - alpha) + alpha * 2 * cd / tot
    ws = (1 - alpha) + alpha * 2 * cs / tot
    return fuse_dbsf(q, wd, ws)


def ranked_chunks(scores):
    return sorted(scores.items(), key=lambda kv: -kv[1])


def per_document(chunk_scores):
    """Each document's chunk scores, best first."""
    per = defaultdict(list)
    for (d, _c), s in chunk_scores.items():
        per[d].append(s)
    return {d: sorted(ss, reverse=True) for d, ss in per.items()}


def doc_aggregate(chunk_scores, lam, top=3):
    """Document score: best chunk + lam * the next `top - 1` chunks of the same document."""
    return {d: ss[0] + lam * sum(ss[1:top]) for d, ss in per_document(chunk_scores).items()}


def chunk_boost(chunk_scores, mu, top=3):
    """Chunk score + mu * (its document's aggregate - the chunk itself): chunks of
    documents with more evidence move up."""
    agg = {d: sum(ss[:top]) for d, ss in per_document(chunk_scores).items()}
    return {k: s + mu * (agg[k[0]] - s) for k, s in chunk_scores.items()}


def mrr_docs(doc_order, relevant):
    for i, d in enumerate(doc_order[:10]):
        if d in relevant:
            return 1.0 / (i + 1)
    return 0.0


def docs_of(chunks):
    seen, out = set(), []
    for (d, _), _s in chunks:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def gold_map(q):
    g = {}
    for lst in (q["dense"], q["sparse"]):
        for r in lst:
            g[(r[0], r[1])] = g.get((r[0], r[1]), False) or r[3]
    return g


def evaluate(qs, scorer, aggregate=None):
    mrr, ctx, n = 0.0, 0, 0
    for q in qs:
        if not q["answerable"]:
            continue
        n += 1
        scores = scorer(q)
        chunks = ranked_chunks(scores)
        if aggregate is None:
            docs = docs_of(chunks)
        else:
            agg = aggregate(scores)
            docs = [d for d, _ in sorted(agg.items(), key=lambda kv: -kv[1])]
        mrr += mrr_docs(docs, set(q["relevant"]))
        g = gold_map(q)
        ctx += any(g.get(k, False) for k, _ in chunks[:3])
    return mrr / max(n, 1), ctx / max(n, 1)


def refusal(qs, feature, max_false=0.10):
    """Share of unanswerable questions refused by the best threshold on `feature`
    (higher = more answerable) that refuses at most `max_false` of answerable ones."""
    pos = sorted(feature(q) for q in qs if q["answerable"])
    neg = [feature(q) for q in qs if not q["answerable"]]
    if not pos or not neg:
        return None
    k = int(math.floor(max_false * len(pos)))
    thr = pos[k] if k < len(pos) else pos[-1]
    # refuse when feature < thr: at most k answerable ones are below it
    return sum(1 for x in neg if x < thr) / len(neg), thr


def feats(q):
    d, s = q["dense"], q["sparse"]
    best_d = d[0][2] if d else 0.0
    best_s = s[0][2] if s else 0.0
    cov = max((r[4] for r in s[:3]), default=0.0)
    agree = 1.0 if d and s and d[0][0] == s[0][0] else 0.0
    # the share of the question's terms in the best-covered of the top-3 fused chunks
    # (what the prompt gets), as docent's `retrieval.term_weight` signal uses it
    covered = {(r[0], r[1]): r[4] for lst in (d, s) for r in lst}
    ctx = max((covered[k] for k, _ in ranked_chunks(fuse_dbsf(q))[:3]), default=0.0)
    return {
        "dense": best_d,
        "dense+0.5*terms@ctx": best_d + 0.5 * ctx,
        "sparse": best_s,
        "sparse/terms": best_s / max(q["terms"], 1),
        "coverage@3": cov,
        "dense_gap": best_d - (d[min(9, len(d) - 1)][2] if d else 0),
        "agree": agree,
    }


def main():
    sets = {}
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        sets[name] = load(path)
    rules = {
        "dense": lambda q: {(r[0], r[1]): r[2] for r in q["dense"]},
        "sparse": lambda q: {(r[0], r[1]): r[2] for r in q["sparse"]},
        "dbsf": fuse_dbsf,
        "rrf60": fuse_rrf,
        "conf/2": lambda q: fuse_conf(q, 0.5),
        "dbsf s1.5": lambda q: fuse_dbsf(q, 1.0, 1.5),
        "dbsf d1.5": lambda q: fuse_dbsf(q, 1.5, 1.0),
    }
    print("MRR@10 / answer in top-3 chunks")
    header = f"{'rule':28}" + "".join(f"{n:>22}" for n in sets)
    print(header)
    for name, rule in rules.items():
        row = f"{name:28}"
        for qs in sets.values():
            m, c = evaluate(qs, rule)
            row += f"{m:>14.3f} / {c:.3f}"
        print(row)
    for base in ("sparse", "dbsf", "dense"):
        for lam in (0.1, 0.25, 0.5):
            row = f"{base + ' docagg ' + str(lam):28}"
            for qs in sets.values():
                m, c = evaluate(qs, rules[base], lambda s, lam=lam: doc_aggregate(s, lam))
                row += f"{m:>14.3f} / {c:.3f}"
            print(row)
    for base in ("dbsf",):
        for mu in (0.1, 0.25, 0.5):
            row = f"{base + ' boost ' + str(mu):28}"
            for qs in sets.values():
                m, c = evaluate(qs, lambda q, mu=mu: chunk_boost(rules[base](q), mu))
                row += f"{m:>14.3f} / {c:.3f}"
            print(row)
    print("\nrefusal at <= 10 % false refusals (share of unanswerable refused, threshold)")
    names = list(feats(next(iter(sets.values()))[0]).keys())
    for f in names:
        row = f"{f:28}"
        for qs in sets.values():
            r = refusal(qs, lambda q, f=f: feats(q)[f])
            row += f"{'-':>22}" if r is None else f"{r[0]:>14.3f} ({r[1]:.3f})"
        print(row)


if __name__ == "__main__":
    main()
