//! Stage 4, **store**: chunks with their vectors in Qdrant's embedded engine (qdrant-edge),
//! a directory on disk.
//!
//! Each chunk is one point with a named dense vector (`dense`, cosine) and a named sparse
//! vector (`bm25`, IDF applied by the engine at query time), and a [`ChunkPayload`].
//! Point ids are derived from `(document_id, chunk_index)`, so writing the same document
//! twice overwrites instead of duplicating.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use qdrant_edge::{
    Condition, CountRequest, CreateIndex, Distance, EdgeConfig, EdgeShard, EdgeSparseVectorParams,
    EdgeVectorParams, FacetRequest, FacetValue, FieldCondition, FieldIndexOperations, Filter,
    JsonPath, Match, Modifier, NamedQuery, PayloadFieldSchema, PayloadSchemaType, PointId,
    PointInsertOperations, PointOperations, PointStruct, QueryEnum, QueryRequest, ScoringQuery,
    ScrollRequest, UpdateOperation, ValueVariants, Vector, VectorInternal, Vectors,
    WithPayloadInterface, WithVector,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::embed::Embedding;
use crate::{Error, Result};

pub const DENSE: &str = "dense";
pub const SPARSE: &str = "bm25";

/// Byte range in the extracted document text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

/// What is stored with every chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkPayload {
    pub document_id: String,
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
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
    /// Only chunks of this collection.
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
    hidden: parking_lot::RwLock<BTreeSet<Version>>,
    journal: PathBuf,
    recovered: Vec<Version>,
    /// Versions rolled back after a crash, kept in `failed.json` until their source is
    /// ingested again.
    failed: parking_lot::Mutex<Vec<Version>>,
    failed_file: PathBuf,
}

/// What an unfinished write was doing, persisted so that a crash can be rolled back or
/// forward when the store is opened again.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum JournalEntry {
    /// `version` is being written: roll back (delete it).
    Writing { version: Version },
    /// `version` is complete: roll forward (delete `replaces`).
    Publishing {
        version: Version,
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

/// Points of one document version at one source.
fn version_filter(document_id: &str, source: &str) -> Result<Filter> {
    Ok(Filter {
        must: Some(vec![
            keyword("document_id", document_id)?,
            keyword("source", source)?,
        ]),
        ..Default::default()
    })
}

/// The embedding model an index was built with, in `index.json` beside the engine's files.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Identity {
    embedding_model_sha256: String,
    dim: usize,
}

