//! The ingest pipeline on the real embedding model and the real embedded Qdrant engine.

use docent_ingest::store::block_on;
use std::sync::Arc;

use docent::server::startup;
use docent_ingest::pipeline::{Outcome, Silent};

use crate::helpers::config;

#[test]
fn reingest_is_incremental_and_failures_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let docs = dir.path().join("docs");
    std::fs::create_dir(&docs).unwrap();
    let a = docs.join("a.md");
    let long: String = (0..60)
        .map(|i| format!("Sentence number {i} talks about topic {}. ", i % 7))
        .collect();
    std::fs::write(&a, format!("# Alpha\n\n{long}\n")).unwrap();
    std::fs::write(docs.join("b.txt"), "Beta is a short plain text file.").unwrap();

    let c = config(&dir.path().join("index"));
    let index = startup::open_index_blocking(&c).unwrap();
    let ingestor = startup::ingestor(&c, &index).unwrap();
    let store = Arc::clone(&index.store);

    let r = ingestor
        .ingest_paths(std::slice::from_ref(&docs), &Silent)
        .unwrap();
    assert_eq!(r.ingested.len(), 2);
    assert!(r.failed.is_empty());
    let first = block_on(store.len()).unwrap();
    assert!(
        first >= 3,
        "a.md should need several chunks, got {first} in total"
    );
    assert_eq!(r.chunks_written(), first);

    // unchanged: a no-op
    let r = ingestor
        .ingest_paths(std::slice::from_ref(&docs), &Silent)
        .unwrap();
    assert_eq!(r.unchanged.len(), 2);
    assert_eq!(block_on(store.len()).unwrap(), first);

    // changed: the old version's chunks are replaced, not kept beside the new ones
    std::fs::write(&a, "# Alpha\n\nNow a single short paragraph.\n").unwrap();
    let r = ingestor
        .ingest_paths(std::slice::from_ref(&a), &Silent)
        .unwrap();
    let Outcome::Ingested {
        document_id,
        chunks,
    } = &r.ingested[0].1
    else {
        panic!("{r:?}")
    };
    assert_eq!(*chunks, 1);
    assert_eq!(block_on(store.len()).unwrap(), 2);
    let source = a.canonicalize().unwrap().display().to_string();
    assert_eq!(
        block_on(store.documents_of_source(&source))
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
        vec![document_id.clone()]
    );

    // a bad file is reported with its name and leaves nothing behind; the rest goes on
    let bad = docs.join("bad.txt");
    std::fs::write(&bad, b"abc\0def").unwrap();
    let r = ingestor
        .ingest_paths(std::slice::from_ref(&docs), &Silent)
        .unwrap();
    assert_eq!(r.failed.len(), 1);
    assert!(r.failed[0].0.ends_with("bad.txt"));
    assert!(r.failed[0].1.contains("binary"), "{}", r.failed[0].1);
    assert_eq!(block_on(store.len()).unwrap(), 2);

    // search finds the right chunk with a checkable span
    let hits = block_on(index.retrieve("What is Beta?", 1, &Default::default()))
        .unwrap()
        .hits;
    let p = &hits[0].payload;
    assert!(p.source.ends_with("b.txt"));
    let text = std::fs::read_to_string(&p.source).unwrap();
    assert_eq!(&text[p.span.start..p.span.end], p.text);
}

#[test]
fn chunks_never_exceed_the_embedding_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(&dir.path().join("index"));
    c.chunking.max_tokens = 254;
    c.chunking.overlap = 0;
    let index = startup::open_index_blocking(&c).unwrap();
    let ingestor = startup::ingestor(&c, &index).unwrap();
    // long words, a long line without spaces, CJK and code
    let text = format!(
        "{}\n\n{}\n\n{}\n\n```rust\n{}\n```\n",
        "supercalifragilisticexpialidocious ".repeat(300),
        "x".repeat(5000),
        "東京は日本の首都です。".repeat(200),
        "fn main() { println!(\"hi\"); }\n".repeat(100)
    );
    let f = dir.path().join("long.md");
    std::fs::write(&f, &text).unwrap();
    let doc = docent_ingest::load::load_file(&f).unwrap();
    let r = ingestor.ingest_document(&doc).unwrap();
    let Outcome::Ingested { chunks, .. } = r else {
        panic!()
    };
    assert!(chunks > 10);
    let tok = index.embedder.sizing_tokenizer();
    let splitter = docent_ingest::split::Splitter::new(tok.clone(), 254, 0, 256).unwrap();
    for chunk in splitter.split(&doc) {
        let n = tok.encode(chunk.text.as_str(), true).unwrap().len();
        assert!(n <= 256, "chunk of {n} tokens with special tokens");
        assert_eq!(&doc.text[chunk.start..chunk.end], chunk.text);
    }
}

