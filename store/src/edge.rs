//! [`EdgeIndex`]: the embedded engine (qdrant-edge), a directory on disk, no server.
//!
//! Layout: `<dir>/qdrant/` holds the chunks (one shard), `<dir>/catalog/` the catalog (a
//! second shard of one-dimensional points carrying `(kind, name, value)` payloads). The
//! engine locks its directories, so one process opens an index at a time; the catalog is
//! mirrored in memory (read on open, written through), which makes catalog reads free on
//! the search path.
//!
//! The engine's calls are synchronous and CPU-bound; each runs on tokio's blocking pool
//! when called from inside a runtime, inline otherwise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use qdrant_edge::external::ordered_float::OrderedFloat;
use qdrant_edge::{
    Condition, CountRequest, CreateIndex, Distance, EdgeConfig, EdgeShard, EdgeSparseVectorParams,
    EdgeVectorParams, FacetRequest, FacetValue, FieldCondition, FieldIndexOperations, JsonPath,
    Match, Mmr, Modifier, NamedQuery, PayloadFieldSchema, PayloadOps, PayloadSchemaType, PointId,
    PointInsertOperations, PointOperations, PointStruct, Prefetch, QueryEnum, QueryRequest,
    ScoringQuery, ScrollRequest, SearchParams, SetPayloadOp, UpdateOperation, ValueVariants,
    Vector, VectorInternal, VectorStructInternal, Vectors, WithPayloadInterface, WithVector,
};
use serde_json::{json, Value};

use crate::index::{
    catalog_id, Filter, Payload, Point, Record, Scored, SearchRequest, VectorIndex, INDEXED_FIELDS,
};
#[cfg(test)]
use crate::types::Ann;
use crate::types::{FusionMethod, SearchMode, SparseVector, DENSE, SPARSE};
use crate::{Error, Result};

/// The embedded index in a directory.
pub struct EdgeIndex {
    inner: Arc<Inner>,
}

struct Inner {
    shard: EdgeShard,
    catalog: EdgeShard,
    mirror: parking_lot::RwLock<BTreeMap<(String, String), Value>>,
    dir: PathBuf,
    /// Held shared by every engine call and exclusively by flushes: qdrant-edge's
    /// `EdgeShard::flush` takes its WAL and segment locks with `try_lock(...).expect(...)`,
    /// so a flush that meets a concurrent write panics (found under load: an upload's
    /// flush while another upload was writing).
    gate: parking_lot::RwLock<()>,
}

const CATALOG_VECTOR: &str = "k";

fn in_use(dir: &Path, e: impl std::fmt::Display) -> Error {
    let e = e.to_string();
    if e.contains("WouldBlock") {
        Error::Incompatible(format!(
            "the index at {} is in use by another docent process (one process may open it at a time; while the service runs, upload through POST /v1/documents, or use a Qdrant server: [store] kind = \"qdrant\")",
            dir.display()
        ))
    } else {
        Error::Engine(format!("cannot open the index at {}: {e}", dir.display()))
    }
}

