//! `docent eval --answers N`: the first N questions through the configured answer path,
//! scored: gold answers, token F1, citations (and the attribution sweep), refusals by every
//! signal over every threshold, degeneration, latency.

use super::*;

/// Full RAG on the first N questions (file order), with the configured retrieval and the
/// generation model (greedy, at most [`ANSWER_TOKENS`] tokens).
#[derive(Debug, Clone, Serialize)]
pub struct AnswerReport {
    /// Questions answered: the first N that have relevant documents or are marked
    /// unanswerable.
    pub questions: usize,
    /// Of them, those with relevant documents.
    pub answerable: usize,
    /// Of them, those without (marked unanswerable in the set).
    pub unanswerable: usize,
    /// Answerable questions whose answer contains a gold answer (case-insensitive).
    pub contains_gold: f64,
    /// Citations (on answerable questions) whose chunk contains a gold answer.
    pub citation_precision: f64,
    /// Citations shown with the answerable questions' answers.
    pub citations: usize,
    /// Answerable questions with at least one citation of a chunk holding a gold answer.
    pub citation_coverage: f64,
    /// Unanswerable questions answered with `answerable: false`.
    pub correct_refusal: f64,
    /// Answerable questions answered with `answerable: false`.
    pub false_refusal: f64,
    /// Mean wall time per question in seconds (the answer, the content signal's retrieval,
    /// the citation checks and the attribution sweep together).
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
    /// With a pre-question: its curve (its probability of "no"). Empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_question: Vec<ThresholdRow>,
    /// With a pre-question: the curve of refusing when either the first token or the
    /// pre-question reaches the threshold. Empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_either: Vec<ThresholdRow>,
    /// With the refusal probe (`generation.refusal = "probe"`): its curve (it decides), and
    /// the first token's is read on the same answers (`refusal_by_first_token`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusal_by_probe: Vec<ThresholdRow>,
    /// Time to the first shown text in ms, over the questions the model answered (not
    /// refused) at the configured threshold.
    pub first_text_ms: Percentiles,
    /// Time to the whole answer in ms, over the same questions.
    pub total_ms: Percentiles,
    /// Generated tokens per second of generation time (prefill included), over every answer
    /// the model wrote.
    pub generation: GenerationSpeed,
}

/// How fast the answers were generated, and the prompt-lookup drafts read on the way.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerationSpeed {
    /// Tokens generated, over the answers that generated any.
    pub tokens: usize,
    /// Those answers' generation time in seconds (prefill and decode).
    pub seconds: f64,
    /// `tokens` / `seconds`; 0 when no time was spent.
    pub tokens_per_second: f64,
    /// Prompt-lookup draft steps taken during the run (`generation.lookup_tokens`).
    pub draft_steps: u64,
    /// Draft tokens proposed in those steps.
    pub draft_proposed: u64,
    /// Draft tokens the model accepted.
    pub draft_accepted: u64,
}

/// One threshold of the model's refusal judgement.
#[derive(Debug, Clone, Serialize)]
pub struct ThresholdRow {
    /// The threshold on the signal's probability: a question is refused when the signal
    /// reaches it.
    pub threshold: f32,
    /// Unanswerable questions refused at it.
    pub correct_refusal: f64,
    /// Answerable questions refused at it.
    pub false_refusal: f64,
    /// Answerable questions answered with a gold answer at this threshold.
    pub contains_gold: f64,
}

