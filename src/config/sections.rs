//! The smaller sections: `[server]`, `[citations]`, `[embedding]`, `[chunking]`, `[ingest]`,
//! `[retrieval]`, `[prompts]`, and the checks of each.

use super::*;

/// `[citations]`: fallback attribution for answers whose sentences lack a marker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CitationsConfig {
    /// Add markers (`inferred: true`) to unmarked sentences a chunk supports, and remove
    /// model markers whose chunk does not support their sentence.
    pub fallback: bool,
    /// Support (mean of content-word overlap and embedding cosine) needed to add a marker.
    pub add_at: f32,
    /// Support below which a model-written marker is removed.
    pub drop_below: f32,
    /// A generated sentence (two content words or more) that no retrieved chunk supports
    /// this much is left out as unsupported; an answer left empty falls back to the
    /// extractive answer. 0 keeps every sentence.
    #[serde(default = "default_unsupported_below")]
    pub unsupported_below: f32,
}

fn default_unsupported_below() -> f32 {
    0.2
}

impl Default for CitationsConfig {
    fn default() -> Self {
        CitationsConfig {
            fallback: true,
            add_at: 0.3,
            drop_below: 0.1,
            unsupported_below: default_unsupported_below(),
        }
    }
}

/// `[server]`: the HTTP server's address, request and upload limits, timeouts, CORS and
/// log format.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on, `host:port` (default `127.0.0.1:8080`; port 0 picks a free
    /// one). Listening beyond loopback needs API keys unless `auth.enabled = false`.
    pub bind: String,
    /// Largest accepted JSON body, bytes.
    pub max_body_bytes: usize,
    /// Longest accepted question, characters.
    pub max_question_chars: usize,
    /// Largest accepted uploaded file, bytes.
    pub max_upload_bytes: usize,
    /// A streamed answer with nothing new for this long gets a keep-alive comment.
    #[serde(default = "default_keep_alive_ms")]
    pub keep_alive_ms: u64,
    /// Largest uploaded file per type (extension → bytes), below `max_upload_bytes`.
    #[serde(default)]
    pub upload_limits: std::collections::BTreeMap<String, usize>,
    /// A request must be answered (its response head sent) within this many seconds, or
    /// it gets 503 `timeout`; the client must send its request head within it too.
    #[serde(default = "default_request_timeout_s")]
    pub request_timeout_s: u64,
    /// Requests handled at once; more get 503 `overloaded` with `Retry-After`.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// On SIGTERM or SIGINT, in-flight requests and ingest jobs get this long to finish.
    #[serde(default = "default_shutdown_timeout_s")]
    pub shutdown_timeout_s: u64,
    /// Origins allowed to call the API from a browser (`*` for any); empty: CORS off.
    #[serde(default)]
    pub cors_origins: Vec<String>,
    /// `text` or `json` (one JSON object per line).
    #[serde(default)]
    pub log_format: LogFormat,
}

/// How log lines are written to stderr (`server.log_format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines, coloured when stderr is a terminal (the default).
    #[default]
    Text,
    /// One JSON object per line, with the request span's fields.
    Json,
}

pub(super) fn default_request_timeout_s() -> u64 {
    120
}
pub(super) fn default_max_in_flight() -> usize {
    256
}
pub(super) fn default_shutdown_timeout_s() -> u64 {
    30
}

pub(super) fn default_keep_alive_ms() -> u64 {
    15_000
}

/// `[embedding]`: the ONNX embedding model, ONNX Runtime and how they run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingConfig {
    /// Directory with model.onnx, tokenizer.json, config.json, special_tokens_map.json,
    /// tokenizer_config.json.
    pub model_dir: PathBuf,
    /// libonnxruntime.so (>= 1.24). Defaults to `$ORT_DYLIB_PATH` when set.
    pub ort_library: PathBuf,
    /// Model input limit in tokens, special tokens included.
    pub max_length: usize,
    /// ONNX Runtime intra-op threads (at least 1; default 2).
    pub threads: usize,
    /// Texts embedded per ONNX run (at least 1; default 8).
    pub batch_size: usize,
    /// BM25 document weighting (`k1`, `b`, `avg_len` in BM25 tokens); changing it
    /// re-embeds documents on their next ingest.
    #[serde(default)]
    pub bm25: docent_ingest::embed::Bm25Settings,
}

