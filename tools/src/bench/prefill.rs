//! `docent bench prefill`: time to the first shown text of RAG answers with passage reuse
//! (`generation.passage_reuse`) against full prefill, through the service's own answer path
//! (retrieval, prompt, refusal judgement, generation) over a BEIR-layout set's questions.
//!
//! Per model, three passes over the same questions, each engine fresh, the answer cache off
//! (every answer generated), the prefix cache on as configured:
//! - **full prefill** (`off`);
//! - **reuse, cold**: the passage cache emptied before each question, so every passage's
//!   block is computed on the way (place 1 in the answer's own prefill, later places ahead);
//! - **reuse, warm**: the same questions again with every block in the cache (each
//!   question asked once first; from here blocks are written to disk too);
//! - **reuse, from disk**: every block read from disk (`generation.passage_disk_mib`: 8-bit
//!   keys and 4-bit values), memory emptied before each question;
//! - with `--llama-server BIN`, **llama-server** with its prompt cache (`cache_prompt`, one
//!   slot) on the same model file, sent the same prompts as token ids in the same order: its
//!   cache holds the previous prompt, so the shared system prompt is not read again.

use std::sync::Arc;

use anyhow::Context;
use serde::Serialize;

use crate::eval::{percentile, Dataset};
use docent::config::Config;
use docent::query::generate::reuse::{PassageReuse, ReuseStats};
use docent::server::startup;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Options {
    /// Questions asked: the first this many of the set that have relevant documents.
    pub limit: usize,
    /// Catalog names or paths of the generation models (the configured one when empty).
    pub models: Vec<String>,
    /// Answer tokens generated per question (the first shown text is what is timed).
    pub answer_tokens: usize,
    /// A llama-server binary (scripts/llama-server-build.sh) for the peer pass.
    pub llama_server: Option<std::path::PathBuf>,
}

/// One pass's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Pass {
    /// Which pass: `full prefill`, `reuse, cold`, `reuse, warm`, `reuse, from disk` or
    /// `llama-server`.
    pub name: String,
    /// Answers that showed text (the ones timed).
    pub answers: usize,
    /// Median time to the first shown text, in milliseconds.
    pub first_text_p50_ms: f64,
    /// 95th-percentile time to the first shown text, in milliseconds.
    pub first_text_p95_ms: f64,
    /// Mean time to the first shown text, in milliseconds.
    pub first_text_mean_ms: f64,
    /// Answers whose text equals the full prefill's answer to the same question (none for
    /// the peer, which is timed on its first token only).
    pub same_as_full: Option<usize>,
    /// The peer's prompt tokens read from its cache instead of prefilled (mean).
    pub cached_tokens_mean: Option<f64>,
    /// The passage cache's counters over this pass (hits, misses, blocks computed); none
    /// for full prefill and the peer.
    pub reuse: Option<ReuseStats>,
}

/// One model's passes and what its passage blocks cost.
#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    /// The generation model (catalog name or path) as given.
    pub model: String,
    /// Mean prompt tokens per question (over the full prefill pass).
    pub prompt_tokens_mean: f64,
    /// The passes, full prefill first (its figures are what the others are compared with).
    pub passes: Vec<Pass>,
    /// Bytes of one block per passage token (keys and values of every layer), in memory.
    pub bytes_per_token: Option<f64>,
    /// The blocks on disk after the disk pass (every question's).
    pub disk: Option<docent::query::generate::reuse::disk::DiskStats>,
    /// Mean milliseconds to compute a block ahead of an answer (the cold pass's later places).
    pub compute_ms_per_block: Option<f64>,
}

/// The result of `docent bench prefill`; [`print`] shows it as a table.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The data set's name.
    pub dataset: String,
    /// Questions asked per pass.
    pub questions: usize,
    /// Chunks in the temporary index built from the set's corpus.
    pub chunks: usize,
    /// Chunks retrieved per question (`retrieval.top_k`).
    pub top_k: usize,
    /// One report per model, in the order given.
    pub models: Vec<ModelReport>,
}

struct Timed {
    first_text_ms: Option<f64>,
    answer: String,
    prompt_tokens: usize,
}

