//! The query path, shared by `POST /v1/query` and `docent ask`:
//! **embed → retrieve → prompt → generate → postprocess**, with the safety filter around it.
//! [`QueryEngine`] orchestrates them.

pub mod embed;
pub mod generate;
pub mod postprocess;
pub mod prompt;
pub mod retrieve;
pub mod safety;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::info;

use crate::query::generate::{GenerateError, Generation, Generator, Params, StreamEvent};
use crate::query::postprocess::{AnswerStream, Citation};
use crate::query::prompt::{Budget, ContextBlock, Prompt, PromptError, Prompts, Turn};
use crate::query::retrieve::MAX_NEIGHBORS;
use crate::query::retrieve::{Index, Retrieved, Scores};
use crate::query::safety::{Filter, SafetyReport};
use docent_ingest::store::{Hit, Span};
use docent_ingest::store::{SearchFilter, SearchMode};

pub use crate::query::postprocess::stop::DEFAULT_STOPS;

/// `POST /v1/query` body.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueryRequest {
    pub question: String,
    #[serde(default)]
    pub retrieval: RetrievalOptions,
    #[serde(default)]
    pub generation: GenerationOptions,
    /// Answer as Server-Sent Events (`retrieval`, `delta`, `citation`, `done`, `error`).
    #[serde(default)]
    pub stream: bool,
    /// Earlier turns of the conversation, oldest first; the oldest are left out when the
    /// model's context is full.
    #[serde(default)]
    pub history: Vec<Turn>,
}

/// Most earlier turns a request may send.
pub const MAX_HISTORY: usize = 64;

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetrievalOptions {
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

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationOptions {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, (0, 1]; 1 = off. Only with temperature > 0.
    pub top_p: Option<f64>,
    /// Sample among the k most likely tokens; 0 = off. Only with temperature > 0.
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    /// More strings that end the answer (besides the template's); never part of it.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Not supported: mistral.rs 0.8.1 seeds one random generator per engine (shared by
    /// all requests), so a per-request seed cannot be honoured; refused with 422.
    pub seed: Option<u64>,
}

/// Most extra stop sequences a request may give, and their longest length in bytes.
pub const MAX_STOPS: usize = 8;
pub const MAX_STOP_BYTES: usize = 64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueryResponse {
    pub answer: String,
    pub citations: Vec<Citation>,
    /// False when nothing relevant was retrieved and the model was not asked.
    pub answerable: bool,
    /// True when the answer came from the cache (same question, options and index).
    #[serde(default)]
    pub cached: bool,
    pub usage: Usage,
    /// What the safety filter did: redactions, whether the answer was withheld, and why.
    #[serde(default)]
    pub safety: SafetyReport,
}

/// `POST /v1/search` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResponse {
    pub mode: SearchMode,
    pub hits: Vec<SearchHit>,
    pub retrieval_ms: f64,
}

/// One retrieved chunk with its scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchHit {
    pub document_id: String,
    pub source: String,
    pub sources: Vec<String>,
    pub title: String,
    pub chunk_index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page: Option<u32>,
    pub span: Span,
    pub text: String,
    /// The score the hits are ranked by (the mode's).
    pub score: f32,
    pub scores: Scores,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub retrieval_ms: f64,
    pub generation_ms: f64,
    pub total_ms: f64,
    /// Milliseconds from the request to the first answer text (streamed answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Generated tokens per second of generation time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Retrieved chunks left out of the prompt because the model's context was full.
    #[serde(default)]
    pub context_chunks_dropped: usize,
    /// Earlier turns left out (the oldest) because the model's context was full.
    #[serde(default)]
    pub history_turns_dropped: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("retrieval failed: {0}")]
    Retrieval(#[from] docent_ingest::Error),
    #[error(transparent)]
    Prompt(#[from] PromptError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("{queued} answers are being generated or waiting, the most this server takes (generation.max_queue); retry in {retry_after_s} s")]
    Busy { queued: usize, retry_after_s: u64 },
}

/// A request with every option resolved against the configuration and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidQuery {
    pub search: ValidSearch,
    pub params: Params,
    pub history: Vec<Turn>,
    pub stream: bool,
}

