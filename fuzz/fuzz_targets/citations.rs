//! The citation parser on arbitrary model output: markers in any form (`[1]`, `[1, 2]`,
//! `[1-3]`, `[1](url)`, in code), any number of blocks. Every citation names a real block
//! once, its quote is text of that block, the normal form parses back to the same blocks,
//! and [`claims`] cover the answer without overlapping.
#![no_main]

use arbitrary::Arbitrary;
use docent_fuzz::query::postprocess::{cite, claims};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    answer: String,
    blocks: Vec<String>,
}

fuzz_target!(|input: Input| {
    let blocks = docent_fuzz::blocks(&input.blocks[..input.blocks.len().min(12)]);
    let (text, citations) = cite(&input.answer, &blocks);
    let mut seen = std::collections::HashSet::new();
    for c in &citations {
        assert!(
            (1..=blocks.len()).contains(&c.n),
            "citation {} of {} blocks",
            c.n,
            blocks.len()
        );
        assert!(seen.insert(c.n), "block {} cited twice", c.n);
        let block = &blocks[c.n - 1].payload;
        assert_eq!(c.document_id, block.document_id);
        assert!(
            block.text.contains(&c.quote),
            "quote {:?} is not in block {}",
            c.quote,
            c.n
        );
        assert!(
            text.contains(&format!("[{}]", c.n)),
            "cited block {} has no marker in {text:?}",
            c.n
        );
    }
    // the normal form is stable: citing it again finds the same blocks in the same order
    let (again, recited) = cite(&text, &blocks);
    assert_eq!(again, text, "normal form changed when parsed again");
    let a: Vec<usize> = citations.iter().map(|c| c.n).collect();
    let b: Vec<usize> = recited.iter().map(|c| c.n).collect();
    assert_eq!(a, b, "normal form cites other blocks");
    let mut end = 0;
    for claim in claims(&text) {
        assert!(claim.start >= end && claim.start <= claim.end && claim.end <= text.len());
        assert!(text.is_char_boundary(claim.start) && text.is_char_boundary(claim.end));
        for m in &claim.markers {
            assert!((1..=blocks.len()).contains(m));
        }
        end = claim.end;
    }
});
