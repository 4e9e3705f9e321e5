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
//! | `meta` | `epoch` | changes with every change of the hidden set, before the points under it change |
//! | `hidden` | document id | a document being written, or about to be deleted |
//! | `journal` | hash of the version | an unfinished write, rolled back or forward on open or by [`Store::sweep`] |
//! | `failed` | hash of the source | a version rolled back after a crash |
//!
//! # What a reader sees
//!
//! A search never sees half a document or two versions of one source. The rule that gives
//! it: **the points of a document that search can see never change.** A writer first hides
//! the document (a `hidden` entry, which every search excludes), then changes the `epoch`,
//! and only then writes, re-labels or deletes its points; a new version is shown, and the
//! versions it replaces are hidden, in one step ([`Store::publish`]).
//!
//! A [`View`] is a read over one state: it holds the hidden set it read, and
//! - in this process, a read lock that every hide and show takes for writing, so no
//!   document visible to the view is hidden (and then changed) while the view is held;
//! - for other processes sharing the index (replicas on one Qdrant collection), the
//!   `epoch` it started from: [`View::unchanged`] tells whether another writer hid or
//!   showed anything meanwhile, in which case the read is done again.
//!
//! The race this replaced: the hidden set used to be read, the search run, and a writer
//! could begin (hide) and write a new version between the two, so the search's stale
//! filter let the new version's first chunks through beside the old version.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::index::{Filter, Payload, Point, Scored, SearchRequest, VectorIndex};
use crate::types::{
    point_id, Ann, ChunkPayload, Derived, DocumentInfo, Embedding, Fusion, Hit, Origin,
    SearchFilter, SearchMode, Version,
};
use crate::{Error, Result};

/// Layout of the points and the catalog; older layouts cannot be read.
/// 3: the catalog (hidden documents, journal, failed versions) lives in the index.
pub const FORMAT: u32 = 3;

/// A journal entry on a shared index that has not been touched for this long belongs to
/// a process that died: it is rolled back (or forward) by the next process that opens
/// the index, or by a running one's [`Store::sweep`] (the default of `store.stale_after_s`).
pub const STALE_AFTER_SECS: u64 = 600;

/// How many times a read is done again when other replicas keep changing what search
/// shows while it runs, before it fails as unavailable (the service answers 503).
pub const READ_ATTEMPTS: usize = 8;

/// A `hidden` entry that hides everything: an unfinished `docent migrate` into this index.
pub(crate) const MIGRATING: &str = "*migrating*";

/// The `meta` entry that changes with every change of the hidden set.
pub(crate) const EPOCH: &str = "epoch";

/// What an index was built with; an index built otherwise is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    #[serde(default)]
    /// The index format's version (this build writes [`FORMAT`]).
    pub format: u32,
    /// SHA-256 of the embedding model file the vectors came from.
    pub embedding_model_sha256: String,
    /// Dimension of the dense vectors.
    pub dim: usize,
}

impl Identity {
    /// This build's format with the given model and dimension.
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
    /// `version`'s writer stopped touching its entry on a shared index and another
    /// process deleted its points, leaving the document hidden: a writer that was only
    /// slow may still write a batch, which stays hidden. Once this entry is stale too,
    /// the points are deleted again and the document's hidden mark goes.
    RolledBack { version: Version },
}

#[derive(Debug, Serialize, Deserialize)]
struct Journaled {
    entry: JournalEntry,
    /// Seconds since the epoch of the last write under this entry.
    updated: u64,
    /// The same in milliseconds (entries written before it existed have 0).
    #[serde(default)]
    updated_ms: u64,
    /// The [`Store`] that wrote the entry (a token per opened store): a writer goes on
    /// only while the entry is still its own.
    #[serde(default)]
    owner: String,
    /// The writer's stale time, milliseconds: no other process takes the entry for a dead
    /// writer's sooner, whatever its own setting.
    #[serde(default)]
    lease_ms: u64,
}

impl Journaled {
    /// Whether the entry went untouched for `stale_after` (and for its writer's own stale
    /// time) by now.
    fn stale(&self, stale_after: std::time::Duration) -> bool {
        let updated = if self.updated_ms > 0 {
            self.updated_ms
        } else {
            self.updated.saturating_mul(1000)
        };
        let limit = (stale_after.as_millis() as u64).max(self.lease_ms);
        now_ms().saturating_sub(updated) >= limit
    }