/// Limits a request is checked against.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_mode: SearchMode,
    /// Refuse without the model when the best chunk's cosine similarity is below this.
    pub min_score: f32,
    pub default_top_k: usize,
    pub max_top_k: usize,
    pub default_neighbors: usize,
    pub default_max_tokens: usize,
    pub max_tokens: usize,
    pub default_temperature: f64,
    pub default_top_p: f64,
    pub default_top_k_tokens: usize,
    pub default_repetition_penalty: f32,
    pub max_question_chars: usize,
    /// Keep-alive interval of streamed answers.
    pub keep_alive: Duration,
    /// Speculative decoding is on: mistral.rs decodes it greedily whatever the sampling
    /// settings, so sampled requests are refused rather than silently answered greedily.
    pub greedy_only: bool,
    /// Fallback attribution of unmarked sentences (`[citations]`), when on.
    pub attribution: Option<postprocess::Attribution>,
}

/// `POST /v1/search` body: retrieval only, with the same options as `/v1/query`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    pub question: String,
    #[serde(default)]
    pub retrieval: RetrievalOptions,
}

/// A search request with its options resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSearch {
    pub question: String,
    pub top_k: usize,
    pub mode: SearchMode,
    pub min_score: f32,
    pub filter: SearchFilter,
    pub neighbors: usize,
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
        let top_k = self.retrieval.top_k.unwrap_or(limits.default_top_k);
        if top_k == 0 || top_k > limits.max_top_k {
            return invalid(
                "retrieval.top_k",
                format!("must be between 1 and {}, got {top_k}", limits.max_top_k),
            );
        }
        let min_score = self.retrieval.min_score.unwrap_or(limits.min_score);
        if !(-1.0..=1.0).contains(&min_score) {
            return invalid(
                "retrieval.min_score",
                format!("must be a cosine similarity between -1 and 1, got {min_score}"),
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
            mode: self.retrieval.mode.unwrap_or(limits.default_mode),
            filter: self.retrieval.filter,
            neighbors,
        })
    }
}

impl QueryRequest {
    pub fn validate(self, limits: &Limits) -> Result<ValidQuery, QueryError> {
        let invalid = |field, message: String| Err(QueryError::Invalid { field, message });
        let search = SearchRequest {
            question: self.question,
            retrieval: self.retrieval,
        }
        .validate(limits)?;
        if self.history.len() > MAX_HISTORY {
            return invalid(
                "history",
                format!("at most {MAX_HISTORY} turns, got {}", self.history.len()),
            );
        }
        if let Some(i) = self
            .history
            .iter()
            .position(|t| t.content.trim().is_empty())
        {
            return invalid("history", format!("turn {i} has no content"));
        }
        let max_tokens = self
            .generation
            .max_tokens
            .unwrap_or(limits.default_max_tokens);
        if max_tokens == 0 || max_tokens > limits.max_tokens {
            return invalid(
                "generation.max_tokens",
                format!(
                    "must be between 1 and {}, got {max_tokens}",
                    limits.max_tokens
                ),
            );
        }
        let temperature = self
            .generation
            .temperature
            .unwrap_or(limits.default_temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return invalid(
                "generation.temperature",
                format!("must be between 0 and 2, got {temperature}"),
            );
        }
        if temperature > 0.0 && limits.greedy_only {
            return invalid(
                "generation.temperature",
                format!("this server decodes speculatively (generation.draft), which mistral.rs does greedily only; send temperature 0, got {temperature}"),
            );
        }
        let repetition_penalty = self
            .generation
            .repetition_penalty
            .unwrap_or(limits.default_repetition_penalty);
        if !(0.5..=2.0).contains(&repetition_penalty) {
            return invalid(
                "generation.repetition_penalty",
                format!("must be between 0.5 and 2, got {repetition_penalty}"),
            );
        }
        let g = &self.generation;
        let top_p = g.top_p.unwrap_or(limits.default_top_p);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return invalid(
                "generation.top_p",
                format!("must be in (0, 1], got {top_p}"),
            );
        }
        let top_k = g.top_k.unwrap_or(limits.default_top_k_tokens);
        if g.seed.is_some() {
            return invalid(
                "generation.seed",
                "per-request seeds are not supported: the engine (mistral.rs 0.8.1) seeds one random generator shared by all requests; use temperature 0 for reproducible answers".into(),
            );
        }
        if g.stop.len() > MAX_STOPS {
            return invalid(
                "generation.stop",
                format!("at most {MAX_STOPS} sequences, got {}", g.stop.len()),
            );
        }
        if let Some(bad) = g
            .stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return invalid(
                "generation.stop",
                format!("each sequence must be 1 to {MAX_STOP_BYTES} bytes long, got {bad:?}"),
            );
        }
        let mut stop: Vec<String> = DEFAULT_STOPS.iter().map(|s| s.to_string()).collect();
        for s in &g.stop {
            if !stop.contains(s) {
                stop.push(s.clone());
            }
        }
        Ok(ValidQuery {
            search,
            params: Params {
                max_tokens,
                temperature,
                top_p,
                top_k,
                repetition_penalty,
                stop,
            },
            history: self.history,
            stream: self.stream,
        })
    }
}

