//! The query path, shared by `POST /v1/query` and `docent ask`:
//! **embed → retrieve → prompt → generate → postprocess**, with the safety filter around it.
//!
//! - [`request`]: the request bodies and their checks;
//! - [`answer`]: the one orchestration of an answer (JSON and streamed alike);
//! - [`response`]: the bodies and events returned; [`cache`]: the answer cache;
//! - [`precompute`]: passages' keys and values computed ahead of the questions;
//! - [`engine`]: the seam to the model ([`engine::Engine`]), which [`generate`] implements
//!   over mistral.rs and [`engine::scripted`] from a script (tests).
//!
//! [`QueryEngine`] holds the stages' shared state.

mod answer;
mod cache;
pub mod embed;
pub mod postprocess;
pub mod precompute;
pub mod prompt;
pub mod request;
pub mod response;
pub mod retrieve;
pub mod safety;

/// The seam between the answer path and a generation engine (the `docent-engine` crate).
pub use docent_engine as engine;
/// Stage **generate**: the mistral.rs engine (the `docent-generate` crate).
pub use docent_generate as generate;

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::query::cache::AnswerCache;
use crate::query::engine::{Engine, SharedEngine};
use crate::query::generate::{GenerateError, Generator};
use crate::query::prompt::{PromptError, Prompts};
use crate::query::response::search_hit;
use crate::query::retrieve::{Index, Retrieved, Scores};
use crate::query::safety::{SafetyFilter, SafetyReport};

pub use crate::query::postprocess::stop::DEFAULT_STOPS;
pub use crate::query::request::{
    GenerationOptions, Limits, QueryRequest, RetrievalOptions, SearchRequest, ValidQuery,
    ValidSearch, MAX_HISTORY, MAX_STOPS, MAX_STOP_BYTES,
};
pub use crate::query::response::{
    AnswerMode, QueryEvent, QueryResponse, RefusalReason, SearchHit, SearchResponse, Usage,
};

