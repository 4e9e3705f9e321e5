//! Stage 2, **split**: token-aware chunks with byte spans into the document text.
//!
//! Sizes are counted with the embedding model's own tokenizer (truncation and padding
//! off), so no chunk exceeds what the model can embed. Markdown is split on its
//! structure (headings, blocks, sentences) before falling back to smaller units.

use std::sync::Arc;

use text_splitter::{ChunkConfig, ChunkSizer, MarkdownSplitter, TextSplitter};
use tokenizers::Tokenizer;

use crate::load::{Document, Format};
use crate::{Error, Result};

/// Special tokens BERT-style models add around every input ([CLS] and [SEP]).
pub const SPECIAL_TOKENS: usize = 2;

/// One chunk of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Its position among the document's chunks, from 0.
    pub index: usize,
    /// The chunk's text, a slice of the document's.
    pub text: String,
    /// Byte range in [`Document::text`]: `&doc.text[start..end] == text`.
    pub start: usize,
    /// End of the byte range (exclusive).
    pub end: usize,
    /// The Markdown headings in force where the chunk starts, outermost first, joined by
    /// ` › ` (empty for plain text and before the first heading): the section the chunk
    /// belongs to, which its own text often does not name.
    pub heading: String,
}

/// Splits documents into chunks of at most `max_tokens` tokens with `overlap` tokens shared
/// between neighbours.
pub struct Splitter {
    max_tokens: usize,
    overlap: usize,
    tokenizer: Arc<Tokenizer>,
    /// Count tokens from one tokenization of each section (see [`SectionSizer`]) instead
    /// of tokenizing every candidate chunk.
    fast_sizing: bool,
}

