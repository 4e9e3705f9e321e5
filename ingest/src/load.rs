//! Stage 1, **load**: read a file into a [`Document`] (text, title, content hash).
//!
//! Supported here: plain text (`.txt`) and Markdown (`.md`, `.markdown`).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// How a document's text is structured; decides which splitter is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Markdown,
}

/// File extensions the loader accepts, lower case, without the dot.
pub const SUPPORTED_EXTENSIONS: &[&str] = &["txt", "md", "markdown"];

/// A loaded document: the text that chunk spans point into, and its identity.
#[derive(Debug, Clone)]
pub struct Document {
    /// Hex SHA-256 of the text: the same content always has the same id.
    pub id: String,
    /// Where the document came from (an absolute path for files).
    pub source: String,
    pub title: String,
    pub text: String,
    pub format: Format,
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
        }
    }
}

/// The content hash used as document id.
pub fn content_id(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The format a path's extension maps to, or `None` if unsupported.
pub fn format_of(path: &Path) -> Option<Format> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    match ext.as_str() {
        "txt" => Some(Format::Text),
        "md" | "markdown" => Some(Format::Markdown),
        _ => None,
    }
}

/// Reads one file. The source recorded is the canonical absolute path, so the same
/// file named two ways is one source.
pub fn load_file(path: &Path) -> Result<Document> {
    let format = format_of(path).ok_or_else(|| Error::UnsupportedType {
        path: path.to_path_buf(),
        supported: SUPPORTED_EXTENSIONS.join(", "),
    })?;
    let canonical = path.canonicalize().map_err(|e| Error::io(path, e))?;
    let bytes = std::fs::read(&canonical).map_err(|e| Error::io(path, e))?;
    let mut text = String::from_utf8(bytes).map_err(|_| Error::NotUtf8 {
        path: path.to_path_buf(),
    })?;
    if text.starts_with('\u{feff}') {
        text.remove(0);
    }
    if text.trim().is_empty() {
        return Err(Error::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(Document::from_text(
        canonical.to_string_lossy().into_owned(),
        text,
        format,
    ))
}

/// Expands files and directories into the supported files below them, sorted.
/// A file named explicitly must be supported; files found in directories are
/// filtered by extension silently.
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            let mut found: Vec<PathBuf> = walkdir::WalkDir::new(path)
                .follow_links(true)
                .into_iter()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_file() && format_of(e.path()).is_some())
                .map(|e| e.into_path())
                .collect();
            found.sort();
            out.extend(found);
        } else if format_of(path).is_some() {
            out.push(path.clone());
        } else {
            return Err(Error::UnsupportedType {
                path: path.clone(),
                supported: SUPPORTED_EXTENSIONS.join(", "),
            });
        }
    }
    out.dedup();
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
        let pdf = dir.path().join("x.pdf");
        std::fs::write(&pdf, b"%PDF").unwrap();
        let err = load_file(&pdf).unwrap_err().to_string();
        assert!(
            err.contains("x.pdf") && err.contains("unsupported"),
            "{err}"
        );

        let empty = dir.path().join("e.txt");
        std::fs::write(&empty, b"  \n").unwrap();
        assert!(matches!(load_file(&empty), Err(Error::Empty { .. })));

        let bin = dir.path().join("b.txt");
        std::fs::write(&bin, [0xff, 0xfe, 0x00]).unwrap();
        assert!(matches!(load_file(&bin), Err(Error::NotUtf8 { .. })));
    }

    #[test]
    fn discover_walks_directories_and_filters() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a.md"), "# A").unwrap();
        std::fs::write(dir.path().join("b.txt"), "b").unwrap();
        std::fs::write(dir.path().join("c.png"), "c").unwrap();
        let found = discover(&[dir.path().to_path_buf()]).unwrap();
        let names: Vec<_> = found
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["b.txt", "a.md"]);
        assert!(discover(&[dir.path().join("c.png")]).is_err());
    }
}
