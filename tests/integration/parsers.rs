//! Every sample document in `../shared/data/parsers/unstructured/` either loads with
//! readable text or is refused with an error that names the file and the reason.

use std::path::{Path, PathBuf};

use docent::server::startup;
use docent_ingest::load::{self, Document};
use docent_ingest::pipeline::Silent;
use docent_ingest::Error;

use crate::helpers::{config, shared};

fn samples() -> PathBuf {
    shared().join("data/parsers/unstructured")
}

/// (file, text the loaded document must contain)
const INGESTS: &[(&str, &str)] = &[
    ("codeblock.md", "HTML Example"),
    ("simple-table.md", "|"),
    ("umlauts-non-utf8.md", "können"),
    ("language-docs/eng_spa_mult.md", "e"),
    ("fake-html.html", "# My First Heading"),
    (
        "fake-html-with-footer-and-header.html",
        "My first paragraph",
    ),
    ("fake-html-cp1252.html", "€"),
    ("example-10k-1p.html", "TRANSITION REPORT"),
    ("language-docs/eng_spa_mult.html", "e"),
    ("fake.docx", "Lorem ipsum dolor sit amet"),
    ("simple.docx", "favorite things"),
    ("docx-hdrftr.docx", "Main document"),
    ("docx-tables.docx", " | "),
    ("fake_table.docx", "Header Col 1 | Header Col 2"),
    ("fake-doc-emphasized-text.docx", "|"),
    ("example-list-items-multiple.docx", "Lorem Ipsum"),
    ("handbook-1p.docx", "INTRODUCTION"),
    ("page-breaks.docx", "First page"),
    ("language-docs/eng_spa_mult.docx", "e"),
    ("pdf/fake-memo.pdf", "bottles of water"),
    ("pdf/embedded-link.pdf", "This is the link"),
    ("pdf/header-test-doc.pdf", "lovely"),
    ("pdf/list-item-example.pdf", "Module One"),
    ("rotated-page-90.pdf", "Hello World"),
];

fn refusal_kind(e: &Error) -> &'static str {
    match e {
        Error::Encrypted { .. } => "encrypted",
        Error::NoTextLayer { .. } => "no text layer",
        Error::UnsupportedType { .. } => "unsupported",
        Error::Corrupt { .. } => "corrupt",
        Error::Binary { .. } => "binary",
        Error::Empty { .. } => "empty",
        _ => "other",
    }
}

const REFUSED: &[(&str, &str)] = &[
    ("pdf/password.pdf", "encrypted"),
    ("pdf/loremipsum-flat.pdf", "no text layer"),
    ("pdf/single_table.pdf", "no text layer"),
    ("pdf/table-multi-row-column-cells.pdf", "no text layer"),
    ("fake-email.eml", "unsupported"),
    ("fake-doc.rtf", "unsupported"),
    ("fake.odt", "unsupported"),
    ("fake-power-point.pptx", "unsupported"),
    ("stanley-cups.xlsx", "unsupported"),
    ("winter-sports.epub", "unsupported"),
];

fn readable(doc: &Document) -> bool {
    let chars = doc.text.chars().count().max(1);
    let bad = doc
        .text
        .chars()
        .filter(|c| *c == '\u{FFFD}' || (c.is_control() && !c.is_whitespace()))
        .count();
    doc.text.chars().any(char::is_alphanumeric) && bad * 100 < chars
}

#[test]
fn every_sample_loads_or_is_refused_with_a_reason() {
    let all: Vec<PathBuf> = walk(&samples());
    assert!(all.len() >= 30, "{} samples", all.len());
    let mut loaded = 0;
    for path in &all {
        let rel = path.strip_prefix(samples()).unwrap().display().to_string();
        match load::load_file(path) {
            Ok(doc) => {
                assert!(readable(&doc), "{rel}: unreadable text {:?}", &doc.text);
                assert!(!doc.title.is_empty(), "{rel}: no title");
                if let Some((_, needle)) = INGESTS.iter().find(|(f, _)| *f == rel) {
                    assert!(
                        doc.text.contains(needle),
                        "{rel}: {needle:?} not in {:?}",
                        doc.text
                    );
                }
                assert!(
                    !REFUSED.iter().any(|(f, _)| *f == rel),
                    "{rel} should have been refused"
                );
                loaded += 1;
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&*path.file_name().unwrap().to_string_lossy()),
                    "{msg}"
                );
                let expected = REFUSED
                    .iter()
                    .find(|(f, _)| *f == rel)
                    .map(|(_, k)| *k)
                    .or_else(|| {
                        (path.extension().is_some_and(|x| x == "eml" || x == "pptx"))
                            .then_some("unsupported")
                    });
                assert_eq!(Some(refusal_kind(&e)), expected, "{rel}: {msg}");
            }
        }
    }
    for (f, _) in INGESTS {
        assert!(all.iter().any(|p| p.ends_with(f)), "sample {f} missing");
    }
    assert!(loaded >= INGESTS.len());
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn pdf_chunks_carry_their_page() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(&dir.path().join("index"));
    let index = startup::open_index_blocking(&c).unwrap();
    let ingestor = startup::ingestor(&c, &index).unwrap();
    let pdf = samples().join("pdf/list-item-example.pdf");
    let r = ingestor.ingest_paths(&[pdf], &Silent).unwrap();
    assert_eq!(r.ingested.len(), 1, "{r:?}");
    let hits = docent_ingest::store::block_on(index.retrieve(
        "Module One Introduction to Product Development",
        5,
        &Default::default(),
    ))
    .unwrap()
    .hits;
    assert!(hits.iter().all(|h| h.payload.page.is_some()));
    assert!(hits.iter().any(|h| h.payload.page == Some(1)));
}
