//! `docent bench generate`: prefill and decode speed and time to first token of the
//! generation engine on RAG-sized prompts, per weight format, beside llama.cpp on the same
//! GGUF files and thread count; speculative decoding against plain greedy decoding; load
//! times of the model sources (GGUF, safetensors, safetensors + ISQ, UQFF); the F16 KV
//! cache beside the F32 one; many clients with continuous batching on and off; and how long
//! a streaming answer pauses while a long prompt is read beside it, per prefill chunk size.
//!
//! Both engines get the same token ids (the model's tokenizer over a demo-corpus text), so
//! the engines are compared, not their tokenizers or templates. Decoding is greedy.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::bench::{Peer, RemoveOnDrop};
use docent::config::{DraftConfig, GenerationConfig};
use docent::query::generate::{GenerateError, Generator, Params, Schedule, StreamEvent};

/// What to measure.
pub struct Options {
    /// GGUF files (or other model sources) to measure, each on its own.
    pub models: Vec<PathBuf>,
    /// `generation.device` for every engine of the run; on a GPU the llama.cpp peer runs
    /// there too (all layers offloaded, flash attention on).
    pub device: String,
    /// Activation dtype for all of them (`f32`, `f16`, `bf16`, `auto`).
    pub dtype: String,
    /// Prompt lengths in tokens.
    pub prompt_tokens: Vec<usize>,
    /// Tokens generated per measured run.
    pub new_tokens: usize,
    /// Runs per cell; the figures are their medians.
    pub repeat: usize,
    /// Compute threads, given to the llama.cpp peer too (candle's come from
    /// RAYON_NUM_THREADS).
    pub threads: usize,
    /// Text the prompts are cut from.
    pub text: PathBuf,
    /// Speculative decoding: target and draft model, and gamma.
    pub speculative: Option<(PathBuf, PathBuf, usize)>,
    /// Prompt-lookup drafts of up to this many tokens on the speculative pair's two models
    /// (0: none).
    pub lookup: usize,
    /// Load-time comparison: a safetensors directory and the ISQ type (the UQFF file goes
    /// to a scratch directory of the run).
    pub load: Option<(PathBuf, String)>,
    /// Concurrent clients for the throughput table (first model).
    pub clients: Vec<usize>,
    /// The throughput table's workloads (`rag`, `chat`) and schedules (`arrival`, `cohort`,
    /// `off`: no continuous batching).
    pub workloads: Vec<String>,
    /// The throughput table's schedules (see `workloads`).
    pub schedules: Vec<String>,
    /// Distinct prompts for the memory check (10 or fewer: skip).
    pub memory_queries: usize,
    /// The llama.cpp peer (llama-cpp-python), run on the GGUF files, if wanted.
    pub peer: Option<Peer>,
    /// `generation.kernels` for every engine of the run (`docent` or `candle`).
    pub kernels: String,
    /// `generation.isa`: the instruction-set cap of docent's kernels.
    pub isa: String,
    /// `generation.prefill_chunk_tokens` for the speed cells (the chunked-prefill rows set
    /// their own).
    pub prefill_chunk: usize,
    /// `generation.repack`: Q5_0 weights rewritten as Q8_0 and Q4_K weights interleaved at
    /// load.
    pub repack: bool,
    /// A `llama-server` binary: the concurrency table's `rag` rows run on it too, with a
    /// slot per client, on the same file and the same prompts (scripts/llama-server-build.sh).
    pub llama_server: Option<PathBuf>,
}

/// One model × prompt cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Speed {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens the first run generated (fewer than asked when the model stopped).
    pub new_tokens: usize,
    /// Prompt tokens per second of prefill.
    pub prefill_tok_s: f64,
    /// Generated tokens per second after the first (which comes out of the prefill).
    pub decode_tok_s: f64,
    /// Time to first token in milliseconds: the wall time of a one-token request.
    pub ttft_ms: f64,
}

/// One model source's speed per prompt length, docent beside llama.cpp.
#[derive(Debug, Clone, Serialize)]
pub struct ModelRow {
    /// The model's file or directory name (with `+ ISQ <type>` for the safetensors export
    /// quantized at load).
    pub model: String,
    /// Milliseconds docent took to load it.
    pub load_ms: f64,
    /// docent's cells, one per prompt length.
    pub docent: Vec<Speed>,
    /// llama.cpp on the same file, when it ran.
    pub llama_cpp: Vec<Speed>,
    /// Leading generated tokens both engines agree on, per prompt.
    pub agreement: Vec<usize>,
    /// The greedy token ids each engine generated, per prompt (for `--json` readers that check
    /// where and why the engines part).
    pub docent_ids: Vec<Vec<u32>>,
    /// The greedy token ids llama.cpp generated, per prompt (empty when it did not run).
    pub llama_cpp_ids: Vec<Vec<u32>>,
}

/// Speculative decoding with a draft model beside plain decoding of its target.
#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeRow {
    /// The target model's file name.
    pub target: String,
    /// The draft model's file name.
    pub draft: String,
    /// Tokens the draft proposes per step.
    pub gamma: usize,
    /// Tokens in the prompt (the first prompt length).
    pub prompt_tokens: usize,
    /// Decode tokens per second of the target alone.
    pub plain_decode_tok_s: f64,
    /// Decode tokens per second of the target with the draft.
    pub speculative_decode_tok_s: f64,
    /// Decode tokens per second of the draft alone.
    pub draft_decode_tok_s: f64,
    /// Whether speculative decoding generated exactly the target's plain output.
    pub identical_output: bool,
    /// The same speculative server, requests that leave its draft model out
    /// (`generation.draft_model = false`), with prompt-lookup drafts of up to this many
    /// tokens (0: plain target steps): their decode speed and whether their output is the
    /// plain one.
    pub skipped_lookup_tokens: usize,
    /// Decode tokens per second of those requests.
    pub skipped_decode_tok_s: f64,
    /// Whether those requests generated exactly the plain output.
    pub skipped_identical_output: bool,
    /// Draft steps run, draft tokens proposed and accepted, counted by the engine over the
    /// speculative runs.
    pub draft_steps: u64,
    /// Draft tokens proposed over the speculative runs.
    pub draft_proposed: u64,
    /// Draft tokens the target accepted over the speculative runs.
    pub draft_accepted: u64,
}

