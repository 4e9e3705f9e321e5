//! `docent eval --dataset DIR`: retrieval quality on a BEIR-layout set (`corpus.jsonl`,
//! `queries.jsonl`, `qrels/test.tsv`, optional `answers.jsonl`). The corpus is ingested
//! into a temporary index through the normal pipeline; each query is embedded once and
//! searched in every mode.
//!
//! Metrics per mode (over queries that have relevant documents): Recall@1/5/10 (BEIR:
//! share of a query's relevant documents in the top k, averaged), MRR@10, nDCG@10 (binary
//! gains), and latency p50/p99 = the query's embedding time + that mode's search time.

pub mod baseline;
pub mod injection_e2e;
pub mod safety;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use docent_ingest::load::{Document, Format};
use docent_ingest::pipeline::{Input, Silent};
use docent_ingest::store::{block_on, SearchFilter, SearchMode};
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::server::startup;

/// Documents ranked per query (chunks beyond this are not looked at).
pub const DEPTH: usize = 10;

/// One document of a BEIR corpus (`corpus.jsonl`).
#[derive(Deserialize)]
pub struct CorpusLine {
    #[serde(rename = "_id")]
    pub id: String,
    #[serde(default)]
    pub title: String,
    pub text: String,
}

#[derive(Deserialize)]
pub(crate) struct QueryLine {
    #[serde(rename = "_id")]
    pub(crate) id: String,
    pub(crate) text: String,
    #[serde(default)]
    metadata: QueryMeta,
}

#[derive(Deserialize)]
struct QueryMeta {
    #[serde(default = "yes")]
    answerable: bool,
}

impl Default for QueryMeta {
    fn default() -> Self {
        QueryMeta { answerable: true }
    }
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct AnswerLine {
    #[serde(rename = "query-id")]
    query_id: String,
    #[serde(default)]
    answers: Vec<String>,
}

/// A BEIR-layout evaluation set.
pub struct Dataset {
    pub name: String,
    pub(crate) corpus: Vec<CorpusLine>,
    pub(crate) queries: Vec<QueryLine>,
    /// Query id → relevant corpus ids.
    pub(crate) qrels: HashMap<String, HashSet<String>>,
    /// Query id → gold answer strings (`answers.jsonl`, optional).
    answers: HashMap<String, Vec<String>>,
}

pub(crate) fn jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<Vec<T>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    std::io::BufReader::new(f)
        .lines()
        .enumerate()
        .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
        .map(|(n, l)| {
            let l = l?;
            serde_json::from_str(&l)
                .with_context(|| format!("{} line {}: not a valid record", path.display(), n + 1))
        })
        .collect()
}

impl Dataset {
    /// Every question: id, text, whether it has relevant documents (answerable), its gold
    /// answers.
    pub(crate) fn questions(&self) -> Vec<(String, String, bool, Vec<String>)> {
        self.queries
            .iter()
            .map(|q| {
                (
                    q.id.clone(),
                    q.text.clone(),
                    self.qrels.contains_key(&q.id),
                    self.answers.get(&q.id).cloned().unwrap_or_default(),
                )
            })
            .collect()
    }

    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let corpus = jsonl(&dir.join("corpus.jsonl"))?;
        let queries = jsonl(&dir.join("queries.jsonl"))?;
        let qrels_file = dir.join("qrels").join("test.tsv");
        let text = std::fs::read_to_string(&qrels_file)
            .with_context(|| format!("cannot read {}", qrels_file.display()))?;
        let mut qrels: HashMap<String, HashSet<String>> = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let cols: Vec<&str> = line.split('\t').collect();
            if n == 0 && cols.first() == Some(&"query-id") {
                continue;
            }
            match cols.as_slice() {
                [q, c, score, ..] if score.trim().parse::<f64>().is_ok_and(|s| s > 0.0) => {
                    qrels
                        .entry(q.to_string())
                        .or_default()
                        .insert(c.to_string());
                }
                [_, _, _, ..] => {}
                _ => anyhow::bail!(
                    "{} line {}: expected query-id, corpus-id, score",
                    qrels_file.display(),
                    n + 1
                ),
            }
        }
        let answers_file = dir.join("answers.jsonl");
        let answers = if answers_file.is_file() {
            jsonl::<AnswerLine>(&answers_file)?
                .into_iter()
                .map(|a| (a.query_id, a.answers))
                .collect()
        } else {
            HashMap::new()
        };
        Ok(Dataset {
            answers,
            name: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            corpus,
            queries,
            qrels,
        })
    }
}

/// Figures of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    #[serde(rename = "recall@1")]
    pub recall_1: f64,
    #[serde(rename = "recall@5")]
    pub recall_5: f64,
    #[serde(rename = "recall@10")]
    pub recall_10: f64,
    #[serde(rename = "mrr@10")]
    pub mrr_10: f64,
    #[serde(rename = "ndcg@10")]
    pub ndcg_10: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
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
    pub answerable: usize,
    pub unanswerable: usize,
    /// `retrieval.min_score` of the configuration and the rates it gives.
    pub min_score: f32,
    pub correct_refusal: f64,
    pub false_refusal: f64,
    /// The threshold that refuses the most unanswerable questions while refusing at most
    /// 10 % of the answerable ones, and its rates.
    pub best_threshold: f32,
    pub best_correct_refusal: f64,
    pub best_false_refusal: f64,
    /// The same at most 1 % false refusals (a cautious default for `retrieval.min_score`).
    pub strict_threshold: f32,
    pub strict_correct_refusal: f64,
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

