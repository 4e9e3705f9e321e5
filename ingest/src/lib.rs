//! docent's ingest pipeline: **load → split → embed → store**.
//!
//! Each stage is one module with a small interface:
//!
//! | stage | module | main type |
//! |---|---|---|
//! | load  | [`load`]  | [`load::Document`] from a file on disk |
//! | split | [`split`] | [`split::Splitter`]: token-aware chunks with byte spans |
//! | embed | [`embed`] | [`embed::Embedder`]: dense (ONNX via fastembed) + BM25 sparse vectors |
//! | store | [`store`] (the `docent-store` crate) | [`store::Store`] over a [`store::VectorIndex`]: embedded (qdrant-edge) or a Qdrant server |
//!
//! [`pipeline::Ingestor`] is the one place that knows the order of the stages; the CLI
//! and the HTTP service both call it. The query path reuses [`embed::Embedder`] and
//! [`store::Store`] and never re-implements them.

// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod bench;
pub mod embed;
pub mod error;
pub mod load;
pub mod pipeline;
pub mod split;
/// Stage 4, **store**: the `docent-store` crate (one interface, two engines).
pub use docent_store as store;

pub use error::{Error, Result};