/// Why a query, search or answer failed. The server maps each variant to an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The request failed a check: 422 with the field at fault.
    #[error("{field}: {message}")]
    Invalid {
        /// The request field at fault (`question`, `retrieval.top_k`, ...).
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// Embedding the question or searching the store failed.
    #[error("retrieval failed: {0}")]
    Retrieval(#[from] docent_ingest::Error),
    /// The prompt could not be built (too long for the model's context, or a template error).
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// The model could not generate the answer.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// Anything else that should not happen (a task that panicked, a stream that ended
    /// without its answer).
    #[error("internal error: {0}")]
    Internal(String),
    /// The generation queue is full (`generation.max_queue`): 429 with `Retry-After`.
    #[error("{queued} answers are being generated or waiting, the most this server takes (generation.max_queue); retry in {retry_after_s} s")]
    Busy {
        /// Answers generating or waiting: the most the server takes (`generation.max_queue`).
        queued: usize,
        /// Seconds to wait before retrying (the recent mean generation time, at least 1).
        retry_after_s: u64,
    },
}

/// Answers questions over the index. One per process, shared by every request.
pub struct QueryEngine {
    /// The embedder and the store that questions are searched in.
    pub index: Index,
    prompts: Prompts,
    generator: SharedEngine,
    limits: Limits,
    /// One permit per answer generating or waiting for the engine.
    slots: Arc<Semaphore>,
    max_queue: usize,
    /// Moving average of generation time (ms), for `Retry-After`.
    generation_ms: std::sync::atomic::AtomicU64,
    cache: AnswerCache,
    safety: SafetyFilter,
    /// Every safety decision by reason, and answers checked.
    safety_counts: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl QueryEngine {
    /// The engine over `index`, answering with `generator`, with at most `max_queue` (at least 1) answers generating or
    /// waiting and an answer cache of `cache_size` entries (0: no cache).
    pub fn new(
        index: Index,
        prompts: Prompts,
        generator: SharedEngine,
        limits: Limits,
        max_queue: usize,
        cache_size: usize,
        safety: SafetyFilter,
    ) -> Self {
        QueryEngine {
            index,
            prompts,
            generator,
            limits,
            slots: Arc::new(Semaphore::new(max_queue.max(1))),
            max_queue: max_queue.max(1),
            generation_ms: std::sync::atomic::AtomicU64::new(1000),
            cache: AnswerCache::new(cache_size),
            safety,
            safety_counts: Default::default(),
        }
    }

    /// The defaults and limits requests are checked against.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Answers being made or waiting for the model (those holding a queue place).
    pub fn answers_in_flight(&self) -> usize {
        self.max_queue
            .saturating_sub(self.slots.available_permits())
    }

    /// The retrieve stage for both endpoints: ranked chunks with their scores,
    /// neighbours joined.
    async fn retrieve(&self, s: ValidSearch) -> Result<(Retrieved, Vec<Scores>), QueryError> {
        self.retrieve_with(s, None).await
    }

    /// [`Self::retrieve`], with the question's embedding when it was made already (at the
    /// instant given).
    async fn retrieve_with(
        &self,
        s: ValidSearch,
        embedded: Option<(&docent_ingest::embed::Embedding, std::time::Instant)>,
    ) -> Result<(Retrieved, Vec<Scores>), QueryError> {
        let (mut retrieved, scores) = match embedded {
            Some((query, started)) => {
                self.index
                    .retrieve_embedded(query, started, s.top_k, s.mode, &s.filter)
                    .await?
            }
            None => {
                self.index
                    .retrieve_scored(&s.question, s.top_k, s.mode, &s.filter)
                    .await?
            }
        };
        if s.term_weight > 0.0 {
            // the chunks as retrieved, before their neighbours are joined
            let texts = retrieved.hits.iter().map(|h| h.payload.text.as_str());
            retrieved.coverage = self.index.term_coverage(&retrieved.terms, texts);
        }
        self.index.expand(&mut retrieved.hits, s.neighbors).await?;
        Ok((retrieved, scores))
    }

    /// Retrieval only: the chunks `answer` would put in the prompt, with their scores.
    pub async fn search(&self, request: SearchRequest) -> Result<SearchResponse, QueryError> {
        let s = request.validate(&self.limits)?;
        let mode = s.mode;
        let (retrieved, scores) = self.retrieve(s).await?;
        let hits = retrieved
            .hits
            .iter()
            .zip(scores)
            .map(|(h, scores)| search_hit(h, scores))
            .collect();
        Ok(SearchResponse {
            mode,
            hits,
            retrieval_ms: retrieved.elapsed_ms,
        })
    }

    /// The engine that writes the answers.
    pub fn engine(&self) -> &dyn Engine {
        &*self.generator
    }

    /// The engine as the mistral.rs [`Generator`] (`None` for another engine, such as a
    /// scripted one in tests), for the tools that need the model itself.
    pub fn generator(&self) -> Option<&Generator> {
        self.generator.as_any().downcast_ref::<Generator>()
    }

    /// Embeddings of `texts` (dense, normalised), off the async threads.
    pub(crate) async fn embed_texts(
        &self,
        texts: Vec<String>,
    ) -> Result<Vec<Vec<f32>>, QueryError> {
        if texts.is_empty() {
            return Ok(vec![]);
        }
        let embedder = self.index.embedder.clone();
        Ok(tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            embedder.embed_dense(&refs)
        })
        .await
        .map_err(|e| QueryError::Internal(e.to_string()))??)
    }

    /// How much each block supports each claim: the mean of the share of the claim's
    /// content words in the block and the cosine similarity of their embeddings.
    pub async fn support(
        &self,
        claims: &[postprocess::Claim],
        blocks: &[String],
    ) -> Result<Vec<Vec<f32>>, QueryError> {
        if claims.is_empty() || blocks.is_empty() {
            return Ok(vec![vec![]; claims.len()]);
        }
        let texts: Vec<String> = claims
            .iter()
            .map(|c| c.text.clone())
            .chain(blocks.iter().cloned())
            .collect();
        let vectors = self.embed_texts(texts).await?;
        let (claim_vecs, block_vecs) = vectors.split_at(claims.len());
        let blocks: Vec<&str> = blocks.iter().map(String::as_str).collect();
        Ok(postprocess::support_matrix(
            claims, claim_vecs, &blocks, block_vecs,
        ))
    }

    /// Safety decisions so far, by reason (`checked`: answers and questions looked at).
    pub fn safety_counts(&self) -> std::collections::BTreeMap<String, u64> {
        self.safety_counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn count(&self, report: &SafetyReport) {
        let m = &crate::metrics::metrics().safety;
        m.with_label_values(&["checked"]).inc();
        for r in &report.reasons {
            m.with_label_values(&[r.as_str()]).inc();
        }
        if report.blocked {
            m.with_label_values(&["blocked"]).inc();
        }
        let mut counts = self.safety_counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry("checked".into()).or_default() += 1;
        for r in &report.reasons {
            *counts.entry(r.clone()).or_default() += 1;
        }
        if report.blocked {
            *counts.entry("blocked".into()).or_default() += 1;
        }
        *counts.entry("redactions".into()).or_default() += report.redactions as u64;
    }
}
