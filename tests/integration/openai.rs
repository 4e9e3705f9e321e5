//! The OpenAI-compatible API (`POST /v1/chat/completions`, `GET /v1/models`) on the real
//! server and model: through the official `openai` Python client from PyPI
//! (tests/openai/client.py, in the venv of scripts/openai-venv.sh), and its raw shapes with
//! reqwest: the completion against `/v1/query`'s answer, the `data: [DONE]` stream, and
//! OpenAI's error shape for every kind of refusal on these paths.

use std::process::Command;
use std::sync::OnceLock;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE};
use serde_json::{json, Value};

use crate::helpers::{client, get_json, get_json_as, models, own_server, repo, OWNERSHIP};
use docent::config::{hash_key, ApiKey, Scope};

const KEY: &str = "openai-compatible-test-key-0123";
const QUESTION: &str = "What are the rules of ownership in Rust?";

fn key() -> Vec<ApiKey> {
    vec![ApiKey {
        name: "openai".into(),
        scope: Scope::Read,
        hash: hash_key(KEY),
    }]
}

/// A server with a key over the ownership chapter, without the answer cache (so a streamed
/// and a JSON answer to the same request are both generated).
fn server() -> &'static str {
    static S: OnceLock<(crate::helpers::OwnServer, String)> = OnceLock::new();
    &S.get_or_init(|| {
        own_server(|c| {
            c.auth.keys = key();
            c.auth.rate_per_minute = 100_000;
            c.auth.burst = 10_000;
            c.generation.cache_size = 0;
        })
    })
    .1
}

#[test]
fn the_openai_python_client_lists_answers_streams_and_gets_typed_errors() {
    let address = server();
    let venv = Command::new("bash")
        .arg(repo().join("scripts/openai-venv.sh"))
        .status()
        .expect("run scripts/openai-venv.sh");
    assert!(
        venv.success(),
        "scripts/openai-venv.sh failed (it installs the openai client from PyPI)"
    );
    let out = Command::new(models().join(".venv-openai/bin/python"))
        .arg(repo().join("tests/openai/client.py"))
        .arg(address)
        .arg(KEY)
        .output()
        .expect("run tests/openai/client.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the openai client's checks failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("all OpenAI client checks passed"),
        "{stdout}"
    );
}

async fn post(path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", server()))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn chat(max_tokens: usize) -> Value {
    json!({
        "model": "docent",
        "messages": [
            {"role": "system", "content": "Answer like a pirate."},
            {"role": "user", "content": QUESTION}
        ],
        "temperature": 0,
        "max_tokens": max_tokens,
        "docent": {"retrieval": {"top_k": 2}}
    })
}