    /// The document the entry writes.
    fn document_id(&self) -> &str {
        match &self.entry {
            JournalEntry::Writing { version }
            | JournalEntry::Publishing { version, .. }
            | JournalEntry::RolledBack { version } => &version.document_id,
        }
    }
}

/// A fresh token (catalog values that only need to differ from every earlier one).
fn token() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    hash_name(&[
        &nanos.to_string(),
        &n.to_string(),
        &std::process::id().to_string(),
    ])
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
/// Readers never see half a document or two versions of one source (see the module's
/// "What a reader sees"): a version being written is hidden from search until
/// [`Store::publish`] shows it and hides the versions it replaces in one step; those are
/// then deleted.
pub struct Store {
    index: Arc<dyn VectorIndex>,
    /// Versions rolled back when the store was opened.
    recovered: Vec<Version>,
    /// This store's mark on the journal entries it writes.
    owner: String,
    /// How long a journal entry on a shared index may go untouched before other processes
    /// take its writer for dead.
    stale_after: std::time::Duration,
    /// When each of this store's writes last wrote its journal entry (journal name →
    /// the moment before that write was sent): its lease. A writer stops on its own
    /// once half of `stale_after` has passed without one, well before any other process
    /// may take over, so its writes never overlap a rollback.
    leases: std::sync::Mutex<HashMap<String, std::time::Instant>>,
    /// Held for reading by every [`View`], for writing by every change of the hidden set.
    visibility: tokio::sync::RwLock<()>,
    /// How searches rank by the dense vectors.
    ann: Ann,
}

