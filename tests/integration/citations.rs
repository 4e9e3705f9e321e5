//! The hidden states at every generated token (vendor/PATCHES.md 22), with the real Qwen
//! 0.5B (the default model until issue 55): what the citation check (issue 54) reads at each
//! marker.

use crate::helpers::qwen_0_5b;

/// A greedy answer read with a [`StepReader`]: every generated token but the last has its
/// state; the state of token k equals the state a fresh prefill of the prompt and tokens
/// 0..=k gives at its last position (an independent read of the same thing); the ids
/// decode to the answer's text; a marker's end maps to the token that completed it.
#[tokio::test]
async fn each_generated_tokens_state_is_the_prefills_state_at_that_position() {
    use docent::query::generate::steps::{marker_states, StepReader};
    use docent::query::generate::{Generator, Params};
    let mut config = crate::helpers::config(&std::env::temp_dir());
    config.generation.model = qwen_0_5b();
    config.generation.prefix_cache = false;
    let generator = Generator::load(&config.generation).await.unwrap();
    let prompts = docent::server::startup::prompts(&config).unwrap();
    let blocks = crate::helpers::office_guide();
    let prompt = prompts
        .render(crate::helpers::OFFICE_ANSWERED, &blocks)
        .unwrap();
    let layer = 16;
    let reader = std::sync::Arc::new(StepReader::new(vec![layer]));
    let answer = generator
        .chat_reading(&prompt, &Params::greedy(24), reader.clone())
        .await
        .unwrap();
    let steps = reader.steps();
    eprintln!("answer: {:?}", answer.text);
    assert!(steps.ids.len() >= 3, "{} tokens read", steps.ids.len());
    assert_eq!(steps.states.len(), steps.ids.len());
    assert!(steps
        .states
        .iter()
        .all(|s| s.as_ref().is_some_and(|s| s[0].len() == 896)));
    assert!(
        answer
            .text
            .starts_with(generator.decode(&steps.ids).trim_end()),
        "{:?} vs {:?}",
        answer.text,
        generator.decode(&steps.ids)
    );
    let prompt_ids = steps.prompt.clone().expect("the prompt's ids");
    let relative = |a: &[f32], b: &[f32]| {
        let norm = b.iter().map(|x| x * x).sum::<f32>().sqrt();
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f32>()
            .sqrt()
            / norm
    };
    let mut fresh = Vec::new();
    for k in 0..3 {
        let mut tokens = prompt_ids.clone();
        tokens.extend_from_slice(&steps.ids[..=k]);
        let states = generator.token_states(tokens, &[layer]).await.unwrap();
        fresh.push(states.expect("states").swap_remove(layer));
    }
    for k in 0..3 {
        let read = &steps.states[k].as_ref().unwrap()[0];
        let same = relative(read, &fresh[k]);
        // the control: the prefill's state one token earlier or later
        let other = relative(read, &fresh[if k == 0 { 1 } else { k - 1 }]);
        eprintln!("token {k}: relative difference {same:.2e} (the next or previous position: {other:.2e})");
        // the decode's and the prefill's kernels round differently (one row against many)
        assert!(
            same < 5e-2 && same * 10.0 < other,
            "token {k}: {same} vs {other}"
        );
    }
    // the first marker's end (or the text's first word) maps to a token with its state
    let end = answer.text.find(']').map_or(3, |i| i + 1);
    let decode = |ids: &[u32]| generator.decode(ids);
    assert!(marker_states(&steps, &[end], &decode)[0].is_some());
}
