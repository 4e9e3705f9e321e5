#!/usr/bin/env python3
"""Verify the refusal-heldout set (stdlib only).

Checks: every file parses; ids are unique and agree across queries.jsonl,
answers.jsonl and qrels/test.tsv; answerable queries have a gold_doc that
exists in corpus.jsonl and is their first qrels row; every answer string is a
verbatim (case-sensitive) substring of the gold passage text and is 1-8 words;
unanswerable queries have no gold_doc, no answers and no qrels rows.
Prints counts per kind. Exits 1 on any problem.

Usage: python3 check.py            (run from anywhere)
"""
import json
import os
import re
import sys
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = {"answerable", "off_topic", "near_miss", "false_premise", "specific_detail"}
problems = []


def problem(msg):
    problems.append(msg)


def load_jsonl(name):
    rows = []
    path = os.path.join(HERE, name)
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    problem(f"{name}:{n}: empty line")
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    problem(f"{name}:{n}: not JSON ({e})")
    except OSError as e:
        problem(f"cannot read {name}: {e}")
    return rows


corpus = load_jsonl("corpus.jsonl")
queries = load_jsonl("queries.jsonl")
answers = load_jsonl("answers.jsonl")

# --- corpus
docs = {}
for d in corpus:
    if set(d) != {"_id", "title", "text"}:
        problem(f"corpus: unexpected keys {sorted(d)}")
    if d.get("_id") in docs:
        problem(f"corpus: duplicate _id {d.get('_id')}")
    docs[d.get("_id")] = d.get("text", "")
if len(docs) != 142:
    problem(f"corpus: expected 142 passages, found {len(docs)}")

# --- queries
qmeta = {}
texts = {}
for q in queries:
    qid = q.get("_id")
    if qid in qmeta:
        problem(f"queries: duplicate _id {qid}")
    if not isinstance(qid, str) or not re.fullmatch(r"h\d{3}", qid or ""):
        problem(f"queries: bad _id {qid!r}")
    text = q.get("text")
    if not isinstance(text, str) or not text.strip():
        problem(f"queries: {qid} has no text")
        text = ""
    norm = re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()
    if norm in texts:
        problem(f"queries: {qid} duplicates the text of {texts[norm]}")
    texts[norm] = qid
    md = q.get("metadata") or {}
    ans_flag, kind = md.get("answerable"), md.get("kind")
    if not isinstance(ans_flag, bool):
        problem(f"queries: {qid} metadata.answerable is not a bool")
    if kind not in KINDS:
        problem(f"queries: {qid} unknown kind {kind!r}")
    if (kind == "answerable") != (ans_flag is True):
        problem(f"queries: {qid} kind {kind!r} disagrees with answerable={ans_flag!r}")
    qmeta[qid] = (ans_flag, kind)

# --- qrels
qrels = defaultdict(list)
qrels_path = os.path.join(HERE, "qrels", "test.tsv")
try:
    with open(qrels_path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if not lines or lines[0] != "query-id\tcorpus-id\tscore":
        problem("qrels: header must be 'query-id\\tcorpus-id\\tscore'")
    for n, line in enumerate(lines[1:], 2):
        parts = line.split("\t")
        if len(parts) != 3:
            problem(f"qrels:{n}: expected 3 tab-separated fields")
            continue
        qid, did, score = parts
        if score != "1":
            problem(f"qrels:{n}: score must be 1")
        if qid not in qmeta:
            problem(f"qrels:{n}: unknown query-id {qid}")
        if did not in docs:
            problem(f"qrels:{n}: unknown corpus-id {did}")
        if did in qrels[qid]:
            problem(f"qrels:{n}: duplicate row {qid} {did}")
        qrels[qid].append(did)
except OSError as e:
    problem(f"cannot read qrels/test.tsv: {e}")

# --- answers
seen = set()
gold_docs = set()
for a in answers:
    qid = a.get("query-id")
    if set(a) != {"query-id", "answerable", "gold_doc", "answers"}:
        problem(f"answers: {qid} unexpected keys {sorted(a)}")
    if qid in seen:
        problem(f"answers: duplicate query-id {qid}")
    seen.add(qid)
    if qid not in qmeta:
        problem(f"answers: query-id {qid} not in queries.jsonl")
        continue
    ans_flag, kind = qmeta[qid]
    if a.get("answerable") != ans_flag:
        problem(f"answers: {qid} answerable differs from queries.jsonl")
    gold, strings = a.get("gold_doc"), a.get("answers")
    if not isinstance(strings, list):
        problem(f"answers: {qid} answers is not a list")
        strings = []
    if ans_flag:
        if gold not in docs:
            problem(f"answers: {qid} gold_doc {gold!r} not in corpus")
            continue
        gold_docs.add(gold)
        if not qrels.get(qid):
            problem(f"qrels: answerable {qid} has no rows")
        elif qrels[qid][0] != gold:
            problem(f"qrels: first row of {qid} is {qrels[qid][0]}, gold_doc is {gold}")
        if len(qrels.get(qid, [])) > 3:
            problem(f"qrels: {qid} has more than 3 relevant passages")
        if not 1 <= len(strings) <= 2:
            problem(f"answers: {qid} needs 1-2 answer strings, has {len(strings)}")
        for s in strings:
            if not isinstance(s, str) or not s.strip():
                problem(f"answers: {qid} empty answer string")
                continue
            if not 1 <= len(s.split()) <= 8:
                problem(f"answers: {qid} answer {s!r} is not 1-8 words")
            if s not in docs[gold]:
                problem(f"answers: {qid} answer {s!r} is not a verbatim substring of {gold}")
    else:
        if gold is not None:
            problem(f"answers: unanswerable {qid} has gold_doc {gold!r}")
        if strings:
            problem(f"answers: unanswerable {qid} has answer strings")
        if qrels.get(qid):
            problem(f"qrels: unanswerable {qid} has rows")
missing = set(qmeta) - seen
for qid in sorted(missing):
    problem(f"answers: no row for query {qid}")

# --- interleaving: neither kind may fill a long leading run
order = [qmeta[q][0] for q in sorted(qmeta)]
run = 1
longest = 1
for x, y in zip(order, order[1:]):
    run = run + 1 if x == y else 1
    longest = max(longest, run)
if longest > 12:
    problem(f"queries: {longest} queries of one kind in a row; interleave them")

# --- counts
counts = Counter(k for _, k in qmeta.values())
n_ans = counts["answerable"]
n_un = sum(v for k, v in counts.items() if k != "answerable")
print(f"passages: {len(docs)}")
print(f"queries: {len(qmeta)}  answerable: {n_ans}  unanswerable: {n_un}")
for k in ["off_topic", "near_miss", "false_premise", "specific_detail"]:
    print(f"  {k}: {counts[k]}")
print(f"qrels rows: {sum(len(v) for v in qrels.values())}  distinct gold passages: {len(gold_docs)}")
if len(qmeta) < 220:
    problem(f"need at least 220 queries, have {len(qmeta)}")
if len(gold_docs) < 40:
    problem(f"need at least 40 distinct gold passages, have {len(gold_docs)}")

if problems:
    print(f"\n{len(problems)} problem(s):")
    for p in problems:
        print("  - " + p)
    sys.exit(1)
print("OK")
