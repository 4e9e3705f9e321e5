//! What the query path returns: the JSON bodies and the events of a streamed answer.

use serde::{Deserialize, Serialize};

pub use docent_engine::AnswerMode;

use crate::query::generate::RefusalSignals;
use crate::query::postprocess::Citation;
use crate::query::retrieve::Scores;
use crate::query::safety::SafetyReport;
use crate::query::QueryError;
use docent_ingest::store::{Hit, SearchMode, Span};

/// `POST /v1/query` response, and the body of a streamed answer's `done` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueryResponse {
    /// Exactly the text the stream's `delta` events carried, concatenated.
    pub answer: String,
    /// The context blocks the answer cites, with the quote that supports each.
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
    /// Token counts and timings of this answer.
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

/// `POST /v1/search` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResponse {
    /// How the chunks were ranked: `dense`, `sparse` or `hybrid`.
    pub mode: SearchMode,
    /// The chunks retrieved, best first, neighbours joined into their text.
    pub hits: Vec<SearchHit>,
    /// Milliseconds the retrieval took, embedding the question included.
    pub retrieval_ms: f64,
}

/// One retrieved chunk with its scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchHit {
    /// The document's content id (hex SHA-256 of its text).
    pub document_id: String,
    /// The first source that holds the document (the one cited).
    pub source: String,
    /// Every source that holds the document's content.
    pub sources: Vec<String>,
    /// The document's title.
    pub title: String,
    /// The chunk's position in its document, from 0.
    pub chunk_index: usize,
    /// 1-based page the chunk starts on, for paged formats (PDF).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page: Option<u32>,
    /// Byte range of the text in the document's extracted text.
    pub span: Span,
    /// The chunk's text, with its joined neighbours.
    pub text: String,
    /// The score the hits are ranked by (the mode's).
    pub score: f32,
    /// The chunk's score under each ranking (dense, sparse, fused).
    pub scores: Scores,
}

/// Token counts and timings of one answer (`usage` in the response).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt put to the model.
    pub prompt_tokens: usize,
    /// Tokens the model generated.
    pub completion_tokens: usize,
    /// Milliseconds spent retrieving (embedding the question and searching); 0 for a cached
    /// answer.
    pub retrieval_ms: f64,
    /// Milliseconds spent generating; 0 when the model was not asked or the answer was cached.
    pub generation_ms: f64,
    /// Milliseconds from the request to the complete answer.
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
        /// The text, in order.
        text: String,
    },
    /// A citation whose marker completed.
    Citation(Citation),
    /// The same body as the non-streamed response.
    Done(Box<QueryResponse>),
    /// The answer failed; nothing follows.
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
