//! PDF to text, page by page (pdf-extract, which places text by position). The parser
//! panics on some malformed input by design, so every call into it is guarded; an
//! encrypted file or one without a text layer is refused with the reason.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::{Error, Result};

fn corrupt(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Corrupt {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Runs `f`, turning a panic inside the PDF parser into a `Corrupt` error.
fn guard<T>(path: &Path, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let m = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        corrupt(path, format!("the PDF parser failed: {m}"))
    })
}

/// The text of every page, in order (index 0 is page 1; empty pages are kept so that
/// numbering holds).
pub fn pages(path: &Path, bytes: &[u8]) -> Result<Vec<String>> {
    let doc = guard(path, || pdf_extract::Document::load_mem(bytes))?
        .map_err(|e| corrupt(path, format!("not a readable PDF: {e}")))?;
    if doc.is_encrypted() {
        return Err(Error::Encrypted {
            path: path.to_path_buf(),
        });
    }
    let page_numbers: Vec<u32> = doc.get_pages().keys().copied().collect();
    if page_numbers.is_empty() {
        return Err(corrupt(path, "the PDF has no pages"));
    }
    let mut out = Vec::with_capacity(page_numbers.len());
    for n in page_numbers {
        let mut text = String::new();
        let positional = guard(path, || {
            let mut output = pdf_extract::PlainTextOutput::new(&mut text);
            pdf_extract::output_doc_page(&doc, &mut output, n).is_ok()
        });
        if !matches!(positional, Ok(true)) {
            tracing::debug!(page = n, path = %path.display(), "positional extraction failed; using plain extraction");
            text = guard(path, || doc.extract_text(&[n]))
                .ok()
                .and_then(|r| r.ok())
                .unwrap_or_default();
        }
        out.push(text);
    }
    let has_text = out.iter().any(|p| p.chars().any(char::is_alphanumeric));
    if !has_text {
        return Err(Error::NoTextLayer {
            path: path.to_path_buf(),
            pages: out.len(),
        });
    }
    let total = out.iter().map(|p| p.chars().count()).sum::<usize>().max(1);
    let garbage = out
        .iter()
        .flat_map(|p| p.chars())
        .filter(|c| *c == '\u{FFFD}' || ('\u{E000}'..='\u{F8FF}').contains(c))
        .count();
    if garbage * 10 > total * 3 {
        return Err(corrupt(
            path,
            "the text layer cannot be decoded (its fonts lack a Unicode mapping)",
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_corrupt_not_a_panic() {
        let p = Path::new("x.pdf");
        assert!(matches!(pages(p, b"hello"), Err(Error::Corrupt { .. })));
        assert!(matches!(
            pages(p, b"%PDF-1.4\n1 0 obj\n<<>>\nendobj\ntrailer\n<<>>\n%%EOF"),
            Err(Error::Corrupt { .. })
        ));
    }
}
