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
    EdgeVectorParams, FieldCondition, FieldIndexOperations, Filter, JsonPath, Match, Modifier,
    NamedQuery, PayloadFieldSchema, PayloadSchemaType, PointId, PointInsertOperations,
    PointOperations, PointStruct, QueryEnum, QueryRequest, ScoringQuery, ScrollRequest,
    UpdateOperation, ValueVariants, Vector, VectorInternal, Vectors, WithPayloadInterface,
    WithVector,
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
    /// 1-based page the chunk starts on, for paged formats (PDF).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<u32>,
    pub span: Span,
    pub text: String,
}

/// A search result.
#[derive(Debug, Clone)]
pub struct Hit {
    pub payload: ChunkPayload,
    pub score: f32,
}

/// The embedded vector store.
pub struct Store {
    shard: EdgeShard,
    path: PathBuf,
}

fn store_err(e: impl std::fmt::Display) -> Error {
    Error::Store(e.to_string())
}

fn key(name: &str) -> Result<JsonPath> {
    JsonPath::try_from(name).map_err(|_| Error::Store(format!("invalid payload key {name:?}")))
}

fn match_keyword(field: &str, value: &str) -> Result<Filter> {
    Ok(Filter::new_must(Condition::Field(
        FieldCondition::new_match(
            key(field)?,
            Match::new_value(ValueVariants::String(value.to_string())),
        ),
    )))
}

/// Deterministic point id of a chunk.
pub fn point_id(document_id: &str, chunk_index: usize) -> u64 {
    let digest = Sha256::digest(format!("{document_id}:{chunk_index}").as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}

impl Store {
    /// Opens the store in `dir` (created if needed) for dense vectors of size `dim`.
    /// Fails with a clear message if the directory holds vectors of another size.
    pub fn open(dir: &Path, dim: usize) -> Result<Self> {
        let path = dir.join("qdrant");
        std::fs::create_dir_all(&path).map_err(|e| Error::io(&path, e))?;
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
            Error::Store(format!(
                "cannot open the index at {}: {e} (another docent process may be using it, or it was built with another embedding model)",
                path.display()
            ))
        })?;
        let store = Store { shard, path };
        for field in ["document_id", "source"] {
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
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes chunks; an existing point with the same id is replaced.
    pub fn upsert(&self, chunks: Vec<(ChunkPayload, Embedding)>) -> Result<()> {
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
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePointsByFilter(match_keyword("document_id", document_id)?),
            ))
            .map_err(store_err)
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

    /// Nearest chunks to a dense query vector.
    pub fn search_dense(&self, query: &[f32], limit: usize) -> Result<Vec<Hit>> {
        let request = QueryRequest {
            prefetches: vec![],
            query: Some(ScoringQuery::Vector(QueryEnum::Nearest(NamedQuery {
                query: VectorInternal::from(query.to_vec()),
                using: Some(DENSE.into()),
            }))),
            filter: None,
            score_threshold: None,
            limit,
            offset: 0,
            params: None,
            with_vector: WithVector::Bool(false),
            with_payload: WithPayloadInterface::Bool(true),
        };
        let points = self.shard.query(request).map_err(store_err)?;
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
            page: None,
            span: Span {
                start: i,
                end: i + 1,
            },
            text: format!("{doc}-{i}"),
        }
    }

    #[test]
    fn upsert_search_delete_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path(), 3).unwrap();
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
            let hits = s.search_dense(&emb([0.1, 1.0, 0.0]).dense, 2).unwrap();
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
        let s = Store::open(dir.path(), 3).unwrap();
        assert_eq!(s.len().unwrap(), 1);
        assert_eq!(s.chunk_count("b").unwrap(), 1);
        drop(s);
        // another vector size is refused with a clear error
        let err = Store::open(dir.path(), 4).err().unwrap().to_string();
        assert!(err.contains("cannot open the index"), "{err}");
    }

    #[test]
    fn point_ids_are_stable_and_distinct() {
        assert_eq!(point_id("a", 0), point_id("a", 0));
        assert_ne!(point_id("a", 0), point_id("a", 1));
        assert_ne!(point_id("a", 0), point_id("b", 0));
    }
}
