#!/usr/bin/env python3
"""Build and verify the encyclo-factoid reading-comprehension / retrieval eval set.

All content lives in source.json next to this script (articles -> paragraphs ->
questions), written by hand.  This script only reformats it into the BEIR-style
files and checks them.  Standard library only.

    python3 make_set.py build    # write corpus.jsonl, queries.jsonl, qrels/test.tsv,
                                 # answers.jsonl, split.json, then verify
    python3 make_set.py verify   # check source.json and the files on disk
    python3 make_set.py split OUT  # OUT/dev and OUT/heldout: BEIR dirs, whole corpus

Ids:
  paragraph  <article_slug>_p001 .. _p003
  question   f0001 ..  numbered in source order: article by article, paragraph by
             paragraph, the paragraph's answerable questions first, then its
             unanswerable question (if any).
Split: the questions of the first N_DEV articles (source order) are "dev", the rest
"heldout".  Held-out questions must never be used to choose anything.
"""
import collections
import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "source.json")

N_ARTICLES = 30
PARAS_PER_ARTICLE = 3
QUESTIONS_PER_PARA = 3
N_DEV = 15                  # first 15 articles -> dev
MIN_WORDS, MAX_WORDS = 110, 200
MAX_ANSWER_WORDS = 6
MAX_ANSWERS = 3             # main span + up to 2 alternatives
MAX_PARAS_PER_AREA = 8
COPY_NGRAM = 6              # a question sharing a 6-word run with its paragraph is flagged

STOP = set("""a an the of in on at to for from by with and or but is was were are be been
being as that this these those which who whom whose what when where why how did does do
it its his her their he she they them there than then into onto over under after before
during about around than not no any some most more many much one two three first last
same other such only also has had have can could would should may might will""".split())


def load_source():
    with open(SOURCE, encoding="utf-8") as f:
        return json.load(f)


def para_id(slug, i):
    return f"{slug}_p{i + 1:03d}"


def generate(src):
    """Return (corpus, queries, answers, qrels, split) as Python objects."""
    corpus, queries, answers, qrels = [], [], [], []
    split = {"dev": [], "heldout": []}
    n = 0
    for ai, art in enumerate(src["articles"]):
        part = "dev" if ai < N_DEV else "heldout"
        for pi, para in enumerate(art["paragraphs"]):
            pid = para_id(art["slug"], pi)
            corpus.append({"_id": pid, "title": art["title"], "text": para["text"]})
            for q in para["questions"]:
                n += 1
                qid = f"f{n:04d}"
                queries.append({"_id": qid, "text": q["question"],
                                "metadata": {"answerable": True}})
                answers.append({"query-id": qid, "answerable": True, "gold_doc": pid,
                                "answers": list(q["answers"])})
                qrels.append((qid, pid, 1))
                split[part].append(qid)
            for u in para.get("unanswerable", []):
                n += 1
                qid = f"f{n:04d}"
                queries.append({"_id": qid, "text": u["question"],
                                "metadata": {"answerable": False}})
                answers.append({"query-id": qid, "answerable": False, "gold_doc": None,
                                "answers": []})
                split[part].append(qid)
    return corpus, queries, answers, qrels, split