#[derive(Debug, Serialize)]
pub struct EvalReport {
    pub dataset: String,
    pub model_dir: PathBuf,
    pub documents: usize,
    pub chunks: usize,
    pub ingest_seconds: f64,
    /// Retrieval settings the figures hold for: chunk tokens/overlap, top_k (context
    /// metrics), neighbours, MMR λ, fusion method and candidates.
    pub settings: String,
    #[serde(flatten)]
    pub modes: BTreeMap<String, ModeReport>,
    /// Present when the set has unanswerable questions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<RefusalReport>,
    /// The same with the question's terms in the signal: best cosine + `term_weight` × the
    /// share of the question's BM25 terms in the best-covered of the top_k chunks
    /// ([`crate::query::retrieve::relevance`]); `retrieval.term_weight`, or 0.5 when it
    /// is 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal_with_terms: Option<(f32, RefusalReport)>,
    /// Full question answering with the LLM (`--answers N`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answers: Option<AnswerReport>,
}

/// Full RAG on the first N questions (file order), with the configured retrieval and the
/// generation model (greedy, at most [`ANSWER_TOKENS`] tokens).
#[derive(Debug, Clone, Serialize)]
pub struct AnswerReport {
    pub questions: usize,
    pub answerable: usize,
    pub unanswerable: usize,
    /// Answerable questions whose answer contains a gold answer (case-insensitive).
    pub contains_gold: f64,
    /// Citations (on answerable questions) whose chunk contains a gold answer.
    pub citation_precision: f64,
    pub citations: usize,
    /// Answerable questions with at least one citation of a chunk holding a gold answer.
    pub citation_coverage: f64,
    /// Unanswerable questions answered with `answerable: false`.
    pub correct_refusal: f64,
    /// Answerable questions answered with `answerable: false`.
    pub false_refusal: f64,
    pub mean_seconds: f64,
    /// Mean token-level F1 of answerable questions' answers against their best gold
    /// answer (SQuAD normalisation: lower case, no punctuation, articles or markers).
    pub f1: f64,
    /// Answered questions whose model text the guards found degenerate (loops, echoes,
    /// unsupported or empty text), before the fallback replaced or trimmed it.
    pub degenerate_before: f64,
    /// Answered questions whose final answer is still degenerate, by an independent check
    /// of the text: empty, a repeated sentence or piece, or the prompt's instructions.
    pub degenerate_after: f64,
    /// Answered questions answered extractively (fallback, or asked for).
    pub extractive: f64,
    /// The same figures per question type (the question's first wh-word).
    pub by_type: BTreeMap<String, TypeRow>,
    /// Refusal decided from the content instead of the similarity: the best score of a
    /// retrieved sentence as an answer (share of the question's content words and cosine,
    /// as the extractive answer scores them); the same sweep as the similarity refusal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal_by_content: Option<RefusalReport>,
    /// Citation precision and coverage with the answer's own markers and with fallback
    /// attribution at several thresholds, on all answerable questions and on the second
    /// half (held out when the thresholds are chosen on the first).
    pub attribution: Vec<AttributionRow>,
    /// `generation.refusal_threshold` the figures above are for (the answers are made
    /// with the model's judgement recorded and applied afterwards, so that one run gives
    /// every threshold of [`Self::refusal_by_model`]).
    pub refusal_threshold: f32,
    /// The model's judgement: refusal rates and gold answers at each threshold on its
    /// probability of starting with the refusal phrase (retrieval refusals and answers
    /// that say the phrase are refused at every threshold). Empty when no refusal phrase
    /// is configured.
    pub refusal_by_model: Vec<ThresholdRow>,
    /// With a pre-question (`generation.refusal = "question"`) both signals are
    /// read on every answer: the curve of each, and of refusing when either reaches the
    /// threshold. Empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_first_token: Vec<ThresholdRow>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_question: Vec<ThresholdRow>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_either: Vec<ThresholdRow>,
    /// With the refusal probe (`generation.refusal = "probe"`): its curve (it decides), and
    /// the first token's is read on the same answers (`refusal_by_first_token`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_probe: Vec<ThresholdRow>,
    /// Time to the first shown text and to the whole answer, over the questions the
    /// model answered (not refused) at the configured threshold, in ms.
    pub first_text_ms: Percentiles,
    pub total_ms: Percentiles,
    /// Generated tokens per second of generation time (prefill included), over every answer
    /// the model wrote.
    pub generation: GenerationSpeed,
}

/// How fast the answers were generated, and the prompt-lookup drafts read on the way.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerationSpeed {
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Draft steps, draft tokens proposed and accepted (`generation.lookup_tokens`).
    pub draft_steps: u64,
    pub draft_proposed: u64,
    pub draft_accepted: u64,
}

/// One threshold of the model's refusal judgement.
#[derive(Debug, Clone, Serialize)]
pub struct ThresholdRow {
    pub threshold: f32,
    pub correct_refusal: f64,
    pub false_refusal: f64,
    /// Answerable questions answered with a gold answer at this threshold.
    pub contains_gold: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p95: f64,
}

