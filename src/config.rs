//! One typed configuration: built-in defaults, then `docent.toml` (or `--config FILE`),
//! then `DOCENT_*` environment variables (`__` separates sections:
//! `DOCENT_GENERATION__MAX_TOKENS=128`, `DOCENT_DATA_DIR=/srv/docent`).
//! Validated once at start-up, with messages that say what to fix.
//! Relative paths are relative to the working directory.

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// The default config file, read when present in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "docent.toml";
const SETUP_HINT: &str = "run `make setup` to fetch the models";
/// Largest `retrieval.ann.ef`: a wider beam costs more than a scan of most indexes.
const MAX_EF: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Parse(String),
    #[error("configuration: {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

use crate::query::generate::{
    default_isa, default_kernels, default_kv_cache, default_max_queue, default_prefill_chunk,
    default_prefix_cache_mib, yes,
};
pub use crate::query::generate::{DraftConfig, GenerationConfig};
pub use crate::query::retrieve::MAX_NEIGHBORS;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the embedded index lives (`store.kind = "edge"`).
    pub data_dir: PathBuf,
    #[serde(default)]
    pub store: StoreConfig,
    pub server: ServerConfig,
    pub embedding: EmbeddingConfig,
    pub chunking: ChunkingConfig,
    pub ingest: IngestConfig,
    pub retrieval: RetrievalConfig,
    pub generation: GenerationConfig,
    pub prompts: PromptsConfig,
    #[serde(default)]
    pub safety: crate::query::safety::SafetyConfig,
    #[serde(default)]
    pub citations: CitationsConfig,
    #[serde(default)]
    pub auth: AuthConfig,
}

/// What an API key may do. `write` includes everything `read` allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Query, search, list documents and jobs, metrics.
    Read,
    /// Upload and delete documents, and everything `read` allows.
    Write,
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Scope, String> {
        match s {
            "read" => Ok(Scope::Read),
            "write" => Ok(Scope::Write),
            other => Err(format!("unknown scope {other:?}: use read or write")),
        }
    }
}

/// One API key, stored as the SHA-256 of the key (`docent keys new` prints both).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// A label for logs and metrics (never the key).
    pub name: String,
    pub scope: Scope,
    /// `sha256:` and 64 hex digits.
    pub hash: String,
}

/// The stored form of a key: `sha256:<hex>`.
pub fn hash_key(key: &str) -> String {
    use sha2::Digest;
    format!(
        "sha256:{}",
        hex::encode(sha2::Sha256::digest(key.as_bytes()))
    )
}

/// Shortest key accepted from `DOCENT_API_KEYS`.
pub const MIN_KEY_CHARS: usize = 16;

/// `[auth]`: who may call the API. Whenever keys are configured every `/v1` route and
/// `/metrics` need one (`Authorization: Bearer <key>`); `/healthz` and `/readyz` never do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// `false` turns authentication off altogether (a warning at start). With it on and
    /// no keys, the server only listens on loopback addresses.
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub keys: Vec<ApiKey>,
    /// Requests per minute per key (a server without keys has no rate limit); 0 = unlimited.
    #[serde(default = "default_rate_per_minute")]
    pub rate_per_minute: u32,
    /// Requests a key may send at once above the steady rate.
    #[serde(default = "default_burst")]
    pub burst: u32,
}

fn default_rate_per_minute() -> u32 {
    600
}
fn default_burst() -> u32 {
    60
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            enabled: true,
            keys: vec![],
            rate_per_minute: default_rate_per_minute(),
            burst: default_burst(),
        }
    }
}

impl AuthConfig {
    /// Keys from `DOCENT_API_KEYS` (`key:scope` pairs, comma-separated; development),
    /// hashed on arrival.
    pub fn add_env_keys(&mut self, raw: &str) -> Result<(), ConfigError> {
        for (i, pair) in raw
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .enumerate()
        {
            let (key, scope) = pair.rsplit_once(':').ok_or_else(|| ConfigError::Invalid {
                field: "DOCENT_API_KEYS",
                message: format!("entry {} is not key:scope (scope read or write)", i + 1),
            })?;
            let scope: Scope = scope.parse().map_err(|message| ConfigError::Invalid {
                field: "DOCENT_API_KEYS",
                message: format!("entry {}: {message}", i + 1),
            })?;
            if key.chars().count() < MIN_KEY_CHARS || key.chars().any(char::is_whitespace) {
                return Err(ConfigError::Invalid {
                    field: "DOCENT_API_KEYS",
                    message: format!(
                        "entry {}: a key needs at least {MIN_KEY_CHARS} characters and no spaces (`docent keys new` makes one)",
                        i + 1
                    ),
                });
            }
            self.keys.push(ApiKey {
                name: format!("env-{}", i + 1),
                scope,
                hash: hash_key(key),
            });
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for k in &self.keys {
            let hex = k.hash.strip_prefix("sha256:").unwrap_or("");
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ConfigError::Invalid {
                    field: "auth.keys",
                    message: format!(
                        "key {:?}: hash must be sha256: and 64 hex digits (from `docent keys new`)",
                        k.name
                    ),
                });
            }
        }
        if self.rate_per_minute > 0 && self.burst == 0 {
            return Err(ConfigError::Invalid {
                field: "auth.burst",
                message: "must be at least 1 when auth.rate_per_minute is set".into(),
            });
        }
        Ok(())
    }
}

