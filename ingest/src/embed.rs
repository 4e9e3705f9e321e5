//! Stage 3, **embed**: dense vectors from an ONNX sentence-embedding model (fastembed on
//! ONNX Runtime, loaded dynamically) and BM25 sparse vectors (qdrant-edge's embedder, the
//! same scheme Qdrant's server uses).
//!
//! ONNX Runtime is loaded from an explicit library path that is checked first: `ort`
//! panics when `dlopen` fails, so a missing library must be an error before any ORT call.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

pub use docent_store::{Embedding, SparseVector};
use fastembed::{
    InitOptionsUserDefined, Pooling, TextEmbedding, TokenizerFiles, UserDefinedEmbeddingModel,
};
use qdrant_edge::bm25_embed::{EdgeBm25, EdgeBm25Config};
use tokenizers::Tokenizer;

use crate::{Error, Result};

/// Files a model directory must hold.
pub const MODEL_FILES: &[&str] = &[
    "model.onnx",
    "tokenizer.json",
    "config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
];

/// Where the embedding model and ONNX Runtime live, and how to run them.
#[derive(Debug, Clone)]
pub struct EmbedderConfig {
    /// Directory with [`MODEL_FILES`] (an all-MiniLM-L6-v2 export by default).
    pub model_dir: PathBuf,
    /// `libonnxruntime.so` (>= 1.24).
    pub ort_library: PathBuf,
    /// Model input limit in tokens, special tokens included.
    pub max_length: usize,
    /// ONNX Runtime intra-op threads.
    pub threads: usize,
    /// Texts per ONNX run.
    pub batch_size: usize,
    /// BM25 document weighting of the sparse vectors.
    pub bm25: Bm25Settings,
}

/// BM25's document-side parameters (the engine applies IDF at query time). `avg_len` is
/// the length, in the BM25 tokenizer's tokens (stop words removed), at which a chunk is
/// neither favoured nor penalised for its length.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bm25Settings {
    /// Term-frequency saturation (1.2 is usual): how quickly repeats of a term stop adding.
    pub k1: f64,
    /// Length normalisation, 0 (none) to 1 (full; 0.75 is usual).
    pub b: f64,
    /// The neutral chunk length in BM25 tokens (see above).
    pub avg_len: f64,
}

impl Default for Bm25Settings {
    /// Qdrant's defaults.
    fn default() -> Self {
        Bm25Settings {
            k1: 1.2,
            b: 0.75,
            avg_len: 256.0,
        }
    }
}

/// Embeds texts. Cheap to share (`Arc`); the ONNX session runs one batch at a time.
pub struct Embedder {
    model: Mutex<TextEmbedding>,
    bm25: EdgeBm25,
    sizing_tokenizer: Arc<Tokenizer>,
    dim: usize,
    model_sha256: String,
    config: EmbedderConfig,
}

static ORT: OnceLock<std::result::Result<(PathBuf, ort::environment::Environment), String>> =
    OnceLock::new();

/// Loads ONNX Runtime from `path` once per process and creates its environment. Later
/// calls must name the same file.
pub fn init_onnx_runtime(path: &Path) -> Result<ort::environment::Environment> {
    if !path.is_file() {
        return Err(Error::OrtLibraryMissing {
            path: path.to_path_buf(),
        });
    }
    let loaded = ORT.get_or_init(|| {
        ort::init_from(path)
            .map_err(|e| e.to_string())
            .and_then(|builder| builder.build().map_err(|e| e.to_string()))
            .map(|env| (path.to_path_buf(), env))
    });
    match loaded {
        Ok((p, env)) if p == path => Ok(env.clone()),
        Ok((p, _)) => Err(Error::OrtLoad {
            path: path.to_path_buf(),
            message: format!(
                "ONNX Runtime is already loaded from {} in this process",
                p.display()
            ),
        }),
        Err(message) => Err(Error::OrtLoad {
            path: path.to_path_buf(),
            message: message.clone(),
        }),
    }
}

/// ONNX Runtime session settings shared by the embedder and the raw-session benchmark:
/// worker threads sleep instead of spinning when a run ends, so the other pipeline stages
/// get the CPU between batches.
pub const SESSION_CONFIG: &[(&str, &str)] = &[("session.intra_op.allow_spinning", "0")];

fn read_model_file(dir: &Path, name: &str) -> Result<Vec<u8>> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::ModelFileMissing {
            path,
            hint: "run `make setup` to fetch and export the embedding model".into(),
        },
        _ => Error::io(path, e),
    })
}

