//! The `docent` binary: `ingest` then `ask --json` on the same code path as the API.

use std::process::Command;

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

/// `docent models`: every catalog model with its pinned size, licence, origin and sha256,
/// whether `make setup` installed it (under `DOCENT_MODELS_DIR`) and which one the
/// configuration names; a path outside the catalog is named as such.
#[test]
fn models_lists_the_catalog_with_what_is_installed_and_configured() {
    let list = |models_dir: &std::path::Path, model: &str| -> Vec<Value> {
        let out = run_ok(
            Command::new(env!("CARGO_BIN_EXE_docent"))
                .env("DOCENT_MODELS_DIR", models_dir)
                .env("DOCENT_GENERATION__MODEL", model)
                .args(["models", "--json"]),
        );
        serde_json::from_slice::<Value>(&out.stdout)
            .expect("JSON")
            .as_array()
            .expect("a list")
            .clone()
    };
    let row = |rows: &[Value], name: &str| -> Value {
        rows.iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("{name} listed: {rows:?}"))
            .clone()
    };
    // the models make test installs
    let rows = list(&crate::helpers::models(), "qwen2.5-coder-1.5b");
    let small = row(&rows, "qwen2.5-coder-0.5b");
    assert_eq!(small["name"], "qwen2.5-coder-0.5b", "{small}");
    assert_eq!(small["installed"], true, "{small}");
    assert_eq!(small["configured"], false, "{small}");
    assert_eq!(small["bytes"], 491_400_064u64, "{small}");
    assert!(
        small["licence"].as_str().unwrap().contains("Apache-2.0")
            && small["origin"].as_str().unwrap().contains("PyPI"),
        "{small}"
    );
    let big = row(&rows, "qwen2.5-coder-1.5b");
    assert_eq!(big["installed"], true, "{big}");
    assert_eq!(big["configured"], true, "{big}");
    assert_eq!(
        big["sha256"],
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    );
    row(&rows, "smollm2-135m");

    // an empty models directory: nothing installed, each row says how to install it
    let empty = tempfile::tempdir().unwrap();
    let rows = list(empty.path(), "qwen2.5-coder-0.5b");
    assert!(!rows.is_empty());
    for r in &rows {
        assert_eq!(r["installed"], false, "{r}");
        assert!(r["setup"].as_str().unwrap().contains("make setup"), "{r}");
    }
    assert_eq!(row(&rows, "qwen2.5-coder-0.5b")["configured"], true);

    // a file outside the catalog: the table says so
    let out = run_ok(
        Command::new(env!("CARGO_BIN_EXE_docent"))
            .env("DOCENT_MODELS_DIR", empty.path())
            .env("DOCENT_GENERATION__MODEL", "/elsewhere/mine.gguf")
            .arg("models"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("configured: /elsewhere/mine.gguf (not a catalog model)")
            && !text.contains("(configured)"),
        "{text}"
    );
}

/// `docent precompute` computes every chunk's passage block to disk beside the index; a
/// second run (another process: what a restart sees) finds them all there and computes
/// none; a changed document is computed again; asking afterwards works. Refused, with the
/// setting to change, when passage reuse is not `passages`. SmolLM2, two Rust Book chapters.
#[test]
fn precompute_puts_every_chunk_on_disk_once() {
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("index");
    let doc = dir.path().join("facts.md");
    std::fs::write(&doc, "The docent test suite's password is periwinkle.\n").unwrap();
    run_ok(
        docent_cmd(&index)
            .arg("ingest")
            .arg(crate::helpers::rust_book(crate::helpers::INSTALLATION))
            .arg(&doc),
    );
    let out = docent_cmd(&index).arg("precompute").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("DOCENT_GENERATION__PASSAGE_REUSE=passages"),
        "{err}"
    );

    let precompute = || -> Value {
        let out = run_ok(
            docent_cmd(&index)
                .env("DOCENT_GENERATION__PASSAGE_REUSE", "passages")
                .args(["precompute", "--json"]),
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let first = precompute();
    eprintln!("{first:#}");
    let chunks = first["chunks"].as_u64().unwrap();
    assert!(chunks >= 3, "{first}");
    assert_eq!(first["documents"], 2);
    assert_eq!(
        first["computed"].as_u64().unwrap() + first["skipped"].as_u64().unwrap(),
        chunks,
        "{first}"
    );
    assert_eq!(first["disk_files"], first["computed"], "{first}");
    assert!(first["disk_bytes"].as_u64().unwrap() > 0);
    let passages = index.join("passages");
    assert!(passages.is_dir());

    let second = precompute();
    assert_eq!(second["computed"], 0, "all on disk already: {second}");
    assert_eq!(second["disk_files"], first["disk_files"]);

    // a changed document: its chunk is another block
    std::fs::write(&doc, "The docent test suite's password is now marigold.\n").unwrap();
    run_ok(docent_cmd(&index).arg("ingest").arg(&doc));
    let third = precompute();
    assert_eq!(third["computed"], 1, "{third}");

    let out = run_ok(
        docent_cmd(&index)
            .env("DOCENT_GENERATION__PASSAGE_REUSE", "passages")
            .args([
                "ask",
                "--json",
                "What is the password of the docent test suite?",
            ]),
    );
    let body: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        !body["answer"].as_str().unwrap().trim().is_empty(),
        "{body}"
    );
}
