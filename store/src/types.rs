//! The data docent stores, whichever engine holds it: chunk payloads, their vectors, how
//! they are ranked and filtered, and the documents they make up.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Name of the dense vector in the engine.
pub const DENSE: &str = "dense";
/// Name of the sparse (BM25) vector in the engine.
pub const SPARSE: &str = "bm25";

/// Byte range in the extracted document text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// First byte.
    pub start: usize,
    /// End (exclusive).
    pub end: usize,
}

/// What is stored with every chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkPayload {
    /// The document's content id (hex SHA-256 of its text).
    pub document_id: String,
    /// The first source that holds this content (cited); every one is in `origins`.
    pub source: String,
    /// The document's title.
    pub title: String,
    /// The chunk's position in the document, from 0.
    pub chunk_index: usize,
    /// Number of chunks of the document (a complete document has them all).
    #[serde(default)]
    pub chunks_total: usize,
    /// How the chunk was made (embedding model and chunking settings); a document whose
    /// chunks were made differently is re-ingested.
    #[serde(default)]
    pub pipeline: String,
    /// 1-based page the chunk starts on, for paged formats (PDF).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<u32>,
    /// Where the chunk's text lies in the document's text.
    pub span: Span,
    /// The chunk's text.
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The first source's collection.
    pub collection: Option<String>,
    /// Tags of every origin (for filters).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Every source that holds this content, with its own collection and tags.
    #[serde(default)]
    pub origins: Vec<Origin>,
    /// `origins`' sources and collections, flattened for filters.
    #[serde(default)]
    pub sources: Vec<String>,
    #[serde(default)]
    /// `origins`' collections.
    pub collections: Vec<String>,
}

/// One source of a document and the metadata it was ingested with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// Where the document came from (a path or an upload's name).
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The collection it was ingested into.
    pub collection: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    /// The tags it was ingested with.
    pub tags: Vec<String>,
}

impl ChunkPayload {
    /// Every source holding the content (`sources`, or `source` for a payload without it).
    pub fn all_sources(&self) -> Vec<String> {
        if self.sources.is_empty() {
            vec![self.source.clone()]
        } else {
            self.sources.clone()
        }
    }

    /// Sets `origins` and everything derived from it.
    pub fn set_origins(&mut self, origins: Vec<Origin>) {
        let derived = Derived::of(&origins);
        self.source = derived.source;
        self.collection = derived.collection;
        self.sources = derived.sources;
        self.collections = derived.collections;
        self.tags = derived.tags;
        self.origins = origins;
    }
}

/// The payload fields that follow from a document's origins.
#[derive(Serialize)]
pub(crate) struct Derived {
    source: String,
    collection: Option<String>,
    sources: Vec<String>,
    collections: Vec<String>,
    tags: Vec<String>,
}

impl Derived {
    pub(crate) fn of(origins: &[Origin]) -> Self {
        let mut collections: Vec<String> = origins
            .iter()
            .filter_map(|o| o.collection.clone())
            .collect();
        collections.sort();
        collections.dedup();
        let mut tags: Vec<String> = origins.iter().flat_map(|o| o.tags.clone()).collect();
        tags.sort();
        tags.dedup();
        Derived {
            source: origins
                .first()
                .map(|o| o.source.clone())
                .unwrap_or_default(),
            collection: origins.first().and_then(|o| o.collection.clone()),
            sources: origins.iter().map(|o| o.source.clone()).collect(),
            collections,
            tags,
        }
    }
}

/// How chunks are ranked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SearchMode {
    /// Embedding similarity (cosine).
    Dense,
    /// BM25 over the chunk text.
    Sparse,
    /// Both, fused with reciprocal rank fusion.
    #[default]
    Hybrid,
}

impl SearchMode {
    /// Every mode, in the order reports list them.
    pub const ALL: [SearchMode; 3] = [SearchMode::Dense, SearchMode::Sparse, SearchMode::Hybrid];

    /// The mode's name in the configuration and the API.
    pub fn name(self) -> &'static str {
        match self {
            SearchMode::Dense => "dense",
            SearchMode::Sparse => "sparse",
            SearchMode::Hybrid => "hybrid",
        }
    }
}

