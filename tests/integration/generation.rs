//! mistral.rs on a real model with an independent reference: stories260K's greedy output
//! from karpathy's llama2.c (200 positions from BOS, temperature 0).
//!
//! The stories260K tests run on `DOCENT_TEST_DEVICE` (helpers::test_device: the CPU, or the
//! GPU in `scripts/gpu-check.sh`), with the same expectations; on a GPU docent's CPU kernels
//! must not be called at all.

use docent::config::Config;
use docent::query::generate::Generator;

use crate::helpers::{generation, shared, test_device};

#[tokio::test]
async fn stories260k_greedy_matches_llama2c() {
    let dir = shared().join("models/stories260K");
    let reference = std::fs::read_to_string(dir.join("greedy_reference.txt")).unwrap();
    let reference = reference.trim_end_matches('\n');
    let mut c = generation();
    c.model = dir.join("stories260K.gguf");
    c.dtype = "f32".into();
    let generator = Generator::load(&c).await.expect("load stories260K");

    // The prompt is the BOS token itself (id 1), as in llama2.c; a text prompt through a
    // chat template would not start from BOS. 200 positions = 200 generated tokens.
    let (matmuls, attentions) = docent::query::generate::cpu_kernels::calls();
    let g = generator.complete_tokens(vec![1], 200).await.unwrap();
    let ids = g.token_ids.clone().expect("token ids");
    assert_eq!(ids.len(), 200);
    let (m, a) = docent::query::generate::cpu_kernels::calls();
    if test_device() == "cpu" {
        // The forward passes ran on docent's kernels (kernels/), not candle's.
        assert!(
            m >= matmuls + 200 * 7,
            "matmuls through docent's kernels: {}",
            m - matmuls
        );
        assert!(
            a >= attentions + 200,
            "attentions through docent's kernels: {}",
            a - attentions
        );
    } else {
        // The hooks' guard: tensors on the GPU never reach docent's CPU kernels (nothing
        // else in this test binary generates on the CPU while it runs on a GPU).
        assert_eq!(
            (m - matmuls, a - attentions),
            (0, 0),
            "docent's CPU kernels intercepted GPU tensors"
        );
    }

    // Token for token: the whole sequence decoded at once equals llama2.c's text,
    // newlines (SentencePiece byte token <0x0A>, id 13) included.
    let decoded = generator.detokenize(ids.clone(), false).await.unwrap();
    assert_eq!(decoded, reference);
    assert_eq!(ids.iter().filter(|&&t| t == 13).count(), 3);

    // mistral.rs's own text drops the byte tokens: its GGUF tokenizer conversion registers
    // every token whose type is not "normal" as special, byte tokens included, and the
    // engine decodes without special tokens. Everything else agrees exactly.
    assert_eq!(g.text, reference.replace('\n', ""));
}

/// Speculative decoding (mistral.rs's `SpeculativePipeline` over two GGUF models) gives
/// the target's own greedy output, on 24 prompts: F32 target, a Q8_0 copy of it as the
/// draft (so some proposals are rejected), no penalties.
#[tokio::test]
async fn speculative_output_equals_plain_greedy() {
    let dir = shared().join("models/stories260K");
    let mut c = generation();
    c.model = dir.join("stories260K.gguf");
    let plain = Generator::load(&c).await.expect("load the target");
    let draft_model = crate::helpers::models().join("stories260K/stories260K.q8_0.gguf");
    let mut d = c.clone();
    d.model = draft_model.clone();
    let draft = Generator::load(&d).await.expect("load the draft alone");
    c.draft = Some(docent::config::DraftConfig {
        model: draft_model,
        gamma: 4,
    });
    let speculative = Generator::load(&c).await.expect("load target and draft");
    // prompts where the draft alone says something else: its proposals get rejected there
    let mut draft_differs = 0;
    for first in 0..24u32 {
        // BOS, then a different word each time
        let prompt = vec![1, 300 + 7 * first];
        let want = plain.complete_tokens(prompt.clone(), 64).await.unwrap();
        let got = speculative
            .complete_tokens(prompt.clone(), 64)
            .await
            .unwrap();
        let alone = draft.complete_tokens(prompt, 64).await.unwrap();
        draft_differs += usize::from(alone.token_ids != want.token_ids);
        assert_eq!(
            got.token_ids, want.token_ids,
            "prompt {first}: speculative output differs"
        );
        assert_eq!(got.text, want.text);
    }
    eprintln!("the draft alone differs from the target on {draft_differs} of 24 prompts");
    assert!(
        draft_differs > 0,
        "the draft never disagrees: no rejection was tested"
    );
}

