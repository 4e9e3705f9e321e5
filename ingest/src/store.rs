//! Stage 4, **store**: chunks with their vectors in Qdrant's embedded engine (qdrant-edge),
//! a directory on disk.
//!
//! Each chunk is one point with a named dense vector (`dense`, cosine) and a named sparse
//! vector (`bm25`, IDF applied by the engine at query time), and a [`ChunkPayload`].
//! Point ids are derived from `(document_id, chunk_index)`: content is stored once, however
//! many sources (paths, uploads) hold it. Each chunk lists those sources in `origins`, with
//! the flattened `sources`, `collections` and `tags` that filters use.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use qdrant_edge::external::ordered_float::OrderedFloat;
use qdrant_edge::{
    Condition, CountRequest, CreateIndex, Distance, EdgeConfig, EdgeShard, EdgeSparseVectorParams,
    EdgeVectorParams, FacetRequest, FacetValue, FieldCondition, FieldIndexOperations, Filter,
    JsonPath, Match, Mmr, Modifier, NamedQuery, Payload, PayloadFieldSchema, PayloadOps,
    PayloadSchemaType, PointId, PointInsertOperations, PointOperations, PointStruct, Prefetch,
    QueryEnum, QueryRequest, ScoringQuery, ScrollRequest, SetPayloadOp, UpdateOperation,
    ValueVariants, Vector, VectorInternal, Vectors, WithPayloadInterface, WithVector,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::embed::Embedding;
use crate::{Error, Result};

pub const DENSE: &str = "dense";
pub const SPARSE: &str = "bm25";

/// Byte range in the extracted document text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

/// What is stored with every chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkPayload {
    pub document_id: String,
    /// The first source that holds this content (cited); every one is in `origins`.
    pub source: String,
    pub title: String,
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
    pub span: Span,
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    pub collections: Vec<String>,
}

/// One source of a document and the metadata it was ingested with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collection: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
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
struct Derived {
    source: String,
    collection: Option<String>,
    sources: Vec<String>,
    collections: Vec<String>,
    tags: Vec<String>,
}

impl Derived {
    fn of(origins: &[Origin]) -> Self {
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
    pub const ALL: [SearchMode; 3] = [SearchMode::Dense, SearchMode::Sparse, SearchMode::Hybrid];

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
    Rrf,
    #[default]
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
    pub rrf_k: usize,
    pub dense_weight: f32,
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
    /// Ties keep no particular order (as in the engine).
    pub fn fuse(&self, dense: &[(u64, f32)], sparse: &[(u64, f32)]) -> Vec<(u64, f32)> {
        let mut fused: Vec<(u64, f32)> = Vec::with_capacity(dense.len() + sparse.len());
        let mut add = |id: u64, score: f32| match fused.iter_mut().find(|p| p.0 == id) {
            Some(p) => p.1 += score,
            None => fused.push((id, score)),
        };
        for (list, weight) in [(dense, self.dense_weight), (sparse, self.sparse_weight)] {
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
        fused.sort_by(|a, b| b.1.total_cmp(&a.1));
        fused
    }
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
    pub payload: ChunkPayload,
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

fn any_of(field: &str, values: &[String]) -> Result<Condition> {
    let should = values
        .iter()
        .map(|v| keyword(field, v))
        .collect::<Result<Vec<_>>>()?;
    Ok(Condition::Filter(Filter {
        should: Some(should),
        ..Default::default()
    }))
}

/// A stored document, as listed by [`Store::documents`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DocumentInfo {
    pub id: String,
    pub source: String,
    pub title: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collection: Option<String>,
    pub tags: Vec<String>,
    /// Every source holding this content (identical files are stored once).
    pub sources: Vec<String>,
    pub chunks: usize,
    /// How many chunks the document was split into; `chunks == chunks_total` when complete.
    pub chunks_total: usize,
}

/// One version of a document: its content id at a source.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Version {
    pub document_id: String,
    pub source: String,
}

/// The embedded vector store.
///
/// Readers never see half a document or two versions of one source: a version being
/// written is hidden from search until [`Store::publish`], which in one step shows it and
/// hides the versions it replaces; those are then deleted. Searches hold the visibility
/// lock for their duration, so a search that started before a swap finishes on the old
/// state.
pub struct Store {
    shard: EdgeShard,
    path: PathBuf,
    /// Documents being written or about to be deleted.
    hidden: parking_lot::RwLock<BTreeSet<String>>,
    journal: PathBuf,
    recovered: Vec<Version>,
    /// Versions rolled back after a crash, kept in `failed.json` until their source is
    /// ingested again.
    failed: parking_lot::Mutex<Vec<Version>>,
    failed_file: PathBuf,
    /// Counts changes to what search can see (see [`Store::version`]).
    changes: std::sync::atomic::AtomicU64,
}

struct ChangeGuard<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for ChangeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What an unfinished write was doing, persisted so that a crash can be rolled back or
/// forward when the store is opened again.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum JournalEntry {
    /// `version` is being written: roll back (delete it).
    Writing { version: Version },
    /// `version` is complete: roll forward (add `origin` to it, detach `replaces`).
    Publishing {
        version: Version,
        #[serde(default)]
        origin: Option<Origin>,
        replaces: Vec<Version>,
    },
}

fn write_durably(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
    f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

fn parse_payload(payload: Payload) -> Result<ChunkPayload> {
    serde_json::from_value(serde_json::Value::Object(payload.0.into_iter().collect()))
        .map_err(|e| Error::Store(format!("malformed chunk payload: {e}")))
}

fn store_err(e: impl std::fmt::Display) -> Error {
    Error::Store(e.to_string())
}

fn key(name: &str) -> Result<JsonPath> {
    JsonPath::try_from(name).map_err(|_| Error::Store(format!("invalid payload key {name:?}")))
}

fn keyword(field: &str, value: &str) -> Result<Condition> {
    Ok(Condition::Field(FieldCondition::new_match(
        key(field)?,
        Match::new_value(ValueVariants::String(value.to_string())),
    )))
}

fn match_keyword(field: &str, value: &str) -> Result<Filter> {
    Ok(Filter::new_must(keyword(field, value)?))
}

/// The embedding model an index was built with, in `index.json` beside the engine's files.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Identity {
    /// Layout of the points; older layouts cannot be read.
    #[serde(default)]
    format: u32,
    embedding_model_sha256: String,
    dim: usize,
}