/// Reciprocal rank fusion constant (unweighted score = sum over rankings of
/// 1 / (k + position), the first position being 1); set explicitly because Qdrant's
/// server default is 2, not the usual 60.
pub const RRF_K: usize = 60;

/// Measured on the first 3,000 SQuAD v1.1 questions (`docent eval`, MRR@10): BM25 alone
/// .872; RRF k = 60 .837 (weights and k between 2 and 60 at best .873); DBSF .888 with
/// 4×, .893 with 8× candidates (16×: .894). Hence DBSF over 8× candidates by default.
/// Weighting BM25 1.25–2× gave .896 there but nothing on the full set (.882 either way)
/// and less on XQuAD (.973 vs .976), so both weights stay 1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FusionMethod {
    /// Weighted reciprocal rank fusion.
    Rrf,
    #[default]
    /// Distribution-based score fusion (the default).
    Dbsf,
}

/// How the final ranking is formed: how hybrid search fuses its two rankings, and
/// whether maximal marginal relevance then diversifies the list.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fusion {
    /// `rrf` (weighted reciprocal rank fusion) or `dbsf` (distribution-based score
    /// fusion: each ranking's scores normalised by their mean ± 3 standard deviations,
    /// then multiplied by the ranking's weight and summed).
    #[serde(default)]
    pub method: FusionMethod,
    /// RRF's k ([`RRF_K`] by default).
    pub rrf_k: usize,
    /// Weight of the dense ranking.
    pub dense_weight: f32,
    /// Weight of the BM25 ranking.
    pub sparse_weight: f32,
    /// Each ranking contributes its top `limit × candidates`.
    #[serde(default = "default_candidates")]
    pub candidates: usize,
    /// Maximal marginal relevance over the final `limit × candidates` candidates (any
    /// mode): each next chunk maximises `λ·sim(question) − (1−λ)·max sim(chosen chunk)`
    /// on dense vectors, so near-duplicates give way to other content. 1 = relevance only;
    /// absent = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mmr_lambda: Option<f32>,
}

/// How the dense ranking is searched: Qdrant's HNSW graph with a beam of `ef` (the engine
/// uses at least the number of results asked for), or every vector (`exact`). Segments
/// below the engine's full-scan threshold (about 6,600 chunks of 384 dimensions) are
/// always scanned whole; this matters above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ann {
    /// HNSW beam width of a search.
    #[serde(default = "default_ef")]
    pub ef: usize,
    /// Compare the question with every stored vector: the true nearest chunks, at a cost
    /// that grows with the index.
    #[serde(default)]
    pub exact: bool,
}

/// The default [`Ann::ef`] (see its measurement in docs/benchmarks.md, "Dense search recall").
pub const DEFAULT_EF: usize = 512;

fn default_ef() -> usize {
    DEFAULT_EF
}

impl Default for Ann {
    fn default() -> Self {
        Ann {
            ef: DEFAULT_EF,
            exact: false,
        }
    }
}

fn default_candidates() -> usize {
    8
}

impl Default for Fusion {
    fn default() -> Self {
        Fusion {
            method: FusionMethod::Dbsf,
            rrf_k: RRF_K,
            dense_weight: 1.0,
            sparse_weight: 1.0,
            candidates: default_candidates(),
            mmr_lambda: None,
        }
    }
}

impl Fusion {
    /// The same settings without MMR: the rankings as they are (their scores are
    /// similarities, not MMR scores).
    pub fn without_mmr(&self) -> Fusion {
        Fusion {
            mmr_lambda: None,
            ..*self
        }
    }

