//! **Where stop sequences are cut**: the model's text ends at the first stop sequence,
//! whether the engine stopped there or ran past it (streamed text is cut the same way).

/// Stop sequences every answer is cut at: the start of a new turn or question.
pub const DEFAULT_STOPS: &[&str] = &["\nQuestion:", "<|im_start|>", "<|im_end|>"];

/// Cuts `text` at the earliest stop sequence; the stop text itself is dropped.
pub fn truncate_at_stop<'a>(text: &'a str, stops: &[String]) -> &'a str {
    let cut = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
        .unwrap_or(text.len());
    &text[..cut]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_ends_at_the_earliest_stop_sequence() {
        let stops: Vec<String> = DEFAULT_STOPS.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            truncate_at_stop("ok <|im_end|> x\nQuestion: y", &stops),
            "ok "
        );
        assert_eq!(truncate_at_stop("a\nQuestion: b<|im_start|>", &stops), "a");
        // empty stop strings are ignored, not a cut at 0
        assert_eq!(truncate_at_stop("plain", &["".to_string()]), "plain");
    }
}
