//! Stage **generate**: a mistral.rs engine over a local GGUF model.
//!
//! Loaded through `GGUFLoaderBuilder` rather than `GgufModelBuilder` so that the activation
//! dtype can be chosen (the builder hard-codes `Auto`, which picks BF16 on many CPUs and is
//! slower than F32 there), the prefix cache can be turned off (on CPU mistral.rs never evicts
//! it), and a missing file is an error instead of a Hugging Face lookup.

pub mod catalog;
pub mod cpu_kernels;
pub mod device;
pub mod lookup;
pub mod probe;
pub mod reuse;
pub mod steps;

use serde::{Deserialize, Serialize};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use mistralrs::core::{
    parse_isq_value, DefaultSchedulerMethod, GGUFLoaderBuilder, GGUFSpecificConfig, IsqType,
    Loader, MistralRsBuilder, ModelDType, NormalLoaderBuilder, NormalSpecificConfig,
    SchedulerConfig, SpeculativeConfig, SpeculativeLoader,
};
use mistralrs::{
    AutoDeviceMapParams, Constraint, DeviceMapSetting, DrySamplingParams, Model, NormalRequest,
    Request, RequestLike, RequestMessage, Response, SamplingParams, StopTokens, TextMessageRole,
    TextMessages, TokenSource,
};
use tokio::sync::mpsc;

use crate::query::prompt::{Prompt, Role, TokenCounter};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("generation model {path} does not exist; run `make setup` or set generation.model")]
    ModelMissing { path: PathBuf },
    #[error("loading the generation model {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("the request was rejected by the engine: {0}")]
    Validation(String),
    #[error("generation failed: {0}")]
    Engine(String),
}

// ---- `[generation]` settings (the generate stage owns them; `config` aggregates) ----

pub(crate) fn default_cache_size() -> usize {
    256
}

pub(crate) fn yes() -> bool {
    true
}

pub(crate) fn default_prefix_cache_mib() -> usize {
    128
}

pub(crate) fn default_isa() -> String {
    "auto".into()
}

pub(crate) fn default_kernels() -> String {
    "docent".into()
}

fn default_true() -> bool {
    true
}

pub(crate) fn default_kv_cache() -> String {
    "f32".into()
}

pub(crate) fn default_passage_cache_mib() -> usize {
    1024
}

pub(crate) fn default_passage_disk_mib() -> usize {
    4096
}

pub(crate) fn default_passage_recompute_tokens() -> usize {
    0
}

pub(crate) fn default_passage_key_scale() -> f32 {
    0.9
}

pub(crate) fn default_prefill_chunk() -> usize {
    256
}

pub(crate) fn default_max_queue() -> usize {
    32
}

pub(crate) fn default_dry_allowed_length() -> usize {
    2
}

pub(crate) fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationConfig {
    /// A model named in `models.toml` (`qwen2.5-coder-0.5b`; `docent models` lists them),
    /// a GGUF file, a safetensors directory (config.json, tokenizer.json, *.safetensors), a
    /// directory written by `uqff`, or `hf:org/name` for a Hugging Face model (online only).
    pub model: PathBuf,
    /// In-situ quantization of a safetensors model at load (`q4k`, `q8_0`, `q4_0`, …).
    #[serde(default)]
    pub isq: Option<String>,
    /// Directory for the ISQ-quantized weights (UQFF): written on the first start, loaded
    /// on later ones so quantization is paid once.
    #[serde(default)]
    pub uqff: Option<PathBuf>,
    /// Speculative decoding: a smaller model with the same tokenizer proposes `gamma`
    /// tokens, the target checks them in one pass. Greedy only.
    #[serde(default)]
    pub draft: Option<DraftConfig>,
    /// Prompt-lookup drafts: when the answer's last tokens occurred earlier in the prompt or
    /// the answer, up to this many of the tokens that followed them there are checked in
    /// the same forward pass as the next token ([`lookup`]); the output is plain
    /// decoding's. 0 = off. Not with `draft` (a draft model). A request may set its own
    /// (`generation.lookup_tokens`).
    #[serde(default = "default_lookup_tokens")]
    pub lookup_tokens: usize,
    /// Activation dtype: `f32` (fastest on CPU), `f16`, `bf16` or `auto`.
    pub dtype: String,
    /// `cpu`; `cuda` or `cuda:N` (a build with `--features cuda`; an error otherwise); or
    /// `auto`: GPU 0 when the build has CUDA and a GPU opens, else the CPU. See
    /// `generate::device`.
    pub device: String,
    pub max_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (1 = off;
    /// applies when temperature > 0).
    #[serde(default = "one")]
    pub top_p: f64,
    /// Sample among the k most likely tokens (0 = off; applies when temperature > 0).
    #[serde(default)]
    pub top_k: usize,
    /// 1.0 is off. Above 1 also penalises copying the context, which hurts RAG answers.
    pub repetition_penalty: f32,
    /// DRY ("don't repeat yourself") penalty multiplier; 0 is off. mistral.rs applies it to
    /// repeats of any earlier span of prompt and answer (base 1.75, allowed length 2).
    #[serde(default)]
    pub dry_multiplier: f32,
    /// Repeats up to this many tokens long go unpenalised by DRY (mistral.rs's default 2
    /// also penalises quoting the context).
    #[serde(default = "default_dry_allowed_length")]
    pub dry_allowed_length: usize,
    /// Sequences the engine schedules at once.
    pub max_num_seqs: usize,
    /// Tokens of context (prompt and answer) to use; 0 = the model's own length.
    #[serde(default)]
    pub context_tokens: usize,
    /// The prefix cache: the KV data of finished prompts, reused by later prompts that start
    /// the same way (a shared system prompt is computed once). Bounded by
    /// `prefix_cache_mib`, least recently used entries evicted first.
    #[serde(default = "yes")]
    pub prefix_cache: bool,
    /// The most KV data the prefix cache keeps, in MiB (0: no limit, mistral.rs's own
    /// behaviour, under which memory grows with every distinct prompt).
    #[serde(default = "default_prefix_cache_mib")]
    pub prefix_cache_mib: usize,
    /// Compute threads for generation (rayon's global pool: docent's kernels and candle's
    /// own operations share it); 0 = one per core.
    #[serde(default)]
    pub threads: usize,
    /// CPU kernels: `docent` (kernels/: quantized matmuls, tiled attention, instruction set
    /// chosen at run time) or `candle` (mistral.rs's and candle's own, for comparison).
    #[serde(default = "default_kernels")]
    pub kernels: String,
    /// The most advanced instruction set docent's kernels may use: `auto` (what the processor
    /// has), `avx512`, `avx2` or `scalar` (for comparisons; fixed for the process once the
    /// first model has loaded).
    #[serde(default = "default_isa")]
    pub isa: String,
    /// The KV cache's element type on the CPU: `f32`, or `f16` (half the memory and the
    /// bytes attention reads per token; keys and values rounded to F16, as llama.cpp does).
    #[serde(default = "default_kv_cache")]
    pub kv_cache: String,
    /// Rewrite weights when a GGUF model loads, for docent's CPU kernels (not with ISQ):
    /// Q5_0 as Q8_0 (the same values, bit-identical answers; prefill without unpacking the
    /// fifth bit; 12 more bytes per 32 such weights, Qwen2.5 0.5B: +120 MB), on AVX2
    /// machines without AVX-512 as eight rows interleaved with one unsigned byte per value
    /// instead (the same size; the same values, summed in another order), and Q4_K and
    /// Q6_K with eight rows interleaved on x86-64 with AVX2 (the same bytes rearranged;
    /// decode reads eight rows at once).
    #[serde(default = "default_true")]
    pub repack: bool,
    /// Continuous batching on the CPU (GGUF llama, mistral3 and qwen2 models, no draft model): answers of
    /// different lengths decode together in one forward pass, and a new request joins the
    /// running batch between steps.
    #[serde(default = "yes")]
    pub continuous_batching: bool,
    /// With continuous batching, prompts are prefilled this many tokens per step, so answers
    /// that are streaming keep going while a long prompt is read (0: whole prompts).
    #[serde(default = "default_prefill_chunk")]
    pub prefill_chunk_tokens: usize,
    /// Passage reuse (`off`, `exact`, `passages`; [`reuse::PassageReuse`]): retrieved
    /// passages' keys and values computed once and placed into later prompts instead of
    /// being prefilled again. Needs continuous batching (its chunked prefill places them)
    /// and a GGUF model on the quantized Llama decoder (llama, mistral3, qwen2).
    #[serde(default)]
    pub passage_reuse: reuse::PassageReuse,
    /// The most passage keys and values kept in memory, in MiB, least recently used evicted.
    #[serde(default = "default_passage_cache_mib")]
    pub passage_cache_mib: usize,
    /// The most passage keys and values kept on disk beside the index
    /// (`<data_dir>/passages/`, 8-bit keys and 4-bit values), in MiB, least recently used
    /// evicted; 0 keeps them in memory only.
    #[serde(default = "default_passage_disk_mib")]
    pub passage_disk_mib: usize,
    /// In the passage mode, `docent serve` computes every chunk's block in the background
    /// while no answer is being made (at start and after the index changes), as `docent
    /// precompute` does.
    #[serde(default = "yes")]
    pub passage_precompute: bool,
    /// In the passage mode, a passage in place 2 or later has this many of its first
    /// tokens prefilled rather than placed, so that they read the passages before it (the
    /// rest of its block never did); 0 places whole blocks.
    #[serde(default = "default_passage_recompute_tokens")]
    pub passage_recompute_tokens: usize,
    /// In the passage mode, the keys of a passage in place 2 or later are multiplied by
    /// this, so what reads them attends to them with logits this much smaller (below 1:
    /// flatter; the passages before never shaped them, as APE's attention temperature
    /// corrects); 1 leaves them.
    #[serde(default = "default_passage_key_scale")]
    pub passage_key_scale: f32,
    /// With continuous batching, the order in which prompts start (see [`Schedule`]).
    #[serde(default)]
    pub schedule: Schedule,
    /// Answers generating or waiting for the engine at once; more get 429 with
    /// `Retry-After`.
    #[serde(default = "default_max_queue")]
    pub max_queue: usize,
    /// Greedy answers kept for repeated questions (same question, retrieval options and
    /// generation parameters, unchanged index); 0 = no cache.
    #[serde(default = "default_cache_size")]
    pub cache_size: usize,
    /// How answers are made when the request does not say: `generative` (the model) or
    /// `extractive` (the retrieved chunks' best sentences, quoted and cited, no model).
    #[serde(default)]
    pub answer_mode: crate::query::AnswerMode,
    /// What the prompt tells the model to answer when the context does not hold the
    /// answer (the templates' `refusal_phrase`); such an answer becomes a refusal. Empty:
    /// the model is not asked to judge.
    #[serde(default = "default_refusal_phrase")]
    pub refusal_phrase: String,
    /// The model's judgement as a number: the probability of the refusal phrase's first
    /// token at the answer's first step. At or above this the question is refused (the
    /// answer stops there); below it the phrase's first token is masked at that step, so
    /// the model answers. Answers that still say the context does not hold the answer, in
    /// other words, are refused too.
    #[serde(default = "default_refusal_threshold")]
    pub refusal_threshold: f32,
    /// Which of the model's signals decides a refusal (`generation.refusal`: `probe`,
    /// `first_token`, `question`, `off`; see [`RefusalCheck`]).
    #[serde(default, rename = "refusal")]
    pub refusal_check: RefusalCheck,
    /// The setting's earlier name, `generation.refusal_check`: still read, and when given
    /// it wins (`Config::load` moves it to `refusal_check`).
    #[serde(default, rename = "refusal_check", skip_serializing)]
    pub refusal_check_old: Option<RefusalCheck>,
    /// A refusal probe file of one's own (`docent train-refusal`); unset: the one docent
    /// ships for the catalog model (`models.toml`'s `refusal_probe`).
    #[serde(default)]
    pub refusal_probe: Option<PathBuf>,
    /// The probe's threshold (refused at or above); unset: the one in the probe file,
    /// chosen on the probe's dev split.
    #[serde(default)]
    pub refusal_probe_threshold: Option<f32>,
    /// Let an answer start with a citation marker (`[1] ...`). When false, `[` is masked at
    /// the answer's first step, so the model starts with words and cites after them.
    #[serde(default = "yes")]
    pub lead_with_marker: bool,
}

/// With continuous batching, which waiting prompt is read next. Every step decodes all the
/// answers under way together and reads one prompt (chunk) beside them, so each prompt read
/// slows the answers already decoding to one token per chunk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Prompts start in order of arrival, whatever is decoding.
    Arrival,
    /// Prompts start in cohorts: the prompts waiting when one starts are read one after
    /// another; a prompt that arrives after them waits until fewer than
    /// [`COHORT_ADMIT_BELOW`] answers decode, then starts the next cohort. Under a burst the
    /// answers of a cohort finish together in batched steps instead of one token per prompt
    /// chunk; a prompt arriving under load waits longer for its first token. The default:
    /// on the RAG workload at 16 clients the slowest request took 28–30 s against 44–49 s in
    /// order of arrival, at the same throughput (docs/benchmarks.md, "Cohorts").
    #[default]
    Cohort,
}

