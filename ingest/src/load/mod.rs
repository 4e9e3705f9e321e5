//! Stage 1, **load**: read a file into a [`Document`] (text, title, content hash, pages).
//!
//! Supported: plain text (`.txt`), Markdown (`.md`, `.markdown`), HTML (`.html`, `.htm`),
//! PDF (`.pdf`, text per page) and DOCX (`.docx`). HTML and DOCX become Markdown-like text
//! (headings as `#` lines) so that chunking can follow their structure. Text files in legacy
//! encodings are decoded; binary, encrypted, image-only and corrupt files are refused with
//! the reason.

mod docx;
mod html;
mod pdf;
mod text;

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// How a document's text is structured; decides which splitter is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Plain text: split on paragraphs and sentences.
    Text,
    /// Markdown (and HTML and DOCX, converted to it): split on headings first.
    Markdown,
}

/// File extensions the loader accepts, lower case, without the dot.
pub const SUPPORTED_EXTENSIONS: &[&str] = &["txt", "md", "markdown", "html", "htm", "pdf", "docx"];

/// Files larger than this are refused before parsing.
pub const MAX_FILE_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Markdown,
    Html,
    Pdf,
    Docx,
}

fn kind_of(path: &Path) -> Option<Kind> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    Some(match ext.as_str() {
        "txt" => Kind::Text,
        "md" | "markdown" => Kind::Markdown,
        "html" | "htm" => Kind::Html,
        "pdf" => Kind::Pdf,
        "docx" => Kind::Docx,
        _ => return None,
    })
}

/// A loaded document: the text that chunk spans point into, and its identity.
#[derive(Debug, Clone)]
pub struct Document {
    /// Hex SHA-256 of the text: the same content always has the same id.
    pub id: String,
    /// Where the document came from (an absolute path for files).
    pub source: String,
    /// The document's title: a Markdown (or converted HTML, DOCX) document's first heading
    /// or the HTML `<title>`, else the file name without its extension.
    pub title: String,
    /// The extracted text (UTF-8, no byte-order mark).
    pub text: String,
    /// How the text is structured (decides the splitter).
    pub format: Format,
    /// Byte offsets in `text` where pages 1, 2, … start (empty when the format has no pages).
    pub page_starts: Vec<usize>,
    /// Optional grouping given at upload time, stored with every chunk for filtering.
    pub collection: Option<String>,
    /// Optional labels given at upload time, stored with every chunk for filtering.
    pub tags: Vec<String>,
}

impl Document {
    /// Builds a document from text already in memory.
    pub fn from_text(source: impl Into<String>, text: String, format: Format) -> Self {
        let source = source.into();
        let title = title_of(&source, &text, format);
        Document {
            id: content_id(&text),
            source,
            title,
            text,
            format,
            page_starts: Vec::new(),
            collection: None,
            tags: Vec::new(),
        }
    }

    /// Builds a document from pages of text, joined by blank lines.
    pub fn from_pages(source: impl Into<String>, pages: &[String]) -> Self {
        let mut text = String::new();
        let mut page_starts = Vec::with_capacity(pages.len());
        for (i, p) in pages.iter().enumerate() {
            if i > 0 {
                text.push_str("\n\n");
            }
            page_starts.push(text.len());
            text.push_str(p.trim_end());
        }
        let mut doc = Document::from_text(source, text, Format::Text);
        doc.page_starts = page_starts;
        doc
    }

    /// The 1-based page that byte offset `at` falls on, for paged formats.
    pub fn page_of(&self, at: usize) -> Option<u32> {
        if self.page_starts.is_empty() {
            return None;
        }
        let n = self.page_starts.partition_point(|&s| s <= at);
        u32::try_from(n.max(1)).ok()
    }
}

/// The content hash used as document id.
pub fn content_id(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Whether the loader can read files with this path's extension.
pub fn is_supported(path: &Path) -> bool {
    kind_of(path).is_some()
}

fn unsupported(path: &Path) -> Error {
    Error::UnsupportedType {
        path: path.to_path_buf(),
        supported: SUPPORTED_EXTENSIONS.join(", "),
    }
}

/// Reads one file. The source recorded is the canonical absolute path, so the same
/// file named two ways is one source.
pub fn load_file(path: &Path) -> Result<Document> {
    if kind_of(path).is_none() {
        return Err(unsupported(path));
    }
    let canonical = path.canonicalize().map_err(|e| Error::io(path, e))?;
    let len = std::fs::metadata(&canonical)
        .map_err(|e| Error::io(path, e))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(Error::TooLarge {
            path: path.to_path_buf(),
            bytes: len,
            limit: MAX_FILE_BYTES,
        });
    }
    let bytes = std::fs::read(&canonical).map_err(|e| Error::io(path, e))?;
    load_bytes(path, &canonical.to_string_lossy(), &bytes)
}

