//! Personal data in text: found by pattern on a normalised view (NFKC, invisible format
//! characters dropped) and checked by the rules of each kind (Luhn for card numbers, ISO
//! 13616 mod 97 for IBANs, the SSA's reserved ranges for US SSNs, octet ranges for IPv4),
//! then redacted or masked per kind, cutting the original text exactly.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};
use unicode_normalization::UnicodeNormalization;

/// A kind of personal data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PiiKind {
    /// An email address.
    Email,
    /// A phone number (an optional country code, then 7–15 digits in groups).
    Phone,
    /// A payment card number: 12–19 digits that pass the Luhn check.
    CreditCard,
    /// An IBAN that passes the ISO 13616 mod-97 check.
    Iban,
    /// A US Social Security number outside the SSA's reserved ranges.
    UsSsn,
    /// An IPv4 or IPv6 address.
    IpAddress,
    /// An API key or token: a well-known prefix (`sk-`, `ghp_`, `AKIA`…), or a long mixed
    /// string of high entropy.
    ApiKey,
}

impl PiiKind {
    /// Every kind.
    pub const ALL: [PiiKind; 7] = [
        PiiKind::Email,
        PiiKind::Phone,
        PiiKind::CreditCard,
        PiiKind::Iban,
        PiiKind::UsSsn,
        PiiKind::IpAddress,
        PiiKind::ApiKey,
    ];

    /// The name in reasons and redactions (`pii:email`, `[email]`).
    pub fn name(self) -> &'static str {
        match self {
            PiiKind::Email => "email",
            PiiKind::Phone => "phone",
            PiiKind::CreditCard => "credit_card",
            PiiKind::Iban => "iban",
            PiiKind::UsSsn => "us_ssn",
            PiiKind::IpAddress => "ip_address",
            PiiKind::ApiKey => "api_key",
        }
    }
}

/// What to do with a kind of personal data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PiiAction {
    /// Replaced by `[kind]`.
    #[default]
    Redact,
    /// All but the last four letters or digits replaced by `*`.
    Mask,
    /// Left as it is.
    Allow,
}

/// One match, in byte offsets of the original text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PiiMatch {
    /// What was found.
    pub kind: PiiKind,
    /// First byte of the match.
    pub start: usize,
    /// End of the match (exclusive).
    pub end: usize,
}

/// The text as the patterns see it, with each normalised byte's original byte range.
pub(crate) struct Normalised {
    pub(crate) text: String,
    /// For each byte of `text`: the start of the original character it came from.
    pub(crate) origin: Vec<usize>,
    /// For each byte of `text`: the end of that original character.
    pub(crate) origin_end: Vec<usize>,
}

/// Zero-width and other invisible format characters that split a number without showing.
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2064}' | '\u{FEFF}'
    )
}

/// `text` as the patterns see it: NFKC, invisible format characters dropped.
pub(crate) fn normalise(text: &str) -> Normalised {
    let mut out = Normalised {
        text: String::with_capacity(text.len()),
        origin: Vec::with_capacity(text.len()),
        origin_end: Vec::with_capacity(text.len()),
    };
    for (i, c) in text.char_indices() {
        if invisible(c) {
            continue;
        }
        let end = i + c.len_utf8();
        for n in std::iter::once(c).nfkc() {
            // look-alike separators become plain ones
            let n = match n {
                '\u{2010}'..='\u{2015}' | '\u{2212}' => '-',
                c if c.is_whitespace() && c != '\n' => ' ',
                c => c,
            };
            let before = out.text.len();
            out.text.push(n);
            for _ in before..out.text.len() {
                out.origin.push(i);
                out.origin_end.push(end);
            }
        }
    }
    out
}

