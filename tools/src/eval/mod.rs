//! `docent eval --dataset DIR`: retrieval quality on a BEIR-layout set (`corpus.jsonl`,
//! `queries.jsonl`, `qrels/test.tsv`, optional `answers.jsonl`). The corpus is ingested
//! into a temporary index through the normal pipeline; each query is embedded once and
//! searched in every mode.
//!
//! Metrics per mode (over queries that have relevant documents): Recall@1/5/10 (BEIR:
//! share of a query's relevant documents in the top k, averaged), MRR@10, nDCG@10 (binary
//! gains), and latency p50/p99 = the query's embedding time + that mode's search time.
//!
//! Here: the retrieval evaluation and its report. `dataset` reads the BEIR layout;
//! `answering` scores answers (`--answers N`); [`safety`] and [`injection_e2e`] are the
//! safety evaluations; [`baseline`] the peers (whole-document BM25, other fusions).

mod answering;
pub mod baseline;
mod dataset;
pub mod injection_e2e;
pub mod safety;

pub use answering::*;
pub use dataset::*;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use docent_ingest::load::{Document, Format};
use docent_ingest::pipeline::{Input, Silent};
use docent_ingest::store::{block_on, SearchFilter, SearchMode};
use serde::{Deserialize, Serialize};

use docent::config::Config;
use docent::server::startup;

/// Documents ranked per query (chunks beyond this are not looked at).
pub const DEPTH: usize = 10;

/// Figures of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// Recall@1: the share of a query's relevant documents ranked first, averaged.
    #[serde(rename = "recall@1")]
    pub recall_1: f64,
    /// Recall@5: the share of a query's relevant documents in the top 5, averaged.
    #[serde(rename = "recall@5")]
    pub recall_5: f64,
    /// Recall@10: the share of a query's relevant documents in the top 10, averaged.
    #[serde(rename = "recall@10")]
    pub recall_10: f64,
    /// MRR@10: the mean of 1 / rank of the first relevant document in the top 10 (0 when
    /// none is there).
    #[serde(rename = "mrr@10")]
    pub mrr_10: f64,
    /// nDCG@10 with binary gains, averaged.
    #[serde(rename = "ndcg@10")]
    pub ndcg_10: f64,
    /// Median latency in ms: the query's embedding time + this mode's search time (for
    /// `bm25-doc`, its search time alone).
    pub p50_ms: f64,
    /// 99th-percentile latency in ms, measured the same way.
    pub p99_ms: f64,
    /// Queries scored (those with relevant documents).
    pub queries: usize,
    /// Share of questions with gold answers whose answer string is in the context the
    /// prompt would get: the top `retrieval.top_k` chunks, with `retrieval.neighbors`
    /// joined (no LLM involved).
    #[serde(rename = "answer_in_context")]
    pub answer_in_context: Option<f64>,
    /// Mean characters of that context.
    pub context_chars: Option<f64>,
    /// Mean number of distinct documents among the top 10 chunks (diversity).
    pub distinct_docs_10: f64,
}

/// Whether the best retrieval score tells answerable questions from unanswerable ones
/// (SQuAD v2.0): the signal is the best dense cosine similarity among the top chunks; a
/// question is refused when it is below the threshold.
#[derive(Debug, Clone, Serialize)]
pub struct RefusalReport {
    /// Questions with relevant documents.
    pub answerable: usize,
    /// Questions without (marked unanswerable in the set).
    pub unanswerable: usize,
    /// `retrieval.min_score` of the configuration: the rates below are at it.
    pub min_score: f32,
    /// Share of the unanswerable questions whose signal is below `min_score` (refused).
    pub correct_refusal: f64,
    /// Share of the answerable questions whose signal is below `min_score` (refused).
    pub false_refusal: f64,
    /// The threshold that refuses the most unanswerable questions while refusing at most
    /// 10 % of the answerable ones, and its rates.
    pub best_threshold: f32,
    /// Share of the unanswerable questions refused at `best_threshold`.
    pub best_correct_refusal: f64,
    /// Share of the answerable questions refused at `best_threshold`.
    pub best_false_refusal: f64,
    /// The same at most 1 % false refusals (a cautious default for `retrieval.min_score`).
    pub strict_threshold: f32,
    /// Share of the unanswerable questions refused at `strict_threshold`.
    pub strict_correct_refusal: f64,
    /// Share of the answerable questions refused at `strict_threshold`.
    pub strict_false_refusal: f64,
}