/// The median and 95th percentile (nearest rank) of a set of values, with their count.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    /// How many values there were.
    pub n: usize,
    /// The median; 0 with no values.
    pub p50: f64,
    /// The 95th percentile; 0 with no values.
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
    /// The question's id (`_id` in `queries.jsonl`).
    pub id: String,
    /// The question's text.
    pub question: String,
    /// The answer's text as the engine returned it.
    pub answer: String,
    /// The question has relevant documents in the set.
    pub answerable: bool,
    /// Refused whatever the threshold: by retrieval, by the safety filter, or the model
    /// wrote the refusal phrase.
    pub refused_anyway: bool,
    /// Why the engine refused, when it did.
    pub refusal_reason: Option<docent::query::RefusalReason>,
    /// The deciding signal's refusal probability (`generation.refusal`), when one was read.
    pub refusal_probability: Option<f32>,
    /// Every signal of the model's judgement read for this answer.
    pub refusal_signals: Option<docent::query::generate::RefusalSignals>,
    /// The answer contains a gold answer (case-insensitive), whatever the threshold.
    pub contains_gold: bool,
    /// How the answer was made: generative, or extractive (asked for or as the fallback).
    pub mode: docent::query::AnswerMode,
    /// What the answer path's guards found degenerate in the model's text, before the
    /// fallback; empty when nothing.
    pub degenerate: Vec<String>,
    /// Time to the first shown text in ms; `None` when no text was streamed.
    pub first_text_ms: Option<f64>,
    /// Time to the whole answer in ms.
    pub total_ms: f64,
    /// Tokens the model generated.
    pub completion_tokens: usize,
    /// The generation's time in ms (prefill and decode).
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
pub(super) fn both_signals(records: &[AnswerRecord], signal: Signal) -> Vec<ThresholdRow> {
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
    engine: &std::sync::Arc<docent::query::QueryEngine>,
    request: docent::query::QueryRequest,
) -> anyhow::Result<(docent::query::QueryResponse, Option<f64>, f64)> {
    let started = Instant::now();
    let mut events = engine.answer_stream(request).await?;
    let mut first = None;
    while let Some(event) = events.recv().await {
        match event {
            docent::query::QueryEvent::Delta { .. } => {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64() * 1e3);
            }
            docent::query::QueryEvent::Done(response) => {
                return Ok((*response, first, started.elapsed().as_secs_f64() * 1e3))
            }
            docent::query::QueryEvent::Error(e) => return Err(e.into()),
            _ => {}
        }
    }
    anyhow::bail!("the answer ended without a result")
}

/// Answer figures for one type of question.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TypeRow {
    /// Questions of the type.
    pub questions: usize,
    /// Of them, those with relevant documents.
    pub answerable: usize,
    /// Answerable questions whose shown answer contains a gold answer.
    pub contains_gold: f64,
    /// Mean token F1 over the answerable questions (0 for a refused one).
    pub f1: f64,
    /// Answered questions whose model text the guards found degenerate.
    pub degenerate_before: f64,
    /// Answered questions answered extractively.
    pub extractive: f64,
    /// Unanswerable questions refused.
    pub correct_refusal: f64,
    /// Answerable questions refused.
    pub false_refusal: f64,
}