/// A request may leave a speculative server's draft model out (`generation.draft_model =
/// false`): its sequence runs the target's own steps. Greedy, the output is the target's
/// (alone and with prompt-lookup drafts); sampled, the answers vary, where the draft model
/// would have decoded the same request greedily (mistral.rs's speculative pipeline ignores
/// the temperature), which shows which path ran.
#[tokio::test]
async fn a_request_may_leave_the_draft_model_out() {
    use docent::query::generate::Params;
    let dir = shared().join("models/stories260K");
    let mut c = generation();
    c.model = dir.join("stories260K.gguf");
    let plain = Generator::load(&c).await.expect("load the target");
    c.draft = Some(docent::config::DraftConfig {
        model: crate::helpers::models().join("stories260K/stories260K.q8_0.gguf"),
        gamma: 4,
    });
    let speculative = Generator::load(&c).await.expect("load target and draft");
    let without = |lookup_tokens: usize| Params {
        draft_model: false,
        lookup_tokens,
        ..Params::greedy(64)
    };
    for first in 0..8u32 {
        let prompt = vec![1, 300 + 7 * first];
        let want = plain.complete_tokens(prompt.clone(), 64).await.unwrap();
        for lookup in [0, 4] {
            let got = speculative
                .complete_with(prompt.clone(), &without(lookup))
                .await
                .unwrap();
            assert_eq!(
                got.token_ids, want.token_ids,
                "prompt {first}, draft model left out, lookup {lookup}: output differs"
            );
        }
    }
    // sampled: five answers of 48 tokens to one prompt, through each path
    let sampled = |draft_model: bool| Params {
        temperature: 1.0,
        draft_model,
        ..Params::greedy(48)
    };
    let greedy = plain.complete_tokens(vec![1], 48).await.unwrap().text;
    let mut texts = std::collections::BTreeSet::new();
    for _ in 0..5 {
        let with = speculative
            .complete_with(vec![1], &sampled(true))
            .await
            .unwrap();
        assert_eq!(with.text, greedy, "the draft model's path decodes greedily");
        let g = speculative
            .complete_with(vec![1], &sampled(false))
            .await
            .unwrap();
        texts.insert(g.text);
    }
    assert!(
        texts.len() > 1 && texts.iter().any(|t| *t != greedy),
        "temperature 1 without the draft model gave one answer five times: {texts:?}"
    );
}

/// Prompt-lookup drafts (`generation.lookup_tokens`): the output is plain greedy decoding's,
/// checked against the independent reference (llama2.c's 200 greedy tokens of stories260K,
/// whose stories repeat their phrases, so drafts are proposed and accepted) and against the
/// same engine without drafts on 24 more prompts, with drafts of 2, 4 and 6 tokens.
#[tokio::test]
async fn prompt_lookup_output_equals_plain_greedy() {
    let dir = shared().join("models/stories260K");
    let reference = std::fs::read_to_string(dir.join("greedy_reference.txt")).unwrap();
    let mut c = generation();
    c.model = dir.join("stories260K.gguf");
    c.lookup_tokens = 0;
    let plain = Generator::load(&c).await.expect("load without drafts");
    for draft_tokens in [2, 4, 6] {
        c.lookup_tokens = draft_tokens;
        let drafted = Generator::load(&c).await.expect("load with drafts");
        let (steps, proposed, accepted) = docent::query::generate::lookup::draft_counts();
        let g = drafted.complete_tokens(vec![1], 200).await.unwrap();
        let ids = g.token_ids.clone().expect("token ids");
        let decoded = drafted.detokenize(ids.clone(), false).await.unwrap();
        assert_eq!(
            decoded,
            reference.trim_end_matches('\n'),
            "{draft_tokens}-token drafts"
        );
        let (steps2, proposed2, accepted2) = docent::query::generate::lookup::draft_counts();
        // (other tests of this binary may draft too: a lower bound for this one)
        eprintln!(
            "{draft_tokens}-token drafts: {} steps, {} of {} draft tokens accepted, 200 tokens",
            steps2 - steps,
            accepted2 - accepted,
            proposed2 - proposed
        );
        assert!(steps2 > steps && accepted2 > accepted, "no draft was taken");
        for first in 0..24u32 {
            let prompt = vec![1, 300 + 7 * first];
            let want = plain.complete_tokens(prompt.clone(), 64).await.unwrap();
            let got = drafted.complete_tokens(prompt, 64).await.unwrap();
            assert_eq!(
                got.token_ids, want.token_ids,
                "prompt {first}, {draft_tokens}-token drafts: output differs"
            );
            assert_eq!(got.text, want.text);
        }
    }
}