/// Prompt-lookup drafts (`generation.lookup_tokens`) beside plain decoding of one model.
#[derive(Debug, Clone, Serialize)]
pub struct LookupRow {
    /// The model's file name.
    pub model: String,
    /// Longest prompt-lookup draft, in tokens (`generation.lookup_tokens`).
    pub draft_tokens: usize,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Decode tokens per second without drafts.
    pub plain_decode_tok_s: f64,
    /// Decode tokens per second with prompt-lookup drafts.
    pub lookup_decode_tok_s: f64,
    /// Whether the drafted run generated exactly the plain output.
    pub identical_output: bool,
    /// Draft steps, draft tokens proposed and accepted over the measurement (the engine's
    /// own counts).
    pub draft_steps: u64,
    /// Draft tokens proposed over the measurement.
    pub draft_proposed: u64,
    /// Draft tokens accepted over the measurement.
    pub draft_accepted: u64,
}

/// How long one model source took to load.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRow {
    /// The source: safetensors, with ISQ, writing or reading UQFF, or a GGUF file.
    pub source: String,
    /// Load time in milliseconds.
    pub load_ms: f64,
}

/// Many clients on one engine: each sends two distinct prompts in turn.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyRow {
    /// `docent`, or `llama-server` (one slot per client).
    pub engine: String,
    /// The model's file name.
    pub model: String,
    /// `rag`: 300-token prompts for 32 new tokens (what the service does); `chat`: prompts
    /// of 24–80 tokens for 128 new tokens (decode-bound).
    pub workload: String,
    /// Continuous batching (`generation.continuous_batching`).
    pub batching: bool,
    /// `generation.schedule` with batching (`arrival` or `cohort`); `-` without batching
    /// and for llama-server.
    pub schedule: String,
    /// Concurrent clients.
    pub clients: usize,
    /// Requests sent in all (two per client).
    pub requests: usize,
    /// Prompt tokens of a request (for `chat`, the first client's; they vary).
    pub prompt_tokens: usize,
    /// New tokens asked for per request.
    pub new_tokens: usize,
    /// Generated tokens per second over the whole run.
    pub tokens_per_second: f64,
    /// Requests finished per second over the whole run.
    pub requests_per_second: f64,
    /// Median request latency in milliseconds (request to last token).
    pub latency_p50_ms: f64,
    /// By nearest rank: with 32 requests, the slowest one.
    pub latency_p99_ms: f64,
    /// Slowest request in milliseconds.
    pub latency_max_ms: f64,
}

/// Resident memory after distinct prompts: prefix cache off, on with docent's bound (the
/// default), and on without a bound (mistral.rs's own behaviour, as a control).
#[derive(Debug, Clone, Serialize)]
pub struct MemoryRow {
    /// Whether the prefix cache was on.
    pub prefix_cache: bool,
    /// The prefix cache's bound in MiB (0: none).
    pub limit_mib: usize,
    /// Distinct prompts sent (at most 200 for the unbounded cache).
    pub queries: usize,
    /// Resident memory of the process after the first 10 prompts, in MiB.
    pub rss_after_10_mib: f64,
    /// Resident memory after all of them, in MiB.
    pub rss_after_all_mib: f64,
    /// Growth from the first figure to the second, in percent.
    pub growth_percent: f64,
}

/// A streaming answer while a long prompt is read beside it (chunked prefill).
#[derive(Debug, Clone, Serialize)]
pub struct StallRow {
    /// `generation.prefill_chunk_tokens` (0: whole prompts).
    pub chunk_tokens: usize,
    /// Tokens in the long prompt (the longest prompt length asked for).
    pub prompt_tokens: usize,
    /// The longest pause between two tokens of the answer while the prompt was read.
    pub longest_pause_ms: f64,
    /// Tokens the answer got meanwhile.
    pub tokens_meanwhile: usize,
    /// Wall time of the long prompt's one-token request (its TTFT beside a running answer).
    pub long_prompt_ms: f64,
}

/// The F16 KV cache against the F32 one, first model.
#[derive(Debug, Clone, Serialize)]
pub struct KvRow {
    /// The model's file name.
    pub model: String,
    /// Speed with the F32 KV cache (the models table's cell).
    pub f32: Speed,
    /// Speed with the F16 KV cache.
    pub f16: Speed,
    /// Leading generated tokens on which the two agree.
    pub agree: usize,
}

/// The result of `docent bench generate`: the settings and every table (a table that was
/// not run is empty). Its `Display` prints them.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateBench {
    /// `generation.device`, with the GPU's name when it is one.
    pub device: String,
    /// Compute threads.
    pub threads: usize,
    /// Activation dtype.
    pub dtype: String,
    /// `docent` (kernels/, with the instruction set it chose) or `candle`.
    pub kernels: String,
    /// The processor (model name from /proc/cpuinfo).
    pub cpu: String,
    /// Speed per model source and prompt length.
    pub models: Vec<ModelRow>,
    /// Speculative decoding with a draft model.
    pub speculative: Vec<SpeculativeRow>,
    /// Prompt-lookup drafts on the speculative pair's two models.
    pub lookup: Vec<LookupRow>,
    /// Load times per model source.
    pub load: Vec<LoadRow>,
    /// Throughput at several client counts (first model).
    pub concurrency: Vec<ConcurrencyRow>,
    /// Pauses of a streaming answer beside a long prompt, per prefill chunk size.
    pub stall: Vec<StallRow>,
    /// The F16 KV cache beside the F32 one (CPU only).
    pub kv: Vec<KvRow>,
    /// Resident memory over many distinct prompts.
    pub memory: Vec<MemoryRow>,
    /// The llama.cpp peer as it names itself (version, instruction set), when it ran.
    pub peer: Option<String>,
}

/// What the llama.cpp peer prints.
#[derive(Debug, Deserialize)]
struct PeerReport {
    peer: String,
    results: Vec<PeerResult>,
}