impl RefusalReport {
    /// The two thresholds of the sweep and the rates they give, in words.
    fn sweep(&self) -> String {
        format!(
            "at <= 10 % false refusals, threshold {:.3} refuses {:.1} % ({:.1} % false); at <= 1 %, {:.3} refuses {:.1} % ({:.1} % false)",
            self.best_threshold,
            100.0 * self.best_correct_refusal,
            100.0 * self.best_false_refusal,
            self.strict_threshold,
            100.0 * self.strict_correct_refusal,
            100.0 * self.strict_false_refusal
        )
    }
}

fn refusal(scores: &[(f32, bool)], min_score: f32) -> Option<RefusalReport> {
    let answerable: Vec<f32> = scores.iter().filter(|s| s.1).map(|s| s.0).collect();
    let unanswerable: Vec<f32> = scores.iter().filter(|s| !s.1).map(|s| s.0).collect();
    if answerable.is_empty() || unanswerable.is_empty() {
        return None;
    }
    let below = |v: &[f32], t: f32| v.iter().filter(|&&s| s < t).count() as f64 / v.len() as f64;
    let mut candidates: Vec<f32> = scores.iter().map(|s| s.0).collect();
    candidates.sort_by(f32::total_cmp);
    candidates.dedup();
    let threshold = |max_false: f64| {
        candidates
            .iter()
            .copied()
            .filter(|&t| below(&answerable, t) <= max_false)
            .max_by(|a, b| below(&unanswerable, *a).total_cmp(&below(&unanswerable, *b)))
            .unwrap_or(f32::MIN)
    };
    let (best, strict) = (threshold(0.10), threshold(0.01));
    Some(RefusalReport {
        answerable: answerable.len(),
        unanswerable: unanswerable.len(),
        min_score,
        correct_refusal: below(&unanswerable, min_score),
        false_refusal: below(&answerable, min_score),
        best_threshold: best,
        best_correct_refusal: below(&unanswerable, best),
        best_false_refusal: below(&answerable, best),
        strict_threshold: strict,
        strict_correct_refusal: below(&unanswerable, strict),
        strict_false_refusal: below(&answerable, strict),
    })
}

/// What `docent eval` measured on one set: the index it built, the retrieval figures per
/// mode, the refusal sweeps and, with `--answers N`, the answers' figures. Its `Display` is
/// the printed report; `--json` prints it serialised.
#[derive(Debug, Serialize)]
pub struct EvalReport {
    /// The set's name (its folder's name).
    pub dataset: String,
    /// The embedding model's directory (`embedding.model_dir`).
    pub model_dir: PathBuf,
    /// Documents in the corpus.
    pub documents: usize,
    /// Chunks in the index after the ingest.
    pub chunks: usize,
    /// Wall time of the ingest, in seconds.
    pub ingest_seconds: f64,
    /// Retrieval settings the figures hold for: chunk tokens/overlap, top_k (context
    /// metrics), neighbours, MMR λ, fusion method and candidates.
    pub settings: String,
    /// Figures per mode, by name: each mode asked for, `bm25-doc` (whole-document BM25)
    /// and, with hybrid, the other fusions of its candidates (`hybrid-rrf`,
    /// `hybrid-confident`, `hybrid-confident/2`). Flattened into the JSON object.
    #[serde(flatten)]
    pub modes: BTreeMap<String, ModeReport>,
    /// Present when the set has unanswerable questions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<RefusalReport>,
    /// The same with the question's terms in the signal: best cosine + `term_weight` × the
    /// share of the question's BM25 terms in the best-covered of the top_k chunks
    /// ([`docent::query::retrieve::relevance`]); `retrieval.term_weight`, or 0.5 when it
    /// is 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal_with_terms: Option<(f32, RefusalReport)>,
    /// Full question answering with the LLM (`--answers N`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answers: Option<AnswerReport>,
}

/// The index an evaluation built, kept for the answer run.
pub struct Evaluated {
    /// The retrieval report (its `answers` still `None`).
    pub report: EvalReport,
    /// The evaluation's index, still open.
    pub index: docent::query::retrieve::Index,
    /// The configuration, pointed at that index.
    pub config: Config,
    _tmp: RemoveOnDrop,
}