/// The model sources answer alike: SmolLM2 as a safetensors directory (the setup step's
/// verified export) gives the F32 GGUF's greedy tokens; in-situ quantized to Q8_0 it writes
/// UQFF once, and the UQFF load gives the ISQ model's tokens without quantizing again. A
/// path that does not exist is an error, not a Hugging Face lookup.
#[tokio::test]
async fn safetensors_isq_and_uqff_sources_agree() {
    let m = crate::helpers::models().join("smollm2");
    let mut c = Config::default().generation;
    let prompt: Vec<u32> = {
        c.model = m.join("SmolLM2-135M-Instruct.F32.gguf");
        let gguf = Generator::load(&c).await.expect("load the F32 GGUF");
        let prompt = gguf.encode("The borrow checker in Rust makes sure that");
        let want = gguf.complete_tokens(prompt.clone(), 24).await.unwrap();
        c.model = m.join("SmolLM2-135M-Instruct-hf");
        let st = Generator::load(&c)
            .await
            .expect("load the safetensors directory");
        let got = st.complete_tokens(prompt.clone(), 24).await.unwrap();
        assert_eq!(got.token_ids, want.token_ids, "safetensors vs GGUF");
        prompt
    };
    let uqff = tempfile::tempdir().unwrap();
    c.isq = Some("q8_0".into());
    let isq = Generator::load(&c).await.expect("ISQ at load");
    let quantized = isq.complete_tokens(prompt.clone(), 24).await.unwrap();
    drop(isq);
    c.uqff = Some(uqff.path().join("smollm2-q8_0"));
    let writing = Generator::load(&c).await.expect("ISQ, writing UQFF");
    assert_eq!(
        writing
            .complete_tokens(prompt.clone(), 24)
            .await
            .unwrap()
            .token_ids,
        quantized.token_ids
    );
    drop(writing);
    let written: Vec<_> = std::fs::read_dir(uqff.path().join("smollm2-q8_0"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    // the UQFF holds Q8_0 weights: about a quarter of the F32 safetensors
    let size = |dir: &std::path::Path, ext: &str| -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == ext))
            .map(|p| p.metadata().unwrap().len())
            .sum()
    };
    let quantized_bytes = size(&uqff.path().join("smollm2-q8_0"), "uqff");
    let f32_bytes = size(&m.join("SmolLM2-135M-Instruct-hf"), "safetensors");
    assert!(
        quantized_bytes > 0 && quantized_bytes * 5 < f32_bytes * 2,
        "{written:?}: {quantized_bytes} bytes of UQFF for {f32_bytes} bytes of F32"
    );
    let reloaded = Generator::load(&c).await.expect("load from UQFF");
    let again = reloaded.complete_tokens(prompt, 24).await.unwrap();
    assert_eq!(again.token_ids, quantized.token_ids, "UQFF vs ISQ");
    eprintln!(
        "load: ISQ q8_0 at load vs from UQFF: {:.0} ms",
        reloaded.load_ms()
    );

    c.model = m.join("no-such-model");
    c.isq = None;
    c.uqff = None;
    match Generator::load(&c).await {
        Err(docent::query::generate::GenerateError::ModelMissing { path }) => {
            assert!(path.ends_with("no-such-model"))
        }
        Err(e) => panic!("expected ModelMissing, got {e}"),
        Ok(_) => panic!("a missing model loaded"),
    }
}