    /// Fuses a dense and a sparse ranking (point id, score; best first) into one, best
    /// first, exactly as Qdrant's engine does (its `score_fusion` / `rrf_scoring`), so the
    /// lists a search already fetched need no second, fused search:
    /// - DBSF: each list's scores mapped to 0..1 between mean ∓ 3 sample standard
    ///   deviations (a single score becomes 0.5), times the list's weight, summed per point;
    /// - RRF: each point gets `1 / ((position + 1) / weight + k − 1)` per list, summed.
    ///
    /// Each list is first put in [`rank_order`] (equal scores by point id): the order in
    /// which an engine returns tied candidates is its own, differs between engines and
    /// can differ between two searches of one engine, and RRF reads positions. So the
    /// fused ranking depends on the scores alone; the result is in [`rank_order`] too.
    pub fn fuse(&self, dense: &[(u64, f32)], sparse: &[(u64, f32)]) -> Vec<(u64, f32)> {
        let canonical = |list: &[(u64, f32)]| {
            let mut list = list.to_vec();
            rank_order(&mut list);
            list
        };
        let (dense, sparse) = (canonical(dense), canonical(sparse));
        let mut fused: Vec<(u64, f32)> = Vec::with_capacity(dense.len() + sparse.len());
        let mut add = |id: u64, score: f32| match fused.iter_mut().find(|p| p.0 == id) {
            Some(p) => p.1 += score,
            None => fused.push((id, score)),
        };
        for (list, weight) in [(&dense, self.dense_weight), (&sparse, self.sparse_weight)] {
            match self.method {
                FusionMethod::Dbsf => {
                    let (lo, hi) = dbsf_range(list);
                    for &(id, score) in list {
                        let norm = if lo == hi {
                            0.5
                        } else {
                            (score - lo) / (hi - lo)
                        };
                        add(id, norm * weight);
                    }
                }
                FusionMethod::Rrf => {
                    for (pos, &(id, _)) in list.iter().enumerate() {
                        let score = if weight <= 0.0 {
                            0.0
                        } else {
                            1.0 / ((pos + 1) as f32 / weight + self.rrf_k as f32 - 1.0)
                        };
                        add(id, score);
                    }
                }
            }
        }
        rank_order(&mut fused);
        fused
    }
}

/// Sorts `(point id, score)` best first; equal scores by point id, so that every engine
/// (and a copy of an index on another one) gives the same order where scores tie.
pub fn rank_order(list: &mut [(u64, f32)]) {
    list.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

/// Mean ∓ 3 sample standard deviations of a list's scores (Welford, in f32 as the engine
/// computes it); equal bounds for fewer than two scores.
fn dbsf_range(list: &[(u64, f32)]) -> (f32, f32) {
    if list.len() < 2 {
        return (0.0, 0.0);
    }
    let (mut mean, mut aggregate) = (0f32, 0f32);
    for (k, &(_, score)) in (1usize..).zip(list) {
        let old_delta = score - mean;
        mean += old_delta / k as f32;
        aggregate += old_delta * (score - mean);
    }
    let std_dev = (aggregate / (list.len() as f32 - 1.0)).sqrt();
    (mean - 3.0 * std_dev, mean + 3.0 * std_dev)
}

/// A search result.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The chunk.
    pub payload: ChunkPayload,
    /// Its score in the final ranking.
    pub score: f32,
}

/// Restricts a search, applied inside the vector search (not after it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchFilter {
    /// Only chunks of this collection (of any of their origins).
    pub collection: Option<String>,
    /// Only chunks with at least one of these tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Only chunks of these documents.
    #[serde(default)]
    pub document_ids: Vec<String>,
}

/// A stored document, as listed by [`crate::Store::documents`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DocumentInfo {
    /// The content id.
    pub id: String,
    /// The first source (cited).
    pub source: String,
    /// The title.
    pub title: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// The first source's collection.
    pub collection: Option<String>,
    /// Tags of every source.
    pub tags: Vec<String>,
    /// Every source holding this content (identical files are stored once).
    pub sources: Vec<String>,
    /// Chunks stored.
    pub chunks: usize,
    /// How many chunks the document was split into; `chunks == chunks_total` when complete.
    pub chunks_total: usize,
}

/// One version of a document: its content id at a source.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Version {
    /// The content id.
    pub document_id: String,
    /// The source.
    pub source: String,
}

/// A sparse vector (BM25 term weights): term ids and their weights, ids ascending.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SparseVector {
    /// Term ids, ascending.
    pub indices: Vec<u32>,
    /// Their weights.
    pub values: Vec<f32>,
}

/// Dense and sparse vectors of one text (a chunk or a question).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embedding {
    /// The dense embedding.
    pub dense: Vec<f32>,
    /// The BM25 term weights.
    pub sparse: SparseVector,
}

/// Deterministic point id of a chunk of a document (content).
pub fn point_id(document_id: &str, chunk_index: usize) -> u64 {
    let digest = Sha256::digest(format!("{document_id}\0{chunk_index}").as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}
