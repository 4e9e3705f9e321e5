//! The ingest pipeline: the one place that knows the order **load → split → embed → store**.
//! The CLI and the HTTP service both call [`Ingestor`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use tracing::{debug, info_span, warn};

use crate::embed::{Embedder, Embedding};
use crate::load::{self, Document};
use crate::split::{Chunk, Splitter};
use crate::store::{block_on, ChunkPayload, Origin, Span, Store, Version};
use crate::{Error, Result};

/// What happened to one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// New or changed content was written; older versions of the same source removed.
    Ingested {
        /// The content id.
        document_id: String,
        /// Chunks written.
        chunks: usize,
    },
    /// This exact content is already in the index under this source.
    Unchanged {
        /// The content id.
        document_id: String,
    },
    /// This exact content was already stored under another source: nothing was embedded
    /// or written again, the source was added to the stored document.
    Deduplicated {
        /// The content id.
        document_id: String,
        /// Chunks of the stored document.
        chunks: usize,
    },
}

/// Summary of one ingest run.
#[derive(Debug, Default)]
pub struct Report {
    /// Documents written, by source.
    pub ingested: Vec<(String, Outcome)>,
    /// Documents whose content was already stored under the same source.
    pub unchanged: Vec<(String, Outcome)>,
    /// Documents whose content was already stored under another source.
    pub deduplicated: Vec<(String, Outcome)>,
    /// Files that could not be ingested, with the reason.
    pub failed: Vec<(PathBuf, String)>,
    /// Files in the given directories whose type is not supported.
    pub skipped: Vec<PathBuf>,
}

impl Report {
    /// Chunks written by this run (the unchanged and deduplicated documents write none).
    pub fn chunks_written(&self) -> usize {
        self.ingested
            .iter()
            .map(|(_, o)| match o {
                Outcome::Ingested { chunks, .. } => *chunks,
                _ => 0,
            })
            .sum()
    }
}

/// Progress notifications, so the CLI can draw a bar and the service can track jobs.
/// `item` is the input's position in the list given to [`Ingestor::ingest`]. All calls
/// come from the thread that called `ingest`.
pub trait Progress: Send + Sync {
    /// Once, with the number of inputs and their total size in bytes.
    fn start(&self, _items: usize, _bytes: u64) {}
    /// `chunks` more of the `total` chunks of `item` were embedded, covering about
    /// `bytes` more bytes of input.
    fn advance(&self, _item: usize, _chunks: usize, _total: usize, _bytes: u64) {}
    /// An input is finished (ingested, unchanged, deduplicated or failed).
    fn done(&self, _item: usize, _name: &str, _result: &std::result::Result<Outcome, String>) {}
}

/// No progress output.
pub struct Silent;
impl Progress for Silent {}

/// One thing to ingest.
pub enum Input {
    /// A file to load.
    File(PathBuf),
    /// A document already loaded (an upload).
    Document(Document),
}

impl Input {
    fn name(&self) -> String {
        match self {
            Input::File(p) => p.display().to_string(),
            Input::Document(d) => d.source.clone(),
        }
    }
    fn size(&self) -> u64 {
        match self {
            Input::File(p) => std::fs::metadata(p).map(|m| m.len()).unwrap_or(0),
            Input::Document(d) => d.text.len() as u64,
        }
    }
}

/// How the stages are run.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Threads that load and split documents while the embedder runs.
    pub workers: usize,
    /// Documents loaded and split ahead of the embedder (bounds memory).
    pub queue_depth: usize,
    /// Embedded batches waiting to be written (bounds memory).
    pub write_queue: usize,
    /// The store is made durable after this many chunks of a long document, so the
    /// write-ahead log of one big document does not grow without bound.
    pub flush_every: usize,
    /// After a run that wrote chunks, build the vector indexes (HNSW) of segments that
    /// grew large enough ([`Store::optimize`]); off when a caller batches many runs and
    /// optimizes once at the end.
    pub optimize: bool,
    /// What each chunk's vectors see besides its text ([`Headers`]).
    pub headers: Headers,
}

