//! What the query path returns: the JSON bodies and the events of a streamed answer.

use serde::{Deserialize, Serialize};

use crate::query::generate::RefusalSignals;
use crate::query::postprocess::Citation;
use crate::query::retrieve::Scores;
use crate::query::safety::SafetyReport;
use crate::query::QueryError;
use docent_ingest::store::{Hit, SearchMode, Span};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueryResponse {
    /// Exactly the text the stream's `delta` events carried, concatenated.
    pub answer: String,
    pub citations: Vec<Citation>,
    /// False when nothing relevant was retrieved and the model was not asked.
    pub answerable: bool,
    /// How the answer was made.
    #[serde(default)]
    pub mode: AnswerMode,
    /// What the degeneration guards found in the model's text, each once: `loop` (it
    /// repeated itself; cut there), `echo` (it repeated the prompt's instructions or the
    /// question; left out), `unsupported` (sentences no retrieved chunk supports; left
    /// out), `empty` (nothing usable was left: the extractive answer replaced it).
    #[serde(default)]
    pub degenerate: Vec<String>,
    /// True when the answer came from the cache (same question, options and index).
    #[serde(default)]
    pub cached: bool,
    pub usage: Usage,
    /// What the safety filter did: redactions, whether the answer was withheld, and why.
    #[serde(default)]
    pub safety: SafetyReport,
    /// The question was refused: the answer is the refusal template (`mode: refusal`).
    #[serde(default)]
    pub refused: bool,
    /// Why it was refused, when it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_reason: Option<RefusalReason>,
    /// The model's judgement, when it was asked: its probability of starting the answer
    /// with the refusal phrase (`generation.refusal_phrase`), or with
    /// `generation.refusal = "question"` of answering "no" to the pre-question,
    /// refused at or above `generation.refusal_threshold`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_probability: Option<f32>,
    /// Every signal of the model's judgement that was read (`first_token`; `question`
    /// with `generation.refusal = "question"`), each a probability that the
    /// passages do not hold the answer; `refusal_probability` is the deciding one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_signals: Option<RefusalSignals>,
}

/// Why a question was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalReason {
    /// Nothing retrieved was relevant enough (`retrieval.min_score`); the model was not
    /// asked.
    Retrieval,
    /// Every retrieved chunk was dropped by the safety filter.
    NoSafeContext,
    /// No retrieved sentence answers the question well enough (`retrieval.min_support`).
    Content,
    /// The model judged that the retrieved passages do not answer the question: it was
    /// likely enough to start with the refusal phrase, or wrote it.
    Model,
    /// The model's text was unusable and no retrieved sentence could stand in for it.
    NoAnswer,
}

impl RefusalReason {
    /// The `reason` the refusal template sees.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::Retrieval => "retrieval",
            RefusalReason::NoSafeContext => "no_safe_context",
            RefusalReason::Content => "content",
            RefusalReason::Model => "model",
            RefusalReason::NoAnswer => "no_answer",
        }
    }
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
}

pub(crate) fn search_hit(h: &Hit, scores: Scores) -> SearchHit {
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