impl EdgeIndex {
    /// Opens (creating if needed) the index in `dir` for dense vectors of size `dim`.
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
        let shard = EdgeShard::load(&path, Some(config)).map_err(|e| in_use(dir, e))?;
        for field in INDEXED_FIELDS {
            keyword_index(&shard, field)?;
        }
        let catalog_path = dir.join("catalog");
        std::fs::create_dir_all(&catalog_path).map_err(|e| Error::io(&catalog_path, e))?;
        let catalog_config = EdgeConfig::builder()
            .vector(
                CATALOG_VECTOR,
                EdgeVectorParams::builder(1, Distance::Dot).build(),
            )
            .build();
        let catalog =
            EdgeShard::load(&catalog_path, Some(catalog_config)).map_err(|e| in_use(dir, e))?;
        keyword_index(&catalog, "kind")?;
        let mut mirror = BTreeMap::new();
        let mut offset = None;
        loop {
            let (records, next) = catalog
                .scroll(ScrollRequest {
                    offset,
                    limit: Some(256),
                    filter: None,
                    with_payload: Some(WithPayloadInterface::Bool(true)),
                    with_vector: WithVector::Bool(false),
                    order_by: None,
                })
                .map_err(Error::engine)?;
            for r in records {
                let p = r.payload.map(|p| p.0).unwrap_or_default();
                if let (Some(Value::String(kind)), Some(Value::String(name))) =
                    (p.get("kind"), p.get("name"))
                {
                    let value = p.get("value").cloned().unwrap_or(Value::Null);
                    mirror.insert((kind.clone(), name.clone()), value);
                }
            }
            match next {
                Some(n) => offset = Some(n),
                None => break,
            }
        }
        adopt_legacy_identity(dir, &catalog, &mut mirror)?;
        Ok(EdgeIndex {
            inner: Arc::new(Inner {
                shard,
                catalog,
                mirror: parking_lot::RwLock::new(mirror),
                dir: dir.to_path_buf(),
                gate: parking_lot::RwLock::new(()),
            }),
        })
    }

    /// Runs `f` with the engine on a blocking thread (inline outside a runtime), beside
    /// other calls but never beside a flush.
    async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T> + Send + 'static,
    {
        self.on_engine(false, f).await
    }

    /// Runs a flush: alone, once the calls in flight have finished.
    async fn run_flush<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce(&Inner) + Send + 'static,
    {
        self.on_engine(true, move |i| {
            f(i);
            Ok(())
        })
        .await
    }

    async fn on_engine<T, F>(&self, exclusive: bool, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        let call = move || {
            if exclusive {
                let _alone = inner.gate.write();
                f(&inner)
            } else {
                let _shared = inner.gate.read();
                f(&inner)
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => handle
                .spawn_blocking(call)
                .await
                .map_err(|e| Error::Engine(format!("a store task failed: {e}")))?,
            Err(_) => call(),
        }
    }
}

/// An index written before the catalog existed (format 2) kept its identity in
/// `index.json` and its points in today's layout: its identity moves into the catalog, so
/// the model check still applies. Older layouts are refused by the check itself.
fn adopt_legacy_identity(
    dir: &Path,
    catalog: &EdgeShard,
    mirror: &mut BTreeMap<(String, String), Value>,
) -> Result<()> {
    let key = ("meta".to_string(), "identity".to_string());
    let file = dir.join("index.json");
    if mirror.contains_key(&key) || !file.is_file() {
        return Ok(());
    }
    let bytes = std::fs::read(&file).map_err(|e| Error::io(&file, e))?;
    let mut legacy: Value = serde_json::from_slice(&bytes).map_err(|e| Error::Malformed {
        what: "index.json",
        detail: e.to_string(),
    })?;
    if legacy["format"] == json!(2) {
        legacy["format"] = json!(crate::store::FORMAT);
    }
    let point = catalog_point(&key.0, &key.1, legacy.clone())?;
    catalog
        .update(UpdateOperation::PointOperation(
            PointOperations::UpsertPoints(PointInsertOperations::PointsList(vec![point.into()])),
        ))
        .map_err(Error::engine)?;
    catalog.flush();
    mirror.insert(key, legacy);
    Ok(())
}

fn key(name: &str) -> Result<JsonPath> {
    JsonPath::try_from(name).map_err(|_| Error::Engine(format!("invalid payload key {name:?}")))
}

fn keyword_index(shard: &EdgeShard, field: &str) -> Result<()> {
    shard
        .update(UpdateOperation::FieldIndexOperation(
            FieldIndexOperations::CreateIndex(CreateIndex {
                field_name: key(field)?,
                field_schema: Some(PayloadFieldSchema::FieldType(PayloadSchemaType::Keyword)),
            }),
        ))
        .map_err(Error::engine)
}

