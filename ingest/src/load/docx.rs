//! DOCX to Markdown-like text: paragraphs in document order, heading styles as `#` lines,
//! list paragraphs as `- `, tables as `a | b` rows (nested tables flatten into their cell).
//! Headers and footers are left out, like page boilerplate in HTML. Read with zip and
//! roxmltree; no existing crate keeps document order and tables together.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use roxmltree::Node;

use crate::{Error, Result};

const W: &str = "http://schemas.openxmlformats.org/wordprocessingml/2006/main";
const W_STRICT: &str = "http://purl.oclc.org/ooxml/wordprocessingml/main";
const MAX_PART: u64 = 64 << 20;
const MAX_DEPTH: usize = 64;

fn corrupt(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Corrupt {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn is_w(n: &Node<'_, '_>, name: &str) -> bool {
    n.is_element()
        && n.tag_name().name() == name
        && matches!(n.tag_name().namespace(), Some(W) | Some(W_STRICT))
}

fn attr<'a>(n: &Node<'a, '_>, name: &str) -> Option<&'a str> {
    n.attribute((W, name))
        .or_else(|| n.attribute((W_STRICT, name)))
}

fn read_part(
    path: &Path,
    zip: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>,
    name: &str,
) -> Result<Option<String>> {
    let mut file = match zip.by_name(name) {
        Ok(f) => f,
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => return Err(corrupt(path, e)),
    };
    if file.encrypted() {
        return Err(Error::Encrypted {
            path: path.to_path_buf(),
        });
    }
    let mut buf = String::new();
    file.by_ref()
        .take(MAX_PART + 1)
        .read_to_string(&mut buf)
        .map_err(|e| corrupt(path, format!("{name}: {e}")))?;
    if buf.len() as u64 > MAX_PART {
        // a zip bomb, or a document too large to index: refused as too large
        return Err(Error::TooLarge {
            path: path.to_path_buf(),
            bytes: buf.len() as u64,
            limit: MAX_PART,
        });
    }
    Ok(Some(buf))
}

/// The document text.
pub fn to_markdown(path: &Path, bytes: &[u8]) -> Result<String> {
    if bytes.starts_with(&[0xD0, 0xCF, 0x11, 0xE0]) {
        // an OLE container: a password-protected DOCX (or a legacy .doc renamed)
        return Err(Error::Encrypted {
            path: path.to_path_buf(),
        });
    }
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| corrupt(path, format!("not a DOCX (zip) file: {e}")))?;
    let xml = read_part(path, &mut zip, "word/document.xml")?
        .ok_or_else(|| corrupt(path, "not a DOCX file: word/document.xml is missing"))?;
    let styles = read_part(path, &mut zip, "word/styles.xml")?;
    let levels = styles
        .as_deref()
        .and_then(|s| roxmltree::Document::parse(s).ok())
        .map(|d| heading_levels(&d))
        .unwrap_or_default();
    let doc = roxmltree::Document::parse(&xml).map_err(|e| corrupt(path, e))?;
    let body = doc
        .descendants()
        .find(|n| is_w(n, "body"))
        .ok_or_else(|| corrupt(path, "word/document.xml has no body"))?;
    let mut out = String::new();
    blocks(path, body, &levels, &mut out, 0)?;
    Ok(out.trim().to_string())
}

/// Paragraph style id → heading level, from styles.xml.
fn heading_levels(styles: &roxmltree::Document<'_>) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for style in styles.descendants().filter(|n| is_w(n, "style")) {
        let Some(id) = attr(&style, "styleId") else {
            continue;
        };
        let name = style
            .children()
            .find(|n| is_w(n, "name"))
            .and_then(|n| attr(&n, "val"))
            .unwrap_or("")
            .to_ascii_lowercase();
        let level = if name == "title" {
            Some(1)
        } else if let Some(l) = name.strip_prefix("heading ") {
            l.trim().parse().ok()
        } else {
            style
                .descendants()
                .find(|n| is_w(n, "outlineLvl"))
                .and_then(|n| attr(&n, "val"))
                .and_then(|v| v.parse::<usize>().ok())
                .map(|l| l + 1)
        };
        if let Some(l) = level.filter(|l| (1..=6).contains(l)) {
            out.insert(id.to_string(), l);
        }
    }
    out
}