#[derive(Debug, Deserialize)]
struct PeerResult {
    #[serde(flatten)]
    speed: Speed,
    generated: Vec<u32>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The 99th percentile by nearest rank ([`crate::eval::percentile`]): with 32
/// requests, the slowest one.
fn p99(latencies: &[f64]) -> f64 {
    let mut sorted = latencies.to_vec();
    sorted.sort_by(f64::total_cmp);
    crate::eval::percentile(&sorted, 99.0)
}

fn name(p: &Path) -> String {
    p.file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// An engine for the speed cells: no prefix cache, so every prompt is prefilled from
/// scratch, as the llama.cpp peer does (it clears its KV cache per run); the longer prompts
/// start with the shorter ones and would otherwise reuse their KV. The memory rows set it
/// themselves.
fn config(model: &Path, opts: &Options) -> GenerationConfig {
    GenerationConfig {
        model: model.to_path_buf(),
        dtype: opts.dtype.clone(),
        device: opts.device.clone(),
        kernels: opts.kernels.clone(),
        isa: opts.isa.clone(),
        prefix_cache: false,
        prefill_chunk_tokens: opts.prefill_chunk,
        repack: opts.repack,
        ..docent::config::Config::default().generation
    }
}

/// Prompts of the asked lengths: the first n tokens of `text`, repeated if it is short.
fn prompts(generator: &Generator, text: &str, lengths: &[usize]) -> Vec<Vec<u32>> {
    let ids = generator.encode(text);
    lengths
        .iter()
        .map(|&n| ids.iter().copied().cycle().take(n).collect())
        .collect()
}

/// Prefill, decode and TTFT of one prompt: medians over `repeat` runs.
async fn measure(
    generator: &Generator,
    prompt: &[u32],
    new_tokens: usize,
    repeat: usize,
) -> Result<(Speed, Vec<u32>), GenerateError> {
    let params = generator.default_params(new_tokens);
    measure_with(generator, prompt, &params, repeat).await
}

/// [`measure`] with a request's own drafts (`params`: greedy, `max_tokens` new tokens).
async fn measure_with(
    generator: &Generator,
    prompt: &[u32],
    params: &Params,
    repeat: usize,
) -> Result<(Speed, Vec<u32>), GenerateError> {
    let (mut prefill, mut decode, mut ttft) = (Vec::new(), Vec::new(), Vec::new());
    let mut generated = Vec::new();
    let first = Params {
        max_tokens: 1,
        ..params.clone()
    };
    for i in 0..repeat.max(1) {
        let started = Instant::now();
        generator.complete_with(prompt.to_vec(), &first).await?;
        ttft.push(started.elapsed().as_secs_f64() * 1e3);
        let g = generator.complete_with(prompt.to_vec(), params).await?;
        prefill.push(g.prompt_tokens as f64 / g.prompt_secs.max(1e-9));
        // the first token comes out of the prefill step
        decode.push(g.completion_tokens.saturating_sub(1) as f64 / g.completion_secs.max(1e-9));
        if i == 0 {
            generated = g.token_ids.unwrap_or_default();
        }
    }
    Ok((
        Speed {
            prompt_tokens: prompt.len(),
            new_tokens: generated.len(),
            prefill_tok_s: median(prefill),
            decode_tok_s: median(decode),
            ttft_ms: median(ttft),
        },
        generated,
    ))
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn run_peer(
    peer: &Peer,
    model: &Path,
    prompts_file: &Path,
    opts: &Options,
) -> anyhow::Result<PeerReport> {
    let out = std::process::Command::new(&peer.python)
        .arg(&peer.script)
        .arg("--model")
        .arg(model)
        .arg("--threads")
        .arg(opts.threads.to_string())
        .arg("--prompt-tokens")
        .arg(prompts_file)
        .arg("--new-tokens")
        .arg(opts.new_tokens.to_string())
        .arg("--repeat")
        .arg(opts.repeat.to_string())
        .args(if opts.device == "cpu" {
            &[][..]
        } else {
            &["--gpu-layers", "999", "--flash-attn"][..]
        })
        .stderr(std::process::Stdio::inherit())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "the llama.cpp peer failed on {}",
        model.display()
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Runs every table `opts` asks for, in order: models, speculative decoding, load times,
/// the F16 KV cache, concurrency and stalls, memory.
pub async fn run(opts: &Options) -> anyhow::Result<GenerateBench> {
    // the instruction-set cap first: the report names the level, which is fixed on first use
    docent::query::generate::cpu_kernels::install(opts.kernels == "docent", &opts.isa, opts.repack);
    let text = std::fs::read_to_string(&opts.text)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", opts.text.display()))?;
    let scratch =
        std::env::temp_dir().join(format!("docent-bench-generate-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let _cleanup = RemoveOnDrop::Dir(scratch.clone());
    let mut report = GenerateBench {
        device: describe_device(&opts.device),
        threads: opts.threads,
        kernels: kernels_label(opts),
        cpu: cpu_model(),
        dtype: opts.dtype.clone(),
        models: Vec::new(),
        speculative: Vec::new(),
        lookup: Vec::new(),
        load: Vec::new(),
        concurrency: Vec::new(),
        stall: Vec::new(),
        kv: Vec::new(),
        memory: Vec::new(),
        peer: None,
    };
    let first_outputs = models(opts, &text, &scratch, &mut report).await?;
    if let Some((target, draft, gamma)) = &opts.speculative {
        speculative(opts, &text, (target, draft, *gamma), &mut report).await?;
    }
    if let Some((dir, isq)) = &opts.load {
        load_times(opts, &scratch, (dir, isq), &mut report).await?;
    }
    if opts.device == "cpu" {
        kv_f16(opts, &text, &first_outputs, &mut report).await?;
    }
    if let (Some(model), false) = (opts.models.first(), opts.clients.is_empty()) {
        concurrent(opts, &text, model, &mut report).await?;
        stalls(opts, &text, model, &mut report).await?;
    }
    if let (Some(model), true) = (opts.models.first(), opts.memory_queries > 10) {
        memory(opts, &text, model, &mut report).await?;
    }
    Ok(report)
}

/// The kernels row of the report: docent's with the instruction set and the repacked
/// formats, or candle's.
fn kernels_label(opts: &Options) -> String {
    if opts.kernels == "docent" {
        format!(
            "docent ({}{})",
            docent_kernels::cpu::isa().name(),
            match (
                opts.repack,
                docent_kernels::q5_0_x8::preferred(docent_kernels::cpu::isa()),
                docent_kernels::q4k_x8::has_kernel(docent_kernels::cpu::isa())
            ) {
                (true, true, _) => ", Q5_0, Q4_K and Q6_K interleaved",
                (true, false, true) => ", Q5_0 as Q8_0, Q4_K and Q6_K interleaved",
                (true, false, false) => ", Q5_0 as Q8_0",
                (false, _, _) => "",
            }
        )
    } else {
        opts.kernels.clone()
    }
}

/// Each model file, then the safetensors export quantized in situ (its speed shows what
/// ISQ gives on this CPU), beside the llama.cpp peer on the GGUF files. Returns the first
/// file's outputs (the F16 KV cache's reference).
async fn models(
    opts: &Options,
    text: &str,
    scratch: &std::path::Path,
    report: &mut GenerateBench,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut cells: Vec<(String, GenerationConfig)> = opts
        .models
        .iter()
        .map(|m| (name(m), config(m, opts)))
        .collect();
    if let Some((dir, isq)) = &opts.load {
        let mut c = config(dir, opts);
        c.isq = Some(isq.clone());
        cells.push((format!("{} + ISQ {isq}", name(dir)), c));
    }
    let mut first_outputs: Vec<Vec<u32>> = Vec::new();
    for (label, cell) in &cells {
        let model = &cell.model;
        eprintln!("bench generate: {label}");
        let generator = Generator::load(cell).await?;
        let prompts = prompts(&generator, text, &opts.prompt_tokens);
        // one short run first: pages the weights in and allocates buffers
        generator
            .complete_tokens(prompts[0][..16.min(prompts[0].len())].to_vec(), 4)
            .await?;
        let mut row = ModelRow {
            model: label.clone(),
            load_ms: generator.load_ms(),
            docent: Vec::new(),
            llama_cpp: Vec::new(),
            agreement: Vec::new(),
            docent_ids: Vec::new(),
            llama_cpp_ids: Vec::new(),
        };
        let mut ours = Vec::new();
        for prompt in &prompts {
            let (speed, generated) =
                measure(&generator, prompt, opts.new_tokens, opts.repeat).await?;
            row.docent.push(speed);
            ours.push(generated);
        }
        drop(generator);
        row.docent_ids = ours.clone();
        if report.models.is_empty() && cell.isq.is_none() {
            first_outputs = ours.clone();
        }
        let is_gguf = cell.isq.is_none() && model.extension().is_some_and(|e| e == "gguf");
        if let (Some(peer), true) = (&opts.peer, is_gguf) {
            let file = scratch.join("prompts.json");
            let body = serde_json::json!({"prompts": prompts.iter().map(|p| serde_json::json!({"name": p.len().to_string(), "tokens": p})).collect::<Vec<_>>()});
            std::fs::write(&file, body.to_string())?;
            let theirs = run_peer(peer, model, &file, opts)?;
            report.peer = Some(theirs.peer.clone());
            for (r, mine) in theirs.results.iter().zip(&ours) {
                row.agreement.push(common_prefix(mine, &r.generated));
                row.llama_cpp.push(r.speed.clone());
                row.llama_cpp_ids.push(r.generated.clone());
            }
        }
        report.models.push(row);
    }
    Ok(first_outputs)
}

/// Speculative decoding with a draft model beside plain decoding of the target and the
/// draft alone; the same server with the draft left out per request; prompt-lookup drafts.
async fn speculative(
    opts: &Options,
    text: &str,
    (target, draft, gamma): (&PathBuf, &PathBuf, usize),
    report: &mut GenerateBench,
) -> anyhow::Result<()> {
    eprintln!(
        "bench generate: speculative {} + {}",
        name(target),
        name(draft)
    );
    let plain = Generator::load(&config(target, opts)).await?;
    let prompt = prompts(&plain, text, &opts.prompt_tokens[..1]).remove(0);
    let (plain_speed, plain_out) = measure(&plain, &prompt, opts.new_tokens, opts.repeat).await?;
    drop(plain);
    let alone = Generator::load(&config(draft, opts)).await?;
    let (draft_speed, draft_out) = measure(&alone, &prompt, opts.new_tokens, opts.repeat).await?;
    drop(alone);
    let mut c = config(target, opts);
    c.draft = Some(DraftConfig {
        model: draft.clone(),
        gamma,
    });
    let spec = Generator::load(&c).await?;
    let before = docent::query::generate::lookup::draft_counts();
    let (spec_speed, spec_out) = measure(&spec, &prompt, opts.new_tokens, opts.repeat).await?;
    let after = docent::query::generate::lookup::draft_counts();
    // the same server, requests that leave the draft model out (`draft_model: false`),
    // with prompt-lookup drafts when asked for
    let per_request = Params {
        draft_model: false,
        lookup_tokens: opts.lookup,
        ..Params::greedy(opts.new_tokens)
    };
    let (skip_speed, skip_out) = measure_with(&spec, &prompt, &per_request, opts.repeat).await?;
    report.speculative.push(SpeculativeRow {
        target: name(target),
        draft: name(draft),
        gamma,
        prompt_tokens: prompt.len(),
        plain_decode_tok_s: plain_speed.decode_tok_s,
        speculative_decode_tok_s: spec_speed.decode_tok_s,
        draft_decode_tok_s: draft_speed.decode_tok_s,
        identical_output: spec_out == plain_out,
        skipped_lookup_tokens: opts.lookup,
        skipped_decode_tok_s: skip_speed.decode_tok_s,
        skipped_identical_output: skip_out == plain_out,
        draft_steps: after.0 - before.0,
        draft_proposed: after.1 - before.1,
        draft_accepted: after.2 - before.2,
    });
    drop(spec);
    if opts.lookup > 0 {
        for (model, plain_speed, plain_out) in [
            (target, &plain_speed, &plain_out),
            (draft, &draft_speed, &draft_out),
        ] {
            let mut c = config(model, opts);
            c.lookup_tokens = opts.lookup;
            let drafted = Generator::load(&c).await?;
            let before = docent::query::generate::lookup::draft_counts();
            let (speed, out) = measure(&drafted, &prompt, opts.new_tokens, opts.repeat).await?;
            let after = docent::query::generate::lookup::draft_counts();
            report.lookup.push(LookupRow {
                model: name(model),
                draft_tokens: opts.lookup,
                prompt_tokens: prompt.len(),
                plain_decode_tok_s: plain_speed.decode_tok_s,
                lookup_decode_tok_s: speed.decode_tok_s,
                identical_output: &out == plain_out,
                draft_steps: after.0 - before.0,
                draft_proposed: after.1 - before.1,
                draft_accepted: after.2 - before.2,
            });
        }
    }
    Ok(())
}

/// Load times: safetensors, with ISQ, writing and reading UQFF, and each GGUF file.
async fn load_times(
    opts: &Options,
    scratch: &std::path::Path,
    (dir, isq): (&PathBuf, &String),
    report: &mut GenerateBench,
) -> anyhow::Result<()> {
    eprintln!("bench generate: load times of {}", dir.display());
    let uqff = scratch.join("uqff");
    let time = |label: String, c: GenerationConfig| async move {
        let g = Generator::load(&c).await?;
        Ok::<_, GenerateError>(LoadRow {
            source: label,
            load_ms: g.load_ms(),
        })
    };
    let mut c = config(dir, opts);
    report
        .load
        .push(time(format!("safetensors {}", name(dir)), c.clone()).await?);
    c.isq = Some(isq.clone());
    report.load.push(
        time(
            format!("safetensors + ISQ {isq} (quantized at load)"),
            c.clone(),
        )
        .await?,
    );
    c.uqff = Some(uqff.clone());
    report
        .load
        .push(time(format!("safetensors + ISQ {isq}, writing UQFF"), c.clone()).await?);
    report
        .load
        .push(time(format!("UQFF {isq} (written above)"), c).await?);
    for m in &opts.models {
        report
            .load
            .push(time(format!("GGUF {}", name(m)), config(m, opts)).await?);
    }
    Ok(())
}

/// The F16 KV cache beside the F32 one (the models table), same prompts (a CPU switch: on
/// a GPU the cache has the activation dtype).
async fn kv_f16(
    opts: &Options,
    text: &str,
    first_outputs: &[Vec<u32>],
    report: &mut GenerateBench,
) -> anyhow::Result<()> {
    let (Some(model), Some(first)) = (opts.models.first(), report.models.first().cloned()) else {
        return Ok(());
    };
    // the F16 KV cache beside the F32 one (the table above), same prompts (a CPU switch:
    // on a GPU the cache has the activation dtype)
    eprintln!("bench generate: F16 KV cache");
    let mut c = config(model, opts);
    c.kv_cache = "f16".into();
    let generator = Generator::load(&c).await?;
    let prompts = prompts(&generator, text, &opts.prompt_tokens);
    for (i, prompt) in prompts.iter().enumerate() {
        let (speed, generated) = measure(&generator, prompt, opts.new_tokens, opts.repeat).await?;
        report.kv.push(KvRow {
            model: first.model.clone(),
            f32: first.docent[i].clone(),
            f16: speed,
            agree: common_prefix(&generated, first_outputs.get(i).map_or(&[], |v| v)),
        });
    }
    Ok(())
}

/// Throughput at several client counts per workload and schedule, and llama-server's on
/// the `rag` workload when given.
async fn concurrent(
    opts: &Options,
    text: &str,
    model: &std::path::Path,
    report: &mut GenerateBench,
) -> anyhow::Result<()> {
    // the text's tokens (the same for every engine of this model): llama-server's prompts
    let mut prompt_ids = None;
    let runs = opts
        .workloads
        .iter()
        .flat_map(|w| opts.schedules.iter().map(move |s| (w, s)));
    for (workload, order) in runs {
        let workload = workload.as_str();
        anyhow::ensure!(
            ["rag", "chat"].contains(&workload),
            "--workloads: rag or chat, got {workload:?}"
        );
        let (batching, schedule) = match order.as_str() {
            "arrival" => (true, Schedule::Arrival),
            "cohort" => (true, Schedule::Cohort),
            "off" => (false, Schedule::Arrival),
            other => anyhow::bail!("--schedules: arrival, cohort or off, got {other:?}"),
        };
        let mut c = config(model, opts);
        c.continuous_batching = batching;
        c.schedule = schedule;
        c.max_num_seqs = opts.clients.iter().copied().max().unwrap_or(1);
        let generator = std::sync::Arc::new(Generator::load(&c).await?);
        let ids = generator.encode(text);
        prompt_ids = Some(ids.clone());
        for &clients in &opts.clients {
            let schedule = if batching { order.as_str() } else { "-" };
            eprintln!(
                "bench generate: {clients} concurrent clients, {workload}, batching {batching}, schedule {schedule}"
            );
            report.concurrency.push(
                concurrency(&generator, &ids, name(model), workload, clients)
                    .await
                    .map(|r| ConcurrencyRow {
                        batching,
                        schedule: schedule.into(),
                        ..r
                    })?,
            );
        }
    }
    if let (Some(server), Some(ids)) = (&opts.llama_server, prompt_ids) {
        let slots = opts.clients.iter().copied().max().unwrap_or(1);
        let peer = start_llama_server(server, model, opts.threads, slots, 512)?;
        for &clients in &opts.clients {
            eprintln!("bench generate: {clients} concurrent clients, rag, llama-server");
            let (addr, ids, name) = (peer.addr, ids.clone(), name(model));
            report.concurrency.push(
                tokio::task::spawn_blocking(move || server_concurrency(addr, &ids, name, clients))
                    .await??,
            );
        }
    }
    Ok(())
}

/// A streaming answer while a long prompt arrives, for several prefill chunk sizes.
async fn stalls(
    opts: &Options,
    text: &str,
    model: &std::path::Path,
    report: &mut GenerateBench,
) -> anyhow::Result<()> {
    let long_len = opts.prompt_tokens.iter().copied().max().unwrap_or(1200);
    for chunk in [0, 64, 256] {
        eprintln!("bench generate: a {long_len}-token prompt beside an answer, chunks of {chunk}");
        let mut c = config(model, opts);
        c.prefill_chunk_tokens = chunk;
        let generator = Generator::load(&c).await?;
        let ids = generator.encode(text);
        let long: Vec<u32> = ids.iter().copied().cycle().take(long_len).collect();
        let mut pauses = Vec::new();
        let (mut meanwhile, mut long_ms) = (Vec::new(), Vec::new());
        for _ in 0..opts.repeat.max(1) {
            let s = stall(&generator, long.clone()).await?;
            pauses.push(s.longest_pause.as_secs_f64() * 1e3);
            meanwhile.push(s.tokens_meanwhile as f64);
            long_ms.push(s.long_prompt.as_secs_f64() * 1e3);
        }
        report.stall.push(StallRow {
            chunk_tokens: chunk,
            prompt_tokens: long_len,
            longest_pause_ms: median(pauses),
            tokens_meanwhile: median(meanwhile) as usize,
            long_prompt_ms: median(long_ms),
        });
    }
    Ok(())
}

/// Memory over many distinct prompts: the prefix cache off, docent's bounded cache, and
/// mistral.rs's unbounded one.
async fn memory(
    opts: &Options,
    text: &str,
    model: &std::path::Path,
    report: &mut GenerateBench,
) -> anyhow::Result<()> {
    let bounded = docent::config::Config::default()
        .generation
        .prefix_cache_mib;
    // off; docent's bounded cache; mistral.rs's unbounded one (the control only needs to
    // show the growth)
    for (prefix_cache, limit_mib) in [(false, 0), (true, bounded), (true, 0)] {
        let n = if prefix_cache && limit_mib == 0 {
            opts.memory_queries.min(200)
        } else {
            opts.memory_queries
        };
        eprintln!(
            "bench generate: memory over {n} prompts, prefix cache {prefix_cache}, limit {limit_mib} MiB"
        );
        let mut c = config(model, opts);
        c.prefix_cache = prefix_cache;
        c.prefix_cache_mib = limit_mib;
        let generator = Generator::load(&c).await?;
        let ids = generator.encode(text);
        let mut after_10 = 0.0;
        for i in 0..n {
            // distinct prompts: 64-token windows at different offsets, then the index
            let start = (i * 7) % ids.len().saturating_sub(64).max(1);
            let mut prompt: Vec<u32> = ids.iter().copied().cycle().skip(start).take(64).collect();
            prompt.extend(generator.encode(&format!(" {i}")));
            generator.complete_tokens(prompt, 2).await?;
            if i + 1 == 10 {
                after_10 = rss_mib();
            }
        }
        let after = rss_mib();
        report.memory.push(MemoryRow {
            prefix_cache,
            limit_mib,
            queries: n,
            rss_after_10_mib: after_10,
            rss_after_all_mib: after,
            growth_percent: (after / after_10 - 1.0) * 100.0,
        });
    }
    Ok(())
}

/// The device setting, with the GPU's name from nvidia-smi when it is not the CPU.
fn describe_device(device: &str) -> String {
    if device == "cpu" {
        return device.into();
    }
    let name = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name,driver_version", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    if name.is_empty() {
        device.into()
    } else {
        format!("{device} ({name})")
    }
}

/// The processor's model name (first `model name` line of /proc/cpuinfo).
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Resident set size of this process, MiB (Linux).
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |pages| pages * 4096.0 / (1 << 20) as f64)
}

/// `clients` tasks on one engine, each sending two distinct prompts in turn: `rag`, 300-token
/// prompts for 32 tokens; `chat`, prompts of 24–80 tokens (different lengths) for 128.
async fn concurrency(
    generator: &std::sync::Arc<Generator>,
    ids: &[u32],
    model: String,
    workload: &str,
    clients: usize,
) -> anyhow::Result<ConcurrencyRow> {
    let (prompt_len, new): (fn(usize) -> usize, usize) = match workload {
        "rag" => (|_| 300, 32),
        _ => (|i| 24 + 8 * (i % 8), 128),
    };
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let generator = generator.clone();
        let prompts = client_prompts(ids, c, prompt_len);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for p in prompts {
                let t = Instant::now();
                let g = generator.complete_tokens(p, new).await?;
                out.push((t.elapsed().as_secs_f64() * 1e3, g.completion_tokens));
            }
            Ok::<_, GenerateError>(out)
        }));
    }
    let mut latencies = Vec::new();
    let mut tokens = 0;
    for t in tasks {
        for (ms, n) in t.await?? {
            latencies.push(ms);
            tokens += n;
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let requests = latencies.len();
    let max = latencies.iter().copied().fold(0.0, f64::max);
    Ok(ConcurrencyRow {
        engine: "docent".into(),
        model,
        workload: workload.into(),
        batching: true,
        schedule: "-".into(),
        clients,
        requests,
        prompt_tokens: prompt_len(0),
        new_tokens: new,
        tokens_per_second: tokens as f64 / wall,
        requests_per_second: requests as f64 / wall,
        latency_p99_ms: p99(&latencies),
        latency_p50_ms: median(latencies),
        latency_max_ms: max,
    })
}

/// The prompts client `c` of [`concurrency`] sends: `ROUNDS` cuts of `ids`.
fn client_prompts(ids: &[u32], c: usize, len: impl Fn(usize) -> usize) -> Vec<Vec<u32>> {
    (0..ROUNDS)
        .map(|r| {
            let start = ((c * ROUNDS + r) * 37) % ids.len().max(1);
            ids.iter()
                .copied()
                .cycle()
                .skip(start)
                .take(len(c * ROUNDS + r))
                .collect()
        })
        .collect()
}

/// Requests per client in the concurrency table.
const ROUNDS: usize = 2;

/// A `llama-server` on a free loopback port with `slots` parallel sequences of up to
/// `context` tokens each, stopped when dropped.
pub(super) fn start_llama_server(
    binary: &Path,
    model: &Path,
    threads: usize,
    slots: usize,
    context: usize,
) -> anyhow::Result<super::query::Server> {
    let addr = super::query::free_addr()?;
    let mut cmd = std::process::Command::new(binary);
    cmd.arg("--model")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--parallel", &slots.to_string()])
        .args(["--ctx-size", &(context * slots).to_string()]);
    super::query::wait_ready_at(super::query::spawn(cmd, "llama-server")?, addr, "/health")
}

/// [`concurrency`]'s `rag` workload on a llama-server: the same token prompts (the same
/// GGUF, so the same vocabulary), sent as token ids to `/completion` for 32 tokens each,
/// one thread and keep-alive connection per client. The server's prompt cache is off, as
/// every prompt is distinct anyway.
fn server_concurrency(
    addr: std::net::SocketAddr,
    ids: &[u32],
    model: String,
    clients: usize,
) -> anyhow::Result<ConcurrencyRow> {
    const PROMPT: usize = 300;
    const NEW: usize = 32;
    let started = Instant::now();
    let results = super::on_client_threads(clients, |c| -> anyhow::Result<Vec<(f64, usize)>> {
        let mut conn = super::http::Connection::open(addr)?;
        let mut out = Vec::new();
        for p in client_prompts(ids, c, |_| PROMPT) {
            let body = serde_json::to_vec(&serde_json::json!({
                "prompt": p,
                "n_predict": NEW,
                "temperature": 0.0,
                "cache_prompt": false,
            }))?;
            let t = Instant::now();
            let (status, reply) = conn.request("POST", "/completion", &body)?;
            anyhow::ensure!(
                status == 200,
                "llama-server answered {status}: {}",
                String::from_utf8_lossy(&reply)
            );
            let v: serde_json::Value = serde_json::from_slice(&reply)?;
            let n = v["tokens_predicted"].as_u64().unwrap_or(0) as usize;
            out.push((t.elapsed().as_secs_f64() * 1e3, n));
        }
        Ok(out)
    })?;
    let wall = started.elapsed().as_secs_f64();
    let latencies: Vec<f64> = results.iter().flatten().map(|r| r.0).collect();
    let tokens: usize = results.iter().flatten().map(|r| r.1).sum();
    let requests = latencies.len();
    Ok(ConcurrencyRow {
        engine: "llama-server".into(),
        model,
        workload: "rag".into(),
        batching: true,
        schedule: "-".into(),
        clients,
        requests,
        prompt_tokens: PROMPT,
        new_tokens: NEW,
        tokens_per_second: tokens as f64 / wall,
        requests_per_second: requests as f64 / wall,
        latency_max_ms: latencies.iter().copied().fold(0.0, f64::max),
        latency_p99_ms: p99(&latencies),
        latency_p50_ms: median(latencies),
    })
}

/// What a streaming answer went through while a long prompt was read beside it.
#[derive(Debug, Clone, Copy)]
pub struct Stall {
    /// The longest pause between two of its tokens, from the long prompt's arrival until
    /// that prompt's first token.
    pub longest_pause: Duration,
    /// Its tokens in that time.
    pub tokens_meanwhile: usize,
    /// The long prompt's one-token request, wall time.
    pub long_prompt: Duration,
}

/// Streams an answer that goes on (the model continues counting, up to 400 tokens); once it
/// is decoding, asks for one token after `long`, and watches the answer until that token
/// comes.
pub async fn stall(generator: &Generator, long: Vec<u32>) -> Result<Stall, GenerateError> {
    let ended = || GenerateError::Engine("the answer ended before the long prompt was read".into());
    let counting = (1..=24)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
        + ",";
    let mut stream = generator
        .stream_tokens(generator.encode(&counting), 400)
        .await?;
    for _ in 0..3 {
        match stream.next().await {
            Some(Ok(StreamEvent::Delta(_))) => {}
            Some(Err(e)) => return Err(e),
            _ => return Err(ended()),
        }
    }
    let started = Instant::now();
    let mut last = started;
    let (mut pause, mut tokens) = (Duration::ZERO, 0);
    let mut reader = std::pin::pin!(generator.complete_tokens(long, 1));
    let done = loop {
        tokio::select! {
            r = &mut reader => break r,
            e = stream.next() => match e {
                Some(Ok(StreamEvent::Delta(_))) => {
                    pause = pause.max(last.elapsed());
                    last = Instant::now();
                    tokens += 1;
                }
                Some(Err(e)) => return Err(e),
                _ => return Err(ended()),
            }
        }
    };
    let long_prompt = started.elapsed();
    done?;
    Ok(Stall {
        longest_pause: pause.max(last.elapsed()),
        tokens_meanwhile: tokens,
        long_prompt,
    })
}

impl fmt::Display for GenerateBench {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "generation: {} threads, activations {}, kernels {}, greedy; tok/s and ms are medians",
            self.threads, self.dtype, self.kernels
        )?;
        writeln!(f, "cpu: {}", self.cpu)?;
        if self.device != "cpu" {
            writeln!(f, "device: {}", self.device)?;
        }
        if let Some(p) = &self.peer {
            writeln!(f, "peer: {p}, same files, same token ids, same threads")?;
        }
        writeln!(
            f,
            "{:<40} {:>6} | {:>9} {:>8} {:>8} | {:>9} {:>8} {:>8} | {:>6} {:>6} {:>5}",
            "model",
            "prompt",
            "prefill/s",
            "decode/s",
            "TTFT ms",
            "llama.cpp",
            "decode/s",
            "TTFT ms",
            "pre ×",
            "dec ×",
            "agree"
        )?;
        self.write_models(f)?;
        self.write_drafts(f)?;
        for l in &self.load {
            writeln!(f, "load: {:<52} {:>8.0} ms", l.source, l.load_ms)?;
        }
        for k in &self.kv {
            writeln!(
                f,
                "kv cache: {} {}-token prompt: F16 prefill / decode {:.1} / {:.1} tok/s, TTFT {:.0} ms vs F32 {:.1} / {:.1}, {:.0} ms; {} of {} tokens agree",
                k.model,
                k.f16.prompt_tokens,
                k.f16.prefill_tok_s,
                k.f16.decode_tok_s,
                k.f16.ttft_ms,
                k.f32.prefill_tok_s,
                k.f32.decode_tok_s,
                k.f32.ttft_ms,
                k.agree,
                k.f16.new_tokens
            )?;
        }
        self.write_concurrency(f)
    }
}