/// 2: one point per chunk of content, shared by every source (`origins`).
const FORMAT: u32 = 2;

fn check_identity(dir: &Path, dim: usize, model: &str) -> Result<()> {
    let file = dir.join("index.json");
    let want = Identity {
        format: FORMAT,
        embedding_model_sha256: model.to_string(),
        dim,
    };
    match std::fs::read(&file) {
        Ok(bytes) => {
            let have: Identity = serde_json::from_slice(&bytes)
                .map_err(|e| Error::Store(format!("{}: {e}", file.display())))?;
            if have.format != want.format {
                return Err(Error::Store(format!(
                    "the index in {} was written by an older docent (format {}, this one reads {FORMAT}); use a new data directory and ingest again",
                    dir.display(),
                    have.format
                )));
            }
            if have != want {
                return Err(Error::Store(format!(
                    "the index in {} was built with another embedding model (sha256 {}…, {} dimensions); use a new data directory or re-ingest into an empty one",
                    dir.display(),
                    &have.embedding_model_sha256.get(..12).unwrap_or(""),
                    have.dim
                )));
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let tmp = dir.join("index.json.tmp");
            let json = serde_json::to_vec_pretty(&want).map_err(store_err)?;
            std::fs::write(&tmp, json).map_err(|e| Error::io(&tmp, e))?;
            std::fs::rename(&tmp, &file).map_err(|e| Error::io(&file, e))
        }
        Err(e) => Err(Error::io(&file, e)),
    }
}

/// Deterministic point id of a chunk of a document (content).
pub fn point_id(document_id: &str, chunk_index: usize) -> u64 {
    let digest = Sha256::digest(format!("{document_id}\0{chunk_index}").as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}

impl Store {
    /// Opens the store in `dir` (created if needed) for dense vectors of size `dim` made by
    /// the embedding model with SHA-256 `model`. Fails with a clear message if the directory
    /// holds vectors of another model or size.
    pub fn open(dir: &Path, dim: usize, model: &str) -> Result<Self> {
        let path = dir.join("qdrant");
        std::fs::create_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        check_identity(dir, dim, model)?;
        let config = EdgeConfig::builder()
            .vector(
                DENSE,
                EdgeVectorParams::builder(dim, Distance::Cosine).build(),
            )
            .sparse_vector(
                SPARSE,
                EdgeSparseVectorParams::builder()
                    .modifier(Modifier::Idf)
                    .build(),
            )
            .build();
        let shard = EdgeShard::load(&path, Some(config)).map_err(|e| {
            let e = e.to_string();
            if e.contains("WouldBlock") {
                Error::Store(format!(
                    "the index at {} is in use by another docent process (one process may open it at a time; while the service runs, upload through POST /v1/documents)",
                    dir.display()
                ))
            } else {
                Error::Store(format!("cannot open the index at {}: {e}", path.display()))
            }
        })?;
        let journal = dir.join("journal");
        std::fs::create_dir_all(&journal).map_err(|e| Error::io(&journal, e))?;
        let mut store = Store {
            shard,
            path,
            hidden: Default::default(),
            journal,
            recovered: Vec::new(),
            failed: Default::default(),
            failed_file: dir.join("failed.json"),
            changes: Default::default(),
        };
        if let Ok(bytes) = std::fs::read(&store.failed_file) {
            *store.failed.get_mut() = serde_json::from_slice(&bytes).unwrap_or_default();
        }
        for field in ["document_id", "sources", "collections", "tags"] {
            store
                .shard
                .update(UpdateOperation::FieldIndexOperation(
                    FieldIndexOperations::CreateIndex(CreateIndex {
                        field_name: key(field)?,
                        field_schema: Some(PayloadFieldSchema::FieldType(
                            PayloadSchemaType::Keyword,
                        )),
                    }),
                ))
                .map_err(store_err)?;
        }
        store.recover()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Versions whose writing was interrupted (a crash) and that were rolled back when the
    /// store was opened.
    pub fn recovered(&self) -> &[Version] {
        &self.recovered
    }

    /// Documents marked failed because a crash interrupted their ingest (until their source
    /// is ingested again).
    pub fn failed(&self) -> Vec<Version> {
        self.failed.lock().clone()
    }

    fn set_failed(&self, update: impl FnOnce(&mut Vec<Version>)) -> Result<()> {
        let mut failed = self.failed.lock();
        let before = failed.clone();
        update(&mut failed);
        if *failed != before {
            let bytes = serde_json::to_vec_pretty(&*failed).map_err(store_err)?;
            write_durably(&self.failed_file, &bytes)?;
        }
        Ok(())
    }

    fn journal_file(&self, v: &Version) -> PathBuf {
        let h = Sha256::digest(format!("{}\0{}", v.document_id, v.source).as_bytes());
        self.journal.join(format!("{}.json", hex::encode(&h[..16])))
    }

    fn journal_write(&self, v: &Version, entry: &JournalEntry) -> Result<()> {
        let bytes = serde_json::to_vec(entry).map_err(store_err)?;
        write_durably(&self.journal_file(v), &bytes)
    }

    fn journal_clear(&self, v: &Version) -> Result<()> {
        let f = self.journal_file(v);
        match std::fs::remove_file(&f) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(&f, e)),
            _ => Ok(()),
        }
    }

    /// Rolls unfinished writes back (a version being written) or forward (a version being
    /// published).
    fn recover(&mut self) -> Result<()> {
        let entries = std::fs::read_dir(&self.journal).map_err(|e| Error::io(&self.journal, e))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        for file in files {
            let entry: Option<JournalEntry> = std::fs::read(&file)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match entry {
                Some(JournalEntry::Writing { version }) => {
                    // content is written only when no source holds it yet
                    self.delete_document(&version.document_id)?;
                    tracing::warn!(source = %version.source, "rolled back an interrupted ingest");
                    let v = version.clone();
                    self.set_failed(|f| {
                        f.retain(|x| x.source != v.source);
                        f.push(v);
                    })?;
                    self.recovered.push(version);
                }
                Some(JournalEntry::Publishing {
                    version,
                    origin,
                    replaces,
                }) => {
                    if let Some(o) = &origin {
                        if !self.origins(&version.document_id)?.is_empty() {
                            self.attach(&version.document_id, o)?;
                        }
                    }
                    for old in replaces.iter().filter(|old| **old != version) {
                        self.detach(&old.document_id, &old.source)?;
                    }
                }
                None => {}
            }
            std::fs::remove_file(&file).map_err(|e| Error::io(&file, e))?;
        }
        self.shard.flush();
        Ok(())
    }

    /// Writes chunks; an existing point with the same id is replaced.
    pub fn upsert(&self, chunks: Vec<(ChunkPayload, Embedding)>) -> Result<()> {
        let _changed = self.change_on_return();
        if chunks.is_empty() {
            return Ok(());
        }
        let points = chunks
            .into_iter()
            .map(|(payload, emb)| {
                let id = point_id(&payload.document_id, payload.chunk_index);
                let json = serde_json::to_value(&payload).map_err(store_err)?;
                let vectors = Vectors::new_named([
                    (DENSE, Vector::new_dense(emb.dense)),
                    (SPARSE, Vector::from(emb.sparse)),
                ]);
                Ok(PointStruct::new(PointId::NumId(id), vectors, json).into())
            })
            .collect::<Result<Vec<_>>>()?;
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::UpsertPoints(PointInsertOperations::PointsList(points)),
            ))
            .map_err(store_err)
    }

    /// Removes every chunk of a document.
    pub fn delete_document(&self, document_id: &str) -> Result<()> {
        let _changed = self.change_on_return();
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePointsByFilter(match_keyword("document_id", document_id)?),
            ))
            .map_err(store_err)
    }

    /// The sources holding a document and their metadata (empty if it is not stored).
    pub fn origins(&self, document_id: &str) -> Result<Vec<Origin>> {
        Ok(self
            .first_payload(document_id)?
            .map(|p| {
                if p.origins.is_empty() {
                    vec![Origin {
                        source: p.source,
                        collection: p.collection,
                        tags: p.tags,
                    }]
                } else {
                    p.origins
                }
            })
            .unwrap_or_default())
    }

    fn set_origins(&self, document_id: &str, origins: &[Origin]) -> Result<()> {
        let mut payload = serde_json::to_value(Derived::of(origins)).map_err(store_err)?;
        if let Some(map) = payload.as_object_mut() {
            map.insert(
                "origins".into(),
                serde_json::to_value(origins).map_err(store_err)?,
            );
        }
        let serde_json::Value::Object(map) = payload else {
            return Err(Error::Store("payload is not an object".into()));
        };
        self.shard
            .update(UpdateOperation::PayloadOperation(PayloadOps::SetPayload(
                SetPayloadOp {
                    payload: Payload(map.into_iter().collect()),
                    points: None,
                    filter: Some(match_keyword("document_id", document_id)?),
                    key: None,
                },
            )))
            .map_err(store_err)
    }

    /// Adds `origin` to a stored document (or updates its metadata). Returns whether the
    /// source was new to the document.
    pub fn attach(&self, document_id: &str, origin: &Origin) -> Result<bool> {
        let _changed = self.change_on_return();
        let mut origins = self.origins(document_id)?;
        if origins.is_empty() {
            return Err(Error::Store(format!(
                "document {document_id} is not stored"
            )));
        }
        let new = match origins.iter_mut().find(|o| o.source == origin.source) {
            Some(o) if o == origin => return Ok(false),
            Some(o) => {
                *o = origin.clone();
                false
            }
            None => {
                origins.push(origin.clone());
                true
            }
        };
        self.set_origins(document_id, &origins)?;
        Ok(new)
    }

    /// Removes `source` from a document's origins; a document left without sources is
    /// deleted.
    pub fn detach(&self, document_id: &str, source: &str) -> Result<()> {
        let _changed = self.change_on_return();
        let mut origins = self.origins(document_id)?;
        let before = origins.len();
        origins.retain(|o| o.source != source);
        if origins.is_empty() {
            self.delete_document(document_id)
        } else if origins.len() != before {
            self.set_origins(document_id, &origins)
        } else {
            Ok(())
        }
    }

    /// Number of chunks of a document made by `pipeline`.
    pub fn stored_chunks(&self, document_id: &str, pipeline: &str) -> Result<usize> {
        self.count(Some(Filter {
            must: Some(vec![
                keyword("document_id", document_id)?,
                keyword("pipeline", pipeline)?,
            ]),
            ..Default::default()
        }))
    }

    /// Number of chunks stored for a document.
    pub fn chunk_count(&self, document_id: &str) -> Result<usize> {
        self.count(Some(match_keyword("document_id", document_id)?))
    }

    /// Number of chunks in the store.
    pub fn len(&self) -> Result<usize> {
        self.count(None)
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    fn count(&self, filter: Option<Filter>) -> Result<usize> {
        self.shard
            .count(CountRequest {
                filter,
                exact: true,
            })
            .map_err(store_err)
    }

    /// Ids of the documents stored for a source.
    pub fn documents_of_source(&self, source: &str) -> Result<BTreeSet<String>> {
        let filter = match_keyword("sources", source)?;
        let mut ids = BTreeSet::new();
        let mut offset = None;
        loop {
            let (records, next) = self
                .shard
                .scroll(ScrollRequest {
                    offset,
                    limit: Some(256),
                    filter: Some(filter.clone()),
                    with_payload: Some(WithPayloadInterface::Fields(vec![key("document_id")?])),
                    with_vector: WithVector::Bool(false),
                    order_by: None,
                })
                .map_err(store_err)?;
            for r in records {
                if let Some(id) = r
                    .payload
                    .as_ref()
                    .and_then(|p| p.0.get("document_id"))
                    .and_then(|v| v.as_str())
                {
                    ids.insert(id.to_string());
                }
            }
            match next {
                Some(n) => offset = Some(n),
                None => break,
            }
        }
        Ok(ids)
    }

    /// Hides `version` from search while it is written. Content is written only when no
    /// source holds it yet, so the whole document is hidden.
    pub fn begin(&self, version: &Version) -> Result<()> {
        self.journal_write(
            version,
            &JournalEntry::Writing {
                version: version.clone(),
            },
        )?;
        self.hidden.write().insert(version.document_id.clone());
        Ok(())
    }

    /// Makes `version` what its source shows, in one step for readers: shows the document
    /// (written since [`Store::begin`], or already stored under other sources, in which
    /// case `origin` is added to it), hides the documents in `replaces` that no other
    /// source holds, then removes `version.source` from each of `replaces`.
    pub fn publish(
        &self,
        version: &Version,
        origin: Option<&Origin>,
        replaces: &[Version],
    ) -> Result<()> {
        let _changed = self.change_on_return();
        // the new version must be durable before the journal says it is complete
        self.shard.flush();
        self.journal_write(
            version,
            &JournalEntry::Publishing {
                version: version.clone(),
                origin: origin.cloned(),
                replaces: replaces.to_vec(),
            },
        )?;
        let mut vanishing = Vec::new();
        for old in replaces {
            let origins = self.origins(&old.document_id)?;
            if origins.iter().all(|o| o.source == old.source) {
                vanishing.push(old.document_id.clone());
            }
        }
        {
            let mut hidden = self.hidden.write();
            hidden.remove(&version.document_id);
            hidden.extend(vanishing.iter().cloned());
        }
        let mut result = match origin {
            Some(o) => self.attach(&version.document_id, o).map(|_| ()),
            None => Ok(()),
        };
        for old in replaces {
            if let Err(e) = self.detach(&old.document_id, &old.source) {
                result = Err(e);
            }
        }
        if result.is_ok() {
            let mut hidden = self.hidden.write();
            for id in &vanishing {
                hidden.remove(id);
            }
            drop(hidden);
            self.journal_clear(version)?;
        }
        self.set_failed(|f| f.retain(|x| x.source != version.source))?;
        result
    }

    /// Deletes a version that could not be written completely.
    pub fn abort(&self, version: &Version) -> Result<()> {
        let _changed = self.change_on_return();
        self.delete_document(&version.document_id)?;
        self.hidden.write().remove(&version.document_id);
        self.journal_clear(version)
    }

    /// Nearest chunks to a dense query vector (for tests that have no sparse vector).
    #[cfg(test)]
    fn search_dense(&self, query: &[f32], limit: usize, only: &SearchFilter) -> Result<Vec<Hit>> {
        let q = Embedding {
            dense: query.to_vec(),
            sparse: Default::default(),
        };
        self.search(&q, SearchMode::Dense, &Fusion::default(), limit, only)
    }

    /// The best `limit` chunks for a query among published versions that pass `only`
    /// (applied inside the search): by dense similarity, by BM25 (IDF from the index), or
    /// both fused as `fusion` says over the `fusion.candidates`× deeper result lists of
    /// each.
    pub fn search(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<Hit>> {
        self.query(query, mode, fusion, limit, only, true)?
            .into_iter()
            .map(|p| {
                let payload = p
                    .payload
                    .ok_or_else(|| Error::Store("point without payload".into()))?;
                Ok(Hit {
                    payload: parse_payload(payload)?,
                    score: p.score,
                })
            })
            .collect()
    }

    /// [`Self::search`] without the payloads: point ids (see [`point_id`]) and scores,
    /// best first. Cheaper when only the scores are needed.
    pub fn search_scores(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<(u64, f32)>> {
        self.query(query, mode, fusion, limit, only, false)?
            .into_iter()
            .map(|p| match p.id {
                PointId::NumId(id) => Ok((id, p.score)),
                PointId::Uuid(u) => Err(Error::Store(format!("unexpected point id {u}"))),
            })
            .collect()
    }

    fn query(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
        with_payload: bool,
    ) -> Result<Vec<qdrant_edge::ScoredPoint>> {
        let hidden = self.hidden.read();
        let mut must = Vec::new();
        if let Some(c) = &only.collection {
            must.push(keyword("collections", c)?);
        }
        if !only.tags.is_empty() {
            must.push(any_of("tags", &only.tags)?);
        }
        if !only.document_ids.is_empty() {
            must.push(any_of("document_id", &only.document_ids)?);
        }
        let must_not = if hidden.is_empty() {
            Vec::new()
        } else {
            let ids: Vec<String> = hidden.iter().cloned().collect();
            vec![any_of("document_id", &ids)?]
        };
        let filter = (!must.is_empty() || !must_not.is_empty()).then(|| Filter {
            must: (!must.is_empty()).then_some(must),
            must_not: (!must_not.is_empty()).then_some(must_not),
            ..Default::default()
        });
        let nearest = |using: &str, v: VectorInternal| {
            ScoringQuery::Vector(QueryEnum::Nearest(NamedQuery {
                query: v,
                using: Some(using.into()),
            }))
        };
        let dense = || nearest(DENSE, VectorInternal::from(query.dense.clone()));
        let sparse = || nearest(SPARSE, VectorInternal::from(query.sparse.clone()));
        let prefetch = |q: ScoringQuery| Prefetch {
            prefetches: vec![],
            query: Some(q),
            limit: limit.max(1) * fusion.candidates.max(1),
            params: None,
            filter: None,
            score_threshold: None,
        };
        let (mut prefetches, mut scoring) = match mode {
            SearchMode::Dense => (vec![], dense()),
            SearchMode::Sparse => (vec![], sparse()),
            SearchMode::Hybrid => (
                vec![prefetch(dense()), prefetch(sparse())],
                ScoringQuery::Fusion(match fusion.method {
                    FusionMethod::Rrf => qdrant_edge::Fusion::Rrf {
                        k: fusion.rrf_k,
                        weights: Some(vec![
                            OrderedFloat(fusion.dense_weight),
                            OrderedFloat(fusion.sparse_weight),
                        ]),
                    },
                    FusionMethod::Dbsf => qdrant_edge::Fusion::Dbsf,
                }),
            ),
        };
        if let Some(lambda) = fusion.mmr_lambda {
            // the ranking becomes the candidate pool MMR picks `limit` chunks from
            let pool = limit.max(1) * fusion.candidates.max(1);
            prefetches = vec![Prefetch {
                prefetches,
                query: Some(scoring),
                limit: pool,
                params: None,
                filter: None,
                score_threshold: None,
            }];
            scoring = ScoringQuery::Mmr(Mmr {
                vector: VectorInternal::from(query.dense.clone()),
                using: DENSE.into(),
                lambda: OrderedFloat(lambda),
                candidates_limit: pool,
            });
        }
        let request = QueryRequest {
            prefetches,
            query: Some(scoring),
            filter,
            score_threshold: None,
            limit,
            offset: 0,
            params: None,
            with_vector: WithVector::Bool(false),
            with_payload: WithPayloadInterface::Bool(with_payload),
        };
        let points = self.shard.query(request).map_err(store_err)?;
        drop(hidden);
        Ok(points)
    }

    /// The chunks of scored point ids (from [`Self::search_scores`] or a fusion of such
    /// lists), in the order given, with their scores; ids no longer stored are skipped.
    pub fn hits(&self, scored: &[(u64, f32)]) -> Result<Vec<Hit>> {
        let ids: Vec<u64> = scored.iter().map(|p| p.0).collect();
        let mut found = self.payloads(&ids)?;
        Ok(scored
            .iter()
            .filter_map(|&(id, score)| found.remove(&id).map(|payload| Hit { payload, score }))
            .collect())
    }

    /// The stored payloads of point ids, in one read; ids not stored are absent.
    pub fn payloads(&self, ids: &[u64]) -> Result<std::collections::HashMap<u64, ChunkPayload>> {
        let ids: Vec<PointId> = ids.iter().map(|&id| PointId::NumId(id)).collect();
        let records = self
            .shard
            .retrieve(
                &ids,
                Some(WithPayloadInterface::Bool(true)),
                Some(WithVector::Bool(false)),
            )
            .map_err(store_err)?;
        records
            .into_iter()
            .map(|r| {
                let PointId::NumId(id) = r.id else {
                    return Err(Error::Store(format!("unexpected point id {}", r.id)));
                };
                let payload = r
                    .payload
                    .ok_or_else(|| Error::Store("point without payload".into()))?;
                Ok((id, parse_payload(payload)?))
            })
            .collect()
    }

    /// Builds the vector indexes (HNSW) of segments large enough to need one and merges
    /// small segments; until then search is exact over the unindexed segments. Blocking,
    /// seconds for large indexes; searches and writes go on meanwhile. Returns whether
    /// anything changed.
    pub fn optimize(&self) -> Result<bool> {
        self.shard.optimize().map_err(store_err)
    }

    /// Published documents passing `only` (its `document_ids` are ignored), sorted by id;
    /// at most `limit` with ids greater than `after`. Returns the page and whether more follow.
    pub fn documents(
        &self,
        only: &SearchFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<DocumentInfo>, bool)> {
        let mut must = Vec::new();
        if let Some(c) = &only.collection {
            must.push(keyword("collections", c)?);
        }
        if !only.tags.is_empty() {
            must.push(any_of("tags", &only.tags)?);
        }
        let hidden: Vec<String> = self.hidden.read().iter().cloned().collect();
        let facet = self
            .shard
            .facet(FacetRequest {
                key: key("document_id")?,
                limit: usize::MAX / 2,
                filter: (!must.is_empty()).then(|| Filter {
                    must: Some(must),
                    ..Default::default()
                }),
                exact: true,
            })
            .map_err(store_err)?;
        let mut ids: Vec<(String, usize)> = facet
            .hits
            .into_iter()
            .filter_map(|h| match h.value {
                FacetValue::Keyword(id) => Some((id, h.count)),
                _ => None,
            })
            .filter(|(id, _)| !hidden.contains(id))
            .filter(|(id, _)| after.is_none_or(|a| id.as_str() > a))
            .collect();
        ids.sort();
        let more = ids.len() > limit;
        ids.truncate(limit);
        let docs = ids
            .into_iter()
            .filter_map(|(id, chunks)| match self.describe(&id, chunks) {
                Ok(Some(d)) => Some(Ok(d)),
                Ok(None) => None,
                Err(e) => Some(Err(e)),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((docs, more))
    }

    /// One published document, or `None`.
    pub fn document(&self, id: &str) -> Result<Option<DocumentInfo>> {
        if self.hidden.read().contains(id) {
            return Ok(None);
        }
        let chunks = self.chunk_count(id)?;
        if chunks == 0 {
            return Ok(None);
        }
        self.describe(id, chunks)
    }

    /// One chunk of a document, by its index.
    pub fn chunk(&self, document_id: &str, chunk_index: usize) -> Result<Option<ChunkPayload>> {
        let id = point_id(document_id, chunk_index);
        Ok(self.payloads(&[id])?.remove(&id))
    }

    /// The payload of one chunk of a document (the fields every chunk shares).
    fn first_payload(&self, id: &str) -> Result<Option<ChunkPayload>> {
        let (records, _) = self
            .shard
            .scroll(ScrollRequest {
                offset: None,
                limit: Some(1),
                filter: Some(match_keyword("document_id", id)?),
                with_payload: Some(WithPayloadInterface::Bool(true)),
                with_vector: WithVector::Bool(false),
                order_by: None,
            })
            .map_err(store_err)?;
        let Some(payload) = records.into_iter().next().and_then(|r| r.payload) else {
            return Ok(None);
        };
        parse_payload(payload).map(Some)
    }

    fn describe(&self, id: &str, chunks: usize) -> Result<Option<DocumentInfo>> {
        Ok(self.first_payload(id)?.map(|p| DocumentInfo {
            sources: p.all_sources(),
            id: p.document_id,
            source: p.source,
            title: p.title,
            collection: p.collection,
            tags: p.tags,
            chunks,
            chunks_total: p.chunks_total,
        }))
    }

    /// A number that changes whenever what search can see may have changed (a document
    /// written, published, rolled back, deleted, or a source added or removed); caches of
    /// answers compare it.
    pub fn version(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Bumps [`Self::version`] when the returned guard drops, i.e. after the change is
    /// done (whichever way the method returns), so an answer computed from the old state
    /// is never filed under the new version.
    fn change_on_return(&self) -> ChangeGuard<'_> {
        ChangeGuard(&self.changes)
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) {
        self.shard.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qdrant_edge::SparseVector;

    fn emb(v: [f32; 3]) -> Embedding {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        Embedding {
            dense: v.iter().map(|x| x / n).collect(),
            sparse: SparseVector {
                indices: vec![1],
                values: vec![1.0],
            },
        }
    }

    fn payload(doc: &str, i: usize, source: &str) -> ChunkPayload {
        payload_in(doc, i, source, None, &[])
    }

    fn payload_in(
        doc: &str,
        i: usize,
        source: &str,
        collection: Option<&str>,
        tags: &[&str],
    ) -> ChunkPayload {
        let mut p = ChunkPayload {
            document_id: doc.into(),
            source: String::new(),
            title: "t".into(),
            chunk_index: i,
            chunks_total: 1,
            pipeline: "p".into(),
            page: None,
            span: Span {
                start: i,
                end: i + 1,
            },
            text: format!("{doc}-{i}"),
            collection: None,
            tags: vec![],
            origins: vec![],
            sources: vec![],
            collections: vec![],
        };
        p.set_origins(vec![origin(source, collection, tags)]);
        p
    }

    fn origin(source: &str, collection: Option<&str>, tags: &[&str]) -> Origin {
        Origin {
            source: source.into(),
            collection: collection.map(String::from),
            tags: tags.iter().map(|t| t.to_string()).collect(),
        }
    }

    #[test]
    fn upsert_search_delete_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path(), 3, "m").unwrap();
            s.upsert(vec![
                (payload("a", 0, "/a"), emb([1.0, 0.0, 0.0])),
                (payload("a", 1, "/a"), emb([0.0, 1.0, 0.0])),
                (payload("b", 0, "/b"), emb([0.0, 0.0, 1.0])),
            ])
            .unwrap();
            // re-upserting the same chunk does not duplicate it
            s.upsert(vec![(payload("a", 0, "/a"), emb([1.0, 0.0, 0.0]))])
                .unwrap();
            assert_eq!(s.len().unwrap(), 3);
            let hits = s
                .search_dense(&emb([0.1, 1.0, 0.0]).dense, 2, &SearchFilter::default())
                .unwrap();
            assert_eq!(hits[0].payload, payload("a", 1, "/a"));
            assert!(hits[0].score > hits[1].score);
            assert_eq!(s.chunk_count("a").unwrap(), 2);
            assert_eq!(s.chunk("a", 1).unwrap(), Some(payload("a", 1, "/a")));
            assert_eq!(s.chunk("a", 7).unwrap(), None);
            assert_eq!(
                s.documents_of_source("/a")
                    .unwrap()
                    .into_iter()
                    .collect::<Vec<_>>(),
                vec!["a".to_string()]
            );
            s.delete_document("a").unwrap();
            assert_eq!(s.len().unwrap(), 1);
            s.flush();
        }
        // persisted across reopen
        let s = Store::open(dir.path(), 3, "m").unwrap();
        assert_eq!(s.len().unwrap(), 1);
        assert_eq!(s.chunk_count("b").unwrap(), 1);
        drop(s);
        // another model or vector size is refused with a clear error
        let err = Store::open(dir.path(), 4, "m").err().unwrap().to_string();
        assert!(err.contains("another embedding model"), "{err}");
        let err = Store::open(dir.path(), 3, "other")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("another embedding model"), "{err}");
    }

    #[test]
    fn readers_see_exactly_one_version_while_it_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(Store::open(dir.path(), 3, "m").unwrap());
        const N: usize = 20;
        let write = |doc: &str| {
            let v = Version {
                document_id: doc.into(),
                source: "/s".into(),
            };
            store.begin(&v).unwrap();
            for i in 0..N {
                // written one chunk at a time, as batches are
                store
                    .upsert(vec![(payload(doc, i, "/s"), emb([1.0, i as f32, 0.5]))])
                    .unwrap();
            }
            v
        };
        let v1 = write("v1");
        store.publish(&v1, None, &[]).unwrap();
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        let stop = AtomicBool::new(false);
        let checks = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(Relaxed) {
                    let hits = store
                        .search_dense(&emb([1.0, 3.0, 0.5]).dense, 2 * N, &SearchFilter::default())
                        .unwrap();
                    assert_eq!(hits.len(), N, "saw {} chunks", hits.len());
                    let first = &hits[0].payload.document_id;
                    assert!(hits.iter().all(|h| &h.payload.document_id == first));
                    checks.fetch_add(1, Relaxed);
                }
            });
            // replace back and forth until the reader has checked many times (bounded)
            let mut current = v1.clone();
            let mut round = 0;
            while round < 6 || (checks.load(Relaxed) < 50 && round < 2000) {
                let next = write(if round % 2 == 0 { "v2" } else { "v1" });
                store
                    .publish(&next, None, std::slice::from_ref(&current))
                    .unwrap();
                current = next;
                round += 1;
            }
            stop.store(true, Relaxed);
        });
        assert!(checks.load(Relaxed) > 0);
        assert_eq!(store.len().unwrap(), N);
        // an aborted version leaves nothing
        let v3 = write("v3");
        store.abort(&v3).unwrap();
        assert_eq!(store.len().unwrap(), N);
    }

    #[test]
    fn filters_apply_inside_the_search() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 3, "m").unwrap();
        let mut points = Vec::new();
        for (doc, coll, tags) in [
            ("a", Some("zoo"), vec!["animals"]),
            ("b", Some("zoo"), vec!["plants"]),
            ("c", None, vec!["animals", "x"]),
        ] {
            for i in 0..5 {
                let p = payload_in(doc, i, &format!("/{doc}"), coll, &tags);
                points.push((p, emb([1.0, i as f32, doc.len() as f32])));
            }
        }
        s.upsert(points).unwrap();
        let q = emb([1.0, 2.0, 1.0]).dense;
        let docs = |f: SearchFilter| {
            let mut d: Vec<String> = s
                .search_dense(&q, 3, &f)
                .unwrap()
                .into_iter()
                .map(|h| h.payload.document_id)
                .collect();
            d.sort();
            d.dedup();
            d
        };
        // the limit is filled from matching chunks only (filtering inside the search)
        let zoo = SearchFilter {
            collection: Some("zoo".into()),
            tags: vec!["plants".into()],
            ..Default::default()
        };
        assert_eq!(s.search_dense(&q, 3, &zoo).unwrap().len(), 3);
        assert_eq!(docs(zoo), vec!["b"]);
        let tagged = SearchFilter {
            tags: vec!["animals".into()],
            ..Default::default()
        };
        let hits = s.search_dense(&q, 15, &tagged).unwrap();
        assert_eq!(hits.len(), 10);
        assert!(hits
            .iter()
            .all(|h| h.payload.tags.contains(&"animals".to_string())));
        let ids = SearchFilter {
            document_ids: vec!["c".into(), "a".into()],
            ..Default::default()
        };
        let all: std::collections::BTreeSet<String> = s
            .search_dense(&q, 15, &ids)
            .unwrap()
            .into_iter()
            .map(|h| h.payload.document_id)
            .collect();
        assert_eq!(all.into_iter().collect::<Vec<_>>(), vec!["a", "c"]);
    }

    #[test]
    fn documents_are_listed_in_pages_with_filters() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 3, "m").unwrap();
        let mut points = Vec::new();
        for (doc, n, coll) in [("a", 2, Some("x")), ("b", 3, None), ("c", 1, Some("x"))] {
            for i in 0..n {
                let p = payload_in(doc, i, &format!("/{doc}"), coll, &[]);
                points.push((p, emb([1.0, i as f32, 0.0])));
            }
        }
        s.upsert(points).unwrap();
        let all = SearchFilter::default();
        let (page, more) = s.documents(&all, None, 2).unwrap();
        assert_eq!(
            page.iter()
                .map(|d| (d.id.as_str(), d.chunks))
                .collect::<Vec<_>>(),
            vec![("a", 2), ("b", 3)]
        );
        assert!(more);
        let (page, more) = s.documents(&all, Some("b"), 2).unwrap();
        assert_eq!(page.len(), 1);
        assert_eq!(page[0].id, "c");
        assert!(!more);
        let x = SearchFilter {
            collection: Some("x".into()),
            ..Default::default()
        };
        let (page, _) = s.documents(&x, None, 10).unwrap();
        assert_eq!(
            page.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
            vec!["a", "c"]
        );
        assert_eq!(s.document("b").unwrap().unwrap().source, "/b");
        assert!(s.document("zzz").unwrap().is_none());
    }

    #[test]
    fn an_interrupted_write_is_rolled_back_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let v = |d: &str| Version {
            document_id: d.into(),
            source: "/s".into(),
        };
        {
            let s = Store::open(dir.path(), 3, "m").unwrap();
            s.begin(&v("old")).unwrap();
            s.upsert(vec![(payload("old", 0, "/s"), emb([1.0, 0.0, 0.0]))])
                .unwrap();
            s.publish(&v("old"), None, &[]).unwrap();
            // a new version half written, then the process "dies" (no publish, no abort)
            s.begin(&v("new")).unwrap();
            s.upsert(vec![(payload("new", 0, "/s"), emb([1.0, 0.0, 0.0]))])
                .unwrap();
            s.flush();
        }
        let s = Store::open(dir.path(), 3, "m").unwrap();
        assert_eq!(s.recovered(), &[v("new")]);
        assert_eq!(s.chunk_count("new").unwrap(), 0);
        assert_eq!(s.chunk_count("old").unwrap(), 1);
        drop(s);
        // nothing left to recover the next time, but it stays marked failed
        let s = Store::open(dir.path(), 3, "m").unwrap();
        assert!(s.recovered().is_empty());
        assert_eq!(s.failed(), vec![v("new")]);
        // until its source is written again
        s.begin(&v("newer")).unwrap();
        s.publish(&v("newer"), None, &[v("old")]).unwrap();
        assert!(s.failed().is_empty());
        drop(s);
        assert!(Store::open(dir.path(), 3, "m").unwrap().failed().is_empty());
    }

    #[test]
    fn a_second_opener_is_told_the_index_is_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Store::open(dir.path(), 3, "m").unwrap();
        let err = Store::open(dir.path(), 3, "m").err().unwrap().to_string();
        assert!(err.contains("in use by another docent process"), "{err}");
    }

    #[test]
    fn point_ids_are_stable_and_distinct() {
        assert_eq!(point_id("a", 0), point_id("a", 0));
        assert_ne!(point_id("a", 0), point_id("a", 1));
        assert_ne!(point_id("a", 0), point_id("b", 0));
    }

    #[test]
    fn shared_content_is_stored_once_and_lives_while_a_source_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 3, "m").unwrap();
        let doc = |src| {
            (0..3)
                .map(|i| {
                    (
                        payload_in("a", i, src, Some("books"), &["x"]),
                        emb([1.0, i as f32, 0.0]),
                    )
                })
                .collect::<Vec<_>>()
        };
        s.upsert(doc("/one")).unwrap();
        // the same content under a second source, in another collection with other tags
        let second = origin("/two", Some("papers"), &["y"]);
        assert!(s.attach("a", &second).unwrap());
        assert!(
            !s.attach("a", &second).unwrap(),
            "attaching twice changes nothing"
        );
        assert_eq!(s.len().unwrap(), 3, "no duplicate chunks");
        let info = s.document("a").unwrap().unwrap();
        assert_eq!(info.sources, vec!["/one", "/two"]);
        assert_eq!(info.source, "/one");
        let q = emb([1.0, 1.0, 0.0]).dense;
        let found = |f: SearchFilter| s.search_dense(&q, 10, &f).unwrap().len();
        let papers = SearchFilter {
            collection: Some("papers".into()),
            ..Default::default()
        };
        assert_eq!(found(papers.clone()), 3);
        let tag_y = SearchFilter {
            tags: vec!["y".into()],
            ..Default::default()
        };
        assert_eq!(found(tag_y.clone()), 3);
        assert!(s.documents_of_source("/two").unwrap().contains("a"));
        // removing the first source keeps the content for the second, which is now cited
        s.detach("a", "/one").unwrap();
        let info = s.document("a").unwrap().unwrap();
        assert_eq!((info.source.as_str(), info.sources.len()), ("/two", 1));
        let books = SearchFilter {
            collection: Some("books".into()),
            ..Default::default()
        };
        assert_eq!(
            found(books),
            0,
            "the collection of the removed source is gone"
        );
        assert_eq!(found(papers), 3);
        assert!(s.documents_of_source("/one").unwrap().is_empty());
        // removing the last source deletes the content
        s.detach("a", "/two").unwrap();
        assert_eq!(s.len().unwrap(), 0);
        assert_eq!(found(tag_y), 0);
    }

    #[test]
    fn fusion_weights_favour_their_own_ranking() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 3, "m").unwrap();
        // "d" leads the dense ranking, "b" is the only sparse match and too far away to be
        // among the 4 dense candidates (4 × limit 1), so each is in one ranking only
        let point = |doc: &str, dense: [f32; 3], term: u32| {
            let mut e = emb(dense);
            e.sparse = SparseVector {
                indices: vec![term],
                values: vec![1.0],
            };
            (payload(doc, 0, &format!("/{doc}")), e)
        };
        let mut points = vec![
            point("d", [1.0, 0.0, 0.0], 9),
            point("b", [0.0, 0.0, 1.0], 7),
        ];
        for i in 0..5 {
            points.push(point(&format!("f{i}"), [1.0, 0.5 + i as f32 * 0.1, 0.0], 9));
        }
        s.upsert(points).unwrap();
        let mut q = emb([1.0, 0.1, 0.0]);
        q.sparse = SparseVector {
            indices: vec![7],
            values: vec![1.0],
        };
        let top = |dense_weight, sparse_weight| {
            let f = Fusion {
                method: FusionMethod::Rrf,
                candidates: 4,
                dense_weight,
                sparse_weight,
                ..Default::default()
            };
            s.search(&q, SearchMode::Hybrid, &f, 1, &SearchFilter::default())
                .unwrap()[0]
                .payload
                .document_id
                .clone()
        };
        assert_eq!(top(10.0, 1.0), "d");
        assert_eq!(top(1.0, 10.0), "b");
    }

    #[test]
    fn mmr_gives_way_to_other_content_and_scores_come_without_payloads() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 3, "m").unwrap();
        // three near-duplicates right on the question, one different chunk a bit further
        let mut points: Vec<_> = (0..3)
            .map(|i| {
                let doc = format!("dup{i}");
                (
                    payload(&doc, 0, &format!("/{doc}")),
                    emb([1.0, 0.01 * i as f32, 0.0]),
                )
            })
            .collect();
        points.push((payload("other", 0, "/other"), emb([0.6, 0.0, 0.8])));
        s.upsert(points).unwrap();
        let q = emb([1.0, 0.0, 0.1]);
        let docs = |f: &Fusion| -> Vec<String> {
            s.search(&q, SearchMode::Dense, f, 2, &SearchFilter::default())
                .unwrap()
                .into_iter()
                .map(|h| h.payload.document_id)
                .collect()
        };
        let plain = Fusion::default();
        assert_eq!(docs(&plain), ["dup0", "dup1"]);
        let diverse = Fusion {
            mmr_lambda: Some(0.5),
            ..Default::default()
        };
        assert_eq!(docs(&diverse), ["dup0", "other"]);
        // λ = 1: relevance only, the same list as without MMR
        let relevance = Fusion {
            mmr_lambda: Some(1.0),
            ..Default::default()
        };
        assert_eq!(docs(&relevance), ["dup0", "dup1"]);

        let scored = s
            .search_scores(&q, SearchMode::Dense, &plain, 2, &SearchFilter::default())
            .unwrap();
        let hits = s
            .search(&q, SearchMode::Dense, &plain, 2, &SearchFilter::default())
            .unwrap();
        let expected: Vec<(u64, f32)> = hits
            .iter()
            .map(|h| {
                (
                    point_id(&h.payload.document_id, h.payload.chunk_index),
                    h.score,
                )
            })
            .collect();
        assert_eq!(scored, expected);
    }

    /// The fusion computed from the two candidate lists equals the engine's own fused
    /// search: same chunks, same order, same scores.
    #[test]
    fn fusing_the_candidate_lists_gives_the_engines_hybrid_ranking() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 3, "m").unwrap();
        let mut points = Vec::new();
        for i in 0..40u32 {
            let x = i as f32;
            let mut e = emb([
                1.0 + (x * 0.37).sin(),
                (x * 0.91).cos(),
                0.2 + (x * 0.13).sin(),
            ]);
            e.sparse = SparseVector {
                indices: vec![i % 7, 10 + i % 3, 20 + i % 11],
                values: vec![1.0 + (i % 4) as f32, 1.0, 0.5 + (i % 5) as f32],
            };
            points.push((payload(&format!("d{i}"), 0, &format!("/d{i}")), e));
        }
        s.upsert(points).unwrap();
        let mut q = emb([1.0, 0.3, 0.5]);
        q.sparse = SparseVector {
            indices: vec![3, 11, 25],
            values: vec![1.0, 1.0, 1.0],
        };
        let none = SearchFilter::default();
        for fusion in [
            // the engine's DBSF has no weights
            Fusion {
                dense_weight: 1.0,
                sparse_weight: 1.0,
                ..Default::default()
            },
            Fusion {
                method: FusionMethod::Rrf,
                dense_weight: 3.0,
                ..Default::default()
            },
        ] {
            let limit = 5;
            let depth = limit * fusion.candidates;
            let dense = s
                .search_scores(&q, SearchMode::Dense, &fusion, depth, &none)
                .unwrap();
            let sparse = s
                .search_scores(&q, SearchMode::Sparse, &fusion, depth, &none)
                .unwrap();
            assert!(dense.len() > limit && sparse.len() > limit);
            let mut ours = fusion.fuse(&dense, &sparse);
            ours.truncate(limit);
            let engine = s
                .search(&q, SearchMode::Hybrid, &fusion, limit, &none)
                .unwrap();
            let ours_hits = s.hits(&ours).unwrap();
            assert_eq!(ours_hits.len(), engine.len(), "{:?}", fusion.method);
            for (a, b) in ours_hits.iter().zip(&engine) {
                assert_eq!(
                    a.payload.document_id, b.payload.document_id,
                    "{:?}",
                    fusion.method
                );
                assert!(
                    (a.score - b.score).abs() < 1e-5,
                    "{} vs {}",
                    a.score,
                    b.score
                );
            }
        }
    }

    #[test]
    fn dbsf_weights_favour_their_own_ranking() {
        // "a" leads the dense list, "b" the sparse one; each is last in the other
        let dense = [(1, 0.9), (3, 0.5), (2, 0.4)];
        let sparse = [(2, 30.0), (3, 20.0), (1, 5.0)];
        let top = |dense_weight, sparse_weight| {
            let f = Fusion {
                dense_weight,
                sparse_weight,
                ..Default::default()
            };
            f.fuse(&dense, &sparse)[0].0
        };
        assert_eq!(top(3.0, 1.0), 1);
        assert_eq!(top(1.0, 3.0), 2);
        // one score in a list: it counts half its weight
        let f = Fusion::default();
        assert_eq!(f.fuse(&[(7, 0.3)], &[]), vec![(7, 0.5 * f.dense_weight)]);
    }
}
