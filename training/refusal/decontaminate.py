#!/usr/bin/env python3
"""Drops from the training questions every one that is close to a question of an
evaluation set (token Jaccard >= 0.6 on lower-cased words): two writers who never saw each
other's sets still wrote some of the same common questions. Run once after the questions
were written; the dropped ones are kept in questions_dropped.jsonl with the question they
matched. Only the training side changes: the evaluation sets are left as written.

    python3 training/refusal/decontaminate.py [QUESTIONS.jsonl]

(default questions.jsonl; the dropped ones go to <stem>_dropped.jsonl beside it)
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EVAL = [
    ROOT / "eval/refusal-heldout/queries.jsonl",
    ROOT / "eval/rust-book-natural/queries.jsonl",
]
LIMIT = 0.6


def words(text):
    return set(re.findall(r"[a-z0-9_]+", text.lower()))


def main():
    held = []
    for path in EVAL:
        for line in path.read_text().splitlines():
            q = json.loads(line)
            held.append((path.parent.name, q["_id"], q["text"], words(q["text"])))
    kept, dropped = [], []
    source = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE / "questions.jsonl"
    all_questions = [json.loads(l) for l in source.read_text().splitlines() if l.strip()]
    dropped_file = source.with_name(source.stem + "_dropped.jsonl")
    if dropped_file.exists():
        all_questions += [json.loads(l)["question"] for l in dropped_file.read_text().splitlines()]
    all_questions.sort(key=lambda q: q["id"])
    for q in all_questions:
        w = words(q["text"])
        best = max(held, key=lambda h: len(w & h[3]) / max(1, len(w | h[3])))
        j = len(w & best[3]) / max(1, len(w | best[3]))
        if j >= LIMIT:
            dropped.append({"question": q, "matched": f"{best[0]}/{best[1]}", "text": best[2], "jaccard": round(j, 2)})
        else:
            kept.append(q)
    source.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in kept))
    dropped_file.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dropped))
    print(f"kept {len(kept)}, dropped {len(dropped)} (Jaccard >= {LIMIT} with an evaluation question)")


if __name__ == "__main__":
    main()