static EMAIL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b[a-z0-9._%+\-]+\s?(?:@|\(at\)|\[at\])\s?[a-z0-9\-]+(?:\.[a-z0-9\-]+)*\.[a-z]{2,24}\b")
        .expect("valid regex")
});
/// 12–19 digits in groups separated by single spaces or dashes.
static CARD: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b\d(?:[ \-]?\d){11,18}\b").expect("valid regex"));
/// Country code, check digits, then groups of four (spaced or not) and a short last group.
static IBAN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b[a-z]{2}\d{2}(?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,4})?\b")
        .expect("valid regex")
});
static SSN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(\d{3})([ \-]?)(\d{2})([ \-]?)(\d{4})\b").expect("valid regex")
});
static IPV4: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})\b").expect("valid regex")
});
static IPV6: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}\b|(?i)\b(?:[0-9a-f]{1,4}:){1,7}:(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){0,6})?\b")
        .expect("valid regex")
});
/// Phone numbers: an optional country code, then 7–15 digits in groups (spaces, dashes,
/// dots, parentheses). Validated by digit count and grouping below.
static PHONE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"(?:\+\d{1,3}[ .\-]?)?(?:\(0?\d{1,4}\)[ .\-]?)?\d{2,5}(?:[ .\-]\d{2,5}){1,4}",
        r"(?:\s?(?:x|ext\.?)\s?\d{1,5})?\b|\b\d{10,12}\b"
    ))
    .expect("valid regex")
});
/// Words that say a number nearby is a phone number.
static PHONE_CONTEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(phone|tel\b|telephone|call|mobile|cell|fax|desk|office|number|messages to|answering at|contact|reach|dial|whatsapp|sms|text me)")
        .expect("valid regex")
});
static DATE_START: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\d{4}[-./]\d{1,2}[-./]\d{1,2}").expect("valid regex"));
static NANP: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\(?\d{3}\)?[ .\-]?\d{3}[.\-]\d{4}").expect("valid regex"));

/// Whether a phone-shaped match is a phone number: international or area-code forms, three
/// or more groups and the North American shape stand on their own; two bare groups or an
/// unseparated run of digits need a word like "phone" or "call" before them (only what
/// comes before counts: a streamed answer must be decidable when the number is complete).
fn phone_ok(t: &str, start: usize, end: usize) -> bool {
    let s = &t[start..end];
    let d = digits(s.split(['x', 'e']).next().unwrap_or(s));
    if !(7..=15).contains(&d.len()) || DATE_START.is_match(s) {
        return false;
    }
    // part of a longer number or a decimal
    let before = t[..start].chars().next_back();
    if before.is_some_and(|c| c.is_ascii_digit() || c == '.' || c == ',') {
        return false;
    }
    let groups = s.split([' ', '-', '.']).filter(|g| !g.is_empty()).count();
    let strong = s.starts_with('+') || s.contains('(') || groups >= 3 || NANP.is_match(s);
    if strong {
        return true;
    }
    let mut from = start.saturating_sub(40);
    while !t.is_char_boundary(from) {
        from -= 1;
    }
    PHONE_CONTEXT.is_match(&t[from..start])
}
/// Keys and tokens with well-known prefixes.
static KEY_PREFIXED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"\b(?:sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}",
        r"|gh[pousr]_[A-Za-z0-9]{30,}",
        r"|github_pat_[A-Za-z0-9_]{40,}",
        r"|xox[abpors]-[A-Za-z0-9\-]{10,}",
        r"|AKIA[0-9A-Z]{16}",
        r"|AIza[0-9A-Za-z_\-]{35}",
        r"|glpat-[A-Za-z0-9_\-]{20,}",
        r"|hf_[A-Za-z0-9]{30,}",
        r"|(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}",
        r"|eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,})"
    ))
    .expect("valid regex")
});
/// Long mixed strings that may be secrets; kept when their entropy is high.
static KEY_GENERIC: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b[A-Za-z0-9+/_\-]{32,}={0,2}").expect("valid regex"));

/// The Luhn checksum of a digit string.
pub fn luhn(digits: &str) -> bool {
    let mut sum = 0;
    for (i, d) in digits.bytes().rev().enumerate() {
        let mut v = u32::from(d - b'0');
        if i % 2 == 1 {
            v *= 2;
            if v > 9 {
                v -= 9;
            }
        }
        sum += v;
    }
    sum % 10 == 0
}

