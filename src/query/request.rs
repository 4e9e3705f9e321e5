//! What a client asks: the `/v1/query` and `/v1/search` bodies, the limits they are checked
//! against, and the checked forms the rest of the query path takes.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::query::generate::Params;
use crate::query::postprocess;
use crate::query::postprocess::stop::DEFAULT_STOPS;
use crate::query::prompt::Turn;
use crate::query::retrieve::MAX_NEIGHBORS;
use crate::query::{AnswerMode, QueryError};
use docent_ingest::store::{SearchFilter, SearchMode};

/// `POST /v1/query` body.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueryRequest {
    /// The question to answer (trimmed; not empty, at most `server.max_question_chars`
    /// characters, no control characters other than newlines and tabs).
    pub question: String,
    /// How the chunks for the prompt are found (defaults from the `retrieval` configuration).
    #[serde(default)]
    pub retrieval: RetrievalOptions,
    /// How the answer is generated (defaults from the `generation` configuration).
    #[serde(default)]
    pub generation: GenerationOptions,
    /// Answer as Server-Sent Events (`retrieval`, `delta`, `citation`, `done`, `error`).
    #[serde(default)]
    pub stream: bool,
    /// Earlier turns of the conversation, oldest first; the oldest are left out when the
    /// model's context is full.
    #[serde(default)]
    pub history: Vec<Turn>,
    /// `generative` (default: the model writes the answer) or `extractive` (the retrieved
    /// chunks' best sentences, quoted and cited, without the model: fast).
    #[serde(default)]
    pub mode: Option<AnswerMode>,
}

/// Most earlier turns a request may send.
pub const MAX_HISTORY: usize = 64;

/// Retrieval options of `/v1/query` and `/v1/search`; each left out takes the server's
/// `retrieval.*` default.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetrievalOptions {
    /// Chunks to retrieve, 1 to `retrieval.max_top_k` (default: `retrieval.top_k`).
    pub top_k: Option<usize>,
    /// `dense`, `sparse` or `hybrid` (default: `retrieval.mode`).
    pub mode: Option<SearchMode>,
    /// Refuse when the best chunk's cosine similarity is below (default:
    /// `retrieval.min_score`).
    pub min_score: Option<f32>,
    /// Restricts retrieval to a collection, tags (any of) or documents.
    #[serde(default)]
    pub filter: SearchFilter,
    /// Chunks before and after each hit joined into its text (default:
    /// `retrieval.neighbors`).
    pub neighbors: Option<usize>,
}

/// Generation options of `/v1/query`; each left out takes the server's `generation.*`
/// default.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationOptions {
    /// Most tokens the answer may have, 1 to `generation.max_tokens_limit` (default:
    /// `generation.max_tokens`).
    pub max_tokens: Option<usize>,
    /// Sampling temperature, 0 to 2; 0 decodes greedily (default: `generation.temperature`).
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, (0, 1]; 1 = off. Only with temperature > 0.
    pub top_p: Option<f64>,
    /// Sample among the k most likely tokens; 0 = off. Only with temperature > 0.
    pub top_k: Option<usize>,
    /// Penalty on tokens already in the context, 0.5 to 2; 1 is off (default:
    /// `generation.repetition_penalty`).
    pub repetition_penalty: Option<f32>,
    /// DRY penalty multiplier, 0..=5; 0 is off.
    pub dry_multiplier: Option<f32>,
    /// More strings that end the answer (besides the template's); never part of it.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Not supported: mistral.rs 0.8.1 seeds one random generator per engine (shared by
    /// all requests), so a per-request seed cannot be honoured; refused with 422.
    pub seed: Option<u64>,
    /// Most tokens of a prompt-lookup draft per step, 0..=6; 0 = off (default:
    /// `generation.lookup_tokens`). Speed only: the answer is the same.
    pub lookup_tokens: Option<usize>,
    /// On a server with a draft model (`generation.draft`): whether it drafts for this
    /// request (default true); false runs the target alone, which may then sample or take
    /// prompt-lookup drafts. `true` on a server without one is refused with 422.
    pub draft_model: Option<bool>,
}

/// Most extra stop sequences a request may give.
pub const MAX_STOPS: usize = 8;
/// Longest extra stop sequence a request may give, in bytes.
pub const MAX_STOP_BYTES: usize = 64;

/// A request with every option resolved against the configuration and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidQuery {
    /// The question and its checked retrieval options.
    pub search: ValidSearch,
    /// Generative or extractive.
    pub mode: AnswerMode,
    /// Sampling parameters, stop sequences and drafts, defaults filled in.
    pub params: Params,
    /// Earlier turns of the conversation, oldest first (at most [`MAX_HISTORY`], none empty).
    pub history: Vec<Turn>,
    /// Answer as Server-Sent Events rather than one JSON body.
    pub stream: bool,
}

