//! Stage 2, **split**: token-aware chunks with byte spans into the document text.
//!
//! Sizes are counted with the embedding model's own tokenizer (truncation and padding
//! off), so no chunk exceeds what the model can embed. Markdown is split on its
//! structure (headings, blocks, sentences) before falling back to smaller units.

use std::sync::Arc;

use text_splitter::{ChunkConfig, MarkdownSplitter, TextSplitter};
use tokenizers::Tokenizer;

use crate::load::{Document, Format};
use crate::{Error, Result};

/// Special tokens BERT-style models add around every input ([CLS] and [SEP]).
pub const SPECIAL_TOKENS: usize = 2;

/// One chunk of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub index: usize,
    pub text: String,
    /// Byte range in [`Document::text`]: `&doc.text[start..end] == text`.
    pub start: usize,
    pub end: usize,
}

/// Splits documents into chunks of at most `max_tokens` tokens with `overlap` tokens shared
/// between neighbours.
pub struct Splitter {
    text: TextSplitter<Arc<Tokenizer>>,
    markdown: MarkdownSplitter<Arc<Tokenizer>>,
    max_tokens: usize,
    overlap: usize,
    tokenizer: Arc<Tokenizer>,
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
        let config = |t: Arc<Tokenizer>| {
            ChunkConfig::new(max_tokens)
                .with_overlap(overlap)
                .map(|c| c.with_sizer(t))
                .map_err(|e| {
                    Error::Config(format!(
                        "chunking.overlap = {overlap} must be smaller than chunking.max_tokens = {max_tokens}: {e}"
                    ))
                })
        };
        Ok(Splitter {
            text: TextSplitter::new(config(tokenizer.clone())?),
            markdown: MarkdownSplitter::new(config(tokenizer.clone())?),
            max_tokens,
            overlap,
            tokenizer,
        })
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

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

    pub fn split(&self, doc: &Document) -> Vec<Chunk> {
        let pieces: Vec<(usize, &str)> = match doc.format {
            Format::Markdown => self.markdown.chunk_indices(&doc.text).collect(),
            Format::Text => self.text.chunk_indices(&doc.text).collect(),
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
            })
            .collect()
    }
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
    fn markdown_splits_at_headings() {
        let s = Splitter::new(word_tokenizer(), 8, 0, 16).unwrap();
        let text = "# One\n\nalpha beta gamma delta\n\n# Two\n\nepsilon zeta eta theta\n";
        let chunks = s.split(&doc(text, Format::Markdown));
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        assert!(chunks[0].text.starts_with("# One"));
        assert!(chunks[1].text.starts_with("# Two"));
    }

    #[test]
    fn rejects_sizes_beyond_the_model_limit() {
        assert!(Splitter::new(word_tokenizer(), 255, 0, 256).is_err());
        assert!(Splitter::new(word_tokenizer(), 254, 0, 256).is_ok());
        assert!(Splitter::new(word_tokenizer(), 10, 10, 256).is_err());
    }
}