/// The same request through `/v1/query` and `/v1/chat/completions`: the same answer, the same
/// citations and token counts, in OpenAI's shape; `finish_reason` is `length` exactly when
/// the model used all of `max_tokens`.
#[tokio::test]
async fn a_completion_is_the_query_answer_in_openai_shape() {
    let models = get_json_as(&client(), &format!("{}/v1/models", server()), KEY).await;
    assert_eq!(models["object"], "list");
    let model = models["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(model, "SmolLM2-135M-Instruct.Q8_0");
    for max_tokens in [48, 6] {
        let query: Value = post(
            "/v1/query",
            &json!({"question": QUESTION, "retrieval": {"top_k": 2},
                    "generation": {"max_tokens": max_tokens, "temperature": 0.0}}),
        )
        .await
        .json()
        .await
        .unwrap();
        let res = post("/v1/chat/completions", &chat(max_tokens)).await;
        assert_eq!(res.status(), 200);
        let c: Value = res.json().await.unwrap();
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"), "{c}");
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["model"], model.as_str());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(now.abs_diff(c["created"].as_u64().unwrap()) < 600, "{c}");
        let choice = &c["choices"][0];
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
        assert_eq!(choice["index"], 0);
        assert_eq!(choice["logprobs"], Value::Null);
        assert_eq!(choice["message"]["role"], "assistant");
        assert_eq!(
            choice["message"]["content"], query["answer"],
            "{c}\n{query}"
        );
        assert_eq!(c["citations"], query["citations"]);
        let (p, n) = (
            query["usage"]["prompt_tokens"].as_u64().unwrap(),
            query["usage"]["completion_tokens"].as_u64().unwrap(),
        );
        assert_eq!(
            c["usage"],
            json!({"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n})
        );
        let length = query["mode"] == "generative" && n == max_tokens as u64;
        assert_eq!(
            choice["finish_reason"],
            if length { "length" } else { "stop" },
            "{c}\n{query}"
        );
        if max_tokens == 6 {
            assert!(length, "six tokens end a generative answer early: {query}");
        }
    }
}

/// The raw stream: `data:` lines only (no `event:`), chunk objects, the role first, the
/// finish reason and citations last, the usage chunk when asked for, then `data: [DONE]`.
#[tokio::test]
async fn the_stream_is_data_chunks_ending_in_done() {
    for include_usage in [false, true] {
        let mut body = chat(24);
        body["stream"] = json!(true);
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let res = post("/v1/chat/completions", &body).await;
        assert_eq!(res.status(), 200);
        assert!(res.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let text = res.text().await.unwrap();
        let frames: Vec<&str> = text
            .split("\n\n")
            .filter(|f| !f.is_empty() && !f.starts_with(':'))
            .collect();
        assert_eq!(frames.last(), Some(&"data: [DONE]"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text:?}");
        let chunks: Vec<Value> = frames[..frames.len() - 1]
            .iter()
            .map(|f| {
                let data = f.strip_prefix("data: ").unwrap_or_else(|| panic!("{f:?}"));
                assert!(!data.contains('\n'), "one data line per frame: {f:?}");
                serde_json::from_str(data).unwrap()
            })
            .collect();
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        let (last, usage) = if include_usage {
            let usage = &chunks[chunks.len() - 1];
            assert_eq!(usage["choices"], json!([]));
            let u = &usage["usage"];
            assert_eq!(
                u["total_tokens"].as_u64().unwrap(),
                u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
            );
            assert!(chunks[..chunks.len() - 1]
                .iter()
                .all(|c| c.get("usage") == Some(&Value::Null)));
            (&chunks[chunks.len() - 2], Some(u))
        } else {
            assert!(chunks.iter().all(|c| c.get("usage").is_none()));
            (&chunks[chunks.len() - 1], None)
        };
        let reason = last["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(reason == "stop" || reason == "length", "{last}");
        assert!(last["citations"].is_array(), "{last}");
        assert_eq!(last["choices"][0]["delta"], json!({}));
        let middle = &chunks[1..chunks.iter().position(|c| c == last).unwrap()];
        assert!(!middle.is_empty(), "{text}");
        assert!(middle.iter().all(|c| {
            c["choices"][0]["finish_reason"].is_null()
                && c["choices"][0]["delta"]["content"].is_string()
                && c["choices"][0]["delta"].get("role").is_none()
        }));
        if let Some(u) = usage {
            assert!(u["completion_tokens"].as_u64().unwrap() <= 24);
        }
    }
}

/// An error body in OpenAI's shape: exactly `message`, `type`, `param`, `code`.
async fn openai_error(res: reqwest::Response) -> (u16, Value) {
    let status = res.status().as_u16();
    assert!(res.headers()[CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let body: Value = res.json().await.unwrap();
    let e = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("{body}"));
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "message", "param", "type"], "{body}");
    assert!(!e["message"].as_str().unwrap().is_empty());
    (status, body["error"].clone())
}

#[tokio::test]
async fn errors_on_the_openai_paths_have_openai_shape() {
    let base = server();
    let c = client();
    let url = |p: &str| format!("{base}{p}");
    let question = json!([{"role": "user", "content": QUESTION}]);
    let body = |extra: Value| {
        let mut b = json!({"model": "docent", "messages": question});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let chat = |b: Value| {
        c.post(url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&b)
    };
    let raw = |content_type: &str, b: String| {
        c.post(url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .header(CONTENT_TYPE, content_type)
            .body(b)
    };
    let no_key = c.post(url("/v1/chat/completions")).json(&body(json!({})));
    let wrong_key = c
        .get(url("/v1/models"))
        .bearer_auth("not-the-key-0123456789");
    let two_messages =
        json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]);
    // (request, status, code, param); every one an `invalid_request_error`
    let cases: Vec<(reqwest::RequestBuilder, u16, &str, Option<&str>)> = vec![
        (no_key, 401, "invalid_api_key", None),
        (wrong_key, 401, "invalid_api_key", None),
        (
            raw(
                "application/json",
                "{\"model\": \"docent\", \"messages\": [".into(),
            ),
            400,
            "invalid_json",
            None,
        ),
        (
            chat(json!({"model": "docent", "messages": "hi"})),
            400,
            "invalid_value",
            None,
        ),
        (chat(json!({"model": "docent"})), 400, "invalid_value", None),
        (
            chat(body(json!({"model": "gpt-4o"}))),
            404,
            "model_not_found",
            Some("model"),
        ),
        (
            c.get(url("/v1/models/gpt-4o")).bearer_auth(KEY),
            404,
            "model_not_found",
            Some("model"),
        ),
        (
            c.get(url("/v1/chat/completions")).bearer_auth(KEY),
            405,
            "method_not_allowed",
            None,
        ),
        (
            chat(body(json!({"padding": "x".repeat(80 * 1024)}))),
            413,
            "payload_too_large",
            None,
        ),
        (
            raw("text/plain", body(json!({})).to_string()),
            415,
            "unsupported_media_type",
            None,
        ),
        (
            chat(body(json!({"messages": two_messages}))),
            400,
            "invalid_value",
            Some("messages[1].role"),
        ),
        (
            chat(body(json!({"stream_options": {"include_usage": true}}))),
            400,
            "invalid_value",
            Some("stream_options"),
        ),
        (
            chat(body(json!({"docent": {"retrieval": {"top_k": 0}}}))),
            400,
            "invalid_value",
            Some("docent.retrieval.top_k"),
        ),
        (
            chat(body(json!({"max_completion_tokens": 100000}))),
            400,
            "invalid_value",
            Some("max_completion_tokens"),
        ),
        (
            chat(body(json!({"seed": 1}))),
            400,
            "invalid_value",
            Some("seed"),
        ),
        (
            chat(body(json!({"n": 3, "stream": true}))),
            400,
            "unsupported_value",
            Some("n"),
        ),
    ];
    for (i, (req, status, code, param)) in cases.into_iter().enumerate() {
        let (got, e) = openai_error(req.send().await.unwrap()).await;
        assert_eq!(
            (
                got,
                e["type"].as_str().unwrap(),
                e["code"].as_str().unwrap(),
                e["param"].as_str()
            ),
            (status, "invalid_request_error", code, param),
            "case {i}: {e}"
        );
    }
    // docent's own routes keep docent's shape
    let res = c
        .post(url("/v1/query"))
        .json(&json!({"question": QUESTION}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
    let e: Value = res.json().await.unwrap();
    assert_eq!(e["error"]["code"], "unauthorized");
    assert!(e["error"].get("details").is_some() && e["error"].get("type").is_none());
}

/// Over the key's rate: 429 `rate_limit_exceeded` in OpenAI's shape, `Retry-After` kept.
#[tokio::test]
async fn over_the_rate_is_429_rate_limit_exceeded() {
    let (_dir, base) = tokio::task::spawn_blocking(|| {
        crate::helpers::server_over(&[crate::helpers::rust_book(OWNERSHIP)], |c| {
            c.auth.keys = key();
            c.auth.rate_per_minute = 1;
            c.auth.burst = 1;
        })
    })
    .await
    .unwrap();
    let get = || {
        client()
            .get(format!("{base}/v1/models"))
            .header(AUTHORIZATION, format!("Bearer {KEY}"))
            .send()
    };
    assert_eq!(get().await.unwrap().status(), 200);
    let res = get().await.unwrap();
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let (status, e) = openai_error(res).await;
    assert_eq!(
        (
            status,
            e["type"].as_str().unwrap(),
            e["code"].as_str().unwrap()
        ),
        (429, "requests", "rate_limit_exceeded")
    );
}

/// A client that goes away mid-stream cancels the generation, as on `/v1/query`.
#[tokio::test]
async fn a_disconnect_cancels_the_generation() {
    let (_dir, base) = tokio::task::spawn_blocking(|| {
        own_server(|c| {
            c.generation.cache_size = 0;
            c.server.keep_alive_ms = 20;
        })
    })
    .await
    .unwrap();
    let c = client();
    // temperature 2 makes near-uniform tokens: no early end of sequence
    let mut res = c
        .post(format!("{base}/v1/chat/completions"))
        .json(
            &json!({"model": "docent", "stream": true, "max_tokens": 1000, "temperature": 2,
                      "messages": [{"role": "user", "content": QUESTION}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    // the role chunk comes at once; then wait on keep-alives (text comes a sentence at a time)
    let mut seen = String::new();
    while seen.matches(": keep-alive").count() < 3 {
        let bytes = res.chunk().await.unwrap().expect("the stream ended early");
        seen.push_str(std::str::from_utf8(&bytes).unwrap());
        assert!(!seen.contains("[DONE]"), "the answer ended early: {seen}");
    }
    assert!(seen.starts_with("data: {"), "{seen}");
    let readyz = format!("{base}/readyz");
    assert_eq!(get_json(&c, &readyz).await["generation"]["active"], 1);
    let dropped = std::time::Instant::now();
    drop(res);
    loop {
        let s = get_json(&c, &readyz).await["generation"].clone();
        if s["cancelled"] == 1 && s["active"] == 0 {
            break;
        }
        assert!(
            dropped.elapsed() < std::time::Duration::from_secs(20),
            "the generation was not cancelled: {s}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