#[test]
fn same_content_at_two_sources_is_stored_once_and_changed_settings_rewrite_it() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = (dir.path().join("x.md"), dir.path().join("y.md"));
    std::fs::write(&x, "# Shared\n\nThe same licence text.\n").unwrap();
    std::fs::write(&y, "# Shared\n\nThe same licence text.\n").unwrap();
    let missing = dir.path().join("missing.md");
    let licence = |index: &docent::query::retrieve::Index| {
        block_on(index.retrieve("the same licence text", 5, &Default::default()))
            .unwrap()
            .hits
    };

    let mut c = config(&dir.path().join("index"));
    {
        let index = startup::open_index_blocking(&c).unwrap();
        let ingestor = startup::ingestor(&c, &index).unwrap();
        // a missing path is reported; the other files are still ingested, in input order
        let r = ingestor
            .ingest_paths(&[x.clone(), y.clone(), missing.clone()], &Silent)
            .unwrap();
        assert_eq!(r.ingested.len(), 1, "{r:?}");
        assert!(r.ingested[0].0.ends_with("x.md"), "{r:?}");
        assert_eq!(r.deduplicated.len(), 1, "{r:?}");
        assert!(r.deduplicated[0].0.ends_with("y.md"), "{r:?}");
        assert_eq!(r.failed.len(), 1);
        assert!(r.failed[0].1.contains("missing.md"), "{:?}", r.failed);
        // one copy of the content, held by both paths
        assert_eq!(block_on(index.store.len()).unwrap(), 1);
        let hits = licence(&index);
        assert_eq!(hits.len(), 1, "search returns the content once");
        assert!(hits[0].payload.source.ends_with("x.md"));
        assert_eq!(hits[0].payload.sources.len(), 2);
        // again: both unchanged
        let r = ingestor
            .ingest_paths(&[x.clone(), y.clone()], &Silent)
            .unwrap();
        assert_eq!(r.unchanged.len(), 2, "{r:?}");

        // editing x leaves y's copy of the old content alone, now cited from y
        std::fs::write(&x, "# Changed\n\nNew text.\n").unwrap();
        ingestor
            .ingest_paths(std::slice::from_ref(&x), &Silent)
            .unwrap();
        let hits = licence(&index);
        let shared: Vec<_> = hits
            .iter()
            .filter(|h| h.payload.text.contains("licence"))
            .collect();
        assert_eq!(shared.len(), 1);
        assert!(shared[0].payload.source.ends_with("y.md"));
        assert_eq!(shared[0].payload.sources.len(), 1);
        assert_eq!(block_on(index.store.len()).unwrap(), 2);
    }
    // other chunking settings: nothing is "unchanged", every file is made again
    c.chunking.max_tokens = 64;
    c.chunking.overlap = 8;
    let index = startup::open_index_blocking(&c).unwrap();
    let ingestor = startup::ingestor(&c, &index).unwrap();
    let r = ingestor.ingest_paths(&[x, y], &Silent).unwrap();
    assert_eq!(r.ingested.len(), 2, "{r:?}");
    assert_eq!(block_on(index.store.len()).unwrap(), 2);
}

/// `docent bench ingest` measures the same chunks in both rows (without the Python peer,
/// which has its own environment).
#[test]
fn ingest_benchmark_runs_docent_and_the_raw_session_over_the_same_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    for i in 0..3 {
        let body = format!(
            "# Part {i}\n\n{}",
            "Some words about borrowing. ".repeat(60 * (i + 1))
        );
        std::fs::write(corpus.join(format!("p{i}.md")), body).unwrap();
    }
    let c = config(&dir.path().join("unused"));
    let b = docent_tools::bench::ingest(&c, &corpus, None).unwrap();
    assert_eq!(b.files, 3);
    assert_eq!(b.rows.len(), 2);
    assert!(b.rows[0].chunks > 3, "{:?}", b.rows);
    assert_eq!(b.rows[0].chunks, b.rows[1].chunks, "{:?}", b.rows);
    assert!(b.real_tokens <= b.padded_tokens);
    assert!(b
        .rows
        .iter()
        .all(|r| r.seconds > 0.0 && r.chunks_per_s > 0.0));
    assert!(
        !dir.path().join("unused").exists(),
        "the benchmark uses its own temp index"
    );
    let table = b.to_string();
    assert!(table.contains("% of the raw session"), "{table}");
}