fn condition(field: &str, values: &[String]) -> Result<Condition> {
    let one = |v: &String| -> Result<Condition> {
        Ok(Condition::Field(FieldCondition::new_match(
            key(field)?,
            Match::new_value(ValueVariants::String(v.clone())),
        )))
    };
    if let [v] = values {
        return one(v);
    }
    let should = values.iter().map(one).collect::<Result<Vec<_>>>()?;
    Ok(Condition::Filter(qdrant_edge::Filter {
        should: Some(should),
        ..Default::default()
    }))
}

fn edge_filter(f: &Filter) -> Result<Option<qdrant_edge::Filter>> {
    if f.is_empty() {
        return Ok(None);
    }
    let conds = |list: &[crate::index::Keyword]| -> Result<Option<Vec<Condition>>> {
        if list.is_empty() {
            return Ok(None);
        }
        list.iter()
            .map(|k| condition(k.field, &k.any_of))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    };
    Ok(Some(qdrant_edge::Filter {
        must: conds(&f.must)?,
        must_not: conds(&f.must_not)?,
        ..Default::default()
    }))
}

fn num_id(id: &PointId) -> Result<u64> {
    match id {
        PointId::NumId(n) => Ok(*n),
        other => Err(Error::Malformed {
            what: "point id",
            detail: other.to_string(),
        }),
    }
}

fn sparse_of(v: &SparseVector) -> qdrant_edge::SparseVector {
    qdrant_edge::SparseVector {
        indices: v.indices.clone(),
        values: v.values.clone(),
    }
}

fn scroll_request(
    filter: Option<qdrant_edge::Filter>,
    limit: usize,
    offset: Option<u64>,
    vectors: bool,
) -> ScrollRequest {
    ScrollRequest {
        offset: offset.map(PointId::NumId),
        limit: Some(limit.max(1)),
        filter,
        with_payload: Some(WithPayloadInterface::Bool(true)),
        with_vector: WithVector::Bool(vectors),
        order_by: None,
    }
}

/// The engine's query for a search request (the same plan the server runs).
fn query_request(r: &SearchRequest) -> Result<QueryRequest> {
    let nearest = |using: &str, v: VectorInternal| {
        ScoringQuery::Vector(QueryEnum::Nearest(NamedQuery {
            query: v,
            using: Some(using.into()),
        }))
    };
    let dense = || nearest(DENSE, VectorInternal::from(r.dense.clone()));
    let sparse = || nearest(SPARSE, VectorInternal::from(sparse_of(&r.sparse)));
    let depth = r.limit.max(1) * r.fusion.candidates.max(1);
    // the beam width and exactness of dense searches (sparse ones are always exact)
    let ann = Some(SearchParams {
        hnsw_ef: Some(r.ann.ef),
        exact: r.ann.exact,
        ..Default::default()
    });
    let prefetch = |q: ScoringQuery, params: Option<SearchParams>| Prefetch {
        prefetches: vec![],
        query: Some(q),
        limit: depth,
        params,
        filter: None,
        score_threshold: None,
    };
    let mut params = None;
    let (mut prefetches, mut scoring) = match r.mode {
        SearchMode::Dense => {
            params = ann;
            (vec![], dense())
        }
        SearchMode::Sparse => (vec![], sparse()),
        SearchMode::Hybrid => (
            vec![prefetch(dense(), ann), prefetch(sparse(), None)],
            ScoringQuery::Fusion(match r.fusion.method {
                FusionMethod::Rrf => qdrant_edge::Fusion::Rrf {
                    k: r.fusion.rrf_k,
                    weights: Some(vec![
                        OrderedFloat(r.fusion.dense_weight),
                        OrderedFloat(r.fusion.sparse_weight),
                    ]),
                },
                FusionMethod::Dbsf => qdrant_edge::Fusion::Dbsf,
            }),
        ),
    };
    if let Some(lambda) = r.fusion.mmr_lambda {
        // the ranking becomes the candidate pool MMR picks `limit` points from
        prefetches = vec![Prefetch {
            prefetches,
            query: Some(scoring),
            limit: depth,
            params: params.take(),
            filter: None,
            score_threshold: None,
        }];
        scoring = ScoringQuery::Mmr(Mmr {
            vector: VectorInternal::from(r.dense.clone()),
            using: DENSE.into(),
            lambda: OrderedFloat(lambda),
            candidates_limit: depth,
        });
    }
    Ok(QueryRequest {
        prefetches,
        query: Some(scoring),
        filter: edge_filter(&r.filter)?,
        score_threshold: None,
        limit: r.limit,
        offset: 0,
        params,
        with_vector: WithVector::Bool(false),
        with_payload: WithPayloadInterface::Bool(r.with_payload),
    })
}

