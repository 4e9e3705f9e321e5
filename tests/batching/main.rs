//! Continuous batching, chunked prefill and the F16 KV cache on real models (mistral.rs with
//! docent's kernels). These settings are process-wide in mistral.rs, so they live in a test
//! binary of their own, and its tests take turns (`KNOBS`): no other test sees them flip.

#[allow(dead_code)]
#[path = "../integration/helpers.rs"]
mod helpers;

use docent::config::{Config, GenerationConfig};
use docent::query::generate::{cpu_kernels, Generator};
use docent::tools::bench::generate::stall;

use helpers::{models, shared};

/// Held by each test for its whole run.
static KNOBS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn stories() -> GenerationConfig {
    let mut c = Config::default().generation;
    c.model = shared().join("models/stories260K/stories260K.gguf");
    c.dtype = "f32".into();
    c.max_num_seqs = 16;
    c
}

/// BOS, then `n` more ids from `start` (stories260K's vocabulary has 512 tokens).
fn prompt(start: u32, n: usize) -> Vec<u32> {
    std::iter::once(1)
        .chain((0..n as u32).map(|i| 32 + (start + 7 * i) % 470))
        .collect()
}

/// Sequences of different lengths, asked at once, decode together (far fewer matmul calls
/// than one after the other) and each gives exactly the tokens it gives alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_lengths_decode_together_with_the_tokens_they_get_alone() {
    let _turn = KNOBS.lock().await;
    let mut c = stories();
    c.continuous_batching = true;
    c.prefill_chunk_tokens = 0;
    c.prefix_cache = false;
    let generator = std::sync::Arc::new(Generator::load(&c).await.expect("load stories260K"));
    let cases: Vec<(Vec<u32>, usize)> = (0..6)
        .map(|i| (prompt(11 * i as u32, 3 + 9 * i), 40 + 12 * i))
        .collect();

    let (m0, _) = cpu_kernels::calls();
    let mut alone = Vec::new();
    for (p, n) in &cases {
        let g = generator.complete_tokens(p.clone(), *n).await.unwrap();
        alone.push(g.token_ids.expect("token ids"));
    }
    let (m1, _) = cpu_kernels::calls();

    let tasks: Vec<_> = cases
        .iter()
        .cloned()
        .map(|(p, n)| {
            let g = generator.clone();
            tokio::spawn(async move { g.complete_tokens(p, n).await })
        })
        .collect();
    let mut together = Vec::new();
    for t in tasks {
        together.push(t.await.unwrap().unwrap().token_ids.expect("token ids"));
    }
    let (m2, _) = cpu_kernels::calls();

    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.len(), cases[i].1, "sequence {i} stopped early");
        assert_eq!(
            a, t,
            "sequence {i}: batched tokens differ from its tokens alone"
        );
    }
    // One after the other, every sequence takes a forward pass per token; together, the
    // decode steps are shared (the longest answer sets the count).
    let (seq_calls, batch_calls) = (m1 - m0, m2 - m1);
    assert!(
        batch_calls * 2 < seq_calls,
        "matmul calls together {batch_calls} vs one after the other {seq_calls}: not batched"
    );
}