/// [`Schedule::Cohort`]: a newer prompt starts once fewer answers than this decode (the tail
/// of a cohort, too few for a batched step to pay for the wait).
pub const COHORT_ADMIT_BELOW: usize = 4;

/// How the model's judgement that the passages do not hold the answer is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCheck {
    /// The refusal probe over the model's hidden state at the prompt's last token, read
    /// in the prefill (no extra pass; [`probe`]). A model without a probe falls back to
    /// [`RefusalCheck::FirstToken`] with a warning.
    #[default]
    Probe,
    /// Its probability of starting the answer with the refusal phrase, read at the
    /// answer's first step (no extra pass).
    FirstToken,
    /// A yes/no pre-question before the answer (`prompts/answer_check.jinja`, appended to
    /// the same prompt, so the answer then reuses its prefix from the cache): the
    /// probability of "no" against "yes" at its first token. Costs the pre-question's few
    /// tokens and one step before the answer starts.
    Question,
    /// The model is not asked to judge: it answers every question retrieval lets through
    /// (an answer that says the refusal phrase is still a refusal).
    Off,
}

pub(crate) fn default_refusal_phrase() -> String {
    "I don't know.".into()
}

pub(crate) fn default_refusal_threshold() -> f32 {
    0.7
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraftConfig {
    /// The draft model (same kinds of source as `generation.model`).
    pub model: PathBuf,
    /// Tokens the draft proposes per step.
    #[serde(default = "default_gamma")]
    pub gamma: usize,
}

pub(crate) fn default_gamma() -> usize {
    4
}

pub(crate) fn default_lookup_tokens() -> usize {
    0
}

/// Per-request decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub max_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling mass; 1 = off. Ignored when greedy.
    pub top_p: f64,
    /// Top-k sampling; 0 = off. Ignored when greedy.
    pub top_k: usize,
    /// 1.0 is off; above 1 discourages repeating tokens already in the context.
    pub repetition_penalty: f32,
    /// DRY penalty multiplier; 0 is off.
    pub dry_multiplier: f32,
    /// Longest repeat DRY leaves alone, in tokens.
    pub dry_allowed_length: usize,
    /// Strings that end the answer; cut out of the text.
    pub stop: Vec<String>,
    /// Most tokens of a prompt-lookup draft per step; 0 = off ([`lookup`]).
    pub lookup_tokens: usize,
    /// The configured draft model (`generation.draft`) drafts for this request; false: the
    /// target's own steps. Ignored without a draft model.
    pub draft_model: bool,
}

/// The drafts one request's decoding may read: speed only, greedy output is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Drafts {
    /// Most tokens of a prompt-lookup draft per step; 0 = off.
    lookup_tokens: usize,
    /// The draft model drafts (when the pipeline has one).
    draft_model: bool,
}

impl Drafts {
    /// Plain steps of the target only (one-step questions: a draft would only cost).
    const NONE: Drafts = Drafts {
        lookup_tokens: 0,
        draft_model: false,
    };

    fn of(params: &Params) -> Drafts {
        Drafts {
            lookup_tokens: params.lookup_tokens,
            draft_model: params.draft_model,
        }
    }
}

impl Params {
    /// Greedy decoding of up to `max_tokens`, no penalties, no stop strings.
    pub fn greedy(max_tokens: usize) -> Params {
        Params {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            dry_multiplier: 0.0,
            dry_allowed_length: default_dry_allowed_length(),
            stop: vec![],
            lookup_tokens: 0,
            draft_model: true,
        }
    }
}

/// A finished generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: String,
    /// Ids of the generated tokens, when asked for (`complete_tokens`).
    pub token_ids: Option<Vec<u32>>,
    /// The engine's own timings: prompt (prefill) and completion (decode) seconds.
    pub prompt_secs: f64,
    pub completion_secs: f64,
}

impl Generation {
    /// A finished generation with the engine's usage (token counts and timings; zero when
    /// the engine sent none).
    fn new(
        text: String,
        finish_reason: String,
        usage: Option<&mistralrs::Usage>,
        token_ids: Option<Vec<u32>>,
    ) -> Self {
        let (prompt_tokens, completion_tokens, prompt_secs, completion_secs) =
            usage.map_or((0, 0, 0.0, 0.0), |u| {
                (
                    u.prompt_tokens,
                    u.completion_tokens,
                    f64::from(u.total_prompt_time_sec),
                    f64::from(u.total_completion_time_sec),
                )
            });
        Generation {
            text,
            prompt_tokens,
            completion_tokens,
            finish_reason,
            token_ids,
            prompt_secs,
            completion_secs,
        }
    }
}

pub struct Generator {
    model: Model,
    path: PathBuf,
    tokens: TokenCounter,
    /// The model's context length in tokens (prompt and answer together).
    context_tokens: usize,
    counters: Arc<Counters>,
    /// How long loading the weights took.
    load_ms: f64,
    /// The model's tokenizer, without special tokens.
    ids: Encoder,
    /// Token ids back to text, special tokens left out (as answers are streamed).
    text: Decoder,
    /// First tokens of the refusal phrase (`generation.refusal_phrase`), whose probability
    /// at an answer's first step is the model's judgement; empty when off.
    refusal_tokens: Vec<u32>,
    /// `generation.refusal_threshold` (see [`RefusalGate`]).
    refusal_threshold: f32,
    /// `generation.refusal_check`, after the fallback for a model without a probe.
    refusal_check: RefusalCheck,
    /// The refusal probe and its threshold, with [`RefusalCheck::Probe`].
    probe: Option<ProbeWithThreshold>,
    /// Tokens masked at an answer's first step (`generation.lead_with_marker = false`: the
    /// first tokens of a citation marker); empty when none are.
    lead_masked: Vec<u32>,
    /// First tokens of "yes" and "no", for [`RefusalCheck::Question`].
    yes_tokens: Vec<u32>,
    no_tokens: Vec<u32>,
    /// `generation.lookup_tokens` and the draft model: the drafts of raw completions
    /// ([`Generator::complete_tokens`], [`Generator::stream_tokens`]); chat requests carry
    /// their own in [`Params`]. `drafts.draft_model` is whether the pipeline is speculative
    /// (`generation.draft`): then each request says whether its draft model drafts for it.
    drafts: Drafts,
    /// `generation.passage_reuse` and its blocks (`None` when off or not possible).
    reuse: reuse::PassageReuse,
    passages: Option<Arc<reuse::PassageCache>>,
    /// `generation.passage_recompute_tokens`, `generation.passage_key_scale`.
    recompute_tokens: usize,
    key_scale: f32,
}

/// The passage cache of a model under `config` (`generation.passage_reuse`): `None` when
/// off, or, with a warning, when the model is not a GGUF file whose RoPE docent can turn.
fn passage_cache(config: &GenerationConfig, source: &Source) -> Option<Arc<reuse::PassageCache>> {
    if config.passage_reuse == reuse::PassageReuse::Off {
        return None;
    }
    // blocks are placed by continuous batching's chunked prefill, and a draft model's cache
    // would not hold them
    if config.draft.is_some() || !config.continuous_batching {
        tracing::warn!(
            "generation.passage_reuse is on (the default) but needs generation.continuous_batching = true and no generation.draft: prompts are prefilled whole (set passage_reuse = \"off\" to silence this)"
        );
        return None;
    }
    let found = match source {
        Source::Gguf { dir, file } => {
            let path = dir.join(file);
            reuse::Rope::of_gguf(&path).map(|rope| (rope, path))
        }
        _ => None,
    };
    match found {
        Some((rope, path)) => {
            let mut cache = reuse::PassageCache::new(rope, config.passage_cache_mib << 20);
            cache.model_file = path;
            Some(Arc::new(cache))
        }
        None => {
            tracing::warn!(
                model = %config.model.display(),
                "generation.passage_reuse needs a GGUF model on the llama, mistral3 or qwen2 decoder: prompts are prefilled whole"
            );
            None
        }
    }
}

/// Where a prompt's passages lie ([`Generator::passage_units`]).
struct PassageUnits {
    /// The tokens the blocks are computed after.
    context: Vec<u32>,
    /// Where place 1 starts when a block there is exact (not for a fenced prompt).
    first: Option<usize>,
    /// Each passage found: where it starts in the prompt, its tokens.
    units: Vec<(usize, Vec<u32>)>,
}

