//! The limit for the ingest benchmark: a bare ONNX Runtime session running the embedding
//! model over pre-tokenized batches, with the embedder's session settings and nothing
//! else (no tokenizing, pooling, BM25, splitting or storing in the timed part).

use std::path::Path;
use std::time::{Duration, Instant};

use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::Tensor;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use crate::embed::{init_onnx_runtime, SESSION_CONFIG};
use crate::{Error, Result};

/// One padded batch: `[rows, len]` input ids and attention mask.
pub struct Batch {
    rows: usize,
    len: usize,
    ids: Vec<i64>,
    mask: Vec<i64>,
}

impl Batch {
    /// Tokens in the batch, padding included.
    pub fn padded_tokens(&self) -> usize {
        self.rows * self.len
    }

    /// Tokens in the batch without padding.
    pub fn real_tokens(&self) -> usize {
        self.mask.iter().filter(|&&m| m != 0).count()
    }
}

fn ort_err(e: impl std::fmt::Display) -> Error {
    Error::Embed(format!("ONNX Runtime: {e}"))
}

/// The model's tokenizer set up as the embedder uses it: truncated to `max_length`,
/// padded to the longest text of each batch.
pub fn batch_tokenizer(model_dir: &Path, max_length: usize) -> Result<Tokenizer> {
    let file = model_dir.join("tokenizer.json");
    let mut tok = Tokenizer::from_file(&file).map_err(|e| Error::Tokenizer(e.to_string()))?;
    tok.with_truncation(Some(TruncationParams {
        max_length,
        ..Default::default()
    }))
    .map_err(|e| Error::Tokenizer(e.to_string()))?;
    tok.with_padding(Some(PaddingParams {
        strategy: PaddingStrategy::BatchLongest,
        ..Default::default()
    }));
    Ok(tok)
}

/// Tokenizes `texts` in batches of `batch_size` with a [`batch_tokenizer`].
pub fn tokenize(tok: &Tokenizer, texts: &[String], batch_size: usize) -> Result<Vec<Batch>> {
    texts
        .chunks(batch_size.max(1))
        .map(|batch| {
            let enc = tok
                .encode_batch(batch.iter().map(String::as_str).collect::<Vec<_>>(), true)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            let len = enc.first().map_or(0, |e| e.get_ids().len());
            let mut out = Batch {
                rows: enc.len(),
                len,
                ids: Vec::with_capacity(enc.len() * len),
                mask: Vec::with_capacity(enc.len() * len),
            };
            for e in &enc {
                out.ids.extend(e.get_ids().iter().map(|&x| x as i64));
                out.mask
                    .extend(e.get_attention_mask().iter().map(|&x| x as i64));
            }
            Ok(out)
        })
        .collect()
}

/// A bare session over `model_dir/model.onnx` with the embedder's settings.
pub struct RawSession {
    session: Session,
}

impl RawSession {
    /// The model directory's ONNX session alone, on `threads` threads, with ONNX Runtime from
    /// `ort_library`.
    pub fn load(model_dir: &Path, ort_library: &Path, threads: usize) -> Result<Self> {
        let env = init_onnx_runtime(ort_library)?;
        let mut builder = Session::builder(&env)
            .map_err(ort_err)?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(ort_err)?
            .with_intra_threads(threads.max(1))
            .map_err(ort_err)?;
        for (k, v) in SESSION_CONFIG {
            builder = builder.with_config_entry(k, v).map_err(ort_err)?;
        }
        let session = builder
            .commit_from_file(model_dir.join("model.onnx"))
            .map_err(ort_err)?;
        Ok(RawSession { session })
    }

    /// Runs every batch once; returns the time spent in `Session::run` only.
    pub fn run(&mut self, batches: &[Batch]) -> Result<Duration> {
        let mut spent = Duration::ZERO;
        for b in batches {
            let shape = [b.rows, b.len];
            let ids = Tensor::from_array((shape, b.ids.clone())).map_err(ort_err)?;
            let mask = Tensor::from_array((shape, b.mask.clone())).map_err(ort_err)?;
            let types = Tensor::from_array((shape, vec![0i64; b.rows * b.len])).map_err(ort_err)?;
            let start = Instant::now();
            let out = self
                .session
                .run(ort::inputs![
                    "input_ids" => ids,
                    "attention_mask" => mask,
                    "token_type_ids" => types,
                ])
                .map_err(ort_err)?;
            spent += start.elapsed();
            drop(out);
        }
        Ok(spent)
    }
}