impl Percentiles {
    fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        Percentiles {
            n: values.len(),
            p50: percentile(&values, 50.0),
            p95: percentile(&values, 95.0),
        }
    }
}

/// Thresholds the model's refusal judgement is reported at (1: only answers that say the
/// refusal phrase).
pub const REFUSAL_THRESHOLDS: &[f32] = &[
    0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
];

/// One answered question, as the evaluation keeps it (and `--answers-dump` writes it).
#[derive(Debug, Clone, Serialize)]
pub struct AnswerRecord {
    pub id: String,
    pub question: String,
    pub answer: String,
    pub answerable: bool,
    /// Refused whatever the threshold: by retrieval, by the safety filter, or the model
    /// wrote the refusal phrase.
    pub refused_anyway: bool,
    pub refusal_reason: Option<crate::query::RefusalReason>,
    pub refusal_probability: Option<f32>,
    /// Every signal of the model's judgement read for this answer.
    pub refusal_signals: Option<crate::query::generate::RefusalSignals>,
    pub contains_gold: bool,
    pub mode: crate::query::AnswerMode,
    pub degenerate: Vec<String>,
    pub first_text_ms: Option<f64>,
    pub total_ms: f64,
    /// Tokens the model generated, and the generation's time (prefill and decode).
    pub completion_tokens: usize,
    pub generation_ms: f64,
}

impl AnswerRecord {
    /// Refused at `threshold` on the model's judgement.
    pub fn refused_at(&self, threshold: f32) -> bool {
        self.refused_by(Signal::Deciding, threshold)
    }

    /// Refused at `threshold` on one of the model's signals.
    pub fn refused_by(&self, signal: Signal, threshold: f32) -> bool {
        self.refused_anyway || self.signal(signal).is_some_and(|p| p >= threshold)
    }

    fn signal(&self, signal: Signal) -> Option<f32> {
        let signals = self.refusal_signals.unwrap_or_default();
        match signal {
            Signal::Deciding => self.refusal_probability,
            Signal::FirstToken => signals.first_token,
            Signal::Question => signals.question,
            Signal::Probe => signals.probe,
            Signal::Either => match (signals.first_token, signals.question) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// Which of the model's refusal signals a curve is drawn for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The one the service decided with (`generation.refusal`).
    Deciding,
    /// The refusal phrase's probability at the answer's first token.
    FirstToken,
    /// The pre-question's probability of "no".
    Question,
    /// The refusal probe's, from the hidden state at the prompt's last token.
    Probe,
    /// Refused when either reaches the threshold.
    Either,
}

/// The refusal curve over `records`, on the deciding signal.
pub fn refusal_curve(records: &[AnswerRecord]) -> Vec<ThresholdRow> {
    refusal_curve_by(records, Signal::Deciding)
}

/// The refusal curve over `records` on one signal; empty when no record has it.
pub fn refusal_curve_by(records: &[AnswerRecord], signal: Signal) -> Vec<ThresholdRow> {
    if !records.iter().any(|r| r.signal(signal).is_some()) {
        return Vec::new();
    }
    let share = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let answerable = records.iter().filter(|r| r.answerable).count();
    let unanswerable = records.len() - answerable;
    REFUSAL_THRESHOLDS
        .iter()
        .map(|&t| ThresholdRow {
            threshold: t,
            correct_refusal: share(
                records
                    .iter()
                    .filter(|r| !r.answerable && r.refused_by(signal, t))
                    .count(),
                unanswerable,
            ),
            false_refusal: share(
                records
                    .iter()
                    .filter(|r| r.answerable && r.refused_by(signal, t))
                    .count(),
                answerable,
            ),
            contains_gold: share(
                records
                    .iter()
                    .filter(|r| r.answerable && !r.refused_by(signal, t) && r.contains_gold)
                    .count(),
                answerable,
            ),
        })
        .collect()
}

/// The curve on `signal` when the records carry both signals (a pre-question ran).
fn both_signals(records: &[AnswerRecord], signal: Signal) -> Vec<ThresholdRow> {
    let both = records.iter().any(|r| {
        r.refusal_signals
            .is_some_and(|s| s.first_token.is_some() && s.question.is_some())
    });
    if both {
        refusal_curve_by(records, signal)
    } else {
        Vec::new()
    }
}

/// The answer to `request` through the streaming path, with the time to its first shown
/// text and to its end.
pub(crate) async fn timed_answer(
    engine: &std::sync::Arc<crate::query::QueryEngine>,
    request: crate::query::QueryRequest,
) -> anyhow::Result<(crate::query::QueryResponse, Option<f64>, f64)> {
    let started = Instant::now();
    let mut events = engine.answer_stream(request).await?;
    let mut first = None;
    while let Some(event) = events.recv().await {
        match event {
            crate::query::QueryEvent::Delta { .. } => {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64() * 1e3);
            }
            crate::query::QueryEvent::Done(response) => {
                return Ok((*response, first, started.elapsed().as_secs_f64() * 1e3))
            }
            crate::query::QueryEvent::Error(e) => return Err(e.into()),
            _ => {}
        }
    }
    anyhow::bail!("the answer ended without a result")
}

/// Answer figures for one type of question.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TypeRow {
    pub questions: usize,
    pub answerable: usize,
    pub contains_gold: f64,
    pub f1: f64,
    pub degenerate_before: f64,
    pub extractive: f64,
    pub correct_refusal: f64,
    pub false_refusal: f64,
}