impl Splitter {
    /// `model_max_length` is the embedding model's limit including special tokens; the
    /// chunk size must leave room for them.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        max_tokens: usize,
        overlap: usize,
        model_max_length: usize,
    ) -> Result<Self> {
        if max_tokens == 0 || max_tokens + SPECIAL_TOKENS > model_max_length {
            return Err(Error::Config(format!(
                "chunking.max_tokens = {max_tokens} must be between 1 and {} (the embedding model's limit of {model_max_length} minus {SPECIAL_TOKENS} special tokens)",
                model_max_length.saturating_sub(SPECIAL_TOKENS)
            )));
        }
        ChunkConfig::new(max_tokens).with_overlap(overlap).map_err(|e| {
            Error::Config(format!(
                "chunking.overlap = {overlap} must be smaller than chunking.max_tokens = {max_tokens}: {e}"
            ))
        })?;
        Ok(Splitter {
            max_tokens,
            overlap,
            tokenizer,
            fast_sizing: true,
        })
    }

    /// Tokenizes every candidate chunk (text-splitter's own way; slow). For checking the
    /// fast sizing against.
    pub fn with_exact_sizing(mut self) -> Self {
        self.fast_sizing = false;
        self
    }

    /// Chunks of one section as `(offset in section, text)`.
    fn split_section<'t>(&self, section: &'t str, format: Format) -> Vec<(usize, &'t str)> {
        fn run<S: ChunkSizer>(
            config: ChunkConfig<S>,
            section: &str,
            format: Format,
        ) -> Vec<(usize, &str)> {
            match format {
                Format::Markdown => MarkdownSplitter::new(config)
                    .chunk_indices(section)
                    .collect(),
                Format::Text => TextSplitter::new(config).chunk_indices(section).collect(),
            }
        }
        // the overlap was validated in `new`
        let config = ChunkConfig::new(self.max_tokens)
            .with_overlap(self.overlap)
            .unwrap_or_else(|_| ChunkConfig::new(self.max_tokens));
        match SectionSizer::new(&self.tokenizer, section).filter(|_| self.fast_sizing) {
            Some(sizer) => run(config.with_sizer(sizer), section, format),
            None => run(config.with_sizer(self.tokenizer.as_ref()), section, format),
        }
    }

    /// Largest chunk, in embedding-model tokens.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Tokens neighbouring chunks share.
    pub fn overlap(&self) -> usize {
        self.overlap
    }

    /// Token count of `text` without special tokens, as the sizer counts it.
    pub fn count_tokens(&self, text: &str) -> Result<usize> {
        self.tokenizer
            .encode_fast(text, false)
            .map(|e| e.len())
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Splits a document. Long documents are first cut at blank lines into sections of
    /// about [`SECTION_BYTES`], which are split in parallel: text-splitter's cost grows
    /// faster than linearly with the input (measured: 2.4× the time for 2× the text), so
    /// this keeps large files linear. Chunks never span two sections.
    pub fn split(&self, doc: &Document) -> Vec<Chunk> {
        self.split_in_sections(doc, SECTION_BYTES)
    }

    /// [`Splitter::split`] with another section size (tests and fuzzing use small ones to
    /// reach the section cut with short inputs).
    pub fn split_in_sections(&self, doc: &Document, section_bytes: usize) -> Vec<Chunk> {
        let sections = sections(&doc.text, section_bytes);
        let workers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(sections.len())
            .max(1);
        let per_worker = sections.len().div_ceil(workers);
        let pieces: Vec<(usize, &str)> = std::thread::scope(|scope| {
            let handles: Vec<_> = sections
                .chunks(per_worker.max(1))
                .map(|group| {
                    scope.spawn(move || {
                        let mut out = Vec::new();
                        for &(offset, section) in group {
                            let found = self.split_section(section, doc.format);
                            out.extend(found.into_iter().map(|(o, t)| (offset + o, t)));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let headings = match doc.format {
            Format::Markdown => headings(&doc.text),
            Format::Text => Vec::new(),
        };
        pieces
            .into_iter()
            .filter(|(_, t)| !t.trim().is_empty())
            .enumerate()
            .map(|(index, (start, text))| Chunk {
                index,
                text: text.to_string(),
                start,
                end: start + text.len(),
                heading: heading_at(&headings, start),
            })
            .collect()
    }
}

/// A Markdown ATX heading: where its line starts, its level (1–6) and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Heading {
    at: usize,
    level: usize,
    text: String,
}

/// Longest heading text kept per level (a heading is a title, not a paragraph).
const MAX_HEADING_CHARS: usize = 80;

/// The ATX headings (`# …` to `###### …`) of a Markdown text, in order; lines inside
/// fenced code blocks (``` or ~~~) are not headings.
fn headings(text: &str) -> Vec<Heading> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let start = at;
        at += line.len();
        let trimmed = line.trim_start_matches(' ');
        if line.len() - trimmed.len() > 3 {
            continue; // indented code
        }
        let trimmed = trimmed.trim_end();
        if let Some(open) = fence {
            if trimmed.starts_with(open) {
                fence = None;
            }
            continue;
        }
        if trimmed.starts_with("```") {
            fence = Some("```");
            continue;
        }
        if trimmed.starts_with("~~~") {
            fence = Some("~~~");
            continue;
        }
        let level = trimmed.bytes().take_while(|&b| b == b'#').count();
        if !(1..=6).contains(&level) {
            continue;
        }
        let rest = &trimmed[level..];
        if !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
            continue; // `#hashtag`, not a heading
        }
        // a closing sequence of #s is not part of the text
        let title = rest.trim().trim_end_matches('#').trim_end();
        if title.is_empty() {
            continue;
        }
        out.push(Heading {
            at: start,
            level,
            text: title.chars().take(MAX_HEADING_CHARS).collect(),
        });
    }
    out
}

/// Whether a text has Markdown ATX headings outside code blocks (how `docent eval` tells
/// Markdown passages from plain ones, as `docent ingest` tells them by file name).
pub fn has_headings(text: &str) -> bool {
    !headings(text).is_empty()
}

/// The heading path in force at byte `offset`: for each level, the last heading at or
/// before `offset` that no higher-level heading closed since.
fn heading_at(headings: &[Heading], offset: usize) -> String {
    let mut path: Vec<&Heading> = Vec::new();
    for h in headings.iter().take_while(|h| h.at <= offset) {
        while path.last().is_some_and(|p| p.level >= h.level) {
            path.pop();
        }
        path.push(h);
    }
    path.iter()
        .map(|h| h.text.as_str())
        .collect::<Vec<_>>()
        .join(" › ")
}

/// Counts the tokens of a candidate chunk from one tokenization of the whole section: the
/// tokens whose byte offsets lie inside the chunk. text-splitter sizes many candidates per
/// chunk, and tokenizing each of them was most of the ingest pipeline's work outside the
/// model (3.3 s of 19 s for the Rust Book with the int8 model).
///
/// This equals tokenizing the chunk alone when the chunk starts and ends between words,
/// because the model's pre-tokenizer splits on whitespace and punctuation first (BERT);
/// when a token straddles a chunk boundary, the chunk cuts a word (a control character
/// the normaliser deletes joins `a\0b` into one word: found by fuzzing), or the chunk is
/// not a slice of the section, the chunk is tokenized on its own. Tests compare both ways
/// on real text.
struct SectionSizer<'a> {
    tokenizer: &'a Tokenizer,
    base: usize,
    len: usize,
    starts: Vec<usize>,
    ends: Vec<usize>,
    /// The pre-tokenizer's word of each token.
    words: Vec<Option<u32>>,
}

impl<'a> SectionSizer<'a> {
    /// `None` when the tokenizer gives no usable offsets (not ordered).
    fn new(tokenizer: &'a Tokenizer, section: &str) -> Option<Self> {
        let enc = tokenizer.encode(section, false).ok()?;
        let (starts, ends): (Vec<usize>, Vec<usize>) = enc.get_offsets().iter().copied().unzip();
        let ordered = starts.windows(2).all(|w| w[0] <= w[1])
            && ends.windows(2).all(|w| w[0] <= w[1])
            && starts
                .iter()
                .zip(&ends)
                .all(|(s, e)| s <= e && *e <= section.len());
        ordered.then(|| SectionSizer {
            tokenizer,
            base: section.as_ptr() as usize,
            len: section.len(),
            starts,
            ends,
            words: enc.get_word_ids().to_vec(),
        })
    }

    fn exact(&self, chunk: &str) -> usize {
        ChunkSizer::size(self.tokenizer, chunk)
    }
}

impl ChunkSizer for SectionSizer<'_> {
    fn size(&self, chunk: &str) -> usize {
        let p = chunk.as_ptr() as usize;
        if p < self.base || p + chunk.len() > self.base + self.len {
            return self.exact(chunk);
        }
        let (a, b) = (p - self.base, p - self.base + chunk.len());
        let first = self.starts.partition_point(|&s| s < a);
        let past = self.ends.partition_point(|&e| e <= b);
        let straddles_start = first > 0 && self.ends[first - 1] > a;
        let straddles_end = past < self.starts.len() && self.starts[past] < b;
        // tokens `i - 1` and `i` are pieces of one word
        let joined = |i: usize| {
            i > 0
                && i < self.words.len()
                && self.words[i].is_some()
                && self.words[i] == self.words[i - 1]
        };
        if straddles_start || straddles_end || joined(first) || joined(past) {
            return self.exact(chunk);
        }
        past.saturating_sub(first)
    }
}

/// Bytes per section of a long document (see [`Splitter::split`]).
pub const SECTION_BYTES: usize = 32 * 1024;

/// Cuts `text` at blank lines into `(offset, section)` pieces of at most about `max`
/// bytes (a single longer paragraph stays whole).
fn sections(text: &str, max: usize) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = 0;
    while text.len() - start > max {
        let window_end = (start + max).min(text.len());
        let window_end = (window_end..=text.len())
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(text.len());
        let cut = text[start..window_end]
            .rfind("\n\n")
            .map(|i| start + i + 2)
            .filter(|&c| c > start)
            .or_else(|| text[window_end..].find("\n\n").map(|i| window_end + i + 2));
        match cut {
            Some(c) if c < text.len() => {
                out.push((start, &text[start..c]));
                start = c;
            }
            _ => break,
        }
    }
    if start < text.len() {
        out.push((start, &text[start..]));
    }
    out
}

