//! Stage **retrieve**: embeds the question with the ingest pipeline's embedder and searches
//! its store. Nothing here re-implements either.

use std::sync::Arc;
use std::time::Instant;

use docent_ingest::embed::Embedder;
use docent_ingest::store::{Fusion, Hit, SearchFilter, SearchMode, Store};
use serde::Serialize;

/// The embedder and the store, opened once and shared by ingest and query.
#[derive(Clone)]
pub struct Index {
    pub embedder: Arc<Embedder>,
    pub store: Arc<Store>,
    /// How chunks are ranked unless a request says otherwise (`retrieval.mode`).
    pub mode: SearchMode,
    /// How hybrid search fuses its rankings.
    pub fusion: Fusion,
}

/// A chunk's score under each ranking (`None`: not among that ranking's candidates).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Scores {
    pub dense: Option<f32>,
    pub sparse: Option<f32>,
    /// Reciprocal rank fusion of both (hybrid mode only).
    pub fused: Option<f32>,
}

/// Retrieved chunks, best first, and the time it took.
#[derive(Debug, Clone)]
pub struct Retrieved {
    pub hits: Vec<Hit>,
    /// Cosine similarity of the chunk nearest to the question (the refusal signal,
    /// whatever the mode); `None` when the index has no matching chunk.
    pub best_dense: Option<f32>,
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
        self.retrieve_with(question, top_k, self.mode, only)
    }

    /// [`Self::retrieve`] with a given ranking.
    pub fn retrieve_with(
        &self,
        question: &str,
        top_k: usize,
        mode: SearchMode,
        only: &SearchFilter,
    ) -> docent_ingest::Result<Retrieved> {
        let started = Instant::now();
        let query = self.embedder.embed_query(question)?;
        let hits = self.store.search(&query, mode, &self.fusion, top_k, only)?;
        let best_dense = self.best_dense(&query, mode, &hits, only)?;
        Ok(Retrieved {
            hits,
            best_dense,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn best_dense(
        &self,
        query: &docent_ingest::embed::Embedding,
        mode: SearchMode,
        hits: &[Hit],
        only: &SearchFilter,
    ) -> docent_ingest::Result<Option<f32>> {
        if mode == SearchMode::Dense {
            return Ok(hits.first().map(|h| h.score));
        }
        Ok(self
            .store
            .search(query, SearchMode::Dense, &self.fusion, 1, only)?
            .first()
            .map(|h| h.score))
    }

    /// [`Self::retrieve_with`], plus each hit's dense and sparse score (from the same
    /// candidate lists hybrid search fuses) and its fused score.
    pub fn retrieve_scored(
        &self,
        question: &str,
        top_k: usize,
        mode: SearchMode,
        only: &SearchFilter,
    ) -> docent_ingest::Result<(Retrieved, Vec<Scores>)> {
        let started = Instant::now();
        let query = self.embedder.embed_query(question)?;
        let hits = self.store.search(&query, mode, &self.fusion, top_k, only)?;
        let depth = top_k.max(1) * self.fusion.candidates.max(1);
        let dense = self
            .store
            .search(&query, SearchMode::Dense, &self.fusion, depth, only)?;
        let sparse = self
            .store
            .search(&query, SearchMode::Sparse, &self.fusion, depth, only)?;
        let score_in = |list: &[Hit], h: &Hit| {
            list.iter()
                .find(|c| {
                    c.payload.document_id == h.payload.document_id
                        && c.payload.chunk_index == h.payload.chunk_index
                })
                .map(|c| c.score)
        };
        let scores = hits
            .iter()
            .map(|h| Scores {
                dense: score_in(&dense, h),
                sparse: score_in(&sparse, h),
                fused: (mode == SearchMode::Hybrid).then_some(h.score),
            })
            .collect();
        // the dense candidates are best first: the refusal signal needs no extra search
        let best_dense = dense.first().map(|h| h.score);
        Ok((
            Retrieved {
                hits,
                best_dense,
                elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
            },
            scores,
        ))
    }
}