/// Limits a request is checked against.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Search mode when the request does not say (`retrieval.mode`).
    pub default_mode: SearchMode,
    /// Refuse without the model when the refusal signal is below this.
    pub min_score: f32,
    /// The weight of the question's terms in the refusal signal
    /// ([`crate::query::retrieve::relevance`]).
    pub term_weight: f32,
    /// Refuse when the best retrieved sentence scores below this as an answer; 0 = off.
    pub min_support: f32,
    /// Chunks retrieved when the request does not say (`retrieval.top_k`).
    pub default_top_k: usize,
    /// Most chunks a request may ask for (`retrieval.max_top_k`).
    pub max_top_k: usize,
    /// Neighbouring chunks joined to each hit when the request does not say
    /// (`retrieval.neighbors`).
    pub default_neighbors: usize,
    /// Answer length in tokens when the request does not say (`generation.max_tokens`).
    pub default_max_tokens: usize,
    /// Most answer tokens a request may ask for (`generation.max_tokens_limit`).
    pub max_tokens: usize,
    /// Sampling temperature when the request does not say (`generation.temperature`).
    pub default_temperature: f64,
    /// Nucleus sampling mass when the request does not say (`generation.top_p`).
    pub default_top_p: f64,
    /// Top-k token sampling when the request does not say (`generation.top_k`); 0 = off.
    pub default_top_k_tokens: usize,
    /// Repetition penalty when the request does not say (`generation.repetition_penalty`).
    pub default_repetition_penalty: f32,
    /// DRY penalty multiplier when the request does not say (`generation.dry_multiplier`).
    pub default_dry_multiplier: f32,
    /// `generation.dry_allowed_length` (server-wide).
    pub dry_allowed_length: usize,
    /// Longest question, in characters (`server.max_question_chars`).
    pub max_question_chars: usize,
    /// Keep-alive interval of streamed answers (the SSE layer sends the comments).
    pub keep_alive: Duration,
    /// The server has a draft model (`generation.draft`). A request it drafts for is
    /// decoded greedily by mistral.rs whatever the sampling settings, so sampled requests
    /// that keep the draft model are refused rather than silently answered greedily.
    pub draft_model: bool,
    /// `generation.lookup_tokens`: prompt-lookup drafts when the request does not say.
    pub default_lookup_tokens: usize,
    /// How an answer is made when the request does not say.
    pub default_answer_mode: AnswerMode,
    /// Fallback attribution of unmarked sentences (`[citations]`), when on.
    pub attribution: Option<postprocess::Attribution>,
    /// What the model answers when the context does not hold the answer; empty: the model
    /// is not asked to judge (`generation.refusal_phrase`; the threshold on its judgement
    /// is the generator's).
    pub refusal_phrase: String,
}

/// `POST /v1/search` body: retrieval only, with the same options as `/v1/query`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    /// The question to search for (checked as for `/v1/query`).
    pub question: String,
    /// How the chunks are found (defaults from the `retrieval` configuration).
    #[serde(default)]
    pub retrieval: RetrievalOptions,
}

/// A search request with its options resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSearch {
    /// The question, trimmed and checked.
    pub question: String,
    /// Chunks to retrieve, 1 to the server's `retrieval.max_top_k`.
    pub top_k: usize,
    /// Dense, sparse or hybrid search.
    pub mode: SearchMode,
    /// Refuse when the refusal signal of the best chunk is below this (-1 to
    /// 1 + `term_weight`).
    pub min_score: f32,
    /// `retrieval.term_weight` (server-wide).
    pub term_weight: f32,
    /// The collection, tags or documents retrieval is restricted to (checked).
    pub filter: SearchFilter,
    /// Chunks before and after each hit joined into its text, at most
    /// [`MAX_NEIGHBORS`].
    pub neighbors: usize,
}

/// Longest collection name or tag, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Most tags or document ids in a filter.
pub const MAX_FILTER_VALUES: usize = 100;

