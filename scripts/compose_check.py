#!/usr/bin/env python3
"""The checks scripts/compose-test.sh runs against the demo stack, through its published
port, as a user would (standard library only):

    python3 scripts/compose_check.py URL KEY ask        # a question over the demo corpus,
                                                        # JSON and streamed, citations resolved
    python3 scripts/compose_check.py URL KEY upload     # POST /v1/documents, wait for the job,
                                                        # then a question only it answers
    python3 scripts/compose_check.py URL KEY count      # prints the number of documents
    python3 scripts/compose_check.py URL KEY kept N     # N documents, the upload still answered
    python3 scripts/compose_check.py URL KEY wait       # until /readyz says ready

Prints one `ok:` line per check; exits 1 with `FAIL:` on the first one that does not hold.
"""
import json
import sys
import time
import urllib.error
import urllib.request
import uuid

# A fact no demo document holds, uploaded and then asked about.
UPLOAD_NAME = "compose-test-note.md"
UPLOAD_TEXT = (
    "# The compose test note\n\n"
    "The docent compose test keeps its marker word in this note: the marker word is "
    "quillfeather-7391. Nothing else in the demo corpus mentions it.\n"
)
UPLOAD_QUESTION = "What is the marker word of the docent compose test?"
UPLOAD_ANSWER = "quillfeather-7391"


def fail(message):
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def request(url, key, method="GET", body=None, content_type=None, timeout=600):
    headers = {"authorization": f"Bearer {key}"}
    if content_type:
        headers["content-type"] = content_type
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url, key):
    status, body = request(url, key)
    if status != 200:
        fail(f"GET {url}: {status} {body[:300]!r}")
    return json.loads(body)


def query(base, key, question, stream=False):
    body = json.dumps({"question": question, "stream": stream}).encode()
    status, raw = request(f"{base}/v1/query", key, "POST", body, "application/json")
    if status != 200:
        fail(f"POST /v1/query: {status} {raw[:300]!r}")
    return raw


def documents(base, key):
    out, after = [], None
    while True:
        url = f"{base}/v1/documents?limit=1000" + (f"&after={after}" if after else "")
        page = get_json(url, key)
        out += page["documents"]
        after = page.get("next")
        if not after:
            return out


def check_citations(base, key, answer, corpus_hint):
    cites = answer.get("citations") or []
    if answer.get("refused") or not cites:
        fail(f"no cited answer: {json.dumps(answer)[:400]}")
    for c in cites:
        doc = get_json(f"{base}/v1/documents/{c['document_id']}", key)
        if c["source"] not in doc["sources"]:
            fail(f"citation [{c['n']}] {c['source']} is not a source of {doc['id']}")
        if not (0 <= c["chunk_index"] < doc["chunks"]):
            fail(f"citation [{c['n']}] chunk {c['chunk_index']} of {doc['chunks']}")
        if corpus_hint and not c["source"].endswith(".md"):
            fail(f"citation [{c['n']}] {c['source']} is not a Rust Book chapter")
    print(f"ok: {len(cites)} citation(s) resolve to stored chunks: "
          + ", ".join(f"{c['source']}#{c['chunk_index']}" for c in cites), flush=True)


def ask(base, key):
    question = "How do I create a new Cargo project?"
    t = time.time()
    answer = json.loads(query(base, key, question))
    print(f"ok: answered in {time.time() - t:.1f} s ({answer['mode']}): "
          f"{answer['answer'][:160]!r}", flush=True)
    if "cargo new" not in answer["answer"].lower():
        fail(f"the answer does not say `cargo new`: {answer['answer']!r}")
    check_citations(base, key, answer, corpus_hint=True)
    raw = query(base, key, "What does the borrow checker prevent?", stream=True).decode()
    events = []  # (event, data)
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = block.splitlines()
        name = next((l[len("event: "):] for l in lines if l.startswith("event: ")), None)
        data = "\n".join(l[len("data: "):] for l in lines if l.startswith("data: "))
        if name:
            events.append((name, json.loads(data) if data else None))
    names = [e[0] for e in events]
    if not names or names[0] != "retrieval" or names[-1] != "done" or "delta" not in names:
        fail(f"streamed events: {names[:20]} (want retrieval, deltas, done)")
    text = "".join(d["text"] for n, d in events if n == "delta")
    done = events[-1][1]
    if text != done["answer"] or not done.get("citations"):
        fail(f"streamed deltas {text!r} against the final answer {done['answer']!r}, "
             f"{len(done.get('citations') or [])} citation(s)")
    print(f"ok: streamed answer: {names.count('delta')} delta(s) that make the final answer, "
          f"{len(done['citations'])} citation(s), then done: {text[:100]!r}", flush=True)


def upload(base, key):
    boundary = uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
        f"filename=\"{UPLOAD_NAME}\"\r\nContent-Type: text/markdown\r\n\r\n"
        f"{UPLOAD_TEXT}\r\n--{boundary}--\r\n"
    ).encode()
    status, raw = request(f"{base}/v1/documents", key, "POST", body,
                          f"multipart/form-data; boundary={boundary}")
    if status != 202:
        fail(f"POST /v1/documents: {status} {raw[:300]!r}")
    job = json.loads(raw)["job_id"]
    for _ in range(600):
        state = get_json(f"{base}/v1/jobs/{job}", key)
        if state["status"] in ("done", "failed"):
            break
        time.sleep(0.5)
    if state["status"] != "done":
        fail(f"upload job: {state}")
    print(f"ok: uploaded {UPLOAD_NAME}: job {state['status']}", flush=True)
    answered(base, key)


def answered(base, key):
    answer = json.loads(query(base, key, UPLOAD_QUESTION))
    if UPLOAD_ANSWER not in answer["answer"]:
        fail(f"the upload's fact is not answered: {answer['answer']!r}")
    sources = [c["source"] for c in answer.get("citations") or []]
    if not any(s.endswith(UPLOAD_NAME) for s in sources):
        fail(f"the upload is not cited: {sources}")
    print(f"ok: the uploaded note answers and is cited: {answer['answer'][:120]!r}", flush=True)


def wait(base, key):
    for _ in range(600):
        try:
            status, _ = request(f"{base}/readyz", key, timeout=5)
            if status == 200:
                print("ok: ready", flush=True)
                return
        except OSError:
            pass
        time.sleep(1)
    fail("not ready after 10 minutes")


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    base, key, what = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3]
    if what == "ask":
        ask(base, key)
    elif what == "upload":
        upload(base, key)
    elif what == "count":
        print(len(documents(base, key)))
    elif what == "kept":
        want = int(sys.argv[4])
        have = len(documents(base, key))
        if have != want:
            fail(f"{have} documents, {want} before")
        print(f"ok: all {have} documents kept", flush=True)
        answered(base, key)
    elif what == "wait":
        wait(base, key)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