/// Which engine holds the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// Qdrant's embedded engine in `data_dir` (one process opens it at a time).
    #[default]
    Edge,
    /// A Qdrant server or cluster (any number of docent replicas share it).
    Qdrant,
}

/// `[store]`: where chunks and the document catalog live.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// The server's gRPC URL (`kind = "qdrant"`): `http://host:6334`, or `https://` for TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Sent as the `api-key` header (`DOCENT_STORE__API_KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Collection of the chunks; the catalog is `<collection>_catalog`.
    pub collection: String,
    /// Per-request timeout against the server, seconds.
    pub timeout_s: u64,
    /// On a shared store (`kind = "qdrant"`): an ingest whose writer has not written for
    /// this long is taken for a dead replica's and rolled back by the others, which look
    /// every quarter of it (at most every minute). Longer than the slowest batch write.
    pub stale_after_s: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            kind: StoreKind::Edge,
            url: None,
            api_key: None,
            collection: "docent".into(),
            timeout_s: 10,
            stale_after_s: docent_ingest::store::STALE_AFTER_SECS,
        }
    }
}

impl StoreConfig {
    /// How long an unfinished write on a shared store may go untouched.
    pub fn stale_after(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.stale_after_s)
    }

    /// The index's location under this configuration (`data_dir` for the embedded one).
    pub fn location<'a>(&self, data_dir: &'a Path) -> docent_ingest::store::Location<'a> {
        match self.kind {
            StoreKind::Edge => docent_ingest::store::Location::Edge { dir: data_dir },
            StoreKind::Qdrant => docent_ingest::store::Location::Qdrant(
                docent_ingest::store::qdrant::QdrantOptions {
                    url: self.url.clone().unwrap_or_default(),
                    api_key: self.api_key.clone().filter(|k| !k.is_empty()),
                    collection: self.collection.clone(),
                    timeout: std::time::Duration::from_secs(self.timeout_s.max(1)),
                },
            ),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, message: String| Err(ConfigError::Invalid { field, message });
        if self.kind == StoreKind::Qdrant {
            let url = self.url.as_deref().unwrap_or("");
            if url.is_empty() {
                return invalid(
                    "store.url",
                    "is required with store.kind = \"qdrant\": the server's gRPC URL, e.g. http://localhost:6334 (DOCENT_STORE__URL)".into(),
                );
            }
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return invalid(
                    "store.url",
                    format!("must start with http:// or https:// (TLS), got {url:?}"),
                );
            }
            if url.trim_end_matches('/').ends_with(":6333") {
                return invalid(
                    "store.url",
                    format!("{url} is Qdrant's REST port; docent speaks gRPC, usually port 6334"),
                );
            }
        } else if self.url.is_some() {
            return invalid(
                "store.url",
                "is set but store.kind is \"edge\" (the embedded engine in data_dir); set store.kind = \"qdrant\" to use the server".into(),
            );
        }
        let valid_name = !self.collection.is_empty()
            && self.collection.len() <= 200
            && self
                .collection
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid_name {
            return invalid(
                "store.collection",
                format!(
                    "must be 1-200 letters, digits, '_' or '-', got {:?}",
                    self.collection
                ),
            );
        }
        if self.timeout_s == 0 {
            return invalid("store.timeout_s", "must be at least 1".into());
        }
        if self.stale_after_s == 0 {
            return invalid(
                "store.stale_after_s",
                "must be at least 1 (seconds without a write before another replica rolls an ingest back)".into(),
            );
        }
        Ok(())
    }
}

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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

fn default_request_timeout_s() -> u64 {
    120
}
fn default_max_in_flight() -> usize {
    256
}
fn default_shutdown_timeout_s() -> u64 {
    30
}