/// `[chunking]`: how documents are split into chunks before they are embedded.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkingConfig {
    /// Chunk size in embedding-model tokens (at most `embedding.max_length - 2`).
    pub max_tokens: usize,
    /// Tokens shared by neighbouring chunks.
    pub overlap: usize,
    /// What a chunk's vectors see besides its text: `none`, `title` (the document's) or
    /// `section` (the title and the Markdown heading path; the default). Changing it
    /// re-embeds documents on their next ingest.
    #[serde(default)]
    pub headers: docent_ingest::pipeline::Headers,
}

/// `[ingest]`: the ingest pipeline's parallelism, queue and flushing.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestConfig {
    /// Threads that load and split documents ahead of the embedder; 0 = one per CPU core.
    pub workers: usize,
    /// Documents loaded and split ahead of the embedder (bounds memory).
    pub queue_depth: usize,
    /// Make the index durable after this many chunks of a long document.
    pub flush_every: usize,
}

impl IngestConfig {
    /// The ingest pipeline's settings from this section (`workers = 0` becomes one per CPU
    /// core); the settings this section lacks keep the pipeline's defaults.
    pub fn pipeline(&self) -> docent_ingest::pipeline::PipelineConfig {
        let auto = docent_ingest::pipeline::PipelineConfig::default();
        docent_ingest::pipeline::PipelineConfig {
            workers: if self.workers == 0 {
                auto.workers
            } else {
                self.workers
            },
            queue_depth: self.queue_depth,
            flush_every: self.flush_every,
            ..auto
        }
    }
}

/// `[retrieval]`: how chunks are searched and ranked, how many a request gets, and when a
/// question is refused for lack of support.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrievalConfig {
    /// `dense`, `sparse` (BM25) or `hybrid` (both, fused with reciprocal rank fusion).
    pub mode: docent_ingest::store::SearchMode,
    /// Hybrid fusion (`method` dbsf | rrf, `candidates`, `rrf_k`, weights) and optional
    /// MMR diversity (`mmr_lambda`).
    pub fusion: docent_ingest::store::Fusion,
    /// How the dense ranking is searched above the engine's full-scan threshold (about
    /// 6,600 chunks per segment): `ef`, the HNSW beam width, and `exact` (every vector).
    #[serde(default)]
    pub ann: docent_ingest::store::Ann,
    /// Below this dense cosine similarity of the best chunk, the question is answered from
    /// the refusal template without calling the model (`answerable: false`); 0 = never.
    /// Default 0.3: calibrated on SQuAD v2.0, where at most 1 % of answerable questions
    /// have their best chunk below 0.324 (`docent eval` prints the calibration).
    pub min_score: f32,
    /// The refusal signal adds this weight × the share of the question's terms that the
    /// retrieved chunks contain to the best chunk's cosine similarity; 0 (the default) =
    /// cosine only. With 0.5 and a `min_score` calibrated by `docent eval` on your own
    /// questions, far more unanswerable natural questions are refused (docs/evaluation.md,
    /// "Retrieval quality"). At most 2.
    #[serde(default)]
    pub term_weight: f32,
    /// Refusal by content: below this score of the best retrieved sentence as an answer
    /// (the extractive answer's score: share of the question's content words and cosine),
    /// the question is refused; 0 = off (the default). On squad-v2.0's first 200
    /// questions 0.459 refuses 29.7 % of the unanswerable ones at 9.8 % false refusals.
    #[serde(default)]
    pub min_support: f32,
    /// Chunks retrieved for a request that does not say (default 3; at most `max_top_k`).
    pub top_k: usize,
    /// Largest `top_k` a request may ask for.
    pub max_top_k: usize,
    /// Neighbour expansion: chunks before and after each hit joined into its context.
    #[serde(default)]
    pub neighbors: usize,
}

/// `[prompts]`: where the prompt templates are.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptsConfig {
    /// Directory of minijinja templates.
    pub dir: PathBuf,
}

