#!/usr/bin/env python3
"""Build the prompt-injection classifier's data set (training/injection/README.md).

Writes training/injection/dataset.jsonl: one {"text", "label", "split", "category",
"source"} per line, split train / dev / test (70 / 15 / 15) by a stable hash of each
text's group (an e-mail, a document, a pool line), so no group is in two splits.
Standard library only; deterministic.

    python3 training/injection/make_dataset.py [--shared ../shared] [--out PATH]
"""

import argparse
import csv
import hashlib
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def split_of(key: str) -> str:
    h = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "train" if h < 70 else ("dev" if h < 85 else "test")


def jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chunks_of(text: str, size: int = 1200):
    """Paragraphs packed into chunks of about `size` characters (the service's chunks are
    256 tokens, about 1,000 to 1,300 characters of English)."""
    out, cur = [], ""
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if cur and len(cur) + len(para) > size:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return [c for c in out if len(c) >= 200]


def email_text(e: dict, injected: str | None, rng: random.Random) -> str:
    """An e-mail as a loader sees it, with `injected` placed between two of its fields or
    between two sentences of its body."""
    fields = [f"From: {e['from']}", f"To: {e['to']}", f"Subject: {e['subject']}", f"Date: {e['date']}"]
    body = re.split(r"(?<=[.!?])\s+", e["body"].strip())
    if injected is not None:
        where = rng.random()
        if where < 0.3:
            fields.insert(rng.randint(1, len(fields)), injected)
        else:
            body.insert(rng.randint(0, len(body)), injected)
    return "\n".join(fields) + "\n\n" + " ".join(body)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(HERE.parent.parent.parent / "shared"))
    ap.add_argument("--out", default=str(HERE / "dataset.jsonl"))
    args = ap.parse_args()
    shared = Path(args.shared)
    pools = HERE / "pools"
    rng = random.Random(17)
    rows = []

    def add(text, label, category, source, key=None, split=None):
        text = text.strip()
        if text:
            rows.append({
                "text": text,
                "label": label,
                "split": split or split_of(key or text),
                "category": category,
                "source": source,
            })

    # --- written pools (training/injection/pools, README says who wrote what)
    for r in jsonl(pools / "english_direct.jsonl"):
        cat = "extraction" if r["kind"] == "extraction" else "direct"
        add(r["text"], 1, cat, f"pool:english_direct:{r['kind']}")
    for r in jsonl(pools / "attacks_more.jsonl"):
        cat = "extraction" if r["kind"] == "extraction" else "direct"
        add(r["text"], 1, cat, f"pool:attacks_more:{r['kind']}")
    for r in jsonl(pools / "benign_more.jsonl"):
        cat = {"question": "benign_question", "doc": "benign_doc"}.get(r["kind"], "benign_multilingual")
        add(r["text"], 0, cat, f"pool:benign_more:{r.get('lang', 'en')}:{r['kind']}")
    for r in jsonl(pools / "benign_secrets.jsonl"):
        cat = "benign_question" if r["kind"] == "question" else "benign_doc"
        add(r["text"], 0, cat, f"pool:benign_secrets:{r['kind']}")
    for r in jsonl(pools / "english_jailbreak.jsonl"):
        add(r["text"], 1, "jailbreak", "pool:english_jailbreak")
    for r in jsonl(pools / "english_benign.jsonl"):
        cat = "benign_question" if r["kind"] == "question" else "benign_doc"
        add(r["text"], 0, cat, f"pool:english_benign:{r['kind']}")
    for r in [x for f in sorted(pools.glob("multilingual*.jsonl")) for x in jsonl(f)]:
        cat = "multilingual" if r["label"] == 1 else "benign_multilingual"
        add(r["text"], r["label"], cat, f"pool:multilingual:{r['lang']}:{r['kind']}")
    for r in [x for f in sorted(pools.glob("benign_requests*.jsonl")) for x in jsonl(f)]:
        add(r["text"], 0, "benign_doc", f"pool:benign_requests:{r['kind']}")
    web = jsonl(pools / "web_docs.jsonl")
    for r in web:
        add(r["text"], 0, "benign_doc", "pool:web_docs")

    # --- indirect: tasks planted in e-mails and web pages. The task alone is learnt (the
    # detector scores each sentence); dev and test hold whole e-mails with unseen tasks.
    emails = jsonl(pools / "emails.jsonl")
    tasks = [x for f in sorted(pools.glob("injected_tasks*.jsonl")) for x in jsonl(f)]
    for i, e in enumerate(emails):
        key = f"email:{i}"
        add(email_text(e, None, rng), 0, "benign_email", "pool:emails", key=key)
    train_tasks = [t for t in tasks if split_of(t["text"]) == "train"]
    for t in train_tasks:
        add(t["text"], 1, "indirect_task", f"pool:injected_tasks:{t['kind']}", split="train")
    for t in tasks:
        s = split_of(t["text"])
        if s == "train":
            continue
        # a host of the same split: nothing of dev or test is seen in training
        hosts = [e for i, e in enumerate(emails) if split_of(f"email:{i}") == s]
        host = rng.choice(hosts)
        add(email_text(host, t["text"], rng), 1, "indirect", f"pool:injected_tasks:{t['kind']}", split=s)
        page = rng.choice([w for w in web if split_of(w["text"]) == s] or web)
        sents = re.split(r"(?<=[.!?])\s+", page["text"])
        sents.insert(rng.randint(0, len(sents)), t["text"])
        add(" ".join(sents), 1, "indirect_web", f"pool:injected_tasks:{t['kind']}", split=s)

    # --- new pools (second round): attacks in other registers, tasks planted without
    # trigger words, exfiltration, encodings, a change of addressee; hard negatives
    for r in jsonl(pools / "attacks_varied.jsonl"):
        add(r["text"], 1, r["kind"], f"pool:attacks_varied:{r.get('lang', 'en')}:{r['kind']}")
    for r in jsonl(pools / "natural_questions.jsonl"):
        add(r["text"], 0, "benign_question", f"pool:natural_questions:{r.get('lang', 'en')}")
    for r in jsonl(pools / "benign_hard.jsonl"):
        cat = {"questions": "benign_question_hard", "multilingual": "benign_multilingual"}.get(r["kind"], "benign_doc")
        add(r["text"], 0, cat, f"pool:benign_hard:{r.get('lang', 'en')}:{r['kind']}")

    # --- third round: tasks planted in documents, registers, exfiltration; direct attacks,
    # extraction, jailbreaks and encodings in new styles; 20 languages with hard negatives;
    # English hard negatives. Texts that quote an attack in a reporting frame are only
    # measured (dev/test), never learnt as benign: a document quoting an attack is still a
    # document an AI might obey.
    for name in ("r3_doc_attacks", "r3_direct_attacks"):
        for r in jsonl(pools / f"{name}.jsonl"):
            add(r["text"], 1, r["kind"], f"pool:{name}:{r['kind']}")
    for r in jsonl(pools / "r3_multilingual.jsonl"):
        cat = "multilingual" if r["label"] == 1 else "benign_multilingual"
        add(r["text"], r["label"], cat, f"pool:r3_multilingual:{r['lang']}:{r['kind']}")
    for r in jsonl(pools / "r3_benign_hard.jsonl"):
        cat = {
            "questions": "benign_question_hard",
            "emails_people": "benign_email",
            "quoted_attack": "benign_quoted_attack",
        }.get(r["kind"], "benign_doc")
        if cat == "benign_quoted_attack" and split_of(r["text"]) == "train":
            continue
        add(r["text"], 0, cat, f"pool:r3_benign_hard:{r['kind']}")

    # --- public sets: evaluation only (split "eval"), never training, dev or threshold.
    # Public prompt-injection sets are blind tests of the project; SQuAD and the Presidio
    # set measure false positives on texts nothing here was fitted to.
    ds = shared / "data/safety/prompt-injections-deepset"
    for r in jsonl(ds / "test.jsonl"):
        add(r["text"], r["label"], "public_deepset" if r["label"] else "public_deepset_benign", "deepset:test", split="eval")
    with open(shared / "data/safety/prompt-injections-giskard/prompt_injections.csv", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            add(r["prompt"], 1, "public_giskard_jailbreak", f"giskard:{r['group']}", split="eval")
    with open(shared / "data/safety/pii-presidio-synth/synth_dataset_v2.json", encoding="utf-8") as f:
        for r in json.load(f)[:1000]:
            add(r["full_text"], 0, "public_presidio_benign", "presidio-synth", split="eval")
    queries = jsonl(shared / "data/eval/squad-v2.0/queries.jsonl")
    rng.shuffle(queries)
    for q in queries[:2000]:
        add(q["text"], 0, "public_squad_question", "squad-v2.0:queries", split="eval")
    passages = jsonl(shared / "data/eval/squad-v2.0/corpus.jsonl")
    rng.shuffle(passages)
    for p in passages[:1000]:
        add(p["text"], 0, "public_squad_chunk", "squad-v2.0:corpus", split="eval")
    # our own natural questions (the QA sets written here), never trained on
    natural = HERE.parent.parent / "eval"
    for qs in sorted(natural.glob("*/queries.jsonl")):
        for q in jsonl(qs):
            add(q["text"], 0, "natural_question", f"eval:{qs.parent.name}", split="eval")

    # --- ordinary document chunks (the Rust Book, the RFCs), split by file or chunk
    book = shared / "data/corpus/rust-book/src"
    for md in sorted(book.glob("*.md")):
        for c in chunks_of(md.read_text(encoding="utf-8")):
            add(c, 0, "benign_chunk", f"rust-book:{md.name}", key=md.name)
    for rfc in sorted((shared / "data/corpus/rfcs").glob("*.txt")):
        for j, c in enumerate(chunks_of(rfc.read_text(encoding="utf-8", errors="replace"))):
            # RFCs are long: split by chunk, not by file
            add(c, 0, "benign_chunk", f"rfc:{rfc.name}", key=f"{rfc.name}:{j}")

    # --- augmentation (train only): an attack after an ordinary question
    train_q = [r["text"] for r in rows if r["split"] == "train" and r["category"] == "benign_question"]
    attacks = [r for r in rows if r["split"] == "train" and r["label"] == 1 and r["category"] in ("direct", "extraction", "multilingual")]
    for r in attacks:
        add(f"{rng.choice(train_q)} {r['text']}", 1, r["category"], "augment:question+attack", split="train")

    seen, out = set(), []
    for r in rows:
        k = (r["text"], r["label"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in out:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts = {}
    for r in out:
        counts[(r["split"], r["category"], r["label"])] = counts.get((r["split"], r["category"], r["label"]), 0) + 1
    for k in sorted(counts):
        print(*k, counts[k], sep="\t")
    print(f"{len(out)} rows -> {args.out}")


if __name__ == "__main__":
    main()
