//! Continuous batching, chunked prefill and the F16 KV cache on real models (mistral.rs with
//! docent's kernels). The F16 KV cache and the kernels' instruction set are process-wide
//! (continuous batching is each pipeline's own), so these tests live in a test binary of
//! their own, and its tests take turns (`KNOBS`): no other test sees them flip.

#[allow(dead_code)]
#[path = "../integration/helpers.rs"]
mod helpers;

use docent::config::{Config, GenerationConfig};
use docent::query::generate::{cpu_kernels, Generator, Schedule, StreamEvent};
use docent_tools::bench::generate::stall;

use helpers::{models, shared};

/// Held by each test for its whole run.
static KNOBS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The kernels' instruction set in this binary, on every machine: the Qwen fixture's ids
/// were recorded on the AVX2 kernels, and the AVX-512 ones sum in another order, which moves
/// a near-tie (seen on a Zen 4 machine: prompt 20's 11th token). The process keeps the first
/// model's setting, so every config here names it. The kernel tests compare every
/// instruction set with the scalar reference.
const ISA: &str = "avx2";

fn stories() -> GenerationConfig {
    let mut c = Config::default().generation;
    c.isa = ISA.into();
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

/// Five answers decode; a sixth prompt arrives. In order of arrival it is read at once, beside
/// them; in cohorts it waits until fewer than `COHORT_ADMIT_BELOW` (4) of them decode, i.e.
/// until the two shortest have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_prompt_waits_for_the_cohort_to_drain() {
    let _turn = KNOBS.lock().await;
    assert_eq!(docent::query::generate::COHORT_ADMIT_BELOW, 4);
    let mut c = stories();
    c.continuous_batching = true;
    c.prefill_chunk_tokens = 0;
    c.prefix_cache = false;
    for schedule in [Schedule::Cohort, Schedule::Arrival] {
        c.schedule = schedule;
        let generator = std::sync::Arc::new(Generator::load(&c).await.expect("load stories260K"));
        let (decoding, mut started) = tokio::sync::mpsc::channel::<()>(8);
        let lengths = [60, 90, 160, 200, 240];
        let answers: Vec<_> = lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let (g, decoding) = (generator.clone(), decoding.clone());
                tokio::spawn(async move {
                    let mut stream = g.stream_tokens(prompt(3 * i as u32, 8), n).await?;
                    let mut first = true;
                    while let Some(event) = stream.next().await {
                        if let (StreamEvent::Delta(_), true) = (event?, first) {
                            first = false;
                            let _ = decoding.send(()).await;
                        }
                    }
                    Ok::<_, docent::query::generate::GenerateError>(std::time::Instant::now())
                })
            })
            .collect();
        for _ in &lengths {
            started.recv().await.expect("every answer decodes");
        }
        generator
            .complete_tokens(prompt(200, 8), 1)
            .await
            .expect("the sixth prompt");
        let sixth = std::time::Instant::now();
        let mut ended_before = 0;
        for a in answers {
            ended_before += usize::from(a.await.unwrap().expect("an answer") < sixth);
        }
        eprintln!(
            "{schedule:?}: {ended_before} of 5 answers ended before the sixth prompt's token"
        );
        match schedule {
            Schedule::Cohort => assert!(
                ended_before >= 2,
                "in cohorts the sixth prompt started while {} answers decoded",
                5 - ended_before
            ),
            Schedule::Arrival => assert_eq!(
                ended_before, 0,
                "in order of arrival the sixth prompt waited for {ended_before} answers"
            ),
        }
    }
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

/// Qwen2.5-Coder-0.5B (a qwen2 GGUF) on the settings the other Qwen tests
/// compare against: F32 activations and KV cache, no prefix cache, one sequence at a time.
fn qwen() -> GenerationConfig {
    let mut c = Config::default().generation;
    c.isa = ISA.into();
    c.model = helpers::qwen_0_5b();
    c.dtype = "f32".into();
    c.kv_cache = "f32".into();
    c.prefix_cache = false;
    c.continuous_batching = false;
    c.prefill_chunk_tokens = 0;
    c
}