/// One refusal curve as a table under `title`; nothing when `rows` is empty.
fn write_curve(
    f: &mut std::fmt::Formatter<'_>,
    title: &str,
    rows: &[ThresholdRow],
) -> std::fmt::Result {
    if rows.is_empty() {
        return Ok(());
    }
    writeln!(f, "{title}:")?;
    writeln!(
        f,
        "  {:>9} {:>16} {:>14} {:>13}",
        "threshold", "correct refusals", "false refusals", "contain gold"
    )?;
    for r in rows {
        writeln!(
            f,
            "  {:>9.2} {:>15.1}% {:>13.1}% {:>12.1}%",
            r.threshold,
            100.0 * r.correct_refusal,
            100.0 * r.false_refusal,
            100.0 * r.contains_gold
        )?;
    }
    Ok(())
}

/// The type of a question: its first wh-word (`what`, `who`, `how`…), else `other`.
pub fn question_type(question: &str) -> String {
    const TYPES: &[&str] = &[
        "what", "which", "who", "whom", "whose", "when", "where", "why", "how",
    ];
    question
        .split(|c: char| !c.is_alphanumeric())
        .map(str::to_lowercase)
        .find(|w| TYPES.contains(&w.as_str()))
        .map(|w| {
            if w == "whom" || w == "whose" {
                "who".to_string()
            } else {
                w
            }
        })
        .unwrap_or_else(|| "other".into())
}

/// SQuAD's answer normalisation: lower case, punctuation, articles and citation markers
/// removed, blanks collapsed; as tokens.
fn answer_tokens(text: &str) -> Vec<String> {
    let lower = text.to_lowercase();
    static MARKER: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"\[\d{1,3}\]").expect("valid regex"));
    MARKER
        .replace_all(&lower, " ")
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c.is_whitespace() {
                c
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .filter(|w| !["a", "an", "the"].contains(w))
        .map(str::to_string)
        .collect()
}

/// Token-level F1 of `answer` against the best of `golds` (0 with no gold answer).
pub fn token_f1(answer: &str, golds: &[String]) -> f64 {
    let a = answer_tokens(answer);
    golds
        .iter()
        .map(|g| {
            let g = answer_tokens(g);
            let mut pool: HashMap<&str, usize> = HashMap::new();
            for t in &g {
                *pool.entry(t.as_str()).or_default() += 1;
            }
            let mut same = 0usize;
            for t in &a {
                if let Some(n) = pool.get_mut(t.as_str()).filter(|n| **n > 0) {
                    *n -= 1;
                    same += 1;
                }
            }
            if same == 0 {
                return 0.0;
            }
            let (p, r) = (same as f64 / a.len() as f64, same as f64 / g.len() as f64);
            2.0 * p * r / (p + r)
        })
        .fold(0.0, f64::max)
}

/// Why a final answer is degenerate, checked on its text alone: empty, a sentence or a
/// piece repeated, or the prompt's instructions written back.
pub fn degenerate_text(answer: &str) -> Option<&'static str> {
    const ECHOES: &[&str] = &[
        "using the context above",
        "answer the question",
        "cite the context",
        "numbered context",
        "in one or two sentences",
        "numbered passages",
        "cite each passage",
        "with the words of the passages",
    ];
    let lower = answer.to_lowercase();
    if answer.trim().is_empty() {
        return Some("empty");
    }
    if crate::query::postprocess::guard::periodic_tail(answer).is_some() {
        return Some("loop");
    }
    let mut seen = HashSet::new();
    let mut units = crate::query::postprocess::guard::Units::default();
    let mut all = units.push(answer);
    all.extend(units.finish());
    for u in all {
        let key: String = answer_tokens(&u).join(" ");
        if key.split(' ').count() >= 3 && !seen.insert(key) {
            return Some("loop");
        }
    }
    ECHOES.iter().any(|e| lower.contains(e)).then_some("echo")
}

#[derive(Debug, Clone, Serialize)]
pub struct AttributionRow {
    pub setting: String,
    pub citations: usize,
    pub precision: f64,
    pub coverage: f64,
    pub held_out_precision: f64,
    pub held_out_coverage: f64,
}

/// Fallback settings the answer evaluation compares (add_at, drop_below).
pub const ATTRIBUTION_SWEEP: &[(f32, f32)] = &[
    (0.3, 0.1),
    (0.4, 0.1),
    (0.45, 0.1),
    (0.5, 0.1),
    (0.6, 0.1),
    (0.7, 0.1),
    (0.45, 0.0),
    (0.45, 0.2),
];

/// Token budget of each generated answer (SQuAD answers are short).
pub const ANSWER_TOKENS: usize = 64;

/// The index an evaluation built, kept for the answer run.
pub struct Evaluated {
    pub report: EvalReport,
    pub index: crate::query::retrieve::Index,
    pub config: Config,
    _tmp: RemoveOnDrop,
}

/// Whether `text` contains one of the gold answers (case-insensitive, trimmed; empty gold
/// strings never match).
pub fn contains_answer(text: &str, golds: &[String]) -> bool {
    let text = text.to_lowercase();
    golds
        .iter()
        .any(|g| !g.trim().is_empty() && text.contains(&g.trim().to_lowercase()))
}