#[derive(Default)]
struct Acc {
    r1: f64,
    r5: f64,
    r10: f64,
    mrr: f64,
    ndcg: f64,
    latencies: Vec<f64>,
    in_context: usize,
    with_gold: usize,
    context_chars: usize,
    distinct: usize,
}

impl Acc {
    fn add(&mut self, ranked: &[String], relevant: &HashSet<String>, ms: f64) {
        let n = relevant.len().max(1) as f64;
        let found = |k: usize| {
            ranked
                .iter()
                .take(k)
                .filter(|d| relevant.contains(*d))
                .count() as f64
        };
        self.r1 += found(1) / n;
        self.r5 += found(5) / n;
        self.r10 += found(10) / n;
        if let Some(rank) = ranked.iter().take(10).position(|d| relevant.contains(d)) {
            self.mrr += 1.0 / (rank + 1) as f64;
        }
        let dcg: f64 = ranked
            .iter()
            .take(10)
            .enumerate()
            .filter(|(_, d)| relevant.contains(*d))
            .map(|(i, _)| 1.0 / ((i + 2) as f64).log2())
            .sum();
        let ideal: f64 = (0..relevant.len().min(10))
            .map(|i| 1.0 / ((i + 2) as f64).log2())
            .sum();
        self.ndcg += if ideal > 0.0 { dcg / ideal } else { 0.0 };
        self.latencies.push(ms);
    }

    fn report(mut self) -> ModeReport {
        let q = self.latencies.len().max(1) as f64;
        self.latencies.sort_by(f64::total_cmp);
        let pct = |p: f64| percentile(&self.latencies, p * 100.0);
        ModeReport {
            recall_1: self.r1 / q,
            recall_5: self.r5 / q,
            recall_10: self.r10 / q,
            mrr_10: self.mrr / q,
            ndcg_10: self.ndcg / q,
            p50_ms: pct(0.50),
            p99_ms: pct(0.99),
            queries: self.latencies.len(),
            answer_in_context: (self.with_gold > 0)
                .then(|| self.in_context as f64 / self.with_gold as f64),
            context_chars: (self.with_gold > 0)
                .then(|| self.context_chars as f64 / self.with_gold as f64),
            distinct_docs_10: self.distinct as f64 / q,
        }
    }
}

/// Nearest-rank percentile `p` (0–100) of `sorted` (ascending); 0 when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[i - 1]
}

/// `corpus` ingested through the normal pipeline into an index of the evaluation's own (a
/// temporary folder, or collections of its own on a server), removed when the guard drops;
/// the config points at it; also the ingest time in seconds.
pub(crate) fn index_corpus(
    config: &Config,
    corpus: &[CorpusLine],
    tag: &str,
) -> anyhow::Result<(Config, docent::query::retrieve::Index, RemoveOnDrop, f64)> {
    let tmp = std::env::temp_dir().join(format!("docent-{tag}-{}", std::process::id()));
    let mut config = config.clone();
    let cleanup = match config.store.kind {
        docent::config::StoreKind::Edge => RemoveOnDrop::Dir(tmp.clone()),
        // on a server: collections of the evaluation's own, dropped afterwards
        docent::config::StoreKind::Qdrant => {
            config.store.collection =
                format!("{}_{tag}_{}", config.store.collection, std::process::id());
            match config.store.location(&tmp) {
                docent_ingest::store::Location::Qdrant(options) => {
                    RemoveOnDrop::Server(options, tmp.clone())
                }
                docent_ingest::store::Location::Edge { .. } => RemoveOnDrop::Dir(tmp.clone()),
            }
        }
    };
    config.data_dir = tmp;
    let index = startup::open_index_blocking(&config)?;
    let ingestor = startup::ingestor(&config, &index)?;
    let inputs: Vec<Input> = corpus
        .iter()
        .map(|c| {
            let format = if docent_ingest::split::has_headings(&c.text) {
                Format::Markdown
            } else {
                Format::Text
            };
            let mut doc = Document::from_text(c.id.clone(), c.text.clone(), format);
            if !c.title.is_empty() {
                doc.title = c.title.clone();
            }
            Input::Document(doc)
        })
        .collect();
    let started = Instant::now();
    for r in ingestor.ingest(inputs, &Silent) {
        r.context("ingesting the corpus")?;
    }
    Ok((config, index, cleanup, started.elapsed().as_secs_f64()))
}