/// A collection name: 1–64 of `[A-Za-z0-9._-]`, starting with a letter or digit (so never
/// `.`, `..`, empty or a path).
pub fn collection_name_ok(name: &str) -> bool {
    (1..=MAX_NAME_BYTES).contains(&name.len())
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// What a collection name must be, for error messages.
pub const COLLECTION_RULE: &str =
    "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit";

/// A tag: 1–64 bytes, no control characters.
pub fn tag_ok(tag: &str) -> bool {
    (1..=MAX_NAME_BYTES).contains(&tag.len()) && !tag.chars().any(char::is_control)
}

fn check_filter(f: &SearchFilter) -> Result<(), QueryError> {
    let invalid = |field, message: String| Err(QueryError::Invalid { field, message });
    if let Some(c) = &f.collection {
        if !collection_name_ok(c) {
            return invalid(
                "retrieval.filter.collection",
                format!("{c:?} is not a collection name: {COLLECTION_RULE}"),
            );
        }
    }
    if f.tags.len() > MAX_FILTER_VALUES || !f.tags.iter().all(|t| tag_ok(t)) {
        return invalid(
            "retrieval.filter.tags",
            format!("at most {MAX_FILTER_VALUES} tags of 1 to {MAX_NAME_BYTES} bytes without control characters"),
        );
    }
    if f.document_ids.len() > MAX_FILTER_VALUES
        || !f
            .document_ids
            .iter()
            .all(|d| (1..=128).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_graphic()))
    {
        return invalid(
            "retrieval.filter.document_ids",
            format!("at most {MAX_FILTER_VALUES} document ids, each 1 to 128 printable ASCII characters"),
        );
    }
    Ok(())
}

impl SearchRequest {
    /// The checks `/v1/query` applies to its question and retrieval options.
    pub fn validate(self, limits: &Limits) -> Result<ValidSearch, QueryError> {
        let invalid = |field, message: String| Err(QueryError::Invalid { field, message });
        let question = self.question.trim().to_string();
        if question.is_empty() {
            return invalid("question", "must not be empty".into());
        }
        let chars = question.chars().count();
        if chars > limits.max_question_chars {
            return invalid(
                "question",
                format!(
                    "is {chars} characters long; the limit is {}",
                    limits.max_question_chars
                ),
            );
        }
        if question
            .chars()
            .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
        {
            return invalid(
                "question",
                "must not contain NUL or other control characters (newlines and tabs are fine)"
                    .into(),
            );
        }
        check_filter(&self.retrieval.filter)?;
        let top_k = self.retrieval.top_k.unwrap_or(limits.default_top_k);
        if top_k == 0 || top_k > limits.max_top_k {
            return invalid(
                "retrieval.top_k",
                format!("must be between 1 and {}, got {top_k}", limits.max_top_k),
            );
        }
        let min_score = self.retrieval.min_score.unwrap_or(limits.min_score);
        let most = 1.0 + limits.term_weight;
        if !(-1.0..=most).contains(&min_score) {
            return invalid(
                "retrieval.min_score",
                format!("must be a refusal score between -1 and {most}, got {min_score}"),
            );
        }
        let neighbors = self.retrieval.neighbors.unwrap_or(limits.default_neighbors);
        if neighbors > MAX_NEIGHBORS {
            return invalid(
                "retrieval.neighbors",
                format!("must be at most {MAX_NEIGHBORS}, got {neighbors}"),
            );
        }
        Ok(ValidSearch {
            question,
            top_k,
            min_score,
            term_weight: limits.term_weight,
            mode: self.retrieval.mode.unwrap_or(limits.default_mode),
            filter: self.retrieval.filter,
            neighbors,
        })
    }
}

impl QueryRequest {
    /// The request checked against the server's limits, with the defaults filled in.
    pub fn validate(self, limits: &Limits) -> Result<ValidQuery, QueryError> {
        let search = SearchRequest {
            question: self.question,
            retrieval: self.retrieval,
        }
        .validate(limits)?;
        validate_history(&self.history)?;
        let params = self.generation.validate(limits)?;
        let mode = self.mode.unwrap_or(limits.default_answer_mode);
        if !matches!(mode, AnswerMode::Generative | AnswerMode::Extractive) {
            return Err(QueryError::Invalid {
                field: "mode",
                message: format!("must be \"generative\" or \"extractive\", got {mode:?}"),
            });
        }
        Ok(ValidQuery {
            search,
            mode,
            params,
            history: self.history,
            stream: self.stream,
        })
    }
}

/// At most [`MAX_HISTORY`] turns, none empty.
fn validate_history(history: &[Turn]) -> Result<(), QueryError> {
    let invalid = |message: String| {
        Err(QueryError::Invalid {
            field: "history",
            message,
        })
    };
    if history.len() > MAX_HISTORY {
        return invalid(format!(
            "at most {MAX_HISTORY} turns, got {}",
            history.len()
        ));
    }
    if let Some(i) = history.iter().position(|t| t.content.trim().is_empty()) {
        return invalid(format!("turn {i} has no content"));
    }
    Ok(())
}