/// Answers questions over the index. One per process, shared by every request.
pub struct QueryEngine {
    pub index: Index,
    prompts: Prompts,
    generator: Generator,
    limits: Limits,
    /// One permit per answer generating or waiting for the engine.
    slots: Arc<Semaphore>,
    max_queue: usize,
    /// Moving average of generation time (ms), for `Retry-After`.
    generation_ms: std::sync::atomic::AtomicU64,
    cache: AnswerCache,
    safety: Filter,
    /// Every safety decision by reason, and answers checked.
    safety_counts: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Greedy answers by request (its resolved options) and the index revision they were made
/// on. quick_cache's S3-FIFO eviction: a key seen once goes first, repeated questions stay.
struct AnswerCache(Option<quick_cache::sync::Cache<String, (u64, QueryResponse)>>);

impl AnswerCache {
    fn new(capacity: usize) -> Self {
        AnswerCache((capacity > 0).then(|| quick_cache::sync::Cache::new(capacity)))
    }

    fn get(&self, key: &str, version: u64) -> Option<QueryResponse> {
        self.0
            .as_ref()?
            .get(key)
            .filter(|(v, _)| *v == version)
            .map(|(_, r)| r)
    }

    fn put(&self, key: String, version: u64, response: QueryResponse) {
        if let Some(cache) = &self.0 {
            cache.insert(key, (version, response));
        }
    }
}

impl QueryEngine {
    pub fn new(
        index: Index,
        prompts: Prompts,
        generator: Generator,
        limits: Limits,
        max_queue: usize,
        cache_size: usize,
        safety: Filter,
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

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The retrieve stage for both endpoints: ranked chunks with their scores,
    /// neighbours joined.
    async fn retrieve(&self, s: ValidSearch) -> Result<(Retrieved, Vec<Scores>), QueryError> {
        let (mut retrieved, scores) = self
            .index
            .retrieve_scored(&s.question, s.top_k, s.mode, &s.filter)
            .await?;
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

    pub fn generator(&self) -> &Generator {
        &self.generator
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
        let embedder = self.index.embedder.clone();
        let vectors = tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            embedder.embed_dense(&refs)
        })
        .await
        .map_err(|e| QueryError::Internal(e.to_string()))??;
        let cos = |a: &[f32], b: &[f32]| {
            let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            dot / (norm(a) * norm(b))
        };
        let (claim_vecs, block_vecs) = vectors.split_at(claims.len());
        Ok(claims
            .iter()
            .zip(claim_vecs)
            .map(|(c, cv)| {
                blocks
                    .iter()
                    .zip(block_vecs)
                    .map(|(b, bv)| (postprocess::lexical_support(&c.text, b) + cos(cv, bv)) / 2.0)
                    .collect()
            })
            .collect())
    }

    /// Fallback attribution of a normal-form answer over the prompt's blocks, when on.
    async fn attribute(
        &self,
        answer: String,
        citations: Vec<Citation>,
        hits: &[Hit],
    ) -> Result<(String, Vec<Citation>), QueryError> {
        let Some(a) = self.limits.attribution else {
            return Ok((answer, citations));
        };
        let claims = postprocess::claims(&answer);
        let blocks: Vec<String> = hits.iter().map(|h| h.payload.text.clone()).collect();
        let support = self.support(&claims, &blocks).await?;
        Ok(postprocess::attribute(&answer, &claims, &support, hits, a))
    }

