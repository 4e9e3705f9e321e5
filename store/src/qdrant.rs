//! [`QdrantIndex`]: a Qdrant server or cluster over gRPC (qdrant-client).
//!
//! Two collections: `<collection>` holds the chunks with the same ids, payloads, named
//! vectors (`dense` cosine, `bm25` sparse with the IDF modifier) and keyword payload
//! indexes as the embedded engine; `<collection>_catalog` holds the catalog as
//! one-dimensional points carrying `(kind, name, value)` payloads, shared by every
//! replica. Hybrid search runs the same plan (two prefetches, then DBSF or weighted RRF
//! with an explicit k, optionally MMR) on the server.
//!
//! The client runs on a small runtime of its own, so it works from any caller: an
//! actix worker, a blocking thread, or a plain thread that blocks on the future.

use std::collections::HashMap;

use async_trait::async_trait;
use qdrant_client::qdrant::{
    point_id::PointIdOptions, vector_output, vectors_output::VectorsOptions, Condition,
    CountPointsBuilder, CreateCollectionBuilder, CreateFieldIndexCollectionBuilder,
    DeletePointsBuilder, Distance, FacetCountsBuilder, FieldType, GetPointsBuilder, MmrBuilder,
    Modifier, NamedVectors, PointId, PointStruct, PointsIdsList, PrefetchQueryBuilder, Query,
    QueryPointsBuilder, RetrievedPoint, RrfBuilder, ScrollPointsBuilder, SearchParamsBuilder,
    SetPayloadPointsBuilder, SparseVectorParamsBuilder, SparseVectorsConfigBuilder,
    UpsertPointsBuilder, Vector, VectorInput, VectorParamsBuilder, VectorsConfigBuilder,
    WriteOrdering, WriteOrderingType,
};
use qdrant_client::{Qdrant, QdrantError};
use serde_json::{json, Value};

use crate::index::{
    catalog_id, Filter, Payload, Point, Record, Scored, SearchRequest, VectorIndex, INDEXED_FIELDS,
};
use crate::types::{FusionMethod, SearchMode, SparseVector, DENSE, SPARSE};
use crate::{Error, Result};

/// How to reach the server.
#[derive(Debug, Clone)]
pub struct QdrantOptions {
    /// gRPC URL (`http://host:6334`; `https://` for TLS with the system's roots).
    pub url: String,
    /// The server's API key, if it wants one.
    pub api_key: Option<String>,
    /// Collection of the chunks; the catalog is `<collection>_catalog`.
    pub collection: String,
    /// Per-request timeout.
    pub timeout: std::time::Duration,
}

/// A collection on a Qdrant server.
pub struct QdrantIndex {
    client: Qdrant,
    collection: String,
    catalog: String,
    url: String,
    runtime: Option<tokio::runtime::Runtime>,
}

const CATALOG_VECTOR: &str = "k";

fn server_err(e: QdrantError) -> Error {
    let text = e.to_string();
    let unavailable = match &e {
        QdrantError::ResponseError { status } => matches!(
            status.code(),
            tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::ResourceExhausted
        ),
        _ => text.contains("transport error") || text.contains("connect"),
    };
    if unavailable {
        Error::Unavailable(text)
    } else {
        Error::Engine(text)
    }
}

fn strong() -> WriteOrdering {
    WriteOrdering {
        r#type: WriteOrderingType::Strong as i32,
    }
}

fn condition(field: &str, values: &[String]) -> Condition {
    if let [v] = values {
        Condition::matches(field, v.clone())
    } else {
        Condition::matches(field, values.to_vec())
    }
}

fn server_filter(f: &Filter) -> Option<qdrant_client::qdrant::Filter> {
    if f.is_empty() {
        return None;
    }
    Some(qdrant_client::qdrant::Filter {
        must: f
            .must
            .iter()
            .map(|k| condition(k.field, &k.any_of))
            .collect(),
        must_not: f
            .must_not
            .iter()
            .map(|k| condition(k.field, &k.any_of))
            .collect(),
        ..Default::default()
    })
}

