//! Stage **retrieve**: embeds the question with the ingest pipeline's embedder and searches
//! its store. Nothing here re-implements either.

use std::sync::Arc;
use std::time::Instant;

use docent_ingest::embed::Embedder;
use docent_ingest::store::{Hit, SearchFilter, Store};

/// The embedder and the store, opened once and shared by ingest and query.
#[derive(Clone)]
pub struct Index {
    pub embedder: Arc<Embedder>,
    pub store: Arc<Store>,
}

/// Retrieved chunks, best first, and the time it took.
#[derive(Debug, Clone)]
pub struct Retrieved {
    pub hits: Vec<Hit>,
    pub elapsed_ms: f64,
}

impl Index {
    /// Blocking: runs the ONNX model and the vector search. Call from a blocking thread.
    pub fn retrieve(
        &self,
        question: &str,
        top_k: usize,
        only: &SearchFilter,
    ) -> docent_ingest::Result<Retrieved> {
        let started = Instant::now();
        let query = self.embedder.embed_query(question)?;
        let hits = self.store.search_dense(&query.dense, top_k, only)?;
        Ok(Retrieved {
            hits,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }
}
