//! The one interface every vector engine implements: [`VectorIndex`].
//!
//! It is deliberately small and engine-shaped (points, filters, searches, a key-value
//! catalog); what docent builds from it (documents, versions, hidden writes, crash
//! recovery) is written once, in [`crate::Store`], over any implementation.

use async_trait::async_trait;
use serde_json::Value;

use crate::types::{Ann, Fusion, SearchMode, SparseVector};
use crate::Result;

/// A point's payload: a JSON object.
pub type Payload = serde_json::Map<String, Value>;

/// One chunk as the engine stores it: an id, a named dense (`dense`, cosine) and a named
/// sparse (`bm25`, IDF applied by the engine) vector, and a payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// Its id ([`crate::point_id`] of the chunk).
    pub id: u64,
    /// The dense embedding.
    pub dense: Vec<f32>,
    /// The BM25 term weights.
    pub sparse: SparseVector,
    /// The chunk's payload ([`crate::ChunkPayload`] as JSON).
    pub payload: Payload,
}

/// One condition on a keyword payload field: the field (or, for an array, one of its
/// elements) equals one of `any_of`.
#[derive(Debug, Clone, PartialEq)]
pub struct Keyword {
    /// The payload field.
    pub field: &'static str,
    /// The values it may equal.
    pub any_of: Vec<String>,
}

/// Which points an operation applies to: all `must` conditions hold and no `must_not`
/// one does. The empty filter selects every point.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    /// Conditions that must all hold.
    pub must: Vec<Keyword>,
    /// Conditions none of which may hold.
    pub must_not: Vec<Keyword>,
}

impl Filter {
    /// Points whose `field` is `value`.
    pub fn is(field: &'static str, value: &str) -> Self {
        Filter::default().and(field, [value])
    }

    /// Adds a condition: `field` is one of `values` (ignored when `values` is empty).
    pub fn and<S: Into<String>>(
        mut self,
        field: &'static str,
        values: impl IntoIterator<Item = S>,
    ) -> Self {
        let any_of: Vec<String> = values.into_iter().map(Into::into).collect();
        if !any_of.is_empty() {
            self.must.push(Keyword { field, any_of });
        }
        self
    }

    /// Adds an exclusion: `field` is none of `values` (ignored when `values` is empty).
    pub fn and_not<S: Into<String>>(
        mut self,
        field: &'static str,
        values: impl IntoIterator<Item = S>,
    ) -> Self {
        let any_of: Vec<String> = values.into_iter().map(Into::into).collect();
        if !any_of.is_empty() {
            self.must_not.push(Keyword { field, any_of });
        }
        self
    }

    /// Whether it selects every point.
    pub fn is_empty(&self) -> bool {
        self.must.is_empty() && self.must_not.is_empty()
    }
}

/// A search: the question's vectors, how to rank, how many, over which points.
#[derive(Debug, Clone)]
pub struct SearchRequest {
    /// The question's dense embedding.
    pub dense: Vec<f32>,
    /// The question's BM25 terms.
    pub sparse: SparseVector,
    /// Dense, sparse or both fused.
    pub mode: SearchMode,
    /// Hybrid fusion (method, weights, candidate depth) and optional MMR.
    pub fusion: Fusion,
    /// How the dense ranking is searched.
    pub ann: Ann,
    /// How many results.
    pub limit: usize,
    /// Over which points.
    pub filter: Filter,
    /// Whether results carry their payloads.
    pub with_payload: bool,
}

/// A search result: point id, score, and the payload when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// The point's id.
    pub id: u64,
    /// Its score in the ranking (cosine, BM25 or fused).
    pub score: f32,
    /// Its payload, when asked for.
    pub payload: Option<Payload>,
}

/// A point read back by id or by scrolling.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The point's id.
    pub id: u64,
    /// Its payload.
    pub payload: Payload,
}

/// The vector engine docent stores chunks in.
///
/// Two implementations: [`crate::edge::EdgeIndex`] (Qdrant's embedded engine, a
/// directory, the default) and [`crate::qdrant::QdrantIndex`] (a Qdrant server or
/// cluster over gRPC). Both store the same ids, payloads, named vectors and payload
/// indexes and fuse rankings with the same formulas, so the same data ranks the same.
/// The contract tests (`store/tests/contract.rs`) run against each.
///
/// Besides points, an index holds a small **catalog**: JSON values under `(kind, name)`
/// keys, in the index itself (a second shard or collection), so every process that opens
/// the index shares it.
#[async_trait]
pub trait VectorIndex: Send + Sync {
    /// Where the data lives, for logs and messages.
    fn describe(&self) -> String;

    /// Whether this process is the only one that can write (the embedded engine locks its
    /// directory): then every unfinished write found at start-up was this process's own,
    /// interrupted, and can be rolled back at once.
    fn exclusive(&self) -> bool;

    /// Writes points; a point with an existing id is replaced.
    async fn upsert(&self, points: Vec<Point>) -> Result<()>;

    /// Removes the points that pass `filter`.
    async fn delete(&self, filter: &Filter) -> Result<()>;

    /// Sets payload keys (others are kept) on the points that pass `filter`.
    async fn set_payload(&self, filter: &Filter, payload: Payload) -> Result<()>;

    /// The best `limit` points for a query, best first.
    async fn search(&self, request: &SearchRequest) -> Result<Vec<Scored>>;

    /// Points by id, with payloads; ids not stored are absent.
    async fn retrieve(&self, ids: &[u64]) -> Result<Vec<Record>>;

    /// One page of the points passing `filter`, in id order, starting at `offset`; the
    /// second value is where the next page starts.
    async fn scroll(
        &self,
        filter: &Filter,
        limit: usize,
        offset: Option<u64>,
    ) -> Result<(Vec<Record>, Option<u64>)>;

    /// [`Self::scroll`] with vectors: whole points (for copying an index).
    async fn scroll_points(
        &self,
        limit: usize,
        offset: Option<u64>,
    ) -> Result<(Vec<Point>, Option<u64>)>;

    /// Exact number of points passing `filter`.
    async fn count(&self, filter: &Filter) -> Result<usize>;

    /// Every value of a keyword field among the points passing `filter`, with the number
    /// of points holding it.
    async fn facet(&self, field: &'static str, filter: &Filter) -> Result<Vec<(String, usize)>>;

    /// Makes every acknowledged write durable.
    async fn flush(&self) -> Result<()>;

    /// Builds vector indexes and merges segments where the engine leaves that to the
    /// caller; returns whether anything changed.
    async fn optimize(&self) -> Result<bool>;

    /// A catalog value.
    async fn catalog_get(&self, kind: &str, name: &str) -> Result<Option<Value>>;

    /// Sets a catalog value. Once this returns, the value survives the process being
    /// killed; [`Self::sync_catalog`] makes it survive a power cut too.
    async fn catalog_put(&self, kind: &str, name: &str, value: Value) -> Result<()>;

    /// Makes every catalog change so far durable (also against a power cut).
    async fn sync_catalog(&self) -> Result<()>;

    /// Removes a catalog value (absent is fine).
    async fn catalog_delete(&self, kind: &str, name: &str) -> Result<()>;

    /// Every `(name, value)` of a kind, by name.
    async fn catalog_list(&self, kind: &str) -> Result<Vec<(String, Value)>>;
}

/// Payload fields with a keyword index (filters and facets use them).
pub const INDEXED_FIELDS: [&str; 5] = ["document_id", "sources", "collections", "tags", "pipeline"];

/// Catalog point id of a key (both engines).
pub(crate) fn catalog_id(kind: &str, name: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("catalog\0{kind}\0{name}").as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}