/// Parses a document from memory. `name` (its extension decides the format) is used in
/// errors; `source` is recorded with the chunks.
pub fn load_bytes(name: &Path, source: &str, bytes: &[u8]) -> Result<Document> {
    let kind = kind_of(name).ok_or_else(|| unsupported(name))?;
    let doc = match kind {
        Kind::Text | Kind::Markdown => {
            let format = if kind == Kind::Text {
                Format::Text
            } else {
                Format::Markdown
            };
            Document::from_text(source, text::decode(name, bytes, None)?, format)
        }
        Kind::Html => {
            let declared = text::declared_html_charset(bytes);
            let html = text::decode(name, bytes, declared.as_deref())?;
            let (body, title) = html::to_markdown(&html);
            let mut doc = Document::from_text(source, body, Format::Markdown);
            if let Some(t) = title {
                doc.title = t;
            }
            doc
        }
        Kind::Pdf => Document::from_pages(source, &pdf::pages(name, bytes)?),
        Kind::Docx => {
            Document::from_text(source, docx::to_markdown(name, bytes)?, Format::Markdown)
        }
    };
    let mut doc = doc;
    if doc.text.starts_with('\u{feff}') {
        doc = Document {
            text: doc.text.trim_start_matches('\u{feff}').to_string(),
            ..doc
        };
        doc.id = content_id(&doc.text);
    }
    if doc.text.trim().is_empty() {
        return Err(Error::Empty {
            path: name.to_path_buf(),
        });
    }
    Ok(doc)
}

/// Files found by [`discover`].
#[derive(Debug, Default)]
pub struct Discovered {
    /// Supported files, sorted per directory.
    pub files: Vec<PathBuf>,
    /// Files in the given directories that are not of a supported type.
    pub skipped: Vec<PathBuf>,
}

/// Expands files and directories into the supported files below them. A file named
/// explicitly must be supported; unsupported files found in directories are listed in
/// `skipped`.
pub fn discover(paths: &[PathBuf]) -> Result<Discovered> {
    let mut out = Discovered::default();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            let mut found: Vec<PathBuf> = walkdir::WalkDir::new(path)
                .follow_links(true)
                .into_iter()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_file())
                .map(|e| e.into_path())
                .collect();
            found.sort();
            for f in found {
                if is_supported(&f) {
                    out.files.push(f);
                } else {
                    out.skipped.push(f);
                }
            }
        } else if is_supported(path) {
            out.files.push(path.clone());
        } else {
            return Err(unsupported(path));
        }
    }
    out.files.dedup();
    Ok(out)
}

/// Markdown: the first ATX heading; otherwise the file stem.
fn title_of(source: &str, text: &str, format: Format) -> String {
    if format == Format::Markdown {
        if let Some(h) = text
            .lines()
            .map(str::trim_start)
            .find(|l| l.starts_with('#'))
            .map(|l| l.trim_start_matches('#').trim())
            .filter(|h| !h.is_empty())
        {
            return h.to_string();
        }
    }
    Path::new(source)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| source.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_title_is_first_heading() {
        let d = Document::from_text(
            "/x/ch01.md",
            "intro\n## Getting Started\ntext".into(),
            Format::Markdown,
        );
        assert_eq!(d.title, "Getting Started");
        let t = Document::from_text("/x/notes.txt", "# not a heading".into(), Format::Text);
        assert_eq!(t.title, "notes");
    }

    #[test]
    fn pages_map_offsets_to_page_numbers() {
        let d = Document::from_pages("/x.pdf", &["one".into(), "two ".into(), "three".into()]);
        assert_eq!(d.text, "one\n\ntwo\n\nthree");
        assert_eq!(d.page_starts, vec![0, 5, 10]);
        assert_eq!(d.page_of(0), Some(1));
        assert_eq!(d.page_of(4), Some(1));
        assert_eq!(d.page_of(5), Some(2));
        assert_eq!(d.page_of(12), Some(3));
        assert_eq!(
            Document::from_text("/a", "x".into(), Format::Text).page_of(0),
            None
        );
    }

    #[test]
    fn id_is_content_hash() {
        let a = Document::from_text("/a.txt", "same".into(), Format::Text);
        let b = Document::from_text("/b.txt", "same".into(), Format::Text);
        let c = Document::from_text("/a.txt", "other".into(), Format::Text);
        assert_eq!(a.id, b.id);
        assert_ne!(a.id, c.id);
        assert_eq!(a.id.len(), 64);
    }

    #[test]
    fn load_rejects_bad_files_with_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let pptx = dir.path().join("x.pptx");
        std::fs::write(&pptx, b"PK").unwrap();
        let err = load_file(&pptx).unwrap_err().to_string();
        assert!(
            err.contains("x.pptx") && err.contains("unsupported"),
            "{err}"
        );
        let pdf = dir.path().join("x.pdf");
        std::fs::write(&pdf, b"%PDF").unwrap();
        let err = load_file(&pdf).unwrap_err().to_string();
        assert!(err.contains("x.pdf") && err.contains("corrupt"), "{err}");

        let empty = dir.path().join("e.txt");
        std::fs::write(&empty, b"  \n").unwrap();
        assert!(matches!(load_file(&empty), Err(Error::Empty { .. })));

        let bin = dir.path().join("b.txt");
        std::fs::write(&bin, [0x01, 0x00, 0x02]).unwrap();
        assert!(matches!(load_file(&bin), Err(Error::Binary { .. })));
    }

    #[test]
    fn discover_walks_directories_and_filters() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a.md"), "# A").unwrap();
        std::fs::write(dir.path().join("b.txt"), "b").unwrap();
        std::fs::write(dir.path().join("c.png"), "c").unwrap();
        let found = discover(&[dir.path().to_path_buf()]).unwrap();
        assert_eq!(found.skipped.len(), 1);
        assert!(found.skipped[0].ends_with("c.png"));
        let names: Vec<_> = found
            .files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["b.txt", "a.md"]);
        assert!(discover(&[dir.path().join("c.png")]).is_err());
    }
}
