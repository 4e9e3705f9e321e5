//! HTML to Markdown-like text: headings become `#` lines (so the Markdown splitter can use
//! them), lists and table rows are kept; scripts, styles, navigation, forms, hidden elements
//! and page-level headers and footers are dropped. The walk is iterative, so deeply nested
//! markup cannot overflow the stack.

use ego_tree::iter::Edge;
use scraper::{ElementRef, Html, Node, Selector};

const DROPPED: &[&str] = &[
    "script",
    "style",
    "noscript",
    "template",
    "head",
    "nav",
    "aside",
    "form",
    "button",
    "select",
    "svg",
    "canvas",
    "iframe",
    "object",
    "embed",
    "ix:header",
];
const BLOCKS: &[&str] = &[
    "p",
    "div",
    "ul",
    "ol",
    "table",
    "blockquote",
    "dl",
    "dt",
    "dd",
    "figure",
    "figcaption",
    "hr",
    "address",
    "details",
    "summary",
    "body",
    "center",
];
const DROPPED_ROLES: &[&str] = &[
    "navigation",
    "banner",
    "contentinfo",
    "complementary",
    "search",
];

/// The extracted text and the document's `<title>`, if any.
pub fn to_markdown(html: &str) -> (String, Option<String>) {
    let doc = Html::parse_document(html);
    let title = Selector::parse("title")
        .ok()
        .and_then(|sel| {
            doc.select(&sel)
                .next()
                .map(|t| t.text().collect::<String>())
        })
        .map(|t| collapse(&t))
        .filter(|t| !t.is_empty());

    let mut out = String::new();
    let mut skip = None;
    let mut pre = 0usize;
    let mut sections = 0usize;
    for edge in doc.tree.root().traverse() {
        match edge {
            Edge::Open(node) if skip.is_none() => match node.value() {
                Node::Element(e) => {
                    let name = e.name();
                    let element = ElementRef::wrap(node);
                    if dropped(name, element, sections) {
                        skip = Some(node.id());
                        continue;
                    }
                    match name {
                        "h1" | "h2" | "h3" | "h4" | "h5" | "h6" => {
                            paragraph_break(&mut out);
                            let level = usize::from(name.as_bytes()[1] - b'0');
                            out.push_str(&"#".repeat(level));
                            out.push(' ');
                        }
                        "li" => {
                            line_break(&mut out);
                            out.push_str("- ");
                        }
                        "td" | "th" if !out.ends_with('\n') && !out.is_empty() => {
                            out.push_str(" | ");
                        }
                        "br" => out.push('\n'),
                        "tr" => line_break(&mut out),
                        "pre" => {
                            pre += 1;
                            paragraph_break(&mut out);
                        }
                        "article" | "main" | "section" => {
                            sections += 1;
                            paragraph_break(&mut out);
                        }
                        _ if BLOCKS.contains(&name) => paragraph_break(&mut out),
                        _ => {}
                    }
                }
                Node::Text(t) => {
                    if pre > 0 {
                        out.push_str(t);
                    } else {
                        push_collapsed(&mut out, t);
                    }
                }
                _ => {}
            },
            Edge::Close(node) if skip == Some(node.id()) => skip = None,
            Edge::Close(node) if skip.is_none() => {
                if let Node::Element(e) = node.value() {
                    match e.name() {
                        "h1" | "h2" | "h3" | "h4" | "h5" | "h6" | "p" => paragraph_break(&mut out),
                        "tr" | "li" => line_break(&mut out),
                        "pre" => {
                            pre = pre.saturating_sub(1);
                            paragraph_break(&mut out);
                        }
                        "article" | "main" | "section" => sections = sections.saturating_sub(1),
                        name if BLOCKS.contains(&name) => line_break(&mut out),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (tidy(&out), title)
}

fn dropped(name: &str, element: Option<ElementRef<'_>>, sections: usize) -> bool {
    if DROPPED.contains(&name) || (matches!(name, "header" | "footer") && sections == 0) {
        return true;
    }
    let Some(e) = element.map(|e| e.value()) else {
        return false;
    };
    if e.attr("hidden").is_some() || e.attr("aria-hidden") == Some("true") {
        return true;
    }
    if e.attr("role").is_some_and(|r| DROPPED_ROLES.contains(&r)) {
        return true;
    }
    e.attr("style").is_some_and(|s| {
        s.to_ascii_lowercase()
            .replace(char::is_whitespace, "")
            .contains("display:none")
    })
}

fn push_collapsed(out: &mut String, text: &str) {
    let mut words = text.split_whitespace().peekable();
    if words.peek().is_none() {
        if !text.is_empty() && !out.ends_with([' ', '\n']) && !out.is_empty() {
            out.push(' ');
        }
        return;
    }
    if text.starts_with(char::is_whitespace) && !out.ends_with([' ', '\n']) && !out.is_empty() {
        out.push(' ');
    }
    let mut first = true;
    for w in words {
        if !first {
            out.push(' ');
        }
        out.push_str(w);
        first = false;
    }
    if text.ends_with(char::is_whitespace) {
        out.push(' ');
    }
}

fn line_break(out: &mut String) {
    trim_trailing_spaces(out);
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
}

fn paragraph_break(out: &mut String) {
    trim_trailing_spaces(out);
    if out.is_empty() || out.ends_with("\n\n") {
        return;
    }
    out.push_str(if out.ends_with('\n') { "\n" } else { "\n\n" });
}

fn trim_trailing_spaces(out: &mut String) {
    while out.ends_with([' ', '\t']) {
        out.pop();
    }
}

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Trims lines, drops empty table separators and collapses runs of blank lines.
fn tidy(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut blank = 0;
    for line in s.lines() {
        let line = line.trim_end().trim_start_matches(" | ");
        if line.trim().is_empty() {
            blank += 1;
            continue;
        }
        if !out.is_empty() {
            out.push_str(if blank > 0 { "\n\n" } else { "\n" });
        }
        blank = 0;
        out.push_str(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_headings_lists_tables_and_drops_boilerplate() {
        let html = r#"<html><head><title> My  Page </title><style>p{}</style></head><body>
            <header>Site header</header><nav><a href="/">Home</a></nav>
            <h1>Main   Title</h1><p>First <b>bold</b> paragraph.</p>
            <script>var x = 1;</script>
            <ul><li>one</li><li>two</li></ul>
            <table><tr><th>A</th><th>B</th></tr><tr><td>1</td><td>2</td></tr></table>
            <div style="display: none">hidden</div><p hidden>also hidden</p>
            <article><header><h2>Section</h2></header><p>Body text.</p></article>
            <footer>Copyright</footer></body></html>"#;
        let (text, title) = to_markdown(html);
        assert_eq!(title.as_deref(), Some("My Page"));
        assert_eq!(
            text,
            "# Main Title\n\nFirst bold paragraph.\n\n- one\n- two\n\nA | B\n1 | 2\n\n## Section\n\nBody text."
        );
    }

    #[test]
    fn deep_nesting_does_not_overflow() {
        let html = format!("{}deep{}", "<div>".repeat(5_000), "</div>".repeat(5_000));
        let (text, _) = to_markdown(&html);
        assert_eq!(text, "deep");
    }
}