fn default_keep_alive_ms() -> u64 {
    15_000
}

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
    pub threads: usize,
    pub batch_size: usize,
    /// BM25 document weighting (`k1`, `b`, `avg_len` in BM25 tokens); changing it
    /// re-embeds documents on their next ingest.
    #[serde(default)]
    pub bm25: docent_ingest::embed::Bm25Settings,
}

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
    pub top_k: usize,
    /// Largest `top_k` a request may ask for.
    pub max_top_k: usize,
    /// Neighbour expansion: chunks before and after each hit joined into its context.
    #[serde(default)]
    pub neighbors: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptsConfig {
    /// Directory of minijinja templates.
    pub dir: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        let ort = std::env::var_os("ORT_DYLIB_PATH")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| "models/onnxruntime/libonnxruntime.so".into());
        Config {
            data_dir: "data".into(),
            server: ServerConfig {
                bind: "127.0.0.1:8080".into(),
                max_body_bytes: 64 * 1024,
                max_question_chars: 2000,
                max_upload_bytes: 64 << 20,
                keep_alive_ms: default_keep_alive_ms(),
                upload_limits: Default::default(),
                request_timeout_s: default_request_timeout_s(),
                max_in_flight: default_max_in_flight(),
                shutdown_timeout_s: default_shutdown_timeout_s(),
                cors_origins: vec![],
                log_format: LogFormat::Text,
            },
            embedding: EmbeddingConfig {
                model_dir: "models/all-MiniLM-L6-v2".into(),
                ort_library: ort,
                max_length: 256,
                threads: 2,
                batch_size: 8,
                bm25: Default::default(),
            },
            chunking: ChunkingConfig {
                max_tokens: 200,
                overlap: 24,
                headers: Default::default(),
            },
            ingest: IngestConfig {
                workers: 0,
                queue_depth: 2,
                flush_every: 4096,
            },
            retrieval: RetrievalConfig {
                mode: docent_ingest::store::SearchMode::Hybrid,
                min_score: 0.3,
                term_weight: 0.0,
                min_support: 0.0,
                fusion: docent_ingest::store::Fusion::default(),
                ann: docent_ingest::store::Ann::default(),
                top_k: 3,
                max_top_k: 20,
                neighbors: 0,
            },
            generation: GenerationConfig {
                model: crate::query::generate::catalog::DEFAULT_MODEL.into(),
                isq: None,
                uqff: None,
                draft: None,
                lookup_tokens: crate::query::generate::default_lookup_tokens(),
                dtype: "f32".into(),
                device: "cpu".into(),
                max_tokens: 256,
                max_tokens_limit: 1024,
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                repetition_penalty: 1.0,
                dry_multiplier: 0.0,
                dry_allowed_length: 2,
                max_num_seqs: 8,
                context_tokens: 0,
                prefix_cache: true,
                prefix_cache_mib: default_prefix_cache_mib(),
                threads: 0,
                kernels: default_kernels(),
                isa: default_isa(),
                kv_cache: default_kv_cache(),
                repack: true,
                continuous_batching: true,
                prefill_chunk_tokens: default_prefill_chunk(),
                passage_reuse: Default::default(),
                passage_cache_mib: crate::query::generate::default_passage_cache_mib(),
                passage_disk_mib: crate::query::generate::default_passage_disk_mib(),
                passage_precompute: true,
                passage_recompute_tokens: crate::query::generate::default_passage_recompute_tokens(
                ),
                passage_key_scale: crate::query::generate::default_passage_key_scale(),
                schedule: Default::default(),
                max_queue: default_max_queue(),
                cache_size: crate::query::generate::default_cache_size(),
                answer_mode: crate::query::AnswerMode::Generative,
                refusal_phrase: crate::query::generate::default_refusal_phrase(),
                refusal_threshold: crate::query::generate::default_refusal_threshold(),
                refusal_check: Default::default(),
                refusal_check_old: None,
                refusal_probe: None,
                refusal_probe_threshold: None,
                lead_with_marker: true,
            },
            prompts: PromptsConfig {
                dir: "prompts".into(),
            },
            safety: crate::query::safety::SafetyConfig::default(),
            citations: CitationsConfig::default(),
            store: StoreConfig::default(),
            auth: AuthConfig::default(),
        }
    }
}

impl Config {
    /// The query path's defaults and limits under this configuration.
    pub fn limits(&self) -> crate::query::Limits {
        let c = self;
        crate::query::Limits {
            default_mode: c.retrieval.mode,
            min_score: c.retrieval.min_score,
            term_weight: c.retrieval.term_weight,
            min_support: c.retrieval.min_support,
            default_top_k: c.retrieval.top_k,
            max_top_k: c.retrieval.max_top_k,
            default_neighbors: c.retrieval.neighbors,
            default_max_tokens: c.generation.max_tokens,
            max_tokens: c.generation.max_tokens_limit,
            default_temperature: c.generation.temperature,
            default_top_p: c.generation.top_p,
            default_top_k_tokens: c.generation.top_k,
            default_repetition_penalty: c.generation.repetition_penalty,
            default_dry_multiplier: c.generation.dry_multiplier,
            dry_allowed_length: c.generation.dry_allowed_length,
            max_question_chars: c.server.max_question_chars,
            keep_alive: std::time::Duration::from_millis(c.server.keep_alive_ms.max(1)),
            default_answer_mode: c.generation.answer_mode,
            draft_model: c.generation.draft.is_some(),
            default_lookup_tokens: c.generation.lookup_tokens,
            refusal_phrase: c.generation.refusal_phrase.trim().to_string(),
            attribution: c
                .citations
                .fallback
                .then_some(crate::query::postprocess::Attribution {
                    add_at: c.citations.add_at,
                    drop_below: c.citations.drop_below,
                    unsupported_below: c.citations.unsupported_below,
                }),
        }
    }

