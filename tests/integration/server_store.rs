//! The server store against the embedded one (issue 31): `docent migrate` from the embedded
//! engine to a Qdrant server keeps every ranking (same chunks, same order, scores within
//! 1e-5), on the Rust Book and on XQuAD-en's passages, with their own questions, and so
//! does the copy back to the embedded engine. Compared in dense search with `exact` and in
//! sparse search, up to the order of equal scores, so that a difference means different
//! data; hybrid search with the default (approximate) beam is compared too and its
//! differences printed.
//!
//! Needs a Qdrant server: `QDRANT_URL` (its gRPC URL). Without it the test prints a SKIP
//! line and passes.

use std::path::Path;

use docent::config::{Config, StoreKind};
use docent_ingest::store::{SearchFilter, SearchMode};

use crate::helpers::{
    config, docent_cmd, drop_server_collection, qdrant_url, run_ok, rust_book, shared,
    unique_collection,
};

/// (document id, chunk index, score) of each of the top 10 chunks, per question.
type Rankings = Vec<Vec<(String, usize, f32)>>;

fn rankings(config: &Config, questions: &[String]) -> Rankings {
    let index = docent::server::startup::open_index_blocking(config).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut out = Vec::new();
        for q in questions {
            let hits = index
                .retrieve(q, 10, &SearchFilter::default())
                .await
                .unwrap()
                .hits;
            out.push(
                hits.into_iter()
                    .map(|h| (h.payload.document_id, h.payload.chunk_index, h.score))
                    .collect(),
            );
        }
        out
    })
}

/// The same ranking of the same data, but for the order of chunks with equal scores: the
/// same scores place by place (within 1e-5), and the same chunks above the last place's
/// score (a tie across the last place may let in either chunk; each engine breaks ties by
/// its own internal ids, which a copy does not keep).
fn same_up_to_ties(x: &[(String, usize, f32)], y: &[(String, usize, f32)]) -> bool {
    if x.len() != y.len() || x.iter().zip(y).any(|(p, r)| (p.2 - r.2).abs() > 1e-5) {
        return false;
    }
    let Some(last) = x.last().map(|p| p.2) else {
        return true;
    };
    let above = |v: &[(String, usize, f32)]| {
        let mut ids: Vec<(String, usize)> = v
            .iter()
            .filter(|p| p.2 > last + 1e-5)
            .map(|p| (p.0.clone(), p.1))
            .collect();
        ids.sort();
        ids
    };
    above(x) == above(y)
}

/// Questions of a BEIR `queries.jsonl`, the first `n`.
fn questions(path: &Path, n: usize) -> Vec<String> {
    docent_tools::eval::questions(path)
        .unwrap()
        .into_iter()
        .take(n)
        .collect()
}

/// Compares two runs' rankings over their first `depth` places; returns how many
/// questions differ (and prints each).
fn differences(
    what: &str,
    a: &Rankings,
    b: &Rankings,
    questions: &[String],
    depth: usize,
    ties_allowed: bool,
) -> usize {
    let mut differ = 0;
    for ((x, y), q) in a.iter().zip(b).zip(questions) {
        let (x, y) = (&x[..depth.min(x.len())], &y[..depth.min(y.len())]);
        let same = if ties_allowed {
            same_up_to_ties(x, y)
        } else {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|(p, r)| p.0 == r.0 && p.1 == r.1 && (p.2 - r.2).abs() <= 1e-5)
        };
        if !same {
            differ += 1;
            eprintln!("{what}, top {depth}: {q:?}\n  {x:?}\n  {y:?}");
        }
    }
    differ
}