    /// Safety decisions so far, by reason (`checked`: answers and questions looked at).
    pub fn safety_counts(&self) -> std::collections::BTreeMap<String, u64> {
        self.safety_counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn count(&self, report: &SafetyReport) {
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

    /// The refusal: nothing relevant (or nothing safe) was retrieved; the model is not asked.
    fn refuse(
        &self,
        q: &ValidQuery,
        safety: SafetyReport,
        retrieval_ms: f64,
        started: Instant,
    ) -> Result<QueryResponse, QueryError> {
        self.count(&safety);
        Ok(QueryResponse {
            answer: self.prompts.refusal(&q.search.question)?,
            citations: vec![],
            answerable: false,
            cached: false,
            usage: Usage {
                retrieval_ms,
                total_ms: started.elapsed().as_secs_f64() * 1e3,
                ..Usage::default()
            },
            safety,
        })
    }

    /// The answer when the filter withholds it.
    fn withheld(&self, report: SafetyReport, usage: Usage) -> QueryResponse {
        self.count(&report);
        QueryResponse {
            answer: "The safety filter withheld this answer.".into(),
            citations: vec![],
            answerable: false,
            cached: false,
            usage,
            safety: report,
        }
    }

    /// Retrieval, refusal, cache and prompt: everything before the model runs.
    async fn prepare(&self, q: ValidQuery, started: Instant) -> Result<Prepared, QueryError> {
        let mut safety = SafetyReport::default();
        if self.safety.question(&q.search.question, &mut safety) {
            return Ok(Prepared::Ready(self.withheld(safety, Usage::default())));
        }
        // greedy answers are a function of the request and the index: reuse them
        let cache_key = (q.params.temperature <= 0.0)
            .then(|| format!("{:?}", (&q.search, &q.params, &q.history)));
        let version = self
            .index
            .store
            .revision()
            .await
            .map_err(docent_ingest::Error::from)?;
        if let Some(hit) = cache_key
            .as_deref()
            .and_then(|k| self.cache.get(k, version))
        {
            return Ok(Prepared::Ready(QueryResponse {
                cached: true,
                // token counts describe the answer; the times are this request's
                usage: Usage {
                    retrieval_ms: 0.0,
                    generation_ms: 0.0,
                    total_ms: started.elapsed().as_secs_f64() * 1e3,
                    ttft_ms: None,
                    ..hit.usage
                },
                ..hit
            }));
        }

        // admission before any work: beyond max_queue answers in flight, say when to come
        // back (held until the answer is done; dropped with a refusal)
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            let avg = self
                .generation_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            QueryError::Busy {
                queued: self.max_queue,
                retry_after_s: avg.div_ceil(1000).max(1),
            }
        })?;
        let mode = q.search.mode;
        let (retrieved, scores) = self.retrieve(q.search.clone()).await?;
        let relevant = retrieved
            .best_dense
            .is_some_and(|s| s >= q.search.min_score);
        if retrieved.hits.is_empty() || !relevant {
            return self
                .refuse(&q, safety, retrieved.elapsed_ms, started)
                .map(Prepared::Ready);
        }

        // chunks that address the model are dropped or fenced as quoted data
        let mut hits = Vec::with_capacity(retrieved.hits.len());
        let mut hit_scores = Vec::with_capacity(retrieved.hits.len());
        let mut texts = Vec::with_capacity(retrieved.hits.len());
        for (h, sc) in retrieved.hits.into_iter().zip(scores) {
            let (keep, fence) = self.safety.chunk(&h.payload.text, &mut safety);
            if !keep {
                continue;
            }
            texts.push(if fence {
                self.prompts.quoted(&h.payload.text)?
            } else {
                h.payload.text.clone()
            });
            hits.push(h);
            hit_scores.push(sc);
        }
        if hits.is_empty() {
            return self
                .refuse(&q, safety, retrieved.elapsed_ms, started)
                .map(Prepared::Ready);
        }
        let blocks: Vec<ContextBlock<'_>> = hits
            .iter()
            .zip(&texts)
            .enumerate()
            .map(|(i, (h, text))| ContextBlock {
                n: i + 1,
                title: &h.payload.title,
                source: &h.payload.source,
                text,
            })
            .collect();
        let budget = Budget {
            context_tokens: self.generator.context_tokens(),
            max_tokens: q.params.max_tokens,
        };
        let fitted = self.prompts.render_within(
            &q.search.question,
            &blocks,
            &q.history,
            budget,
            self.generator.tokens(),
        )?;
        let context_chunks_dropped = hits.len() - fitted.blocks;
        hits.truncate(fitted.blocks);

        Ok(Prepared::Generate(Box::new(Pending {
            search: SearchResponse {
                mode,
                hits: hits
                    .iter()
                    .zip(hit_scores)
                    .map(|(h, scores)| search_hit(h, scores))
                    .collect(),
                retrieval_ms: retrieved.elapsed_ms,
            },
            hits,
            prompt: fitted.prompt,
            context_chunks_dropped,
            history_turns_dropped: fitted.history_dropped,
            q,
            started,
            cache_key,
            version,
            safety,
            _slot: slot,
        })))
    }

