//! **Extractive answers**: the retrieved chunks' sentences that best answer the question,
//! quoted and cited. The fallback when the model's text is degenerate, empty or
//! unsupported, and an answer mode of its own (`"mode": "extractive"`, no model at all).

use std::sync::LazyLock;

use regex::Regex;

use super::{words as content_words, SENTENCE_END};

/// A sentence of a context block, a candidate for the extractive answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The block number (1-based, as in the prompt's `[n]`).
    pub n: usize,
    /// The sentence, trimmed (paragraph lines joined with spaces).
    pub text: String,
}

static CODE_OR_MARKUP: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\s*(#|```|\||<|\{|\}|//|\$ |- \[)").expect("valid regex"));

/// Sentences of the blocks (in prompt order) that can stand alone as an answer: prose of
/// five words or more, not headings, code, tables or markup.
pub fn candidates(blocks: &[&str]) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (i, block) in blocks.iter().enumerate() {
        let mut in_fence = false;
        // prose lines of a paragraph are one text (documents wrap their lines); markup,
        // code and table lines are left out
        let mut lines: Vec<String> = Vec::new();
        for paragraph in block.split("\n\n") {
            let mut prose = String::new();
            for line in paragraph.split('\n') {
                if line.trim_start().starts_with("```") {
                    in_fence = !in_fence;
                    continue;
                }
                if in_fence || CODE_OR_MARKUP.is_match(line) || line.trim().is_empty() {
                    continue;
                }
                if !prose.is_empty() {
                    prose.push(' ');
                }
                prose.push_str(line.trim());
            }
            lines.push(prose);
        }
        for line in &lines {
            // the placeholder of an instruction the safety filter took out is not prose
            let line = &line.replace(crate::query::safety::NEUTRALISED, " ");
            let mut start = 0;
            let mut ends: Vec<usize> = SENTENCE_END.find_iter(line).map(|m| m.end()).collect();
            ends.push(line.len());
            for end in ends {
                let s = line[start..end].trim();
                start = end;
                if s.split_whitespace().count() >= 5
                    && s.chars().next().is_some_and(|c| !c.is_lowercase())
                {
                    out.push(Candidate {
                        n: i + 1,
                        text: s.to_string(),
                    });
                }
            }
        }
    }
    out
}

/// How well a sentence answers a question, lexically: the share of the question's content
/// words it contains.
pub fn overlap(question: &str, sentence: &str) -> f32 {
    let q = content_words(question);
    if q.is_empty() {
        return 0.0;
    }
    let s = content_words(sentence);
    q.iter().filter(|w| s.contains(*w)).count() as f32 / q.len() as f32
}

/// The answer from the candidates, given each one's score: the best sentence, and the
/// second best when it scores nearly as well (90 %) and comes from another place; each
/// with its block's marker. `None` when there is no candidate.
pub fn compose(candidates: &[Candidate], scores: &[f32]) -> Option<String> {
    let mut order: Vec<usize> = (0..candidates.len().min(scores.len())).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let &best = order.first()?;
    let mut picked = vec![best];
    if let Some(&second) = order.get(1) {
        if scores[second] >= 0.9 * scores[best] && candidates[second].text != candidates[best].text
        {
            picked.push(second);
        }
    }
    let sentences: Vec<String> = picked
        .into_iter()
        .map(|i| {
            let c = &candidates[i];
            let body = c.text.trim_end_matches(|ch: char| ".!?".contains(ch));
            let end = &c.text[body.len()..];
            format!("{body} [{}]{}", c.n, if end.is_empty() { "." } else { end })
        })
        .collect();
    Some(sentences.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_prose_sentences_with_their_block() {
        let blocks = [
            "# Ownership\n\nOwnership is a set of rules\nthat govern memory. Short one.\n```rust\nlet s = String::from(\"hello world, this is code\");\n```",
            "| a | b | c | d | e |\nEach value in Rust has a variable that is its owner.",
        ];
        let c = candidates(&blocks);
        assert_eq!(
            c,
            vec![
                Candidate {
                    n: 1,
                    text: "Ownership is a set of rules that govern memory.".into()
                },
                Candidate {
                    n: 2,
                    text: "Each value in Rust has a variable that is its owner.".into()
                },
            ]
        );
    }

    #[test]
    fn the_best_sentences_are_cited() {
        let c = vec![
            Candidate {
                n: 2,
                text: "Ownership is a set of rules that govern memory.".into(),
            },
            Candidate {
                n: 1,
                text: "Cargo is the build system".into(),
            },
        ];
        assert_eq!(
            compose(&c, &[0.9, 0.2]).as_deref(),
            Some("Ownership is a set of rules that govern memory [2].")
        );
        assert_eq!(
            compose(&c, &[0.5, 0.48]).as_deref(),
            Some("Ownership is a set of rules that govern memory [2]. Cargo is the build system [1].")
        );
        assert_eq!(compose(&[], &[]), None);
        assert!(
            overlap("What is ownership in Rust?", &c[0].text)
                > overlap("What is ownership in Rust?", &c[1].text)
        );
    }
}
