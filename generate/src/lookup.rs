//! Prompt lookup: a draft for speculative decoding read from the text itself.
//!
//! A RAG answer copies phrases from its context. When the last few tokens of the prompt and
//! answer so far occurred earlier, the tokens that followed them there are a likely
//! continuation: the engine reads them with the last token in one forward pass and keeps
//! those the model itself would have produced (mistral.rs patch 17, `pipeline/lookup.rs`),
//! so the output is exactly plain decoding's. No draft model is needed, so the 0.5B model
//! gains as well as the 1.5B.

/// The longest n-gram looked up first; a longer match predicts its continuation better.
pub const MAX_NGRAM: usize = 4;
/// The shortest n-gram looked up: single tokens match too often by chance (a draft that is
/// rejected costs a wider forward pass for nothing).
pub const MIN_NGRAM: usize = 2;
/// The most tokens a draft may hold (config and request limits). A draft step reads the
/// last token and the draft, at most 7 positions: docent's attention kernel takes the same
/// path for them as for one (the direct one, below 8 query rows), so only the matmuls'
/// summation order differs from plain decoding's (measured: 1 answer of 60 changed at a
/// near-tie with 2- and 4-token drafts, 10 of 60 with 8-token drafts, which crossed into
/// the packed prefill path).
pub const MAX_DRAFT_TOKENS: usize = 6;

/// Draft steps run, draft tokens proposed and draft tokens accepted since the process
/// started (every engine of the process together).
pub fn draft_counts() -> (u64, u64, u64) {
    mistralrs::core::draft_counts()
}

/// Up to `max` tokens to follow `tokens`: what followed the most recent earlier occurrence of
/// their longest suffix of [`MIN_NGRAM`]..=[`MAX_NGRAM`] tokens; empty when none occurred.
pub fn propose(tokens: &[u32], max: usize) -> Vec<u32> {
    let len = tokens.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        // starts before the suffix itself; the newest first (a phrase being copied now is
        // more likely the one read last)
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return tokens[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_a_phrase_read_before() {
        // "... 7 8 9 10 11 ... 7 8" → "9 10 11"
        let tokens = [1, 7, 8, 9, 10, 11, 2, 3, 7, 8];
        assert_eq!(propose(&tokens, 3), vec![9, 10, 11]);
        assert_eq!(propose(&tokens, 2), vec![9, 10]);
        // never past the end of what exists
        assert_eq!(propose(&tokens, 16), vec![9, 10, 11, 2, 3, 7, 8]);
    }

    #[test]
    fn a_longer_match_wins_over_a_newer_shorter_one() {
        // the suffix "5 7 8": "7 8" occurs newest at 6..8 (followed by 40), but "5 7 8"
        // only at 0..3 (followed by 20)
        let tokens = [5, 7, 8, 20, 21, 9, 7, 8, 40, 5, 7, 8];
        assert_eq!(propose(&tokens, 2), vec![20, 21]);
    }

    #[test]
    fn the_newest_occurrence_of_equal_length_wins() {
        let tokens = [3, 4, 10, 3, 4, 11, 3, 4];
        assert_eq!(propose(&tokens, 1), vec![11]);
    }

    #[test]
    fn no_repeated_ngram_no_draft() {
        assert!(propose(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        // a single repeated token is not enough
        assert!(propose(&[9, 1, 2, 3, 9], 4).is_empty());
        assert!(propose(&[], 4).is_empty());
        assert!(propose(&[1, 2, 1, 2], 0).is_empty());
    }
}