/// A consistent read of the store (see the module's "What a reader sees"): searches and
/// payload reads over one hidden set. Hold it only while reading: writers that hide or
/// show documents wait for it.
pub struct View<'s> {
    store: &'s Store,
    _visible: tokio::sync::RwLockReadGuard<'s, ()>,
    epoch: Option<Value>,
    hidden: Vec<String>,
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
            owner: token(),
            stale_after,
            leases: Default::default(),
            visibility: Default::default(),
            ann: Ann::default(),
        };
        store.recovered = store.recover(stale_after).await?;
        Ok(store)
    }

    /// This store, its searches ranking by the dense vectors as `ann` says.
    pub fn with_ann(mut self, ann: Ann) -> Self {
        self.ann = ann;
        self
    }

    /// How searches rank by the dense vectors.
    pub fn ann(&self) -> Ann {
        self.ann
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
        let sent = std::time::Instant::now();
        let ms = now_ms();
        let value = serde_json::to_value(Journaled {
            entry,
            updated: ms / 1000,
            updated_ms: ms,
            owner: self.owner.clone(),
            lease_ms: self.stale_after.as_millis() as u64,
        })
        .map_err(Error::engine)?;
        let name = journal_name(v);
        self.index.catalog_put("journal", &name, value).await?;
        // a journal entry must outlive a power cut: it is what recovery goes by
        self.index.sync_catalog().await?;
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name, sent);
        Ok(())
    }

    fn end_lease(&self, version: &Version) {
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&journal_name(version));
    }

    /// Fails when this store's write of `version` went longer than half the stale time
    /// without writing its journal entry (see `leases`): another process may soon take it
    /// for a dead writer's.
    fn check_lease(&self, version: &Version) -> Result<()> {
        let last = self
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&journal_name(version))
            .copied();
        match last {
            Some(t) if t.elapsed() < self.stale_after / 2 => Ok(()),
            _ => Err(Error::TakenOver(format!(
                "the ingest of {} stopped: it wrote nothing for half of the index's stale time (store.stale_after_s = {} s), after which another process may roll it back; ingest it again",
                version.source,
                self.stale_after.as_secs()
            ))),
        }
    }

    /// Rolls back or forward the writes of processes that died on a shared index: journal
    /// entries nobody touched for the stale time the store was opened with
    /// (`store.stale_after_s`). Replicas call it
    /// now and then, so a dead replica's half-written document does not stay hidden until
    /// the next start. Returns the versions rolled back.
    pub async fn sweep(&self) -> Result<Vec<Version>> {
        self.recover(self.stale_after).await
    }

    /// The stale time this store was opened with (`store.stale_after_s`).
    pub fn stale_after(&self) -> std::time::Duration {
        self.stale_after
    }

    /// Rolls unfinished writes back (a version being written) or forward (a version being
    /// published): all of them on an index only this process writes, the stale ones
    /// ([`STALE_AFTER_SECS`]) on a shared one. Returns the versions rolled back.
    async fn recover(&self, stale_after: std::time::Duration) -> Result<Vec<Version>> {
        let exclusive = self.index.exclusive();
        let mut rolled_back = Vec::new();
        let mut changed = false;
        for (name, _) in self.index.catalog_list("journal").await? {
            // read again: the list may be old by now (a writer touched or finished since)
            let Some(value) = self.index.catalog_get("journal", &name).await? else {
                continue;
            };
            let Ok(journaled) = serde_json::from_value::<Journaled>(value) else {
                self.index.catalog_delete("journal", &name).await?;
                changed = true;
                continue;
            };
            if !exclusive && !journaled.stale(stale_after) {
                continue; // another replica is writing it
            }
            changed = true;
            // Points of a document are deleted only while it is hidden and no other
            // write names it: same content is the same document, so another source's
            // writer may be writing it, or may have shown it since.
            let sole = exclusive || self.sole_writer(&name, journaled.document_id()).await?;
            match journaled.entry {
                JournalEntry::Writing { version } if !exclusive => {
                    // the writer may only be slow: its points go, its document stays
                    // hidden (a late batch with it) until this entry is stale in turn
                    if sole {
                        self.index
                            .delete(&Filter::is("document_id", &version.document_id))
                            .await?;
                    }
                    self.journal_write(
                        &version,
                        JournalEntry::RolledBack {
                            version: version.clone(),
                        },
                    )
                    .await?;
                    self.mark_failed(&version).await?;
                    tracing::warn!(source = %version.source, stale_after_s = stale_after.as_secs(), "rolled back an ingest another process left unfinished");
                    rolled_back.push(version);
                    continue; // the entry stays, now as RolledBack
                }
                JournalEntry::Writing { version } => {
                    self.roll_back(&version).await?;
                    tracing::warn!(source = %version.source, "rolled back an interrupted ingest");
                    self.mark_failed(&version).await?;
                    rolled_back.push(version);
                }
                JournalEntry::RolledBack { version } => {
                    if sole {
                        self.roll_back(&version).await?;
                    }
                }
                JournalEntry::Publishing {
                    version,
                    origin,
                    replaces,
                } => {
                    // everything it touches is hidden while it is finished, then shown
                    let mut touched = vec![version.document_id.clone()];
                    touched.extend(
                        replaces
                            .iter()
                            .filter(|old| **old != version)
                            .map(|old| old.document_id.clone()),
                    );
                    self.set_hidden(&touched, &[]).await?;
                    if let Some(o) = &origin {
                        if !self.origins(&version.document_id).await?.is_empty() {
                            self.attach_unversioned(&version.document_id, o).await?;
                        }
                    }
                    for old in replaces.iter().filter(|old| **old != version) {
                        self.detach_unversioned(&old.document_id, &old.source)
                            .await?;
                    }
                    self.set_hidden(&[], &touched).await?;
                }
            }
            self.index.catalog_delete("journal", &name).await?;
        }
        if exclusive {
            // nothing else can be writing: a document still hidden was left by a crash
            // (an unfinished migration stays marked: only `docent migrate` finishes it)
            for (id, _) in self.index.catalog_list("hidden").await? {
                if id != MIGRATING {
                    self.index.catalog_delete("hidden", &id).await?;
                    changed = true;
                }
            }
        }
        if changed {
            self.index.flush().await?;
            self.bump().await?;
            self.index.sync_catalog().await?;
        }
        Ok(rolled_back)
    }

    /// Whether `document_id` is hidden and no journal entry but `name` writes it.
    async fn sole_writer(&self, name: &str, document_id: &str) -> Result<bool> {
        let hidden = self.index.catalog_list("hidden").await?;
        if !hidden.iter().any(|(id, _)| id == document_id) {
            return Ok(false); // shown since: someone published it
        }
        for (other, value) in self.index.catalog_list("journal").await? {
            if other != name
                && serde_json::from_value::<Journaled>(value)
                    .is_ok_and(|j| j.document_id() == document_id)
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Records a rolled-back version as failed (until its source is written again).
    async fn mark_failed(&self, version: &Version) -> Result<()> {
        self.index
            .catalog_put(
                "failed",
                &hash_name(&[&version.source]),
                serde_json::to_value(version).map_err(Error::engine)?,
            )
            .await
    }

    /// Fails when `version`'s journal entry is no longer this store's own write of it:
    /// another replica took the writer for dead and rolled it back.
    async fn check_own(&self, version: &Version) -> Result<()> {
        let entry = self
            .index
            .catalog_get("journal", &journal_name(version))
            .await?
            .and_then(|v| serde_json::from_value::<Journaled>(v).ok());
        match entry {
            Some(Journaled {
                entry: JournalEntry::Writing { .. },
                owner,
                ..
            }) if owner == self.owner => Ok(()),
            _ => Err(Error::TakenOver(format!(
                "the ingest of {} was rolled back by another process: it wrote nothing for longer than the index's stale time (store.stale_after_s); ingest it again",
                version.source
            ))),
        }
    }

    /// Marks a change of what search can see (see [`Self::revision`]).
    async fn bump(&self) -> Result<()> {
        self.index
            .catalog_put("meta", "revision", json!(token()))
            .await
    }

    /// Hides the documents `hide` and shows `show` (in that order: never both versions
    /// at once), then changes the epoch; under the visibility lock, so this process's
    /// views see all of it or none. A document's points may change only after it was
    /// hidden here (or in [`Self::set_hidden_locked`]).
    async fn set_hidden(&self, hide: &[String], show: &[String]) -> Result<()> {
        let _swap = self.visibility.write().await;
        self.set_hidden_locked(hide, show).await
    }

    /// [`Self::set_hidden`] for a caller that holds the visibility lock for writing (to
    /// change documents that views see, and show them again, in one step for this
    /// process's readers).
    async fn set_hidden_locked(&self, hide: &[String], show: &[String]) -> Result<()> {
        for id in hide {
            self.index.catalog_put("hidden", id, json!({})).await?;
        }
        for id in show {
            self.index.catalog_delete("hidden", id).await?;
        }
        self.index.catalog_put("meta", EPOCH, json!(token())).await
    }

    /// A consistent read of what search shows now (see [`View`]).
    pub async fn view(&self) -> Result<View<'_>> {
        let visible = self.visibility.read().await;
        // the epoch before the hidden set: a change between the two reads shows as a
        // changed epoch at the end
        let epoch = self.index.catalog_get("meta", EPOCH).await?;
        let hidden = self.hidden().await?;
        Ok(View {
            store: self,
            _visible: visible,
            epoch,
            hidden,
        })
    }

    /// The error of a read that other processes kept changing under it
    /// ([`READ_ATTEMPTS`] reads in a row).
    pub fn kept_changing() -> Error {
        Error::Unavailable(format!(
            "what search shows changed during {READ_ATTEMPTS} reads in a row (other processes are publishing into this index); try again"
        ))
    }

    /// [`View::query`] on one state of the store: again when another process changed what
    /// search shows meanwhile ([`View::unchanged`]).
    async fn query(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
        with_payload: bool,
    ) -> Result<Vec<Scored>> {
        for _ in 0..READ_ATTEMPTS {
            let view = self.view().await?;
            let found = view
                .query(query, mode, fusion, limit, only, with_payload)
                .await?;
            if view.unchanged().await? {
                return Ok(found);
            }
        }
        Err(Self::kept_changing())
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

    /// Removes every chunk of a document (hidden first: no search sees part of it).
    pub async fn delete_document(&self, document_id: &str) -> Result<()> {
        let id = [document_id.to_string()];
        let swap = self.visibility.write().await;
        self.set_hidden_locked(&id, &[]).await?;
        let result = self
            .index
            .delete(&Filter::is("document_id", document_id))
            .await;
        if result.is_ok() {
            self.set_hidden_locked(&[], &id).await?;
        }
        drop(swap);
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
        let id = [document_id.to_string()];
        let swap = self.visibility.write().await;
        self.set_hidden_locked(&id, &[]).await?;
        let result = self.attach_unversioned(document_id, origin).await;
        self.set_hidden_locked(&[], &id).await?;
        drop(swap);
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
        let id = [document_id.to_string()];
        let swap = self.visibility.write().await;
        self.set_hidden_locked(&id, &[]).await?;
        let result = self.detach_unversioned(document_id, source).await;
        self.set_hidden_locked(&[], &id).await?;
        drop(swap);
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

    /// Whether a document is hidden from search (being written, deleted, or left by a
    /// write another process rolled back): its points are not a stored document.
    pub async fn is_hidden(&self, document_id: &str) -> Result<bool> {
        Ok(self
            .index
            .catalog_get("hidden", document_id)
            .await?
            .is_some())
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

    /// Whether the index holds no chunk.
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
        self.set_hidden(std::slice::from_ref(&version.document_id), &[])
            .await
    }

    /// Marks a version being written as alive (on a shared index, a journal entry left
    /// untouched for `store.stale_after_s` is taken for a crashed writer's); fails when
    /// that already happened, or may soon ([`Error::TakenOver`]: stop writing it).
    pub async fn touch(&self, version: &Version) -> Result<()> {
        if !self.index.exclusive() {
            self.check_lease(version)?;
            self.check_own(version).await?;
        }
        self.journal_write(
            version,
            JournalEntry::Writing {
                version: version.clone(),
            },
        )
        .await
    }

    /// [`Self::touch`] when a quarter of the stale time has passed since the last one
    /// (call it after every batch); on a shared index, fails once the write's lease has
    /// run out ([`Error::TakenOver`]). Nothing to do on an exclusive index.
    pub async fn keep_alive(&self, version: &Version) -> Result<()> {
        if self.index.exclusive() {
            return Ok(());
        }
        self.check_lease(version)?;
        let due = self
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&journal_name(version))
            .is_none_or(|t| t.elapsed() >= self.stale_after / 4);
        if due {
            self.touch(version).await?;
        }
        Ok(())
    }

    /// Makes `version` what its source shows, in one step for readers: shows the document
    /// (written since [`Store::begin`], or already stored under other sources, in which
    /// case `origin` is added to it), hides the documents in `replaces` that no other
    /// source holds, then removes `version.source` from each of `replaces`.
    ///
    /// Documents whose labels change (the stored document that gains `origin`, replaced
    /// ones that other sources keep) are hidden while they change and shown with the new
    /// version; replaced ones that vanish are hidden with that step, then deleted.
    pub async fn publish(
        &self,
        version: &Version,
        origin: Option<&Origin>,
        replaces: &[Version],
    ) -> Result<()> {
        // the new version must be durable before the journal says it is complete
        self.index.flush().await?;
        if origin.is_none() && !self.index.exclusive() {
            // written under `begin` on a shared index: still this store's write, with
            // time left before anyone may take it over?
            self.check_lease(version)?;
            self.check_own(version).await?;
        }
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
        let mut relabelled = Vec::new();
        for old in replaces {
            let origins = self.origins(&old.document_id).await?;
            if origins.iter().all(|o| o.source == old.source) {
                vanishing.push(old.document_id.clone());
            } else if old.document_id != version.document_id {
                relabelled.push(old.document_id.clone());
            }
        }
        let mut changing = relabelled.clone();
        if origin.is_some() {
            changing.push(version.document_id.clone());
        }
        // held from the relabelling to the swap: this process's readers see the old
        // state or the new one; other processes' may see the relabelled ones missing
        // for that moment, never changing
        let swap = self.visibility.write().await;
        if !changing.is_empty() {
            self.set_hidden_locked(&changing, &[]).await?;
        }
        let mut result = match origin {
            Some(o) => self
                .attach_unversioned(&version.document_id, o)
                .await
                .map(|_| ()),
            None => Ok(()),
        };
        for old in replaces
            .iter()
            .filter(|old| !vanishing.contains(&old.document_id))
        {
            if let Err(e) = self.detach_unversioned(&old.document_id, &old.source).await {
                result = Err(e);
            }
        }
        // the swap: the replaced versions out, the new one (and the relabelled) in
        let mut shown = relabelled;
        shown.push(version.document_id.clone());
        self.set_hidden_locked(&vanishing, &shown).await?;
        drop(swap);
        for old in replaces
            .iter()
            .filter(|old| vanishing.contains(&old.document_id))
        {
            if let Err(e) = self.detach_unversioned(&old.document_id, &old.source).await {
                result = Err(e);
            }
        }
        if result.is_ok() {
            // the vanished versions have no points left: their hidden marks can go
            for id in &vanishing {
                self.index.catalog_delete("hidden", id).await?;
            }
            self.index
                .catalog_delete("journal", &journal_name(version))
                .await?;
            self.end_lease(version);
        }
        self.index
            .catalog_delete("failed", &hash_name(&[&version.source]))
            .await?;
        self.bump().await?;
        result
    }

    /// Deletes a version that could not be written completely.
    pub async fn abort(&self, version: &Version) -> Result<()> {
        self.end_lease(version);
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

    /// Documents hidden from search now; unavailable while a migration fills the index.
    async fn hidden(&self) -> Result<Vec<String>> {
        let hidden: Vec<String> = self
            .index
            .catalog_list("hidden")
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        if hidden.iter().any(|id| id == MIGRATING) {
            return Err(Error::Unavailable(format!(
                "a migration into this index ({}) is unfinished: run the same `docent migrate` again to finish it",
                self.index.describe()
            )));
        }
        Ok(hidden)
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

    /// The best `limit` chunks for a query among published versions that pass `only`
    /// (applied inside the search): by dense similarity, by BM25 (IDF from the index), or
    /// both fused as `fusion` says over the `fusion.candidates`× deeper result lists of
    /// each. One consistent read ([`View::search`]).
    pub async fn search(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<Hit>> {
        to_hits(self.query(query, mode, fusion, limit, only, true).await?)
    }

    /// [`Self::search`] without the payloads ([`View::search_scores`]).
    pub async fn search_scores(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<(u64, f32)>> {
        Ok(to_scores(
            self.query(query, mode, fusion, limit, only, false).await?,
        ))
    }

    /// The chunks of scored point ids ([`View::hits`]).
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

fn to_hits(found: Vec<Scored>) -> Result<Vec<Hit>> {
    found
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

fn to_scores(found: Vec<Scored>) -> Vec<(u64, f32)> {
    found.into_iter().map(|p| (p.id, p.score)).collect()
}

impl View<'_> {
    async fn query(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
        with_payload: bool,
    ) -> Result<Vec<Scored>> {
        let request = SearchRequest {
            dense: query.dense.clone(),
            sparse: query.sparse.clone(),
            mode,
            fusion: *fusion,
            ann: self.store.ann,
            limit,
            filter: Store::filter(only, self.hidden.clone()),
            with_payload,
        };
        self.store.index.search(&request).await
    }

    /// See [`Store::search`].
    pub async fn search(
        &self,
        query: &Embedding,
        mode: SearchMode,
        fusion: &Fusion,
        limit: usize,
        only: &SearchFilter,
    ) -> Result<Vec<Hit>> {
        to_hits(self.query(query, mode, fusion, limit, only, true).await?)
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
        Ok(to_scores(
            self.query(query, mode, fusion, limit, only, false).await?,
        ))
    }

    /// The chunks of scored point ids (from [`Self::search_scores`] or a fusion of such
    /// lists), in the order given, with their scores; ids no longer stored are skipped.
    pub async fn hits(&self, scored: &[(u64, f32)]) -> Result<Vec<Hit>> {
        self.store.hits(scored).await
    }

    /// Whether what search shows is still what this view started from: false when
    /// another process sharing the index hid or showed documents meanwhile (the read may
    /// then mix versions and must be done again). Call it after the last read.
    pub async fn unchanged(&self) -> Result<bool> {
        Ok(self.store.index.catalog_get("meta", EPOCH).await? == self.epoch)
    }
}