impl GenerationOptions {
    /// The sampling parameters, the stop sequences and the drafts, each checked against
    /// the server's limits (the configured defaults where the request says nothing).
    fn validate(&self, limits: &Limits) -> Result<Params, QueryError> {
        let invalid = |field, message: String| Err(QueryError::Invalid { field, message });
        let max_tokens = self.max_tokens.unwrap_or(limits.default_max_tokens);
        if max_tokens == 0 || max_tokens > limits.max_tokens {
            return invalid(
                "generation.max_tokens",
                format!(
                    "must be between 1 and {}, got {max_tokens}",
                    limits.max_tokens
                ),
            );
        }
        let temperature = self.temperature.unwrap_or(limits.default_temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return invalid(
                "generation.temperature",
                format!("must be between 0 and 2, got {temperature}"),
            );
        }
        let draft_model = self.draft_choice(limits, temperature)?;
        let repetition_penalty = self
            .repetition_penalty
            .unwrap_or(limits.default_repetition_penalty);
        if !(0.5..=2.0).contains(&repetition_penalty) {
            return invalid(
                "generation.repetition_penalty",
                format!("must be between 0.5 and 2, got {repetition_penalty}"),
            );
        }
        let dry_multiplier = self.dry_multiplier.unwrap_or(limits.default_dry_multiplier);
        if !(0.0..=5.0).contains(&dry_multiplier) {
            return invalid(
                "generation.dry_multiplier",
                format!("must be between 0 and 5 (0 is off), got {dry_multiplier}"),
            );
        }
        let top_p = self.top_p.unwrap_or(limits.default_top_p);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return invalid(
                "generation.top_p",
                format!("must be in (0, 1], got {top_p}"),
            );
        }
        if self.seed.is_some() {
            return invalid(
                "generation.seed",
                "per-request seeds are not supported: the engine (mistral.rs 0.8.1) seeds one random generator shared by all requests; use temperature 0 for reproducible answers".into(),
            );
        }
        Ok(Params {
            max_tokens,
            temperature,
            top_p,
            top_k: self.top_k.unwrap_or(limits.default_top_k_tokens),
            repetition_penalty,
            dry_multiplier,
            dry_allowed_length: limits.dry_allowed_length,
            stop: self.stops()?,
            lookup_tokens: self.lookup_choice(limits, draft_model)?,
            draft_model,
        })
    }

    /// Whether the server's draft model decodes this answer (by default when it has one;
    /// greedy only).
    fn draft_choice(&self, limits: &Limits, temperature: f64) -> Result<bool, QueryError> {
        if self.draft_model == Some(true) && !limits.draft_model {
            return Err(QueryError::Invalid {
                field: "generation.draft_model",
                message: "this server has no draft model (generation.draft in its config): send false or leave it out".into(),
            });
        }
        let draft_model = limits.draft_model && self.draft_model.unwrap_or(true);
        if temperature > 0.0 && draft_model {
            return Err(QueryError::Invalid {
                field: "generation.temperature",
                message: format!("this server decodes speculatively (generation.draft), which mistral.rs does greedily only; send temperature 0, or draft_model false, got {temperature}"),
            });
        }
        Ok(draft_model)
    }

    /// The default stop sequences and the request's own (at most [`MAX_STOPS`], each 1 to
    /// [`MAX_STOP_BYTES`] bytes).
    fn stops(&self) -> Result<Vec<String>, QueryError> {
        let invalid = |message: String| {
            Err(QueryError::Invalid {
                field: "generation.stop",
                message,
            })
        };
        if self.stop.len() > MAX_STOPS {
            return invalid(format!(
                "at most {MAX_STOPS} sequences, got {}",
                self.stop.len()
            ));
        }
        if let Some(bad) = self
            .stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return invalid(format!(
                "each sequence must be 1 to {MAX_STOP_BYTES} bytes long, got {bad:?}"
            ));
        }
        let mut stop: Vec<String> = DEFAULT_STOPS.iter().map(|s| s.to_string()).collect();
        for s in &self.stop {
            if !stop.contains(s) {
                stop.push(s.clone());
            }
        }
        Ok(stop)
    }

    /// Prompt-lookup draft length: within the engine's bound, and not with a draft model.
    fn lookup_choice(&self, limits: &Limits, draft_model: bool) -> Result<usize, QueryError> {
        let lookup_tokens = self.lookup_tokens.unwrap_or(limits.default_lookup_tokens);
        let lookup_max = crate::query::generate::lookup::MAX_DRAFT_TOKENS;
        if lookup_tokens > lookup_max {
            return Err(QueryError::Invalid {
                field: "generation.lookup_tokens",
                message: format!("must be between 0 (off) and {lookup_max}, got {lookup_tokens}"),
            });
        }
        if lookup_tokens > 0 && draft_model {
            return Err(QueryError::Invalid {
                field: "generation.lookup_tokens",
                message: "this server drafts with a draft model (generation.draft); prompt-lookup drafts are its alternative, not an addition: send 0, or draft_model false".into(),
            });
        }
        Ok(lookup_tokens)
    }
}