/// One refusal curve as a table under `title`; nothing when `rows` is empty.
pub(super) fn write_curve(
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
pub(super) fn answer_tokens(text: &str) -> Vec<String> {
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
    if docent::query::postprocess::guard::periodic_tail(answer).is_some() {
        return Some("loop");
    }
    let mut seen = HashSet::new();
    let mut units = docent::query::postprocess::guard::Units::default();
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

/// One way of citing in the attribution sweep ([`AnswerReport::attribution`]), over the
/// answerable questions' answers and the same retrieved passages.
#[derive(Debug, Clone, Serialize)]
pub struct AttributionRow {
    /// The way of citing, in words: the answer as made (configured attribution), or
    /// fallback attribution at one of [`ATTRIBUTION_SWEEP`]'s settings.
    pub setting: String,
    /// Citations it gives over the answerable questions.
    pub citations: usize,
    /// Citations whose passage holds a gold answer.
    pub precision: f64,
    /// Answerable questions with at least one such citation.
    pub coverage: f64,
    /// `precision` on the second half of the questions only (held out when a setting is
    /// chosen on the first).
    pub held_out_precision: f64,
    /// `coverage` on the second half of the questions only.
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

/// Whether `text` contains one of the gold answers (case-insensitive, trimmed; empty gold
/// strings never match).
pub fn contains_answer(text: &str, golds: &[String]) -> bool {
    let text = text.to_lowercase();
    golds
        .iter()
        .any(|g| !g.trim().is_empty() && text.contains(&g.trim().to_lowercase()))
}

/// The chunks the query path retrieves for `question` (configured retrieval), as hits.
pub(super) async fn hits_of(
    engine: &docent::query::QueryEngine,
    question: &str,
) -> anyhow::Result<Vec<docent_ingest::store::Hit>> {
    let search = engine
        .search(docent::query::SearchRequest {
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
    engine: &std::sync::Arc<docent::query::QueryEngine>,
    data: &Dataset,
    n: usize,
    mode: docent::query::AnswerMode,
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
    let drafts_before = docent::query::generate::lookup::draft_counts();
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
pub(super) async fn answer_one(
    engine: &std::sync::Arc<docent::query::QueryEngine>,
    q: &QueryLine,
    mode: docent::query::AnswerMode,
    answerable: bool,
    golds: &[String],
) -> anyhow::Result<(docent::query::QueryResponse, AnswerRecord)> {
    let (response, first_text_ms, total_ms) = timed_answer(
        engine,
        docent::query::QueryRequest {
            question: q.text.clone(),
            generation: docent::query::GenerationOptions {
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
pub(super) struct Tally {
    pub(super) answerable: usize,
    pub(super) unanswerable: usize,
    pub(super) gold: usize,
    pub(super) refused_ok: usize,
    pub(super) refused_wrongly: usize,
    pub(super) citations: usize,
    pub(super) good_citations: usize,
    pub(super) covered: usize,
    /// Per setting (0 = the model's markers), per answerable question: (citations, good).
    pub(super) per_setting: Vec<Vec<(usize, usize)>>,
    /// Per type: (questions, answerable, gold, f1 sum, degenerate before, extractive,
    /// refused ok, refused wrongly, unanswerable).
    pub(super) types: BTreeMap<String, [f64; 9]>,
    pub(super) content_scores: Vec<(f32, bool)>,
    pub(super) f1_sum: f64,
    pub(super) answered: usize,
    pub(super) degenerate_before: usize,
    pub(super) degenerate_after: usize,
    pub(super) extractive: usize,
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
        response: &docent::query::QueryResponse,
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
            let is_extractive = response.mode == docent::query::AnswerMode::Extractive;
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
        engine: &docent::query::QueryEngine,
        response: &docent::query::QueryResponse,
        shown: bool,
        golds: &[String],
    ) -> anyhow::Result<()> {
        let shown: &[docent::query::postprocess::Citation] =
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
        engine: &docent::query::QueryEngine,
        response: &docent::query::QueryResponse,
        hits: &[docent_ingest::store::Hit],
        golds: &[String],
    ) -> anyhow::Result<()> {
        let texts: Vec<String> = hits.iter().map(|h| h.payload.text.clone()).collect();
        let good_block = |n: usize| texts.get(n - 1).is_some_and(|t| contains_answer(t, golds));
        let tally = |cits: &[docent::query::postprocess::Citation]| {
            (cits.len(), cits.iter().filter(|c| good_block(c.n)).count())
        };
        let (answer, model) = docent::query::postprocess::cite(&response.answer, hits);
        self.per_setting[0].push(tally(&model));
        let claims = docent::query::postprocess::claims(&answer);
        let support = engine.support(&claims, &texts).await?;
        for (i, &(add_at, drop_below)) in ATTRIBUTION_SWEEP.iter().enumerate() {
            let a = docent::query::postprocess::Attribution {
                add_at,
                drop_below,
                unsupported_below: 0.0,
            };
            let (_, cits) =
                docent::query::postprocess::attribute(&answer, &claims, &support, hits, a);
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
pub(super) fn generation_speed(
    records: &[AnswerRecord],
    before: (u64, u64, u64),
) -> GenerationSpeed {
    let drafts = docent::query::generate::lookup::draft_counts();
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
pub(super) fn attribution_rows(per_setting: &[Vec<(usize, usize)>]) -> Vec<AttributionRow> {
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
pub(super) fn type_rows(types: BTreeMap<String, [f64; 9]>) -> BTreeMap<String, TypeRow> {
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
