//! [`Store`]: documents over any [`VectorIndex`], written once for every engine.
//!
//! Chunks are points; a document is the chunks sharing a `document_id`; the sources that
//! hold a document are its `origins`. The **catalog** (in the index itself, so every
//! replica shares it) holds what is not a chunk:
//!
//! | kind | name | value |
//! |---|---|---|
//! | `meta` | `identity` | the embedding model and dimension the index was built with |
//! | `meta` | `revision` | changes whenever what search can see changes (answer caches key on it) |
//! | `hidden` | document id | a document being written, or about to be deleted |
//! | `journal` | hash of the version | an unfinished write, rolled back or forward on open |
//! | `failed` | hash of the source | a version rolled back after a crash |

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::index::{Filter, Payload, Point, Scored, SearchRequest, VectorIndex};
use crate::types::{
    point_id, ChunkPayload, Derived, DocumentInfo, Embedding, Fusion, Hit, Origin, SearchFilter,
    SearchMode, Version,
};
use crate::{Error, Result};

/// Layout of the points and the catalog; older layouts cannot be read.
/// 3: the catalog (hidden documents, journal, failed versions) lives in the index.
pub const FORMAT: u32 = 3;

/// A journal entry on a shared index that has not been touched for this long belongs to
/// a process that died: it is rolled back (or forward) by the next process that opens
/// the index.
pub const STALE_AFTER_SECS: u64 = 600;

/// What an index was built with; an index built otherwise is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    #[serde(default)]
    pub format: u32,
    pub embedding_model_sha256: String,
    pub dim: usize,
}

impl Identity {
    pub fn new(embedding_model_sha256: &str, dim: usize) -> Self {
        Identity {
            format: FORMAT,
            embedding_model_sha256: embedding_model_sha256.to_string(),
            dim,
        }
    }
}

/// What an unfinished write was doing, so that a crash can be rolled back or forward.
#[derive(Debug, Clone, Serialize, Deserialize)]
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

#[derive(Debug, Serialize, Deserialize)]
struct Journaled {
    entry: JournalEntry,
    /// Seconds since the epoch of the last write under this entry.
    updated: u64,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn hash_name(parts: &[&str]) -> String {
    let h = Sha256::digest(parts.join("\0").as_bytes());
    hex::encode(&h[..16])
}

fn journal_name(v: &Version) -> String {
    hash_name(&[&v.document_id, &v.source])
}

fn parse_payload(payload: Payload) -> Result<ChunkPayload> {
    serde_json::from_value(Value::Object(payload)).map_err(|e| Error::Malformed {
        what: "chunk payload",
        detail: e.to_string(),
    })
}

fn to_payload(value: impl Serialize) -> Result<Payload> {
    match serde_json::to_value(value).map_err(Error::engine)? {
        Value::Object(map) => Ok(map),
        _ => Err(Error::engine("a payload must be a JSON object")),
    }
}

/// Documents, their versions and their chunks, over a [`VectorIndex`].
///
/// Readers never see half a document or two versions of one source: a version being
/// written is hidden from search until [`Store::publish`], which in one step (for this
/// process's readers; for other replicas, within one catalog write) shows it and hides
/// the versions it replaces; those are then deleted.
pub struct Store {
    index: Arc<dyn VectorIndex>,
    recovered: Vec<Version>,
    /// Orders visibility swaps against this process's searches.
    visibility: tokio::sync::RwLock<()>,
}

impl Store {
    /// Opens the documents in `index`, built with `identity` (recorded on first use,
    /// checked on every later one), and finishes writes a crash interrupted.
    pub async fn open(index: Arc<dyn VectorIndex>, identity: &Identity) -> Result<Self> {
        Self::open_with(
            index,
            identity,
            std::time::Duration::from_secs(STALE_AFTER_SECS),
        )
        .await
    }

