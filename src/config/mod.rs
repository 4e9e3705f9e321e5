//! One typed configuration: built-in defaults, then `docent.toml` (or `--config FILE`),
//! then `DOCENT_*` environment variables (`__` separates sections:
//! `DOCENT_GENERATION__MAX_TOKENS=128`, `DOCENT_DATA_DIR=/srv/docent`).
//! Validated once at start-up, with messages that say what to fix.
//! Relative paths are relative to the working directory.
//!
//! Here: [`Config`], its loading and its checks across sections. Each section's type and
//! checks are in `auth`, `store`, `sections` (server, citations, embedding, chunking,
//! ingest, retrieval, prompts) and `generation` (the checks of the generate stage's
//! settings).

mod auth;
mod generation;
mod sections;
mod store;

pub use auth::*;
pub use sections::*;
pub use store::*;

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// The default config file, read when present in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "docent.toml";
const SETUP_HINT: &str = "run `make setup` to fetch the models";
/// Largest `retrieval.ann.ef`: a wider beam costs more than a scan of most indexes.
const MAX_EF: usize = 4096;

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or environment could not be read into a [`Config`] (a missing file, bad
    /// TOML, an unknown key, a wrong type).
    #[error("configuration: {0}")]
    Parse(String),
    /// A value is out of range or a required file is missing.
    #[error("configuration: {field}: {message}")]
    Invalid {
        /// The setting, as a dotted path such as `chunking.max_tokens`.
        field: &'static str,
        /// What is wrong and what to do about it.
        message: String,
    },
}

use crate::query::generate::{
    default_isa, default_kernels, default_kv_cache, default_max_queue, default_prefill_chunk,
    default_prefix_cache_mib, yes,
};
pub use crate::query::generate::{DraftConfig, GenerationConfig};
pub use crate::query::retrieve::MAX_NEIGHBORS;

/// The whole configuration: one field per section of `docent.toml`. Unknown keys are
/// refused; [`Config::default`] holds the built-in defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the embedded index lives (`store.kind = "edge"`).
    pub data_dir: PathBuf,
    /// `[store]`: the embedded index or a Qdrant server.
    #[serde(default)]
    pub store: StoreConfig,
    /// `[server]`: the HTTP server's address, limits and log format.
    pub server: ServerConfig,
    /// `[embedding]`: the embedding model and how it runs.
    pub embedding: EmbeddingConfig,
    /// `[chunking]`: how documents are split into chunks.
    pub chunking: ChunkingConfig,
    /// `[ingest]`: the ingest pipeline's workers and batching.
    pub ingest: IngestConfig,
    /// `[retrieval]`: how chunks are searched and ranked.
    pub retrieval: RetrievalConfig,
    /// `[generation]`: the generation model and its sampling defaults and limits.
    pub generation: GenerationConfig,
    /// `[prompts]`: where the prompt templates are.
    pub prompts: PromptsConfig,
    /// `[safety]`: the safety filter around the query path.
    #[serde(default)]
    pub safety: crate::query::safety::SafetyConfig,
    /// `[citations]`: how citations are checked and attributed.
    #[serde(default)]
    pub citations: CitationsConfig,
    /// `[auth]`: API keys and rate limits.
    #[serde(default)]
    pub auth: AuthConfig,
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
        generation::Checks(&self.generation).validate()?;
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
