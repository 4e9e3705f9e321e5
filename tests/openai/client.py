"""docent's OpenAI-compatible API through the official `openai` Python client.

Usage: python tests/openai/client.py BASE_URL [API_KEY]

BASE_URL is the server's address (http://127.0.0.1:PORT); the client talks to BASE_URL/v1.
The server must hold the Rust Book's ownership chapter, answer greedily by default and keep
no answer cache (so that a streamed and a non-streamed answer are both generated). Run by
tests/integration/openai.rs with the interpreter of scripts/openai-venv.sh. Exits non-zero
(an AssertionError or the client's exception) when a check fails.
"""

import sys

import openai

QUESTION = "What are the rules of ownership in Rust?"
SYSTEM = "You are a helpful assistant."  # ignored by docent; sent as most clients do


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def expect_error(kind, call, status, code=None, param=None):
    """`call` must raise the client's typed exception `kind` with OpenAI's error body."""
    try:
        call()
    except kind as e:
        check(e.status_code == status, f"{kind.__name__}: status {e.status_code}, wanted {status}")
        body = e.body
        check(isinstance(body, dict), f"{kind.__name__}: body {body!r}")
        check(set(body) == {"message", "type", "param", "code"}, f"error keys: {sorted(body)}")
        check(isinstance(body["message"], str) and body["message"], "error message")
        if code is not None:
            check(body["code"] == code, f"error code {body['code']!r}, wanted {code!r}")
        if param is not None:
            check(body["param"] == param, f"error param {body['param']!r}, wanted {param!r}")
        print(f"ok: {kind.__name__} {status} {body['type']} {body['code']} {body['param']}: {body['message']}")
        return e
    raise AssertionError(f"no {kind.__name__} raised")


def main():
    base_url = sys.argv[1].rstrip("/") + "/v1"
    key = sys.argv[2] if len(sys.argv) > 2 else "unused"
    print(f"openai {openai.__version__} against {base_url}")
    # no retries: a 429 or 5xx must show, not be retried away
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)

    # models: the one served model, by id; an unknown one is a NotFoundError
    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1, f"one served model, got {ids}")
    model = ids[0]
    check(models.data[0].object == "model" and models.data[0].owned_by == "docent", str(models.data[0]))
    check(client.models.retrieve(model).id == model, "retrieve the served model")
    check(client.models.retrieve("docent").id == model, "the alias names the served model")
    expect_error(openai.NotFoundError, lambda: client.models.retrieve("gpt-4o"), 404, "model_not_found")
    print(f"ok: models {ids}")

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    common = dict(
        messages=messages,
        temperature=0,
        max_completion_tokens=96,
        extra_body={"docent": {"retrieval": {"top_k": 2}}},
    )

    # one completion
    resp = client.chat.completions.create(model=model, **common)
    check(resp.object == "chat.completion", resp.object)
    check(resp.id.startswith("chatcmpl-"), resp.id)
    check(resp.model == model, resp.model)
    check(len(resp.choices) == 1, f"{len(resp.choices)} choices")
    choice = resp.choices[0]
    check(choice.message.role == "assistant", choice.message.role)
    answer = choice.message.content
    check(answer and answer.strip(), f"empty answer: {answer!r}")
    check(choice.finish_reason in ("stop", "length"), choice.finish_reason)
    u = resp.usage
    check(u.prompt_tokens > 0 and u.completion_tokens > 0, str(u))
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens, str(u))
    if choice.finish_reason == "length":
        check(u.completion_tokens == 96, f"length with {u.completion_tokens} tokens")
    citations = resp.model_extra.get("citations")
    check(isinstance(citations, list) and citations, f"citations: {citations!r}")
    for c in citations:
        check(c["source"].endswith("ch04-01-what-is-ownership.md"), c["source"])
        check(c["span"]["start"] < c["span"]["end"] and c["quote"], str(c))
        check(f"[{c['n']}]" in answer, f"citation {c['n']} not marked in {answer!r}")
    check(resp.to_dict()["citations"] == citations, "to_dict keeps the citations")
    print(f"ok: completion ({choice.finish_reason}, {u.completion_tokens} tokens, {len(citations)} citations): {answer!r}")

    # the same request streamed, by the alias, with the usage chunk
    chunks = list(
        client.chat.completions.create(
            model="docent", stream=True, stream_options={"include_usage": True}, **common
        )
    )
    check(len(chunks) >= 4, f"{len(chunks)} chunks")
    check(len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-"), "one id")
    check(all(c.object == "chat.completion.chunk" and c.model == model for c in chunks), "chunk objects")
    check(chunks[0].choices[0].delta.role == "assistant", "the first chunk has the role")
    with_choices = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    check(finishes == [choice.finish_reason], f"finish reasons {finishes}")
    check(with_choices[-1].choices[0].finish_reason == choice.finish_reason, "finish_reason last")
    texts = [c.choices[0].delta.content for c in with_choices if c.choices[0].delta.content]
    streamed = "".join(texts)
    check(streamed == answer, f"streamed {streamed!r} != {answer!r}")
    check(with_choices[-1].model_extra.get("citations") == citations, "streamed citations")
    tail = chunks[-1]
    check(tail.choices == [] and tail.usage is not None, f"usage chunk: {tail}")
    check(tail.usage.to_dict() == u.to_dict(), f"streamed usage {tail.usage} != {u}")
    check(all(c.usage is None for c in chunks[:-1]), "usage is null before the last chunk")
    print(f"ok: stream of {len(chunks)} chunks, {len(texts)} with text, equal to the completion")

    # a conversation: earlier turns are history, content as text parts
    follow = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": "What happens when the owner goes out of scope?"}]},
        ],
        temperature=0,
        max_tokens=32,
    )
    check(follow.choices[0].message.content.strip(), "follow-up answered")
    print(f"ok: follow-up: {follow.choices[0].message.content!r}")

    # refusals, as the client's typed exceptions with OpenAI's error body
    def ask(**kw):
        return client.chat.completions.create(**{"model": model, "messages": messages, **kw})

    expect_error(openai.NotFoundError, lambda: ask(model="gpt-4o"), 404, "model_not_found", "model")
    expect_error(
        openai.BadRequestError,
        lambda: ask(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
        400,
        "invalid_value",
        "messages[1].role",
    )
    expect_error(openai.BadRequestError, lambda: ask(n=2), 400, "unsupported_value", "n")
    expect_error(openai.BadRequestError, lambda: ask(seed=7), 400, "invalid_value", "seed")
    expect_error(openai.BadRequestError, lambda: ask(temperature=3), 400, "invalid_value", "temperature")
    expect_error(
        openai.BadRequestError,
        lambda: ask(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        400,
        "unsupported_value",
        "tools",
    )
    expect_error(openai.BadRequestError, lambda: ask(extra_body={"frobnicate": 1}), 400, "unknown_parameter", "frobnicate")
    if len(sys.argv) > 2:
        wrong = openai.OpenAI(base_url=base_url, api_key="not-a-valid-key-0123456789", max_retries=0)
        expect_error(openai.AuthenticationError, lambda: wrong.models.list(), 401, "invalid_api_key")
        expect_error(openai.AuthenticationError, lambda: wrong.chat.completions.create(model=model, messages=messages), 401, "invalid_api_key")
    print("all OpenAI client checks passed")


if __name__ == "__main__":
    main()