/// `block` as a splice at `start`: its keys turned by the offset from where it was
/// computed and multiplied by `key_scale` (`generation.passage_key_scale`: what later
/// tokens' attention logits to them are multiplied by), less its first `head` tokens
/// (prefilled instead, so they read what comes before: `generation.passage_recompute_tokens`);
/// `None` when nothing is left to place.
fn place(
    cache: &reuse::PassageCache,
    block: &reuse::Block,
    start: usize,
    head: usize,
    key_scale: f32,
    in_place: bool,
) -> mistralrs::Result<Option<mistralrs::core::KvSplice>> {
    let n = block.tokens.len();
    if head >= n {
        return Ok(None);
    }
    let delta = start as i64 - block.context_len as i64;
    let scaled = key_scale != 1.0;
    let layers = if head == 0 && delta == 0 && !scaled {
        block.layers.clone()
    } else {
        let cut = |t: &mistralrs::Tensor| -> mistralrs::Result<mistralrs::Tensor> {
            if head == 0 {
                Ok(t.clone())
            } else {
                t.narrow(2, head, n - head)?.force_contiguous()
            }
        };
        let layers = block
            .layers
            .iter()
            .map(|(k, v)| {
                let k = cache.rope.turn(&cut(k)?, delta)?;
                let k = if scaled {
                    k.affine(f64::from(key_scale), 0.0)?
                } else {
                    k
                };
                Ok((k, cut(v)?))
            })
            .collect::<mistralrs::Result<Vec<_>>>()?;
        Arc::new(layers)
    };
    Ok(Some(mistralrs::core::KvSplice {
        start: start + head,
        tokens: block.tokens[head..].to_vec(),
        layers,
        exact: in_place && block.exact && head == 0 && !scaled,
    }))
}

/// What passage reuse does for one answer's request ([`Generator::reuse_plan`]).
#[derive(Default)]
struct ReusePlan {
    splices: Vec<mistralrs::core::KvSplice>,
    keep: Option<Arc<reuse::KvReader>>,
}

/// Text to token ids with the model's tokenizer.
type Encoder = Arc<dyn Fn(&str) -> Vec<u32> + Send + Sync>;

/// Token ids to text with the model's tokenizer.
type Decoder = Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// A GGUF file (quantized or not).
    Gguf { dir: PathBuf, file: String },
    /// A directory with `config.json`, `tokenizer.json` and `*.safetensors`.
    Safetensors { dir: PathBuf },
    /// A directory written by an earlier ISQ run (`generation.uqff`).
    Uqff { dir: PathBuf, files: Vec<PathBuf> },
    /// A Hugging Face model id (`hf:org/name`), downloaded when online.
    Hub { id: String },
}

/// The `*.uqff` file in `dir`, if any.
fn uqff_file(dir: &Path) -> Option<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "uqff"))
        .collect();
    files.sort();
    files.into_iter().next()
}

fn isq_name(isq: IsqType) -> String {
    format!("{isq:?}").to_lowercase()
}

impl Source {
    /// What `model` names. A path that does not exist is an error here: mistral.rs would
    /// take it for a Hugging Face id and go to the network. Hub ids must say `hf:`.
    fn resolve(model: &Path) -> Result<Source, GenerateError> {
        let text = model.to_string_lossy();
        if let Some(id) = text.strip_prefix("hf:") {
            return Ok(Source::Hub { id: id.to_string() });
        }
        let missing = || GenerateError::ModelMissing {
            path: model.to_path_buf(),
        };
        let bad = |message: &str| GenerateError::Load {
            path: model.to_path_buf(),
            message: message.to_string(),
        };
        let canonical = model.canonicalize().map_err(|_| missing())?;
        if canonical.is_file() {
            if canonical.extension().is_none_or(|e| e != "gguf") {
                return Err(bad(
                    "a model file must be GGUF (*.gguf); for safetensors name the directory",
                ));
            }
            let dir = canonical.parent().ok_or_else(missing)?.to_path_buf();
            let file = canonical
                .file_name()
                .ok_or_else(missing)?
                .to_string_lossy()
                .into_owned();
            return Ok(Source::Gguf { dir, file });
        }
        if let Some(uqff) = uqff_file(&canonical) {
            let name = uqff.file_name().ok_or_else(missing)?;
            return Ok(Source::Uqff {
                files: vec![PathBuf::from(name)],
                dir: canonical,
            });
        }
        let has = |name: &str| canonical.join(name).is_file();
        let safetensors = std::fs::read_dir(&canonical)
            .map_err(|_| missing())?
            .filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
        if has("config.json") && has("tokenizer.json") && safetensors {
            return Ok(Source::Safetensors { dir: canonical });
        }
        Err(bad("a model directory needs config.json, tokenizer.json and *.safetensors (or a *.uqff written by docent)"))
    }

    /// The mistral.rs loader; `write_uqff` saves the quantized weights there.
    fn loader(&self, write_uqff: Option<PathBuf>) -> Result<Box<dyn Loader>, GenerateError> {
        let normal = |id: String, from_uqff: Option<Vec<PathBuf>>| {
            NormalLoaderBuilder::new(
                NormalSpecificConfig {
                    topology: None,
                    organization: Default::default(),
                    write_uqff: write_uqff.clone(),
                    from_uqff,
                    imatrix: None,
                    calibration_file: None,
                    hf_cache_path: None,
                    matformer_config_path: None,
                    matformer_slice_name: None,
                },
                None,
                None,
                Some(id),
                false,
                None,
            )
        };
        let (id, from_uqff) = match self {
            Source::Gguf { dir, file } => {
                return Ok(GGUFLoaderBuilder::new(
                    None,
                    None,
                    dir.to_string_lossy().into_owned(),
                    vec![file.clone()],
                    GGUFSpecificConfig { topology: None },
                    false,
                    None,
                )
                .build())
            }
            Source::Safetensors { dir } => (dir.to_string_lossy().into_owned(), None),
            Source::Uqff { dir, files } => {
                (dir.to_string_lossy().into_owned(), Some(files.clone()))
            }
            Source::Hub { id } => (id.clone(), None),
        };
        normal(id.clone(), from_uqff)
            .build(None)
            .map_err(|e| GenerateError::Load {
                path: PathBuf::from(id),
                message: format!("{e:#}"),
            })
    }
}

/// What the engine is doing, for `/healthz` and the tests.
#[derive(Debug, Default)]
struct Counters {
    /// Generations running or waiting in the engine.
    active: AtomicUsize,
    /// Streams given up by their client whose sequence the engine has dropped.
    cancelled: AtomicU64,
}

/// One generation in [`Counters::active`] while this lives.
struct Active<'a>(&'a Counters);

