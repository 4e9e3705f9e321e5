//! The `docent` binary: `ingest` then `ask --json` on the same code path as the API.

use serde_json::Value;

use crate::helpers::{docent_cmd, run_ok};

#[test]
fn ingest_then_ask_json() {
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("index");
    let doc = dir.path().join("facts.txt");
    std::fs::write(
        &doc,
        "The secret password of the docent test suite is periwinkle. It was chosen in 2026.",
    )
    .unwrap();
    let bad = dir.path().join("slides.pptx");
    std::fs::write(&bad, "x").unwrap();

    // an unsupported file named explicitly is refused with its name and the supported types
    let out = docent_cmd(&index).arg("ingest").arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "exit code 2: some files failed");
    let err = String::from_utf8_lossy(&out.stdout);
    assert!(
        err.contains("slides.pptx") && err.contains("supported: txt, md"),
        "{err}"
    );

    let out = run_ok(docent_cmd(&index).arg("ingest").arg(&doc));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ingested 1 document(s) (1 chunks)"));

    let out = run_ok(docent_cmd(&index).args([
        "ask",
        "--json",
        "--top-k",
        "1",
        "What is the secret password of the docent test suite?",
    ]));
    let body: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("{body:#}");
    assert!(!body["answer"].as_str().unwrap().trim().is_empty());
    assert_eq!(body["answerable"], true);
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 20);
    let citations = body["citations"].as_array().unwrap();
    assert!(
        !citations.is_empty(),
        "an answer without a citation: {body}"
    );
    assert!(
        citations[0]["source"]
            .as_str()
            .unwrap()
            .ends_with("facts.txt"),
        "{body}"
    );
}

#[test]
fn missing_model_names_the_file_and_the_setup_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = docent_cmd(&dir.path().join("index"))
        .env("DOCENT_GENERATION__MODEL", "/nonexistent/model.gguf")
        .args(["ask", "anything"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/model.gguf") && err.contains("make setup"),
        "{err}"
    );

    let out = docent_cmd(&dir.path().join("index"))
        .env("DOCENT_RETRIEVAL__TOP_K", "0")
        .args(["ask", "anything"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("retrieval.top_k"), "{err}");
}