/// Loads a `tokenizer.json` for sizing: padding and truncation off, so counts are true.
pub fn sizing_tokenizer(path: &std::path::Path) -> Result<Tokenizer> {
    let mut tok = Tokenizer::from_file(path)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    tok.with_padding(None);
    tok.with_truncation(None)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;

    /// A whitespace word-level tokenizer: one token per word or punctuation run. The real
    /// model tokenizer is exercised by the integration tests.
    fn word_tokenizer() -> Arc<Tokenizer> {
        let vocab = [("[UNK]".to_string(), 0u32)].into_iter().collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut tok = Tokenizer::new(model);
        tok.with_pre_tokenizer(Some(Whitespace {}));
        Arc::new(tok)
    }

    fn doc(text: &str, format: Format) -> Document {
        Document::from_text("/t", text.to_string(), format)
    }

    #[test]
    fn spans_point_into_the_text_and_respect_the_limit() {
        let s = Splitter::new(word_tokenizer(), 8, 2, 16).unwrap();
        let text = (0..100)
            .map(|i| format!("word{i}"))
            .collect::<Vec<_>>()
            .join(" ");
        let d = doc(&text, Format::Text);
        let chunks = s.split(&d);
        assert!(chunks.len() > 10);
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(c.index, i);
            assert_eq!(&d.text[c.start..c.end], c.text);
            assert!(s.count_tokens(&c.text).unwrap() <= 8, "{c:?}");
        }
        // overlap: consecutive chunks share text
        assert!(chunks[1].start < chunks[0].end);
        // coverage: first and last word present
        assert!(chunks[0].text.starts_with("word0"));
        assert!(chunks.last().unwrap().text.ends_with("word99"));
    }

    #[test]
    fn chunks_carry_the_heading_path_they_start_under() {
        let text = "Intro text here.\n\n# Guide\n\nalpha beta\n\n## Install #\n\ngamma delta\n\n\
                    ```sh\n# not a heading\n```\n\n### On Linux\n\nepsilon\n\n## Use\n\nzeta eta\n\n#tag\n";
        let h = headings(text);
        let names: Vec<(usize, &str)> = h.iter().map(|h| (h.level, h.text.as_str())).collect();
        assert_eq!(
            names,
            [(1, "Guide"), (2, "Install"), (3, "On Linux"), (2, "Use")]
        );
        let at = |needle: &str| heading_at(&h, text.find(needle).unwrap());
        assert_eq!(at("Intro"), "");
        assert_eq!(at("alpha"), "Guide");
        assert_eq!(at("## Install"), "Guide › Install");
        assert_eq!(at("# not"), "Guide › Install");
        assert_eq!(at("epsilon"), "Guide › Install › On Linux");
        // a level-2 heading closes the level-3 one under the previous level 2
        assert_eq!(at("zeta"), "Guide › Use");
        // through the splitter: Markdown chunks carry it, plain text never does
        let s = Splitter::new(word_tokenizer(), 6, 0, 16).unwrap();
        let md = s.split(&doc(text, Format::Markdown));
        let last = md.iter().find(|c| c.text.contains("zeta")).unwrap();
        assert_eq!(last.heading, "Guide › Use");
        assert!(s
            .split(&doc(text, Format::Text))
            .iter()
            .all(|c| c.heading.is_empty()));
    }

    #[test]
    fn markdown_splits_at_headings() {
        let s = Splitter::new(word_tokenizer(), 8, 0, 16).unwrap();
        let text = "# One\n\nalpha beta gamma delta\n\n# Two\n\nepsilon zeta eta theta\n";
        let chunks = s.split(&doc(text, Format::Markdown));
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        assert!(chunks[0].text.starts_with("# One"));
        assert!(chunks[1].text.starts_with("# Two"));
    }

    #[test]
    fn long_documents_are_cut_into_sections_at_blank_lines() {
        let para = "word ".repeat(50);
        let text = vec![para.as_str(); 40].join("\n\n");
        let secs = sections(&text, 1000);
        assert!(secs.len() > 5);
        let mut joined = String::new();
        for (off, sec) in &secs {
            assert_eq!(*off, joined.len());
            assert!(sec.len() <= 1000 + para.len());
            joined.push_str(sec);
        }
        assert_eq!(joined, text);
        // splitting through sections keeps spans exact
        let s = Splitter::new(word_tokenizer(), 16, 2, 32).unwrap();
        let d = doc(&text, Format::Text);
        let chunks = s.split_in_sections(&d, 1000);
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(c.index, i);
            assert_eq!(&d.text[c.start..c.end], c.text);
            assert!(s.count_tokens(&c.text).unwrap() <= 16);
        }
        assert!(chunks.windows(2).all(|w| w[0].start < w[1].start));
        assert!(text[chunks.last().unwrap().end..].trim().is_empty());
    }

    #[test]
    fn rejects_sizes_beyond_the_model_limit() {
        assert!(Splitter::new(word_tokenizer(), 255, 0, 256).is_err());
        assert!(Splitter::new(word_tokenizer(), 254, 0, 256).is_ok());
        assert!(Splitter::new(word_tokenizer(), 10, 10, 256).is_err());
    }
}

#[cfg(test)]
mod scaling {
    use super::*;

    /// Prints split time against document size (run by hand: `cargo test -p docent-ingest
    /// split_scaling -- --ignored --nocapture`).
    #[test]
    #[ignore = "measurement"]
    fn split_scaling() {
        let tok = sizing_tokenizer(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../models/all-MiniLM-L6-v2/tokenizer.json"),
        )
        .unwrap();
        let overlap = std::env::var("OVERLAP")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(24);
        let s = Splitter::new(Arc::new(tok), 200, overlap, 256).unwrap();
        let base = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/data/corpus/rfcs")
                .read_dir()
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
                .path(),
        )
        .unwrap();
        for copies in [1, 2, 4] {
            let text = base.repeat(copies);
            let d = Document::from_text("/x", text, Format::Text);
            let t = std::time::Instant::now();
            let n = s.split(&d).len();
            eprintln!(
                "{:>8} bytes: {n} chunks in {:.2} s",
                d.text.len(),
                t.elapsed().as_secs_f64()
            );
        }
    }
}