    /// Defaults ← `file` (or `docent.toml` if present) ← `DOCENT_*` environment.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        match file {
            Some(f) if !f.is_file() => {
                return Err(ConfigError::Parse(format!(
                    "config file {} does not exist",
                    f.display()
                )))
            }
            Some(f) => fig = fig.merge(Toml::file(f)),
            None => fig = fig.merge(Toml::file(DEFAULT_CONFIG_FILE)),
        }
        // DOCENT_MODELS_DIR and DOCENT_SHARED_DIR belong to the setup script and the tests.
        fig = fig.merge(
            Env::prefixed("DOCENT_")
                .ignore(&["models_dir", "shared_dir", "api_keys"])
                .split("__"),
        );
        let mut config: Config = fig
            .extract()
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        if let Ok(raw) = std::env::var("DOCENT_API_KEYS") {
            config.auth.add_env_keys(&raw)?;
        }
        if let Some(check) = config.generation.refusal_check_old.take() {
            config.generation.refusal_check = check;
        }
        config.validate()?;
        Ok(config)
    }

    /// `generation.refusal_probe` and its threshold, when set.
    fn validate_refusal_probe(&self) -> Result<(), ConfigError> {
        if let Some(t) = self.generation.refusal_probe_threshold {
            if !(t > 0.0 && t <= 1.0) {
                return Err(ConfigError::Invalid { field: "generation.refusal_probe_threshold",
                    message: format!("is a probability above 0 and at most 1 (the probe's own, from its file, when unset), got {t}"),
                });
            }
        }
        if let Some(p) = &self.generation.refusal_probe {
            if let Err(e) = crate::query::generate::probe::Probe::read(p) {
                return Err(ConfigError::Invalid { field: "generation.refusal_probe",
                    message: format!("{e}; name a file written by `docent train-refusal`, or unset it for the probe docent ships"),
                });
            }
        }
        Ok(())
    }

    /// Checks values that do not need files: each section's own, then the ones that span
    /// sections.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.store.validate()?;
        self.auth.validate()?;
        self.embedding.validate()?;
        let limit = self.embedding.max_length - 2;
        if self.chunking.max_tokens == 0 || self.chunking.max_tokens > limit {
            return invalid(
                "chunking.max_tokens",
                format!("must be between 1 and {limit} (embedding.max_length minus 2 special tokens), got {}", self.chunking.max_tokens),
            );
        }
        if self.chunking.overlap >= self.chunking.max_tokens {
            return invalid(
                "chunking.overlap",
                format!(
                    "must be smaller than chunking.max_tokens ({}), got {}",
                    self.chunking.max_tokens, self.chunking.overlap
                ),
            );
        }
        self.retrieval.validate()?;
        if self.ingest.queue_depth == 0 || self.ingest.flush_every == 0 {
            return invalid(
                "ingest.queue_depth",
                "ingest.queue_depth and ingest.flush_every must be at least 1".into(),
            );
        }
        self.server.validate()?;
        self.generation.validate()?;
        self.validate_refusal_probe()?;
        if let Err(e) = self.safety.check() {
            return invalid("safety.deny", e);
        }
        Ok(())
    }

    /// The embedding model and ONNX Runtime must exist (ingest and query).
    pub fn check_embedding_files(&self) -> Result<(), ConfigError> {
        must_exist(
            "embedding.ort_library",
            &self.embedding.ort_library,
            SETUP_HINT,
        )?;
        for f in docent_ingest::embed::MODEL_FILES {
            must_exist(
                "embedding.model_dir",
                &self.embedding.model_dir.join(f),
                SETUP_HINT,
            )?;
        }
        Ok(())
    }

    /// The generation model and the prompt templates must exist (query).
    pub fn check_generation_files(&self) -> Result<(), ConfigError> {
        use crate::query::generate::catalog;
        let hint = |model: &Path| {
            model
                .to_str()
                .and_then(catalog::find)
                .map_or_else(|| SETUP_HINT.to_string(), |m| m.setup_hint())
        };
        let model = &self.generation.model;
        must_exist("generation.model", &catalog::resolve(model), &hint(model))?;
        if let Some(draft) = &self.generation.draft {
            must_exist(
                "generation.draft.model",
                &catalog::resolve(&draft.model),
                &hint(&draft.model),
            )?;
        }
        for t in crate::query::prompt::TEMPLATES {
            must_exist(
                "prompts.dir",
                &self.prompts.dir.join(t),
                "point prompts.dir at docent's prompts/ directory",
            )?;
        }
        Ok(())
    }
}

/// The configuration error for `field`, saying what to fix.
fn invalid(field: &'static str, message: String) -> Result<(), ConfigError> {
    Err(ConfigError::Invalid { field, message })
}

