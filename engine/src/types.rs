//! The seam's vocabulary: the data an engine and the answer path exchange (settings of a
//! request, events of an answer, the model's judgement, errors, counters). Plain data,
//! nothing of a particular engine.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Why the model could not be loaded or could not generate.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The model file is not there.
    #[error("generation model {path} does not exist; run `make setup` or set generation.model")]
    ModelMissing {
        /// The path looked for.
        path: PathBuf,
    },
    /// Loading the model failed; `message` says why.
    #[error("loading the generation model {path}: {message}")]
    Load {
        /// The model, as `generation.model` names it.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The engine refused the request as invalid (422 for the client).
    #[error("the request was rejected by the engine: {0}")]
    Validation(String),
    /// The engine failed while generating, or dropped the request.
    #[error("generation failed: {0}")]
    Engine(String),
}

/// Per-request decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Most tokens to generate.
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
    /// Most tokens of a prompt-lookup draft per step; 0 = off
    /// (`docent_generate::lookup`).
    pub lookup_tokens: usize,
    /// The configured draft model (`generation.draft`) drafts for this request; false: the
    /// target's own steps. Ignored without a draft model.
    pub draft_model: bool,
}

/// The longest repeat the DRY penalty leaves alone, in tokens, unless configured.
pub const DEFAULT_DRY_ALLOWED_LENGTH: usize = 2;

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
            dry_allowed_length: DEFAULT_DRY_ALLOWED_LENGTH,
            stop: vec![],
            lookup_tokens: 0,
            draft_model: true,
        }
    }
}

/// A finished generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The generated text.
    pub text: String,
    /// Tokens in the prompt, as the engine counted them (0 when it sent no usage).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Why the generation ended, as the engine says it (such as `stop` or `length`).
    pub finish_reason: String,
    /// Ids of the generated tokens, when asked for (`complete_tokens`).
    pub token_ids: Option<Vec<u32>>,
    /// The engine's own timings: prompt (prefill) and completion (decode) seconds.
    pub prompt_secs: f64,
    /// Seconds the engine spent decoding the completion.
    pub completion_secs: f64,
}

/// What an engine is doing: generations running or waiting, and streams cancelled.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct EngineStats {
    /// Generations running or waiting in the engine now.
    pub active: usize,
    /// Streams given up by their client whose sequence the engine has dropped, since start.
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

/// The model's judgement of whether the passages answer: read at an answer's first step,
/// or from a pre-question (`generation.refusal_check`).
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

/// What the passage cache has done since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReuseStats {
    /// Lookups that found a block (in memory or on disk).
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Blocks computed ahead of an answer (misses in a later place, `passages` mode), and
    /// the microseconds that took.
    pub computed: u64,
    /// Microseconds computing them took, in all.
    pub compute_us: u64,
    /// Blocks kept in memory.
    pub blocks: usize,
    /// Bytes the blocks in memory take.
    pub bytes: usize,
    /// Passage tokens the blocks hold.
    pub tokens: usize,
    /// Lookups missed in memory and read from disk (counted in `hits` too).
    pub disk_hits: u64,
    /// The blocks on disk (`None` without a folder).
    pub disk: Option<DiskStats>,
}

impl ReuseStats {
    /// Bytes a block holds per passage token (every layer's keys and values).
    pub fn bytes_per_token(&self) -> Option<f64> {
        (self.tokens > 0).then(|| self.bytes as f64 / self.tokens as f64)
    }

    /// Mean milliseconds a block computed ahead took.
    pub fn compute_ms_per_block(&self) -> Option<f64> {
        (self.computed > 0).then(|| self.compute_us as f64 / 1e3 / self.computed as f64)
    }

    /// The counters' growth since `before` (sizes as they are now).
    pub fn since(&self, before: &ReuseStats) -> ReuseStats {
        ReuseStats {
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            computed: self.computed - before.computed,
            compute_us: self.compute_us - before.compute_us,
            disk_hits: self.disk_hits - before.disk_hits,
            ..*self
        }
    }
}

/// What a folder of passage blocks holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskStats {
    /// Block files in the folder.
    pub files: usize,
    /// Their total size, in bytes.
    pub bytes: u64,
    /// The bound (`generation.passage_disk_mib`).
    pub limit: u64,
    /// Files found damaged (and deleted) since start.
    pub corrupt: u64,
}

/// How an answer was made (`mode` in the request picks `generative` or `extractive`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnswerMode {
    /// Written by the model from the retrieved chunks.
    #[default]
    Generative,
    /// Sentences of the retrieved chunks, quoted and cited: asked for, or the fallback
    /// when the model's text was degenerate, empty or unsupported.
    Extractive,
    /// Nothing relevant was retrieved: the refusal template.
    Refusal,
    /// The safety filter withheld the answer.
    Withheld,
}