    /// [`Self::open`], taking unfinished writes on a shared index untouched for
    /// `stale_after` for a dead writer's (on an exclusive index, all of them are).
    pub async fn open_with(
        index: Arc<dyn VectorIndex>,
        identity: &Identity,
        stale_after: std::time::Duration,
    ) -> Result<Self> {
        match index.catalog_get("meta", "identity").await? {
            Some(value) => {
                let have: Identity =
                    serde_json::from_value(value).map_err(|e| Error::Malformed {
                        what: "index identity",
                        detail: e.to_string(),
                    })?;
                if have.format != identity.format {
                    return Err(Error::Incompatible(format!(
                        "the index ({}) was written by another docent (format {}, this one reads {FORMAT}); use a new data directory or collection and ingest again",
                        index.describe(),
                        have.format
                    )));
                }
                if have != *identity {
                    return Err(Error::Incompatible(format!(
                        "the index ({}) was built with another embedding model (sha256 {}…, {} dimensions); use a new data directory or collection, or re-ingest into an empty one",
                        index.describe(),
                        have.embedding_model_sha256.get(..12).unwrap_or(""),
                        have.dim
                    )));
                }
            }
            None => {
                index
                    .catalog_put(
                        "meta",
                        "identity",
                        serde_json::to_value(identity).map_err(Error::engine)?,
                    )
                    .await?
            }
        }
        let mut store = Store {
            index,
            recovered: Vec::new(),
            visibility: Default::default(),
        };
        store.recover(stale_after.as_secs()).await?;
        Ok(store)
    }

    /// The engine underneath.
    pub fn index(&self) -> &Arc<dyn VectorIndex> {
        &self.index
    }

    /// Versions whose writing was interrupted (a crash) and that were rolled back when the
    /// store was opened.
    pub fn recovered(&self) -> &[Version] {
        &self.recovered
    }

    /// Documents marked failed because a crash interrupted their ingest (until their source
    /// is ingested again).
    pub async fn failed(&self) -> Result<Vec<Version>> {
        let mut out = Vec::new();
        for (_, v) in self.index.catalog_list("failed").await? {
            if let Ok(v) = serde_json::from_value(v) {
                out.push(v);
            }
        }
        Ok(out)
    }

    async fn journal_write(&self, v: &Version, entry: JournalEntry) -> Result<()> {
        let value = serde_json::to_value(Journaled {
            entry,
            updated: now(),
        })
        .map_err(Error::engine)?;
        self.index
            .catalog_put("journal", &journal_name(v), value)
            .await?;
        // a journal entry must outlive a power cut: it is what recovery goes by
        self.index.sync_catalog().await
    }

    /// Rolls unfinished writes back (a version being written) or forward (a version being
    /// published): all of them on an index only this process writes, the stale ones
    /// ([`STALE_AFTER_SECS`]) on a shared one.
    async fn recover(&mut self, stale_after: u64) -> Result<()> {
        let exclusive = self.index.exclusive();
        for (name, value) in self.index.catalog_list("journal").await? {
            let Ok(journaled) = serde_json::from_value::<Journaled>(value) else {
                self.index.catalog_delete("journal", &name).await?;
                continue;
            };
            if !exclusive && now().saturating_sub(journaled.updated) < stale_after {
                continue; // another replica is writing it
            }
            match journaled.entry {
                JournalEntry::Writing { version } => {
                    self.roll_back(&version).await?;
                    tracing::warn!(source = %version.source, "rolled back an interrupted ingest");
                    self.index
                        .catalog_put(
                            "failed",
                            &hash_name(&[&version.source]),
                            serde_json::to_value(&version).map_err(Error::engine)?,
                        )
                        .await?;
                    self.recovered.push(version);
                }
                JournalEntry::Publishing {
                    version,
                    origin,
                    replaces,
                } => {
                    if let Some(o) = &origin {
                        if !self.origins(&version.document_id).await?.is_empty() {
                            self.attach_unversioned(&version.document_id, o).await?;
                        }
                    }
                    self.index
                        .catalog_delete("hidden", &version.document_id)
                        .await?;
                    for old in replaces.iter().filter(|old| **old != version) {
                        self.detach_unversioned(&old.document_id, &old.source)
                            .await?;
                        self.index
                            .catalog_delete("hidden", &old.document_id)
                            .await?;
                    }
                }
            }
            self.index.catalog_delete("journal", &name).await?;
        }
        if exclusive {
            // nothing else can be writing: a document still hidden was left by a crash
            for (id, _) in self.index.catalog_list("hidden").await? {
                self.index.catalog_delete("hidden", &id).await?;
            }
        }
        self.index.flush().await?;
        self.bump().await?;
        self.index.sync_catalog().await
    }

    /// Marks a change of what search can see (see [`Self::revision`]).
    async fn bump(&self) -> Result<()> {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let token = hash_name(&[
            &nanos.to_string(),
            &n.to_string(),
            &std::process::id().to_string(),
        ]);
        self.index
            .catalog_put("meta", "revision", json!(token))
            .await
    }