/// Ingests the corpus into a temporary index and evaluates `modes` on up to `limit` queries
/// (those with relevant documents, in file order).
pub fn run(
    config: &Config,
    data: &Dataset,
    modes: &[SearchMode],
    limit: Option<usize>,
    dump: Option<&Path>,
) -> anyhow::Result<Evaluated> {
    let (config, index, cleanup, ingest_seconds) = index_corpus(config, &data.corpus, "eval")?;
    let chunks = block_on(index.store.len())?;

    // questions with relevant documents, and those marked unanswerable
    let queries: Vec<&QueryLine> = data
        .queries
        .iter()
        .filter(|q| data.qrels.contains_key(&q.id) || !q.metadata.answerable)
        .take(limit.unwrap_or(usize::MAX))
        .collect();
    let mut acc: Vec<Acc> = modes.iter().map(|_| Acc::default()).collect();
    // beside the modes: whole-document BM25 (the peer of sparse search), and other fusions
    // of the same two candidate lists as hybrid's
    let bm25 = baseline::Bm25::new(&data.corpus);
    let mut bm25_acc = Acc::default();
    type FuseFn = fn(&[(u64, f32)], &[(u64, f32)]) -> Vec<(u64, f32)>;
    let variants: [(&str, FuseFn); 3] = [
        ("hybrid-rrf", baseline::fusions::rrf),
        ("hybrid-confident", baseline::fusions::confident_dbsf),
        ("hybrid-confident/2", baseline::fusions::confident_dbsf_half),
    ];
    let mut variant_acc: Vec<Acc> = variants.iter().map(|_| Acc::default()).collect();
    let none = SearchFilter::default();
    let mut best_scores: Vec<(f32, bool)> = Vec::new();
    let term_weight = match config.retrieval.term_weight {
        w if w > 0.0 => w,
        _ => PROBE_TERM_WEIGHT,
    };
    let mut with_terms: Vec<(f32, bool)> = Vec::new();
    let mut dump = match dump {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => None,
    };
    for q in queries {
        let t = Instant::now();
        let embedded = block_on(index.embed_query(&q.text))?;
        let embed_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Some(out) = dump.as_mut() {
            let record = dump_record(&index, &embedded, q, data)?;
            serde_json::to_writer(&mut *out, &record)?;
            std::io::Write::write_all(out, b"\n")?;
        }
        let (best, signal) = refusal_signals(&index, &config, &embedded, term_weight)?;
        let answerable = data.qrels.contains_key(&q.id);
        best_scores.push((best, answerable));
        with_terms.push((signal, answerable));
        let Some(relevant) = data.qrels.get(&q.id) else {
            continue;
        };
        let golds = data.answers.get(&q.id);
        let t = Instant::now();
        let ids = bm25.search(&q.text, DEPTH);
        bm25_acc.add(&ids, relevant, t.elapsed().as_secs_f64() * 1e3);
        for (mode, acc) in modes.iter().zip(acc.iter_mut()) {
            let t = Instant::now();
            // more chunks than documents: a long document may fill several places
            let ranked = block_on(index.rank(&embedded, 2 * DEPTH, *mode, &none))?;
            let ms = embed_ms + t.elapsed().as_secs_f64() * 1e3;
            score_hits(acc, ranked.hits, relevant, golds, &index, &config, ms)?;
            if *mode != SearchMode::Hybrid {
                continue;
            }
            for ((_, fuse), acc) in variants.iter().zip(variant_acc.iter_mut()) {
                let mut fused = fuse(&ranked.dense, &ranked.sparse);
                fused.truncate(2 * DEPTH);
                let hits = block_on(index.store.hits(&fused))?;
                score_hits(acc, hits, relevant, golds, &index, &config, ms)?;
            }
        }
    }
    let mut mode_reports: BTreeMap<String, ModeReport> = modes
        .iter()
        .zip(acc)
        .map(|(m, a)| (m.name().to_string(), a.report()))
        .collect();
    mode_reports.insert("bm25-doc".into(), bm25_acc.report());
    if modes.contains(&SearchMode::Hybrid) {
        for ((name, _), a) in variants.iter().zip(variant_acc) {
            mode_reports.insert(name.to_string(), a.report());
        }
    }
    let report = EvalReport {
        dataset: data.name.clone(),
        model_dir: config.embedding.model_dir.clone(),
        documents: data.corpus.len(),
        chunks,
        ingest_seconds,
        settings: settings_line(&config),
        modes: mode_reports,
        refusal: refusal(&best_scores, config.retrieval.min_score),
        refusal_with_terms: refusal(&with_terms, config.retrieval.min_score)
            .map(|r| (term_weight, r)),
        answers: None,
    };
    Ok(Evaluated {
        report,
        index,
        config,
        _tmp: cleanup,
    })
}

