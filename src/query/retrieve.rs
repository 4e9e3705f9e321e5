//! Stage **retrieve**: embeds the question with the ingest pipeline's embedder and searches
//! its store. Nothing here re-implements either.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use docent_ingest::embed::{Embedder, Embedding};
use docent_ingest::store::{point_id, Fusion, Hit, SearchFilter, SearchMode, Span, Store};
use serde::Serialize;

use crate::query::embed::QueryBatcher;

/// Most neighbours a hit may take on each side.
pub const MAX_NEIGHBORS: usize = 5;

/// The embedder and the store, opened once and shared by ingest and query.
/// (Questions are embedded in [`crate::query::embed`].)
#[derive(Clone)]
pub struct Index {
    /// The ingest pipeline's embedder (dense and BM25 vectors).
    pub embedder: Arc<Embedder>,
    /// The vector store the chunks are searched in.
    pub store: Arc<Store>,
    /// How chunks are ranked unless a request says otherwise (`retrieval.mode`).
    pub mode: SearchMode,
    /// How hybrid search fuses its rankings.
    pub fusion: Fusion,
    /// Embeds questions, batching concurrent ones.
    pub queries: Arc<QueryBatcher>,
}

/// A chunk's score under each ranking (`None`: not among that ranking's candidates).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Scores {
    /// Cosine similarity to the question, when among the dense candidates.
    pub dense: Option<f32>,
    /// BM25 score, when among the sparse candidates.
    pub sparse: Option<f32>,
    /// The fused score (hybrid mode only).
    pub fused: Option<f32>,
}

/// Chunks ranked for a question, best first, and the candidate lists (point id, score;
/// best first) they were ranked from.
pub struct Ranked {
    /// The chunks kept, best first (at most `top_k`).
    pub hits: Vec<Hit>,
    /// The dense candidates: point id and cosine similarity, best first.
    pub dense: Vec<(u64, f32)>,
    /// The BM25 candidates: point id and score, best first.
    pub sparse: Vec<(u64, f32)>,
}

/// Retrieved chunks, best first, and the time it took.
#[derive(Debug, Clone)]
pub struct Retrieved {
    /// The chunks retrieved, best first; their text is widened by [`Index::expand`] when
    /// neighbours are joined.
    pub hits: Vec<Hit>,
    /// Cosine similarity of the chunk nearest to the question (the refusal signal,
    /// whatever the mode); `None` when the index has no matching chunk.
    pub best_dense: Option<f32>,
    /// Share of the question's BM25 terms found in the retrieved chunk that has the most of
    /// them ([`Index::term_coverage`]); part of the refusal signal ([`relevance`]). Only
    /// computed (by the caller) when `retrieval.term_weight` uses it; 0 otherwise.
    pub coverage: f32,
    /// The question's BM25 term ids.
    pub terms: Vec<u32>,
    /// Milliseconds the retrieval took, embedding the question included.
    pub elapsed_ms: f64,
}

/// The refusal signal: the best chunk's cosine similarity plus `term_weight` × the share
/// of the question's terms that the retrieved chunks contain (`retrieval.term_weight`);
/// the question is refused below `retrieval.min_score`. `None` when nothing was found.
///
/// Natural questions that the documents cannot answer still land near a chunk about the
/// same subject (a close cosine), but their specific words are missing from it: on the
/// visible natural-question sets the sum refuses far more of them at the same false
/// refusals (docs/evaluation.md, "Retrieval quality").
pub fn relevance(best_dense: Option<f32>, coverage: f32, term_weight: f32) -> Option<f32> {
    best_dense.map(|d| d + term_weight * coverage)
}

impl Index {
    /// The best `top_k` chunks for a question under the configured mode.
    pub async fn retrieve(
        &self,
        question: &str,
        top_k: usize,
        only: &SearchFilter,
    ) -> docent_ingest::Result<Retrieved> {
        Ok(self
            .retrieve_scored(question, top_k, self.mode, only)
            .await?
            .0)
    }

    /// The question's dense and BM25 vectors ([`QueryBatcher::embed_question`]).
    pub async fn embed_query(&self, question: &str) -> docent_ingest::Result<Embedding> {
        let started = Instant::now();
        let e = self.queries.embed_question(question).await;
        crate::metrics::metrics().stage("embed", started.elapsed().as_secs_f64());
        e
    }