/// The chunks the query path retrieves for `question` (configured retrieval), as hits.
async fn hits_of(
    engine: &crate::query::QueryEngine,
    question: &str,
) -> anyhow::Result<Vec<docent_ingest::store::Hit>> {
    let search = engine
        .search(crate::query::SearchRequest {
            question: question.to_string(),
            retrieval: Default::default(),
        })
        .await?;
    Ok(search
        .hits
        .iter()
        .map(|h| docent_ingest::store::Hit {
            payload: docent_ingest::store::ChunkPayload {
                document_id: h.document_id.clone(),
                source: h.source.clone(),
                title: h.title.clone(),
                chunk_index: h.chunk_index,
                page: h.page,
                span: h.span,
                text: h.text.clone(),
                ..Default::default()
            },
            score: h.score,
        })
        .collect())
}

/// Answers the first `n` questions with the full query path and scores them.
///
/// The engine should run with `generation.refusal_threshold = 1` (only answers that say the
/// refusal phrase refused): the model's judgement is recorded and `threshold` applied to it
/// afterwards, which is what the service does at that threshold (it decides at the first
/// token, before anything is shown), so the curve over every threshold comes from one run.
/// Each answer is written to `dump` (JSON lines) when given.
pub async fn answers(
    engine: &std::sync::Arc<crate::query::QueryEngine>,
    data: &Dataset,
    n: usize,
    mode: crate::query::AnswerMode,
    threshold: f32,
    dump: Option<&Path>,
) -> anyhow::Result<AnswerReport> {
    let queries: Vec<&QueryLine> = data
        .queries
        .iter()
        .filter(|q| data.qrels.contains_key(&q.id) || !q.metadata.answerable)
        .take(n)
        .collect();
    let started = Instant::now();
    let drafts_before = crate::query::generate::lookup::draft_counts();
    let mut tally = Tally::new();
    let mut records = Vec::with_capacity(queries.len());
    for q in &queries {
        let golds = data.answers.get(&q.id).cloned().unwrap_or_default();
        let answerable = data.qrels.contains_key(&q.id);
        let (response, record) = answer_one(engine, q, mode, answerable, &golds).await?;
        // as the service answers at `threshold`: refused when the judgement reaches it
        let shown = !record.refused_at(threshold);
        records.push(record);
        // content-based answerability, on the same retrieval as the answer
        let hits = hits_of(engine, &q.text).await?;
        let content = engine
            .extractive_answer(&q.text, &hits)
            .await?
            .map_or(f32::MIN, |(_, score)| score);
        tally.content_scores.push((content, answerable));
        tally.count(
            &question_type(&q.text),
            &response,
            shown,
            answerable,
            &golds,
        );
        if answerable {
            tally.citations(engine, &response, shown, &golds).await?;
            tally.sweep(engine, &response, &hits, &golds).await?;
        }
    }
    if let Some(path) = dump {
        let mut out = String::new();
        for r in &records {
            out.push_str(&serde_json::to_string(r)?);
            out.push('\n');
        }
        std::fs::write(path, out)?;
    }
    let mean_seconds = started.elapsed().as_secs_f64() / queries.len().max(1) as f64;
    Ok(tally.report(
        queries.len(),
        mean_seconds,
        threshold,
        &records,
        drafts_before,
    ))
}

/// One question through the answer path (greedy, [`ANSWER_TOKENS`] at most), timed, as its
/// record.
async fn answer_one(
    engine: &std::sync::Arc<crate::query::QueryEngine>,
    q: &QueryLine,
    mode: crate::query::AnswerMode,
    answerable: bool,
    golds: &[String],
) -> anyhow::Result<(crate::query::QueryResponse, AnswerRecord)> {
    let (response, first_text_ms, total_ms) = timed_answer(
        engine,
        crate::query::QueryRequest {
            question: q.text.clone(),
            generation: crate::query::GenerationOptions {
                max_tokens: Some(ANSWER_TOKENS),
                temperature: Some(0.0),
                ..Default::default()
            },
            mode: Some(mode),
            ..Default::default()
        },
    )
    .await?;
    let record = AnswerRecord {
        id: q.id.clone(),
        question: q.text.clone(),
        answer: response.answer.clone(),
        answerable,
        refused_anyway: !response.answerable,
        refusal_reason: response.refusal_reason,
        refusal_probability: response.refusal_probability,
        refusal_signals: response.refusal_signals,
        contains_gold: contains_answer(&response.answer, golds),
        mode: response.mode,
        degenerate: response.degenerate.clone(),
        first_text_ms,
        total_ms,
        completion_tokens: response.usage.completion_tokens,
        generation_ms: response.usage.generation_ms,
    };
    Ok((response, record))
}

/// Counts of [`answers`], question by question.
struct Tally {
    answerable: usize,
    unanswerable: usize,
    gold: usize,
    refused_ok: usize,
    refused_wrongly: usize,
    citations: usize,
    good_citations: usize,
    covered: usize,
    /// Per setting (0 = the model's markers), per answerable question: (citations, good).
    per_setting: Vec<Vec<(usize, usize)>>,
    /// Per type: (questions, answerable, gold, f1 sum, degenerate before, extractive,
    /// refused ok, refused wrongly, unanswerable).
    types: BTreeMap<String, [f64; 9]>,
    content_scores: Vec<(f32, bool)>,
    f1_sum: f64,
    answered: usize,
    degenerate_before: usize,
    degenerate_after: usize,
    extractive: usize,
}

