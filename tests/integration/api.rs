//! The real server on a random port, over HTTP.

use serde_json::{json, Value};

use crate::helpers::{app, client, OWNERSHIP};

#[tokio::test]
async fn answers_with_a_citation_of_the_document_that_holds_the_answer() {
    let app = app();
    assert!(
        app.ingest_stdout.contains("ingested 2 document(s)"),
        "{}",
        app.ingest_stdout
    );
    let res = client()
        .post(format!("{}/v1/query", app.address))
        .json(&json!({
            "question": "What is ownership in Rust?",
            "generation": {"max_tokens": 48, "temperature": 0.0}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    eprintln!("{}", serde_json::to_string_pretty(&body).unwrap());
    let answer = body["answer"].as_str().unwrap();
    let words = regex::Regex::new(r"\[\d+\]")
        .unwrap()
        .replace_all(answer, "")
        .split_whitespace()
        .count();
    assert!(
        words >= 3,
        "the answer has no content besides markers: {answer:?}"
    );
    let citations = body["citations"].as_array().unwrap();
    assert!(!citations.is_empty(), "no citations: {body}");
    let first = &citations[0];
    assert!(
        first["source"].as_str().unwrap().ends_with(OWNERSHIP),
        "first citation is not the ownership chapter: {first}"
    );
    // the citation is checkable: its span and quote point into the source document
    let source = std::fs::read_to_string(first["source"].as_str().unwrap()).unwrap();
    let (start, end) = (
        first["span"]["start"].as_u64().unwrap() as usize,
        first["span"]["end"].as_u64().unwrap() as usize,
    );
    let chunk = &source[start..end];
    assert!(chunk.contains(first["quote"].as_str().unwrap()));
    // every [n] in the answer refers to a returned citation
    let ns: Vec<u64> = citations.iter().map(|c| c["n"].as_u64().unwrap()).collect();
    for cap in regex::Regex::new(r"\[(\d+)\]")
        .unwrap()
        .captures_iter(answer)
    {
        assert!(ns.contains(&cap[1].parse().unwrap()), "{answer}");
    }
    let usage = &body["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 50);
    assert!(usage["completion_tokens"].as_u64().unwrap() > 0);
    assert!(usage["total_ms"].as_f64().unwrap() >= usage["generation_ms"].as_f64().unwrap());
}

#[tokio::test]
async fn healthz_reports_the_index() {
    let app = app();
    let res = client()
        .get(format!("{}/healthz", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["status"], "ok");
    assert!(body["chunks"].as_u64().unwrap() > 10, "{body}");
}

async fn expect_error(req: reqwest::RequestBuilder, status: u16, code: &str) {
    let res = req.send().await.unwrap();
    assert_eq!(res.status().as_u16(), status);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(!body["error"]["message"].as_str().unwrap().is_empty());
}

#[tokio::test]
async fn bad_requests_get_json_errors() {
    let app = app();
    let url = format!("{}/v1/query", app.address);
    let c = client();
    expect_error(
        c.post(&url)
            .header("content-type", "application/json")
            .body("{not json"),
        400,
        "invalid_json",
    )
    .await;
    expect_error(
        c.post(&url).json(&json!({"q": "x"})),
        422,
        "invalid_request",
    )
    .await;
    expect_error(
        c.post(&url).json(&json!({"question": ""})),
        422,
        "invalid_request",
    )
    .await;
    expect_error(
        c.post(&url)
            .json(&json!({"question": "x", "retrieval": {"top_k": 0}})),
        422,
        "invalid_request",
    )
    .await;
    expect_error(
        c.post(&url)
            .header("content-type", "text/plain")
            .body("question"),
        415,
        "unsupported_media_type",
    )
    .await;
    expect_error(
        c.post(&url).json(&json!({"question": "x".repeat(100_000)})),
        413,
        "payload_too_large",
    )
    .await;
    expect_error(c.get(&url), 405, "method_not_allowed").await;
    expect_error(c.get(format!("{}/nope", app.address)), 404, "not_found").await;
    // the server is still healthy after all of that
    let ok = c
        .get(format!("{}/healthz", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}