fn paragraph_level(p: &Node<'_, '_>, levels: &HashMap<String, usize>) -> (Option<usize>, bool) {
    let Some(ppr) = p.children().find(|n| is_w(n, "pPr")) else {
        return (None, false);
    };
    let style = ppr
        .children()
        .find(|n| is_w(n, "pStyle"))
        .and_then(|n| attr(&n, "val"));
    let level = style.and_then(|s| {
        levels.get(s).copied().or_else(|| {
            s.strip_prefix("Heading")
                .and_then(|l| l.parse().ok())
                .filter(|l| (1..=6).contains(l))
        })
    });
    let list =
        ppr.children().any(|n| is_w(&n, "numPr")) || style.is_some_and(|s| s.starts_with("List"));
    (level, list)
}

fn blocks(
    path: &Path,
    node: Node<'_, '_>,
    levels: &HashMap<String, usize>,
    out: &mut String,
    depth: usize,
) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(corrupt(path, "the document is nested too deeply"));
    }
    for child in node.children().filter(Node::is_element) {
        match child.tag_name().name() {
            "p" => {
                let text = inline(child);
                if text.trim().is_empty() {
                    continue;
                }
                match paragraph_level(&child, levels) {
                    (Some(l), _) => {
                        out.push_str(&"#".repeat(l));
                        out.push(' ');
                    }
                    (None, true) => out.push_str("- "),
                    _ => {}
                }
                out.push_str(text.trim());
                out.push_str("\n\n");
            }
            "tbl" => {
                for row in child.children().filter(|n| is_w(n, "tr")) {
                    let cells: Vec<String> = row
                        .children()
                        .filter(|n| is_w(n, "tc"))
                        .map(|tc| {
                            let mut cell = String::new();
                            blocks(path, tc, levels, &mut cell, depth + 1)
                                .map(|_| cell.split_whitespace().collect::<Vec<_>>().join(" "))
                        })
                        .collect::<Result<_>>()?;
                    if cells.iter().any(|c| !c.is_empty()) {
                        out.push_str(&cells.join(" | "));
                        out.push('\n');
                    }
                }
                out.push('\n');
            }
            "sdt" | "sdtContent" | "customXml" | "ins" | "smartTag" | "txbxContent" => {
                blocks(path, child, levels, out, depth + 1)?
            }
            "AlternateContent" => {
                if let Some(choice) = child.children().find(|n| n.tag_name().name() == "Choice") {
                    blocks(path, choice, levels, out, depth + 1)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The text of one paragraph.
fn inline(p: Node<'_, '_>) -> String {
    let mut out = String::new();
    let mut stack = vec![p];
    // iterative pre-order walk that skips deleted text, field codes and fallbacks
    while let Some(n) = stack.pop() {
        if !n.is_element() {
            continue;
        }
        let name = n.tag_name().name();
        match name {
            "t" => out.push_str(n.text().unwrap_or("")),
            "tab" => out.push('\t'),
            "br" | "cr" => out.push('\n'),
            "noBreakHyphen" => out.push('-'),
            "delText" | "instrText" | "Fallback" | "del" | "pPr" | "rPr" => {}
            _ => {
                let children: Vec<_> = n.children().collect();
                stack.extend(children.into_iter().rev());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_a_docx_is_corrupt() {
        let p = Path::new("x.docx");
        let e = to_markdown(p, b"hello").unwrap_err().to_string();
        assert!(e.contains("x.docx") && e.contains("not a DOCX"), "{e}");
        // a zip without word/document.xml
        let mut buf = std::io::Cursor::new(Vec::new());
        {
            let mut w = zip::ZipWriter::new(&mut buf);
            w.start_file("a.txt", zip::write::SimpleFileOptions::default())
                .unwrap();
            std::io::Write::write_all(&mut w, b"x").unwrap();
            w.finish().unwrap();
        }
        let e = to_markdown(p, buf.get_ref()).unwrap_err().to_string();
        assert!(e.contains("word/document.xml"), "{e}");
    }
}