    /// The response for a finished generation; cached when greedy.
    fn finish(
        &self,
        p: &Pending,
        answer: String,
        citations: Vec<Citation>,
        generation: &Generation,
        generation_ms: f64,
        ttft_ms: Option<f64>,
    ) -> QueryResponse {
        let avg = self
            .generation_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        self.generation_ms.store(
            (avg * 3 + generation_ms as u64) / 4,
            std::sync::atomic::Ordering::Relaxed,
        );
        let usage = Usage {
            prompt_tokens: generation.prompt_tokens,
            completion_tokens: generation.completion_tokens,
            retrieval_ms: p.search.retrieval_ms,
            generation_ms,
            total_ms: p.started.elapsed().as_secs_f64() * 1e3,
            ttft_ms,
            tokens_per_second: (generation_ms > 0.0)
                .then(|| generation.completion_tokens as f64 / (generation_ms / 1e3)),
            context_chunks_dropped: p.context_chunks_dropped,
            history_turns_dropped: p.history_turns_dropped,
        };
        info!(
            top_k = p.q.search.top_k,
            citations = citations.len(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            total_ms = usage.total_ms,
            stream = p.q.stream,
            "answered"
        );
        let mut safety = p.safety.clone();
        let answer = self.safety.redact(&answer, &mut safety);
        let citations = citations
            .into_iter()
            .map(|mut c| {
                c.quote = self.safety.redact(&c.quote, &mut safety);
                c
            })
            .collect();
        let response = if self.safety.withhold(&answer, &p.prompt.system, &mut safety) {
            self.withheld(safety, usage)
        } else {
            self.count(&safety);
            QueryResponse {
                answer,
                citations,
                answerable: true,
                cached: false,
                usage,
                safety,
            }
        };
        if let Some(key) = &p.cache_key {
            self.cache.put(key.clone(), p.version, response.clone());
        }
        response
    }

    /// The answer as one response: the same orchestration as [`Self::answer_stream`]
    /// (one path for JSON and streamed answers), its events collected until `done`.
    pub async fn answer(
        self: &Arc<Self>,
        request: QueryRequest,
    ) -> Result<QueryResponse, QueryError> {
        let mut events = self.answer_stream(request).await?;
        while let Some(event) = events.recv().await {
            match event {
                QueryEvent::Done(response) => return Ok(*response),
                QueryEvent::Error(e) => return Err(e),
                _ => {}
            }
        }
        Err(QueryError::Internal(
            "the answer ended without a result".into(),
        ))
    }

    /// The answer as a stream of events. Errors before the model starts (bad request, busy,
    /// prompt too long) are returned here, so they get a plain HTTP status; later ones
    /// arrive as an `error` event. Dropping the receiver cancels the generation.
    pub async fn answer_stream(
        self: &Arc<Self>,
        request: QueryRequest,
    ) -> Result<mpsc::Receiver<QueryEvent>, QueryError> {
        let started = Instant::now();
        let q = request.validate(&self.limits)?;
        let (tx, rx) = mpsc::channel(64);
        let p = match self.prepare(q, started).await? {
            Prepared::Ready(response) => {
                // cached or refused: the same events, at once
                let mut events = vec![QueryEvent::Delta {
                    text: response.answer.clone(),
                }];
                events.extend(response.citations.iter().cloned().map(QueryEvent::Citation));
                events.push(QueryEvent::Done(Box::new(response)));
                tokio::spawn(async move {
                    for e in events {
                        if tx.send(e).await.is_err() {
                            break;
                        }
                    }
                });
                return Ok(rx);
            }
            Prepared::Generate(p) => p,
        };
        let generation_started = Instant::now();
        let stream = self.generator.stream(&p.prompt, &p.q.params).await?;
        let engine = self.clone();
        tokio::spawn(async move {
            engine
                .drive_stream(*p, stream, generation_started, tx)
                .await;
        });
        Ok(rx)
    }

    /// Forwards a generation as events until it ends or the client goes away (which drops
    /// the generation, and so cancels it).
    async fn drive_stream(
        &self,
        p: Pending,
        mut stream: crate::query::generate::GenerationStream,
        generation_started: Instant,
        tx: mpsc::Sender<QueryEvent>,
    ) {
        let keep_alive = self.limits.keep_alive;
        if tx
            .send(QueryEvent::Retrieval(Box::new(p.search.clone())))
            .await
            .is_err()
        {
            return;
        }
        let mut answer =
            AnswerStream::new(&p.q.params.stop).with_redaction(self.safety.config.pii.clone());
        let mut shown = String::new();
        let mut ttft_ms = None;
        let send_step = |step: postprocess::StreamStep, ttft_ms: &mut Option<f64>| {
            let mut events = Vec::new();
            if !step.text.is_empty() {
                ttft_ms.get_or_insert_with(|| p.started.elapsed().as_secs_f64() * 1e3);
                events.push(QueryEvent::Delta { text: step.text });
            }
            events.extend(step.citations.into_iter().map(QueryEvent::Citation));
            events
        };
        loop {
            let next = tokio::select! {
                _ = tx.closed() => return,
                next = tokio::time::timeout(keep_alive, stream.next()) => next,
            };
            let event = match next {
                Err(_) => {
                    if tx.send(QueryEvent::KeepAlive).await.is_err() {
                        return;
                    }
                    continue;
                }
                Ok(None) => return,
                Ok(Some(event)) => event,
            };
            match event {
                Ok(StreamEvent::Delta(text)) => {
                    let step = answer.push(&text, &p.hits);
                    // a denied pattern or an echo of the system prompt is never shown:
                    // the generation stops and `done` says why
                    shown.push_str(&step.text);
                    let mut check = p.safety.clone();
                    if self.safety.withhold(&shown, &p.prompt.system, &mut check) {
                        let response = self.withheld(check, Usage::default());
                        let _ = tx.send(QueryEvent::Done(Box::new(response))).await;
                        return;
                    }
                    for e in send_step(step, &mut ttft_ms) {
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                }
                Ok(StreamEvent::Done(generation)) => {
                    let generation_ms = generation_started.elapsed().as_secs_f64() * 1e3;
                    let (rest, text, citations) = answer.finish(&p.hits);
                    let mut events = send_step(rest, &mut ttft_ms);
                    // the done event has the attributed answer; the deltas had the model's
                    // own markers
                    let (text, citations) = match self.attribute(text, citations, &p.hits).await {
                        Ok(attributed) => attributed,
                        Err(e) => {
                            let _ = tx.send(QueryEvent::Error(e)).await;
                            return;
                        }
                    };
                    let response =
                        self.finish(&p, text, citations, &generation, generation_ms, ttft_ms);
                    events.push(QueryEvent::Done(Box::new(response)));
                    for e in events {
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                    return;
                }
                Err(e) => {
                    let _ = tx.send(QueryEvent::Error(QueryError::from(e))).await;
                    return;
                }
            }
        }
    }
}

/// What `prepare` found: an answer without the model, or a prompt to run.
enum Prepared {
    Ready(QueryResponse),
    Generate(Box<Pending>),
}

/// An answer about to be generated.
struct Pending {
    q: ValidQuery,
    /// The chunks in the prompt, in block order.
    hits: Vec<Hit>,
    /// The same, as the `retrieval` event shows them.
    search: SearchResponse,
    prompt: Prompt,
    context_chunks_dropped: usize,
    history_turns_dropped: usize,
    started: Instant,
    cache_key: Option<String>,
    version: u64,
    /// What the safety filter found before generation (question, chunks).
    safety: SafetyReport,
    /// The place in the bounded queue, held until the answer is done.
    _slot: OwnedSemaphorePermit,
}

/// One event of a streamed answer.
#[derive(Debug)]
pub enum QueryEvent {
    /// The chunks in the prompt (once, first).
    Retrieval(Box<SearchResponse>),
    /// More answer text; all deltas together are the answer.
    Delta {
        text: String,
    },
    /// A citation whose marker completed.
    Citation(Citation),
    /// The same body as the non-streamed response.
    Done(Box<QueryResponse>),
    Error(QueryError),
    /// Nothing new for a while.
    KeepAlive,
}

fn search_hit(h: &Hit, scores: Scores) -> SearchHit {
    let p = &h.payload;
    SearchHit {
        sources: p.all_sources(),
        document_id: p.document_id.clone(),
        source: p.source.clone(),
        title: p.title.clone(),
        chunk_index: p.chunk_index,
        page: p.page,
        span: p.span,
        text: p.text.clone(),
        score: h.score,
        scores,
    }
}