/// `generation.repack = false`: the Q5_0 weights stay as in the file, on their own kernels,
/// and give the ids of the rewrite (the fixture: eight rows interleaved at the AVX2 cap),
/// which is lossless. The rewritten layouts' kernels (Q5_0 and Q4_K interleaved) add up in
/// another order than the row kernels, so the two runs may part only at a near-tie: where llama.cpp's top two
/// logits are within 0.25, the fixture test's bound (a wrong Q5_0 product parts them where
/// the margin is wide: 3.2 and 6.6 at the first token of these prompts).
#[tokio::test]
async fn qwen_without_the_q8_0_rewrite_gives_the_same_tokens() {
    let _turn = KNOBS.lock().await;
    let fixture = qwen_fixture();
    let margins = &fixture
        .llama_cpp
        .as_ref()
        .expect("the fixture has llama.cpp's scores")
        .margins;
    let repacked = cpu_kernels::repacked();
    let mut c = qwen();
    c.repack = false;
    let generator = Generator::load(&c).await.expect("load Qwen 0.5B");
    assert_eq!(cpu_kernels::repacked(), repacked, "nothing rewritten");
    for (i, (p, want)) in fixture
        .prompts
        .iter()
        .zip(&fixture.docent)
        .take(2)
        .enumerate()
    {
        let g = generator
            .complete_tokens(p.tokens.clone(), fixture.new_tokens)
            .await
            .expect("generate");
        let got = g.token_ids.as_deref().unwrap_or_default();
        let n = agree(got, want);
        eprintln!(
            "prompt {}: {n} of {} ids equal the rewrite's",
            p.name,
            want.len()
        );
        if n < want.len() {
            let margin = margins[i][n];
            assert!(
                margin < 0.25,
                "prompt {}: the Q5_0 kernels and the Q8_0 rewrite part at token {n}, where \
                 llama.cpp's top two are {margin} apart (not a near-tie)\n{got:?}\n{want:?}",
                p.name
            );
        }
    }
}

/// The Qwen fixture: three prompts (token ids cut from the Rust Book: about 20, 300 and 700
/// tokens, so the decode, packed-prefill and multi-tile attention paths all run), docent's
/// greedy ids for each, and llama.cpp's scores of those ids (scripts/llama_score.py).
#[derive(serde::Deserialize, serde::Serialize)]
struct QwenFixture {
    prompts: Vec<FixturePrompt>,
    new_tokens: usize,
    /// docent's greedy ids per prompt (written with DOCENT_BLESS=1)
    docent: Vec<Vec<u32>>,
    /// llama.cpp's logits on docent's ids, an independent reference
    #[serde(default)]
    llama_cpp: Option<LlamaScores>,
}