async fn ask(
    engine: &Arc<docent::query::QueryEngine>,
    question: &str,
    tokens: usize,
) -> anyhow::Result<Timed> {
    let request = docent::query::QueryRequest {
        question: question.to_string(),
        generation: docent::query::GenerationOptions {
            max_tokens: Some(tokens),
            temperature: Some(0.0),
            ..Default::default()
        },
        ..Default::default()
    };
    let (r, first_text_ms, _) = crate::eval::timed_answer(engine, request).await?;
    Ok(Timed {
        first_text_ms,
        answer: r.answer,
        prompt_tokens: r.usage.prompt_tokens,
    })
}

fn pass(name: &str, timed: &[Timed], full: Option<&[Timed]>, reuse: Option<ReuseStats>) -> Pass {
    let mut ms: Vec<f64> = timed.iter().filter_map(|t| t.first_text_ms).collect();
    ms.sort_by(f64::total_cmp);
    Pass {
        name: name.to_string(),
        answers: ms.len(),
        first_text_p50_ms: percentile(&ms, 50.0),
        first_text_p95_ms: percentile(&ms, 95.0),
        first_text_mean_ms: ms.iter().sum::<f64>() / ms.len().max(1) as f64,
        same_as_full: Some(full.map_or(timed.len(), |f| {
            f.iter()
                .zip(timed)
                .filter(|(a, b)| a.answer == b.answer)
                .count()
        })),
        cached_tokens_mean: None,
        reuse,
    }
}