fn num_id(id: Option<PointId>) -> Result<u64> {
    match id.and_then(|p| p.point_id_options) {
        Some(PointIdOptions::Num(n)) => Ok(n),
        other => Err(Error::Malformed {
            what: "point id",
            detail: format!("{other:?}"),
        }),
    }
}

fn to_json(payload: HashMap<String, qdrant_client::qdrant::Value>) -> Payload {
    payload
        .into_iter()
        .map(|(k, v)| (k, v.into_json()))
        .collect()
}

fn to_server_payload(map: Payload) -> Result<qdrant_client::Payload> {
    qdrant_client::Payload::try_from(Value::Object(map)).map_err(Error::engine)
}

fn point_of(p: RetrievedPoint) -> Result<Point> {
    let id = num_id(p.id)?;
    let mut dense = Vec::new();
    let mut sparse = SparseVector::default();
    if let Some(VectorsOptions::Vectors(named)) = p.vectors.and_then(|v| v.vectors_options) {
        for (name, v) in named.vectors {
            match (name.as_str(), v.vector) {
                (DENSE, Some(vector_output::Vector::Dense(d))) => dense = d.data,
                (SPARSE, Some(vector_output::Vector::Sparse(s))) => {
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
        payload: to_json(p.payload),
    })
}

impl QdrantIndex {
    /// Connects, creating the collections (and their payload indexes) on first use. Fails
    /// with a message that names the URL when the server cannot be reached.
    pub async fn connect(options: &QdrantOptions, dim: usize) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("docent-qdrant")
            .enable_all()
            .build()
            .map_err(|e| Error::Engine(format!("cannot start the Qdrant client: {e}")))?;
        let mut builder = Qdrant::from_url(&options.url)
            .timeout(options.timeout)
            .connect_timeout(options.timeout)
            .skip_compatibility_check();
        if let Some(key) = &options.api_key {
            builder = builder.api_key(key.clone());
        }
        let client = builder.build().map_err(|e| {
            Error::Unavailable(format!(
                "cannot configure a client for {}: {e}",
                options.url
            ))
        })?;
        let index = QdrantIndex {
            client,
            collection: options.collection.clone(),
            catalog: format!("{}_catalog", options.collection),
            url: options.url.clone(),
            runtime: Some(runtime),
        };
        let (client, collection, catalog) = (
            index.client.clone(),
            index.collection.clone(),
            index.catalog.clone(),
        );
        let url = options.url.clone();
        index
            .on_runtime(async move {
                let exists = client.collection_exists(&collection).await.map_err(|e| {
                    Error::Unavailable(format!(
                        "cannot reach the Qdrant server at {url}: {e} (is it running? is [store] url its gRPC port, usually 6334?)"
                    ))
                })?;
                if !exists {
                    let mut vectors = VectorsConfigBuilder::default();
                    vectors.add_named_vector_params(
                        DENSE,
                        VectorParamsBuilder::new(dim as u64, Distance::Cosine),
                    );
                    let mut sparse = SparseVectorsConfigBuilder::default();
                    sparse.add_named_vector_params(
                        SPARSE,
                        SparseVectorParamsBuilder::default().modifier(Modifier::Idf),
                    );
                    create(
                        &client,
                        CreateCollectionBuilder::new(&collection)
                            .vectors_config(vectors)
                            .sparse_vectors_config(sparse),
                    )
                    .await?;
                }
                for field in INDEXED_FIELDS {
                    client
                        .create_field_index(
                            CreateFieldIndexCollectionBuilder::new(
                                &collection,
                                field,
                                FieldType::Keyword,
                            )
                            .wait(true),
                        )
                        .await
                        .map_err(server_err)?;
                }
                if !client
                    .collection_exists(&catalog)
                    .await
                    .map_err(server_err)?
                {
                    let mut vectors = VectorsConfigBuilder::default();
                    vectors.add_named_vector_params(
                        CATALOG_VECTOR,
                        VectorParamsBuilder::new(1, Distance::Dot),
                    );
                    create(
                        &client,
                        CreateCollectionBuilder::new(&catalog).vectors_config(vectors),
                    )
                    .await?;
                }
                client
                    .create_field_index(
                        CreateFieldIndexCollectionBuilder::new(&catalog, "kind", FieldType::Keyword)
                            .wait(true),
                    )
                    .await
                    .map_err(server_err)?;
                Ok(())
            })
            .await?;
        Ok(index)
    }

    /// Runs a client call on the client's own runtime.
    async fn on_runtime<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T>> + Send + 'static,
    {
        let runtime = self
            .runtime
            .as_ref()
            .ok_or_else(|| Error::Engine("the Qdrant client was shut down".into()))?;
        runtime
            .spawn(f)
            .await
            .map_err(|e| Error::Engine(format!("a Qdrant request failed: {e}")))?
    }

    /// A write on the client's runtime; done once the server acknowledged it.
    async fn acknowledged<R, F, Fut>(&self, f: F) -> Result<()>
    where
        R: Send + 'static,
        F: FnOnce(Qdrant) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = std::result::Result<R, QdrantError>> + Send + 'static,
    {
        let client = self.client.clone();
        self.on_runtime(async move { f(client).await.map(|_| ()).map_err(server_err) })
            .await
    }

    /// Deletes both collections (tests and `docent migrate` clean-up).
    pub async fn drop_collections(&self) -> Result<()> {
        let (client, collection, catalog) = (
            self.client.clone(),
            self.collection.clone(),
            self.catalog.clone(),
        );
        self.on_runtime(async move {
            for c in [collection, catalog] {
                client.delete_collection(c).await.map_err(server_err)?;
            }
            Ok(())
        })
        .await
    }
}

/// Creates a collection; another replica creating it at the same moment is fine.
async fn create(client: &Qdrant, builder: CreateCollectionBuilder) -> Result<()> {
    match client.create_collection(builder).await {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("already exists") => Ok(()),
        Err(e) => Err(server_err(e)),
    }
}

impl Drop for QdrantIndex {
    fn drop(&mut self) {
        // dropping a runtime blocks; from inside another runtime it must not
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn search_query(r: &SearchRequest, collection: &str) -> QueryPointsBuilder {
    let depth = (r.limit.max(1) * r.fusion.candidates.max(1)) as u64;
    let dense = || Query::new_nearest(VectorInput::new_dense(r.dense.clone()));
    let sparse = || {
        Query::new_nearest(VectorInput::new_sparse(
            r.sparse.indices.clone(),
            r.sparse.values.clone(),
        ))
    };
    let fusion = || match r.fusion.method {
        FusionMethod::Rrf => Query::new_rrf(
            RrfBuilder::with_k(r.fusion.rrf_k as u32)
                .weights(vec![r.fusion.dense_weight, r.fusion.sparse_weight]),
        ),
        FusionMethod::Dbsf => Query::new_fusion(qdrant_client::qdrant::Fusion::Dbsf),
    };
    let mut q = QueryPointsBuilder::new(collection)
        .limit(r.limit as u64)
        .with_payload(r.with_payload);
    if let Some(f) = server_filter(&r.filter) {
        q = q.filter(f);
    }
    // the beam width and exactness of dense searches (sparse ones are always exact)
    let ann = || {
        SearchParamsBuilder::default()
            .hnsw_ef(r.ann.ef as u64)
            .exact(r.ann.exact)
    };
    let hybrid_prefetches = |p: PrefetchQueryBuilder| {
        p.add_prefetch(
            PrefetchQueryBuilder::default()
                .query(dense())
                .using(DENSE)
                .params(ann())
                .limit(depth),
        )
        .add_prefetch(
            PrefetchQueryBuilder::default()
                .query(sparse())
                .using(SPARSE)
                .limit(depth),
        )
    };
    match r.fusion.mmr_lambda {
        None => match r.mode {
            SearchMode::Dense => q.query(dense()).using(DENSE).params(ann()),
            SearchMode::Sparse => q.query(sparse()).using(SPARSE),
            SearchMode::Hybrid => q
                .add_prefetch(
                    PrefetchQueryBuilder::default()
                        .query(dense())
                        .using(DENSE)
                        .params(ann())
                        .limit(depth),
                )
                .add_prefetch(
                    PrefetchQueryBuilder::default()
                        .query(sparse())
                        .using(SPARSE)
                        .limit(depth),
                )
                .query(fusion()),
        },
        Some(lambda) => {
            // the ranking becomes the candidate pool MMR picks `limit` points from
            let pool = match r.mode {
                SearchMode::Dense => PrefetchQueryBuilder::default()
                    .query(dense())
                    .using(DENSE)
                    .params(ann()),
                SearchMode::Sparse => PrefetchQueryBuilder::default()
                    .query(sparse())
                    .using(SPARSE),
                SearchMode::Hybrid => {
                    hybrid_prefetches(PrefetchQueryBuilder::default()).query(fusion())
                }
            }
            .limit(depth);
            let mmr = MmrBuilder::new()
                .diversity(1.0 - lambda)
                .candidates_limit(depth as u32);
            q.add_prefetch(pool)
                .query(Query::new_nearest_with_mmr(
                    VectorInput::new_dense(r.dense.clone()),
                    mmr,
                ))
                .using(DENSE)
        }
    }
}

#[async_trait]
impl VectorIndex for QdrantIndex {
    fn describe(&self) -> String {
        format!(
            "Qdrant server at {}, collection {}",
            self.url, self.collection
        )
    }

    fn exclusive(&self) -> bool {
        false
    }

    async fn upsert(&self, points: Vec<Point>) -> Result<()> {
        if points.is_empty() {
            return Ok(());
        }
        let points = points
            .into_iter()
            .map(|p| {
                let vectors = NamedVectors::default()
                    .add_vector(DENSE, Vector::new_dense(p.dense))
                    .add_vector(
                        SPARSE,
                        Vector::new_sparse(p.sparse.indices, p.sparse.values),
                    );
                Ok(PointStruct::new(
                    p.id,
                    vectors,
                    to_server_payload(p.payload)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let collection = self.collection.clone();
        self.acknowledged(move |client| async move {
            client
                .upsert_points(
                    UpsertPointsBuilder::new(collection, points)
                        .wait(true)
                        .ordering(strong()),
                )
                .await
        })
        .await
    }

    async fn delete(&self, filter: &Filter) -> Result<()> {
        let filter = server_filter(filter).unwrap_or_default();
        let collection = self.collection.clone();
        self.acknowledged(move |client| async move {
            client
                .delete_points(
                    DeletePointsBuilder::new(collection)
                        .points(filter)
                        .wait(true)
                        .ordering(strong()),
                )
                .await
        })
        .await
    }

    async fn set_payload(&self, filter: &Filter, payload: Payload) -> Result<()> {
        let filter = server_filter(filter).unwrap_or_default();
        let payload = to_server_payload(payload)?;
        let collection = self.collection.clone();
        self.acknowledged(move |client| async move {
            client
                .set_payload(
                    SetPayloadPointsBuilder::new(collection, payload)
                        .points_selector(filter)
                        .wait(true)
                        .ordering(strong()),
                )
                .await
        })
        .await
    }

    async fn search(&self, request: &SearchRequest) -> Result<Vec<Scored>> {
        let query = search_query(request, &self.collection);
        let client = self.client.clone();
        self.on_runtime(async move {
            let response = client.query(query).await.map_err(server_err)?;
            response
                .result
                .into_iter()
                .map(|p| {
                    Ok(Scored {
                        id: num_id(p.id)?,
                        score: p.score,
                        payload: (!p.payload.is_empty()).then(|| to_json(p.payload)),
                    })
                })
                .collect()
        })
        .await
    }

    async fn retrieve(&self, ids: &[u64]) -> Result<Vec<Record>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<PointId> = ids.iter().map(|&id| id.into()).collect();
        let (client, collection) = (self.client.clone(), self.collection.clone());
        self.on_runtime(async move {
            let response = client
                .get_points(GetPointsBuilder::new(collection, ids).with_payload(true))
                .await
                .map_err(server_err)?;
            response
                .result
                .into_iter()
                .map(|p| {
                    Ok(Record {
                        id: num_id(p.id)?,
                        payload: to_json(p.payload),
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
        let (points, next) = self.scroll_with(filter, limit, offset, false).await?;
        Ok((
            points
                .into_iter()
                .map(|p| Record {
                    id: p.id,
                    payload: p.payload,
                })
                .collect(),
            next,
        ))
    }

    async fn scroll_points(
        &self,
        limit: usize,
        offset: Option<u64>,
    ) -> Result<(Vec<Point>, Option<u64>)> {
        self.scroll_with(&Filter::default(), limit, offset, true)
            .await
    }

    async fn count(&self, filter: &Filter) -> Result<usize> {
        let mut request = CountPointsBuilder::new(&self.collection).exact(true);
        if let Some(f) = server_filter(filter) {
            request = request.filter(f);
        }
        let client = self.client.clone();
        self.on_runtime(async move {
            let response = client.count(request).await.map_err(server_err)?;
            Ok(response.result.map_or(0, |r| r.count as usize))
        })
        .await
    }

    async fn facet(&self, field: &'static str, filter: &Filter) -> Result<Vec<(String, usize)>> {
        let mut request = FacetCountsBuilder::new(&self.collection, field)
            .limit(u32::MAX as u64)
            .exact(true);
        if let Some(f) = server_filter(filter) {
            request = request.filter(f);
        }
        let client = self.client.clone();
        self.on_runtime(async move {
            let response = client.facet(request).await.map_err(server_err)?;
            Ok(response
                .hits
                .into_iter()
                .filter_map(|h| match h.value.and_then(|v| v.variant) {
                    Some(qdrant_client::qdrant::facet_value::Variant::StringValue(s)) => {
                        Some((s, h.count as usize))
                    }
                    _ => None,
                })
                .collect())
        })
        .await
    }

    async fn flush(&self) -> Result<()> {
        // every write waited for the server's acknowledgement (its WAL)
        Ok(())
    }

    async fn optimize(&self) -> Result<bool> {
        // the server's optimizers run by themselves
        Ok(false)
    }

    async fn catalog_get(&self, kind: &str, name: &str) -> Result<Option<Value>> {
        let (client, catalog) = (self.client.clone(), self.catalog.clone());
        let id: PointId = catalog_id(kind, name).into();
        self.on_runtime(async move {
            let response = client
                .get_points(GetPointsBuilder::new(catalog, vec![id]).with_payload(true))
                .await
                .map_err(server_err)?;
            Ok(response
                .result
                .into_iter()
                .next()
                .map(|p| to_json(p.payload).remove("value").unwrap_or(Value::Null)))
        })
        .await
    }

    async fn catalog_put(&self, kind: &str, name: &str, value: Value) -> Result<()> {
        let payload = to_server_payload(
            match json!({ "kind": kind, "name": name, "value": value }) {
                Value::Object(m) => m,
                _ => unreachable!("a json object literal"),
            },
        )?;
        let point = PointStruct::new(
            catalog_id(kind, name),
            NamedVectors::default().add_vector(CATALOG_VECTOR, Vector::new_dense(vec![1.0])),
            payload,
        );
        let catalog = self.catalog.clone();
        self.acknowledged(move |client| async move {
            client
                .upsert_points(
                    UpsertPointsBuilder::new(catalog, vec![point])
                        .wait(true)
                        .ordering(strong()),
                )
                .await
        })
        .await
    }

    async fn sync_catalog(&self) -> Result<()> {
        // every write waited for the server's acknowledgement (its WAL)
        Ok(())
    }

    async fn catalog_delete(&self, kind: &str, name: &str) -> Result<()> {
        let ids = PointsIdsList {
            ids: vec![catalog_id(kind, name).into()],
        };
        let catalog = self.catalog.clone();
        self.acknowledged(move |client| async move {
            client
                .delete_points(
                    DeletePointsBuilder::new(catalog)
                        .points(ids)
                        .wait(true)
                        .ordering(strong()),
                )
                .await
        })
        .await
    }

    async fn catalog_list(&self, kind: &str) -> Result<Vec<(String, Value)>> {
        let (client, catalog) = (self.client.clone(), self.catalog.clone());
        let filter =
            qdrant_client::qdrant::Filter::must([Condition::matches("kind", kind.to_string())]);
        self.on_runtime(async move {
            let mut out = Vec::new();
            let mut offset: Option<PointId> = None;
            loop {
                let mut request = ScrollPointsBuilder::new(&catalog)
                    .filter(filter.clone())
                    .limit(256)
                    .with_payload(true);
                if let Some(o) = offset.take() {
                    request = request.offset(o);
                }
                let response = client.scroll(request).await.map_err(server_err)?;
                for p in response.result {
                    let mut payload = to_json(p.payload);
                    if let Some(Value::String(name)) = payload.remove("name") {
                        out.push((name, payload.remove("value").unwrap_or(Value::Null)));
                    }
                }
                match response.next_page_offset {
                    Some(next) => offset = Some(next),
                    None => break,
                }
            }
            out.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(out)
        })
        .await
    }
}

impl QdrantIndex {
    async fn scroll_with(
        &self,
        filter: &Filter,
        limit: usize,
        offset: Option<u64>,
        vectors: bool,
    ) -> Result<(Vec<Point>, Option<u64>)> {
        let mut request = ScrollPointsBuilder::new(&self.collection)
            .limit(limit.max(1) as u32)
            .with_payload(true)
            .with_vectors(vectors);
        if let Some(f) = server_filter(filter) {
            request = request.filter(f);
        }
        if let Some(o) = offset {
            request = request.offset(o);
        }
        let client = self.client.clone();
        self.on_runtime(async move {
            let response = client.scroll(request).await.map_err(server_err)?;
            let points = response
                .result
                .into_iter()
                .map(point_of)
                .collect::<Result<Vec<_>>>()?;
            let next = match response.next_page_offset {
                Some(id) => Some(num_id(Some(id))?),
                None => None,
            };
            Ok((points, next))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Ann, Fusion};
    use qdrant_client::qdrant::query::Variant;

    fn request(mode: SearchMode, fusion: Fusion) -> SearchRequest {
        SearchRequest {
            dense: vec![0.6, 0.8, 0.0],
            sparse: SparseVector {
                indices: vec![3, 9],
                values: vec![1.0, 1.0],
            },
            mode,
            fusion,
            ann: Ann {
                ef: 77,
                exact: false,
            },
            limit: 5,
            filter: Filter::is("collections", "books").and_not("document_id", ["a", "b"]),
            with_payload: false,
        }
    }

    fn variant(q: &Option<Query>) -> &Variant {
        q.as_ref()
            .and_then(|q| q.variant.as_ref())
            .expect("a query")
    }

    /// The server runs the plan the embedded engine runs: two prefetches `limit ×
    /// candidates` deep over the named vectors, then weighted RRF with an explicit k.
    #[test]
    fn hybrid_search_is_the_same_plan_as_on_the_embedded_engine() {
        let fusion = Fusion {
            method: FusionMethod::Rrf,
            rrf_k: 60,
            dense_weight: 2.0,
            sparse_weight: 0.5,
            candidates: 8,
            mmr_lambda: None,
        };
        let q = search_query(&request(SearchMode::Hybrid, fusion), "c").build();
        assert_eq!(q.collection_name, "c");
        assert_eq!(q.limit, Some(5));
        let using: Vec<_> = q.prefetch.iter().map(|p| p.using.as_deref()).collect();
        assert_eq!(using, [Some(DENSE), Some(SPARSE)]);
        assert!(q.prefetch.iter().all(|p| p.limit == Some(40)));
        // the dense ranking is searched with the configured beam; BM25 is always exact
        let ef: Vec<_> = q
            .prefetch
            .iter()
            .map(|p| p.params.as_ref().and_then(|p| p.hnsw_ef))
            .collect();
        assert_eq!(ef, [Some(77), None]);
        match variant(&q.query) {
            Variant::Rrf(rrf) => {
                assert_eq!(rrf.k, Some(60), "k is explicit: the server's default is 2");
                assert_eq!(rrf.weights, vec![2.0, 0.5]);
            }
            other => panic!("expected RRF, got {other:?}"),
        }
        let dbsf = search_query(&request(SearchMode::Hybrid, Fusion::default()), "c").build();
        assert!(
            matches!(variant(&dbsf.query), Variant::Fusion(f) if *f == qdrant_client::qdrant::Fusion::Dbsf as i32)
        );
        // the filter applies to the whole query (the server propagates it to prefetches)
        let f = q.filter.expect("a filter");
        assert_eq!((f.must.len(), f.must_not.len()), (1, 1));
    }

    #[test]
    fn mmr_takes_diversity_as_one_minus_lambda_over_the_candidate_pool() {
        let fusion = Fusion {
            mmr_lambda: Some(0.7),
            ..Fusion::default()
        };
        let q = search_query(&request(SearchMode::Dense, fusion), "c").build();
        assert_eq!(q.using.as_deref(), Some(DENSE));
        assert_eq!(q.prefetch.len(), 1);
        assert_eq!(q.prefetch[0].limit, Some(40));
        match variant(&q.query) {
            Variant::NearestWithMmr(n) => {
                let mmr = n.mmr.as_ref().expect("mmr");
                assert!((mmr.diversity.unwrap() - 0.3).abs() < 1e-6);
                assert_eq!(mmr.candidates_limit, Some(40));
            }
            other => panic!("expected MMR, got {other:?}"),
        }
    }

    #[test]
    fn sparse_search_uses_the_bm25_vector() {
        let q = search_query(&request(SearchMode::Sparse, Fusion::default()), "c").build();
        assert_eq!(q.using.as_deref(), Some(SPARSE));
        assert!(q.prefetch.is_empty());
        assert!(matches!(variant(&q.query), Variant::Nearest(_)));
        assert!(q.params.is_none());
    }

    #[test]
    fn dense_search_takes_the_beam_width_and_exactness() {
        let mut r = request(SearchMode::Dense, Fusion::default());
        let q = search_query(&r, "c").build();
        let p = q.params.expect("search params");
        assert_eq!((p.hnsw_ef, p.exact), (Some(77), Some(false)));
        r.ann.exact = true;
        let q = search_query(&r, "c").build();
        assert_eq!(q.params.and_then(|p| p.exact), Some(true));
    }

    /// With nothing listening, connecting fails fast with a message that names the URL
    /// and what to check (a real connection attempt, not a mock).
    #[tokio::test]
    async fn an_unreachable_server_is_reported_with_its_url() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port(); // bound, then released: nothing listens there now
        let url = format!("http://127.0.0.1:{port}");
        let err = QdrantIndex::connect(
            &QdrantOptions {
                url: url.clone(),
                api_key: None,
                collection: "c".into(),
                timeout: std::time::Duration::from_secs(2),
            },
            3,
        )
        .await
        .err()
        .expect("no server");
        assert!(err.is_unavailable(), "{err}");
        let text = err.to_string();
        assert!(text.contains(&url) && text.contains("6334"), "{text}");
    }
}
