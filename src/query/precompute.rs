//! Passages' keys and values computed ahead of the questions (`docent precompute`, issue
//! 55): every chunk of the index, as the answer path would quote it in place 1, through the
//! generator's passage cache, so that it lands on disk beside the index and the first
//! question that retrieves it places it instead of computing it.

use docent_ingest::store::SearchFilter;

use crate::query::prompt::ContextBlock;
use crate::query::safety::Suspicion;
use crate::query::{QueryEngine, QueryError};

/// What a run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Precomputed {
    /// Documents in the index.
    pub documents: usize,
    /// Chunks read from the store and looked at.
    pub chunks: usize,
    /// Blocks computed by this run (the others were on disk or in memory already).
    pub computed: usize,
    /// Chunks the safety filter would not quote as they are (quoted or dropped when
    /// retrieved: computed when a question needs them).
    pub skipped: usize,
    /// How long the run took, in seconds.
    pub seconds: f64,
    /// Chunks whose block could not be computed (logged; the run went on).
    pub failed: usize,
    /// The run stopped because the disk was full (`generation.passage_disk_mib`): the
    /// blocks beyond it would only push out those written before.
    pub disk_full: bool,
    /// The blocks on disk afterwards.
    pub disk_files: usize,
    /// Their total size, in bytes.
    pub disk_bytes: u64,
}

impl QueryEngine {
    /// Computes every chunk's block that is not kept yet (`generation.passage_reuse =
    /// "passages"`); `progress` hears of each chunk done, with the number of chunks.
    pub async fn precompute_passages(
        &self,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Precomputed, QueryError> {
        self.precompute(progress, false).await
    }

    /// The same, a chunk at a time while no answer is being made or waiting (`docent
    /// serve` in the background: an answer that arrives waits for one block at most).
    pub async fn precompute_passages_when_idle(&self) -> Result<Precomputed, QueryError> {
        self.precompute(&|_, _| {}, true).await
    }

    async fn precompute(
        &self,
        progress: &(dyn Fn(usize, usize) + Sync),
        when_idle: bool,
    ) -> Result<Precomputed, QueryError> {
        let started = std::time::Instant::now();
        let store = &self.index.store;
        let mut documents = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let (page, more) = store
                .documents(&SearchFilter::default(), after.as_deref(), 256)
                .await
                .map_err(docent_ingest::Error::from)?;
            after = page.last().map(|d| d.id.clone());
            documents.extend(page);
            if !more || after.is_none() {
                break;
            }
        }
        let total: usize = documents.iter().map(|d| d.chunks).sum();
        let mut done = Precomputed {
            documents: documents.len(),
            ..Default::default()
        };
        'documents: for d in &documents {
            for i in 0..d.chunks {
                let Some(chunk) = store
                    .chunk(&d.id, i)
                    .await
                    .map_err(docent_ingest::Error::from)?
                else {
                    continue;
                };
                done.chunks += 1;
                progress(done.chunks, total);
                if !matches!(self.safety.suspicion(&chunk.text), Suspicion::Clean) {
                    done.skipped += 1;
                    continue;
                }
                let block = ContextBlock {
                    n: 1,
                    title: &chunk.title,
                    source: &chunk.source,
                    text: &chunk.text,
                };
                if let Some(d) = self.generator.reuse_stats().and_then(|s| s.disk) {
                    // room for about one more block, or stop
                    let next = d.bytes / d.files.max(1) as u64;
                    if d.bytes + next > d.limit {
                        tracing::warn!(
                            files = d.files,
                            bytes = d.bytes,
                            limit = d.limit,
                            "the passage disk is full (generation.passage_disk_mib): the remaining chunks' blocks are computed when a question needs them"
                        );
                        done.disk_full = true;
                        break 'documents;
                    }
                }
                while when_idle && self.answers_in_flight() > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                // the question comes after the passages: it does not change their blocks
                let computed = match self.prompts.render("?", &[block]) {
                    Ok(prompt) => self
                        .generator
                        .precompute_passages(&prompt)
                        .await
                        .map_err(QueryError::from),
                    Err(e) => Err(e.into()),
                };
                match computed {
                    Ok(n) => done.computed += n,
                    Err(e) => {
                        done.failed += 1;
                        if done.failed <= 3 {
                            tracing::warn!(document = %d.id, chunk = i, error = %e, "a passage block was not computed ahead");
                        }
                    }
                }
            }
        }
        self.generator.flush_passages().await;
        done.seconds = started.elapsed().as_secs_f64();
        if let Some(disk) = self.generator.reuse_stats().and_then(|s| s.disk) {
            done.disk_files = disk.files;
            done.disk_bytes = disk.bytes;
        }
        Ok(done)
    }
}