/// The peer: llama-server with its prompt cache, one slot, the same model file, sent the
/// prompts docent's answer path builds for `questions` (as token ids, so both read the same
/// tokens), in the same order; timed from the request to its one generated token (its first
/// shown text), over a keep-alive loopback connection.
async fn llama_server_pass(
    engine: &Arc<docent::query::QueryEngine>,
    binary: &std::path::Path,
    model: &std::path::Path,
    questions: &[String],
) -> anyhow::Result<Pass> {
    let generator = engine
        .generator()
        .context("bench prefill measures the mistral.rs generator")?;
    let mut prompts = Vec::new();
    for q in questions {
        let request = docent::query::QueryRequest {
            question: q.clone(),
            ..Default::default()
        };
        if let Some(prompt) = engine.prompt_for(request).await? {
            prompts.push(generator.prompt_ids(&prompt).await?);
        }
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (binary, model) = (binary.to_path_buf(), model.to_path_buf());
    tokio::task::spawn_blocking(move || -> anyhow::Result<Pass> {
        let server = super::generate::start_llama_server(
            &binary,
            &model,
            threads,
            1,
            (longest + 64).next_power_of_two(),
        )?;
        let mut conn = super::http::Connection::open(server.addr)?;
        let b = indicatif::ProgressBar::new(prompts.len() as u64);
        b.set_message("llama-server, prompt cache");
        let (mut ms, mut cached) = (Vec::new(), Vec::new());
        for ids in &prompts {
            let body = serde_json::to_vec(&serde_json::json!({
                "prompt": ids,
                "n_predict": 1,
                "temperature": 0.0,
                "cache_prompt": true,
            }))?;
            let t = std::time::Instant::now();
            let (status, reply) = conn.request("POST", "/completion", &body)?;
            let elapsed = t.elapsed().as_secs_f64() * 1e3;
            anyhow::ensure!(
                status == 200,
                "llama-server answered {status}: {}",
                String::from_utf8_lossy(&reply)
            );
            let v: serde_json::Value = serde_json::from_slice(&reply)?;
            ms.push(elapsed);
            // tokens read this time; the rest came from its cache
            let read = v["timings"]["prompt_n"]
                .as_f64()
                .unwrap_or(ids.len() as f64);
            cached.push(ids.len() as f64 - read);
            b.inc(1);
        }
        b.finish_and_clear();
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        Ok(Pass {
            name: "llama-server".into(),
            answers: ms.len(),
            first_text_p50_ms: percentile(&sorted, 50.0),
            first_text_p95_ms: percentile(&sorted, 95.0),
            first_text_mean_ms: ms.iter().sum::<f64>() / ms.len().max(1) as f64,
            same_as_full: None,
            cached_tokens_mean: Some(cached.iter().sum::<f64>() / cached.len().max(1) as f64),
            reuse: None,
        })
    })
    .await
    .context("the llama-server pass")?
}

/// Each of `questions` answered with `tokens` tokens and timed, the passage memory emptied
/// before each; with `fill_first`, asked once (one token) before the timed answer, so that
/// every block it needs is in memory.
async fn timed_pass(
    engine: &Arc<docent::query::QueryEngine>,
    questions: &[String],
    tokens: usize,
    what: String,
    fill_first: bool,
) -> anyhow::Result<Vec<Timed>> {
    let b = indicatif::ProgressBar::new(questions.len() as u64);
    b.set_style(
        indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} {eta} left")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b.set_message(what);
    let generator = engine
        .generator()
        .context("bench prefill measures the mistral.rs generator")?;
    let mut out = Vec::with_capacity(questions.len());
    for q in questions {
        generator.clear_passages();
        if fill_first {
            ask(engine, q, 1).await?;
        }
        out.push(ask(engine, q, tokens).await?);
        b.inc(1);
    }
    b.finish_and_clear();
    Ok(out)
}

/// The passes for one model over `questions`.
async fn one_model(
    config: &Config,
    index: &docent::query::retrieve::Index,
    questions: &[String],
    opts: &Options,
) -> anyhow::Result<ModelReport> {
    let engine_with = |reuse: PassageReuse| {
        let mut c = config.clone();
        c.generation.passage_reuse = reuse;
        c.generation.cache_size = 0;
        // memory only until the warm pass
        c.generation.passage_disk_mib = 0;
        c
    };
    let model = config.generation.model.display().to_string();
    let tokens = opts.answer_tokens;

    let full = {
        let engine =
            Arc::new(startup::query_engine(&engine_with(PassageReuse::Off), index.clone()).await?);
        timed_pass(
            &engine,
            questions,
            tokens,
            format!("{model}: full prefill"),
            false,
        )
        .await?
    };
    let engine =
        Arc::new(startup::query_engine(&engine_with(PassageReuse::Passages), index.clone()).await?);
    let generator = engine
        .generator()
        .context("bench prefill measures the mistral.rs generator")?;
    anyhow::ensure!(
        generator.reuse_stats().is_some(),
        "passage reuse is not possible with {model} (see the warning above)"
    );
    let cold = timed_pass(
        &engine,
        questions,
        tokens,
        format!("{model}: reuse, cold"),
        false,
    )
    .await?;
    let cold_stats = generator.reuse_stats();
    // from here blocks are kept on disk too: the warm pass's first asks write them
    generator
        .attach_passage_disk(&config.data_dir.join("passages"), 16 << 10)
        .await
        .context("the passage disk")?;
    let warm = timed_pass(
        &engine,
        questions,
        tokens,
        format!("{model}: reuse, warm"),
        true,
    )
    .await?;
    let after_warm = generator.reuse_stats();
    let warm_stats = after_warm.zip(cold_stats).map(|(w, c)| w.since(&c));

    // blocks read from disk, memory emptied before each question (the answer's own prefix
    // still comes from the prefix cache)
    generator.flush_passages().await;
    let before_disk = generator.reuse_stats();
    let from_disk = timed_pass(
        &engine,
        questions,
        tokens,
        format!("{model}: reuse, from disk"),
        false,
    )
    .await?;
    let disk_stats = generator
        .reuse_stats()
        .zip(before_disk)
        .map(|(d, b)| d.since(&b));

    let peer = match &opts.llama_server {
        Some(binary) => {
            let file = docent::query::generate::catalog::resolve(generator.model_path());
            Some(llama_server_pass(&engine, binary, &file, questions).await?)
        }
        None => None,
    };
    let prompt_tokens_mean =
        full.iter().map(|t| t.prompt_tokens as f64).sum::<f64>() / full.len().max(1) as f64;
    Ok(ModelReport {
        model,
        prompt_tokens_mean,
        passes: vec![
            pass("full prefill", &full, None, None),
            pass("reuse, cold", &cold, Some(&full), cold_stats),
            pass("reuse, warm", &warm, Some(&full), warm_stats),
            pass("reuse, from disk", &from_disk, Some(&full), disk_stats),
        ]
        .into_iter()
        .chain(peer)
        .collect(),
        bytes_per_token: after_warm.and_then(|s| s.bytes_per_token()),
        disk: disk_stats.and_then(|s| s.disk),
        compute_ms_per_block: cold_stats.and_then(|s| s.compute_ms_per_block()),
    })
}

/// Indexes `dataset`'s corpus in a temporary directory (removed afterwards), then runs
/// every pass for each model of `opts` over its first answerable questions.
pub async fn run(
    config: &Config,
    dataset: &std::path::Path,
    opts: &Options,
) -> anyhow::Result<Report> {
    let data = Arc::new(Dataset::load(dataset)?);
    let questions: Vec<String> = data
        .queries
        .iter()
        .filter(|q| data.qrels.contains_key(&q.id))
        .take(opts.limit)
        .map(|q| q.text.clone())
        .collect();
    anyhow::ensure!(
        !questions.is_empty(),
        "no answerable questions in {}",
        dataset.display()
    );
    let (config, index, cleanup, _) = {
        let config = config.clone();
        let data = data.clone();
        tokio::task::spawn_blocking(move || {
            crate::eval::index_corpus(&config, &data.corpus, "prefill")
        })
        .await
        .context("indexing the corpus")??
    };
    // the index goes before its folder, on an error too
    let measured = async {
        let chunks = index.store.len().await?;
        let models = if opts.models.is_empty() {
            vec![config.generation.model.display().to_string()]
        } else {
            opts.models.clone()
        };
        let mut reports = Vec::new();
        for m in models {
            let mut c = config.clone();
            c.generation.model = m.into();
            reports.push(one_model(&c, &index, &questions, opts).await?);
        }
        anyhow::Ok((chunks, reports))
    }
    .await;
    drop(index);
    drop(cleanup);
    let (chunks, reports) = measured?;
    Ok(Report {
        dataset: data.name.clone(),
        questions: questions.len(),
        chunks,
        top_k: config.retrieval.top_k,
        models: reports,
    })
}

/// The table: one row per model and pass, the full prefill beside each.
pub fn print(report: &Report) {
    println!(
        "bench prefill: {} ({} questions, {} chunks, top_k {}), time to the first shown text",
        report.dataset, report.questions, report.chunks, report.top_k
    );
    println!(
        "{:<28} {:<16} {:>9} {:>9} {:>9} {:>9} {:>11} {:>7} {:>6} {:>9}",
        "model",
        "pass",
        "p50 ms",
        "p95 ms",
        "mean ms",
        "vs full",
        "same answer",
        "hits",
        "misses",
        "computed"
    );
    for m in &report.models {
        let name = m.model.rsplit('/').next().unwrap_or(&m.model);
        let full = m.passes.first().map_or(f64::NAN, |p| p.first_text_p50_ms);
        for p in &m.passes {
            let (hits, misses, computed) =
                p.reuse.map_or(("-".into(), "-".into(), "-".into()), |s| {
                    (
                        s.hits.to_string(),
                        s.misses.to_string(),
                        s.computed.to_string(),
                    )
                });
            let same = p
                .same_as_full
                .map_or_else(|| "-".to_string(), |n| format!("{n}/{}", p.answers));
            println!(
                "{:<28} {:<16} {:>9.0} {:>9.0} {:>9.0} {:>8.2}x {:>11} {:>7} {:>6} {:>9}",
                name,
                p.name,
                p.first_text_p50_ms,
                p.first_text_p95_ms,
                p.first_text_mean_ms,
                full / p.first_text_p50_ms,
                same,
                hits,
                misses,
                computed
            );
        }
        println!(
            "{:<28} prompt {:.0} tokens on average; a block holds {} bytes per token; a block computed ahead took {} ms on average",
            name,
            m.prompt_tokens_mean,
            m.bytes_per_token.map_or("-".into(), |b| format!("{b:.0}")),
            m.compute_ms_per_block.map_or("-".into(), |b| format!("{b:.0}"))
        );
        if let Some(d) = m.disk {
            println!(
                "{:<28} on disk: {} blocks, {} bytes ({} damaged)",
                name, d.files, d.bytes, d.corrupt
            );
        }
        for p in &m.passes {
            if let Some(c) = p.cached_tokens_mean {
                println!(
                    "{:<28} {} read {c:.0} prompt tokens from its cache on average",
                    name, p.name
                );
            }
        }
    }
}