impl Tally {
    fn new() -> Self {
        Tally {
            answerable: 0,
            unanswerable: 0,
            gold: 0,
            refused_ok: 0,
            refused_wrongly: 0,
            citations: 0,
            good_citations: 0,
            covered: 0,
            per_setting: vec![Vec::new(); ATTRIBUTION_SWEEP.len() + 1],
            types: BTreeMap::new(),
            content_scores: Vec::new(),
            f1_sum: 0.0,
            answered: 0,
            degenerate_before: 0,
            degenerate_after: 0,
            extractive: 0,
        }
    }

    /// The answer's refusal, gold answer, F1 and degeneration, overall and per type;
    /// `shown`: not refused at the threshold.
    fn count(
        &mut self,
        kind: &str,
        response: &crate::query::QueryResponse,
        shown: bool,
        answerable: bool,
        golds: &[String],
    ) {
        let t = self.types.entry(kind.to_string()).or_default();
        let one = |b: bool| f64::from(u8::from(b));
        t[0] += 1.0;
        if shown {
            self.answered += 1;
            let before = !response.degenerate.is_empty();
            let is_extractive = response.mode == crate::query::AnswerMode::Extractive;
            self.degenerate_before += usize::from(before);
            self.degenerate_after += usize::from(degenerate_text(&response.answer).is_some());
            self.extractive += usize::from(is_extractive);
            t[4] += one(before);
            t[5] += one(is_extractive);
        }
        if !answerable {
            self.unanswerable += 1;
            t[8] += 1.0;
            self.refused_ok += usize::from(!shown);
            t[6] += one(!shown);
            return;
        }
        self.answerable += 1;
        t[1] += 1.0;
        self.refused_wrongly += usize::from(!shown);
        t[7] += one(!shown);
        let has_gold = shown && contains_answer(&response.answer, golds);
        self.gold += usize::from(has_gold);
        t[2] += one(has_gold);
        let f1 = if shown {
            token_f1(&response.answer, golds)
        } else {
            0.0
        };
        self.f1_sum += f1;
        t[3] += f1;
    }

    /// The citations shown with an answerable question's answer: how many cite a chunk
    /// that holds a gold answer.
    async fn citations(
        &mut self,
        engine: &crate::query::QueryEngine,
        response: &crate::query::QueryResponse,
        shown: bool,
        golds: &[String],
    ) -> anyhow::Result<()> {
        let shown: &[crate::query::postprocess::Citation] =
            if shown { &response.citations } else { &[] };
        let mut any_good = false;
        for c in shown {
            self.citations += 1;
            let chunk = engine
                .index
                .store
                .chunk(&c.document_id, c.chunk_index)
                .await?;
            let good = chunk.is_some_and(|p| contains_answer(&p.text, golds));
            self.good_citations += usize::from(good);
            any_good |= good;
        }
        self.covered += usize::from(any_good);
        Ok(())
    }

    /// The same answer with fallback attribution over the same retrieved blocks, at every
    /// setting of [`ATTRIBUTION_SWEEP`].
    async fn sweep(
        &mut self,
        engine: &crate::query::QueryEngine,
        response: &crate::query::QueryResponse,
        hits: &[docent_ingest::store::Hit],
        golds: &[String],
    ) -> anyhow::Result<()> {
        let texts: Vec<String> = hits.iter().map(|h| h.payload.text.clone()).collect();
        let good_block = |n: usize| texts.get(n - 1).is_some_and(|t| contains_answer(t, golds));
        let tally = |cits: &[crate::query::postprocess::Citation]| {
            (cits.len(), cits.iter().filter(|c| good_block(c.n)).count())
        };
        let (answer, model) = crate::query::postprocess::cite(&response.answer, hits);
        self.per_setting[0].push(tally(&model));
        let claims = crate::query::postprocess::claims(&answer);
        let support = engine.support(&claims, &texts).await?;
        for (i, &(add_at, drop_below)) in ATTRIBUTION_SWEEP.iter().enumerate() {
            let a = crate::query::postprocess::Attribution {
                add_at,
                drop_below,
                unsupported_below: 0.0,
            };
            let (_, cits) =
                crate::query::postprocess::attribute(&answer, &claims, &support, hits, a);
            self.per_setting[i + 1].push(tally(&cits));
        }
        Ok(())
    }