/// The refusal signals of a question as the service computes them: the best dense cosine
/// over the whole index, and that plus `term_weight` × the question's term share in the
/// chunks the prompt gets.
fn refusal_signals(
    index: &docent::query::retrieve::Index,
    config: &Config,
    embedded: &docent_ingest::embed::Embedding,
    term_weight: f32,
) -> anyhow::Result<(f32, f32)> {
    let none = SearchFilter::default();
    let best = block_on(index.store.search_scores(
        embedded,
        SearchMode::Dense,
        &index.fusion.without_mmr(),
        1,
        &none,
    ))?
    .first()
    .map_or(f32::MIN, |h| h.1);
    let context = block_on(index.rank(
        embedded,
        config.retrieval.top_k,
        config.retrieval.mode,
        &none,
    ))?;
    let coverage = index.term_coverage(
        &embedded.sparse.indices,
        context.hits.iter().map(|h| h.payload.text.as_str()),
    );
    let signal =
        docent::query::retrieve::relevance(Some(best), coverage, term_weight).unwrap_or(f32::MIN);
    Ok((best, signal))
}

/// The settings line of the report: chunking, top_k, neighbours, MMR and fusion.
fn settings_line(config: &Config) -> String {
    format!(
        "chunks {}/{} tokens, top_k {}, neighbors {}, mmr {}, fusion {:?} x{}",
        config.chunking.max_tokens,
        config.chunking.overlap,
        config.retrieval.top_k,
        config.retrieval.neighbors,
        config
            .retrieval
            .fusion
            .mmr_lambda
            .map_or("off".to_string(), |l| l.to_string()),
        config.retrieval.fusion.method,
        config.retrieval.fusion.candidates
    )
}

/// The weight of the question's terms in the refusal signal that `docent eval` reports
/// beside the cosine alone, when `retrieval.term_weight` is 0: chosen on the visible
/// natural-question sets together (README, "Retrieval quality").
pub const PROBE_TERM_WEIGHT: f32 = 0.5;

/// One question's candidate lists for offline analysis (`docent eval --dump`): each
/// dense and BM25 candidate (the hybrid depth) as
/// `[document, chunk index, score, gold answer in the chunk, share of the question's BM25
/// terms in the chunk, characters]`, the document being the relevant source where a
/// chunk has several.
fn dump_record(
    index: &docent::query::retrieve::Index,
    embedded: &docent_ingest::embed::Embedding,
    q: &QueryLine,
    data: &Dataset,
) -> anyhow::Result<serde_json::Value> {
    let none = SearchFilter::default();
    let ranked = block_on(index.rank(embedded, 2 * DEPTH, SearchMode::Hybrid, &none))?;
    let relevant = data.qrels.get(&q.id);
    let golds = data.answers.get(&q.id);
    let terms: HashSet<u32> = embedded.sparse.indices.iter().copied().collect();
    let rows = |list: &[(u64, f32)]| -> anyhow::Result<Vec<serde_json::Value>> {
        let hits = block_on(index.store.hits(list))?;
        Ok(hits
            .iter()
            .map(|h| {
                let doc = h
                    .payload
                    .sources
                    .iter()
                    .find(|s| relevant.is_some_and(|r| r.contains(*s)))
                    .unwrap_or(&h.payload.source);
                serde_json::json!([
                    doc,
                    h.payload.chunk_index,
                    h.score,
                    golds.is_some_and(|g| contains_answer(&h.payload.text, g)),
                    index.term_share(&terms, &h.payload.text),
                    h.payload.text.chars().count()
                ])
            })
            .collect())
    };
    Ok(serde_json::json!({
        "id": q.id,
        "answerable": relevant.is_some(),
        "relevant": relevant,
        "terms": terms.len(),
        "dense": rows(&ranked.dense)?,
        "sparse": rows(&ranked.sparse)?,
    }))
}