impl EmbeddingConfig {
    /// Token limits, threads, batch size and BM25's parameters.
    fn validate(&self) -> Result<(), ConfigError> {
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
    fn validate(&self) -> Result<(), ConfigError> {
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
    fn validate(&self) -> Result<(), ConfigError> {
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

impl GenerationConfig {
    /// The engine's settings, sampling, passage reuse, the models and the refusal.
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_engine()?;
        self.validate_sampling()?;
        self.validate_passage_reuse()?;
        self.validate_models()?;
        self.validate_refusal()
    }

    /// dtype, device, kernels, instruction set, KV cache, prefill chunks, threads, queue.
    fn validate_engine(&self) -> Result<(), ConfigError> {
        use crate::query::generate::device::{DeviceChoice, CUDA_BUILT};
        if !["f32", "f16", "bf16", "auto"].contains(&self.dtype.as_str()) {
            return invalid(
                "generation.dtype",
                format!("must be one of f32, f16, bf16, auto, got {:?}", self.dtype),
            );
        }
        match self.device.parse::<DeviceChoice>() {
            Err(e) => return invalid("generation.device", e),
            Ok(DeviceChoice::Cuda(_)) if !CUDA_BUILT => {
                return invalid(
                    "generation.device",
                    "this binary was built without CUDA: build with `--features cuda` \
                     (scripts/cuda-toolkit.sh), or use cpu or auto"
                        .into(),
                );
            }
            Ok(_) => {}
        }
        if !["docent", "candle"].contains(&self.kernels.as_str()) {
            return invalid(
                "generation.kernels",
                format!("must be docent or candle, got {:?}", self.kernels),
            );
        }
        if !["auto", "avx512", "avx2", "scalar"].contains(&self.isa.as_str()) {
            return invalid(
                "generation.isa",
                format!("must be auto, avx512, avx2 or scalar, got {:?}", self.isa),
            );
        }
        if !["f32", "f16"].contains(&self.kv_cache.as_str()) {
            return invalid(
                "generation.kv_cache",
                format!("must be f32 or f16, got {:?}", self.kv_cache),
            );
        }
        if self.prefill_chunk_tokens != 0 && !(16..=65_536).contains(&self.prefill_chunk_tokens) {
            return invalid(
                "generation.prefill_chunk_tokens",
                format!(
                    "must be 0 (off) or between 16 and 65536, got {}",
                    self.prefill_chunk_tokens
                ),
            );
        }
        if self.threads > 1024 {
            return invalid(
                "generation.threads",
                format!("must be 0 (one per core) to 1024, got {}", self.threads),
            );
        }
        if self.max_queue == 0 {
            return invalid("generation.max_queue", "must be at least 1".into());
        }
        Ok(())
    }

    /// Answer mode, temperature, top_p, penalties and token limits.
    fn validate_sampling(&self) -> Result<(), ConfigError> {
        if !matches!(
            self.answer_mode,
            crate::query::AnswerMode::Generative | crate::query::AnswerMode::Extractive
        ) {
            return invalid(
                "generation.answer_mode",
                format!(
                    "must be generative or extractive, got {:?}",
                    self.answer_mode
                ),
            );
        }
        if !(0.0..=2.0).contains(&self.temperature) {
            return invalid(
                "generation.temperature",
                format!("must be in 0..=2, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(
                "generation.top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            );
        }
        if !(0.5..=2.0).contains(&self.repetition_penalty) {
            return invalid(
                "generation.repetition_penalty",
                format!("must be in 0.5..=2, got {}", self.repetition_penalty),
            );
        }
        if !(0.0..=5.0).contains(&self.dry_multiplier) {
            return invalid(
                "generation.dry_multiplier",
                format!("must be in 0..=5 (0 is off), got {}", self.dry_multiplier),
            );
        }
        if self.max_tokens > self.max_tokens_limit {
            return invalid(
                "generation.max_tokens",
                format!(
                    "must not exceed generation.max_tokens_limit ({}), got {}",
                    self.max_tokens_limit, self.max_tokens
                ),
            );
        }
        if self.max_tokens == 0 || self.max_num_seqs == 0 {
            return invalid(
                "generation.max_tokens",
                "generation.max_tokens and generation.max_num_seqs must be at least 1".into(),
            );
        }
        Ok(())
    }

    /// The placed keys' scale and the memory bound, when passage reuse is on. (With a
    /// draft model or without continuous batching reuse is off with a warning, not an
    /// error: it is on by default; see `query::generate::passage_cache`.)
    fn validate_passage_reuse(&self) -> Result<(), ConfigError> {
        if self.passage_reuse == crate::query::generate::reuse::PassageReuse::Off {
            return Ok(());
        }
        let scale = self.passage_key_scale;
        if !(scale.is_finite() && scale > 0.0 && scale <= 4.0) {
            return invalid(
                "generation.passage_key_scale",
                format!(
                    "must be above 0 and at most 4 (1 leaves placed keys as they are), not {scale}"
                ),
            );
        }
        if self.passage_cache_mib == 0 {
            return invalid(
                "generation.passage_cache_mib",
                "must be at least 1 with generation.passage_reuse on".to_string(),
            );
        }
        Ok(())
    }

    /// In-place quantization, UQFF, the model names, prompt lookup and the draft model.
    fn validate_models(&self) -> Result<(), ConfigError> {
        use crate::query::generate::catalog;
        if let Some(isq) = &self.isq {
            if mistralrs::core::parse_isq_value(isq, None).is_err() {
                return invalid(
                    "generation.isq",
                    format!("unknown quantization {isq:?}; use q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k or q8k"),
                );
            }
        }
        if self.uqff.is_some() && self.isq.is_none() {
            return invalid(
                "generation.uqff",
                "needs generation.isq (the quantization to write)".into(),
            );
        }
        let models = [
            ("generation.model", Some(&self.model)),
            (
                "generation.draft.model",
                self.draft.as_ref().map(|d| &d.model),
            ),
        ];
        for (field, model) in models {
            let Some(model) = model else { continue };
            let name = model.to_string_lossy();
            if catalog::looks_like_name(model) && catalog::find(&name).is_none() {
                let known: Vec<&str> = catalog::known().iter().map(|m| m.name.as_str()).collect();
                return invalid(
                    field,
                    format!(
                        "{name:?} is neither a known model ({}; `docent models` lists them) nor an existing file; give a name or the path of a GGUF file",
                        known.join(", ")
                    ),
                );
            }
        }
        let lookup_max = crate::query::generate::lookup::MAX_DRAFT_TOKENS;
        if self.lookup_tokens > lookup_max {
            return invalid(
                "generation.lookup_tokens",
                format!(
                    "must be between 0 (off) and {lookup_max}, got {}",
                    self.lookup_tokens
                ),
            );
        }
        if self.draft.is_some() && self.lookup_tokens > 0 {
            return invalid(
                "generation.lookup_tokens",
                "prompt-lookup drafts and a draft model (generation.draft) are alternatives: set generation.lookup_tokens = 0 or remove generation.draft".into(),
            );
        }
        if let Some(draft) = &self.draft {
            if !(1..=16).contains(&draft.gamma) {
                return invalid(
                    "generation.draft.gamma",
                    format!("must be between 1 and 16, got {}", draft.gamma),
                );
            }
            if self.temperature != 0.0 {
                return invalid(
                    "generation.temperature",
                    "speculative decoding (generation.draft) is greedy only in mistral.rs: set temperature = 0".into(),
                );
            }
        }
        Ok(())
    }

    /// The refusal threshold, and the question check's need of a refusal phrase.
    fn validate_refusal(&self) -> Result<(), ConfigError> {
        let t = self.refusal_threshold;
        if !(t > 0.0 && t <= 1.0) {
            return invalid(
                "generation.refusal_threshold",
                format!("is a probability above 0 and at most 1 (1: refuse only when the model writes the refusal phrase), got {t}"),
            );
        }
        if self.refusal_check == crate::query::generate::RefusalCheck::Question
            && self.refusal_phrase.trim().is_empty()
        {
            return invalid(
                "generation.refusal",
                "\"question\" asks the model whether the passages hold the answer, which is off when generation.refusal_phrase is empty; set a refusal phrase or use \"first_token\"".to_string(),
            );
        }
        Ok(())
    }
}

fn must_exist(field: &'static str, path: &Path, hint: &str) -> Result<(), ConfigError> {
    if path.exists() {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field,
            message: format!("{} does not exist; {hint}", path.display()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn the_generation_device_is_checked_at_start_up() {
        let with = |device: &str| {
            let mut c = Config::default();
            c.generation.device = device.into();
            c.validate().map_err(|e| e.to_string())
        };
        assert!(with("cpu").is_ok());
        assert!(with("auto").is_ok());
        let err = with("gpu0").unwrap_err();
        assert!(
            err.contains("generation.device") && err.contains("cuda:N"),
            "{err}"
        );
        let cuda = with("cuda:1");
        if crate::query::generate::device::CUDA_BUILT {
            assert!(cuda.is_ok(), "{cuda:?}");
        } else {
            let err = cuda.unwrap_err();
            assert!(err.contains("built without CUDA"), "{err}");
        }
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure signature
    fn file_and_env_override_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "data_dir = \"/srv/x\"\n[retrieval]\ntop_k = 7\n").unwrap();
        figment::Jail::expect_with(|jail| {
            jail.set_env("DOCENT_GENERATION__MAX_TOKENS", "64");
            jail.set_env("DOCENT_SHARED_DIR", "/elsewhere");
            jail.set_env("DOCENT_MODELS_DIR", "/models");
            let c = Config::load(Some(&f)).map_err(|e| e.to_string())?;
            assert_eq!(c.data_dir, PathBuf::from("/srv/x"));
            assert_eq!(c.retrieval.top_k, 7);
            assert_eq!(c.generation.max_tokens, 64);
            assert_eq!(c.chunking.max_tokens, Config::default().chunking.max_tokens);
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure signature
    fn example_file_documents_the_defaults() {
        let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("docent.example.toml");
        figment::Jail::expect_with(|_| {
            let mut c = Config::load(Some(&f)).map_err(|e| e.to_string())?;
            let mut d = Config::default();
            c.embedding.ort_library = PathBuf::new();
            d.embedding.ort_library = PathBuf::new();
            assert_eq!(
                serde_json::to_value(&c).unwrap(),
                serde_json::to_value(&d).unwrap()
            );
            Ok(())
        });
    }

    #[test]
    fn bad_values_say_what_to_fix() {
        let mut c = Config::default();
        c.chunking.max_tokens = 300;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("chunking.max_tokens") && e.contains("254"),
            "{e}"
        );

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[retrieval]\ntopk = 7\n").unwrap();
        let e = Config::load(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("topk"), "{e}");
        let e = Config::load(Some(&dir.path().join("missing.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn the_search_beam_is_checked() {
        let mut c = Config::default();
        for ef in [0, MAX_EF + 1] {
            c.retrieval.ann.ef = ef;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("retrieval.ann.ef") && e.contains("4096"), "{e}");
        }
        c.retrieval.ann.ef = MAX_EF;
        c.validate().unwrap();
    }

    #[test]
    fn retrieval_weights_are_checked() {
        let mut c = Config::default();
        c.retrieval.term_weight = 3.0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("retrieval.term_weight"), "{e}");
        // with the terms in the signal, min_score may go above a cosine's 1
        let mut c = Config::default();
        c.retrieval.term_weight = 0.5;
        c.retrieval.min_score = 1.2;
        c.validate().unwrap();
        c.retrieval.min_score = 1.6;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("retrieval.min_score") && e.contains("1.5"),
            "{e}"
        );
        let mut c = Config::default();
        c.generation.passage_reuse = crate::query::generate::reuse::PassageReuse::Passages;
        c.validate().unwrap();
        c.generation.passage_key_scale = 0.0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("generation.passage_key_scale"), "{e}");
        c.generation.passage_key_scale = f32::NAN;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.embedding.bm25.b = 1.5;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("embedding.bm25.b"), "{e}");
        let mut c = Config::default();
        c.embedding.bm25.avg_len = f64::NAN;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("embedding.bm25.avg_len"), "{e}");
    }

    #[test]
    fn the_pre_question_needs_a_refusal_phrase() {
        let mut c = Config::default();
        c.generation.refusal_check = crate::query::generate::RefusalCheck::Question;
        c.validate().unwrap();
        c.generation.refusal_phrase = " ".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("generation.refusal") && e.contains("refusal_phrase"),
            "{e}"
        );
        // from TOML, by name
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[generation]\nrefusal_check = \"question\"\n").unwrap();
        let c = Config::load(Some(&f)).unwrap();
        assert_eq!(
            c.generation.refusal_check,
            crate::query::generate::RefusalCheck::Question
        );
        std::fs::write(&f, "[generation]\nrefusal_check = \"ask\"\n").unwrap();
        let e = Config::load(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("first_token") && e.contains("question"), "{e}"); // the setting's own name, and the default
        std::fs::write(&f, "[generation]\nrefusal = \"off\"\n").unwrap();
        let c = Config::load(Some(&f)).unwrap();
        assert_eq!(
            c.generation.refusal_check,
            crate::query::generate::RefusalCheck::Off
        );
        assert_eq!(
            Config::default().generation.refusal_check,
            crate::query::generate::RefusalCheck::Probe
        );
        std::fs::write(&f, "[generation]\nrefusal_probe_threshold = 1.5\n").unwrap();
        let e = Config::load(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("generation.refusal_probe_threshold"), "{e}");
        std::fs::write(
            &f,
            "[generation]\nrefusal_probe = \"/no/such/probe.json\"\n",
        )
        .unwrap();
        let e = Config::load(Some(&f)).unwrap_err().to_string();
        assert!(
            e.contains("generation.refusal_probe") && e.contains("train-refusal"),
            "{e}"
        );
    }

    #[test]
    fn prompt_lookup_settings_are_checked() {
        let mut c = Config::default();
        c.generation.lookup_tokens = 6;
        c.validate().unwrap();
        c.generation.lookup_tokens = 7;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("generation.lookup_tokens") && e.contains('6'),
            "{e}"
        );
        // a draft model with passage reuse on (the default): valid (reuse is then off, with
        // a warning, when the model loads)
        c.generation.lookup_tokens = 0;
        c.generation.draft = Some(DraftConfig {
            model: "draft.gguf".into(),
            gamma: 4,
        });
        c.validate().unwrap();
        // with a draft model: one kind of draft or the other
        c.generation.lookup_tokens = 4;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("generation.lookup_tokens") && e.contains("generation.draft"),
            "{e}"
        );
        c.generation.lookup_tokens = 0;
        c.validate().unwrap();
    }

    #[test]
    fn kernel_settings_are_checked() {
        let mut c = Config::default();
        c.generation.isa = "sse9".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("generation.isa") && e.contains("avx2"), "{e}");
        let mut c = Config::default();
        c.generation.kernels = "fast".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("generation.kernels"), "{e}");
    }

    #[test]
    fn missing_model_names_file_and_setup_command() {
        let mut c = Config::default();
        c.generation.model = "/nonexistent/m.gguf".into();
        let e = c.check_generation_files().unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/m.gguf") && e.contains("make setup"),
            "{e}"
        );
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure signature
    fn models_are_named_from_the_catalog() {
        // in a jail: an empty working directory, and the models directory inside it
        figment::Jail::expect_with(|jail| {
            jail.set_env("DOCENT_MODELS_DIR", "empty-models");
            let mut c = Config::default();
            // the default is a name, resolved in the models directory
            assert_eq!(
                c.generation.model,
                PathBuf::from(crate::query::generate::catalog::DEFAULT_MODEL)
            );
            c.validate().unwrap();
            c.generation.model = "qwen2.5-coder-0.5b".into();
            c.validate().unwrap();
            let e = c.check_generation_files().unwrap_err().to_string();
            assert!(
                e.contains(
                    "empty-models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
                ) && e.contains("make setup MODELS=\"qwen2.5-coder-0.5b\""),
                "{e}"
            );
            // a name that is not in the catalog says which ones are
            c.generation.model = "qwen2.5-coder-7b".into();
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.contains("generation.model") && e.contains("qwen2.5-coder-0.5b"),
                "{e}"
            );
            Ok(())
        });
    }
}