/// The ISO 13616 check of an IBAN (letters and digits, any case, no spaces).
pub fn iban_valid(iban: &str) -> bool {
    let s: String = iban.chars().filter(|c| !c.is_whitespace()).collect();
    if !(15..=34).contains(&s.len()) || !s.is_ascii() {
        return false;
    }
    let (head, tail) = s.split_at(4);
    let mut rem: u32 = 0;
    for c in tail.chars().chain(head.chars()) {
        let v = match c.to_ascii_uppercase() {
            d @ '0'..='9' => d as u32 - '0' as u32,
            l @ 'A'..='Z' => l as u32 - 'A' as u32 + 10,
            _ => return false,
        };
        rem = if v >= 10 {
            (rem * 100 + v) % 97
        } else {
            (rem * 10 + v) % 97
        };
    }
    rem == 1
}

/// Shannon entropy in bits per character.
fn entropy(s: &str) -> f64 {
    let mut counts = BTreeMap::new();
    for c in s.chars() {
        *counts.entry(c).or_insert(0usize) += 1;
    }
    let n = s.chars().count() as f64;
    counts
        .values()
        .map(|&k| {
            let p = k as f64 / n;
            -p * p.log2()
        })
        .sum()
}

fn digits(s: &str) -> String {
    s.chars().filter(char::is_ascii_digit).collect()
}

/// Candidates of every kind in the normalised text, checked; overlapping matches keep the
/// more specific kind (the order of checks below).
fn candidates(t: &str) -> Vec<(PiiKind, usize, usize)> {
    let mut found: Vec<(PiiKind, usize, usize)> = Vec::new();
    let mut add = |kind, start, end| found.push((kind, start, end));
    for m in KEY_PREFIXED.find_iter(t) {
        add(PiiKind::ApiKey, m.start(), m.end());
    }
    for m in EMAIL.find_iter(t) {
        add(PiiKind::Email, m.start(), m.end());
    }
    for m in IBAN.find_iter(t) {
        // the longest prefix (whole groups) that passes the check: a following word may
        // have been taken for a last group
        let s = m.as_str();
        let ends = std::iter::once(s.len()).chain(s.rmatch_indices(' ').map(|(i, _)| i));
        if let Some(end) = ends.into_iter().find(|&e| iban_valid(&s[..e])) {
            add(PiiKind::Iban, m.start(), m.start() + end);
        }
    }
    for m in CARD.find_iter(t) {
        let d = digits(m.as_str());
        // 13-19 digits; 12 only for Maestro (50, 56-69)
        let maestro =
            d.len() == 12 && matches!(d.as_bytes()[..2], [b'5', b'0' | b'6'..=b'9'] | [b'6', _]);
        if ((13..=19).contains(&d.len()) || maestro) && luhn(&d) {
            add(PiiKind::CreditCard, m.start(), m.end());
        }
    }
    for c in SSN.captures_iter(t) {
        let (Some(whole), Some(area), Some(group), Some(serial)) =
            (c.get(0), c.get(1), c.get(3), c.get(5))
        else {
            continue;
        };
        // the same separator twice, or none; no SSN starts with 000, 666 or 9xx, and
        // neither group nor serial is all zeros
        let same_sep = c.get(2).map(|m| m.as_str()) == c.get(4).map(|m| m.as_str());
        let area = area.as_str();
        if same_sep
            && area != "000"
            && area != "666"
            && !area.starts_with('9')
            && group.as_str() != "00"
            && serial.as_str() != "0000"
        {
            add(PiiKind::UsSsn, whole.start(), whole.end());
        }
    }
    for c in IPV4.captures_iter(t) {
        let octets: Vec<u32> = (1..=4)
            .filter_map(|i| c.get(i)?.as_str().parse().ok())
            .collect();
        let Some(whole) = c.get(0) else { continue };
        // not a version number (1.2.3.4 in "version 1.2.3.4" is rare enough; all octets
        // must be in range and the address not followed by another dotted part)
        let dotted_on = t[whole.end()..].starts_with('.')
            && t[whole.end() + 1..].starts_with(|ch: char| ch.is_ascii_digit());
        if octets.len() == 4 && octets.iter().all(|&o| o <= 255) && !dotted_on {
            add(PiiKind::IpAddress, whole.start(), whole.end());
        }
    }
    for m in IPV6.find_iter(t) {
        // at least three groups with a hex letter or a "::": not a time like 12:30:45
        let s = m.as_str();
        if s.matches(':').count() >= 3
            && (s.contains("::") || s.chars().any(|c| c.is_ascii_alphabetic()))
        {
            add(PiiKind::IpAddress, m.start(), m.end());
        }
    }
    for m in PHONE.find_iter(t) {
        if phone_ok(t, m.start(), m.end()) {
            add(PiiKind::Phone, m.start(), m.end());
        }
    }
    for m in KEY_GENERIC.find_iter(t) {
        let s = m.as_str();
        let has_digit = s.chars().any(|c| c.is_ascii_digit());
        let has_upper = s.chars().any(|c| c.is_ascii_uppercase());
        let has_lower = s.chars().any(|c| c.is_ascii_lowercase());
        if has_digit && has_upper && has_lower && entropy(s) >= 4.0 {
            add(PiiKind::ApiKey, m.start(), m.end());
        }
    }
    // keep the first (most specific) of overlapping matches
    let mut kept: Vec<(PiiKind, usize, usize)> = Vec::new();
    for (k, s, e) in found {
        if kept.iter().all(|&(_, ks, ke)| e <= ks || s >= ke) {
            kept.push((k, s, e));
        }
    }
    kept.sort_by_key(|&(_, s, _)| s);
    kept
}