impl GenerateBench {
    /// One row per model and prompt length beside llama.cpp's, then the best of each.
    fn write_models(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for row in &self.models {
            for (i, d) in row.docent.iter().enumerate() {
                let peer = row.llama_cpp.get(i);
                let cell =
                    |v: Option<f64>, p: usize| v.map_or("–".to_string(), |v| format!("{v:.p$}"));
                writeln!(
                    f,
                    "{:<40} {:>6} | {:>9.1} {:>8.1} {:>8.0} | {:>9} {:>8} {:>8} | {:>6} {:>6} {:>5}",
                    row.model,
                    d.prompt_tokens,
                    d.prefill_tok_s,
                    d.decode_tok_s,
                    d.ttft_ms,
                    cell(peer.map(|p| p.prefill_tok_s), 1),
                    cell(peer.map(|p| p.decode_tok_s), 1),
                    cell(peer.map(|p| p.ttft_ms), 0),
                    cell(peer.map(|p| d.prefill_tok_s / p.prefill_tok_s), 2),
                    cell(peer.map(|p| d.decode_tok_s / p.decode_tok_s), 2),
                    row.agreement
                        .get(i)
                        .map_or("–".to_string(), |a| a.to_string()),
                )?;
            }
        }
        let best = |pick: fn(&Speed) -> f64, peer: bool| {
            self.models
                .iter()
                .flat_map(|r| if peer { &r.llama_cpp } else { &r.docent })
                .map(pick)
                .fold(0.0f64, f64::max)
        };
        if self.models.iter().any(|r| !r.llama_cpp.is_empty()) {
            let (dp, lp) = (
                best(|s| s.prefill_tok_s, false),
                best(|s| s.prefill_tok_s, true),
            );
            let (dd, ld) = (
                best(|s| s.decode_tok_s, false),
                best(|s| s.decode_tok_s, true),
            );
            writeln!(
                f,
                "best configuration: prefill {dp:.1} vs llama.cpp {lp:.1} tok/s ({:.2}×), decode {dd:.1} vs {ld:.1} tok/s ({:.2}×); goal ≥ 1×",
                dp / lp,
                dd / ld
            )?;
        }
        Ok(())
    }

