//! The ingest crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading, splitting, embedding or storing documents.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: unsupported file type (supported: {supported})")]
    UnsupportedType { path: PathBuf, supported: String },
    #[error("{path}: the document contains no text")]
    Empty { path: PathBuf },
    #[error("{path}: a binary file, not text")]
    Binary { path: PathBuf },
    #[error("{path}: the document is encrypted (password protected); decrypt it first, e.g. qpdf --decrypt")]
    Encrypted { path: PathBuf },
    #[error("{path}: no text layer in {pages} page(s) (a scanned or image-only PDF); run OCR first, e.g. ocrmypdf")]
    NoTextLayer { path: PathBuf, pages: usize },
    #[error("{path}: corrupt or unreadable: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: {bytes} bytes is over the {limit}-byte limit")]
    TooLarge {
        path: PathBuf,
        bytes: u64,
        limit: u64,
    },
    #[error("ONNX Runtime library not found at {path}: run `make setup` or set embedding.ort_library / ORT_DYLIB_PATH")]
    OrtLibraryMissing { path: PathBuf },
    #[error("model file not found: {path} ({hint})")]
    ModelFileMissing { path: PathBuf, hint: String },
    #[error("could not load ONNX Runtime from {path}: {message}")]
    OrtLoad { path: PathBuf, message: String },
    #[error("embedding failed: {0}")]
    Embed(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chunking: {0}")]
    Split(String),
    #[error(transparent)]
    Store(#[from] docent_store::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