impl Embedder {
    /// Loads the ONNX model, its tokenizer and ONNX Runtime as `config` says; fails with a
    /// message that names the missing file.
    pub fn load(config: EmbedderConfig) -> Result<Self> {
        // Check every file before touching ONNX Runtime.
        let files: Vec<Vec<u8>> = MODEL_FILES
            .iter()
            .map(|f| read_model_file(&config.model_dir, f))
            .collect::<Result<_>>()?;
        let environment = init_onnx_runtime(&config.ort_library)?;
        let [onnx, tokenizer_file, config_file, special_tokens_map_file, tokenizer_config_file] =
            <[Vec<u8>; 5]>::try_from(files).map_err(|_| Error::Embed("model files".into()))?;
        let model_sha256 = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(&onnx))
        };

        let sizing = Tokenizer::from_bytes(&tokenizer_file)
            .map_err(|e| Error::Tokenizer(e.to_string()))
            .and_then(|mut t| {
                t.with_padding(None);
                t.with_truncation(None)
                    .map_err(|e| Error::Tokenizer(e.to_string()))?;
                Ok(t)
            })?;
        let model = UserDefinedEmbeddingModel::new(
            onnx,
            TokenizerFiles {
                tokenizer_file,
                config_file,
                special_tokens_map_file,
                tokenizer_config_file,
            },
        )
        .with_pooling(Pooling::Mean);
        let options = SESSION_CONFIG.iter().fold(
            InitOptionsUserDefined::new()
                .with_environment(environment)
                .with_max_length(config.max_length)
                .with_intra_threads(config.threads.max(1)),
            |o, (k, v)| o.with_session_config(*k, *v),
        );
        let mut model = TextEmbedding::try_new_from_user_defined(model, options)
            .map_err(|e| Error::Embed(e.to_string()))?;
        let dim = model
            .embed(["dimension probe"], None)
            .map_err(|e| Error::Embed(e.to_string()))?
            .first()
            .map(Vec::len)
            .ok_or_else(|| Error::Embed("model returned no embedding".into()))?;
        let bm25 = bm25_model(&config.bm25)?;
        Ok(Embedder {
            model: Mutex::new(model),
            bm25,
            sizing_tokenizer: Arc::new(sizing),
            dim,
            model_sha256,
            config,
        })
    }

    /// Dense vector size.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// SHA-256 of the ONNX model: vectors from different models must not be mixed.
    pub fn model_sha256(&self) -> &str {
        &self.model_sha256
    }

    /// The settings this embedder was loaded with.
    pub fn config(&self) -> &EmbedderConfig {
        &self.config
    }

    /// The model's tokenizer with truncation and padding off, for chunk sizing.
    pub fn sizing_tokenizer(&self) -> Arc<Tokenizer> {
        self.sizing_tokenizer.clone()
    }

    /// L2-normalised dense vectors, one per text, computed in batches.
    pub fn embed_dense(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let mut model = self
            .model
            .lock()
            .map_err(|_| Error::Embed("embedding model lock poisoned".into()))?;
        model
            .embed(texts, Some(self.config.batch_size.max(1)))
            .map_err(|e| Error::Embed(e.to_string()))
    }

    /// The BM25 settings as part of the index's pipeline fingerprint; `None` for Qdrant's
    /// defaults (what indexes written before the settings existed used).
    pub fn bm25_fingerprint(&self) -> Option<String> {
        let b = self.config.bm25;
        (b != Bm25Settings::default()).then(|| format!("{}/{}/{}", b.k1, b.b, b.avg_len))
    }

    /// The BM25 vector of a document (chunk) text; cheap, needs no model.
    pub fn embed_sparse_document(&self, text: &str) -> SparseVector {
        sparse(self.bm25.embed_document(text))
    }

    /// The BM25 vector of a query (term weights 1; the engine applies IDF).
    pub fn embed_sparse_query(&self, text: &str) -> SparseVector {
        sparse(self.bm25.embed_query(text))
    }
}

/// Qdrant's BM25 embedder (its tokenizer, stop words and stemmer) with `settings`.
pub fn bm25_model(settings: &Bm25Settings) -> Result<EdgeBm25> {
    let invalid = |what: &str| Error::Embed(format!("BM25: {what}"));
    let not_nan = |v: f64, what: &str| {
        qdrant_edge::external::ordered_float::NotNan::new(v).map_err(|_| invalid(what))
    };
    EdgeBm25::new(EdgeBm25Config {
        k: not_nan(settings.k1, "k1 is not a number")?,
        b: not_nan(settings.b, "b is not a number")?,
        avg_len: not_nan(settings.avg_len, "avg_len is not a number")?,
        ..EdgeBm25Config::default()
    })
    .map_err(|e| invalid(&e.to_string()))
}

/// The engine's BM25 vector as the store's type (the store, not the embedder, knows
/// which engine holds it).
fn sparse(v: qdrant_edge::SparseVector) -> SparseVector {
    SparseVector {
        indices: v.indices,
        values: v.values,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let err = init_onnx_runtime(Path::new("/nonexistent/libonnxruntime.so")).unwrap_err();
        assert!(matches!(err, Error::OrtLibraryMissing { .. }));
        assert!(err.to_string().contains("make setup"), "{err}");
    }

    #[test]
    fn missing_model_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = Embedder::load(EmbedderConfig {
            model_dir: dir.path().to_path_buf(),
            ort_library: "/nonexistent/lib.so".into(),
            max_length: 256,
            threads: 1,
            batch_size: 8,
            bm25: Default::default(),
        })
        .err()
        .unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains("model.onnx") && msg.contains("make setup"),
            "{msg}"
        );
    }
}
