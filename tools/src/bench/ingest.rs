//! `docent bench ingest`: end-to-end ingest throughput over a corpus, side by side in the
//! same run with (a) a bare ONNX Runtime session over the same pre-tokenized batches (the
//! limit) and (b) a Python peer doing the same job with the same ONNX file and threads.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use docent_ingest::bench::{batch_tokenizer, tokenize, Batch, RawSession};
use docent_ingest::load;
use docent_ingest::pipeline::Silent;
use serde::Serialize;

use super::{Peer, RemoveOnDrop};
use docent::config::Config;
use docent::server::startup;

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What was measured: docent end to end, the raw session or the Python peer.
    pub name: String,
    /// Chunks embedded (and, for docent and the peer, stored).
    pub chunks: usize,
    /// Wall-clock seconds the run took.
    pub seconds: f64,
    /// Chunks per second: `chunks / seconds`.
    pub chunks_per_s: f64,
    /// Input megabytes (10^6 bytes) per second (absent for the raw session, which reads no
    /// files).
    pub mb_per_s: Option<f64>,
}

impl Row {
    fn new(name: &str, chunks: usize, seconds: f64, bytes: Option<u64>) -> Self {
        Row {
            name: name.into(),
            chunks,
            seconds,
            chunks_per_s: chunks as f64 / seconds.max(1e-9),
            mb_per_s: bytes.map(|b| b as f64 / 1e6 / seconds.max(1e-9)),
        }
    }
}

/// The result of `docent bench ingest`: the settings it ran with and one row per
/// measurement (docent first, then the raw session, then the peer if it ran). Its
/// `Display` prints the table.
#[derive(Debug, Serialize)]
pub struct IngestBench {
    /// The corpus directory that was ingested.
    pub corpus: PathBuf,
    /// The embedding model directory used (`embedding.model_dir`).
    pub model_dir: PathBuf,
    /// Files found in the corpus.
    pub files: usize,
    /// Total size of those files in bytes.
    pub bytes: u64,
    /// Embedding threads (`embedding.threads`).
    pub threads: usize,
    /// Chunks per embedding batch (`embedding.batch_size`).
    pub batch_size: usize,
    /// Tokens in the raw session's batches counting padding to each batch's longest text.
    pub padded_tokens: usize,
    /// Tokens in the raw session's batches without padding.
    pub real_tokens: usize,
    /// Loading and splitting alone, one thread (part of docent's end-to-end work).
    pub split_seconds: f64,
    /// The measurements, docent's first.
    pub rows: Vec<Row>,
}

/// Runs the three measurements. The index is built in a temporary directory that is
/// removed afterwards.
pub fn ingest(config: &Config, corpus: &Path, peer: Option<&Peer>) -> anyhow::Result<IngestBench> {
    let found = load::discover(&[corpus.to_path_buf()])?;
    let bytes: u64 = found
        .files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let tmp = std::env::temp_dir().join(format!("docent-bench-{}", std::process::id()));
    let _cleanup = RemoveOnDrop::Dir(tmp.clone());
    let mut config = config.clone();
    config.data_dir = tmp.clone();
    let e = &config.embedding;
    let mut rows = Vec::new();

    // 1. docent, end to end: load, split, embed (dense + BM25), store, flush
    let index = startup::open_index_blocking(&config)?;
    let ingestor = startup::ingestor(&config, &index)?;
    let start = Instant::now();
    let report = ingestor.ingest_paths(&[corpus.to_path_buf()], &Silent)?;
    let seconds = start.elapsed().as_secs_f64();
    if let Some((path, err)) = report.failed.first() {
        anyhow::bail!("{} failed: {err}", path.display());
    }
    rows.push(Row::new(
        "docent ingest (end to end)",
        report.chunks_written(),
        seconds,
        Some(bytes),
    ));

    // 2. the limit: the same chunks, tokenized beforehand, through a bare session
    let splitter = docent_ingest::split::Splitter::new(
        index.embedder.sizing_tokenizer(),
        config.chunking.max_tokens,
        config.chunking.overlap,
        e.max_length,
    )?;
    let mut texts = Vec::new();
    let start = Instant::now();
    for f in &found.files {
        let doc = load::load_file(f)?;
        let mut chunks = splitter.split(&doc);
        docent_ingest::pipeline::order_for_batching(&mut chunks);
        texts.push(chunks.into_iter().map(|c| c.text).collect::<Vec<_>>());
    }
    let split_seconds = start.elapsed().as_secs_f64();
    drop(ingestor);
    drop(index);
    let (row, batches) = raw_session(&config, &texts)?;
    rows.push(row);

    // 3. the Python peer
    if let Some(p) = peer {
        rows.push(peer_row(p, corpus, &config, bytes)?);
    }

    Ok(IngestBench {
        corpus: corpus.to_path_buf(),
        model_dir: e.model_dir.clone(),
        files: found.files.len(),
        bytes,
        threads: e.threads,
        batch_size: e.batch_size,
        padded_tokens: batches.iter().map(|b| b.padded_tokens()).sum(),
        real_tokens: batches.iter().map(|b| b.real_tokens()).sum(),
        split_seconds,
        rows,
    })
}