/// The query path's request validation against the limits this configuration gives
/// (here, not in `query`, so that `query` never depends on `config`).
#[cfg(test)]
mod query_limits_tests {
    use crate::query::*;

    fn limits() -> Limits {
        super::Config::default().limits()
    }

    #[test]
    fn defaults_come_from_config() {
        let q = QueryRequest {
            question: "  What is Cargo?  ".into(),
            ..Default::default()
        }
        .validate(&limits())
        .unwrap();
        assert_eq!(q.search.question, "What is Cargo?");
        assert_eq!(q.search.top_k, super::Config::default().retrieval.top_k);
        assert_eq!(q.search.neighbors, 0);
        assert_eq!((q.params.top_p, q.params.top_k), (1.0, 0));
        // a request's stop sequences come after the template's, once each
        let q: QueryRequest = serde_json::from_str(
            r#"{"question": "q", "generation": {"stop": ["END", "END", "<|im_end|>"], "top_k": 40}}"#,
        )
        .unwrap();
        let q = q.validate(&limits()).unwrap();
        assert_eq!(q.params.top_k, 40);
        let mut want: Vec<String> = DEFAULT_STOPS.iter().map(|s| s.to_string()).collect();
        want.push("END".into());
        assert_eq!(q.params.stop, want);
        assert_eq!(
            q.params.max_tokens,
            super::Config::default().generation.max_tokens
        );
        assert_eq!(q.params.temperature, 0.0);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let bad = [
            (r#"{"question": "  "}"#, "question"),
            (
                r#"{"question": "q", "retrieval": {"top_k": 0}}"#,
                "retrieval.top_k",
            ),
            (
                r#"{"question": "q", "retrieval": {"top_k": 999}}"#,
                "retrieval.top_k",
            ),
            (
                r#"{"question": "q", "generation": {"max_tokens": 0}}"#,
                "generation.max_tokens",
            ),
            (
                r#"{"question": "q", "generation": {"temperature": -1}}"#,
                "generation.temperature",
            ),
            (
                r#"{"question": "q", "generation": {"repetition_penalty": 9}}"#,
                "generation.repetition_penalty",
            ),
            (
                r#"{"question": "q", "history": [{"role": "user", "content": " "}]}"#,
                "history",
            ),
            (
                r#"{"question": "q", "generation": {"top_p": 0}}"#,
                "generation.top_p",
            ),
            (
                r#"{"question": "q", "generation": {"seed": 7}}"#,
                "generation.seed",
            ),
            (
                r#"{"question": "q", "generation": {"stop": [""]}}"#,
                "generation.stop",
            ),
            (
                r#"{"question": "q", "retrieval": {"neighbors": 6}}"#,
                "retrieval.neighbors",
            ),
        ];
        for (json, field) in bad {
            let r: QueryRequest = serde_json::from_str(json).unwrap();
            match r.validate(&limits()) {
                Err(QueryError::Invalid { field: f, .. }) => assert_eq!(f, field, "{json}"),
                other => panic!("{json}: {other:?}"),
            }
        }
        let long = QueryRequest {
            question: "x".repeat(5000),
            ..Default::default()
        };
        assert!(long.validate(&limits()).is_err());
        // prompt-lookup drafts: per request, within the limit, not beside a draft model
        let lookup = |n: usize| -> QueryRequest {
            serde_json::from_str(&format!(
                r#"{{"question": "q", "generation": {{"lookup_tokens": {n}}}}}"#
            ))
            .unwrap()
        };
        assert_eq!(
            lookup(3).validate(&limits()).unwrap().params.lookup_tokens,
            3
        );
        assert!(matches!(
            lookup(7).validate(&limits()),
            Err(QueryError::Invalid {
                field: "generation.lookup_tokens",
                ..
            })
        ));
        let mut drafting = limits();
        drafting.draft_model = true;
        assert!(lookup(3).validate(&drafting).is_err());
        assert_eq!(
            lookup(0).validate(&drafting).unwrap().params.lookup_tokens,
            0
        );
        let mut defaulted = limits();
        defaulted.default_lookup_tokens = 2;
        let plain: QueryRequest = serde_json::from_str(r#"{"question": "q"}"#).unwrap();
        assert_eq!(plain.validate(&defaulted).unwrap().params.lookup_tokens, 2);
        // with a draft model, sampling is refused instead of silently decoded greedily
        let mut speculative = limits();
        speculative.draft_model = true;
        let sampled: QueryRequest =
            serde_json::from_str(r#"{"question": "q", "generation": {"temperature": 0.7}}"#)
                .unwrap();
        assert!(matches!(
            sampled.validate(&speculative),
            Err(QueryError::Invalid {
                field: "generation.temperature",
                ..
            })
        ));
        let greedy: QueryRequest = serde_json::from_str(r#"{"question": "q"}"#).unwrap();
        assert!(
            greedy
                .clone()
                .validate(&speculative)
                .unwrap()
                .params
                .draft_model
        );
        // a request may leave the draft model out: then it may sample or look up drafts
        let plain_target = |extra: &str| -> QueryRequest {
            serde_json::from_str(&format!(
                r#"{{"question": "q", "generation": {{"draft_model": false{extra}}}}}"#
            ))
            .unwrap()
        };
        let p = plain_target(r#", "temperature": 0.7, "lookup_tokens": 3"#)
            .validate(&speculative)
            .unwrap()
            .params;
        assert!(!p.draft_model && p.lookup_tokens == 3 && p.temperature == 0.7);
        // asking for a draft model the server lacks is an error, not ignored
        let wants: QueryRequest =
            serde_json::from_str(r#"{"question": "q", "generation": {"draft_model": true}}"#)
                .unwrap();
        assert!(
            wants
                .clone()
                .validate(&speculative)
                .unwrap()
                .params
                .draft_model
        );
        assert!(matches!(
            wants.validate(&limits()),
            Err(QueryError::Invalid {
                field: "generation.draft_model",
                ..
            })
        ));
        assert!(
            !plain_target("")
                .validate(&limits())
                .unwrap()
                .params
                .draft_model,
            "no draft model on a plain server"
        );
        assert!(!greedy.validate(&limits()).unwrap().params.draft_model);
        assert!(serde_json::from_str::<QueryRequest>(r#"{"question": "q", "topk": 1}"#).is_err());
    }
}