fn point_of(r: qdrant_edge::Record) -> Result<Point> {
    let id = num_id(&r.id)?;
    let mut dense = Vec::new();
    let mut sparse = SparseVector::default();
    if let Some(VectorStructInternal::Named(map)) = r.vector {
        for (name, v) in map {
            match (name.as_str(), v) {
                (DENSE, VectorInternal::Dense(d)) => dense = d,
                (SPARSE, VectorInternal::Sparse(s)) => {
                    sparse = SparseVector {
                        indices: s.indices,
                        values: s.values,
                    }
                }
                _ => {}
            }
        }
    }
    Ok(Point {
        id,
        dense,
        sparse,
        payload: r
            .payload
            .map(|p| p.0.into_iter().collect())
            .unwrap_or_default(),
    })
}

fn catalog_point(kind: &str, name: &str, value: Value) -> Result<PointStruct> {
    let vectors = Vectors::new_named([(CATALOG_VECTOR, Vector::new_dense(vec![1.0]))]);
    Ok(PointStruct::new(
        PointId::NumId(catalog_id(kind, name)),
        vectors,
        json!({ "kind": kind, "name": name, "value": value }),
    ))
}

#[async_trait]
impl VectorIndex for EdgeIndex {
    fn describe(&self) -> String {
        format!("embedded Qdrant engine in {}", self.inner.dir.display())
    }

    fn exclusive(&self) -> bool {
        true
    }

    async fn upsert(&self, points: Vec<Point>) -> Result<()> {
        if points.is_empty() {
            return Ok(());
        }
        self.run(move |i| {
            let points = points
                .into_iter()
                .map(|p| {
                    let vectors = Vectors::new_named([
                        (DENSE, Vector::new_dense(p.dense)),
                        (SPARSE, Vector::from(sparse_of(&p.sparse))),
                    ]);
                    PointStruct::new(PointId::NumId(p.id), vectors, Value::Object(p.payload)).into()
                })
                .collect();
            i.shard
                .update(UpdateOperation::PointOperation(
                    PointOperations::UpsertPoints(PointInsertOperations::PointsList(points)),
                ))
                .map_err(Error::engine)
        })
        .await
    }

    async fn delete(&self, filter: &Filter) -> Result<()> {
        let filter = edge_filter(filter)?.unwrap_or_default();
        self.run(move |i| {
            i.shard
                .update(UpdateOperation::PointOperation(
                    PointOperations::DeletePointsByFilter(filter),
                ))
                .map_err(Error::engine)
        })
        .await
    }

    async fn set_payload(&self, filter: &Filter, payload: Payload) -> Result<()> {
        let filter = edge_filter(filter)?.unwrap_or_default();
        self.run(move |i| {
            i.shard
                .update(UpdateOperation::PayloadOperation(PayloadOps::SetPayload(
                    SetPayloadOp {
                        payload: qdrant_edge::Payload(payload.into_iter().collect()),
                        points: None,
                        filter: Some(filter),
                        key: None,
                    },
                )))
                .map_err(Error::engine)
        })
        .await
    }

