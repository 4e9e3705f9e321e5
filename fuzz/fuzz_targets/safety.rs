//! The safety filter on arbitrary text: PII matches are ordered, disjoint and on character
//! boundaries; redaction is idempotent; neutralising removes every sentence that matches
//! an injection rule (so doing it twice changes nothing); scores are finite; the filter's
//! checks never panic.
#![no_main]

use arbitrary::Arbitrary;
use docent_fuzz::query::safety::{
    find_pii, injection_score, neutralise, redact, PiiAction, PiiKind, PiiRules, SafetyConfig,
    SafetyFilter, SafetyReport, NEUTRALISED,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    text: String,
    system_prompt: String,
}

fuzz_target!(|input: Input| {
    let text = input.text.as_str();
    let mut end = 0;
    for m in find_pii(text) {
        assert!(
            m.start >= end && m.start < m.end && m.end <= text.len(),
            "bad match {m:?}"
        );
        assert!(text.is_char_boundary(m.start) && text.is_char_boundary(m.end));
        end = m.end;
    }

    let all_redact = PiiRules(
        PiiKind::ALL
            .iter()
            .map(|k| (*k, PiiAction::Redact))
            .collect(),
    );
    let (once, _) = redact(text, &all_redact);
    let (twice, kinds) = redact(&once, &all_redact);
    assert_eq!(
        twice, once,
        "redacting twice changed {once:?} (found {kinds:?})"
    );
    let _ = redact(text, &PiiRules::default());

    let (score, names) = injection_score(text);
    assert!(score.is_finite() && score >= 0.0);
    assert_eq!(score == 0.0, names.is_empty());

    let (clean, spans) = neutralise(text);
    let (again, more) = neutralise(&clean);
    assert!(
        more.is_empty(),
        "neutralised text still has instructions: {more:?}"
    );
    assert_eq!(again, clean);
    if spans.is_empty() {
        assert_eq!(clean, text);
    } else {
        assert!(clean.contains(NEUTRALISED));
    }

    let filter = SafetyFilter::new(SafetyConfig::default()).expect("default config is valid");
    let mut report = SafetyReport::default();
    filter.question(text, &mut report);
    filter.chunk(text, &mut report);
    filter.redact(text, &mut report);
    filter.withhold(text, &input.system_prompt, &mut report);
});