fn check_identity(dir: &Path, dim: usize, model: &str) -> Result<()> {
    let file = dir.join("index.json");
    let want = Identity {
        embedding_model_sha256: model.to_string(),
        dim,
    };
    match std::fs::read(&file) {
        Ok(bytes) => {
            let have: Identity = serde_json::from_slice(&bytes)
                .map_err(|e| Error::Store(format!("{}: {e}", file.display())))?;
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

/// Deterministic point id of a chunk of a document version at a source.
pub fn point_id(document_id: &str, source: &str, chunk_index: usize) -> u64 {
    let digest = Sha256::digest(format!("{document_id}\0{source}\0{chunk_index}").as_bytes());
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
        };
        if let Ok(bytes) = std::fs::read(&store.failed_file) {
            *store.failed.get_mut() = serde_json::from_slice(&bytes).unwrap_or_default();
        }
        for field in ["document_id", "source", "collection", "tags"] {
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
                    self.delete_version(&version.document_id, &version.source)?;
                    tracing::warn!(source = %version.source, "rolled back an interrupted ingest");
                    let v = version.clone();
                    self.set_failed(|f| {
                        f.retain(|x| x.source != v.source);
                        f.push(v);
                    })?;
                    self.recovered.push(version);
                }
                Some(JournalEntry::Publishing { replaces, .. }) => {
                    for old in replaces {
                        self.delete_version(&old.document_id, &old.source)?;
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
        if chunks.is_empty() {
            return Ok(());
        }
        let points = chunks
            .into_iter()
            .map(|(payload, emb)| {
                let id = point_id(&payload.document_id, &payload.source, payload.chunk_index);
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
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePointsByFilter(match_keyword("document_id", document_id)?),
            ))
            .map_err(store_err)
    }

    /// Removes the chunks of one document version at one source, leaving the same content
    /// stored under other sources alone.
    pub fn delete_version(&self, document_id: &str, source: &str) -> Result<()> {
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePointsByFilter(version_filter(document_id, source)?),
            ))
            .map_err(store_err)
    }

    /// Number of chunks of a document version at a source made by `pipeline`.
    pub fn version_chunk_count(
        &self,
        document_id: &str,
        source: &str,
        pipeline: &str,
    ) -> Result<usize> {
        let mut f = version_filter(document_id, source)?;
        if let Some(must) = f.must.as_mut() {
            must.push(keyword("pipeline", pipeline)?);
        }
        self.count(Some(f))
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
        let filter = match_keyword("source", source)?;
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

    /// Hides `version` from search while it is written.
    pub fn begin(&self, version: &Version) -> Result<()> {
        self.journal_write(
            version,
            &JournalEntry::Writing {
                version: version.clone(),
            },
        )?;
        self.hidden.write().insert(version.clone());
        Ok(())
    }

    /// Shows `version` and hides `replaces` in one step, then deletes `replaces`.
    pub fn publish(&self, version: &Version, replaces: &[Version]) -> Result<()> {
        // the new version must be durable before the journal says it is complete
        self.shard.flush();
        self.journal_write(
            version,
            &JournalEntry::Publishing {
                version: version.clone(),
                replaces: replaces.to_vec(),
            },
        )?;
        {
            let mut hidden = self.hidden.write();
            hidden.remove(version);
            hidden.extend(replaces.iter().cloned());
        }
        let mut result = Ok(());
        for old in replaces {
            if let Err(e) = self.delete_version(&old.document_id, &old.source) {
                result = Err(e);
                continue;
            }
            self.hidden.write().remove(old);
        }
        if result.is_ok() {
            self.journal_clear(version)?;
        }
        self.set_failed(|f| f.retain(|x| x.source != version.source))?;
        result
    }

    /// Deletes a version that could not be written completely.
    pub fn abort(&self, version: &Version) -> Result<()> {
        self.delete_version(&version.document_id, &version.source)?;
        self.hidden.write().remove(version);
        self.journal_clear(version)
    }

    /// Nearest chunks to a dense query vector, among published versions that pass `only`.
    pub fn search_dense(
        &self,
        query: &[f32],
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<Hit>> {
        let hidden = self.hidden.read();
        let mut must = Vec::new();
        if let Some(c) = &only.collection {
            must.push(keyword("collection", c)?);
        }
        if !only.tags.is_empty() {
            must.push(any_of("tags", &only.tags)?);
        }
        if !only.document_ids.is_empty() {
            must.push(any_of("document_id", &only.document_ids)?);
        }
        let must_not = hidden
            .iter()
            .map(|v| version_filter(&v.document_id, &v.source).map(Condition::Filter))
            .collect::<Result<Vec<_>>>()?;
        let filter = (!must.is_empty() || !must_not.is_empty()).then(|| Filter {
            must: (!must.is_empty()).then_some(must),
            must_not: (!must_not.is_empty()).then_some(must_not),
            ..Default::default()
        });
        let request = QueryRequest {
            prefetches: vec![],
            query: Some(ScoringQuery::Vector(QueryEnum::Nearest(NamedQuery {
                query: VectorInternal::from(query.to_vec()),
                using: Some(DENSE.into()),
            }))),
            filter,
            score_threshold: None,
            limit,
            offset: 0,
            params: None,
            with_vector: WithVector::Bool(false),
            with_payload: WithPayloadInterface::Bool(true),
        };
        let points = self.shard.query(request).map_err(store_err)?;
        drop(hidden);
        points
            .into_iter()
            .map(|p| {
                let map = p
                    .payload
                    .ok_or_else(|| Error::Store("point without payload".into()))?
                    .0;
                let payload: ChunkPayload =
                    serde_json::from_value(serde_json::Value::Object(map.into_iter().collect()))
                        .map_err(|e| Error::Store(format!("malformed chunk payload: {e}")))?;
                Ok(Hit {
                    payload,
                    score: p.score,
                })
            })
            .collect()
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
            must.push(keyword("collection", c)?);
        }
        if !only.tags.is_empty() {
            must.push(any_of("tags", &only.tags)?);
        }
        let hidden: Vec<String> = self
            .hidden
            .read()
            .iter()
            .map(|v| v.document_id.clone())
            .collect();
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
        if self.hidden.read().iter().any(|v| v.document_id == id) {
            return Ok(None);
        }
        let chunks = self.chunk_count(id)?;
        if chunks == 0 {
            return Ok(None);
        }
        self.describe(id, chunks)
    }

    fn describe(&self, id: &str, chunks: usize) -> Result<Option<DocumentInfo>> {
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
        let p: ChunkPayload =
            serde_json::from_value(serde_json::Value::Object(payload.0.into_iter().collect()))
                .map_err(|e| Error::Store(format!("malformed chunk payload: {e}")))?;
        Ok(Some(DocumentInfo {
            id: p.document_id,
            source: p.source,
            title: p.title,
            collection: p.collection,
            tags: p.tags,
            chunks,
            chunks_total: p.chunks_total,
        }))
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
        ChunkPayload {
            document_id: doc.into(),
            source: source.into(),
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
        store.publish(&v1, &[]).unwrap();
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
                    .publish(&next, std::slice::from_ref(&current))
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
                let mut p = payload(doc, i, &format!("/{doc}"));
                p.collection = coll.map(String::from);
                p.tags = tags.iter().map(|t| t.to_string()).collect();
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
                let mut p = payload(doc, i, &format!("/{doc}"));
                p.collection = coll.map(String::from);
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
            s.publish(&v("old"), &[]).unwrap();
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
        s.publish(&v("newer"), &[v("old")]).unwrap();
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
        assert_eq!(point_id("a", "/x", 0), point_id("a", "/x", 0));
        assert_ne!(point_id("a", "/x", 0), point_id("a", "/x", 1));
        assert_ne!(point_id("a", "/x", 0), point_id("b", "/x", 0));
        assert_ne!(point_id("a", "/x", 0), point_id("a", "/y", 0));
    }
}