/// A prompt read in chunks gives the tokens it gives read at once, after a prefix-cache hit
/// too; and it is read in several forward passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_prefill_gives_the_tokens_of_a_whole_prompt() {
    let _turn = KNOBS.lock().await;
    let long = prompt(5, 300);
    // shares its first 200 tokens with `long`
    let mut branch = long[..200].to_vec();
    branch.extend(prompt(99, 150).into_iter().skip(1));

    let mut c = stories();
    c.prefill_chunk_tokens = 0;
    let whole = Generator::load(&c).await.expect("load");
    let (m0, _) = cpu_kernels::calls();
    let want_long = whole.complete_tokens(long.clone(), 1).await.unwrap();
    let (m1, _) = cpu_kernels::calls();
    let want_long = (
        want_long.token_ids,
        whole.complete_tokens(long.clone(), 48).await.unwrap(),
    );
    let want_branch = whole.complete_tokens(branch.clone(), 48).await.unwrap();
    drop(whole);

    c.prefill_chunk_tokens = 64;
    let chunked = Generator::load(&c).await.expect("load");
    let (m2, _) = cpu_kernels::calls();
    let got_first = chunked.complete_tokens(long.clone(), 1).await.unwrap();
    let (m3, _) = cpu_kernels::calls();
    let got_long = chunked.complete_tokens(long.clone(), 48).await.unwrap();
    // a prefix-cache hit on `long`'s first 200 tokens, the other 150 read in chunks
    let got_branch = chunked.complete_tokens(branch.clone(), 48).await.unwrap();

    assert_eq!(got_first.token_ids, want_long.0);
    assert_eq!(got_long.token_ids, want_long.1.token_ids);
    assert_eq!(got_long.prompt_tokens, long.len());
    assert_eq!(got_branch.token_ids, want_branch.token_ids);
    assert_eq!(got_branch.prompt_tokens, branch.len());
    // 301 tokens in chunks of 64: five forward passes instead of one
    let (whole_calls, chunk_calls) = (m1 - m0, m3 - m2);
    assert!(
        chunk_calls >= 4 * whole_calls,
        "matmul calls for the prompt: chunked {chunk_calls}, whole {whole_calls}"
    );
}

/// Chunked prefill keeps a streaming answer going while a long prompt is read beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoding_continues_while_a_long_prompt_is_read() {
    let _turn = KNOBS.lock().await;
    let mut c = stories();
    c.model = models().join("smollm2/SmolLM2-135M-Instruct.Q8_0.gguf");
    c.prefix_cache = false;
    let text = std::fs::read_to_string(
        shared().join("data/corpus/rust-book/src/ch04-01-what-is-ownership.md"),
    )
    .expect("the ownership chapter");
    c.prefill_chunk_tokens = 0;
    let whole = Generator::load(&c).await.expect("load SmolLM2");
    let ids = whole.encode(&text);
    assert!(ids.len() > 1_000);
    let long = ids[..900].to_vec();
    let whole_run = stall(&whole, long.clone()).await.unwrap();
    drop(whole);

    c.prefill_chunk_tokens = 64;
    let chunked = Generator::load(&c).await.expect("load SmolLM2");
    let chunked_run = stall(&chunked, long).await.unwrap();
    let (pause_whole, pause_chunked) = (whole_run.longest_pause, chunked_run.longest_pause);
    let tokens = chunked_run.tokens_meanwhile;
    eprintln!(
        "longest pause of a streaming answer while 900 prompt tokens are read: \
         whole {pause_whole:?}, in chunks of 64 {pause_chunked:?} ({tokens} tokens meanwhile)"
    );
    assert!(
        tokens >= 5,
        "only {tokens} tokens while the prompt was read in chunks"
    );
    assert!(
        pause_chunked * 3 < pause_whole,
        "chunked {pause_chunked:?} vs whole {pause_whole:?}"
    );
}

/// An F16 KV cache: the attention runs on the F16 kernel, and stories260K still tells
/// llama2.c's greedy story (F16 rounding of keys and values may move late tokens only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_kv_cache_runs_on_the_f16_kernel() {
    let _turn = KNOBS.lock().await;
    let dir = shared().join("models/stories260K");
    let reference = std::fs::read_to_string(dir.join("greedy_reference.txt")).unwrap();
    let mut c = stories();
    c.kv_cache = "f16".into();
    c.prefix_cache = false;
    let generator = Generator::load(&c).await.expect("load stories260K");
    let before = cpu_kernels::f16_attentions();
    let g = generator.complete_tokens(vec![1], 200).await.unwrap();
    let ids = g.token_ids.expect("token ids");
    assert!(
        cpu_kernels::f16_attentions() >= before + 200,
        "attention over F16 keys and values: {}",
        cpu_kernels::f16_attentions() - before
    );
    let text = generator.detokenize(ids, false).await.unwrap();
    let same = text
        .chars()
        .zip(reference.trim_end().chars())
        .take_while(|(a, b)| a == b)
        .count();
    eprintln!("F16 KV cache: the first {same} characters equal llama2.c's");
    assert!(
        same >= 200,
        "F16 KV cache output departs after {same} characters:\n{text}"
    );
    // back to F32 for whatever runs next in this process
    c.kv_cache = "f32".into();
    drop(Generator::load(&c).await.expect("load stories260K"));
}