/// Context put before a chunk's text when it is embedded (dense and BM25 vectors; the
/// stored text, spans and citations are the chunk alone). A chunk in the middle of a long
/// document rarely names what it is about: its document title and section headings do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Headers {
    /// The chunk's text only.
    None,
    /// The document title.
    Title,
    /// The document title and the Markdown heading path the chunk starts under.
    #[default]
    Section,
}

/// Longest context line, in characters (about 30 model tokens).
pub const MAX_HEADER_CHARS: usize = 120;

impl Headers {
    /// The context line for a chunk of a document titled `title` that starts under
    /// `heading` (a ` › `-joined path); `None` when there is nothing to add. A heading path
    /// that starts with the title does not repeat it.
    pub fn line(self, title: &str, heading: &str) -> Option<String> {
        let title = title.trim();
        let heading = heading.trim();
        let line = match self {
            Headers::None => return None,
            Headers::Title => title.to_string(),
            Headers::Section if heading.is_empty() => title.to_string(),
            Headers::Section if title.is_empty() || heading.starts_with(title) => {
                heading.to_string()
            }
            Headers::Section => format!("{title} › {heading}"),
        };
        // a header is a few words: it must leave the chunk its place in the model's input
        let line: String = line.chars().take(MAX_HEADER_CHARS).collect();
        (!line.is_empty()).then_some(line)
    }

    /// The text a chunk's vectors are made from.
    pub fn embedded_text<'t>(self, title: &str, chunk: &'t Chunk) -> std::borrow::Cow<'t, str> {
        match self.line(title, &chunk.heading) {
            Some(line) => format!("{line}\n\n{}", chunk.text).into(),
            None => chunk.text.as_str().into(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Headers::None => "none",
            Headers::Title => "title",
            Headers::Section => "section",
        }
    }
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            queue_depth: 2,
            write_queue: 4,
            flush_every: 4096,
            optimize: true,
            headers: Headers::default(),
        }
    }
}

/// A loaded document, split unless its content is already stored.
struct Prepared {
    doc: Document,
    chunks: Option<Vec<Chunk>>,
}

/// Orders a document's chunks by length before they are cut into embedding batches, so a
/// batch holds texts of similar length: each batch is padded to its longest text, and in
/// document order about 30 % of the tokens run through the model would be padding (the
/// Rust Book: 434k tokens with padding for 334k real ones). Chunks keep their index, so
/// the order they are written in does not matter.
pub fn order_for_batching(chunks: &mut [Chunk]) {
    chunks.sort_by_key(|c| c.text.len());
}

/// The bounded queue between the workers and the writer: prepared documents by input
/// position. A worker waits while its document is `depth` or more ahead of the writer.
struct Handoff {
    state: parking_lot::Mutex<(usize, std::collections::BTreeMap<usize, Result<Prepared>>)>,
    changed: parking_lot::Condvar,
    depth: usize,
}

impl Handoff {
    fn new(depth: usize) -> Self {
        Handoff {
            state: Default::default(),
            changed: Default::default(),
            depth,
        }
    }

    fn wait_for_room(&self, i: usize) {
        let mut state = self.state.lock();
        while i >= state.0 + self.depth {
            self.changed.wait(&mut state);
        }
    }

    fn put(&self, i: usize, prepared: Result<Prepared>) {
        self.state.lock().1.insert(i, prepared);
        self.changed.notify_all();
    }

    fn take(&self, i: usize) -> Result<Prepared> {
        let mut state = self.state.lock();
        loop {
            if let Some(p) = state.1.remove(&i) {
                state.0 = i + 1;
                self.changed.notify_all();
                return p;
            }
            self.changed.wait(&mut state);
        }
    }
}