    /// Speculative decoding and prompt-lookup drafts.
    fn write_drafts(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.speculative {
            writeln!(
                f,
                "speculative: target {} + draft {} (gamma {}), {}-token prompt: decode {:.1} tok/s vs plain {:.1} ({:.2}×; goal 1.5×), draft alone {:.1} tok/s, identical output: {}, {} draft steps, {} of {} draft tokens accepted",
                s.target,
                s.draft,
                s.gamma,
                s.prompt_tokens,
                s.speculative_decode_tok_s,
                s.plain_decode_tok_s,
                s.speculative_decode_tok_s / s.plain_decode_tok_s,
                s.draft_decode_tok_s,
                s.identical_output,
                s.draft_steps,
                s.draft_accepted,
                s.draft_proposed
            )?;
            let drafts = if s.skipped_lookup_tokens > 0 {
                format!(
                    "prompt-lookup drafts of ≤ {} tokens",
                    s.skipped_lookup_tokens
                )
            } else {
                "plain target steps".to_string()
            };
            writeln!(
                f,
                "  same server, requests with draft_model false ({drafts}): decode {:.1} tok/s ({:.2}× plain), identical output: {}",
                s.skipped_decode_tok_s,
                s.skipped_decode_tok_s / s.plain_decode_tok_s,
                s.skipped_identical_output
            )?;
        }
        for l in &self.lookup {
            writeln!(
                f,
                "prompt lookup: {} (drafts of up to {} tokens), {}-token prompt: decode {:.1} tok/s vs plain {:.1} ({:.2}×), identical output: {}, {} draft steps, {} of {} draft tokens accepted",
                l.model,
                l.draft_tokens,
                l.prompt_tokens,
                l.lookup_decode_tok_s,
                l.plain_decode_tok_s,
                l.lookup_decode_tok_s / l.plain_decode_tok_s,
                l.identical_output,
                l.draft_steps,
                l.draft_accepted,
                l.draft_proposed
            )?;
        }
        Ok(())
    }