/// One ranking's figures for one question: distinct documents in the top 10, the gold
/// answer in the top-k context (neighbours joined), and the document ranking.
fn score_hits(
    acc: &mut Acc,
    hits: Vec<docent_ingest::store::Hit>,
    relevant: &HashSet<String>,
    golds: Option<&Vec<String>>,
    index: &docent::query::retrieve::Index,
    config: &Config,
    ms: f64,
) -> anyhow::Result<()> {
    let top10: HashSet<&str> = hits
        .iter()
        .take(DEPTH)
        .map(|h| h.payload.document_id.as_str())
        .collect();
    acc.distinct += top10.len();
    if let Some(golds) = golds {
        let mut context: Vec<_> = hits.iter().take(config.retrieval.top_k).cloned().collect();
        block_on(index.expand(&mut context, config.retrieval.neighbors))?;
        let text: Vec<&str> = context.iter().map(|h| h.payload.text.as_str()).collect();
        let text = text.join("\n");
        acc.with_gold += 1;
        acc.context_chars += text.chars().count();
        acc.in_context += usize::from(contains_answer(&text, golds));
    }
    let mut ranked: Vec<String> = Vec::with_capacity(DEPTH);
    for h in hits {
        // identical paragraphs are stored once: any of their ids counts
        let id = h
            .payload
            .sources
            .iter()
            .find(|s| relevant.contains(*s))
            .unwrap_or(&h.payload.source)
            .clone();
        if !ranked.contains(&id) {
            ranked.push(id);
        }
    }
    ranked.truncate(DEPTH);
    acc.add(&ranked, relevant, ms);
    Ok(())
}

impl std::fmt::Display for EvalReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.modes.values().next().map_or(0, |m| m.queries);
        writeln!(
            f,
            "{}: {} documents → {} chunks (ingested in {:.1} s), {} queries, model {}",
            self.dataset,
            self.documents,
            self.chunks,
            self.ingest_seconds,
            q,
            self.model_dir.display()
        )?;
        writeln!(f, "{}", self.settings)?;
        writeln!(
            f,
            "{:<18} {:>6} {:>6} {:>6} {:>7} {:>7} {:>8} {:>8} {:>7} {:>9} {:>7}",
            "mode",
            "R@1",
            "R@5",
            "R@10",
            "MRR@10",
            "nDCG@10",
            "p50 ms",
            "p99 ms",
            "ans@ctx",
            "ctx chars",
            "docs@10"
        )?;
        for (name, m) in &self.modes {
            let opt = |v: Option<f64>, prec: usize| v.map_or("-".into(), |v| format!("{v:.prec$}"));
            writeln!(
                f,
                "{:<18} {:>6.3} {:>6.3} {:>6.3} {:>7.3} {:>7.3} {:>8.2} {:>8.2} {:>7} {:>9} {:>7.2}",
                name,
                m.recall_1,
                m.recall_5,
                m.recall_10,
                m.mrr_10,
                m.ndcg_10,
                m.p50_ms,
                m.p99_ms,
                opt(m.answer_in_context, 3),
                opt(m.context_chars, 0),
                m.distinct_docs_10
            )?;
        }
        if let Some(r) = &self.refusal {
            writeln!(
                f,
                "refusal ({} answerable, {} unanswerable; signal: best dense cosine): min_score {:.3} refuses {:.1} % of unanswerable and {:.1} % of answerable; best threshold with <= 10 % false refusals: {:.3} ({:.1} % / {:.1} %)",
                r.answerable,
                r.unanswerable,
                r.min_score,
                100.0 * r.correct_refusal,
                100.0 * r.false_refusal,
                r.best_threshold,
                100.0 * r.best_correct_refusal,
                100.0 * r.best_false_refusal
            )?;
            writeln!(
                f,
                "refusal with <= 1 % false refusals: threshold {:.3} ({:.1} % / {:.1} %)",
                r.strict_threshold,
                100.0 * r.strict_correct_refusal,
                100.0 * r.strict_false_refusal
            )?;
        }
        if let Some((w, r)) = &self.refusal_with_terms {
            writeln!(
                f,
                "refusal with the question's terms (signal: cosine + {w} x term share in the top_k chunks): {}",
                r.sweep()
            )?;
        }
        if let Some(a) = &self.answers {
            write!(f, "{a}")?;
        }
        Ok(())
    }
}

