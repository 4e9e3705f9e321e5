//! Shared helpers for the fuzz targets.
//!
//! docent's query-side text modules (the citation parser, the stop-sequence matcher and
//! streamed answer, the safety filter) are compiled here from their own source files, so
//! the fuzzers exercise exactly the code the server runs without building the model
//! runtime (mistral.rs, candle) with coverage instrumentation. The module tree mirrors
//! `docent::query` so that the files' own `super::`/`crate::query::` paths resolve.
#![allow(dead_code, unused_imports)]

pub mod query;

use docent_ingest::load::{self, Document};
use docent_ingest::store::{ChunkPayload, Hit, Span};

/// Checks what every successfully loaded document must satisfy.
pub fn check_document(doc: &Document) {
    assert!(
        !doc.text.trim().is_empty(),
        "an empty document was accepted"
    );
    assert_eq!(
        doc.id,
        load::content_id(&doc.text),
        "id is not the content hash"
    );
    assert!(
        !doc.text.starts_with('\u{feff}'),
        "a byte-order mark was kept"
    );
    let mut prev = 0;
    for &s in &doc.page_starts {
        assert!(s >= prev, "page starts out of order: {:?}", doc.page_starts);
        assert!(s <= doc.text.len(), "page start past the text");
        assert!(
            doc.text.is_char_boundary(s),
            "page start inside a character"
        );
        prev = s;
    }
    if !doc.text.is_empty() && !doc.page_starts.is_empty() {
        let last = doc.text.len() - 1;
        assert!(doc.page_of(last).is_some());
    }
}

/// Context blocks as the prompt numbers them, from fuzzer-chosen texts.
pub fn blocks(texts: &[String]) -> Vec<Hit> {
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| Hit {
            payload: ChunkPayload {
                document_id: format!("doc{i}"),
                source: format!("/doc{i}.md"),
                title: format!("doc{i}"),
                chunk_index: i,
                chunks_total: texts.len(),
                span: Span {
                    start: 0,
                    end: t.len(),
                },
                text: t.clone(),
                ..Default::default()
            },
            score: 0.5,
        })
        .collect()
}