/// Runs the pipeline. Stages and their threads:
///
/// ```text
/// workers (load → split) ──queue_depth docs──▶ embed (this thread) ──write_queue batches──▶ store writer
/// ```
///
/// Writes to the store are serialised (one document at a time), so identical content
/// arriving from two sources at once is stored once.
pub struct Ingestor {
    splitter: Splitter,
    embedder: Arc<Embedder>,
    store: Arc<Store>,
    config: PipelineConfig,
    write_lock: parking_lot::Mutex<()>,
}

impl Ingestor {
    /// The pipeline over these stages; `config` sets the workers and queue depths.
    pub fn new(
        splitter: Splitter,
        embedder: Arc<Embedder>,
        store: Arc<Store>,
        config: PipelineConfig,
    ) -> Self {
        Ingestor {
            splitter,
            embedder,
            store,
            config,
            write_lock: Default::default(),
        }
    }

    /// The store chunks are written to.
    pub fn store(&self) -> Arc<Store> {
        self.store.clone()
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<()> {
        Ok(block_on(self.store.flush())?)
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
        let mut report = Report {
            skipped: found.skipped,
            failed: unreadable,
            ..Report::default()
        };
        let files = found.files;
        let inputs = files.iter().cloned().map(Input::File).collect();
        for (path, result) in files.into_iter().zip(self.ingest(inputs, progress)) {
            let name = path.display().to_string();
            match result {
                Ok(o @ Outcome::Ingested { .. }) => report.ingested.push((name, o)),
                Ok(o @ Outcome::Unchanged { .. }) => report.unchanged.push((name, o)),
                Ok(o @ Outcome::Deduplicated { .. }) => report.deduplicated.push((name, o)),
                Err(e) => {
                    let msg = e.to_string();
                    let msg = if msg.starts_with(&name) {
                        msg
                    } else {
                        format!("{name}: {msg}")
                    };
                    report.failed.push((path, msg));
                }
            }
        }
        Ok(report)
    }

    /// Ingests `inputs`, one result per input in the same order. Loading and splitting
    /// run on worker threads ahead of the embedder through a bounded queue; a failed
    /// input leaves nothing behind and the others go on.
    pub fn ingest(&self, inputs: Vec<Input>, progress: &dyn Progress) -> Vec<Result<Outcome>> {
        let sizes: Vec<u64> = inputs.iter().map(Input::size).collect();
        let names: Vec<String> = inputs.iter().map(Input::name).collect();
        progress.start(inputs.len(), sizes.iter().sum());
        let n = inputs.len();
        let queue: Vec<parking_lot::Mutex<Option<Input>>> = inputs
            .into_iter()
            .map(|i| parking_lot::Mutex::new(Some(i)))
            .collect();
        let next = AtomicUsize::new(0);
        let handoff = Handoff::new(self.config.queue_depth.max(1));
        let workers = self.config.workers.clamp(1, n.max(1));
        let mut results = Vec::with_capacity(n);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                let (queue, next, handoff) = (&queue, &next, &handoff);
                scope.spawn(move || loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(input) = queue.get(i).and_then(|slot| slot.lock().take()) else {
                        break;
                    };
                    handoff.wait_for_room(i);
                    let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.prepare(input)
                    }))
                    .unwrap_or_else(|_| Err(Error::Embed("loading or splitting panicked".into())));
                    handoff.put(i, prepared);
                });
            }
            // The writer takes documents in input order, so a run is deterministic.
            for (i, (size, name)) in sizes.iter().copied().zip(&names).enumerate() {
                let prepared = handoff.take(i);
                let advanced = std::cell::Cell::new(0u64);
                let on_batch = |done: usize, total: usize| {
                    let bytes = size * done as u64 / total.max(1) as u64;
                    advanced.set(advanced.get() + bytes);
                    progress.advance(i, done, total, bytes);
                };
                // a panic here must not leave the workers waiting for room forever
                let result = prepared.and_then(|p| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.write(&p.doc, p.chunks, &on_batch)
                    }))
                    .unwrap_or_else(|_| {
                        Err(Error::Store(docent_store::Error::Engine(
                            "writing the document panicked".into(),
                        )))
                    })
                });
                progress.advance(i, 0, 0, size.saturating_sub(advanced.get()));
                if let Err(e) = &result {
                    warn!(input = %name, error = %e, "ingest failed");
                }
                let shown = result.as_ref().map(Clone::clone).map_err(|e| e.to_string());
                progress.done(i, name, &shown);
                results.push(result);
            }
        });
        if let Err(e) = block_on(self.store.flush()) {
            warn!(error = %e, "could not flush the index");
        }
        let wrote = results
            .iter()
            .any(|r| matches!(r, Ok(Outcome::Ingested { .. })));
        if self.config.optimize && wrote {
            let started = std::time::Instant::now();
            match block_on(self.store.optimize()) {
                Ok(changed) => debug!(
                    changed,
                    seconds = started.elapsed().as_secs_f64(),
                    "optimized the index"
                ),
                Err(e) => warn!(error = %e, "could not optimize the index (search stays exact)"),
            }
        }
        results
    }

    /// Worker stage: load, and split unless the content is already stored.
    fn prepare(&self, input: Input) -> Result<Prepared> {
        let mut doc = match input {
            Input::File(path) => load::load_file(&path)?,
            Input::Document(doc) => doc,
        };
        let stored = self.stored_chunks(&doc.id, &self.fingerprint())?;
        let chunks = (stored == 0).then(|| self.splitter.split(&doc));
        if chunks.is_some() {
            // the chunks carry the text from here on: do not hold a big document twice
            doc.text = String::new();
        }
        Ok(Prepared { doc, chunks })
    }

    /// Chunks of a stored document made by `pipeline`; none while it is hidden (points of
    /// a write in progress, or left by one another process rolled back, are not stored).
    fn stored_chunks(&self, document_id: &str, pipeline: &str) -> Result<usize> {
        if block_on(self.store.is_hidden(document_id))? {
            return Ok(0);
        }
        Ok(block_on(self.store.stored_chunks(document_id, pipeline))?)
    }

    /// Removes what a failed write left, unless another process took the write over (it
    /// rolls it back itself: same content may be another writer's by then).
    fn give_up(&self, version: &Version, e: Error) -> Error {
        if !matches!(e, Error::Store(docent_store::Error::TakenOver(_))) {
            if let Err(abort) = block_on(self.store.abort(version)) {
                warn!(error = %abort, "could not remove a partly written document");
            }
        }
        e
    }

    /// Splits, embeds and stores one document. Unchanged content is a no-op; content
    /// stored under another source is not written again; a changed document replaces the
    /// older version's chunks of the same source.
    pub fn ingest_document(&self, doc: &Document) -> Result<Outcome> {
        self.write(doc, None, &|_, _| {})
    }

    /// Writer stage for one document (`chunks`: its chunks if already split).
    fn write(
        &self,
        doc: &Document,
        chunks: Option<Vec<Chunk>>,
        on_batch: &dyn Fn(usize, usize),
    ) -> Result<Outcome> {
        let _span = info_span!("ingest", source = %doc.source).entered();
        let _serialised = self.write_lock.lock();
        let pipeline = self.fingerprint();
        let origin = Origin {
            source: doc.source.clone(),
            collection: doc.collection.clone(),
            tags: doc.tags.clone(),
        };
        let version = Version {
            document_id: doc.id.clone(),
            source: doc.source.clone(),
        };
        let replaces: Vec<Version> = block_on(self.store.documents_of_source(&doc.source))?
            .into_iter()
            .filter(|id| *id != doc.id)
            .map(|document_id| Version {
                document_id,
                source: doc.source.clone(),
            })
            .collect();
        let stored = self.stored_chunks(&doc.id, &pipeline)?;
        let origins = block_on(self.store.origins(&doc.id))?;
        if stored > 0 {
            let known = origins.iter().find(|o| o.source == doc.source);
            if known == Some(&origin) && replaces.is_empty() {
                return Ok(Outcome::Unchanged {
                    document_id: doc.id.clone(),
                });
            }
            block_on(self.store.publish(&version, Some(&origin), &replaces))?;
            return Ok(if known.is_some() {
                Outcome::Unchanged {
                    document_id: doc.id.clone(),
                }
            } else {
                Outcome::Deduplicated {
                    document_id: doc.id.clone(),
                    chunks: stored,
                }
            });
        }
        // new content, or content stored with other settings: (re)write it for every source
        if !origins.is_empty() {
            block_on(self.store.delete_document(&doc.id))?;
        }
        let mut all_origins: Vec<Origin> = origins
            .into_iter()
            .filter(|o| o.source != doc.source)
            .collect();
        all_origins.insert(0, origin);
        let chunks = chunks.unwrap_or_else(|| self.splitter.split(doc));
        let n = chunks.len();
        // Written batch by batch while hidden from search; shown in one step at the end.
        block_on(self.store.begin(&version))?;
        if let Err(e) =
            self.embed_and_store(doc, &version, chunks, &pipeline, &all_origins, on_batch)
        {
            // leave nothing of a failed document behind
            return Err(self.give_up(&version, e));
        }
        match block_on(self.store.publish(&version, None, &replaces)) {
            Ok(()) => {}
            // another replica took this write for a dead one's: nothing was shown
            Err(e @ docent_store::Error::TakenOver(_)) => {
                return Err(self.give_up(&version, Error::Store(e)));
            }
            // the new version is visible; an old one may linger until the next run
            Err(e) => warn!(error = %e, "could not remove the previous version"),
        }
        debug!(chunks = n, document_id = %doc.id, "ingested");
        Ok(Outcome::Ingested {
            document_id: doc.id.clone(),
            chunks: n,
        })
    }

    /// Embeds `chunks` in batches on this thread while a second thread writes the
    /// embedded batches (a bounded queue between them), flushing every
    /// [`PipelineConfig::flush_every`] chunks.
    fn embed_and_store(
        &self,
        doc: &Document,
        version: &Version,
        chunks: Vec<Chunk>,
        pipeline: &str,
        origins: &[Origin],
        on_batch: &dyn Fn(usize, usize),
    ) -> Result<()> {
        let n = chunks.len();
        let mut chunks = chunks;
        order_for_batching(&mut chunks);
        let batch_size = self.embedder.config().batch_size.max(1);
        // (payload, dense vector, the text the vectors are made from when it is not the
        // chunk's own)
        type Embedded = (ChunkPayload, Vec<f32>, Option<String>);
        let (tx, rx) = sync_channel::<Vec<Embedded>>(self.config.write_queue.max(1));
        std::thread::scope(|scope| {
            // BM25 vectors are made here, beside the model rather than in its way
            let writer = scope.spawn(move || -> Result<()> {
                let mut unflushed = 0;
                for batch in rx {
                    unflushed += batch.len();
                    let points = batch
                        .into_iter()
                        .map(|(p, dense, embedded)| {
                            let sparse = self
                                .embedder
                                .embed_sparse_document(embedded.as_deref().unwrap_or(&p.text));
                            (p, Embedding { dense, sparse })
                        })
                        .collect();
                    block_on(self.store.upsert(points))?;
                    if unflushed >= self.config.flush_every.max(1) {
                        block_on(self.store.flush())?;
                        unflushed = 0;
                    }
                    // still alive: other replicas must not take this write for a dead
                    // one's (on a shared index: a touch every quarter of the stale time)
                    block_on(self.store.keep_alive(version))?;
                }
                Ok(())
            });
            let mut rest = chunks.into_iter();
            let embedded = loop {
                let batch: Vec<Chunk> = rest.by_ref().take(batch_size).collect();
                if batch.is_empty() {
                    break Ok(());
                }
                let headers = self.config.headers;
                let texts: Vec<std::borrow::Cow<'_, str>> = batch
                    .iter()
                    .map(|c| headers.embedded_text(&doc.title, c))
                    .collect();
                let refs: Vec<&str> = texts.iter().map(|t| t.as_ref()).collect();
                let embeddings = match self.embedder.embed_dense(&refs) {
                    Ok(e) => e,
                    Err(e) => break Err(e),
                };
                let k = batch.len();
                let owned: Vec<Option<String>> = texts
                    .into_iter()
                    .map(|t| match t {
                        std::borrow::Cow::Owned(t) => Some(t),
                        std::borrow::Cow::Borrowed(_) => None,
                    })
                    .collect();
                let points = batch
                    .into_iter()
                    .zip(embeddings)
                    .zip(owned)
                    .map(|((c, e), t)| (self.payload(doc, c, n, pipeline, origins), e, t))
                    .collect();
                if tx.send(points).is_err() {
                    break Ok(()); // the writer failed: its error is reported below
                }
                on_batch(k, n);
            };
            drop(tx);
            let written = writer.join().unwrap_or_else(|_| {
                Err(Error::Store(docent_store::Error::Engine(
                    "the store writer panicked".into(),
                )))
            });
            embedded.and(written)
        })
    }

    fn payload(
        &self,
        doc: &Document,
        c: Chunk,
        n: usize,
        pipeline: &str,
        origins: &[Origin],
    ) -> ChunkPayload {
        let mut p = ChunkPayload {
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
            text: c.text,
            collection: None,
            tags: Vec::new(),
            origins: Vec::new(),
            sources: Vec::new(),
            collections: Vec::new(),
        };
        p.set_origins(origins.to_vec());
        p
    }

    /// How chunks are made now: the embedding model and the chunking settings.
    /// A setting left at its old default adds nothing, so indexes written before it
    /// existed still match.
    fn fingerprint(&self) -> String {
        let mut f = format!(
            "{}/{}/{}",
            self.embedder.model_sha256().get(..16).unwrap_or(""),
            self.splitter.max_tokens(),
            self.splitter.overlap()
        );
        if self.config.headers != Headers::None {
            f.push_str("/h:");
            f.push_str(self.config.headers.name());
        }
        if let Some(bm25) = self.embedder.bm25_fingerprint() {
            f.push_str("/bm25:");
            f.push_str(&bm25);
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str, heading: &str) -> Chunk {
        Chunk {
            index: 0,
            text: text.into(),
            start: 0,
            end: text.len(),
            heading: heading.into(),
        }
    }

    #[test]
    fn headers_name_the_document_and_section_without_repeating_the_title() {
        let c = chunk("It moves the value.", "Ownership › Move");
        assert_eq!(
            Headers::None.embedded_text("Book", &c),
            "It moves the value."
        );
        assert_eq!(
            Headers::Title.embedded_text("Book", &c),
            "Book\n\nIt moves the value."
        );
        assert_eq!(
            Headers::Section.embedded_text("Book", &c),
            "Book › Ownership › Move\n\nIt moves the value."
        );
        // a Markdown title is its first heading: said once
        assert_eq!(
            Headers::Section
                .line("Ownership", "Ownership › Move")
                .as_deref(),
            Some("Ownership › Move")
        );
        assert_eq!(Headers::Section.line("Book", "").as_deref(), Some("Book"));
        assert_eq!(Headers::Section.line(" ", ""), None);
        // the chunk's own text is borrowed when nothing is added
        assert!(matches!(
            Headers::Title.embedded_text("", &c),
            std::borrow::Cow::Borrowed(_)
        ));
        let long = "word ".repeat(100);
        let line = Headers::Title.line(&long, "").unwrap();
        assert_eq!(line.chars().count(), MAX_HEADER_CHARS);
    }
}
