//! docent's vector store: where chunks and the document catalog live.
//!
//! - [`VectorIndex`] ([`index`]): the one async interface an engine implements: points
//!   (upsert, delete, payload updates, dense / sparse / fused hybrid search with filters,
//!   retrieve, scroll, count, facets) and a small key-value catalog.
//! - Two engines: [`edge::EdgeIndex`] (Qdrant's embedded engine, a directory; the
//!   default) and [`qdrant::QdrantIndex`] (a Qdrant server or cluster over gRPC).
//! - [`Store`] ([`store`]): documents, versions, hidden writes, crash recovery and the
//!   revision answer caches key on, written once over any engine. The ingest pipeline
//!   writes through it and the query path reads through it.
//! - [`types`]: what is stored (chunk payloads, spans, origins) and how it is ranked.
//!
//! Not here: embedding (the ingest crate's `embed` stage) and HTTP (the service).

// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod edge;
pub mod error;
pub mod index;
pub mod migrate;
pub mod qdrant;
pub mod store;
pub mod types;

use std::path::Path;
use std::sync::Arc;

pub use error::{Error, Result};
pub use index::{Filter, Point, VectorIndex};
pub use store::{Identity, Store, View, STALE_AFTER_SECS};
pub use types::*;

/// Where the index lives.
#[derive(Debug, Clone)]
pub enum Location<'a> {
    /// The embedded engine in a directory.
    Edge {
        /// The directory.
        dir: &'a Path,
    },
    /// A Qdrant server.
    Qdrant(qdrant::QdrantOptions),
}

impl Location<'_> {
    /// Whether two locations name the same index.
    pub fn same_as(&self, other: &Location<'_>) -> bool {
        match (self, other) {
            (Location::Edge { dir: a }, Location::Edge { dir: b }) => {
                let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
                canon(a) == canon(b)
            }
            (Location::Qdrant(a), Location::Qdrant(b)) => {
                a.url.trim_end_matches('/') == b.url.trim_end_matches('/')
                    && a.collection == b.collection
            }
            _ => false,
        }
    }
}

/// Opens the engine at `location` for dense vectors of size `dim`.
pub async fn open_index(location: &Location<'_>, dim: usize) -> Result<Arc<dyn VectorIndex>> {
    Ok(match location {
        Location::Edge { dir } => Arc::new(edge::EdgeIndex::open(dir, dim)?),
        Location::Qdrant(options) => Arc::new(qdrant::QdrantIndex::connect(options, dim).await?),
    })
}

/// Runs a store future to completion from synchronous code (the ingest pipeline's
/// threads). Both engines work without the caller's runtime: the embedded one runs
/// inline or on tokio's blocking pool, the server client on its own runtime.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    futures::executor::block_on(future)
}