    /// A value that changes whenever what search can see may have changed (a document
    /// published, rolled back, deleted, or a source added or removed), in this process or
    /// any other sharing the index; answer caches key on it. It is set after the change
    /// is done, so an answer computed from the old state is never filed under the new one.
    pub async fn revision(&self) -> Result<u64> {
        Ok(self
            .index
            .catalog_get("meta", "revision")
            .await?
            .and_then(|v| {
                v.as_str()
                    .and_then(|t| u64::from_str_radix(t.get(..16)?, 16).ok())
            })
            .unwrap_or_default())
    }

    /// Writes chunks (hidden until published when written under [`Self::begin`]); an
    /// existing point with the same id is replaced.
    pub async fn upsert(&self, chunks: Vec<(ChunkPayload, Embedding)>) -> Result<()> {
        let points = chunks
            .into_iter()
            .map(|(payload, emb)| {
                Ok(Point {
                    id: point_id(&payload.document_id, payload.chunk_index),
                    dense: emb.dense,
                    sparse: emb.sparse,
                    payload: to_payload(&payload)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.index.upsert(points).await
    }

    /// Removes every chunk of a document.
    pub async fn delete_document(&self, document_id: &str) -> Result<()> {
        let result = self
            .index
            .delete(&Filter::is("document_id", document_id))
            .await;
        self.bump().await?;
        result
    }

    /// The sources holding a document and their metadata (empty if it is not stored).
    pub async fn origins(&self, document_id: &str) -> Result<Vec<Origin>> {
        Ok(self
            .first_payload(document_id)
            .await?
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

    async fn set_origins(&self, document_id: &str, origins: &[Origin]) -> Result<()> {
        let mut payload = to_payload(Derived::of(origins))?;
        payload.insert(
            "origins".into(),
            serde_json::to_value(origins).map_err(Error::engine)?,
        );
        self.index
            .set_payload(&Filter::is("document_id", document_id), payload)
            .await
    }

    /// Adds `origin` to a stored document (or updates its metadata). Returns whether the
    /// source was new to the document.
    pub async fn attach(&self, document_id: &str, origin: &Origin) -> Result<bool> {
        let result = self.attach_unversioned(document_id, origin).await;
        self.bump().await?;
        result
    }

    async fn attach_unversioned(&self, document_id: &str, origin: &Origin) -> Result<bool> {
        let mut origins = self.origins(document_id).await?;
        if origins.is_empty() {
            return Err(Error::Engine(format!(
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
        self.set_origins(document_id, &origins).await?;
        Ok(new)
    }

    /// Removes `source` from a document's origins; a document left without sources is
    /// deleted.
    pub async fn detach(&self, document_id: &str, source: &str) -> Result<()> {
        let result = self.detach_unversioned(document_id, source).await;
        self.bump().await?;
        result
    }

    async fn detach_unversioned(&self, document_id: &str, source: &str) -> Result<()> {
        let mut origins = self.origins(document_id).await?;
        let before = origins.len();
        origins.retain(|o| o.source != source);
        if origins.is_empty() {
            self.index
                .delete(&Filter::is("document_id", document_id))
                .await
        } else if origins.len() != before {
            self.set_origins(document_id, &origins).await
        } else {
            Ok(())
        }
    }

    /// Number of chunks of a document made by `pipeline`.
    pub async fn stored_chunks(&self, document_id: &str, pipeline: &str) -> Result<usize> {
        self.index
            .count(&Filter::is("document_id", document_id).and("pipeline", [pipeline]))
            .await
    }

    /// Number of chunks stored for a document.
    pub async fn chunk_count(&self, document_id: &str) -> Result<usize> {
        self.index
            .count(&Filter::is("document_id", document_id))
            .await
    }

    /// Number of chunks in the store.
    pub async fn len(&self) -> Result<usize> {
        self.index.count(&Filter::default()).await
    }

    pub async fn is_empty(&self) -> Result<bool> {
        Ok(self.len().await? == 0)
    }

    /// Ids of the documents stored for a source.
    pub async fn documents_of_source(&self, source: &str) -> Result<BTreeSet<String>> {
        Ok(self
            .index
            .facet("document_id", &Filter::is("sources", source))
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect())
    }

    /// Hides `version` from search while it is written. Content is written only when no
    /// source holds it yet, so the whole document is hidden.
    pub async fn begin(&self, version: &Version) -> Result<()> {
        self.journal_write(
            version,
            JournalEntry::Writing {
                version: version.clone(),
            },
        )
        .await?;
        self.index
            .catalog_put("hidden", &version.document_id, json!({}))
            .await
    }

    /// Marks a version being written as alive (on a shared index, a journal entry left
    /// untouched for [`STALE_AFTER_SECS`] is taken for a crashed writer's).
    pub async fn touch(&self, version: &Version) -> Result<()> {
        self.journal_write(
            version,
            JournalEntry::Writing {
                version: version.clone(),
            },
        )
        .await
    }

    /// Makes `version` what its source shows, in one step for readers: shows the document
    /// (written since [`Store::begin`], or already stored under other sources, in which
    /// case `origin` is added to it), hides the documents in `replaces` that no other
    /// source holds, then removes `version.source` from each of `replaces`.
    pub async fn publish(
        &self,
        version: &Version,
        origin: Option<&Origin>,
        replaces: &[Version],
    ) -> Result<()> {
        // the new version must be durable before the journal says it is complete
        self.index.flush().await?;
        self.journal_write(
            version,
            JournalEntry::Publishing {
                version: version.clone(),
                origin: origin.cloned(),
                replaces: replaces.to_vec(),
            },
        )
        .await?;
        let mut vanishing = Vec::new();
        for old in replaces {
            let origins = self.origins(&old.document_id).await?;
            if origins.iter().all(|o| o.source == old.source) {
                vanishing.push(old.document_id.clone());
            }
        }
        {
            let _swap = self.visibility.write().await;
            for id in &vanishing {
                self.index.catalog_put("hidden", id, json!({})).await?;
            }
            self.index
                .catalog_delete("hidden", &version.document_id)
                .await?;
        }
        let mut result = match origin {
            Some(o) => self
                .attach_unversioned(&version.document_id, o)
                .await
                .map(|_| ()),
            None => Ok(()),
        };
        for old in replaces {
            if let Err(e) = self.detach_unversioned(&old.document_id, &old.source).await {
                result = Err(e);
            }
        }
        if result.is_ok() {
            for id in &vanishing {
                self.index.catalog_delete("hidden", id).await?;
            }
            self.index
                .catalog_delete("journal", &journal_name(version))
                .await?;
        }
        self.index
            .catalog_delete("failed", &hash_name(&[&version.source]))
            .await?;
        self.bump().await?;
        result
    }

    /// Deletes a version that could not be written completely.
    pub async fn abort(&self, version: &Version) -> Result<()> {
        self.roll_back(version).await?;
        self.index
            .catalog_delete("journal", &journal_name(version))
            .await?;
        self.bump().await
    }

    /// Removes a version being written and its hidden mark (content is written only when
    /// no source holds it yet, so the whole document goes).
    async fn roll_back(&self, version: &Version) -> Result<()> {
        self.index
            .delete(&Filter::is("document_id", &version.document_id))
            .await?;
        self.index
            .catalog_delete("hidden", &version.document_id)
            .await
    }

    /// Documents hidden from search now.
    async fn hidden(&self) -> Result<Vec<String>> {
        Ok(self
            .index
            .catalog_list("hidden")
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect())
    }

    fn filter(only: &SearchFilter, hidden: Vec<String>) -> Filter {
        let mut f = Filter::default();
        if let Some(c) = &only.collection {
            f = f.and("collections", [c.clone()]);
        }
        f.and("tags", only.tags.clone())
            .and("document_id", only.document_ids.clone())
            .and_not("document_id", hidden)
    }

    async fn query(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
        with_payload: bool,
    ) -> Result<Vec<Scored>> {
        let _visible = self.visibility.read().await;
        let request = SearchRequest {
            dense: query.dense.clone(),
            sparse: query.sparse.clone(),
            mode,
            fusion: *fusion,
            limit,
            filter: Self::filter(only, self.hidden().await?),
            with_payload,
        };
        self.index.search(&request).await
    }

    /// The best `limit` chunks for a query among published versions that pass `only`
    /// (applied inside the search): by dense similarity, by BM25 (IDF from the index), or
    /// both fused as `fusion` says over the `fusion.candidates`× deeper result lists of
    /// each.
    pub async fn search(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<Hit>> {
        self.query(query, mode, fusion, limit, only, true)
            .await?
            .into_iter()
            .map(|p| {
                let payload = p.payload.ok_or(Error::Malformed {
                    what: "search result",
                    detail: "a point without payload".into(),
                })?;
                Ok(Hit {
                    payload: parse_payload(payload)?,
                    score: p.score,
                })
            })
            .collect()
    }

    /// [`Self::search`] without the payloads: point ids (see [`point_id`]) and scores,
    /// best first. Cheaper when only the scores are needed.
    pub async fn search_scores(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<(u64, f32)>> {
        Ok(self
            .query(query, mode, fusion, limit, only, false)
            .await?
            .into_iter()
            .map(|p| (p.id, p.score))
            .collect())
    }

    /// The chunks of scored point ids (from [`Self::search_scores`] or a fusion of such
    /// lists), in the order given, with their scores; ids no longer stored are skipped.
    pub async fn hits(&self, scored: &[(u64, f32)]) -> Result<Vec<Hit>> {
        let ids: Vec<u64> = scored.iter().map(|p| p.0).collect();
        let mut found = self.payloads(&ids).await?;
        Ok(scored
            .iter()
            .filter_map(|&(id, score)| found.remove(&id).map(|payload| Hit { payload, score }))
            .collect())
    }

    /// The stored payloads of point ids, in one read; ids not stored are absent.
    pub async fn payloads(&self, ids: &[u64]) -> Result<HashMap<u64, ChunkPayload>> {
        self.index
            .retrieve(ids)
            .await?
            .into_iter()
            .map(|r| Ok((r.id, parse_payload(r.payload)?)))
            .collect()
    }

    /// Builds the vector indexes (HNSW) where the engine leaves it to the caller; returns
    /// whether anything changed.
    pub async fn optimize(&self) -> Result<bool> {
        self.index.optimize().await
    }

    /// Published documents passing `only` (its `document_ids` are ignored), sorted by id;
    /// at most `limit` with ids greater than `after`. Returns the page and whether more follow.
    pub async fn documents(
        &self,
        only: &SearchFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<DocumentInfo>, bool)> {
        let hidden = self.hidden().await?;
        let scope = SearchFilter {
            document_ids: Vec::new(),
            ..only.clone()
        };
        let mut ids: Vec<(String, usize)> = self
            .index
            .facet("document_id", &Self::filter(&scope, Vec::new()))
            .await?
            .into_iter()
            .filter(|(id, _)| !hidden.contains(id))
            .filter(|(id, _)| after.is_none_or(|a| id.as_str() > a))
            .collect();
        ids.sort();
        let more = ids.len() > limit;
        ids.truncate(limit);
        let mut docs = Vec::with_capacity(ids.len());
        for (id, chunks) in ids {
            if let Some(d) = self.describe(&id, chunks).await? {
                docs.push(d);
            }
        }
        Ok((docs, more))
    }

    /// One published document, or `None`.
    pub async fn document(&self, id: &str) -> Result<Option<DocumentInfo>> {
        if self.hidden().await?.iter().any(|h| h == id) {
            return Ok(None);
        }
        let chunks = self.chunk_count(id).await?;
        if chunks == 0 {
            return Ok(None);
        }
        self.describe(id, chunks).await
    }

    /// One chunk of a document, by its index.
    pub async fn chunk(
        &self,
        document_id: &str,
        chunk_index: usize,
    ) -> Result<Option<ChunkPayload>> {
        let id = point_id(document_id, chunk_index);
        Ok(self.payloads(&[id]).await?.remove(&id))
    }

    /// The payload of one chunk of a document (the fields every chunk shares).
    async fn first_payload(&self, id: &str) -> Result<Option<ChunkPayload>> {
        let (records, _) = self
            .index
            .scroll(&Filter::is("document_id", id), 1, None)
            .await?;
        match records.into_iter().next() {
            Some(r) => parse_payload(r.payload).map(Some),
            None => Ok(None),
        }
    }

    async fn describe(&self, id: &str, chunks: usize) -> Result<Option<DocumentInfo>> {
        Ok(self.first_payload(id).await?.map(|p| DocumentInfo {
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

    /// Makes everything written so far durable.
    pub async fn flush(&self) -> Result<()> {
        self.index.flush().await
    }
}
