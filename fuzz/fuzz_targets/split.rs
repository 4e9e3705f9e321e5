//! The splitter wrapper (sections, fast token sizing, byte spans) with the real embedding
//! tokenizer: every chunk is the document text at its span, within the token budget, in
//! order, and together the chunks cover every non-blank character.
#![no_main]

use std::sync::{Arc, LazyLock};

use arbitrary::Arbitrary;
use docent_ingest::load::{Document, Format};
use docent_ingest::split::Splitter;
use libfuzzer_sys::fuzz_target;
use tokenizers::Tokenizer;
use unicode_segmentation::UnicodeSegmentation;

/// The tokenizer `make setup` fetches (MiniLM, BERT word pieces); `DOCENT_FUZZ_TOKENIZER`
/// points elsewhere.
static TOKENIZER: LazyLock<Arc<Tokenizer>> = LazyLock::new(|| {
    let path = std::env::var("DOCENT_FUZZ_TOKENIZER").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/all-MiniLM-L6-v2/tokenizer.json"
        )
        .into()
    });
    let tok = docent_ingest::split::sizing_tokenizer(std::path::Path::new(&path))
        .unwrap_or_else(|e| panic!("run `make setup` first (or set DOCENT_FUZZ_TOKENIZER): {e}"));
    Arc::new(tok)
});

#[derive(Debug, Arbitrary)]
struct Input {
    text: String,
    markdown: bool,
    max_tokens: u8,
    overlap: u8,
    /// Exercise the section cut on short inputs too.
    small_sections: bool,
}

fuzz_target!(|input: Input| {
    let max_tokens = usize::from(input.max_tokens % 64) + 1;
    let overlap = usize::from(input.overlap) % max_tokens;
    let Ok(splitter) = Splitter::new(TOKENIZER.clone(), max_tokens, overlap, 256) else {
        return;
    };
    let format = if input.markdown {
        Format::Markdown
    } else {
        Format::Text
    };
    let doc = Document::from_text("/fuzz", input.text, format);
    let chunks = if input.small_sections {
        splitter.split_in_sections(&doc, 64)
    } else {
        splitter.split(&doc)
    };
    let mut covered = vec![false; doc.text.len()];
    let mut last_start = 0;
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.index, i);
        assert!(
            c.start < c.end && c.end <= doc.text.len(),
            "bad span {}..{}",
            c.start,
            c.end
        );
        assert_eq!(
            &doc.text[c.start..c.end],
            c.text,
            "chunk text is not the text at its span"
        );
        assert!(c.start >= last_start, "chunks out of order");
        last_start = c.start;
        assert!(!c.text.trim().is_empty(), "blank chunk");
        let tokens = splitter.count_tokens(&c.text).expect("tokenizes");
        // a single grapheme longer than the budget cannot be cut; anything else must fit
        if tokens > max_tokens {
            assert!(
                c.text.trim().graphemes(true).count() <= 1,
                "chunk {i} has {tokens} tokens > {max_tokens}: {:?}",
                c.text
            );
        }
        covered[c.start..c.end].iter_mut().for_each(|b| *b = true);
    }
    for (at, ch) in doc.text.char_indices() {
        if !ch.is_whitespace() {
            assert!(covered[at], "character {ch:?} at {at} is in no chunk");
        }
    }
});