    /// The report: the shares, the refusal curves, the latencies of the answers shown.
    fn report(
        self,
        questions: usize,
        mean_seconds: f64,
        threshold: f32,
        records: &[AnswerRecord],
        drafts_before: (u64, u64, u64),
    ) -> AnswerReport {
        let answered_now: Vec<&AnswerRecord> = records
            .iter()
            .filter(|r| !r.refused_at(threshold))
            .collect();
        let first_text_ms = Percentiles::of(
            answered_now
                .iter()
                .filter_map(|r| r.first_text_ms)
                .collect(),
        );
        let total_ms = Percentiles::of(answered_now.iter().map(|r| r.total_ms).collect());
        let share = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        AnswerReport {
            questions,
            answerable: self.answerable,
            unanswerable: self.unanswerable,
            contains_gold: share(self.gold, self.answerable),
            citation_precision: share(self.good_citations, self.citations),
            citations: self.citations,
            citation_coverage: share(self.covered, self.answerable),
            correct_refusal: share(self.refused_ok, self.unanswerable),
            false_refusal: share(self.refused_wrongly, self.answerable),
            mean_seconds,
            f1: if self.answerable == 0 {
                0.0
            } else {
                self.f1_sum / self.answerable as f64
            },
            degenerate_before: share(self.degenerate_before, self.answered),
            degenerate_after: share(self.degenerate_after, self.answered),
            extractive: share(self.extractive, self.answered),
            refusal_by_content: refusal(&self.content_scores, f32::MIN),
            by_type: type_rows(self.types),
            attribution: attribution_rows(&self.per_setting),
            refusal_threshold: threshold,
            refusal_by_model: refusal_curve(records),
            refusal_by_first_token: if records
                .iter()
                .any(|r| r.refusal_signals.is_some_and(|s| s.probe.is_some()))
            {
                refusal_curve_by(records, Signal::FirstToken)
            } else {
                both_signals(records, Signal::FirstToken)
            },
            refusal_by_probe: refusal_curve_by(records, Signal::Probe),
            refusal_by_question: both_signals(records, Signal::Question),
            refusal_by_either: both_signals(records, Signal::Either),
            first_text_ms,
            total_ms,
            generation: generation_speed(records, drafts_before),
        }
    }
}

/// Tokens per second over the answers that generated, and the drafts since `before`.
fn generation_speed(records: &[AnswerRecord], before: (u64, u64, u64)) -> GenerationSpeed {
    let drafts = crate::query::generate::lookup::draft_counts();
    let (tokens, seconds) = records
        .iter()
        .filter(|r| r.completion_tokens > 0)
        .fold((0, 0.0), |(t, s), r| {
            (t + r.completion_tokens, s + r.generation_ms / 1e3)
        });
    GenerationSpeed {
        tokens,
        seconds,
        tokens_per_second: if seconds > 0.0 {
            tokens as f64 / seconds
        } else {
            0.0
        },
        draft_steps: drafts.0 - before.0,
        draft_proposed: drafts.1 - before.1,
        draft_accepted: drafts.2 - before.2,
    }
}

/// The attribution sweep's rows: citations, precision and coverage per setting, on every
/// answerable question and on the second half only.
fn attribution_rows(per_setting: &[Vec<(usize, usize)>]) -> Vec<AttributionRow> {
    let score = |rows: &[(usize, usize)]| {
        let cits: usize = rows.iter().map(|r| r.0).sum();
        let good: usize = rows.iter().map(|r| r.1).sum();
        let covered = rows.iter().filter(|r| r.1 > 0).count();
        (
            cits,
            if cits == 0 {
                0.0
            } else {
                good as f64 / cits as f64
            },
            if rows.is_empty() {
                0.0
            } else {
                covered as f64 / rows.len() as f64
            },
        )
    };
    per_setting
        .iter()
        .enumerate()
        .map(|(i, rows)| {
            let (cits, precision, coverage) = score(rows);
            let (_, held_out_precision, held_out_coverage) = score(&rows[rows.len() / 2..]);
            AttributionRow {
                setting: match i {
                    0 => "as answered (configured attribution)".to_string(),
                    i => {
                        let (a, d) = ATTRIBUTION_SWEEP[i - 1];
                        format!("fallback add_at {a}, drop_below {d}")
                    }
                },
                citations: cits,
                precision,
                coverage,
                held_out_precision,
                held_out_coverage,
            }
        })
        .collect()
}