/// What an evaluation's temporary index is, removed when the evaluation is dropped.
pub(crate) enum RemoveOnDrop {
    /// An embedded index's directory.
    Dir(std::path::PathBuf),
    /// Collections on a Qdrant server (chunks and catalog), and the local directory beside
    /// them (passage blocks on disk).
    Server(
        docent_ingest::store::qdrant::QdrantOptions,
        std::path::PathBuf,
    ),
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        match self {
            RemoveOnDrop::Dir(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            RemoveOnDrop::Server(options, dir) => {
                let _ = std::fs::remove_dir_all(dir);
                let options = options.clone();
                // a thread of its own: this may be dropped inside a runtime
                let dropped = std::thread::spawn(move || {
                    docent_ingest::store::block_on(async {
                        docent_ingest::store::qdrant::QdrantIndex::connect(&options, 1)
                            .await?
                            .drop_collections()
                            .await
                    })
                })
                .join();
                if !matches!(dropped, Ok(Ok(()))) {
                    tracing::warn!("could not drop the evaluation's collections on the server");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn ranked(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn metrics_match_hand_computed_values() {
        let mut a = Acc::default();
        // relevant at rank 2 of 3
        a.add(&ranked(&["x", "a", "y"]), &set(&["a"]), 2.0);
        // relevant missing
        a.add(&ranked(&["x", "y"]), &set(&["a"]), 4.0);
        let r = a.report();
        assert_eq!(r.recall_1, 0.0);
        assert_eq!(r.recall_5, 0.5);
        assert!((r.mrr_10 - 0.25).abs() < 1e-12);
        // nDCG of a hit at rank 2 = 1/log2(3)
        assert!((r.ndcg_10 - 0.5 / 3f64.log2()).abs() < 1e-12);
        assert_eq!((r.p50_ms, r.p99_ms), (2.0, 4.0));

        // two relevant documents, one found: BEIR recall counts the share
        let mut b = Acc::default();
        b.add(&ranked(&["a", "z"]), &set(&["a", "b"]), 1.0);
        let r = b.report();
        assert_eq!((r.recall_1, r.mrr_10), (0.5, 1.0));
        let ideal = 1.0 + 1.0 / 3f64.log2();
        assert!((r.ndcg_10 - 1.0 / ideal).abs() < 1e-12);
    }

    #[test]
    fn answers_are_scored_by_f1_type_and_degeneration() {
        let f1 = token_f1("The Denver Broncos [1].", &["Denver Broncos".into()]);
        assert!((f1 - 1.0).abs() < 1e-9, "{f1}");
        // one token of two in common each way: precision and recall 0.5
        let f1 = token_f1("Broncos won", &["Denver Broncos".into(), "nothing".into()]);
        assert!((f1 - 0.5).abs() < 1e-9, "{f1}");
        assert_eq!(token_f1("anything", &[]), 0.0);
        assert_eq!(degenerate_text("  "), Some("empty"));
        assert_eq!(
            degenerate_text("Using the context above, the answer is 4."),
            Some("echo")
        );
        assert_eq!(
            degenerate_text("It is big. It is red and round. It is red and round [2]. Ok"),
            Some("loop")
        );
        assert_eq!(
            degenerate_text(&"## Ownership [1]\n".repeat(4)),
            Some("loop")
        );
        assert_eq!(degenerate_text("Ownership is a set of rules [1]."), None);
        assert_eq!(question_type("In which year did it happen?"), "which");
        assert_eq!(question_type("Whose idea was it?"), "who");
        assert_eq!(question_type("Name the river."), "other");
    }

    #[test]
    fn gold_answers_match_case_insensitively_and_never_when_empty() {
        let golds = vec!["October 1973".to_string(), " ".to_string()];
        assert!(contains_answer("It began in october 1973.", &golds));
        assert!(!contains_answer("It began in 1973.", &golds));
        assert!(!contains_answer("anything", &[String::new()]));
    }

    #[test]
    fn a_dataset_reads_the_beir_layout_and_names_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir(p.join("qrels")).unwrap();
        std::fs::write(
            p.join("corpus.jsonl"),
            "{\"_id\": \"d1\", \"title\": \"T\", \"text\": \"x\"}\n",
        )
        .unwrap();
        std::fs::write(
            p.join("queries.jsonl"),
            "{\"_id\": \"q1\", \"text\": \"?\"}\n{\"_id\": \"q2\", \"text\": \"?\"}\n",
        )
        .unwrap();
        std::fs::write(
            p.join("qrels/test.tsv"),
            "query-id\tcorpus-id\tscore\nq1\td1\t1\n",
        )
        .unwrap();
        let d = Dataset::load(p).unwrap();
        assert_eq!((d.corpus.len(), d.queries.len(), d.qrels.len()), (1, 2, 1));
        std::fs::write(p.join("queries.jsonl"), "{\"_id\": \"q1\"}\n").unwrap();
        let e = format!("{:#}", Dataset::load(p).err().unwrap());
        assert!(e.contains("queries.jsonl line 1"), "{e}");
    }

    #[test]
    fn each_signal_has_its_curve() {
        let record = |answerable, first_token, question| AnswerRecord {
            id: String::new(),
            question: String::new(),
            answer: String::new(),
            answerable,
            refused_anyway: false,
            refusal_reason: None,
            refusal_probability: question,
            refusal_signals: Some(docent::query::generate::RefusalSignals {
                first_token,
                question,
                probe: None,
            }),
            contains_gold: answerable,
            mode: docent::query::AnswerMode::Generative,
            degenerate: Vec::new(),
            first_text_ms: None,
            total_ms: 0.0,
            completion_tokens: 0,
            generation_ms: 0.0,
        };
        // unanswerable: one the first token catches, one the pre-question catches
        let records = [
            record(false, Some(0.9), Some(0.1)),
            record(false, Some(0.1), Some(0.8)),
            record(true, Some(0.1), Some(0.1)),
        ];
        let at = |signal, t: f32| {
            let curve = refusal_curve_by(&records, signal);
            let row = curve.into_iter().find(|r| r.threshold == t).unwrap();
            (row.correct_refusal, row.false_refusal)
        };
        assert_eq!(at(Signal::FirstToken, 0.5), (0.5, 0.0));
        assert_eq!(at(Signal::Question, 0.5), (0.5, 0.0));
        assert_eq!(at(Signal::Either, 0.5), (1.0, 0.0));
        // the deciding signal is the pre-question's here
        assert_eq!(at(Signal::Deciding, 0.5), (0.5, 0.0));
        assert!(!records[0].refused_at(0.5) && records[1].refused_at(0.5));
        assert_eq!(at(Signal::Either, 0.05), (1.0, 1.0));
        assert_eq!(
            both_signals(&records, Signal::Either).len(),
            REFUSAL_THRESHOLDS.len()
        );
        // one signal only: no per-signal curves
        let single = [AnswerRecord {
            refusal_signals: None,
            ..record(true, None, Some(0.2))
        }];
        assert!(both_signals(&single, Signal::Either).is_empty());
        assert_eq!(refusal_curve(&single).len(), REFUSAL_THRESHOLDS.len());
    }

    #[test]
    fn refusal_thresholds_keep_false_refusals_under_their_limits() {
        // answerable best scores 0.40..0.89, unanswerable 0.10..0.59
        let mut scores: Vec<(f32, bool)> =
            (0..100).map(|i| (0.40 + i as f32 * 0.005, true)).collect();
        scores.extend((0..100).map(|i| (0.10 + i as f32 * 0.005, false)));
        let r = refusal(&scores, 0.0).unwrap();
        assert_eq!((r.correct_refusal, r.false_refusal), (0.0, 0.0));
        // 10 %: refuse below 0.45 (10 answerable); 1 %: below 0.405 (1 answerable)
        assert!(
            (r.best_threshold - 0.45).abs() < 1e-6,
            "{}",
            r.best_threshold
        );
        assert!((r.best_false_refusal - 0.10).abs() < 1e-9);
        assert!((r.best_correct_refusal - 0.70).abs() < 1e-9);
        assert!(
            (r.strict_threshold - 0.405).abs() < 1e-6,
            "{}",
            r.strict_threshold
        );
        assert!((r.strict_false_refusal - 0.01).abs() < 1e-9);
        assert!((r.strict_correct_refusal - 0.61).abs() < 1e-9);
    }
}
