//! Bytes to text: byte-order mark, then valid UTF-8, then a declared charset (HTML), then a
//! statistical guess (chardetng). Binary files are refused.

use std::path::Path;
use std::sync::LazyLock;

use chardetng::{EncodingDetector, Iso2022JpDetection, Utf8Detection};
use encoding_rs::{Encoding, REPLACEMENT, UTF_16BE, UTF_16LE, UTF_8};

use crate::{Error, Result};

/// Decodes `bytes`; `declared` is a charset label found in the document itself, if any.
pub fn decode(path: &Path, bytes: &[u8], declared: Option<&str>) -> Result<String> {
    if let Some((enc, bom)) = Encoding::for_bom(bytes) {
        return Ok(enc
            .decode_without_bom_handling(&bytes[bom..])
            .0
            .into_owned());
    }
    if bytes[..bytes.len().min(8192)].contains(&0) {
        return Err(Error::Binary {
            path: path.to_path_buf(),
        });
    }
    if let Ok(s) = std::str::from_utf8(bytes) {
        return Ok(s.to_owned());
    }
    let enc = declared
        .and_then(|l| Encoding::for_label(l.as_bytes()))
        .filter(|e| ![UTF_8, UTF_16LE, UTF_16BE, REPLACEMENT].contains(e))
        .unwrap_or_else(|| {
            let mut d = EncodingDetector::new(Iso2022JpDetection::Deny);
            d.feed(bytes, true);
            d.guess(None, Utf8Detection::Deny)
        });
    let (text, _, had_errors) = enc.decode(bytes);
    if had_errors {
        tracing::warn!(path = %path.display(), encoding = enc.name(), "undecodable bytes replaced");
    }
    Ok(text.into_owned())
}

static META_CHARSET: LazyLock<regex::bytes::Regex> = LazyLock::new(|| {
    regex::bytes::Regex::new(
        r#"(?i)<meta[^>]*charset\s*=\s*["']?\s*([-\w.:]+)|^\s*<\?xml[^>]*encoding\s*=\s*["']([-\w.:]+)"#,
    )
    .expect("valid regex")
});

/// The charset an HTML document declares in its first kilobyte.
pub fn declared_html_charset(bytes: &[u8]) -> Option<String> {
    let head = &bytes[..bytes.len().min(1024)];
    let caps = META_CHARSET.captures(head)?;
    let m = caps.get(1).or_else(|| caps.get(2))?;
    Some(String::from_utf8_lossy(m.as_bytes()).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_bom_legacy_and_binary() {
        let p = Path::new("x.txt");
        assert_eq!(decode(p, "héllo".as_bytes(), None).unwrap(), "héllo");
        assert_eq!(decode(p, b"\xEF\xBB\xBFhi", None).unwrap(), "hi");
        // windows-1252: "können äöüß"
        let legacy = b"Die Leute k\xF6nnen \xE4\xF6\xFC\xDF sagen, sch\xF6n.";
        let t = decode(p, legacy, None).unwrap();
        assert!(t.contains("können") && t.contains("äöüß"), "{t}");
        assert!(matches!(
            decode(p, b"ab\0cd", None),
            Err(Error::Binary { .. })
        ));
    }

    #[test]
    fn declared_charset_is_found_and_trusted_only_when_needed() {
        let html: &[u8] =
            b"<html><head><meta charset=\"windows-1252\"></head><body>caf\xE9</body></html>";
        assert_eq!(declared_html_charset(html).as_deref(), Some("windows-1252"));
        let t = decode(Path::new("x.html"), html, Some("windows-1252")).unwrap();
        assert!(t.contains("café"));
        // valid UTF-8 wins over a wrong declaration
        let t = decode(Path::new("x.html"), "café".as_bytes(), Some("windows-1252")).unwrap();
        assert_eq!(t, "café");
    }
}