/// Found by fuzzing: a control character that the tokenizer's normaliser deletes joins the
/// words around it (`conscience\u{8}\0nd` is one word), so a chunk cut there counted
/// fewer tokens from the section's tokenization than it has on its own.
#[test]
fn chunks_cut_inside_a_word_are_counted_on_their_own() {
    use docent_ingest::load::{Document, Format};
    use docent_ingest::split::{sizing_tokenizer, Splitter};
    let tok = Arc::new(
        sizing_tokenizer(&crate::helpers::models().join("all-MiniLM-L6-v2/tokenizer.json"))
            .unwrap(),
    );
    let text = "They are endowed with reason and conscience\u{8}\0nd should act towards one another in a spirit of brotherhood.";
    let doc = Document::from_text("/x.md", text.to_string(), Format::Markdown);
    for max in [1, 2, 3] {
        let fast = Splitter::new(tok.clone(), max, 0, 256).unwrap();
        let exact = Splitter::new(tok.clone(), max, 0, 256)
            .unwrap()
            .with_exact_sizing();
        let chunks = fast.split(&doc);
        for c in &chunks {
            let n = fast.count_tokens(&c.text).unwrap();
            assert!(
                n <= max || c.text.trim().chars().count() == 1,
                "{:?} has {n} tokens, over {max}",
                c.text
            );
        }
        assert_eq!(chunks, exact.split(&doc), "budget {max}");
    }
}

/// The splitter counts tokens from one tokenization per section; tokenizing every
/// candidate chunk (text-splitter's own way) must give exactly the same chunks.
#[test]
fn fast_token_counting_gives_the_same_chunks_as_tokenizing_each_candidate() {
    use docent_ingest::load::{load_file, Document, Format};
    use docent_ingest::split::{sizing_tokenizer, Splitter};
    let tok = Arc::new(
        sizing_tokenizer(&crate::helpers::models().join("all-MiniLM-L6-v2/tokenizer.json"))
            .unwrap(),
    );
    let book = crate::helpers::shared().join("data/corpus/rust-book/src");
    let mut docs: Vec<Document> = [
        "ch04-01-what-is-ownership.md",
        "ch08-02-strings.md",
        "ch16-01-threads.md",
        "appendix-02-operators.md",
    ]
    .iter()
    .map(|f| load_file(&book.join(f)).unwrap())
    .collect();
    let rfc =
        std::fs::read_to_string(crate::helpers::shared().join("data/corpus/rfcs/rfc6749.txt"))
            .unwrap();
    docs.push(Document::from_text(
        "rfc",
        rfc[..120_000].to_string(),
        Format::Text,
    ));
    let odd = format!(
        "{}\n\n{}\n\n{}\n\nnaïve café — “quotes” … e\u{301}\n\n```rust\n{}\n```\n",
        "supercalifragilisticexpialidocious ".repeat(300),
        "x".repeat(5000),
        "東京は日本の首都です。".repeat(200),
        "fn main() { println!(\"hi\"); }\n".repeat(100)
    );
    docs.push(Document::from_text("odd.md", odd.clone(), Format::Markdown));
    docs.push(Document::from_text("odd.txt", odd, Format::Text));
    for (max, overlap) in [(200, 24), (254, 0), (48, 8)] {
        let fast = Splitter::new(tok.clone(), max, overlap, 256).unwrap();
        let exact = Splitter::new(tok.clone(), max, overlap, 256)
            .unwrap()
            .with_exact_sizing();
        for doc in &docs {
            let (t0, a) = (std::time::Instant::now(), fast.split(doc));
            let (t1, b) = (std::time::Instant::now(), exact.split(doc));
            let t2 = std::time::Instant::now();
            eprintln!(
                "{} ({max}/{overlap}): {} chunks, fast {:?}, exact {:?}",
                doc.source,
                a.len(),
                t1 - t0,
                t2 - t1
            );
            assert_eq!(a, b, "{} with {max}/{overlap}", doc.source);
        }
    }
}