/// Personal data in `text`, in byte offsets of `text`, in order.
pub fn find_pii(text: &str) -> Vec<PiiMatch> {
    let n = normalise(text);
    candidates(&n.text)
        .into_iter()
        .map(|(kind, s, e)| PiiMatch {
            kind,
            start: n.origin[s],
            end: n.origin_end[e - 1],
        })
        .collect()
}

/// Per-kind actions; kinds not listed are redacted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PiiRules(pub BTreeMap<PiiKind, PiiAction>);

impl Default for PiiRules {
    /// Every kind redacted, listed explicitly.
    fn default() -> Self {
        PiiRules(
            PiiKind::ALL
                .iter()
                .map(|&k| (k, PiiAction::Redact))
                .collect(),
        )
    }
}

impl PiiRules {
    /// What to do with `kind` (redact when not listed).
    pub fn action(&self, kind: PiiKind) -> PiiAction {
        self.0.get(&kind).copied().unwrap_or_default()
    }
}

/// `text` with personal data redacted or masked as `rules` say, and the kinds acted on.
pub fn redact(text: &str, rules: &PiiRules) -> (String, Vec<PiiKind>) {
    let mut out = String::with_capacity(text.len());
    let mut kinds = Vec::new();
    let mut last = 0;
    for m in find_pii(text) {
        let action = rules.action(m.kind);
        if action == PiiAction::Allow {
            continue;
        }
        out.push_str(&text[last..m.start]);
        let original = &text[m.start..m.end];
        match action {
            PiiAction::Redact => {
                out.push('[');
                out.push_str(m.kind.name());
                out.push(']');
            }
            PiiAction::Mask => {
                let visible: Vec<usize> = original
                    .char_indices()
                    .filter(|(_, c)| c.is_alphanumeric())
                    .map(|(i, _)| i)
                    .collect();
                let keep_from = visible
                    .len()
                    .checked_sub(4)
                    .map_or(original.len(), |k| visible[k]);
                for (i, c) in original.char_indices() {
                    out.push(if i < keep_from && c.is_alphanumeric() {
                        '*'
                    } else {
                        c
                    });
                }
            }
            PiiAction::Allow => {}
        }
        kinds.push(m.kind);
        last = m.end;
    }
    out.push_str(&text[last..]);
    (out, kinds)
}
