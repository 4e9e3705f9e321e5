#!/usr/bin/env python3
"""Validate training/refusal/questions.jsonl (stdlib only).

Checks: every line parses as a JSON object with the expected fields and
types; ids are unique; question texts are unique (after case/space
normalisation); answerable rows name an existing gold passage in the right
corpus file and their `answer` is a verbatim substring of that passage;
unanswerable rows carry a valid kind and null gold_doc/answer.
Prints counts per corpus and kind. Exits 1 on any problem.

Usage: python3 training/refusal/check_questions.py [questions.jsonl]
"""
import json
import os
import re
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
CORPORA = {
    "rust-book": os.path.join(ROOT, "eval", "rust-book-natural", "corpus.jsonl"),
    "rfcs": os.path.join(ROOT, "eval", "rfcs-long", "corpus.jsonl"),
}
KINDS_UNANSWERABLE = {"off_topic", "near_miss", "false_premise", "specific_detail"}
FIELDS = ["id", "corpus", "text", "answerable", "kind", "gold_doc", "answer"]
ID_RE = re.compile(r"^t\d{4}$")


def load_corpus(path):
    docs = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                d = json.loads(line)
                docs[d["_id"]] = d["text"]
    return docs


def main():
    qpath = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "questions.jsonl")
    problems = []
    corpora = {}
    for name, path in CORPORA.items():
        if not os.path.exists(path):
            problems.append("missing corpus file %s" % path)
        else:
            corpora[name] = load_corpus(path)

    rows = []
    with open(qpath, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                problems.append("line %d: blank line" % n)
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append("line %d: bad JSON (%s)" % (n, e))
                continue
            if not isinstance(obj, dict):
                problems.append("line %d: not an object" % n)
                continue
            if sorted(obj) != sorted(FIELDS):
                problems.append("line %d: fields %s, expected %s" % (n, sorted(obj), sorted(FIELDS)))
            rows.append((n, obj))

    ids = Counter(o.get("id") for _, o in rows)
    for i, c in ids.items():
        if c > 1:
            problems.append("duplicate id %r (%d times)" % (i, c))
    texts = Counter(" ".join(str(o.get("text", "")).lower().split()) for _, o in rows)
    for t, c in texts.items():
        if c > 1:
            problems.append("duplicate question text %r" % t)

    counts = Counter()
    golds = {name: set() for name in CORPORA}
    for n, o in rows:
        where = "line %d (%s)" % (n, o.get("id"))
        if not isinstance(o.get("id"), str) or not ID_RE.match(o["id"]):
            problems.append("%s: bad id" % where)
        corp = o.get("corpus")
        if corp not in CORPORA:
            problems.append("%s: unknown corpus %r" % (where, corp))
            continue
        if not isinstance(o.get("text"), str) or not o["text"].strip():
            problems.append("%s: empty text" % where)
        ans = o.get("answerable")
        kind = o.get("kind")
        if not isinstance(ans, bool):
            problems.append("%s: answerable must be true/false" % where)
            continue
        counts[(corp, kind)] += 1
        if ans:
            if kind != "answerable":
                problems.append("%s: answerable row has kind %r" % (where, kind))
            gold, answer = o.get("gold_doc"), o.get("answer")
            docs = corpora.get(corp, {})
            if gold not in docs:
                problems.append("%s: gold_doc %r not in %s corpus" % (where, gold, corp))
                continue
            if not isinstance(answer, str) or not answer.strip():
                problems.append("%s: empty answer" % where)
                continue
            if answer not in docs[gold]:
                problems.append("%s: answer %r is not a verbatim substring of %s" % (where, answer, gold))
            words = len(answer.split())
            if words > 8:
                problems.append("%s: answer too long (%d words)" % (where, words))
            golds[corp].add(gold)
        else:
            if kind not in KINDS_UNANSWERABLE:
                problems.append("%s: unanswerable row has kind %r" % (where, kind))
            if o.get("gold_doc") is not None or o.get("answer") is not None:
                problems.append("%s: unanswerable row must have null gold_doc and answer" % where)

    print("questions: %d" % len(rows))
    for corp in CORPORA:
        total = sum(c for (cp, _), c in counts.items() if cp == corp)
        print("  %-10s total %3d" % (corp, total))
        for kind in ["answerable"] + sorted(KINDS_UNANSWERABLE):
            print("    %-16s %3d" % (kind, counts.get((corp, kind), 0)))
        print("    distinct gold passages: %d" % len(golds[corp]))
    print("distinct gold passages overall: %d" % sum(len(g) for g in golds.values()))

    if problems:
        print("\n%d problem(s):" % len(problems))
        for p in problems:
            print("  - " + p)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
