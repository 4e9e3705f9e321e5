//! The ingest pipeline: the one place that knows the order **load → split → embed → store**.
//! The CLI and the HTTP service both call [`Ingestor`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{debug, info_span, warn};

use crate::embed::Embedder;
use crate::load::{self, Document};
use crate::split::{Chunk, Splitter};
use crate::store::{ChunkPayload, Span, Store, Version};
use crate::Result;

/// What happened to one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// New or changed content was written; older versions of the same source removed.
    Ingested { document_id: String, chunks: usize },
    /// This exact content is already in the index.
    Unchanged { document_id: String },
}

/// Summary of one ingest run.
#[derive(Debug, Default)]
pub struct Report {
    pub ingested: Vec<(String, Outcome)>,
    pub unchanged: Vec<(String, Outcome)>,
    pub failed: Vec<(PathBuf, String)>,
    /// Files in the given directories whose type is not supported.
    pub skipped: Vec<PathBuf>,
}

impl Report {
    pub fn chunks_written(&self) -> usize {
        self.ingested
            .iter()
            .map(|(_, o)| match o {
                Outcome::Ingested { chunks, .. } => *chunks,
                Outcome::Unchanged { .. } => 0,
            })
            .sum()
    }
}

/// Progress notifications, so the CLI can draw a bar and the service can track jobs.
pub trait Progress: Send + Sync {
    /// Once, with the number of files and their total size in bytes.
    fn start(&self, _files: usize, _bytes: u64) {}
    /// `chunks` more chunks were embedded, covering about `bytes` more bytes of input.
    fn advance(&self, _chunks: usize, _bytes: u64) {}
    /// A file is finished (ingested, unchanged or failed).
    fn file_done(&self, _path: &Path, _result: &std::result::Result<Outcome, String>) {}
}

/// No progress output.
pub struct Silent;
impl Progress for Silent {}

pub struct Ingestor {
    splitter: Splitter,
    embedder: Arc<Embedder>,
    store: Arc<Store>,
}

impl Ingestor {
    pub fn new(splitter: Splitter, embedder: Arc<Embedder>, store: Arc<Store>) -> Self {
        Ingestor {
            splitter,
            embedder,
            store,
        }
    }

    /// The store chunks are written to.
    pub fn store(&self) -> Arc<Store> {
        self.store.clone()
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) {
        self.store.flush();
    }

