#!/usr/bin/env python3
"""Rebuild the rust-book-natural BEIR-style retrieval eval set.

Usage:
  python3 make_set.py corpus   # split the book into passages -> corpus.jsonl
  python3 make_set.py build    # questions_first.jsonl + questions_added.jsonl + labels.jsonl
                               # -> queries.jsonl,
                               # qrels/test.tsv, answers.jsonl (then verifies)
  python3 make_set.py verify   # check the written files

Source: The Rust Programming Language (rust-lang/book), src/*.md, MIT OR Apache-2.0.
"""
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("RUST_BOOK_SRC", "/work/shared/data/corpus/rust-book/src")
MIN_CHARS = 200
SEP = " \u2014 "  # " — "


def source_files():
    files = glob.glob(os.path.join(SRC, "ch*.md")) + glob.glob(os.path.join(SRC, "appendix-*.md"))
    return sorted(files)


def h1_title(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# "):
                return line[2:].strip()
    return None


def parent_title(path):
    base = os.path.basename(path)
    prefix = "appendix-00" if base.startswith("appendix-") else base.split("-")[0] + "-00"
    parents = glob.glob(os.path.join(SRC, prefix + "*.md"))
    title = h1_title(parents[0]) if parents else None
    return title or os.path.splitext(base)[0]


_SUMMARY = None


def summary_titles():
    global _SUMMARY
    if _SUMMARY is None:
        _SUMMARY = {}
        with open(os.path.join(SRC, "SUMMARY.md"), encoding="utf-8") as f:
            for m in re.finditer(r"\[(.+?)\]\(([^)]+\.md)\)", f.read()):
                _SUMMARY[m.group(2)] = m.group(1).replace("`", "")
    return _SUMMARY


def split_file(path):
    """Yield (n, heading or None, chapter_title, text) for each passage in one file.

    A passage is the text before the first `## ` heading, or one `## ` section
    (including its `###` subsections). Heading lines inside fenced code blocks
    (e.g. mdBook's hidden `# ` lines in Rust listings) are not headings.
    """
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    # HTML comments are editorial notes (regeneration hints, "old headings"):
    # drop them so they are neither headings nor passage text.
    raw = re.sub(r"<!--.*?-->", "", raw, flags=re.S)
    lines = raw.split("\n")
    chapter_title = None
    sections = [[None, []]]  # [heading, lines]
    fence = None
    for line in lines:
        stripped = line.lstrip()
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if m:
            token = m.group(1)
            if fence is None:
                fence = token
            elif token[0] == fence[0] and len(token) >= len(fence) and stripped.strip() == token:
                fence = None
            sections[-1][1].append(line)
            continue
        if fence is None and line.startswith("# ") and chapter_title is None:
            chapter_title = line[2:].strip()
            continue
        if fence is None and line.startswith("## "):
            sections.append([line[3:].strip(), []])
            continue
        sections[-1][1].append(line)
    own_title = chapter_title is not None
    if not own_title:
        # Sub-chapter files (e.g. ch03-01-*.md) have no `# ` line: their `## `
        # line is the page title. Use the parent chapter's `# ` title
        # (chNN-00-*.md / appendix-00.md), and the SUMMARY.md link text as the
        # heading of any text before the first `## `.
        chapter_title = parent_title(path)
    for n, (heading, body) in enumerate(sections):
        if heading is None and not own_title:
            heading = summary_titles().get(os.path.basename(path))
        text = "\n".join(body).strip()
        yield n, heading, chapter_title, text


def build_corpus():
    out = os.path.join(HERE, "corpus.jsonl")
    kept = dropped = 0
    with open(out, "w", encoding="utf-8") as f:
        for path in source_files():
            stem = os.path.splitext(os.path.basename(path))[0]
            for n, heading, ctitle, text in split_file(path):
                if len(text) < MIN_CHARS:
                    dropped += 1
                    continue
                title = ctitle if heading is None else ctitle + SEP + heading
                f.write(json.dumps({"_id": f"{stem}__{n}", "title": title, "text": text}, ensure_ascii=False) + "\n")
                kept += 1
    print(f"corpus.jsonl: {kept} passages ({dropped} dropped as < {MIN_CHARS} chars)")


def load_jsonl(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def build():
    # questions_first.jsonl: the 150 questions written before any labelling.
    # questions_added.jsonl: unanswerable questions added after labelling
    # (step 3 of the brief), on topics a keyword search showed the book lacks.
    questions = load_jsonl("questions_first.jsonl")
    if os.path.exists(os.path.join(HERE, "questions_added.jsonl")):
        questions += load_jsonl("questions_added.jsonl")
    labels = {l["_id"]: l for l in load_jsonl("labels.jsonl")}
    with open(os.path.join(HERE, "queries.jsonl"), "w", encoding="utf-8") as fq, \
         open(os.path.join(HERE, "answers.jsonl"), "w", encoding="utf-8") as fa, \
         open(os.path.join(HERE, "qrels", "test.tsv"), "w", encoding="utf-8") as fr:
        fr.write("query-id\tcorpus-id\tscore\n")
        for q in questions:
            lab = labels[q["_id"]]
            docs = lab.get("docs") or []
            answerable = bool(docs)
            fq.write(json.dumps({"_id": q["_id"], "text": q["text"],
                                 "metadata": {"answerable": answerable}}, ensure_ascii=False) + "\n")
            for d in docs:
                fr.write(f"{q['_id']}\t{d}\t1\n")
            fa.write(json.dumps({"query-id": q["_id"], "answerable": answerable,
                                 "gold_doc": docs[0] if docs else None,
                                 "answers": [lab["answer"]] if answerable else []},
                                ensure_ascii=False) + "\n")
    verify()


def verify():
    problems = []
    corpus = load_jsonl("corpus.jsonl")
    cids = [c["_id"] for c in corpus]
    if len(cids) != len(set(cids)):
        problems.append("duplicate corpus ids")
    text = {c["_id"]: c["text"] for c in corpus}
    queries = load_jsonl("queries.jsonl")
    qids = [q["_id"] for q in queries]
    if len(qids) != len(set(qids)):
        problems.append("duplicate query ids")
    qans = {q["_id"]: q["metadata"]["answerable"] for q in queries}
    with open(os.path.join(HERE, "qrels", "test.tsv"), encoding="utf-8") as f:
        rows = f.read().splitlines()
    if rows[0] != "query-id\tcorpus-id\tscore":
        problems.append("bad qrels header")
    qrels = {}
    for r in rows[1:]:
        qid, cid, score = r.split("\t")
        if cid not in text:
            problems.append(f"qrels {qid}: unknown corpus id {cid}")
        if qid not in qans:
            problems.append(f"qrels {qid}: unknown query id")
        if score != "1":
            problems.append(f"qrels {qid}: score {score}")
        if cid in qrels.setdefault(qid, []):
            problems.append(f"qrels {qid}: duplicate pair {cid}")
        qrels[qid].append(cid)
    for qid, docs in qrels.items():
        if len(docs) > 3:
            problems.append(f"{qid}: more than 3 relevant passages")
    answers = load_jsonl("answers.jsonl")
    if sorted(a["query-id"] for a in answers) != sorted(qids):
        problems.append("answers.jsonl ids differ from queries.jsonl")
    for a in answers:
        qid = a["query-id"]
        if a["answerable"] != qans.get(qid):
            problems.append(f"{qid}: answerable flag mismatch")
        if a["answerable"]:
            if qid not in qrels or a["gold_doc"] != qrels[qid][0]:
                problems.append(f"{qid}: gold_doc not first qrel")
            if not a["answers"]:
                problems.append(f"{qid}: no answer string")
            for s in a["answers"]:
                if s.lower() not in text.get(a["gold_doc"], "").lower():
                    problems.append(f"{qid}: answer {s!r} not in {a['gold_doc']}")
                if not (1 <= len(s.split()) <= 8):
                    problems.append(f"{qid}: answer {s!r} not 1-8 words")
        else:
            if qid in qrels or a["gold_doc"] is not None or a["answers"]:
                problems.append(f"{qid}: unanswerable but has labels")
    n_ans = sum(1 for v in qans.values() if v)
    print(f"passages={len(cids)} queries={len(qids)} answerable={n_ans} unanswerable={len(qids) - n_ans}")
    for p in problems:
        print("PROBLEM:", p)
    if not problems:
        print("verify: OK")
    return not problems


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "corpus"
    {"corpus": build_corpus, "build": build, "verify": verify}[cmd]()