    /// The best `top_k` chunks for an embedded question under `mode`, with the candidate
    /// lists they were chosen from.
    ///
    /// Two searches, whatever the mode: the dense and the BM25 candidate lists (each
    /// `top_k × fusion.candidates` deep, ids and scores only); the ranking is one of them
    /// or their fusion ([`Fusion::fuse`], the engine's own formulas), and only the
    /// `top_k` chunks it keeps are read. With MMR the engine re-ranks (a third search).
    pub async fn rank(
        &self,
        query: &Embedding,
        top_k: usize,
        mode: SearchMode,
        only: &SearchFilter,
    ) -> docent_ingest::Result<Ranked> {
        let started = Instant::now();
        let ranked = self.rank_unmetered(query, top_k, mode, only).await;
        crate::metrics::metrics().stage("retrieve", started.elapsed().as_secs_f64());
        ranked
    }

    async fn rank_unmetered(
        &self,
        query: &Embedding,
        top_k: usize,
        mode: SearchMode,
        only: &SearchFilter,
    ) -> docent_ingest::Result<Ranked> {
        let depth = top_k.max(1) * self.fusion.candidates.max(1);
        let plain = self.fusion.without_mmr();
        // the candidate lists and the chunks read from one state of the store: again when
        // another replica hid or showed documents meanwhile (see `Store::view`)
        for _ in 0..docent_ingest::store::store::READ_ATTEMPTS {
            let view = self.store.view().await?;
            let (dense, sparse) = futures::try_join!(
                view.search_scores(query, SearchMode::Dense, &plain, depth, only),
                view.search_scores(query, SearchMode::Sparse, &plain, depth, only),
            )?;
            let hits = if self.fusion.mmr_lambda.is_some() {
                view.search(query, mode, &self.fusion, top_k, only).await?
            } else {
                let mut ranked = match mode {
                    SearchMode::Dense => dense.clone(),
                    SearchMode::Sparse => sparse.clone(),
                    SearchMode::Hybrid => self.fusion.fuse(&dense, &sparse),
                };
                // ties in the engine's own order differ between engines: by id
                docent_ingest::store::rank_order(&mut ranked);
                ranked.truncate(top_k);
                view.hits(&ranked).await?
            };
            if view.unchanged().await? {
                return Ok(Ranked {
                    hits,
                    dense,
                    sparse,
                });
            }
        }
        Err(Store::kept_changing().into())
    }

    /// The best `top_k` chunks under `mode`, with each hit's dense and sparse score (from
    /// the candidate lists) and its fused score.
    pub async fn retrieve_scored(
        &self,
        question: &str,
        top_k: usize,
        mode: SearchMode,
        only: &SearchFilter,
    ) -> docent_ingest::Result<(Retrieved, Vec<Scores>)> {
        let started = Instant::now();
        let query = self.embed_query(question).await?;
        self.retrieve_embedded(&query, started, top_k, mode, only)
            .await
    }

    /// [`Self::retrieve_scored`] for a question embedded already (at `started`: the
    /// retrieval time counts from there).
    pub async fn retrieve_embedded(
        &self,
        query: &Embedding,
        started: Instant,
        top_k: usize,
        mode: SearchMode,
        only: &SearchFilter,
    ) -> docent_ingest::Result<(Retrieved, Vec<Scores>)> {
        let Ranked {
            hits,
            dense,
            sparse,
        } = self.rank(query, top_k, mode, only).await?;
        let score_in = |list: &[(u64, f32)], h: &Hit| {
            let id = point_id(&h.payload.document_id, h.payload.chunk_index);
            list.iter().find(|c| c.0 == id).map(|c| c.1)
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
        let best_dense = dense.first().map(|h| h.1);
        Ok((
            Retrieved {
                hits,
                best_dense,
                coverage: 0.0,
                terms: query.sparse.indices.clone(),
                elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
            },
            scores,
        ))
    }

    /// The largest share of the question's BM25 terms (after the BM25 tokenizer: stop
    /// words out, stemmed) that one of `texts` contains; 0 for a question without terms.
    pub fn term_coverage<'t>(&self, terms: &[u32], texts: impl Iterator<Item = &'t str>) -> f32 {
        let asked: HashSet<u32> = terms.iter().copied().collect();
        texts
            .map(|t| self.term_share(&asked, t))
            .fold(0.0, f32::max)
    }

    /// The share of the question's BM25 terms `asked` that `text` contains; 0 when nothing
    /// is asked.
    pub fn term_share(&self, asked: &HashSet<u32>, text: &str) -> f32 {
        if asked.is_empty() {
            return 0.0;
        }
        let found = self.embedder.embed_sparse_document(text).indices;
        let shared = found.iter().filter(|i| asked.contains(i)).count();
        shared as f32 / asked.len() as f32
    }