impl EmbeddingConfig {
    /// Token limits, threads, batch size and BM25's parameters.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_length < 3 {
            return invalid("embedding.max_length", "must be at least 3".into());
        }
        if self.threads == 0 || self.batch_size == 0 {
            return invalid(
                "embedding.threads",
                "embedding.threads and embedding.batch_size must be at least 1".into(),
            );
        }
        let bm25 = self.bm25;
        if !(bm25.k1 > 0.0 && bm25.k1 <= 10.0) {
            return invalid(
                "embedding.bm25.k1",
                format!(
                    "is BM25's term saturation, between 0 and 10 (usually 1.2), got {}",
                    bm25.k1
                ),
            );
        }
        if !(0.0..=1.0).contains(&bm25.b) {
            return invalid(
                "embedding.bm25.b",
                format!(
                    "is BM25's length normalisation, between 0 and 1 (usually 0.75), got {}",
                    bm25.b
                ),
            );
        }
        if !(bm25.avg_len >= 1.0 && bm25.avg_len.is_finite()) {
            return invalid(
                "embedding.bm25.avg_len",
                format!(
                    "is a length in BM25 tokens, at least 1, got {}",
                    bm25.avg_len
                ),
            );
        }
        Ok(())
    }
}

impl RetrievalConfig {
    /// Fusion, the ANN beam, neighbours, the refusal scores and `top_k`.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let f = &self.fusion;
        let positive = |w: f32| w.is_finite() && w > 0.0;
        if f.rrf_k == 0
            || f.candidates == 0
            || !positive(f.dense_weight)
            || !positive(f.sparse_weight)
        {
            return invalid(
                "retrieval.fusion",
                format!(
                    "rrf_k and candidates must be at least 1 and both weights above 0, got rrf_k = {}, candidates = {}, dense_weight = {}, sparse_weight = {}",
                    f.rrf_k, f.candidates, f.dense_weight, f.sparse_weight
                ),
            );
        }
        if let Some(l) = f.mmr_lambda {
            if !(0.0..=1.0).contains(&l) {
                return invalid(
                    "retrieval.fusion.mmr_lambda",
                    format!("must be between 0 (diversity only) and 1 (relevance only), got {l}"),
                );
            }
        }
        let ef = self.ann.ef;
        if !(1..=MAX_EF).contains(&ef) {
            return invalid(
                "retrieval.ann.ef",
                format!("must be between 1 and {MAX_EF}, got {ef} (retrieval.ann.exact = true searches every vector)"),
            );
        }
        if self.neighbors > MAX_NEIGHBORS {
            return invalid(
                "retrieval.neighbors",
                format!("must be at most {MAX_NEIGHBORS}, got {}", self.neighbors),
            );
        }
        if !(0.0..=1.0).contains(&self.min_support) {
            return invalid(
                "retrieval.min_support",
                format!("is a score between 0 (off) and 1, got {}", self.min_support),
            );
        }
        if !(0.0..=2.0).contains(&self.term_weight) {
            return invalid(
                "retrieval.term_weight",
                format!(
                    "is a weight between 0 (cosine only) and 2, got {}",
                    self.term_weight
                ),
            );
        }
        let most = 1.0 + self.term_weight;
        if !(-1.0..=most).contains(&self.min_score) {
            return invalid(
                "retrieval.min_score",
                format!(
                    "is a refusal score (cosine similarity + term_weight × term share) and must be between -1 and {most}, got {}",
                    self.min_score
                ),
            );
        }
        if self.top_k == 0 || self.top_k > self.max_top_k {
            return invalid(
                "retrieval.top_k",
                format!(
                    "must be between 1 and retrieval.max_top_k ({}), got {}",
                    self.max_top_k, self.top_k
                ),
            );
        }
        Ok(())
    }
}

impl ServerConfig {
    /// Body and question limits, upload types, timeouts and CORS origins.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes < 256 || self.max_question_chars == 0 {
            return invalid(
                "server.max_body_bytes",
                "server.max_body_bytes must be at least 256 and server.max_question_chars at least 1".into(),
            );
        }
        let supported = docent_ingest::load::SUPPORTED_EXTENSIONS;
        if let Some((ext, _)) = self
            .upload_limits
            .iter()
            .find(|(ext, _)| !supported.contains(&ext.as_str()))
        {
            return invalid(
                "server.upload_limits",
                format!(
                    "unknown file type {ext:?}: use one of {}",
                    supported.join(", ")
                ),
            );
        }
        if self.request_timeout_s == 0 || self.max_in_flight == 0 {
            return invalid(
                "server.request_timeout_s",
                "server.request_timeout_s and server.max_in_flight must be at least 1".into(),
            );
        }
        if let Some(o) = self
            .cors_origins
            .iter()
            .find(|o| o.as_str() != "*" && !(o.starts_with("http://") || o.starts_with("https://")))
        {
            return invalid(
                "server.cors_origins",
                format!("{o:?} is not an origin: use http(s)://host[:port], or \"*\""),
            );
        }
        Ok(())
    }
}
