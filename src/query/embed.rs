//! **Where a question is embedded**: [`QueryBatcher::embed_question`] (dense and BM25
//! vectors), with opportunistic batching of the dense model runs ([`QueryBatcher`]).
//!
//! Query embedding with opportunistic batching. The ONNX session runs one batch at a time,
//! so concurrent questions would queue for it one by one; instead, a single thread takes
//! the first waiting question and every other question already waiting (up to
//! `max_batch`) and embeds them in one run. A lone question never waits for company: it is
//! embedded at once, as before. Batching helps because a short question uses the model
//! poorly: measured with the fp32 MiniLM on two threads, 3.0 ms for one question, 7.5 ms
//! for four, 25 ms for sixteen (1.6 ms each).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};

use docent_ingest::embed::{Embedder, Embedding};

/// Cosine similarity of two vectors.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    dot / (norm(a) * norm(b))
}

type Reply = Sender<docent_ingest::Result<Vec<f32>>>;

/// Embeds questions, batching the dense model runs of concurrent ones on one thread.
pub struct QueryBatcher {
    embedder: Arc<Embedder>,
    max_batch: usize,
    /// Started on first use, so commands that never embed a question start no thread.
    queue: Mutex<Option<SyncSender<(String, Reply)>>>,
    /// Questions embedded and model runs (batches) they took.
    counts: Arc<(AtomicUsize, AtomicUsize)>,
}

impl QueryBatcher {
    /// **Where a question is embedded**: its dense vector (the ONNX model, batched with
    /// concurrent questions, on a blocking thread) and its BM25 vector.
    pub async fn embed_question(
        self: &Arc<Self>,
        question: &str,
    ) -> docent_ingest::Result<Embedding> {
        let (queries, q) = (self.clone(), question.to_string());
        let embed = move || {
            Ok(Embedding {
                dense: queries.embed(&q)?,
                sparse: queries.embedder.embed_sparse_query(&q),
            })
        };
        // on tokio's blocking pool inside a runtime; inline from plain threads (tools)
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => rt.spawn_blocking(embed).await.map_err(|e| {
                docent_ingest::Error::Embed(format!("the embedding task failed: {e}"))
            })?,
            Err(_) => embed(),
        }
    }

    /// A batcher over `embedder` that embeds at most `max_batch` questions (at least 1) per
    /// model run. The embedding thread starts on first use.
    pub fn new(embedder: Arc<Embedder>, max_batch: usize) -> Self {
        QueryBatcher {
            embedder,
            max_batch: max_batch.max(1),
            queue: Default::default(),
            counts: Default::default(),
        }
    }

    /// (questions embedded, batches they were embedded in) so far.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.counts.0.load(Ordering::Relaxed),
            self.counts.1.load(Ordering::Relaxed),
        )
    }

    /// The dense vector of `question`. Blocking.
    pub fn embed(&self, question: &str) -> docent_ingest::Result<Vec<f32>> {
        let (reply, answer) = mpsc::channel();
        let stopped = || docent_ingest::Error::Embed("the query embedding thread stopped".into());
        self.sender()?
            .send((question.to_string(), reply))
            .map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())?
    }

    fn sender(&self) -> docent_ingest::Result<SyncSender<(String, Reply)>> {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = queue.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::sync_channel(1024);
        let (embedder, max, counts) = (self.embedder.clone(), self.max_batch, self.counts.clone());
        std::thread::Builder::new()
            .name("query-embed".into())
            .spawn(move || run(&embedder, &rx, max, &counts))
            .map_err(|e| {
                docent_ingest::Error::Embed(format!("cannot start the query embedding thread: {e}"))
            })?;
        *queue = Some(tx.clone());
        Ok(tx)
    }
}

/// Embeds what is waiting, batch after batch, until every sender is gone.
fn run(
    embedder: &Embedder,
    rx: &Receiver<(String, Reply)>,
    max: usize,
    counts: &(AtomicUsize, AtomicUsize),
) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < max {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        counts.0.fetch_add(batch.len(), Ordering::Relaxed);
        counts.1.fetch_add(1, Ordering::Relaxed);
        let texts: Vec<&str> = batch.iter().map(|(q, _)| q.as_str()).collect();
        match embedder.embed_dense(&texts) {
            Ok(vectors) if vectors.len() == batch.len() => {
                for ((_, reply), v) in batch.into_iter().zip(vectors) {
                    let _ = reply.send(Ok(v));
                }
            }
            result => {
                let message = match result {
                    Err(e) => e.to_string(),
                    Ok(v) => format!("{} vectors for {} questions", v.len(), batch.len()),
                };
                for (_, reply) in batch {
                    let _ = reply.send(Err(docent_ingest::Error::Embed(message.clone())));
                }
            }
        }
    }
}