/// The limit: the same chunks, tokenized beforehand and batched per document in the order
/// the pipeline embeds them, through a bare ONNX Runtime session. Returns its row and the
/// batches (for the token counts).
fn raw_session(config: &Config, texts: &[Vec<String>]) -> anyhow::Result<(Row, Vec<Batch>)> {
    let e = &config.embedding;
    let tok = batch_tokenizer(&e.model_dir, e.max_length)?;
    let mut batches = Vec::new();
    for doc in texts {
        batches.extend(tokenize(&tok, doc, e.batch_size)?);
    }
    let n_chunks: usize = texts.iter().map(Vec::len).sum();
    let mut raw = RawSession::load(&e.model_dir, &e.ort_library, e.threads)?;
    raw.run(&batches[..batches.len().min(4)])?; // warm-up, as the embedder's probe is
    let spent = raw.run(&batches)?;
    let row = Row::new(
        "raw ONNX Runtime session (limit)",
        n_chunks,
        spent.as_secs_f64(),
        None,
    );
    Ok((row, batches))
}

/// The Python peer over the same corpus and settings, as a row (its own byte count when
/// it gives one).
fn peer_row(p: &Peer, corpus: &Path, config: &Config, bytes: u64) -> anyhow::Result<Row> {
    let e = &config.embedding;
    let out = std::process::Command::new(&p.python)
        .arg(&p.script)
        .arg("--corpus")
        .arg(corpus)
        .arg("--model-dir")
        .arg(&e.model_dir)
        .args(["--threads", &e.threads.to_string()])
        .args(["--batch-size", &e.batch_size.to_string()])
        .args(["--max-tokens", &config.chunking.max_tokens.to_string()])
        .args(["--overlap", &config.chunking.overlap.to_string()])
        .arg("--json")
        .output()
        .with_context(|| format!("running the Python peer {}", p.python.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "the Python peer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("the Python peer printed no JSON line")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let chunks = v["chunks"].as_u64().unwrap_or(0) as usize;
    let seconds = v["seconds"].as_f64().unwrap_or(f64::NAN);
    Ok(Row::new(
        "Python peer (onnxruntime + tokenizers + semantic-text-splitter + qdrant-client)",
        chunks,
        seconds,
        Some(v["bytes"].as_u64().unwrap_or(bytes)),
    ))
}

impl std::fmt::Display for IngestBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "ingest benchmark: {} ({} files, {:.2} MB), model {}, {} threads, batches of {}",
            self.corpus.display(),
            self.files,
            self.bytes as f64 / 1e6,
            self.model_dir.display(),
            self.threads,
            self.batch_size
        )?;
        writeln!(
            f,
            "tokens: {} ({} with padding to each batch's longest text); loading and splitting alone: {:.2} s on one thread",
            self.real_tokens, self.padded_tokens, self.split_seconds
        )?;
        writeln!(
            f,
            "{:<44} {:>7} {:>9} {:>9} {:>8} {:>10}",
            "", "chunks", "seconds", "chunks/s", "MB/s", "vs docent"
        )?;
        let docent = self.rows.first().map_or(f64::NAN, |r| r.chunks_per_s);
        for r in &self.rows {
            let mut name = r.name.clone();
            name.truncate(44);
            writeln!(
                f,
                "{:<44} {:>7} {:>9.2} {:>9.1} {:>8} {:>9.2}x",
                name,
                r.chunks,
                r.seconds,
                r.chunks_per_s,
                r.mb_per_s.map_or("-".into(), |m| format!("{m:.3}")),
                r.chunks_per_s / docent
            )?;
        }
        if let [d, raw, rest @ ..] = self.rows.as_slice() {
            write!(
                f,
                "docent reaches {:.0} % of the raw session (goal >= 90 %)",
                100.0 * d.chunks_per_s / raw.chunks_per_s
            )?;
            if let Some(py) = rest.first() {
                write!(
                    f,
                    "; {:.2}x the Python peer (goal >= 1.5x)",
                    d.chunks_per_s / py.chunks_per_s
                )?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