    /// Neighbour expansion: joins up to `n` chunks before and after each hit (same
    /// document) into the hit's text and span, so the prompt sees the passage around
    /// it. A neighbour that is a hit itself, or already joined to a better hit, is left
    /// there (no text twice). Reads the neighbours from the store, in one read.
    pub async fn expand(&self, hits: &mut [Hit], n: usize) -> docent_ingest::Result<()> {
        if n == 0 {
            return Ok(());
        }
        // every neighbour that may be needed, read at once
        let wanted: Vec<u64> = hits
            .iter()
            .flat_map(|h| {
                let (doc, i) = (&h.payload.document_id, h.payload.chunk_index);
                (i.saturating_sub(n)..=i + n)
                    .filter(move |&j| j != i)
                    .map(move |j| point_id(doc, j))
            })
            .collect();
        let mut stored = self.store.payloads(&wanted).await?;
        let mut taken: HashSet<(String, usize)> = hits
            .iter()
            .map(|h| (h.payload.document_id.clone(), h.payload.chunk_index))
            .collect();
        for h in hits.iter_mut() {
            let (doc, i) = (h.payload.document_id.clone(), h.payload.chunk_index);
            let mut take = |j: usize| {
                if !taken.insert((doc.clone(), j)) {
                    return None;
                }
                stored.remove(&point_id(&doc, j))
            };
            let mut before = Vec::new();
            for j in (i.saturating_sub(n)..i).rev() {
                match take(j) {
                    Some(c) => before.push(c),
                    None => break,
                }
            }
            before.reverse();
            let mut after = Vec::new();
            for j in i + 1..=i + n {
                match take(j) {
                    Some(c) => after.push(c),
                    None => break,
                }
            }
            if before.is_empty() && after.is_empty() {
                continue;
            }
            let parts: Vec<(&str, Span)> = before
                .iter()
                .map(|c| (c.text.as_str(), c.span))
                .chain([(h.payload.text.as_str(), h.payload.span)])
                .chain(after.iter().map(|c| (c.text.as_str(), c.span)))
                .collect();
            let (text, span) = join_spans(&parts);
            h.payload.text = text;
            h.payload.span = span;
        }
        Ok(())
    }
}

/// Joins consecutive chunks of one document, in order. Each text is the document's bytes
/// at its span, so overlapping bytes are dropped by offset; a gap between two chunks
/// (whitespace the splitter trimmed) becomes one newline. Returns the text and the span
/// from the first chunk's start to the last one's end.
pub fn join_spans(parts: &[(&str, Span)]) -> (String, Span) {
    let Some(first) = parts.first() else {
        return (String::new(), Span::default());
    };
    let mut text = String::new();
    let mut end = first.1.start;
    for (i, (t, s)) in parts.iter().enumerate() {
        if i > 0 && s.end <= end {
            continue; // inside what is joined already
        }
        if i == 0 || s.start >= end {
            if i > 0 {
                text.push('\n');
            }
            text.push_str(t);
        } else {
            match t.get(end - s.start..) {
                Some(rest) => text.push_str(rest),
                None => {
                    text.push('\n');
                    text.push_str(t);
                }
            }
        }
        end = end.max(s.end);
    }
    (
        text,
        Span {
            start: first.1.start,
            end,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(doc: &str, start: usize, end: usize) -> (&str, Span) {
        (&doc[start..end], Span { start, end })
    }

    #[test]
    fn joined_chunks_are_the_document_text_without_repeats() {
        let doc = "Alpha beta gamma.\n\nDelta epsilon zeta. Eta theta.";
        // overlapping: "gamma." is in both
        let (text, span) = join_spans(&[part(doc, 0, 17), part(doc, 11, 37)]);
        assert_eq!(text, &doc[..37]);
        assert_eq!(span, Span { start: 0, end: 37 });
        // a gap of trimmed whitespace becomes one newline; a chunk inside is skipped
        let (text, span) = join_spans(&[part(doc, 0, 17), part(doc, 6, 10), part(doc, 19, 49)]);
        assert_eq!(text, "Alpha beta gamma.\nDelta epsilon zeta. Eta theta.");
        assert_eq!(span, Span { start: 0, end: 49 });
        assert_eq!(join_spans(&[]), (String::new(), Span::default()));
    }
}