/// Written by scripts/llama_score.py: llama.cpp reads each prompt plus docent's tokens before
/// position t (teacher-forced, F32 KV cache) and gives its logits there.
#[derive(serde::Deserialize, serde::Serialize)]
struct LlamaScores {
    engine: String,
    /// the ids scored (docent's at the time of scoring)
    scored: Vec<Vec<u32>>,
    /// per prompt and token: llama.cpp's best logit minus the logit of docent's token
    gaps: Vec<Vec<f32>>,
    /// per prompt and token: llama.cpp's best logit minus its second best (near-ties are
    /// where any rounding may pick the other token)
    margins: Vec<Vec<f32>>,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct FixturePrompt {
    name: String,
    tokens: Vec<u32>,
}

/// Qwen2.5-0.5B's layers, and its matmuls per forward pass (7 a layer, plus the output).
const QWEN_LAYERS: u64 = 24;
const QWEN_MATMULS: u64 = QWEN_LAYERS * 7 + 1;

fn qwen_fixture_path() -> std::path::PathBuf {
    helpers::repo().join("tests/batching/qwen2.5-coder-0.5b.greedy.json")
}

fn qwen_fixture() -> QwenFixture {
    let path = qwen_fixture_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (DOCENT_BLESS=1 writes it)", path.display()));
    serde_json::from_str(&text).expect("the Qwen fixture parses")
}

impl QwenFixture {
    /// Where prompt `i`'s recorded tokens first meet a near-tie: llama.cpp's top two logits
    /// within 0.25, where any other order of adding up may pick the other token.
    fn first_near_tie(&self, i: usize) -> usize {
        let margins = &self.llama_cpp.as_ref().expect("llama.cpp's scores").margins[i];
        margins
            .iter()
            .position(|&m| m < 0.25)
            .unwrap_or(margins.len())
    }
}

/// How many leading ids two greedy runs share.
fn agree(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Qwen's greedy tokens on docent's engine: the ids recorded in the fixture exactly (any
/// change to the qwen2 path that moves a token shows here), with every matmul and attention on
/// docent's kernels; and those ids are llama.cpp's choice too, up to near-ties: on docent's
/// prefix, llama.cpp puts each of docent's tokens within 0.25 of its best logit (a wrong
/// token is typically several logits behind), and at least 3 in 4 are its argmax.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_greedy_tokens_match_the_fixture_and_llama_cpp() {
    let _turn = KNOBS.lock().await;
    let bless = std::env::var_os("DOCENT_BLESS").is_some();
    let (repacked, interleaved) = (cpu_kernels::repacked(), cpu_kernels::interleaved());
    let generator = Generator::load(&qwen()).await.expect("load Qwen 0.5B");
    // generation.repack (on): the Q5_0 projections (q, k, v, o, gate, up: 896 columns)
    // are rewritten; with AVX2 (the cap here) as eight rows interleaved, one byte per value
    // (docent_kernels::q5_0_x8), and the Q4_K weights (some layers' down projections) are
    // interleaved by eight rows too: prefill and decode run on those layouts
    let q4k = cpu_kernels::interleaved() - interleaved;
    assert!(
        cpu_kernels::repacked() - repacked - q4k >= QWEN_LAYERS * 4,
        "{} Q5_0 weights rewritten",
        cpu_kernels::repacked() - repacked - q4k
    );
    if docent_kernels::q4k_x8::has_kernel(docent_kernels::cpu::isa()) {
        assert!(q4k > 0, "no Q4_K weight interleaved");
    }
    eprintln!("Q4_K weights interleaved: {q4k}");
    let mut fixture = if bless {
        let text = std::fs::read_to_string(
            shared().join("data/corpus/rust-book/src/ch04-01-what-is-ownership.md"),
        )
        .expect("the ownership chapter");
        let ids = generator.encode(&text);
        QwenFixture {
            prompts: [20, 300, 700]
                .iter()
                .map(|&n| FixturePrompt {
                    name: n.to_string(),
                    tokens: ids[..n].to_vec(),
                })
                .collect(),
            new_tokens: 32,
            docent: Vec::new(),
            llama_cpp: None,
        }
    } else {
        qwen_fixture()
    };
    let mut got = Vec::new();
    for p in &fixture.prompts {
        let (m0, a0) = cpu_kernels::calls();
        let g = generator
            .complete_tokens(p.tokens.clone(), fixture.new_tokens)
            .await
            .expect("generate");
        let (m1, a1) = cpu_kernels::calls();
        let ids = g.token_ids.expect("token ids");
        let passes = ids.len() as u64;
        assert!(
            m1 - m0 >= passes * QWEN_MATMULS && a1 - a0 >= passes * QWEN_LAYERS,
            "prompt {}: {} matmuls and {} attentions on docent's kernels for {passes} passes",
            p.name,
            m1 - m0,
            a1 - a0
        );
        got.push(ids);
    }
    if bless {
        fixture.docent = got;
        let path = qwen_fixture_path();
        std::fs::write(&path, serde_json::to_string(&fixture).unwrap()).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    for (i, p) in fixture.prompts.iter().enumerate() {
        assert_eq!(
            got[i], fixture.docent[i],
            "prompt {}: greedy ids moved from the recorded ones",
            p.name
        );
    }
    let llama = fixture
        .llama_cpp
        .as_ref()
        .expect("the fixture has llama.cpp's scores (scripts/llama_score.py --fixture … --write)");
    assert_eq!(
        llama.scored, fixture.docent,
        "llama.cpp scored other ids than the recorded ones: score the fixture again"
    );
    for (i, p) in fixture.prompts.iter().enumerate() {
        let gaps = &llama.gaps[i];
        assert_eq!(gaps.len(), got[i].len());
        let argmax = gaps.iter().filter(|&&g| g == 0.0).count();
        let worst = gaps.iter().cloned().fold(0f32, f32::max);
        eprintln!(
            "prompt {}: {argmax} of {} tokens are {}'s argmax, largest gap {worst:.4}",
            p.name,
            gaps.len(),
            llama.engine
        );
        assert!(
            worst <= 0.25 && argmax * 4 >= gaps.len() * 3,
            "prompt {}: llama.cpp disagrees (largest gap {worst}, argmax {argmax} of {})",
            p.name,
            gaps.len()
        );
    }
}

/// Qwen under the service's fast paths: the fixture's prompts asked at once decode together
/// (continuous batching: far fewer matmul calls than one after the other), read in chunks of
/// 64 tokens (chunked prefill), and after prefix-cache hits (the prompts are prefixes of each
/// other), and each still gives exactly its recorded greedy tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_batched_chunked_and_cached_give_the_recorded_tokens() {
    let _turn = KNOBS.lock().await;
    let fixture = qwen_fixture();
    let n = fixture.new_tokens;

    let mut c = qwen();
    c.continuous_batching = true;
    let generator = std::sync::Arc::new(Generator::load(&c).await.expect("load Qwen 0.5B"));
    let (m0, _) = cpu_kernels::calls();
    let tasks: Vec<_> = fixture
        .prompts
        .iter()
        .map(|p| {
            let (g, tokens) = (generator.clone(), p.tokens.clone());
            tokio::spawn(async move { g.complete_tokens(tokens, n).await })
        })
        .collect();
    let mut together = Vec::new();
    for t in tasks {
        together.push(t.await.unwrap().expect("generate").token_ids.expect("ids"));
    }
    let (m1, _) = cpu_kernels::calls();
    for (i, p) in fixture.prompts.iter().enumerate() {
        assert_eq!(
            together[i], fixture.docent[i],
            "prompt {}: batched tokens differ from its tokens alone",
            p.name
        );
    }
    // one after the other: a forward pass per token and prompt
    let sequential: u64 = fixture
        .docent
        .iter()
        .map(|ids| ids.len() as u64 * QWEN_MATMULS)
        .sum();
    assert!(
        (m1 - m0) * 2 < sequential,
        "matmul calls together {} vs {sequential} one after the other: not batched",
        m1 - m0
    );
    drop(generator);

    c.prefill_chunk_tokens = 64;
    c.prefix_cache = true;
    let generator = Generator::load(&c).await.expect("load Qwen 0.5B");
    // longest first: the shorter prompts then hit the prefix cache
    for (i, p) in fixture.prompts.iter().enumerate().rev() {
        let (m0, _) = cpu_kernels::calls();
        let g = generator
            .complete_tokens(p.tokens.clone(), n)
            .await
            .expect("generate");
        let (m1, _) = cpu_kernels::calls();
        assert_eq!(
            g.token_ids.as_ref(),
            Some(&fixture.docent[i]),
            "prompt {}: chunked or cached prefill changed the tokens",
            p.name
        );
        if i + 1 == fixture.prompts.len() {
            // 700 tokens in chunks of 64: 11 prefill passes, then n - 1 decode passes
            let passes = (m1 - m0) / QWEN_MATMULS;
            assert!(
                passes >= (n as u64 - 1) + 11,
                "{passes} forward passes for a 700-token prompt in chunks of 64"
            );
        }
    }
}

/// Qwen with an F16 KV cache: attention runs on the F16 kernel, and every prompt's tokens stay
/// the recorded F32 ones up to the first near-tie (llama.cpp's two best logits within 0.25),
/// where F16 rounding of keys and values may pick the other token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_f16_kv_cache_runs_on_the_f16_kernel() {
    let _turn = KNOBS.lock().await;
    let fixture = qwen_fixture();
    let mut c = qwen();
    c.kv_cache = "f16".into();
    let generator = Generator::load(&c).await.expect("load Qwen 0.5B");
    for (i, p) in fixture.prompts.iter().enumerate() {
        let before = cpu_kernels::f16_attentions();
        let g = generator
            .complete_tokens(p.tokens.clone(), fixture.new_tokens)
            .await
            .expect("generate");
        let ids = g.token_ids.expect("token ids");
        let f16 = cpu_kernels::f16_attentions() - before;
        assert!(
            f16 >= QWEN_LAYERS * ids.len() as u64,
            "prompt {}: {f16} attentions over F16 keys and values",
            p.name
        );
        let same = agree(&ids, &fixture.docent[i]);
        let tie = fixture.first_near_tie(i);
        eprintln!(
            "F16 KV cache, prompt {}: the first {same} tokens equal the F32 ones (first near-tie at {tie})",
            p.name
        );
        assert!(
            same >= tie,
            "prompt {}: F16 departs after {same} tokens, before the first near-tie at {tie}",
            p.name
        );
    }
    c.kv_cache = "f32".into();
    drop(Generator::load(&c).await.expect("load Qwen 0.5B"));
}

/// Prompt-lookup drafts on Qwen (`generation.lookup_tokens`): the fixture's Rust Book prompts
/// repeat their own phrases, so drafts are proposed and accepted, and the output is plain
/// greedy decoding's (the fixture's ids) up to the first near-tie, where the few-row pass
/// that checks a draft may add up attention in another order than a one-row step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_prompt_lookup_gives_the_plain_tokens() {
    use docent::query::generate::lookup;
    let _turn = KNOBS.lock().await;
    let fixture = qwen_fixture();
    let mut c = qwen();
    c.lookup_tokens = 4;
    let generator = Generator::load(&c).await.expect("load Qwen 0.5B");
    let (steps, proposed, accepted) = lookup::draft_counts();
    for (i, p) in fixture.prompts.iter().enumerate() {
        let g = generator
            .complete_tokens(p.tokens.clone(), fixture.new_tokens)
            .await
            .expect("generate");
        let ids = g.token_ids.expect("token ids");
        let same = agree(&ids, &fixture.docent[i]);
        let tie = fixture.first_near_tie(i);
        eprintln!(
            "prompt lookup, prompt {}: the first {same} of {} tokens equal plain decoding's (first near-tie at {tie})",
            p.name,
            ids.len()
        );
        assert!(
            same >= tie.min(fixture.docent[i].len()),
            "prompt {}: drafts change the answer after {same} tokens, before the first near-tie at {tie}",
            p.name
        );
    }
    let (steps2, proposed2, accepted2) = lookup::draft_counts();
    eprintln!(
        "{} draft steps, {} of {} draft tokens accepted",
        steps2 - steps,
        accepted2 - accepted,
        proposed2 - proposed
    );
    assert!(
        steps2 > steps && accepted2 > accepted,
        "no draft was proposed and accepted on the Rust Book prompts"
    );
}
