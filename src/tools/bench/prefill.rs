//! `docent bench prefill`: time to the first shown text of RAG answers with passage reuse
//! (`generation.passage_reuse`) against full prefill, through the service's own answer path
//! (retrieval, prompt, refusal judgement, generation) over a BEIR-layout set's questions.
//!
//! Per model, three passes over the same questions, each engine fresh, the answer cache off
//! (every answer generated), the prefix cache on as configured:
//! - **full prefill** (`off`);
//! - **reuse, cold**: the passage cache emptied before each question, so every passage's
//!   block is computed on the way (place 1 in the answer's own prefill, later places ahead);
//! - **reuse, warm**: the same questions again with every block in the cache.

use std::sync::Arc;

use anyhow::Context;
use serde::Serialize;

use crate::config::Config;
use crate::query::generate::reuse::{PassageReuse, ReuseStats};
use crate::server::startup;
use crate::tools::eval::{percentile, Dataset};

#[derive(Debug, Clone)]
pub struct Options {
    pub limit: usize,
    /// Catalog names or paths of the generation models (the configured one when empty).
    pub models: Vec<String>,
    /// Answer tokens generated per question (the first shown text is what is timed).
    pub answer_tokens: usize,
}

/// One pass's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Pass {
    pub name: String,
    pub answers: usize,
    pub first_text_p50_ms: f64,
    pub first_text_p95_ms: f64,
    pub first_text_mean_ms: f64,
    /// Answers whose text equals the full prefill's answer to the same question.
    pub same_as_full: usize,
    pub reuse: Option<ReuseStats>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    pub model: String,
    pub prompt_tokens_mean: f64,
    pub passes: Vec<Pass>,
    /// Bytes of one block per passage token (keys and values of every layer).
    pub bytes_per_token: Option<f64>,
    /// Mean milliseconds to compute a block ahead of an answer (the cold pass's later places).
    pub compute_ms_per_block: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub dataset: String,
    pub questions: usize,
    pub chunks: usize,
    pub top_k: usize,
    pub models: Vec<ModelReport>,
}

struct Timed {
    first_text_ms: Option<f64>,
    answer: String,
    prompt_tokens: usize,
}

async fn ask(
    engine: &Arc<crate::query::QueryEngine>,
    question: &str,
    tokens: usize,
) -> anyhow::Result<Timed> {
    let request = crate::query::QueryRequest {
        question: question.to_string(),
        generation: crate::query::GenerationOptions {
            max_tokens: Some(tokens),
            temperature: Some(0.0),
            ..Default::default()
        },
        ..Default::default()
    };
    let (r, first_text_ms, _) = crate::tools::eval::timed_answer(engine, request).await?;
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
        same_as_full: full.map_or(timed.len(), |f| {
            f.iter()
                .zip(timed)
                .filter(|(a, b)| a.answer == b.answer)
                .count()
        }),
        reuse,
    }
}

/// The three passes for one model over `questions`.
async fn one_model(
    config: &Config,
    index: &crate::query::retrieve::Index,
    questions: &[String],
    opts: &Options,
) -> anyhow::Result<ModelReport> {
    let engine_with = |reuse: PassageReuse| {
        let mut c = config.clone();
        c.generation.passage_reuse = reuse;
        c.generation.cache_size = 0;
        c
    };
    let bar = |n: usize, what: String| {
        let b = indicatif::ProgressBar::new(n as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} {eta} left")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(what);
        b
    };
    let model = config.generation.model.display().to_string();

    let full = {
        let engine =
            Arc::new(startup::query_engine(&engine_with(PassageReuse::Off), index.clone()).await?);
        let b = bar(questions.len(), format!("{model}: full prefill"));
        let mut out = Vec::new();
        for q in questions {
            out.push(ask(&engine, q, opts.answer_tokens).await?);
            b.inc(1);
        }
        b.finish_and_clear();
        out
    };
    let engine =
        Arc::new(startup::query_engine(&engine_with(PassageReuse::Passages), index.clone()).await?);
    let generator = engine.generator();
    anyhow::ensure!(
        generator.reuse_stats().is_some(),
        "passage reuse is not possible with {model} (see the warning above)"
    );
    let b = bar(questions.len(), format!("{model}: reuse, cold"));
    let mut cold = Vec::new();
    for q in questions {
        generator.clear_passages();
        cold.push(ask(&engine, q, opts.answer_tokens).await?);
        b.inc(1);
    }
    b.finish_and_clear();
    let cold_stats = generator.reuse_stats();
    let b = bar(questions.len(), format!("{model}: reuse, warm"));
    let mut warm = Vec::new();
    for q in questions {
        // the first ask fills the cache with this question's blocks; the second is timed
        generator.clear_passages();
        ask(&engine, q, 1).await?;
        warm.push(ask(&engine, q, opts.answer_tokens).await?);
        b.inc(1);
    }
    b.finish_and_clear();
    let stats = generator.reuse_stats();
    let warm_stats = match (stats, cold_stats) {
        (Some(w), Some(c)) => Some(ReuseStats {
            hits: w.hits - c.hits,
            misses: w.misses - c.misses,
            computed: w.computed - c.computed,
            compute_us: w.compute_us - c.compute_us,
            ..w
        }),
        (w, _) => w,
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
        ],
        bytes_per_token: stats.and_then(|s| s.bytes_per_token()),
        compute_ms_per_block: cold_stats.and_then(|s| s.compute_ms_per_block()),
    })
}

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
            crate::tools::eval::index_corpus(&config, &data.corpus, "prefill")
        })
        .await
        .context("indexing the corpus")??
    };
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
    // the index before its folder
    drop(index);
    drop(cleanup);
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
        "{:<28} {:<14} {:>9} {:>9} {:>9} {:>9} {:>11} {:>7} {:>6} {:>9}",
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
            println!(
                "{:<28} {:<14} {:>9.0} {:>9.0} {:>9.0} {:>8.2}x {:>5}/{:<5} {:>7} {:>6} {:>9}",
                name,
                p.name,
                p.first_text_p50_ms,
                p.first_text_p95_ms,
                p.first_text_mean_ms,
                full / p.first_text_p50_ms,
                p.same_as_full,
                p.answers,
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
    }
}
