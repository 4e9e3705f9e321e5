//! The stop-sequence matcher and the streamed answer: the model's text arrives in
//! arbitrary pieces with arbitrary stop sequences. Generation ends with the first piece
//! that completes a stop sequence (the engine stops there); the answer is that output cut
//! before its first stop sequence. The streamed text, joined, must equal the answer made
//! from that output at once, every prefix sent must be a prefix of it, and nothing is
//! sent after the stop.
#![no_main]

use arbitrary::Arbitrary;
use docent_fuzz::query::postprocess::stop::truncate_at_stop;
use docent_fuzz::query::postprocess::{cite, AnswerStream};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    pieces: Vec<String>,
    stops: Vec<String>,
    blocks: Vec<String>,
}

fuzz_target!(|input: Input| {
    let stops: Vec<String> = input.stops.into_iter().take(4).collect();
    let blocks = docent_fuzz::blocks(&input.blocks[..input.blocks.len().min(6)]);
    // what the engine produced: the pieces up to the one that completes a stop sequence
    let mut raw = String::new();
    for piece in &input.pieces {
        raw.push_str(piece);
        if truncate_at_stop(&raw, &stops).len() < raw.len() {
            break;
        }
    }

    let cut = truncate_at_stop(&raw, &stops);
    assert!(raw.starts_with(cut));
    for s in stops.iter().filter(|s| !s.is_empty()) {
        assert!(!cut.contains(s.as_str()), "stop {s:?} left in {cut:?}");
    }
    let (expected, expected_citations) = cite(cut, &blocks);

    let mut stream = AnswerStream::new(&stops);
    let mut streamed = String::new();
    let mut cited = Vec::new();
    let mut stopped = false;
    for piece in &input.pieces {
        let step = stream.push(piece, &blocks);
        assert!(
            !(stopped && !step.text.is_empty()),
            "text sent after the stop"
        );
        streamed.push_str(&step.text);
        cited.extend(step.citations.iter().map(|c| c.n));
        stopped |= step.stopped;
        assert!(
            expected.starts_with(&streamed),
            "streamed {streamed:?} is not a prefix of the answer {expected:?}"
        );
    }
    let (last, answer, citations) = stream.finish(&blocks);
    streamed.push_str(&last.text);
    cited.extend(last.citations.iter().map(|c| c.n));
    assert_eq!(answer, expected);
    assert_eq!(streamed, expected, "streamed text differs from the answer");
    let mut want: Vec<usize> = expected_citations.iter().map(|c| c.n).collect();
    let got: Vec<usize> = citations.iter().map(|c| c.n).collect();
    assert_eq!(got, want);
    want.sort_unstable();
    cited.sort_unstable();
    assert_eq!(cited, want, "streamed citations differ");
});