    async fn search(&self, request: &SearchRequest) -> Result<Vec<Scored>> {
        let query = query_request(request)?;
        self.run(move |i| {
            i.shard
                .query(query)
                .map_err(Error::engine)?
                .into_iter()
                .map(|p| {
                    Ok(Scored {
                        id: num_id(&p.id)?,
                        score: p.score,
                        payload: p.payload.map(|p| p.0.into_iter().collect()),
                    })
                })
                .collect()
        })
        .await
    }

    async fn retrieve(&self, ids: &[u64]) -> Result<Vec<Record>> {
        let ids: Vec<PointId> = ids.iter().map(|&id| PointId::NumId(id)).collect();
        self.run(move |i| {
            i.shard
                .retrieve(
                    &ids,
                    Some(WithPayloadInterface::Bool(true)),
                    Some(WithVector::Bool(false)),
                )
                .map_err(Error::engine)?
                .into_iter()
                .map(|r| {
                    Ok(Record {
                        id: num_id(&r.id)?,
                        payload: r
                            .payload
                            .map(|p| p.0.into_iter().collect())
                            .unwrap_or_default(),
                    })
                })
                .collect()
        })
        .await
    }

    async fn scroll(
        &self,
        filter: &Filter,
        limit: usize,
        offset: Option<u64>,
    ) -> Result<(Vec<Record>, Option<u64>)> {
        let request = scroll_request(edge_filter(filter)?, limit, offset, false);
        self.run(move |i| {
            let (records, next) = i.shard.scroll(request).map_err(Error::engine)?;
            let records = records
                .into_iter()
                .map(|r| {
                    Ok(Record {
                        id: num_id(&r.id)?,
                        payload: r
                            .payload
                            .map(|p| p.0.into_iter().collect())
                            .unwrap_or_default(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((records, next.as_ref().map(num_id).transpose()?))
        })
        .await
    }

    async fn scroll_points(
        &self,
        limit: usize,
        offset: Option<u64>,
    ) -> Result<(Vec<Point>, Option<u64>)> {
        let request = scroll_request(None, limit, offset, true);
        self.run(move |i| {
            let (records, next) = i.shard.scroll(request).map_err(Error::engine)?;
            let points = records
                .into_iter()
                .map(point_of)
                .collect::<Result<Vec<_>>>()?;
            Ok((points, next.as_ref().map(num_id).transpose()?))
        })
        .await
    }

    async fn count(&self, filter: &Filter) -> Result<usize> {
        let filter = edge_filter(filter)?;
        self.run(move |i| {
            i.shard
                .count(CountRequest {
                    filter,
                    exact: true,
                })
                .map_err(Error::engine)
        })
        .await
    }

    async fn facet(&self, field: &'static str, filter: &Filter) -> Result<Vec<(String, usize)>> {
        let filter = edge_filter(filter)?;
        self.run(move |i| {
            let facet = i
                .shard
                .facet(FacetRequest {
                    key: key(field)?,
                    limit: usize::MAX / 2,
                    filter,
                    exact: true,
                })
                .map_err(Error::engine)?;
            Ok(facet
                .hits
                .into_iter()
                .filter_map(|h| match h.value {
                    FacetValue::Keyword(v) => Some((v, h.count)),
                    _ => None,
                })
                .collect())
        })
        .await
    }

    async fn flush(&self) -> Result<()> {
        self.run_flush(|i| {
            i.shard.flush();
            i.catalog.flush();
        })
        .await
    }

    async fn optimize(&self) -> Result<bool> {
        self.run(|i| i.shard.optimize().map_err(Error::engine))
            .await
    }

    async fn catalog_get(&self, kind: &str, name: &str) -> Result<Option<Value>> {
        Ok(self
            .inner
            .mirror
            .read()
            .get(&(kind.to_string(), name.to_string()))
            .cloned())
    }

    async fn catalog_put(&self, kind: &str, name: &str, value: Value) -> Result<()> {
        let (kind, name) = (kind.to_string(), name.to_string());
        self.run(move |i| {
            // the mirror lock orders writers, so the mirror and the shard agree
            let mut mirror = i.mirror.write();
            let point = catalog_point(&kind, &name, value.clone())?;
            i.catalog
                .update(UpdateOperation::PointOperation(
                    PointOperations::UpsertPoints(PointInsertOperations::PointsList(vec![
                        point.into()
                    ])),
                ))
                .map_err(Error::engine)?;
            // the write-ahead log (mmap'd) survives a killed process; sync_catalog fsyncs
            mirror.insert((kind, name), value);
            Ok(())
        })
        .await
    }

    async fn catalog_delete(&self, kind: &str, name: &str) -> Result<()> {
        let (kind, name) = (kind.to_string(), name.to_string());
        self.run(move |i| {
            let mut mirror = i.mirror.write();
            if mirror.remove(&(kind.clone(), name.clone())).is_none() {
                return Ok(());
            }
            i.catalog
                .update(UpdateOperation::PointOperation(
                    PointOperations::DeletePoints {
                        ids: vec![PointId::NumId(catalog_id(&kind, &name))],
                    },
                ))
                .map_err(Error::engine)?;
            Ok(())
        })
        .await
    }

    async fn sync_catalog(&self) -> Result<()> {
        self.run_flush(|i| i.catalog.flush()).await
    }

    async fn catalog_list(&self, kind: &str) -> Result<Vec<(String, Value)>> {
        let mirror = self.inner.mirror.read();
        Ok(mirror
            .range((kind.to_string(), String::new())..)
            .take_while(|((k, _), _)| k == kind)
            .map(|((_, name), value)| (name.clone(), value.clone()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn _send_sync<T: Send + Sync>() {}

    #[test]
    fn the_engine_can_be_shared_between_threads() {
        _send_sync::<EdgeShard>();
        _send_sync::<EdgeIndex>();
    }

    #[test]
    fn a_second_opener_is_told_the_index_is_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let _first = EdgeIndex::open(dir.path(), 3).unwrap();
        let second = EdgeIndex::open(dir.path(), 3).err().unwrap().to_string();
        assert!(
            second.contains("in use by another docent process"),
            "{second}"
        );
    }

    #[test]
    fn an_index_from_before_the_catalog_keeps_its_model_check() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("index.json"),
            r#"{"format": 2, "embedding_model_sha256": "abc", "dim": 3}"#,
        )
        .unwrap();
        let index = EdgeIndex::open(dir.path(), 3).unwrap();
        let identity = futures::executor::block_on(index.catalog_get("meta", "identity"))
            .unwrap()
            .unwrap();
        assert_eq!(identity["embedding_model_sha256"], "abc");
        assert_eq!(identity["format"], json!(crate::store::FORMAT));
        let index: Arc<dyn VectorIndex> = Arc::new(index);
        let other = crate::Identity::new("another-model", 3);
        let err = futures::executor::block_on(crate::Store::open(index, &other))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("another embedding model"), "{err}");
    }

    #[test]
    fn flushes_beside_concurrent_writes_neither_panic_nor_fail() {
        let dir = tempfile::tempdir().unwrap();
        let index = Arc::new(EdgeIndex::open(dir.path(), 3).unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let point = |id: u64| Point {
            id,
            dense: vec![1.0, id as f32, 0.5],
            sparse: crate::SparseVector {
                indices: vec![1, 2],
                values: vec![0.5, 1.0],
            },
            payload: Default::default(),
        };
        rt.block_on(async {
            let mut tasks = Vec::new();
            for t in 0..4u64 {
                let index = index.clone();
                tasks.push(tokio::spawn(async move {
                    for n in 0..40u64 {
                        let id = t * 1000 + n;
                        index.upsert(vec![point(id)]).await?;
                        index.flush().await?;
                        index.catalog_put("k", &format!("{id}"), json!(id)).await?;
                        index.sync_catalog().await?;
                    }
                    Ok::<_, Error>(())
                }));
            }
            for t in tasks {
                t.await.expect("no panic").expect("no error");
            }
        });
        assert_eq!(rt.block_on(index.catalog_list("k")).unwrap().len(), 160);
    }

    #[test]
    fn the_catalog_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        futures::executor::block_on(async {
            let index = EdgeIndex::open(dir.path(), 3).unwrap();
            index.catalog_put("k", "a", json!(1)).await.unwrap();
            index.catalog_put("k", "b", json!({"x": 2})).await.unwrap();
            index.catalog_put("other", "a", json!(3)).await.unwrap();
            index.catalog_delete("k", "a").await.unwrap();
        });
        let index = EdgeIndex::open(dir.path(), 3).unwrap();
        let listed = futures::executor::block_on(index.catalog_list("k")).unwrap();
        assert_eq!(listed, vec![("b".to_string(), json!({"x": 2}))]);
    }

    /// Above the engine's full-scan threshold the dense ranking comes from the HNSW graph:
    /// `ann.exact` gives the true nearest points (checked against a brute-force scan), a
    /// narrow beam misses some, and a wide one misses fewer. Random vectors are the
    /// graph's hardest case (every point about as far as every other).
    #[test]
    fn dense_search_is_exact_when_asked_and_the_beam_width_sets_recall() {
        const DIM: usize = 384;
        const POINTS: u64 = 7_000; // over 10,000 KB of vectors: one HNSW-indexed segment
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut unit = || {
            let mut v: Vec<f32> = (0..DIM)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
                })
                .collect();
            let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            v.iter_mut().for_each(|x| *x /= n);
            v
        };
        let vectors: Vec<Vec<f32>> = (0..POINTS).map(|_| unit()).collect();
        let queries: Vec<Vec<f32>> = (0..20).map(|_| unit()).collect();
        let dir = tempfile::tempdir().unwrap();
        let index = EdgeIndex::open(dir.path(), DIM).unwrap();
        futures::executor::block_on(async {
            for (b, batch) in vectors.chunks(500).enumerate() {
                let points = batch
                    .iter()
                    .enumerate()
                    .map(|(i, v)| Point {
                        id: (b * 500 + i) as u64,
                        dense: v.clone(),
                        sparse: crate::SparseVector::default(),
                        payload: Default::default(),
                    })
                    .collect();
                index.upsert(points).await.unwrap();
            }
            assert!(index.optimize().await.unwrap(), "the graph was built");
        });
        let search = |q: &[f32], ann: Ann| -> Vec<u64> {
            let request = SearchRequest {
                dense: q.to_vec(),
                sparse: crate::SparseVector::default(),
                mode: SearchMode::Dense,
                fusion: Default::default(),
                ann,
                limit: 10,
                filter: Filter::default(),
                with_payload: false,
            };
            futures::executor::block_on(index.search(&request))
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .collect()
        };
        let (mut narrow, mut wide) = (0, 0);
        for q in &queries {
            let mut scored: Vec<(f32, u64)> = vectors
                .iter()
                .enumerate()
                .map(|(i, v)| (v.iter().zip(q).map(|(a, b)| a * b).sum(), i as u64))
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0));
            let truth: Vec<u64> = scored[..10].iter().map(|s| s.1).collect();
            let exact = search(q, Ann { ef: 1, exact: true });
            assert_eq!(exact, truth, "exact search is the brute-force ranking");
            let found = |ef| {
                search(q, Ann { ef, exact: false })
                    .iter()
                    .filter(|id| truth.contains(id))
                    .count()
            };
            narrow += found(10);
            wide += found(512);
        }
        eprintln!("true neighbours found: beam 10 {narrow} of 200, beam 512 {wide}");
        assert!(
            narrow < 200,
            "a beam of 10 finds every true neighbour: no graph searched"
        );
        assert!(
            wide > narrow,
            "a beam of 512 finds {wide} of 200, 10 finds {narrow}"
        );
    }
}