#[test]
fn migrate_to_a_server_and_back_keeps_every_ranking() {
    let Some(url) = qdrant_url("server_store") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let edge = dir.path().join("edge");
    let back = dir.path().join("back");
    // the corpus: the Rust Book and XQuAD-en's passages (as text files)
    let xquad = shared().join("data/eval/xquad-en");
    let passages = dir.path().join("xquad");
    std::fs::create_dir_all(&passages).unwrap();
    for (i, line) in std::fs::read_to_string(xquad.join("corpus.jsonl"))
        .unwrap()
        .lines()
        .enumerate()
    {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        std::fs::write(
            passages.join(format!("{i:04}.txt")),
            v["text"].as_str().unwrap(),
        )
        .unwrap();
    }
    run_ok(
        docent_cmd(&edge)
            .arg("ingest")
            .arg(rust_book(""))
            .arg(&passages),
    );
    let collection = unique_collection("docent_migrate");
    run_ok(docent_cmd(&edge).args(["migrate", "--to", &url, "--collection", &collection]));
    run_ok(
        docent_cmd(&dir.path().join("unused"))
            .env("DOCENT_STORE__KIND", "qdrant")
            .env("DOCENT_STORE__URL", &url)
            .env("DOCENT_STORE__COLLECTION", &collection)
            .args(["migrate", "--to"])
            .arg(&back),
    );

    let mut asked = questions(&xquad.join("queries.jsonl"), 100);
    asked.extend(questions(
        &crate::helpers::repo().join("eval/rust-book-natural/queries.jsonl"),
        100,
    ));
    let mut server_config = config(&dir.path().join("unused"));
    server_config.store.kind = StoreKind::Qdrant;
    server_config.store.url = Some(url.clone());
    server_config.store.collection = collection.clone();
    let (edge_config, copy_config) = (config(&edge), config(&back));

    // The data must be the same: dense search with `exact` (every vector) and sparse
    // search (BM25, always exact) must rank the same chunks with the same scores in all
    // three stores, up to the order of equal scores. Hybrid search fuses the two lists'
    // top candidates; where a tie straddles a list's cut the stores may let in different
    // chunks (a CI run saw 1 of 200 questions differ at place 8, with exact dense search),
    // so hybrid with the default beam is compared and reported, not asserted.
    let with = |c: &Config, mode: SearchMode| {
        let mut c = c.clone();
        c.retrieval.ann.exact = true;
        c.retrieval.mode = mode;
        c
    };
    let mut asserted = Vec::new();
    for mode in [SearchMode::Dense, SearchMode::Sparse] {
        let [on_edge, on_server, on_copy] =
            [&edge_config, &server_config, &copy_config].map(|c| rankings(&with(c, mode), &asked));
        // (a sparse ranking holds only chunks that share a term with the question; the
        // stores must agree on how many)
        assert!(on_edge.iter().filter(|r| r.len() == 10).count() >= asked.len() / 2);
        let name = mode.name();
        let to_server = differences(
            &format!("{name}, edge → server"),
            &on_edge,
            &on_server,
            &asked,
            10,
            true,
        );
        let round_trip = differences(
            &format!("{name}, edge → server → edge"),
            &on_edge,
            &on_copy,
            &asked,
            10,
            true,
        );
        asserted.push((name, to_server, round_trip));
    }
    let approximate = [&edge_config, &server_config, &copy_config].map(|c| rankings(c, &asked));
    let ann_to_server = differences(
        "hybrid, default beam, edge → server",
        &approximate[0],
        &approximate[1],
        &asked,
        10,
        false,
    );
    let ann_round_trip = differences(
        "hybrid, default beam, edge → server → edge",
        &approximate[0],
        &approximate[2],
        &asked,
        10,
        false,
    );
    eprintln!(
        "{} questions (100 XQuAD-en, 100 rust-book-natural), top 10 each, (mode, differences edge → server, edge → copy back): {asserted:?}; hybrid with the default beam (ef {}), not asserted: {ann_to_server} and {ann_round_trip}",
        asked.len(),
        edge_config.retrieval.ann.ef,
    );
    docent_ingest::store::block_on(drop_server_collection(&url, &collection));
    for (mode, to_server, round_trip) in asserted {
        assert_eq!(to_server, 0, "the server ranks differently ({mode})");
        assert_eq!(round_trip, 0, "the copy back ranks differently ({mode})");
    }
}