    /// The throughput table, the chunked-prefill stalls and the memory rows.
    fn write_concurrency(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let one = |c: &ConcurrencyRow| {
            self.concurrency
                .iter()
                .find(|o| {
                    (&o.engine, &o.workload, o.batching, &o.schedule, o.clients)
                        == (&c.engine, &c.workload, c.batching, &c.schedule, 1)
                })
                .map(|o| o.tokens_per_second)
        };
        for c in &self.concurrency {
            writeln!(
                f,
                "concurrency: {:<12} {} {:<4} batching {:<3} schedule {:<7} {:>2} clients × 2 requests ({}-token prompts, {} new): {:.1} tok/s ({}× one client), {:.2} req/s, latency p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
                c.engine,
                c.model,
                c.workload,
                if c.batching { "on" } else { "off" },
                c.schedule,
                c.clients,
                c.prompt_tokens,
                c.new_tokens,
                c.tokens_per_second,
                one(c).map_or("–".into(), |o| format!("{:.2}", c.tokens_per_second / o)),
                c.requests_per_second,
                c.latency_p50_ms,
                c.latency_p99_ms,
                c.latency_max_ms
            )?;
        }
        for s in &self.stall {
            writeln!(
                f,
                "chunked prefill: chunks of {:>4} ({}): a {}-token prompt beside a streaming answer: longest pause {:.0} ms, {} answer tokens meanwhile, the prompt's first token after {:.0} ms",
                s.chunk_tokens,
                if s.chunk_tokens == 0 { "whole prompts" } else { "tokens" },
                s.prompt_tokens,
                s.longest_pause_ms,
                s.tokens_meanwhile,
                s.long_prompt_ms
            )?;
        }
        for m in &self.memory {
            writeln!(
                f,
                "memory: prefix cache {:<18}: RSS after 10 prompts {:.0} MiB, after {} {:.0} MiB ({:+.1} %; limit +10 %)",
                match (m.prefix_cache, m.limit_mib) {
                    (false, _) => "off".to_string(),
                    (true, 0) => "on, unbounded".to_string(),
                    (true, l) => format!("on, {l} MiB bound"),
                },
                m.rss_after_10_mib,
                m.queries,
                m.rss_after_all_mib,
                m.growth_percent
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn p99_is_the_nearest_rank() {
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(p99(&v), 198.0);
        // with 32 values, the 99th percentile is the slowest
        let w: Vec<f64> = (1..=32).rev().map(f64::from).collect();
        assert_eq!(p99(&w), 32.0);
        assert_eq!(p99(&[]), 0.0);
    }
}