    /// Ingests files and directories. A file that fails is reported and leaves nothing
    /// behind; the others go on.
    pub fn ingest_paths(&self, paths: &[PathBuf], progress: &dyn Progress) -> Result<Report> {
        let mut found = load::Discovered::default();
        let mut unreadable = Vec::new();
        for p in paths {
            match load::discover(std::slice::from_ref(p)) {
                Ok(d) => {
                    found.files.extend(d.files);
                    found.skipped.extend(d.skipped);
                }
                Err(e) => unreadable.push((p.clone(), e.to_string())),
            }
        }
        let sizes: Vec<u64> = found
            .files
            .iter()
            .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
            .collect();
        progress.start(found.files.len(), sizes.iter().sum());
        let mut report = Report {
            skipped: found.skipped,
            failed: unreadable,
            ..Report::default()
        };
        for (path, size) in found.files.into_iter().zip(sizes) {
            let advanced = std::cell::Cell::new(0u64);
            let on_batch = |done: usize, total: usize| {
                let bytes = size * done as u64 / total.max(1) as u64;
                advanced.set(advanced.get() + bytes);
                progress.advance(done, bytes);
            };
            let result =
                load::load_file(&path).and_then(|doc| self.ingest_document_with(&doc, &on_batch));
            progress.advance(0, size.saturating_sub(advanced.get()));
            let shown = result.as_ref().map(Clone::clone).map_err(|e| e.to_string());
            progress.file_done(&path, &shown);
            match result {
                Ok(o @ Outcome::Ingested { .. }) => {
                    report.ingested.push((path.display().to_string(), o))
                }
                Ok(o @ Outcome::Unchanged { .. }) => {
                    report.unchanged.push((path.display().to_string(), o))
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "ingest failed");
                    let shown = path.display().to_string();
                    let msg = e.to_string();
                    let msg = if msg.starts_with(&shown) {
                        msg
                    } else {
                        format!("{shown}: {msg}")
                    };
                    report.failed.push((path, msg));
                }
            }
        }
        self.store.flush();
        Ok(report)
    }

    /// Splits, embeds and stores one document. Unchanged content is a no-op; a changed
    /// document replaces the older version's chunks of the same source.
    pub fn ingest_document(&self, doc: &Document) -> Result<Outcome> {
        self.ingest_document_with(doc, &|_, _| {})
    }

    /// [`Self::ingest_document`], calling `on_batch(chunks_in_batch, chunks_in_document)`
    /// after each embedding batch.
    pub fn ingest_document_with(
        &self,
        doc: &Document,
        on_batch: &dyn Fn(usize, usize),
    ) -> Result<Outcome> {
        let _span = info_span!("ingest", source = %doc.source).entered();
        let pipeline = self.fingerprint();
        let previous = self.store.documents_of_source(&doc.source)?;
        if self
            .store
            .version_chunk_count(&doc.id, &doc.source, &pipeline)?
            > 0
        {
            self.remove_stale(&previous, doc)?;
            return Ok(Outcome::Unchanged {
                document_id: doc.id.clone(),
            });
        }
        if previous.contains(&doc.id) {
            // the same content made with other settings (same point ids): replace it
            self.store.delete_version(&doc.id, &doc.source)?;
        }
        let version = Version {
            document_id: doc.id.clone(),
            source: doc.source.clone(),
        };
        let chunks = self.splitter.split(doc);
        let n = chunks.len();
        // Written batch by batch while hidden from search; shown in one step at the end.
        self.store.begin(&version)?;
        let written = chunks
            .chunks(self.embedder.config().batch_size.max(1))
            .try_for_each(|batch| {
                let texts: Vec<&str> = batch.iter().map(|c| c.text.as_str()).collect();
                let embeddings = self.embedder.embed_documents(&texts)?;
                let points = batch
                    .iter()
                    .zip(embeddings)
                    .map(|(c, e)| (self.payload(doc, c, n, &pipeline), e))
                    .collect();
                self.store.upsert(points)?;
                on_batch(batch.len(), n);
                Ok(())
            });
        if let Err(e) = written {
            // leave nothing of a failed document behind
            if let Err(abort) = self.store.abort(&version) {
                warn!(error = %abort, "could not remove a partly written document");
            }
            return Err(e);
        }
        let replaces: Vec<Version> = previous
            .iter()
            .filter(|id| **id != doc.id)
            .map(|id| Version {
                document_id: id.clone(),
                source: doc.source.clone(),
            })
            .collect();
        if let Err(e) = self.store.publish(&version, &replaces) {
            // the new version is visible; an old one may linger until the next run
            warn!(error = %e, "could not remove the previous version");
        }
        debug!(chunks = n, document_id = %doc.id, "ingested");
        Ok(Outcome::Ingested {
            document_id: doc.id.clone(),
            chunks: n,
        })
    }

    fn payload(&self, doc: &Document, c: &Chunk, n: usize, pipeline: &str) -> ChunkPayload {
        ChunkPayload {
            document_id: doc.id.clone(),
            source: doc.source.clone(),
            title: doc.title.clone(),
            chunk_index: c.index,
            chunks_total: n,
            pipeline: pipeline.to_string(),
            page: doc.page_of(c.start),
            span: Span {
                start: c.start,
                end: c.end,
            },
            text: c.text.clone(),
            collection: doc.collection.clone(),
            tags: doc.tags.clone(),
        }
    }

    /// How chunks are made now: the embedding model and the chunking settings.
    fn fingerprint(&self) -> String {
        format!(
            "{}/{}/{}",
            self.embedder.model_sha256().get(..16).unwrap_or(""),
            self.splitter.max_tokens(),
            self.splitter.overlap()
        )
    }

    /// Deletes the older versions of `doc`'s source.
    fn remove_stale(
        &self,
        previous: &std::collections::BTreeSet<String>,
        doc: &Document,
    ) -> Result<()> {
        for old in previous.iter().filter(|id| **id != doc.id) {
            self.store.delete_version(old, &doc.source)?;
        }
        Ok(())
    }
}