def jsonl(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def render(src):
    corpus, queries, answers, qrels, split = generate(src)
    tsv = "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in qrels)
    return {
        "corpus.jsonl": jsonl(corpus),
        "queries.jsonl": jsonl(queries),
        "answers.jsonl": jsonl(answers),
        os.path.join("qrels", "test.tsv"): tsv,
        "split.json": json.dumps(split, indent=1) + "\n",
    }


def build():
    src = load_source()
    os.makedirs(os.path.join(HERE, "qrels"), exist_ok=True)
    for name, text in render(src).items():
        with open(os.path.join(HERE, name), "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        print(f"wrote {name}")
    return verify()


def read_jsonl(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def term_in(term, text_lower):
    """Whole-word, case-insensitive occurrence of term in an already lower-cased text."""
    return re.search(r"(?<!\w)" + re.escape(term.lower()) + r"(?!\w)", text_lower) is not None


def content_tokens(s):
    return [t for t in re.findall(r"[a-zà-öø-ÿ0-9]+", s.lower()) if t not in STOP]


def verify():
    errors, notes = [], []
    err = errors.append
    src = load_source()
    arts = src["articles"]

    # ---- source structure -------------------------------------------------
    if len(arts) != N_ARTICLES:
        err(f"expected {N_ARTICLES} articles, found {len(arts)}")
    slugs = [a["slug"] for a in arts]
    titles = [a["title"] for a in arts]
    for what, seq in (("slug", slugs), ("title", titles)):
        dup = [k for k, c in collections.Counter(seq).items() if c > 1]
        if dup:
            err(f"duplicate article {what}s: {dup}")
    area_paras = collections.Counter()
    texts = {}
    for a in arts:
        if not re.fullmatch(r"[a-z0-9_]+", a["slug"]):
            err(f"bad slug {a['slug']!r}")
        if len(a["paragraphs"]) != PARAS_PER_ARTICLE:
            err(f"{a['slug']}: {len(a['paragraphs'])} paragraphs")
        area_paras[a["area"]] += len(a["paragraphs"])
        for pi, p in enumerate(a["paragraphs"]):
            pid = para_id(a["slug"], pi)
            texts[pid] = p["text"]
            nw = len(p["text"].split())
            if not MIN_WORDS <= nw <= MAX_WORDS:
                err(f"{pid}: {nw} words (want {MIN_WORDS}-{MAX_WORDS})")
            if p["text"] != p["text"].strip() or "  " in p["text"] or "\n" in p["text"]:
                err(f"{pid}: stray whitespace in text")
            if len(p["questions"]) != QUESTIONS_PER_PARA:
                err(f"{pid}: {len(p['questions'])} answerable questions")
            if len(p.get("unanswerable", [])) > 1:
                err(f"{pid}: more than one unanswerable question")
            for q in p["questions"]:
                ans = q["answers"]
                if not 1 <= len(ans) <= MAX_ANSWERS:
                    err(f"{pid}: {len(ans)} answers for {q['question']!r}")
                if len(set(ans)) != len(ans):
                    err(f"{pid}: repeated answer string for {q['question']!r}")
                for s in ans:
                    if s not in p["text"]:
                        err(f"{pid}: answer {s!r} is not a substring of its paragraph")
                    if s != s.strip() or not s:
                        err(f"{pid}: answer {s!r} has stray whitespace")
                nmain = len(ans[0].split()) if ans else 0
                if not 1 <= nmain <= MAX_ANSWER_WORDS:
                    err(f"{pid}: main answer {ans[0]!r} has {nmain} words")
                for s in ans[1:]:
                    if len(s.split()) > MAX_ANSWER_WORDS:
                        err(f"{pid}: alternative answer {s!r} has more than {MAX_ANSWER_WORDS} words")
    for area, c in sorted(area_paras.items()):
        if c > MAX_PARAS_PER_AREA:
            err(f"area {area!r} has {c} paragraphs (> {MAX_PARAS_PER_AREA})")

    # ---- files on disk == generated --------------------------------------
    for name, text in render(src).items():
        path = os.path.join(HERE, name)
        if not os.path.exists(path):
            err(f"{name} missing (run: python3 make_set.py build)")
            continue
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                err(f"{name} differs from what source.json generates (run build)")

    # ---- consistency of the files themselves -------------------------------
    corpus = read_jsonl("corpus.jsonl")
    queries = read_jsonl("queries.jsonl")
    answers = read_jsonl("answers.jsonl")
    with open(os.path.join(HERE, "qrels", "test.tsv"), encoding="utf-8") as f:
        qlines = f.read().splitlines()
    with open(os.path.join(HERE, "split.json"), encoding="utf-8") as f:
        split = json.load(f)

    cids = [d["_id"] for d in corpus]
    qids = [q["_id"] for q in queries]
    for what, seq in (("corpus", cids), ("query", qids), ("answers query-id", [a["query-id"] for a in answers])):
        dup = [k for k, c in collections.Counter(seq).items() if c > 1]
        if dup:
            err(f"duplicate {what} ids: {dup[:5]}")
    dupq = [k for k, c in collections.Counter(q["text"].strip().lower() for q in queries).items() if c > 1]
    if dupq:
        err(f"duplicate question texts: {dupq[:5]}")
    for q in queries:
        if not q["text"].endswith("?"):
            err(f"{q['_id']}: question does not end with '?'")
        if set(q) != {"_id", "text", "metadata"} or set(q["metadata"]) != {"answerable"}:
            err(f"{q['_id']}: unexpected query keys")
    for d in corpus:
        if set(d) != {"_id", "title", "text"}:
            err(f"{d['_id']}: unexpected corpus keys")
    cset, qmap = set(cids), {q["_id"]: q for q in queries}
    amap = {a["query-id"]: a for a in answers}
    if set(amap) != set(qmap):
        err("answers.jsonl and queries.jsonl cover different query ids")
    doc_text = {d["_id"]: d["text"] for d in corpus}

    if not qlines or qlines[0] != "query-id\tcorpus-id\tscore":
        err("qrels/test.tsv: bad header")
    qrel_rows = {}
    for ln in qlines[1:]:
        parts = ln.split("\t")
        if len(parts) != 3 or parts[2] != "1":
            err(f"qrels: bad row {ln!r}")
            continue
        q, d, _ = parts
        if q in qrel_rows:
            err(f"qrels: more than one row for {q}")
        qrel_rows[q] = d
        if d not in cset:
            err(f"qrels: unknown corpus id {d}")
        if q not in qmap:
            err(f"qrels: unknown query id {q}")
    for qid, q in qmap.items():
        a = amap.get(qid)
        if a is None:
            continue
        if a["answerable"] != q["metadata"]["answerable"]:
            err(f"{qid}: answerable flag differs between queries and answers")
        if a["answerable"]:
            if qrel_rows.get(qid) != a["gold_doc"]:
                err(f"{qid}: qrels row {qrel_rows.get(qid)} != gold_doc {a['gold_doc']}")
            if a["gold_doc"] not in doc_text:
                err(f"{qid}: gold_doc {a['gold_doc']} not in corpus")
            elif not a["answers"]:
                err(f"{qid}: answerable but no answers")
            for s in a["answers"]:
                if s not in doc_text.get(a["gold_doc"], ""):
                    err(f"{qid}: answer {s!r} not a substring of {a['gold_doc']}")
        else:
            if qid in qrel_rows:
                err(f"{qid}: unanswerable but has a qrels row")
            if a["gold_doc"] is not None or a["answers"]:
                err(f"{qid}: unanswerable but has gold_doc/answers")

    # split: a partition, by article, first N_DEV articles = dev
    dev, held = split.get("dev", []), split.get("heldout", [])
    if set(split) != {"dev", "heldout"}:
        err("split.json: keys must be dev and heldout")
    if set(dev) & set(held):
        err("split.json: dev and heldout overlap")
    if set(dev) | set(held) != set(qids) or len(dev) + len(held) != len(qids):
        err("split.json: does not cover every query exactly once")
    dev_slugs = set(slugs[:N_DEV])
    # article of every question (unanswerable ones too), from source order
    n = 0
    q2art = {}
    for a in arts:
        for p in a["paragraphs"]:
            for _ in p["questions"] + p.get("unanswerable", []):
                n += 1
                q2art[f"f{n:04d}"] = a["slug"]
    for qid in dev:
        if q2art.get(qid) not in dev_slugs:
            err(f"split: dev question {qid} belongs to held-out article {q2art.get(qid)}")
    for qid in held:
        if q2art.get(qid) in dev_slugs:
            err(f"split: held-out question {qid} belongs to dev article {q2art.get(qid)}")

    # ---- unanswerable questions: keyword sanity check ----------------------
    print("== unanswerable questions: keyword check (review by eye) ==")
    low = {pid: t.lower() for pid, t in texts.items()}
    n = 0
    for a in arts:
        for pi, p in enumerate(a["paragraphs"]):
            n += len(p["questions"])
            for u in p.get("unanswerable", []):
                n += 1
                qid = f"f{n:04d}"
                pid = para_id(a["slug"], pi)
                print(f"{qid} [{pid}] {u['question']}")
                if not u.get("absent_terms"):
                    err(f"{qid}: no absent_terms recorded")
                for t in u.get("absent_terms", []):
                    hits = [d for d, s in low.items() if term_in(t, s)]
                    print(f"    absent {t!r}: {'NOT FOUND (ok)' if not hits else 'FOUND in ' + ', '.join(hits)}")
                    if hits:
                        err(f"{qid}: expected-answer term {t!r} occurs in {hits}")
                topic = u.get("topic_terms", [])
                for t in topic:
                    hits = [d for d, s in low.items() if t.lower() in s]
                    shown = ", ".join(hits[:8]) + (f" (+{len(hits) - 8})" if len(hits) > 8 else "")
                    print(f"    topic  {t!r}: {len(hits)} paragraph(s){': ' + shown if hits else ''}")
                if topic:
                    allhit = [d for d, s in low.items() if all(t.lower() in s for t in topic)]
                    print(f"    all topic terms together in: {', '.join(allhit) if allhit else 'none'}")

    # ---- informational: answers found in other paragraphs; copied wording --
    print("== answers that also occur in another paragraph (check the question is specific) ==")
    n_other = 0
    for a in answers:
        if not a["answerable"]:
            continue
        main = a["answers"][0]
        if len(main) < 4:
            continue
        others = [d for d, t in doc_text.items() if d != a["gold_doc"] and main in t]
        if others:
            n_other += 1
            print(f"  {a['query-id']} {main!r} gold {a['gold_doc']}; also in {', '.join(others)}")
    print(f"  ({n_other} answerable questions)")
    print(f"== questions sharing a {COPY_NGRAM}-word run with their paragraph (copy-paste check) ==")
    n_copy = 0
    for a in answers:
        if not a["answerable"]:
            continue
        qt = re.findall(r"\w+", qmap[a["query-id"]]["text"].lower())
        pt = " " + " ".join(re.findall(r"\w+", doc_text[a["gold_doc"]].lower())) + " "
        runs = [" ".join(qt[i:i + COPY_NGRAM]) for i in range(len(qt) - COPY_NGRAM + 1)]
        hit = [r for r in runs if f" {r} " in pt]
        if hit:
            n_copy += 1
            print(f"  {a['query-id']}: {hit[0]!r}")
    print(f"  ({n_copy} questions)")
    overlap = []
    for a in answers:
        if a["answerable"]:
            qt = set(content_tokens(qmap[a["query-id"]]["text"]))
            pt = set(content_tokens(doc_text[a["gold_doc"]]))
            if qt:
                overlap.append(len(qt & pt) / len(qt))
    if overlap:
        print(f"== mean share of a question's content words found in its paragraph: "
              f"{sum(overlap) / len(overlap):.2f} ==")

    # ---- counts ----------------------------------------------------------
    n_ans = sum(1 for a in answers if a["answerable"])
    n_un = len(answers) - n_ans
    dev_set = set(dev)
    dev_ans = sum(1 for a in answers if a["answerable"] and a["query-id"] in dev_set)
    dev_un = sum(1 for a in answers if not a["answerable"] and a["query-id"] in dev_set)
    alts = sum(len(a["answers"]) - 1 for a in answers if a["answerable"])
    wc = [len(t.split()) for t in doc_text.values()]
    print("== counts ==")
    print(f"  articles {len(arts)}, paragraphs {len(corpus)} "
          f"(words per paragraph: min {min(wc)}, mean {sum(wc) / len(wc):.0f}, max {max(wc)})")
    print(f"  questions {len(queries)}: answerable {n_ans}, unanswerable {n_un}; "
          f"alternative answer spans {alts}")
    print(f"  dev {len(dev)} ({dev_ans} answerable, {dev_un} unanswerable; articles 1-{N_DEV}); "
          f"heldout {len(held)} ({n_ans - dev_ans} answerable, {n_un - dev_un} unanswerable)")
    print("  paragraphs per area: " + ", ".join(f"{k} {v}" for k, v in sorted(area_paras.items())))
    wh = collections.Counter()
    for q in queries:
        if q["metadata"]["answerable"]:
            first = q["text"].split()[0].lower()
            key = "how many/much" if q["text"].lower().startswith(("how many", "how much")) else first
            wh[key] += 1
    print("  answerable questions by first word: " + ", ".join(f"{k} {v}" for k, v in wh.most_common()))

    if errors:
        print(f"== {len(errors)} PROBLEM(S) ==")
        for e in errors:
            print("  " + e)
        return 1
    print("== OK: no problems ==")
    return 0


def split(out):
    """Write `out/dev` and `out/heldout`: BEIR directories with the whole
    corpus and only that part's queries, answers and qrels."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = json.load(open(os.path.join(here, "split.json")))
    for part, qids in parts.items():
        qids = set(qids)
        d = os.path.join(out, part)
        os.makedirs(os.path.join(d, "qrels"), exist_ok=True)
        shutil.copyfile(os.path.join(here, "corpus.jsonl"), os.path.join(d, "corpus.jsonl"))
        for name, key in (("queries.jsonl", "_id"), ("answers.jsonl", "query-id")):
            with open(os.path.join(here, name)) as src, open(os.path.join(d, name), "w") as dst:
                for line in src:
                    if json.loads(line)[key] in qids:
                        dst.write(line)
        lines = open(os.path.join(here, "qrels", "test.tsv")).read().splitlines()
        with open(os.path.join(d, "qrels", "test.tsv"), "w") as dst:
            dst.write(lines[0] + "\n")
            for line in lines[1:]:
                if line.split("\t")[0] in qids:
                    dst.write(line + "\n")
        print(f"{part}: {len(qids)} questions in {d}")
    return 0


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "verify"
    if cmd == "build":
        sys.exit(build())
    if cmd == "verify":
        sys.exit(verify())
    if cmd == "split" and len(sys.argv) == 3:
        sys.exit(split(sys.argv[2]))
    sys.exit(__doc__)
