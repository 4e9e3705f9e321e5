//! `[generation]`: the generate stage's settings (`config` aggregates them), their
//! defaults, and the refusal, schedule and draft-model choices.

use super::*;

// ---- `[generation]` settings (the generate stage owns them; `config` aggregates) ----

/// The built-in default of `generation.cache_size` (docent's `Config::default` uses it too).
pub fn default_cache_size() -> usize {
    256
}

/// `true`, the default of a switch that is on unless configured.
pub fn yes() -> bool {
    true
}

/// The built-in default of `generation.prefix_cache_mib` (docent's `Config::default` uses it too).
pub fn default_prefix_cache_mib() -> usize {
    128
}

/// The built-in default of `generation.isa` (docent's `Config::default` uses it too).
pub fn default_isa() -> String {
    "auto".into()
}

/// The built-in default of `generation.kernels` (docent's `Config::default` uses it too).
pub fn default_kernels() -> String {
    "docent".into()
}

pub(super) fn default_true() -> bool {
    true
}

/// The built-in default of `generation.kv_cache` (docent's `Config::default` uses it too).
pub fn default_kv_cache() -> String {
    "f32".into()
}

/// The built-in default of `generation.passage_cache_mib` (docent's `Config::default` uses it too).
pub fn default_passage_cache_mib() -> usize {
    1024
}

/// The built-in default of `generation.passage_disk_mib` (docent's `Config::default` uses it too).
pub fn default_passage_disk_mib() -> usize {
    4096
}

/// The built-in default of `generation.passage_recompute_tokens` (docent's `Config::default` uses it too).
pub fn default_passage_recompute_tokens() -> usize {
    0
}

/// The built-in default of `generation.passage_key_scale` (docent's `Config::default` uses it too).
pub fn default_passage_key_scale() -> f32 {
    0.9
}

/// The built-in default of `generation.prefill_chunk` (docent's `Config::default` uses it too).
pub fn default_prefill_chunk() -> usize {
    256
}

/// The built-in default of `generation.max_queue` (docent's `Config::default` uses it too).
pub fn default_max_queue() -> usize {
    32
}

/// The built-in default of `generation.dry_allowed_length` (docent's `Config::default` uses it too).
pub fn default_dry_allowed_length() -> usize {
    docent_engine::DEFAULT_DRY_ALLOWED_LENGTH
}

/// `1.0`, the default of a factor that is off unless configured.
pub fn one() -> f64 {
    1.0
}

/// The `[generation]` settings: the model, how it is loaded and run, and the answers'
/// default sampling.
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
    /// Most tokens an answer may have when the request does not say.
    pub max_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    /// Sampling temperature when the request does not say; 0 decodes greedily.
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
    /// Continuous batching on the CPU (GGUF llama, mistral3 and qwen2 models, no draft
    /// model): answers of different lengths decode together in one forward pass, and a new
    /// request joins the running batch between steps.
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
    pub answer_mode: docent_engine::AnswerMode,
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

/// The built-in default of `generation.refusal_phrase` (docent's `Config::default` uses it too).
pub fn default_refusal_phrase() -> String {
    "I don't know.".into()
}

/// The built-in default of `generation.refusal_threshold` (docent's `Config::default` uses it too).
pub fn default_refusal_threshold() -> f32 {
    0.7
}

/// `generation.draft`: the draft model of speculative decoding.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraftConfig {
    /// The draft model (same kinds of source as `generation.model`).
    pub model: PathBuf,
    /// Tokens the draft proposes per step.
    #[serde(default = "default_gamma")]
    pub gamma: usize,
}

/// The built-in default of `generation.gamma` (docent's `Config::default` uses it too).
pub fn default_gamma() -> usize {
    4
}

/// The built-in default of `generation.lookup_tokens` (docent's `Config::default` uses it too).
pub fn default_lookup_tokens() -> usize {
    0
}