/// The bounded prefix cache changes nothing but speed: prompts that share a prefix with
/// earlier ones (reused from the cache, then extended) give the same greedy tokens as an
/// engine without the cache; with a tiny bound, entries are evicted and it still agrees.
#[tokio::test]
async fn prefix_cache_reuse_gives_the_same_tokens() {
    let dir = shared().join("models/stories260K");
    let mut c = generation();
    c.model = dir.join("stories260K.gguf");
    c.prefix_cache = false;
    let plain = Generator::load(&c).await.expect("load without the cache");
    c.prefix_cache = true;
    let cached = Generator::load(&c).await.expect("load with the cache");
    // a shared 40-token prefix (a "system prompt"), then a different word each time
    let shared_prefix: Vec<u32> = std::iter::once(1).chain((0..39).map(|i| 300 + i)).collect();
    for first in 0..8u32 {
        let mut prompt = shared_prefix.clone();
        prompt.extend([350 + 5 * first, 400 + first]);
        let want = plain.complete_tokens(prompt.clone(), 32).await.unwrap();
        let got = cached.complete_tokens(prompt.clone(), 32).await.unwrap();
        assert_eq!(
            got.token_ids, want.token_ids,
            "prompt {first}: cache changed the output"
        );
        // the same prompt again: reused from the cache in full
        let again = cached.complete_tokens(prompt.clone(), 32).await.unwrap();
        assert_eq!(again.token_ids, want.token_ids, "prompt {first}, repeated");
        // a next turn: the whole earlier exchange (prompt and answer) plus new tokens, which
        // extends a stored entry past the positions it holds KV for
        let mut turn = prompt;
        turn.extend(want.token_ids.clone().unwrap_or_default());
        turn.extend([420 + first, 421]);
        let want2 = plain.complete_tokens(turn.clone(), 16).await.unwrap();
        let got2 = cached.complete_tokens(turn, 16).await.unwrap();
        assert_eq!(got2.token_ids, want2.token_ids, "prompt {first}, next turn");
    }
}

/// A caller that stops waiting for a request (a client that disconnects, a shutdown that
/// drops the passage work in hand) loses only its own answer: the engine finishes the
/// request for nobody and goes on. mistral.rs 0.8.1 failed the step when a finished
/// answer had nobody to go to, answered the step's other prompts with errors and then
/// panicked on the closed channel (vendor/PATCHES.md 25), which took down every answer in
/// flight (`make compose-test` found it at shutdown). Here requests are dropped right
/// after they reach the engine while a 200-token answer decodes; that answer still ends
/// with llama2.c's text, and the engine answers afterwards.
#[tokio::test]
async fn a_dropped_request_leaves_the_other_answers_alone() {
    let dir = shared().join("models/stories260K");
    let reference = std::fs::read_to_string(dir.join("greedy_reference.txt")).unwrap();
    let mut c = generation();
    c.model = dir.join("stories260K.gguf");
    c.dtype = "f32".into();
    let generator = std::sync::Arc::new(Generator::load(&c).await.expect("load stories260K"));
    let long = {
        let g = generator.clone();
        tokio::spawn(async move { g.complete_tokens(vec![1], 200).await })
    };
    let mut dropped = 0;
    while !long.is_finished() {
        // polled once: the request is handed to the engine, then its receiver is dropped
        let prompt = vec![1, 32 + dropped % 400, 40 + dropped % 300];
        let once = generator.complete_tokens(prompt, 1);
        if futures::FutureExt::now_or_never(once).is_none() {
            dropped += 1;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let g = long.await.unwrap().expect("the long answer");
    eprintln!("{dropped} requests dropped in flight");
    assert!(dropped >= 3, "only {dropped} requests dropped in flight");
    let text = generator
        .detokenize(g.token_ids.expect("ids"), false)
        .await
        .unwrap();
    assert_eq!(text, reference.trim_end_matches('\n'));
    let after = generator.complete_tokens(vec![1], 8).await.expect("after");
    assert_eq!(after.token_ids.map(|t| t.len()), Some(8));
}