/// The per-type counts as rows of shares.
fn type_rows(types: BTreeMap<String, [f64; 9]>) -> BTreeMap<String, TypeRow> {
    types
        .into_iter()
        .map(|(name, t)| {
            let ratio = |a: f64, b: f64| if b == 0.0 { 0.0 } else { a / b };
            let answered = t[0] - t[6] - t[7];
            (
                name,
                TypeRow {
                    questions: t[0] as usize,
                    answerable: t[1] as usize,
                    contains_gold: ratio(t[2], t[1]),
                    f1: ratio(t[3], t[1]),
                    degenerate_before: ratio(t[4], answered),
                    extractive: ratio(t[5], answered),
                    correct_refusal: ratio(t[6], t[8]),
                    false_refusal: ratio(t[7], t[1]),
                },
            )
        })
        .collect()
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

/// The questions of a BEIR `queries.jsonl`, in file order.
pub fn questions(path: &Path) -> anyhow::Result<Vec<String>> {
    Ok(jsonl::<QueryLine>(path)?
        .into_iter()
        .map(|q| q.text)
        .collect())
}

/// `corpus` ingested through the normal pipeline into an index of the evaluation's own (a
/// temporary folder, or collections of its own on a server), removed when the guard drops;
/// the config points at it; also the ingest time in seconds.
pub(crate) fn index_corpus(
    config: &Config,
    corpus: &[CorpusLine],
    tag: &str,
) -> anyhow::Result<(Config, crate::query::retrieve::Index, RemoveOnDrop, f64)> {
    let tmp = std::env::temp_dir().join(format!("docent-{tag}-{}", std::process::id()));
    let mut config = config.clone();
    let cleanup = match config.store.kind {
        crate::config::StoreKind::Edge => RemoveOnDrop::Dir(tmp.clone()),
        // on a server: collections of the evaluation's own, dropped afterwards
        crate::config::StoreKind::Qdrant => {
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
    index: &crate::query::retrieve::Index,
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
        crate::query::retrieve::relevance(Some(best), coverage, term_weight).unwrap_or(f32::MIN);
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
    index: &crate::query::retrieve::Index,
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
    index: &crate::query::retrieve::Index,
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

impl std::fmt::Display for AnswerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "answers ({} questions: {} answerable, {} unanswerable; {:.1} s each): contain a gold answer {:.1} %, citation precision {:.1} % of {}, coverage {:.1} %, correct refusals {:.1} %, false refusals {:.1} %",
            self.questions,
            self.answerable,
            self.unanswerable,
            self.mean_seconds,
            100.0 * self.contains_gold,
            100.0 * self.citation_precision,
            self.citations,
            100.0 * self.citation_coverage,
            100.0 * self.correct_refusal,
            100.0 * self.false_refusal
        )?;
        writeln!(
            f,
            "token F1 {:.1} %; degenerate model text {:.1} % of answers (before the fallback), degenerate final answers {:.1} %; extractive answers {:.1} %",
            100.0 * self.f1,
            100.0 * self.degenerate_before,
            100.0 * self.degenerate_after,
            100.0 * self.extractive
        )?;
        writeln!(
            f,
            "time to the first shown text p50 {:.0} ms, p95 {:.0} ms; whole answer p50 {:.0} ms, p95 {:.0} ms ({} answers not refused)",
            self.first_text_ms.p50, self.first_text_ms.p95, self.total_ms.p50, self.total_ms.p95, self.total_ms.n
        )?;
        let g = &self.generation;
        writeln!(
            f,
            "generation: {} tokens in {:.1} s = {:.2} tokens/s (prefill included); prompt-lookup drafts: {} steps, {} of {} draft tokens accepted",
            g.tokens, g.seconds, g.tokens_per_second, g.draft_steps, g.draft_accepted, g.draft_proposed
        )?;
        self.write_refusal(f)?;
        self.write_tables(f)
    }
}

impl AnswerReport {
    /// The refusal curves of the signals that decided or were read.
    fn write_refusal(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.refusal_by_probe.is_empty() {
            write_curve(
                f,
                &format!("refusal by the probe (hidden state at the prompt's last token; configured threshold {}, deciding)", self.refusal_threshold),
                &self.refusal_by_probe,
            )?;
            write_curve(
                f,
                "refusal by the first token (probability of starting with the refusal phrase, read on the same answers)",
                &self.refusal_by_first_token,
            )?;
        } else if self.refusal_by_question.is_empty() {
            write_curve(
                f,
                &format!("refusal by the model's judgement (probability of starting with the refusal phrase; configured threshold {})", self.refusal_threshold),
                &self.refusal_by_model,
            )?;
        } else {
            write_curve(
                f,
                &format!("refusal by the pre-question (probability of \"no\"; configured threshold {}, deciding)", self.refusal_threshold),
                &self.refusal_by_question,
            )?;
            write_curve(
                f,
                "refusal by the first token (probability of starting with the refusal phrase, read on the same answers)",
                &self.refusal_by_first_token,
            )?;
            write_curve(
                f,
                "refusal when either signal reaches the threshold",
                &self.refusal_by_either,
            )?;
        }
        if let Some(r) = &self.refusal_by_content {
            writeln!(
                f,
                "refusal by content (best sentence score; {} answerable, {} unanswerable): {}",
                r.answerable,
                r.unanswerable,
                r.sweep()
            )?;
        }
        Ok(())
    }

    /// The per-type table and the attribution sweep's.
    fn write_tables(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<8} {:>9} {:>10} {:>12} {:>6} {:>11} {:>10} {:>9} {:>9}",
            "type",
            "questions",
            "answerable",
            "contain gold",
            "F1",
            "degenerate",
            "extractive",
            "refused+",
            "refused-"
        )?;
        for (name, t) in &self.by_type {
            writeln!(
                f,
                "{:<8} {:>9} {:>10} {:>11.1}% {:>5.1}% {:>10.1}% {:>9.1}% {:>8.1}% {:>8.1}%",
                name,
                t.questions,
                t.answerable,
                100.0 * t.contains_gold,
                100.0 * t.f1,
                100.0 * t.degenerate_before,
                100.0 * t.extractive,
                100.0 * t.correct_refusal,
                100.0 * t.false_refusal
            )?;
        }
        writeln!(
            f,
            "{:<38} {:>9} {:>10} {:>9} {:>18} {:>17}",
            "citations",
            "citations",
            "precision",
            "coverage",
            "held-out precision",
            "held-out coverage"
        )?;
        for r in &self.attribution {
            writeln!(
                f,
                "{:<38} {:>9} {:>9.1}% {:>8.1}% {:>17.1}% {:>16.1}%",
                r.setting,
                r.citations,
                100.0 * r.precision,
                100.0 * r.coverage,
                100.0 * r.held_out_precision,
                100.0 * r.held_out_coverage
            )?;
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
            refusal_signals: Some(crate::query::generate::RefusalSignals {
                first_token,
                question,
                probe: None,
            }),
            contains_gold: answerable,
            mode: crate::query::AnswerMode::Generative,
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
