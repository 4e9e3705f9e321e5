//! Crash safety: `docent ingest` killed with SIGKILL at random points. After every restart
//! each stored document is complete (all its chunks) and every document that was complete
//! before a kill still is; rerunning the ingest converges to the full index.
//! Slow (about two minutes): `make crash-test` runs it.

use std::collections::BTreeSet;
use std::time::Duration;

use docent_ingest::store::{SearchFilter, Store};

use crate::helpers::{config, docent_cmd, run_ok, rust_book};

/// (id, source, chunks, chunks_total) of every stored document.
fn snapshot(dir: &std::path::Path) -> (Vec<(String, String, usize, usize)>, usize) {
    let c = config(dir);
    let index = docent::server::startup::open_index_blocking(&c).expect("open after kill");
    let store: &Store = &index.store;
    let recovered = store.recovered().len();
    let (docs, more) =
        docent_ingest::store::block_on(store.documents(&SearchFilter::default(), None, 100_000))
            .unwrap();
    assert!(!more);
    let out = docs
        .into_iter()
        .map(|d| (d.id, d.source, d.chunks, d.chunks_total))
        .collect();
    (out, recovered)
}

#[test]
#[ignore = "slow: run with `make crash-test`"]
fn sigkill_during_ingest_never_leaves_half_documents() {
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("index");
    let corpus = rust_book("");
    let kills: usize = std::env::var("CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut complete_before: BTreeSet<(String, String)> = BTreeSet::new();
    let (mut rolled_back, mut max_docs) = (0, 0);
    for round in 0..kills {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let wait = Duration::from_millis(1500 + seed % 4000);
        let mut child = docent_cmd(&index)
            .arg("ingest")
            .arg(&corpus)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(wait);
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let (docs, recovered) = snapshot(&index);
        rolled_back += recovered;
        let mut sources = BTreeSet::new();
        for (id, source, chunks, total) in &docs {
            assert_eq!(chunks, total, "round {round}: {source} is incomplete");
            assert!(
                sources.insert(source.clone()),
                "round {round}: two versions of {source}"
            );
            let _ = id;
        }
        let now: BTreeSet<_> = docs.iter().map(|d| (d.0.clone(), d.1.clone())).collect();
        assert!(
            complete_before.is_subset(&now),
            "round {round}: a complete document was lost"
        );
        complete_before = now;
        max_docs = max_docs.max(docs.len());
        eprintln!(
            "kill {:>2} after {:>4} ms: {:>3} complete documents, {recovered} rolled back",
            round + 1,
            wait.as_millis(),
            docs.len()
        );
    }
    // run to completion: converges to every file, complete
    run_ok(docent_cmd(&index).arg("ingest").arg(&corpus));
    let (docs, _) = snapshot(&index);
    let files = std::fs::read_dir(&corpus)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "md"))
        })
        .count();
    assert_eq!(docs.len(), files);
    assert!(docs.iter().all(|d| d.2 == d.3));
    let again = docent_cmd(&index)
        .arg("ingest")
        .arg(&corpus)
        .output()
        .unwrap();
    let summary = String::from_utf8_lossy(&again.stdout);
    assert!(
        summary.contains(&format!(
            "ingested 0 document(s) (0 chunks), {files} unchanged"
        )),
        "{summary}"
    );
    eprintln!(
        "{kills} kills, {rolled_back} interrupted documents rolled back, at most {max_docs} complete documents between kills, {files} after the final run"
    );
}
