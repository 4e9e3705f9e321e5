//! `docent bench query` end to end on a small index: the index is built through the ingest
//! pipeline and cached, the real `docent serve` runs on a free port, and the load generator
//! measures it at two client counts (the Python peer has its own environment and is left out).

use std::time::Duration;

use docent_tools::bench::query::{run, Options};

use crate::helpers::{config, shared};

#[test]
fn query_benchmark_builds_a_cached_index_and_measures_the_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let book = shared().join("data/corpus/rust-book/src");
    let c = config(&dir.path().join("unused"));
    let opts = Options {
        docent: env!("CARGO_BIN_EXE_docent").into(),
        corpus: vec![
            book.join("ch04-01-what-is-ownership.md"),
            book.join("ch08-02-strings.md"),
        ],
        sizes: vec![20],
        clients: vec![1, 3],
        warmup: Duration::from_millis(200),
        duration: Duration::from_millis(800),
        top_k: 3,
        queries: shared().join("data/eval/xquad-en/queries.jsonl"),
        cache: dir.path().join("cache"),
        peer: None,
        compare: 5,
    };
    let first = run(&c, &opts).unwrap();
    assert_eq!(first.indexes.len(), 1);
    let built = &first.indexes[0];
    assert!(built.chunks >= 20, "{built:?}");
    assert_eq!(first.rows.len(), 2, "{:?}", first.rows);
    for r in &first.rows {
        assert_eq!(r.server, "docent");
        assert!(r.requests > 0 && r.requests_per_s > 0.0, "{r:?}");
        assert!(0.0 < r.p50_ms && r.p50_ms <= r.p99_ms, "{r:?}");
    }
    assert_eq!(first.rows[1].clients, 3);
    let table = first.to_string();
    assert!(table.contains("goals at"), "{table}");

    // the second run reuses the cached index instead of building it again: the same
    // record, build time included (a rebuild would take a measurably different time; the
    // JSON round trip may change the last bits of the float)
    let second = run(&c, &opts).unwrap();
    let reused = &second.indexes[0];
    assert!(
        (reused.build_seconds - built.build_seconds).abs() < 1e-6,
        "{reused:?} vs {built:?}"
    );
    let same_time = docent_tools::bench::query::IndexInfo {
        build_seconds: built.build_seconds,
        ..reused.clone()
    };
    assert_eq!(&same_time, built);
    assert!(!dir.path().join("unused").exists());

    // with a server store configured, the cached embedded index is copied to it before
    // docent is measured there; an unreachable server is an error that names it
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port(); // bound, then released: nothing listens there now
    let mut on_server = c.clone();
    on_server.store.kind = docent::config::StoreKind::Qdrant;
    on_server.store.url = Some(format!("http://127.0.0.1:{port}"));
    on_server.store.timeout_s = 2;
    let err = run(&on_server, &opts).unwrap_err();
    let message = format!("{err:#}");
    assert!(
        message.contains(&format!(
            "copying the bench index to http://127.0.0.1:{port}"
        )),
        "{message}"
    );
    assert!(message.contains("collection docent_bench_20"), "{message}");
}