impl<'a> Active<'a> {
    fn new(counters: &'a Counters) -> Self {
        counters.active.fetch_add(1, Ordering::Relaxed);
        Active(counters)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct EngineStats {
    pub active: usize,
    pub cancelled: u64,
}

/// One event of a streamed generation.
#[derive(Debug)]
pub enum StreamEvent {
    /// Raw text the model produced (stop sequences not cut yet).
    Delta(String),
    /// The end, with the usage; `text` is empty (the deltas carry it).
    Done(Generation),
}

/// A generation in progress. Dropping it before `Done` cancels the generation: the engine
/// notices at its next token and drops the sequence (counted in `cancelled` once it has).
pub struct GenerationStream {
    rx: Option<mpsc::Receiver<Response>>,
    counters: Arc<Counters>,
    /// `Done` was delivered (or an error): the engine is finished with the sequence.
    finished: bool,
    /// `Done`, held back while the text of the last chunk is delivered.
    pending_done: Option<Generation>,
    /// Released only once the engine has let go of the sequence (see [`Self::hold`]).
    held: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The model's signals; `None` when no refusal phrase is configured.
    judge: Option<Judge>,
}

/// What a stream knows of the model's judgement.
struct Judge {
    /// The pre-question's probability of "no" ([`RefusalCheck::Question`]): it decides.
    question: Option<f32>,
    /// Set at the first generated step: the probability of the refusal phrase's first
    /// token (see [`RefusalGate`]); it decides when there is no pre-question.
    first_token: Option<Arc<OnceLock<f32>>>,
    /// The probe's score (set in the prefill) and its threshold: it decides when there is
    /// no pre-question and the model gave its states.
    probe: Option<(Arc<probe::ProbeScore>, f32)>,
    threshold: f32,
}

impl Judge {
    fn judgement(&self) -> Option<Judgement> {
        let first_token = self.first_token.as_ref().and_then(|p| p.get().copied());
        let probe = self.probe.as_ref().and_then(|(s, _)| s.get());
        let (probability, threshold) = match (self.question, probe, &self.probe) {
            (Some(q), _, _) => (q, self.threshold),
            (None, Some(p), Some((_, t))) => (p, *t),
            _ => (first_token?, self.threshold),
        };
        Some(Judgement {
            probability,
            refuse: probability >= threshold,
            signals: RefusalSignals {
                first_token,
                question: self.question,
                probe,
            },
        })
    }
}

impl GenerationStream {
    /// Keeps `permit` (a place in the generation queue) until the engine is done with the
    /// sequence, also when this stream is dropped early: a cancelled sequence lives on in
    /// the engine until its next step, so releasing the place at once would let abandoned
    /// requests (timeouts, clients gone) pile up in the engine, with their memory, beyond
    /// `generation.max_queue` (seen under load).
    pub fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        self.held = Some(permit);
    }

    /// The model's judgement: with a pre-question from the start, else once the first
    /// token is out (`None` before, or when no refusal phrase is configured).
    pub fn judgement(&self) -> Option<Judgement> {
        self.judge.as_ref().and_then(Judge::judgement)
    }

    /// The next event; `None` after `Done` or an error.
    pub async fn next(&mut self) -> Option<Result<StreamEvent, GenerateError>> {
        if let Some(done) = self.pending_done.take() {
            self.finished = true;
            return Some(Ok(StreamEvent::Done(done)));
        }
        if self.finished {
            return None;
        }
        let rx = self.rx.as_mut()?;
        let Some(response) = rx.recv().await else {
            self.finished = true;
            return Some(Err(GenerateError::Engine(
                "the engine dropped the request".into(),
            )));
        };
        // chat requests stream `Chunk`s; raw completions (`stream_tokens`) `CompletionChunk`s
        let (text, finish_reason, usage) = match response {
            Response::Chunk(chunk) => match chunk.choices.into_iter().next() {
                Some(c) => (
                    c.delta.content.unwrap_or_default(),
                    c.finish_reason,
                    chunk.usage,
                ),
                None => (String::new(), None, chunk.usage),
            },
            Response::CompletionChunk(chunk) => match chunk.choices.into_iter().next() {
                Some(c) => (c.text, c.finish_reason, None),
                None => (String::new(), None, None),
            },
            Response::CompletionDone(r) => {
                let reason = r.choices.first().map(|c| c.finish_reason.clone());
                (String::new(), reason.or(Some("stop".into())), Some(r.usage))
            }
            other => {
                self.finished = true;
                return Some(Err(response_error(other)));
            }
        };
        if let Some(finish_reason) = finish_reason {
            let done = Generation::new(String::new(), finish_reason, usage.as_ref(), None);
            if text.is_empty() {
                self.finished = true;
                return Some(Ok(StreamEvent::Done(done)));
            }
            self.pending_done = Some(done);
        }
        Some(Ok(StreamEvent::Delta(text)))
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        let counters = self.counters.clone();
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        if self.finished {
            counters.active.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        // Closing the channel makes the engine's next send fail, which cancels the
        // sequence; the channel reports its end once the engine has dropped the sequence.
        rx.close();
        let held = self.held.take();
        let wait = async move {
            while rx.recv().await.is_some() {}
            counters.cancelled.fetch_add(1, Ordering::Relaxed);
            counters.active.fetch_sub(1, Ordering::Relaxed);
            drop(held);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(wait);
            }
            Err(_) => {
                self.counters.active.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

fn response_error(response: Response) -> GenerateError {
    match response {
        Response::ValidationError(e) => GenerateError::Validation(e.to_string()),
        Response::InternalError(e) => GenerateError::Engine(e.to_string()),
        Response::ModelError(m, _) | Response::CompletionModelError(m, _) => {
            GenerateError::Engine(m)
        }
        _ => GenerateError::Engine("unexpected response kind".into()),
    }
}

fn dtype(name: &str) -> ModelDType {
    match name {
        "f16" => ModelDType::F16,
        "bf16" => ModelDType::BF16,
        "auto" => ModelDType::Auto,
        _ => ModelDType::F32,
    }
}

/// Where the weights come from (a UQFF directory written earlier replaces the safetensors
/// it was made from), the in-place quantization to apply, and the UQFF file to write.
fn weights(
    config: &GenerationConfig,
) -> Result<(Source, Option<IsqType>, Option<PathBuf>), GenerateError> {
    let load_err = |message: String| GenerateError::Load {
        path: config.model.clone(),
        message,
    };
    let target = Source::resolve(&catalog::resolve(&config.model))?;
    let isq = config
        .isq
        .as_deref()
        .map(|s| parse_isq_value(s, None))
        .transpose()
        .map_err(load_err)?;
    let target = match (&target, &config.uqff) {
        // a UQFF directory made earlier: load the quantized weights from it
        (Source::Safetensors { .. } | Source::Hub { .. }, Some(dir))
            if uqff_file(dir).is_some() =>
        {
            Source::resolve(dir)?
        }
        _ => target,
    };
    let write_uqff = match (&target, &config.uqff, isq) {
        (Source::Safetensors { .. } | Source::Hub { .. }, Some(dir), Some(isq)) => {
            Some(dir.join(format!("{}.uqff", isq_name(isq))))
        }
        _ => None,
    };
    let isq = match target {
        Source::Uqff { .. } => None,
        _ => isq,
    };
    if isq.is_some() && matches!(target, Source::Gguf { .. }) {
        return Err(load_err(
            "generation.isq applies to safetensors models; a GGUF file is quantized already".into(),
        ));
    }
    Ok((target, isq, write_uqff))
}

/// The vendored engine's process-wide settings (vendor/PATCHES.md): docent's CPU kernels
/// and their threads, the prefix cache's bound, the KV cache's type, prompt-lookup drafts,
/// continuous batching, chunked prefill and the cohort schedule.
fn install_engine_settings(config: &GenerationConfig) {
    cpu_kernels::init_threads(config.threads);
    // an ISQ model's weights are re-quantised after load, from the file's layout
    let repack = config.repack && config.isq.is_none();
    cpu_kernels::install(config.kernels == "docent", &config.isa, repack);
    mistralrs::core::set_prefix_cache_limit_bytes(config.prefix_cache_mib << 20);
    mistralrs::core::set_cpu_kv_cache_f16(config.kv_cache == "f16");
    // drafts are asked for per request (`Generator::send`); the proposer is the same
    mistralrs::core::set_draft_proposer(Some(lookup::propose));
    // Continuous batching needs each sequence's own cache: not with a draft model, whose
    // speculative steps manage the caches themselves (the pipeline declines it anyway).
    let batching = config.continuous_batching && config.draft.is_none();
    mistralrs::core::set_cpu_continuous_batching(batching);
    mistralrs::core::set_cpu_prefill_chunk(if batching {
        config.prefill_chunk_tokens
    } else {
        0
    });
    mistralrs::core::set_cpu_cohort_scheduling(match config.schedule {
        Schedule::Cohort if batching => COHORT_ADMIT_BELOW,
        _ => 0,
    });
}

/// The engine's pipeline for `loader` on the configured device and dtype (blocking work,
/// off the async threads).
async fn load_pipeline(
    config: &GenerationConfig,
    loader: Box<dyn Loader>,
    isq: Option<IsqType>,
) -> Result<Arc<tokio::sync::Mutex<dyn mistralrs::core::Pipeline + Send + Sync>>, String> {
    let device_choice: device::DeviceChoice = config
        .device
        .parse()
        .map_err(|e| format!("generation.device {e}"))?;
    let dtype = dtype(&config.dtype);
    let dtype_is_f32 = config.dtype == "f32";
    tokio::task::spawn_blocking(move || {
        let device = device_choice.select()?;
        if !device.is_cpu() && dtype_is_f32 {
            tracing::warn!(
                "generation.dtype = \"f32\" on a GPU: attention and the KV cache run in F32; \
                 \"auto\" (BF16 on recent GPUs) is faster"
            );
        }
        loader
            .load_model_from_hf(
                None,
                TokenSource::None,
                &dtype,
                &device,
                true,
                DeviceMapSetting::Auto(AutoDeviceMapParams::default_text()),
                isq,
                None,
            )
            .map_err(|e| format!("{e:#}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// The loaded model's tokenizer as docent uses it: text to ids, ids to text, its context
/// length and whether it has a chat template.
struct Tokenizer {
    ids: Encoder,
    text: Decoder,
    context_tokens: usize,
    has_template: bool,
}

impl Tokenizer {
    fn of(p: &(dyn mistralrs::core::Pipeline + Send + Sync)) -> Result<Self, String> {
        let tokenizer = p
            .tokenizer()
            .ok_or_else(|| "the model has no tokenizer".to_string())?;
        let decoding = tokenizer.clone();
        let text: Decoder =
            Arc::new(move |ids: &[u32]| decoding.decode(ids, true).unwrap_or_default());
        let ids: Encoder = Arc::new(move |text: &str| {
            tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        });
        Ok(Tokenizer {
            ids,
            text,
            context_tokens: p.get_metadata().max_seq_len,
            has_template: p
                .get_chat_template()
                .is_some_and(|t| t.chat_template.is_some()),
        })
    }
}

impl Generator {
    /// Loads the model named in `config`, with its draft model when speculative decoding
    /// is configured (blocking work; call before serving).
    pub async fn load(config: &GenerationConfig) -> Result<Self, GenerateError> {
        let path = config.model.clone();
        let load_err = |message: String| GenerateError::Load {
            path: path.clone(),
            message,
        };
        let (target, isq, write_uqff) = weights(config)?;
        let passages = passage_cache(config, &target);
        // the refusal probe first: one for another model file stops the start-up at once
        let (refusal_check, probe) = refusal_signal(config).map_err(load_err)?;
        let loader = target.loader(write_uqff.clone())?;
        let loader: Box<dyn Loader> = match &config.draft {
            Some(draft) => Box::new(SpeculativeLoader {
                target: loader,
                draft: Source::resolve(&catalog::resolve(&draft.model))?.loader(None)?,
                config: SpeculativeConfig { gamma: draft.gamma },
            }),
            None => loader,
        };
        install_engine_settings(config);
        let started = Instant::now();
        let pipeline = load_pipeline(config, loader, isq).await.map_err(load_err)?;
        let load_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            model = %config.model.display(),
            load_ms,
            isq = ?isq,
            uqff_written = ?write_uqff,
            draft = ?config.draft.as_ref().map(|d| &d.model),
            "generation model loaded"
        );
        let tokenizer = Tokenizer::of(&*pipeline.lock().await).map_err(load_err)?;
        let max_num_seqs = NonZeroUsize::new(config.max_num_seqs).unwrap_or(NonZeroUsize::MIN);
        let runner = MistralRsBuilder::new(
            pipeline,
            SchedulerConfig::DefaultScheduler {
                method: DefaultSchedulerMethod::Fixed(max_num_seqs),
            },
            false,
            None,
        )
        // bounded in bytes by the patched prefix cacher (generation.prefix_cache_mib); off with
        // a draft model: mistral.rs's prefix cache keeps the target's KV only, and speculative
        // steps after a prefix hit then diverge from plain greedy decoding (seen in tests)
        .with_no_prefix_cache(!config.prefix_cache || config.draft.is_some())
        .build()
        .await;
        let model = Model::new(runner);
        // a model without a chat template (a base model) only serves raw completions
        let count = tokenizer.ids.clone();
        let encode = move |text: &str| {
            let n = count(text).len();
            // an encoding failure still has to count: assume a token per byte
            if n == 0 {
                text.len()
            } else {
                n
            }
        };
        let tokens = if tokenizer.has_template {
            template_overhead(&model, encode)
                .await
                .map_err(|e| load_err(format!("measuring the chat template: {e}")))?
        } else {
            TokenCounter::new(encode, 0, 0)
        };
        let context_tokens = match config.context_tokens {
            0 => tokenizer.context_tokens,
            n => n.min(tokenizer.context_tokens),
        };
        let ids = tokenizer.ids;
        let word_tokens = |words: &[&str]| {
            let mut t: Vec<u32> = words
                .iter()
                .flat_map(|w| first_tokens(w, ids.as_ref()))
                .collect();
            t.sort_unstable();
            t.dedup();
            t
        };
        Ok(Generator {
            model,
            path,
            tokens,
            context_tokens,
            counters: Arc::default(),
            load_ms,
            refusal_tokens: first_tokens(&config.refusal_phrase, ids.as_ref()),
            refusal_threshold: config.refusal_threshold,
            refusal_check,
            probe,
            lead_masked: if config.lead_with_marker {
                Vec::new()
            } else {
                word_tokens(&["[", "[1]", "[[", "[\n"])
            },
            yes_tokens: word_tokens(&["yes", "Yes", "YES"]),
            no_tokens: word_tokens(&["no", "No", "NO"]),
            ids,
            text: tokenizer.text,
            // by default a draft model's pipeline runs its own steps; drafts of both kinds
            // never mix in one request
            drafts: Drafts {
                lookup_tokens: if config.draft.is_some() {
                    0
                } else {
                    config.lookup_tokens
                },
                draft_model: config.draft.is_some(),
            },
            reuse: config.passage_reuse,
            recompute_tokens: config.passage_recompute_tokens,
            key_scale: config.passage_key_scale,
            passages,
        })
    }

    /// Token ids of `text` with the model's tokenizer (no special tokens added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        (self.ids)(text)
    }

    /// Milliseconds loading the weights took (quantization included).
    pub fn load_ms(&self) -> f64 {
        self.load_ms
    }

    /// The model's tokenizer, for the prompt budget.
    pub fn tokens(&self) -> &TokenCounter {
        &self.tokens
    }

    /// Tokens the prompt and the answer may use together.
    pub fn context_tokens(&self) -> usize {
        self.context_tokens
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            active: self.counters.active.load(Ordering::Relaxed),
            cancelled: self.counters.cancelled.load(Ordering::Relaxed),
        }
    }

    pub fn model_path(&self) -> &Path {
        &self.path
    }

    /// Chat generation with the model's own chat template.
    pub async fn chat(
        &self,
        prompt: &Prompt,
        params: &Params,
    ) -> Result<Generation, GenerateError> {
        self.run(
            messages(prompt),
            sampling(params),
            false,
            Drafts::of(params),
            None,
        )
        .await
    }

    /// [`Self::chat`] with `reader` reading the hidden states at every generated token
    /// (no drafts: a verified draft has no states).
    pub async fn chat_reading(
        &self,
        prompt: &Prompt,
        params: &Params,
        reader: Arc<steps::StepReader>,
    ) -> Result<Generation, GenerateError> {
        self.run(
            messages(prompt),
            sampling(params),
            false,
            Drafts::NONE,
            Some(vec![reader]),
        )
        .await
    }

    /// Token ids back to text, as answers are streamed.
    pub fn decode(&self, ids: &[u32]) -> String {
        (self.text)(ids)
    }

    /// Chat generation, token by token; the stream also gives the model's refusal
    /// judgement ([`GenerationStream::judgement`]) when a refusal phrase is set. With
    /// [`RefusalCheck::Question`] the pre-question runs first; when it refuses, the answer
    /// is not started and the stream ends at once.
    pub async fn stream(
        &self,
        prompt: &Prompt,
        params: &Params,
    ) -> Result<GenerationStream, GenerateError> {
        let judging = self.refusal_check != RefusalCheck::Off
            && (!self.refusal_tokens.is_empty() || self.probe.is_some());
        let question = match self.refusal_check {
            RefusalCheck::Question if judging && !prompt.check.is_empty() => {
                Some(self.check(prompt).await?)
            }
            _ => None,
        };
        let refuse_first_token = match question {
            // the pre-question decides; the answer's first step is only recorded (and the
            // phrase masked there: the model answers what the check judged answerable)
            Some(_) => f32::INFINITY,
            None => self.refusal_threshold,
        };
        let first_token = judging.then(Arc::<OnceLock<f32>>::default);
        let probe = self
            .probe
            .as_ref()
            .filter(|_| judging)
            .map(|(p, threshold)| ProbeGate {
                read: probe::ProbeRead {
                    probe: p.clone(),
                    score: Arc::default(),
                },
                threshold: *threshold,
            });
        let judge = Judge {
            question,
            first_token: first_token.clone(),
            probe: probe.as_ref().map(|g| (g.read.score.clone(), g.threshold)),
            threshold: self.refusal_threshold,
        };
        if question.is_some_and(|q| q >= self.refusal_threshold) {
            return Ok(GenerationStream {
                rx: None,
                counters: self.counters.clone(),
                finished: true,
                pending_done: None,
                held: None,
                judge: Some(judge),
            });
        }
        let processors = (judging || !self.lead_masked.is_empty()).then(|| {
            vec![Arc::new(RefusalGate {
                tokens: if judging {
                    self.refusal_tokens.clone()
                } else {
                    Vec::new()
                },
                threshold: refuse_first_token,
                probability: first_token.clone().unwrap_or_default(),
                masked: self.lead_masked.clone(),
                probe: probe.filter(|_| question.is_none()),
            }) as Arc<dyn mistralrs::CustomLogitsProcessor>]
        });
        let plan = self.reuse_plan(prompt).await?;
        let processors = match (processors, plan.keep) {
            (p, None) => p,
            (p, Some(keep)) => {
                let mut p = p.unwrap_or_default();
                p.push(keep as Arc<dyn mistralrs::CustomLogitsProcessor>);
                Some(p)
            }
        };
        let mut stream = self
            .stream_request(
                messages(prompt),
                sampling(params),
                processors,
                Drafts::of(params),
                plan.splices,
            )
            .await?;
        stream.judge = judging.then_some(judge);
        Ok(stream)
    }

    /// Where `prompt`'s passages lie in its tokens, and the tokens their blocks are
    /// computed after: the prompt's own up to its first passage, or, for a fenced prompt
    /// (`safety.spotlight`: a fence new each request), the same prompt's in the cache's
    /// fence (never exact then: the tokens before the passages differ). `None` when no
    /// passage is found.
    async fn passage_units(
        &self,
        cache: &reuse::PassageCache,
        prompt: &Prompt,
    ) -> Result<Option<PassageUnits>, GenerateError> {
        let ids = self.prompt_ids(prompt).await?;
        let units = reuse::find_units(&ids, &prompt.passages, |t| (self.ids)(t));
        let fenced = !prompt.fence.is_empty();
        let (home_ids, home_units) = if fenced {
            let home = prompt.with_fence(&cache.fence());
            let ids = self.prompt_ids(&home).await?;
            let units = reuse::find_units(&ids, &home.passages, |t| (self.ids)(t));
            (ids, units)
        } else {
            (ids, units.clone())
        };
        let Some(first) = home_units.iter().flatten().map(|u| u.0).next() else {
            return Ok(None);
        };
        let units = units
            .into_iter()
            .zip(home_units)
            .filter_map(|(u, h)| match (u, h) {
                (Some(u), Some(h)) if u.1 == h.1 => Some(u),
                _ => None,
            })
            .collect();
        Ok(Some(PassageUnits {
            context: home_ids[..first].to_vec(),
            first: (!fenced).then_some(first),
            units,
        }))
    }

    /// Passage reuse for `prompt` (`generation.passage_reuse`, [`reuse`]): the blocks the
    /// engine places into its cache, and the reader that keeps the first passage's block
    /// from this prefill when the cache lacks it (that block is exact in place 1). Nothing
    /// when off, when the prompt quotes no passage, or when none is found in its tokens; a
    /// fenced prompt's passages are computed in the cache's fence, and never in the exact
    /// mode. In a later place a block's first `generation.passage_recompute_tokens` tokens
    /// are prefilled instead, so that they read the passages before them.
    async fn reuse_plan(&self, prompt: &Prompt) -> Result<ReusePlan, GenerateError> {
        let mut plan = ReusePlan::default();
        let Some(cache) = self
            .passages
            .as_ref()
            .filter(|_| !prompt.passages.is_empty())
        else {
            return Ok(plan);
        };
        let exact_mode = self.reuse == reuse::PassageReuse::Exact;
        if exact_mode && !prompt.fence.is_empty() {
            return Ok(plan);
        }
        let Some(found) = self.passage_units(cache, prompt).await? else {
            return Ok(plan);
        };
        let context_hash = reuse::hash_tokens(0, &found.context);
        for (i, (start, tokens)) in found.units.into_iter().enumerate() {
            let in_place = found.first == Some(start);
            if exact_mode && !in_place {
                break;
            }
            // a miss in memory may read a file: off the async threads then
            let kept = if cache.has_disk() {
                let (c, t) = (cache.clone(), tokens.clone());
                tokio::task::spawn_blocking(move || c.get(context_hash, &t))
                    .await
                    .map_err(|e| GenerateError::Engine(e.to_string()))?
            } else {
                cache.get(context_hash, &tokens)
            };
            let block = match kept {
                Some(b) => b,
                None if in_place => {
                    // prefilled in place by this request, exactly; kept from it
                    plan.keep = Some(Arc::new(reuse::KvReader::new(
                        cache.clone(),
                        found.context.clone(),
                        tokens,
                    )));
                    continue;
                }
                None => match self
                    .compute_block(cache, &found.context, tokens.clone(), false)
                    .await?
                {
                    Some(b) => b,
                    None => continue,
                },
            };
            // the first passage read only the prefix in a prefill too
            let (head, scale) = if i == 0 {
                (0, 1.0)
            } else {
                (self.recompute_tokens, self.key_scale)
            };
            if let Some(splice) = place(cache, &block, start, head, scale, in_place)
                .map_err(|e| GenerateError::Engine(e.to_string()))?
            {
                plan.splices.push(splice);
            }
        }
        Ok(plan)
    }

    /// Computes the blocks of `prompt`'s passages that neither memory nor disk holds
    /// (`docent precompute`: every chunk ahead of the questions); how many it computed.
    /// Nothing unless `generation.passage_reuse = "passages"`.
    pub async fn precompute_passages(&self, prompt: &Prompt) -> Result<usize, GenerateError> {
        let Some(cache) = self
            .passages
            .as_ref()
            .filter(|_| self.reuse == reuse::PassageReuse::Passages)
        else {
            return Ok(0);
        };
        let Some(found) = self.passage_units(cache, prompt).await? else {
            return Ok(0);
        };
        let context_hash = reuse::hash_tokens(0, &found.context);
        let mut computed = 0;
        for (_, tokens) in found.units {
            if cache.contains(context_hash, &tokens) {
                continue;
            }
            // ahead of the questions: to disk, not into the memory recent answers use
            if self
                .compute_block(cache, &found.context, tokens, true)
                .await?
                .is_some()
            {
                computed += 1;
            }
        }
        Ok(computed)
    }

    /// A passage's block computed after `context` (one greedy step over both; the
    /// context's own keys and values come from the prefix cache after the first time).
    async fn compute_block(
        &self,
        cache: &Arc<reuse::PassageCache>,
        context: &[u32],
        tokens: Vec<u32>,
        disk_only: bool,
    ) -> Result<Option<Arc<reuse::Block>>, GenerateError> {
        let started = Instant::now();
        let ids = [context, &tokens].concat();
        let reader = reuse::KvReader::new(cache.clone(), context.to_vec(), tokens);
        let reader = Arc::new(if disk_only {
            reader.disk_only()
        } else {
            reader
        });
        self.one_step(RequestMessage::CompletionTokens(ids), reader.clone())
            .await?;
        cache.note_computed(started.elapsed());
        Ok(reader.take())
    }

    /// Keeps passage blocks on disk under `root` too (`generation.passage_disk_mib`), in a
    /// folder of this model's own (named by a hash of its file): blocks written by an
    /// earlier run of the same model and prompt are read instead of computed. Nothing
    /// unless `generation.passage_reuse = "passages"`, nor when `limit_mib` is 0.
    pub async fn attach_passage_disk(&self, root: &Path, limit_mib: usize) -> std::io::Result<()> {
        // the exact mode places only a prefill's own keys and values, never 8-bit ones
        let Some(cache) = self
            .passages
            .clone()
            .filter(|_| limit_mib > 0 && self.reuse == reuse::PassageReuse::Passages)
        else {
            return Ok(());
        };
        let (root, model) = (root.to_path_buf(), cache.model_file.clone());
        let salt = format!("{:?}", cache.rope);
        let started = Instant::now();
        let blocks = tokio::task::spawn_blocking(move || {
            let dir = reuse::disk::model_dir(&root, &model, &salt)?;
            reuse::disk::DiskBlocks::open(&dir, (limit_mib as u64) << 20)
        })
        .await
        .map_err(std::io::Error::other)??;
        let stats = blocks.stats();
        tracing::info!(dir = %blocks.dir().display(), files = stats.files, bytes = stats.bytes, ms = started.elapsed().as_millis() as u64, "passage blocks on disk");
        cache.attach_disk(blocks);
        Ok(())
    }

    /// Waits until every passage block kept so far is written to disk.
    pub async fn flush_passages(&self) {
        if let Some(cache) = self.passages.clone() {
            let _ = tokio::task::spawn_blocking(move || cache.flush_disk()).await;
        }
    }

    /// The fence fenced prompts' passages are computed in (`None` without reuse).
    pub fn reuse_fence(&self) -> Option<String> {
        self.passages.as_ref().map(|c| c.fence())
    }

    /// Forgets every passage block (measurements of cold prefills).
    pub fn clear_passages(&self) {
        if let Some(c) = &self.passages {
            c.clear();
        }
    }

    /// The token ids the engine reads for `prompt` (its chat template applied).
    pub async fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, GenerateError> {
        self.model
            .tokenize(
                either::Either::Left(text_messages(prompt)),
                None,
                true,
                true,
                None,
            )
            .await
            .map_err(|e| GenerateError::Engine(e.to_string()))
    }

    /// The keys and values of every position of `prompt`, per layer (1, kv heads,
    /// positions, head dim), as its prefill leaves them in the cache: with passage reuse as
    /// configured when `reuse`, else a full prefill (checks and measurements).
    pub async fn prompt_kv(
        &self,
        prompt: &Prompt,
        reuse: bool,
    ) -> Result<Option<Vec<(mistralrs::Tensor, mistralrs::Tensor)>>, GenerateError> {
        let plan = if reuse {
            self.reuse_plan(prompt).await?
        } else {
            ReusePlan::default()
        };
        let snapshot = Arc::new(reuse::KvSnapshot::default());
        let mut processors: Vec<Arc<dyn mistralrs::CustomLogitsProcessor>> = vec![snapshot.clone()];
        if let Some(keep) = plan.keep {
            processors.push(keep);
        }
        let response = self
            .request_once(
                messages(prompt),
                sampling(&Params::greedy(1)),
                false,
                Some(processors),
                Drafts::NONE,
                plan.splices,
            )
            .await?;
        match response {
            Response::Done(_) | Response::CompletionDone(_) => Ok(snapshot.take()),
            other => Err(response_error(other)),
        }
    }

    /// What passage reuse has done since the model loaded (`None` when off).
    pub fn reuse_stats(&self) -> Option<reuse::ReuseStats> {
        self.passages.as_ref().map(|c| c.stats())
    }

    /// The pre-question ([`RefusalCheck::Question`]): the prompt with `prompt.check` after
    /// the question, one greedy step; the probability of "no" against "yes" there.
    async fn check(&self, prompt: &Prompt) -> Result<f32, GenerateError> {
        let mut asked = prompt.clone();
        asked.user = format!("{}\n\n{}", prompt.user, prompt.check);
        self.no_against_yes(&asked).await
    }

    /// A yes/no question put to the model (`system`, then `user`): the probability of
    /// "yes" against "no" at the first step of the answer.
    pub async fn yes_probability(&self, system: &str, user: &str) -> Result<f32, GenerateError> {
        let prompt = Prompt {
            system: system.to_string(),
            history: Vec::new(),
            user: user.to_string(),
            check: String::new(),
            fence: String::new(),
            passages: Vec::new(),
        };
        Ok(1.0 - self.no_against_yes(&prompt).await?)
    }

    /// One greedy step after `asked`; the probability of "no" against "yes" there.
    async fn no_against_yes(&self, asked: &Prompt) -> Result<f32, GenerateError> {
        let probability = Arc::<OnceLock<f32>>::default();
        let reader = YesNo {
            yes: self.yes_tokens.clone(),
            no: self.no_tokens.clone(),
            probability: probability.clone(),
        };
        self.one_step(messages(asked), Arc::new(reader)).await?;
        probability
            .get()
            .copied()
            .ok_or_else(|| GenerateError::Engine("the pre-question was not read".into()))
    }

    /// One greedy step after `prompt` with `reader` as its logits processor (which reads
    /// what it needs: the step's logits, the prompt's hidden states).
    async fn one_step(
        &self,
        messages: RequestMessage,
        reader: Arc<dyn mistralrs::CustomLogitsProcessor>,
    ) -> Result<(), GenerateError> {
        let response = self
            .request_once(
                messages,
                sampling(&Params::greedy(1)),
                false,
                Some(vec![reader]),
                Drafts::NONE,
                Vec::new(),
            )
            .await?;
        match response {
            Response::Done(_) | Response::CompletionDone(_) => Ok(()),
            other => Err(response_error(other)),
        }
    }

    /// The hidden states at `prompt`'s last token, per layer (0: after the first; `layers`
    /// only, the others empty; every layer when `layers` is empty), read in one greedy step's
    /// prefill as an answer's would be; `None` when the model does not give them (not the
    /// quantized Llama decoder, or a draft model's step).
    pub async fn hidden_states(
        &self,
        prompt: &Prompt,
        layers: &[usize],
    ) -> Result<Option<Vec<Vec<f32>>>, GenerateError> {
        let reader = Arc::new(probe::StateReader {
            layers: layers.to_vec(),
            states: Default::default(),
        });
        self.one_step(messages(prompt), reader.clone()).await?;
        Ok(reader.states.lock().ok().and_then(|mut s| s.take()))
    }

    /// The hidden states at the last of `tokens` (a raw completion's prefill: no template),
    /// as [`Self::hidden_states`] reads them.
    pub async fn token_states(
        &self,
        tokens: Vec<u32>,
        layers: &[usize],
    ) -> Result<Option<Vec<Vec<f32>>>, GenerateError> {
        let reader = Arc::new(probe::StateReader {
            layers: layers.to_vec(),
            states: Default::default(),
        });
        self.one_step(RequestMessage::CompletionTokens(tokens), reader.clone())
            .await?;
        Ok(reader.states.lock().ok().and_then(|mut s| s.take()))
    }

    /// The refusal probe this generator decides with, and its threshold.
    pub fn probe(&self) -> Option<(&probe::Probe, f32)> {
        self.probe.as_ref().map(|(p, t)| (p.as_ref(), *t))
    }

    /// Raw completion from token ids (no template), greedy, token by token.
    pub async fn stream_tokens(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<GenerationStream, GenerateError> {
        self.stream_request(
            RequestMessage::CompletionTokens(tokens),
            sampling(&Params::greedy(max_tokens)),
            None,
            self.drafts,
            Vec::new(),
        )
        .await
    }

    async fn stream_request(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
        drafts: Drafts,
        splices: Vec<mistralrs::core::KvSplice>,
    ) -> Result<GenerationStream, GenerateError> {
        // room for a few chunks: the engine waits on a full channel
        let (tx, rx) = mpsc::channel(64);
        self.send(
            messages,
            sampling_params,
            false,
            true,
            tx,
            processors,
            drafts,
            splices,
        )
        .await?;
        self.counters.active.fetch_add(1, Ordering::Relaxed);
        Ok(GenerationStream {
            rx: Some(rx),
            counters: self.counters.clone(),
            finished: false,
            pending_done: None,
            held: None,
            judge: None,
        })
    }

    /// Raw completion from token ids (no template), greedy, with the configured drafts;
    /// returns the generated ids too.
    pub async fn complete_tokens(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<Generation, GenerateError> {
        self.complete_with(tokens, &self.default_params(max_tokens))
            .await
    }

    /// Greedy decoding of up to `max_tokens` with the configured drafts
    /// (`generation.lookup_tokens`, the draft model when there is one).
    pub fn default_params(&self, max_tokens: usize) -> Params {
        Params {
            lookup_tokens: self.drafts.lookup_tokens,
            draft_model: self.drafts.draft_model,
            ..Params::greedy(max_tokens)
        }
    }

    /// Raw completion from token ids (no template) with `params`' sampling and drafts
    /// (a request's own choice of drafts, as [`Generator::chat`] takes it). The generated
    /// ids come back when the decoding is greedy (`temperature` 0); read `text` otherwise.
    pub async fn complete_with(
        &self,
        tokens: Vec<u32>,
        params: &Params,
    ) -> Result<Generation, GenerateError> {
        let mut sampling = sampling(params);
        let greedy = params.temperature <= 0.0;
        if greedy {
            // The top-1 alternative of a greedy step is the chosen token: that is how the
            // engine's response carries token ids.
            sampling.top_n_logprobs = 1;
        }
        self.run(
            RequestMessage::CompletionTokens(tokens),
            sampling,
            greedy,
            Drafts::of(params),
            None,
        )
        .await
    }

    /// Decodes token ids with the model's tokenizer (the whole sequence at once).
    /// `skip_special` drops tokens the tokenizer marks special; note that mistral.rs's GGUF
    /// tokenizer conversion marks SentencePiece byte tokens (`<0x0A>`, …) special too.
    pub async fn detokenize(
        &self,
        ids: Vec<u32>,
        skip_special: bool,
    ) -> Result<String, GenerateError> {
        self.model
            .detokenize(ids, skip_special)
            .await
            .map_err(|e| GenerateError::Engine(e.to_string()))
    }

    // one private call site per kind of request; each argument is one NormalRequest field
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
        is_streaming: bool,
        tx: mpsc::Sender<Response>,
        logits_processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
        drafts: Drafts,
        splices: Vec<mistralrs::core::KvSplice>,
    ) -> Result<(), GenerateError> {
        let id = self.model.inner().next_request_id();
        // read by the engine when it adds the request (vendor/PATCHES.md 17, 19 and 23)
        mistralrs::core::set_request_draft_tokens(id, drafts.lookup_tokens);
        mistralrs::core::set_request_kv_splices(id, splices);
        if self.drafts.draft_model {
            mistralrs::core::set_request_skips_draft_model(id, !drafts.draft_model);
        }
        let request = Request::Normal(Box::new(NormalRequest {
            messages,
            sampling_params,
            response: tx,
            return_logprobs: logprobs,
            is_streaming,
            id,
            constraint: Constraint::None,
            suffix: None,
            tools: None,
            tool_choice: None,
            logits_processors,
            return_raw_logits: false,
            web_search_options: None,
            model_id: None,
            truncate_sequence: false,
        }));
        self.model
            .inner()
            .get_sender(None)
            .map_err(|e| GenerateError::Engine(e.to_string()))?
            .send(request)
            .await
            .map_err(|e| GenerateError::Engine(e.to_string()))
    }

    /// One request, not streamed: its one response.
    async fn request_once(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
        processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
        drafts: Drafts,
        splices: Vec<mistralrs::core::KvSplice>,
    ) -> Result<Response, GenerateError> {
        let (tx, mut rx) = mpsc::channel(8);
        // counted while it runs, also when the caller gives up waiting (a dropped future)
        let _active = Active::new(&self.counters);
        self.send(
            messages,
            sampling_params,
            logprobs,
            false,
            tx,
            processors,
            drafts,
            splices,
        )
        .await?;
        rx.recv()
            .await
            .ok_or_else(|| GenerateError::Engine("the engine dropped the request".into()))
    }

    async fn run(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
        drafts: Drafts,
        processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
    ) -> Result<Generation, GenerateError> {
        match self
            .request_once(
                messages,
                sampling_params,
                logprobs,
                processors,
                drafts,
                Vec::new(),
            )
            .await?
        {
            Response::Done(r) => {
                let choice = r.choices.into_iter().next();
                let finish_reason = choice
                    .as_ref()
                    .map(|c| c.finish_reason.clone())
                    .unwrap_or_default();
                let text = choice.and_then(|c| c.message.content).unwrap_or_default();
                Ok(Generation::new(text, finish_reason, Some(&r.usage), None))
            }
            Response::CompletionDone(r) => {
                let choice = r.choices.into_iter().next();
                let token_ids = choice
                    .as_ref()
                    .and_then(|c| c.logprobs.as_ref())
                    .and_then(|l| l.content.as_ref())
                    .map(|c| {
                        c.iter()
                            .filter_map(|t| t.top_logprobs.first().map(|t| t.token))
                            .collect()
                    });
                let finish_reason = choice
                    .as_ref()
                    .map(|c| c.finish_reason.clone())
                    .unwrap_or_default();
                let text = choice.map(|c| c.text).unwrap_or_default();
                Ok(Generation::new(
                    text,
                    finish_reason,
                    Some(&r.usage),
                    token_ids,
                ))
            }
            other => Err(response_error(other)),
        }
    }
}

/// The engine's messages for a prompt: system, the earlier turns, then the question.
fn messages(prompt: &Prompt) -> RequestMessage {
    text_messages(prompt).take_messages()
}

/// The prompt's messages: system, earlier turns, user.
fn text_messages(prompt: &Prompt) -> TextMessages {
    let mut m = TextMessages::new().add_message(TextMessageRole::System, &prompt.system);
    for turn in &prompt.history {
        let role = match turn.role {
            Role::User => TextMessageRole::User,
            Role::Assistant => TextMessageRole::Assistant,
        };
        m = m.add_message(role, &turn.content);
    }
    m.add_message(TextMessageRole::User, &prompt.user)
}

/// Measures what the chat template adds around messages, with the engine's own template
/// rendering and tokenizer: two and three messages of one word each.
async fn template_overhead(
    model: &Model,
    encode: impl Fn(&str) -> usize + Send + Sync + 'static,
) -> Result<TokenCounter, String> {
    let word = "hello";
    let count = |n: usize| {
        let mut m = TextMessages::new().add_message(TextMessageRole::System, word);
        for i in 1..n {
            let role = if i % 2 == 1 {
                TextMessageRole::User
            } else {
                TextMessageRole::Assistant
            };
            m = m.add_message(role, word);
        }
        async move {
            model
                .tokenize(either::Either::Left(m), None, true, true, None)
                .await
                .map(|t| t.len())
                .map_err(|e| e.to_string())
        }
    };
    let (two, three) = (count(2).await?, count(3).await?);
    let w = encode(word);
    let per_message = three.saturating_sub(two + w).max(1);
    let base = two.saturating_sub(2 * (w + per_message));
    Ok(TokenCounter::new(encode, base, per_message))
}

fn sampling(params: &Params) -> SamplingParams {
    let stop = (!params.stop.is_empty()).then(|| StopTokens::Seqs(params.stop.clone()));
    let mut s = if params.temperature <= 0.0 {
        SamplingParams::deterministic()
    } else {
        SamplingParams {
            temperature: Some(params.temperature),
            top_p: (params.top_p < 1.0).then_some(params.top_p),
            top_k: (params.top_k > 0).then_some(params.top_k),
            ..SamplingParams::neutral()
        }
    };
    s.max_len = Some(params.max_tokens);
    s.repetition_penalty = (params.repetition_penalty != 1.0).then_some(params.repetition_penalty);
    s.dry_params = (params.dry_multiplier > 0.0).then(|| DrySamplingParams {
        multiplier: params.dry_multiplier,
        allowed_length: params.dry_allowed_length,
        ..DrySamplingParams::default()
    });
    s.stop_toks = stop;
    s
}

/// The model's judgement at the first generated step: its probability of starting the
/// answer with one of `tokens` (the refusal phrase's first tokens). At or above
/// `threshold` the logits pass unchanged (the model refuses, and docent stops it there);
/// below, those tokens are masked at that step, so the model answers instead of writing
/// the phrase it was only somewhat inclined to write. `masked` tokens are masked at that
/// step whatever the judgement (`generation.lead_with_marker`); with no refusal tokens the
/// gate only masks.
struct RefusalGate {
    tokens: Vec<u32>,
    threshold: f32,
    probability: Arc<OnceLock<f32>>,
    masked: Vec<u32>,
    /// With [`RefusalCheck::Probe`]: the probe reads the prompt's hidden states in the
    /// prefill, and its score decides at the first step instead of `threshold`.
    probe: Option<ProbeGate>,
}

/// The probe a [`RefusalGate`] decides with.
struct ProbeGate {
    read: probe::ProbeRead,
    threshold: f32,
}

/// The model's judgement at an answer's first step (see [`RefusalGate`]), or from the
/// pre-question ([`RefusalCheck::Question`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Judgement {
    /// The deciding signal's probability that the passages do not hold the answer.
    pub probability: f32,
    /// At or above `generation.refusal_threshold`: the question is refused.
    pub refuse: bool,
    /// Every signal read.
    pub signals: RefusalSignals,
}

/// The model's refusal signals, each as a probability that the passages do not hold the
/// answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RefusalSignals {
    /// Of starting the answer with the refusal phrase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token: Option<f32>,
    /// Of answering "no" to the pre-question (`generation.refusal_check = "question"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<f32>,
    /// The refusal probe's, from the hidden state at the prompt's last token
    /// (`generation.refusal = "probe"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<f32>,
}

impl mistralrs::CustomLogitsProcessor for RefusalGate {
    fn apply(
        &self,
        logits: &mistralrs::Tensor,
        _context: &[u32],
    ) -> mistralrs::Result<mistralrs::Tensor> {
        if self.probability.get().is_some() {
            return Ok(logits.clone());
        }
        let mut values: Vec<f32> = logits
            .flatten_all()?
            .to_dtype(mistralrs::DType::F32)?
            .to_vec1()?;
        let probability = token_probability(&values, &self.tokens);
        let _ = self.probability.set(probability);
        let probe = self
            .probe
            .as_ref()
            .and_then(|g| Some((g.read.score.get()?, g.threshold)));
        let refuse = match probe {
            Some((score, threshold)) => score >= threshold,
            None => !self.tokens.is_empty() && probability >= self.threshold,
        };
        if refuse {
            return Ok(logits.clone());
        }
        for &t in self.tokens.iter().chain(&self.masked) {
            if let Some(v) = values.get_mut(t as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        mistralrs::Tensor::from_vec(values, logits.shape(), logits.device())?
            .to_dtype(logits.dtype())
    }

    fn hidden_state_layers(&self) -> Option<Vec<usize>> {
        self.probe.as_ref().map(|g| vec![g.read.probe.file.layer])
    }

    fn observe_hidden_states(&self, states: &[Vec<f32>]) {
        if let Some(g) = &self.probe {
            g.read.score.set(g.read.probe.score(states));
        }
    }
}

/// A refusal probe and the threshold it decides at.
type ProbeWithThreshold = (Arc<probe::Probe>, f32);

/// The refusal signal `config` asks for, after the fallback for a model without a probe,
/// and the probe with its threshold (`generation.refusal_probe_threshold`, else the file's).
fn refusal_signal(
    config: &GenerationConfig,
) -> Result<(RefusalCheck, Option<ProbeWithThreshold>), String> {
    Ok(match config.refusal_check {
        RefusalCheck::Probe => match refusal_probe(config, &catalog::resolve(&config.model))
            .map_err(|e| e.to_string())?
        {
            Some(p) => {
                let threshold = config.refusal_probe_threshold.unwrap_or(p.file.threshold);
                (RefusalCheck::Probe, Some((Arc::new(p), threshold)))
            }
            None => {
                tracing::warn!(
                    model = %config.model.display(),
                    "no refusal probe for this model (generation.refusal_probe); refusals \
                     fall back to the first-token signal (generation.refusal = \"first_token\")"
                );
                (RefusalCheck::FirstToken, None)
            }
        },
        other => (other, None),
    })
}

/// The refusal probe for `config.model` (whose file is `model_file`): the file
/// `generation.refusal_probe` names, else the one shipped for the catalog model (named, or a
/// path to a file of the same size and sha256); `None` when there is none. Checked against
/// the model file's sha256: a probe for another file is an error that says what to do.
fn refusal_probe(
    config: &GenerationConfig,
    model_file: &Path,
) -> Result<Option<probe::Probe>, probe::ProbeError> {
    if !model_file.is_file() {
        // a hub id or a missing file: the loader says what is wrong
        return Ok(None);
    }
    let sha = || {
        probe::file_sha256(model_file).map_err(|e| probe::ProbeError::Read {
            path: model_file.to_path_buf(),
            message: e.to_string(),
        })
    };
    let (name, probe) = match &config.refusal_probe {
        Some(path) => (path.display().to_string(), probe::Probe::read(path)?),
        None => {
            let named = config.model.to_str().and_then(catalog::find);
            let size = std::fs::metadata(model_file).map(|m| m.len()).ok();
            let entry = match named {
                Some(m) => Some(m),
                // a path: the catalog file it is, by size, then by hash
                None => match catalog::known()
                    .iter()
                    .find(|m| m.refusal_probe.is_some() && m.bytes.is_some() && m.bytes == size)
                {
                    Some(m) if m.sha256.as_deref() == Some(sha()?.as_str()) => Some(m),
                    _ => None,
                },
            };
            let shipped = entry
                .and_then(|m| m.refusal_probe.as_deref())
                .and_then(|name| Some((name, probe::shipped(name)?)));
            match shipped {
                Some((name, text)) => (name.to_string(), probe::Probe::parse(name, text)?),
                None => return Ok(None),
            }
        }
    };
    probe.for_model(&name, model_file, &sha()?).map(Some)
}

/// Reads the pre-question's first step: the probability of `no` against `yes`
/// (their softmax masses, normalised to the two), 0.5 when neither is likely at all.
struct YesNo {
    yes: Vec<u32>,
    no: Vec<u32>,
    probability: Arc<OnceLock<f32>>,
}

impl mistralrs::CustomLogitsProcessor for YesNo {
    fn apply(
        &self,
        logits: &mistralrs::Tensor,
        _context: &[u32],
    ) -> mistralrs::Result<mistralrs::Tensor> {
        if self.probability.get().is_none() {
            let values: Vec<f32> = logits
                .flatten_all()?
                .to_dtype(mistralrs::DType::F32)?
                .to_vec1()?;
            let _ = self
                .probability
                .set(no_against_yes(&values, &self.yes, &self.no));
        }
        Ok(logits.clone())
    }
}

/// P(no) / (P(yes) + P(no)) under `logits`; 0.5 when both are 0.
fn no_against_yes(logits: &[f32], yes: &[u32], no: &[u32]) -> f32 {
    let (y, n) = (
        token_probability(logits, yes),
        token_probability(logits, no),
    );
    if y + n > 0.0 {
        n / (y + n)
    } else {
        0.5
    }
}

/// The softmax probability of `tokens` together under `logits` (0 for ids out of range).
fn token_probability(logits: &[f32], tokens: &[u32]) -> f32 {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return 0.0;
    }
    let total: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let hit: f64 = tokens
        .iter()
        .filter_map(|&t| logits.get(t as usize))
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    (hit / total) as f32
}

/// The first token of `phrase` as an answer starts with it, alone and after a blank
/// (tokenizers that mark a word's start), without repeats; none for an empty phrase.
fn first_tokens(phrase: &str, encode: &(dyn Fn(&str) -> Vec<u32> + Send + Sync)) -> Vec<u32> {
    let phrase = phrase.trim();
    if phrase.is_empty() {
        return Vec::new();
    }
    let mut tokens: Vec<u32> = [phrase.to_string(), format!(" {phrase}")]
        .iter()
        .filter_map(|p| encode(p).first().copied())
        .collect();
    tokens.dedup();
    tokens
}

/// The engine is shared by all requests.
pub type SharedGenerator = Arc<Generator>;

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_p: f64, top_k: usize) -> Params {
        Params {
            max_tokens: 7,
            temperature,
            top_p,
            top_k,
            repetition_penalty: 1.0,
            dry_multiplier: 0.0,
            dry_allowed_length: 2,
            stop: vec!["END".into()],
            lookup_tokens: 0,
            draft_model: false,
        }
    }

    /// The first-step gate: below the threshold the refusal tokens and the masked ones are
    /// masked at the first step only, and the judgement is recorded; at or above it the
    /// logits pass unchanged (the answer is refused there).
    #[test]
    fn the_first_step_gate_masks_then_passes() {
        use mistralrs::CustomLogitsProcessor;
        let logits =
            |v: Vec<f32>| mistralrs::Tensor::from_vec(v, 4, &mistralrs::Device::Cpu).unwrap();
        let values = |t: mistralrs::Tensor| t.to_vec1::<f32>().unwrap();
        let gate = |threshold: f32, masked: Vec<u32>| RefusalGate {
            tokens: vec![1],
            threshold,
            probability: Arc::default(),
            masked,
            probe: None,
        };
        // a marker token (3) masked whatever the judgement, the refusal token (1) under it
        let g = gate(0.9, vec![3]);
        let first = values(g.apply(&logits(vec![1.0, 0.0, 1.0, 2.0]), &[]).unwrap());
        assert_eq!(first[0], 1.0);
        assert_eq!(first[2], 1.0);
        assert!(
            first[1] == f32::NEG_INFINITY && first[3] == f32::NEG_INFINITY,
            "{first:?}"
        );
        let p = *g.probability.get().expect("the judgement is recorded");
        assert!((p - token_probability(&[1.0, 0.0, 1.0, 2.0], &[1])).abs() < 1e-6);
        // later steps pass unchanged
        assert_eq!(
            values(g.apply(&logits(vec![1.0, 0.0, 1.0, 2.0]), &[5]).unwrap()),
            vec![1.0, 0.0, 1.0, 2.0]
        );
        // a refusal: unchanged, so the phrase can start
        let g = gate(0.1, vec![3]);
        assert_eq!(
            values(g.apply(&logits(vec![0.0, 3.0, 0.0, 0.0]), &[]).unwrap()),
            vec![0.0, 3.0, 0.0, 0.0]
        );
        // no refusal phrase: only the masked tokens, never a refusal
        let g = RefusalGate {
            tokens: vec![],
            threshold: 0.0,
            probability: Arc::default(),
            masked: vec![0],
            probe: None,
        };
        let first = values(g.apply(&logits(vec![5.0, 0.0, 1.0, 2.0]), &[]).unwrap());
        assert_eq!(first[0], f32::NEG_INFINITY);
        assert_eq!(&first[1..], &[0.0, 1.0, 2.0]);
    }

    /// With a probe the gate asks for the prompt's states, scores them, and decides by the
    /// probe's threshold whatever the first token says.
    #[test]
    fn the_gate_decides_by_the_probe_when_it_has_one() {
        use mistralrs::CustomLogitsProcessor;
        let logits =
            |v: Vec<f32>| mistralrs::Tensor::from_vec(v, 4, &mistralrs::Device::Cpu).unwrap();
        let values = |t: mistralrs::Tensor| t.to_vec1::<f32>().unwrap();
        let gate = || RefusalGate {
            tokens: vec![1],
            // the first token alone would refuse anything
            threshold: 0.0,
            probability: Arc::default(),
            masked: vec![],
            probe: Some(ProbeGate {
                read: probe::ProbeRead {
                    probe: Arc::new(probe::Probe::new(
                        "m",
                        &"0".repeat(64),
                        1,
                        vec![1.0, 0.0],
                        1.0,
                        0.0,
                    )),
                    score: Arc::default(),
                },
                threshold: 0.5,
            }),
        };
        let g = gate();
        assert_eq!(g.hidden_state_layers(), Some(vec![1]));
        // layer 1's state projects to -3: score 0.047, below 0.5: the model answers
        g.observe_hidden_states(&[vec![9.0, 9.0], vec![-3.0, 1.0]]);
        let first = values(g.apply(&logits(vec![0.0, 3.0, 0.0, 0.0]), &[]).unwrap());
        assert_eq!(first[1], f32::NEG_INFINITY, "{first:?}");
        // a later chunk's call wins: +3 → 0.95, refused (logits unchanged)
        let g = gate();
        g.observe_hidden_states(&[vec![0.0, 0.0], vec![-3.0, 1.0]]);
        g.observe_hidden_states(&[vec![0.0, 0.0], vec![3.0, 1.0]]);
        assert!(g.probe.as_ref().unwrap().read.score.get().unwrap() > 0.9);
        assert_eq!(
            values(g.apply(&logits(vec![0.0, 3.0, 0.0, 0.0]), &[]).unwrap()),
            vec![0.0, 3.0, 0.0, 0.0]
        );
    }

    #[test]
    fn sampling_settings_reach_the_engine_explicitly() {
        // greedy: the engine's deterministic settings (top_k 1), whatever top_p/top_k say
        let s = sampling(&params(0.0, 0.5, 40));
        assert_eq!((s.top_k, s.temperature), (Some(1), None));
        assert_eq!(s.max_len, Some(7));
        assert!(matches!(&s.stop_toks, Some(StopTokens::Seqs(v)) if v == &["END".to_string()]));
        // sampling: only what is switched on is sent
        let s = sampling(&params(0.7, 0.9, 40));
        assert_eq!(
            (s.temperature, s.top_p, s.top_k),
            (Some(0.7), Some(0.9), Some(40))
        );
        let s = sampling(&params(0.7, 1.0, 0));
        assert_eq!((s.top_p, s.top_k), (None, None));
        assert_eq!(s.repetition_penalty, None);
    }

    #[test]
    fn the_refusal_probability_is_the_softmax_mass_of_its_tokens() {
        // logits 0, ln 3, 0: probabilities 0.2, 0.6, 0.2
        let logits = [0.0, 3f32.ln(), 0.0];
        assert!((token_probability(&logits, &[1]) - 0.6).abs() < 1e-6);
        assert!((token_probability(&logits, &[0, 2]) - 0.4).abs() < 1e-6);
        // ids beyond the vocabulary and masked logits count nothing
        assert_eq!(token_probability(&logits, &[7]), 0.0);
        let masked = [f32::NEG_INFINITY, 0.0, 0.0];
        assert!((token_probability(&masked, &[1]) - 0.5).abs() < 1e-6);
        assert_eq!(token_probability(&masked, &[0]), 0.0);
        // large logits do not overflow
        assert!((token_probability(&[1000.0, 1000.0], &[0]) - 0.5).abs() < 1e-6);
    }

    #[test]
    fn the_pre_question_reads_no_against_yes() {
        // probabilities 0.1 (yes), 0.3 (no), 0.6 (other): no against yes is 0.75
        let logits = [0.1f32.ln(), 0.3f32.ln(), 0.6f32.ln()];
        assert!((no_against_yes(&logits, &[0], &[1]) - 0.75).abs() < 1e-6);
        // several spellings of each count together
        let logits = [0.1f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.4f32.ln()];
        assert!((no_against_yes(&logits, &[0, 3], &[1, 2]) - 0.5).abs() < 1e-6);
        // neither likely at all: undecided
        let masked = [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0];
        assert_eq!(no_against_yes(&masked, &[0], &[1]), 0.5);
    }

    #[test]
    fn a_stream_judges_by_its_pre_question_when_there_is_one() {
        let first = Arc::new(OnceLock::new());
        let judge = |question| Judge {
            question,
            first_token: Some(first.clone()),
            probe: None,
            threshold: 0.6,
        };
        // no pre-question: nothing until the first token, then the first token decides
        assert_eq!(judge(None).judgement(), None);
        let pre = judge(Some(0.7)).judgement().unwrap();
        assert!(pre.refuse && pre.probability == 0.7 && pre.signals.first_token.is_none());
        first.set(0.9).unwrap();
        let j = judge(None).judgement().unwrap();
        assert!(j.refuse && j.probability == 0.9);
        // with one, it decides; the first token is only recorded
        let j = judge(Some(0.2)).judgement().unwrap();
        assert!(!j.refuse && j.probability == 0.2);
        assert_eq!(
            j.signals,
            RefusalSignals {
                first_token: Some(0.9),
                question: Some(0.2),
                probe: None,
            }
        );
    }

    #[test]
    fn the_probe_decides_at_its_own_threshold_once_the_prefill_gave_its_score() {
        let first = Arc::new(OnceLock::new());
        let score = Arc::new(probe::ProbeScore::default());
        let judge = |question| Judge {
            question,
            first_token: Some(first.clone()),
            probe: Some((score.clone(), 0.3)),
            threshold: 0.9,
        };
        assert_eq!(judge(None).judgement(), None);
        // the prefill gave no states (e.g. a draft model's step): the first token decides
        first.set(0.5).unwrap();
        let j = judge(None).judgement().unwrap();
        assert!(!j.refuse && j.probability == 0.5 && j.signals.probe.is_none());
        score.set(Some(0.35));
        let j = judge(None).judgement().unwrap();
        assert!(j.refuse && j.probability == 0.35, "{j:?}");
        assert_eq!(j.signals.first_token, Some(0.5));
        score.set(Some(0.25));
        assert!(!judge(None).judgement().unwrap().refuse);
        // a pre-question still decides when asked
        assert!(judge(Some(0.95)).judgement().unwrap().refuse);
    }

    #[test]
    fn the_refusal_phrase_starts_with_its_first_tokens() {
        let encode = |t: &str| -> Vec<u32> { t.split(' ').map(|w| w.len() as u32).collect() };
        // "I don't know." and " I don't know." start with different tokens here
        assert_eq!(first_tokens("I don't know.", &encode), vec![1, 0]);
        assert!(first_tokens("  ", &encode).is_empty());
    }
}
