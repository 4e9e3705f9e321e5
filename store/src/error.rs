//! The store's one error type.

/// What went wrong in the store. Messages say what to fix where the caller can.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine or server refused or failed an operation.
    #[error("vector store: {0}")]
    Engine(String),
    /// The server cannot be reached (retry later; the service answers 503 meanwhile).
    #[error("vector store unavailable: {0}")]
    Unavailable(String),
    /// The index cannot be used as configured (another model, another format, in use).
    #[error("{0}")]
    Incompatible(String),
    /// Stored data that does not parse.
    #[error("vector store: malformed {what}: {detail}")]
    Malformed {
        /// What was read (a payload, the catalog, a format marker).
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// A write that another replica took for a dead one's and rolled back: it made no
    /// progress for longer than the index's stale time. Nothing of it is shown.
    #[error("vector store: {0}")]
    TakenOver(String),
    /// Reading or writing the index's files failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

/// The store crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn engine(e: impl std::fmt::Display) -> Self {
        Error::Engine(e.to_string())
    }

    pub(crate) fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether retrying later may succeed (the server is down or overloaded).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable(_))
    }
}
