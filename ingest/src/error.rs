//! The ingest crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading, splitting, embedding or storing documents.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The file's extension is not one the loader reads.
    #[error("{path}: unsupported file type (supported: {supported})")]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The extensions that are, comma-separated.
        supported: String,
    },
    /// The document has no text once loaded.
    #[error("{path}: the document contains no text")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A text-typed file that holds binary data.
    #[error("{path}: a binary file, not text")]
    Binary {
        /// The file.
        path: PathBuf,
    },
    /// A password-protected PDF or DOCX.
    #[error("{path}: the document is encrypted (password protected); decrypt it first, e.g. qpdf --decrypt")]
    Encrypted {
        /// The file.
        path: PathBuf,
    },
    /// A PDF whose pages are images only.
    #[error("{path}: no text layer in {pages} page(s) (a scanned or image-only PDF); run OCR first, e.g. ocrmypdf")]
    NoTextLayer {
        /// The file.
        path: PathBuf,
        /// Its pages.
        pages: usize,
    },
    /// A file its parser cannot read.
    #[error("{path}: corrupt or unreadable: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A file over the size limit, refused before parsing.
    #[error("{path}: {bytes} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// The ONNX Runtime shared library is not where the configuration says.
    #[error("ONNX Runtime library not found at {path}: run `make setup` or set embedding.ort_library / ORT_DYLIB_PATH")]
    OrtLibraryMissing {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A file of the embedding model is missing.
    #[error("model file not found: {path} ({hint})")]
    ModelFileMissing {
        /// The file.
        path: PathBuf,
        /// How to get it.
        hint: String,
    },
    /// ONNX Runtime is there but does not load.
    #[error("could not load ONNX Runtime from {path}: {message}")]
    OrtLoad {
        /// The library.
        path: PathBuf,
        /// What the loader said.
        message: String,
    },
    /// The embedding model failed on a batch.
    #[error("embedding failed: {0}")]
    Embed(String),
    /// The tokenizer failed or does not load.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The splitter failed.
    #[error("chunking: {0}")]
    Split(String),
    /// The vector store failed.
    #[error(transparent)]
    Store(#[from] docent_store::Error),
    /// A setting that cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// The ingest crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
