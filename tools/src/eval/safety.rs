//! `docent eval-injection` / `docent eval-pii`: the safety filter measured on labelled sets.
//!
//! Precision and recall of [`find_pii`] per kind on a labelled set.

use docent::query::safety::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// One example of the Presidio synthetic set (`synth_dataset_v2.json`).
#[derive(Debug, Deserialize)]
struct Example {
    full_text: String,
    spans: Vec<Span>,
}

#[derive(Debug, Deserialize)]
struct Span {
    entity_type: String,
    start_position: usize,
    end_position: usize,
}

/// The set's label for a kind (API keys are not labelled there).
fn label(kind: PiiKind) -> Option<&'static str> {
    Some(match kind {
        PiiKind::Email => "EMAIL_ADDRESS",
        PiiKind::Phone => "PHONE_NUMBER",
        PiiKind::CreditCard => "CREDIT_CARD",
        PiiKind::Iban => "IBAN_CODE",
        PiiKind::UsSsn => "US_SSN",
        PiiKind::IpAddress => "IP_ADDRESS",
        PiiKind::ApiKey => return None,
    })
}

/// One PII kind's figures on the labelled set.
#[derive(Debug, Clone, Serialize)]
pub struct KindScore {
    /// The kind.
    pub kind: PiiKind,
    /// Labelled entities of the kind.
    pub gold: usize,
    /// Matches reported as the kind.
    pub predicted: usize,
    /// Matches that overlap a labelled entity of the kind.
    pub true_positives: usize,
    /// Labelled entities that a match of the kind overlaps.
    pub found: usize,
    /// `true_positives` / `predicted`; 1 when nothing was predicted.
    pub precision: f64,
    /// `found` / `gold`; 1 when nothing is labelled.
    pub recall: f64,
}

/// What `docent eval-pii` measured: [`find_pii`] per kind on a Presidio-style set. Its
/// `Display` is the printed table.
#[derive(Debug, Clone, Serialize)]
pub struct PiiReport {
    /// Examples in the set.
    pub examples: usize,
    /// One row per kind the set labels (API keys are not labelled there).
    pub kinds: Vec<KindScore>,
}

/// Scores on a Presidio-style JSON file; a match counts when it overlaps a labelled
/// entity of its kind (entity-level overlap, as Presidio's evaluator does).
pub fn run(path: &Path) -> anyhow::Result<PiiReport> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let examples: Vec<Example> = serde_json::from_str(&text)?;
    let mut kinds = Vec::new();
    let found_all: Vec<Vec<PiiMatch>> = examples.iter().map(|e| find_pii(&e.full_text)).collect();
    for kind in PiiKind::ALL {
        let Some(label) = label(kind) else { continue };
        let (mut gold, mut predicted, mut tp, mut found) = (0, 0, 0, 0);
        for (e, matches) in examples.iter().zip(&found_all) {
            // the set counts characters; our matches are bytes
            let byte = |c: usize| {
                e.full_text
                    .char_indices()
                    .nth(c)
                    .map_or(e.full_text.len(), |(b, _)| b)
            };
            let spans: Vec<(usize, usize)> = e
                .spans
                .iter()
                .filter(|s| s.entity_type == label)
                .map(|s| (byte(s.start_position), byte(s.end_position)))
                .collect();
            let mine: Vec<&PiiMatch> = matches.iter().filter(|m| m.kind == kind).collect();
            let overlaps = |m: &PiiMatch, (s, e): (usize, usize)| m.start < e && s < m.end;
            gold += spans.len();
            predicted += mine.len();
            tp += mine
                .iter()
                .filter(|m| spans.iter().any(|&sp| overlaps(m, sp)))
                .count();
            found += spans
                .iter()
                .filter(|&&sp| mine.iter().any(|m| overlaps(m, sp)))
                .count();
        }
        kinds.push(KindScore {
            kind,
            gold,
            predicted,
            true_positives: tp,
            found,
            precision: if predicted == 0 {
                1.0
            } else {
                tp as f64 / predicted as f64
            },
            recall: if gold == 0 {
                1.0
            } else {
                found as f64 / gold as f64
            },
        });
    }
    Ok(PiiReport {
        examples: examples.len(),
        kinds,
    })
}

/// One category of one source, scored by the rules, the classifier, and both.
#[derive(Debug, Clone, Serialize)]
pub struct InjectionRow {
    /// `test split` or `eval only` (rows of `training/injection/dataset.jsonl`), or `held
    /// out` (written apart from the training data, `training/injection/heldout/`).
    pub source: String,
    /// The category: the data set's, or the held-out file's stem.
    pub category: String,
    /// 1: attacks, 0: benign texts.
    pub label: u8,
    /// Texts of this category and label.
    pub texts: usize,
    /// Share flagged by the rules alone (the detector before the classifier): detection
    /// for attacks, false positives for benign texts.
    pub rules: f64,
    /// Wilson 95 % interval of `rules`.
    pub rules_interval: (f64, f64),
    /// Share flagged by the classifier (the detector the service runs; the rules are among
    /// its features).
    pub classifier: f64,
    /// Wilson 95 % interval of `classifier`.
    pub classifier_interval: (f64, f64),
    /// Flagged by the classifier or the embedding head on the text's MiniLM vector (what
    /// the service does with a question; `None` when no embedder was given).
    pub as_question: Option<f64>,
    /// Wilson 95 % interval of `as_question`.
    pub as_question_interval: Option<(f64, f64)>,
}

/// What a rate of texts of `label` measures.
fn measures(label: u8) -> &'static str {
    if label == 1 {
        "detection"
    } else {
        "false positives"
    }
}

/// `12.5% [8.1, 18.7]`: `hits` of `n` with its Wilson 95 % interval.
pub fn rate_with_interval(hits: usize, n: usize) -> String {
    let (lo, hi) = wilson(hits, n);
    format!(
        "{:.1}% [{:.1}, {:.1}]",
        100.0 * hits as f64 / n.max(1) as f64,
        100.0 * lo,
        100.0 * hi
    )
}

/// The Wilson score interval (95 %) of `hits` out of `n`: where the true rate lies, given
/// the sample (a 75-text category is good to about ±10 points).
pub fn wilson(hits: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let z = 1.959_964f64;
    let (n, p) = (n as f64, hits as f64 / n as f64);
    let denom = 1.0 + z * z / n;
    let centre = (p + z * z / (2.0 * n)) / denom;
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// `docent eval-injection`: detection per attack category and false positives per benign
/// category, on texts no training or threshold choice saw, and the classifier's cost.
#[derive(Debug, Clone, Serialize)]
pub struct InjectionReport {
    /// The classifier's threshold (the model file's).
    pub threshold: f32,
    /// One row per source, category and label.
    pub rows: Vec<InjectionRow>,
    /// Mean classifier time per ordinary document chunk of the test split, in
    /// microseconds.
    pub us_per_chunk: f64,
    /// Mean classifier time per ordinary question of the test split, in microseconds.
    pub us_per_question: f64,
    /// Mean characters of those chunks.
    pub chunk_chars: f64,
}

#[derive(Deserialize)]
struct Labelled {
    text: String,
    label: u8,
    #[serde(default)]
    split: Option<String>,
    #[serde(default)]
    category: Option<String>,
}

/// A model file written by `docent train-injection`.
pub fn load_model(path: &Path) -> anyhow::Result<docent::query::safety::classifier::Model> {
    docent::query::safety::classifier::Model::from_bytes(&std::fs::read(path)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Labelled texts by (source, category).
type Sets = Vec<(String, String, Vec<Labelled>)>;

/// The test split and the evaluation-only rows of the data set, then the held-out files.
fn load_sets(dataset: &Path, heldout: &Path) -> anyhow::Result<Sets> {
    load_sets_with(dataset, heldout, false)
}

/// [`load_sets`], with the dev split first when `dev` (the second stage's cutoff is chosen
/// there).
fn load_sets_with(dataset: &Path, heldout: &Path, dev: bool) -> anyhow::Result<Sets> {
    let mut sets: Sets = Vec::new();
    let test: Vec<Labelled> = crate::eval::jsonl(dataset).map_err(|e| {
        anyhow::anyhow!("{e} (make it with: python3 training/injection/make_dataset.py)")
    })?;
    // the test split, then the sets kept for evaluation only (public sets, our QA
    // questions: never trained on, never used for the threshold)
    let mut by_cat: BTreeMap<(u8, String), Vec<Labelled>> = BTreeMap::new();
    for r in test {
        let order = match r.split.as_deref() {
            Some("dev") if dev => 0,
            Some("test") => 1,
            Some("eval") => 2,
            _ => continue,
        };
        let c = r.category.clone().unwrap_or_default();
        by_cat.entry((order, c)).or_default().push(r);
    }
    for ((order, c), rows) in by_cat {
        let source = match order {
            0 => "dev split",
            1 => "test split",
            _ => "eval only",
        };
        sets.push((source.into(), c, rows));
    }
    if heldout.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(heldout)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        files.sort();
        for f in files {
            let c = f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            sets.push(("held out".into(), c, crate::eval::jsonl(&f)?));
        }
    }
    Ok(sets)
}

/// `model`: a model file to score with instead of the one built in; `embedder`: the
/// retrieval model, to measure the embedding head ([`docent::query::safety::dense`]) beside
/// the classifier, as the service runs it on questions.
pub fn injection(
    dataset: &Path,
    heldout: &Path,
    model: Option<&Path>,
    embedder: Option<&docent_ingest::embed::Embedder>,
) -> anyhow::Result<InjectionReport> {
    use docent::query::safety::classifier::BUILTIN;
    let sets = load_sets(dataset, heldout)?;
    let loaded = model.map(load_model).transpose()?;
    let m = loaded.as_ref().unwrap_or(&*BUILTIN);
    let head = &*docent::query::safety::dense::BUILTIN;
    let mut rows = Vec::new();
    for (source, category, texts) in &sets {
        for label in [1u8, 0] {
            let of: Vec<&Labelled> = texts.iter().filter(|t| t.label == label).collect();
            if of.is_empty() {
                continue;
            }
            let (mut r, mut c, mut q) = (0usize, 0usize, 0usize);
            let vectors = match embedder {
                Some(e) => {
                    let mut all = Vec::with_capacity(of.len());
                    for batch in of.chunks(64) {
                        let refs: Vec<&str> = batch.iter().map(|t| t.text.as_str()).collect();
                        all.extend(e.embed_dense(&refs)?);
                    }
                    Some(all)
                }
                None => None,
            };
            for (i, t) in of.iter().enumerate() {
                r += usize::from(injection_score(&t.text).0 >= INJECTION_THRESHOLD);
                let flagged = m.score(&t.text) >= m.threshold;
                c += usize::from(flagged);
                let dense = vectors.as_ref().is_some_and(|v| head.flags(&v[i]));
                q += usize::from(flagged || dense);
            }
            let n = of.len() as f64;
            rows.push(InjectionRow {
                source: source.clone(),
                category: category.clone(),
                label,
                texts: of.len(),
                rules: r as f64 / n,
                rules_interval: wilson(r, of.len()),
                classifier: c as f64 / n,
                classifier_interval: wilson(c, of.len()),
                as_question: vectors.as_ref().map(|_| q as f64 / n),
                as_question_interval: vectors.as_ref().map(|_| wilson(q, of.len())),
            });
        }
    }
    // cost: the ordinary chunks and questions of the test split, each scored 5 times
    let pick = |cat: &str| -> Vec<&str> {
        sets.iter()
            .filter(|(s, c, _)| s == "test split" && c == cat)
            .flat_map(|(_, _, t)| t.iter().map(|l| l.text.as_str()))
            .collect()
    };
    let time = |texts: &[&str]| -> f64 {
        if texts.is_empty() {
            return 0.0;
        }
        let started = std::time::Instant::now();
        let mut sink = 0.0f32;
        for _ in 0..5 {
            for t in texts {
                sink += m.score(t);
            }
        }
        std::hint::black_box(sink);
        started.elapsed().as_secs_f64() * 1e6 / (5 * texts.len()) as f64
    };
    let chunks = pick("benign_chunk");
    let questions = pick("benign_question");
    let chunk_chars =
        chunks.iter().map(|t| t.chars().count()).sum::<usize>() as f64 / chunks.len().max(1) as f64;
    Ok(InjectionReport {
        threshold: m.threshold,
        us_per_chunk: time(&chunks),
        us_per_question: time(&questions),
        chunk_chars,
        rows,
    })
}

impl fmt::Display for InjectionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "prompt injection: rules alone (score >= {INJECTION_THRESHOLD}) and the classifier (p >= {:.3})",
            self.threshold
        )?;
        writeln!(
            f,
            "{:<11} {:<24} {:>6} {:>22} {:>10} {:>15} {:>24}  measures",
            "source",
            "category",
            "texts",
            "rules, 95 % interval",
            "classifier",
            "95 % interval",
            "+ embedding head (as questions)"
        )?;
        for r in &self.rows {
            let what = measures(r.label);
            let (lo, hi) = r.classifier_interval;
            let head = match (r.as_question, r.as_question_interval) {
                (Some(q), Some((lo, hi))) => {
                    format!("{:.1}% [{:.1}, {:.1}]", 100.0 * q, 100.0 * lo, 100.0 * hi)
                }
                _ => "-".into(),
            };
            writeln!(
                f,
                "{:<11} {:<24} {:>6} {:>22} {:>9.1}% {:>15} {:>24}  {what}",
                r.source,
                r.category,
                r.texts,
                format!(
                    "{:.1}% [{:.1}, {:.1}]",
                    100.0 * r.rules,
                    100.0 * r.rules_interval.0,
                    100.0 * r.rules_interval.1
                ),
                100.0 * r.classifier,
                format!("[{:.1}, {:.1}]", 100.0 * lo, 100.0 * hi),
                head,
            )?;
        }
        writeln!(
            f,
            "classifier cost: {:.0} us per chunk ({:.0} characters on average), {:.0} us per question",
            self.us_per_chunk, self.chunk_chars, self.us_per_question
        )
    }
}

/// One category with and without the second stage.
#[derive(Debug, Clone, Serialize)]
pub struct SecondStageRow {
    /// `dev split`, `test split`, `eval only` or `held out`, as in [`InjectionRow::source`].
    pub source: String,
    /// The category: the data set's, or the held-out file's stem.
    pub category: String,
    /// 1: attacks, 0: benign texts.
    pub label: u8,
    /// Texts of this category and label.
    pub texts: usize,
    /// Texts in the band, put to the model.
    pub asked: usize,
    /// Flagged by the classifier alone.
    pub before: usize,
    /// Flagged with the second stage at a "yes" of 0.5 or more.
    pub after_even: usize,
    /// Flagged with the second stage at the cutoff chosen on the dev split.
    pub after: usize,
}

/// The dev split at one "yes" cutoff.
#[derive(Debug, Clone, Serialize)]
pub struct CutoffRow {
    /// The cutoff on the model's probability of "yes" (a text is flagged at or above it).
    pub yes: f32,
    /// Dev attacks detected with the stage (all categories together).
    pub detected: f64,
    /// The most false positives the stage adds to one ordinary dev category.
    pub added_false_positives: f64,
}

/// `docent eval-injection --model-check BAND`: what the second stage adds, and what it costs
/// per text put to the model. The "yes" cutoff is chosen on the dev split
/// ([`choose_yes_cutoff`]); the test split, the held-out sets and the evaluation-only ones
/// are reported at it.
#[derive(Debug, Clone, Serialize)]
pub struct SecondStageReport {
    /// How far below the classifier's threshold a text's score may be for it to be asked
    /// of the model (`--model-check`).
    pub band: f32,
    /// Texts in another language than English were asked whatever their score.
    pub foreign: bool,
    /// The built-in classifier's threshold.
    pub threshold: f32,
    /// The cutoff chosen on dev (`None`: no cutoff keeps the ordinary texts within bounds).
    pub yes_cutoff: Option<f32>,
    /// The dev split at each of [`YES_CUTOFFS`].
    pub dev: Vec<CutoffRow>,
    /// One row per source, category and label.
    pub rows: Vec<SecondStageRow>,
    /// Texts put to the model, over every set.
    pub asked: usize,
    /// Median time per text put to the model, in ms.
    pub ms_per_ask_p50: f64,
    /// 95th-percentile time per text put to the model, in ms.
    pub ms_per_ask_p95: f64,
}

/// The cutoffs tried on dev.
pub const YES_CUTOFFS: [f32; 10] = [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999];
/// The ordinary texts whose false positives the stage must keep low (the goal's "natural
/// questions and ordinary document chunks", and e-mails to people).
const ORDINARY: [&str; 3] = ["benign_question", "benign_chunk", "benign_email"];
/// Ordinary questions in other languages, held to the same bound when the stage asks about
/// every foreign text (`--model-check-foreign`).
const FOREIGN_ORDINARY: &str = "benign_multilingual";
/// The most the stage may add to one ordinary dev category (half the goal's 1 %).
const MAX_ADDED_FALSE_POSITIVES: f64 = 0.005;

/// One text: its set, its label, whether the classifier flagged it, and the model's "yes"
/// when it was asked.
struct Judged {
    set: usize,
    label: u8,
    before: bool,
    yes: Option<f32>,
}

/// The lowest cutoff at which the stage adds at most [`MAX_ADDED_FALSE_POSITIVES`] to every
/// ordinary category of dev, with the dev table behind the choice.
fn choose_yes_cutoff(
    sets: &Sets,
    judged: &[Judged],
    ordinary: &[&str],
) -> (Option<f32>, Vec<CutoffRow>) {
    let dev = |j: &&Judged| sets[j.set].0 == "dev split";
    let mut table = Vec::new();
    let mut chosen = None;
    for yes in YES_CUTOFFS {
        let flags = |j: &Judged| j.before || j.yes.is_some_and(|y| y >= yes);
        let attacks: Vec<&Judged> = judged.iter().filter(dev).filter(|j| j.label == 1).collect();
        let detected =
            attacks.iter().filter(|j| flags(j)).count() as f64 / attacks.len().max(1) as f64;
        let mut worst = 0f64;
        for (i, (source, category, _)) in sets.iter().enumerate() {
            if source != "dev split" || !ordinary.contains(&category.as_str()) {
                continue;
            }
            let of: Vec<&Judged> = judged
                .iter()
                .filter(|j| j.set == i && j.label == 0)
                .collect();
            let added = of
                .iter()
                .filter(|j| !j.before && j.yes.is_some_and(|y| y >= yes))
                .count();
            worst = worst.max(added as f64 / of.len().max(1) as f64);
        }
        if chosen.is_none() && worst <= MAX_ADDED_FALSE_POSITIVES {
            chosen = Some(yes);
        }
        table.push(CutoffRow {
            yes,
            detected,
            added_false_positives: worst,
        });
    }
    (chosen, table)
}

/// Scores every dev, test, held-out and evaluation-only text with the built-in classifier;
/// those in the band below its threshold are asked of `generator` (the service's second
/// stage).
pub async fn second_stage(
    dataset: &Path,
    heldout: &Path,
    generator: &docent::query::generate::Generator,
    band: f32,
    foreign: bool,
) -> anyhow::Result<SecondStageReport> {
    use docent::query::safety::{classifier::BUILTIN, model_check_prompt, MODEL_CHECK_SYSTEM};
    let m = &*BUILTIN;
    let sets = load_sets_with(dataset, heldout, true)?;
    let mut judged = Vec::new();
    let mut ms = Vec::new();
    for (i, (_, _, texts)) in sets.iter().enumerate() {
        for t in texts {
            let (score, piece) = m.score_with_piece(&t.text);
            let before = score >= m.threshold;
            let asked = (band > 0.0 && score >= m.threshold - band)
                || (foreign && docent::query::safety::signals::foreign(&t.text));
            let yes = if !before && asked {
                let started = std::time::Instant::now();
                let yes = generator
                    .yes_probability(MODEL_CHECK_SYSTEM, &model_check_prompt(&piece))
                    .await?;
                ms.push(started.elapsed().as_secs_f64() * 1e3);
                Some(yes)
            } else {
                None
            };
            judged.push(Judged {
                set: i,
                label: t.label,
                before,
                yes,
            });
        }
    }
    // with every foreign text asked, questions in other languages count as ordinary too
    let mut ordinary = ORDINARY.to_vec();
    if foreign {
        ordinary.push(FOREIGN_ORDINARY);
    }
    let (yes_cutoff, dev) = choose_yes_cutoff(&sets, &judged, &ordinary);
    let mut rows = Vec::new();
    for (i, (source, category, _)) in sets.iter().enumerate() {
        for label in [1u8, 0] {
            let of: Vec<&Judged> = judged
                .iter()
                .filter(|j| j.set == i && j.label == label)
                .collect();
            if of.is_empty() {
                continue;
            }
            let at = |cut: Option<f32>| {
                of.iter()
                    .filter(|j| j.before || cut.is_some_and(|c| j.yes.is_some_and(|y| y >= c)))
                    .count()
            };
            rows.push(SecondStageRow {
                source: source.clone(),
                category: category.clone(),
                label,
                texts: of.len(),
                asked: of.iter().filter(|j| j.yes.is_some()).count(),
                before: at(None),
                after_even: at(Some(0.5)),
                after: at(yes_cutoff),
            });
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(SecondStageReport {
        band,
        foreign,
        threshold: m.threshold,
        yes_cutoff,
        dev,
        asked: ms.len(),
        ms_per_ask_p50: crate::eval::percentile(&ms, 50.0),
        ms_per_ask_p95: crate::eval::percentile(&ms, 95.0),
        rows,
    })
}

impl fmt::Display for SecondStageReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "second stage: texts scored in [{:.3}, {:.3}){} asked of the model ({} asked; {:.0} ms p50, {:.0} ms p95 each)",
            self.threshold - self.band,
            self.threshold,
            if self.foreign {
                ", and every text under the threshold in another language than English,"
            } else {
                ""
            },
            self.asked,
            self.ms_per_ask_p50,
            self.ms_per_ask_p95
        )?;
        writeln!(
            f,
            "dev split, per \"yes\" cutoff: attacks detected, and the most false positives added to one of {}{}:",
            ORDINARY.join(", "),
            if self.foreign {
                format!(", {FOREIGN_ORDINARY}")
            } else {
                String::new()
            }
        )?;
        for r in &self.dev {
            writeln!(
                f,
                "  yes >= {:<6} detected {:>5.1}%  added false positives {:>4.1}%",
                r.yes,
                100.0 * r.detected,
                100.0 * r.added_false_positives
            )?;
        }
        let cut = match self.yes_cutoff {
            Some(c) => format!("{c}"),
            None => "none (no cutoff keeps the ordinary texts within 0.5 %)".into(),
        };
        writeln!(f, "cutoff chosen on dev: yes >= {cut}")?;
        writeln!(
            f,
            "{:<11} {:<24} {:>6} {:>6} {:>22} {:>22} {:>22}  measures",
            "source",
            "category",
            "texts",
            "asked",
            "classifier",
            "stage, yes >= 0.5",
            "stage, chosen cutoff"
        )?;
        for r in &self.rows {
            let what = measures(r.label);
            let cell = |hits: usize| rate_with_interval(hits, r.texts);
            writeln!(
                f,
                "{:<11} {:<24} {:>6} {:>6} {:>22} {:>22} {:>22}  {what}",
                r.source,
                r.category,
                r.texts,
                r.asked,
                cell(r.before),
                cell(r.after_even),
                cell(r.after)
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for PiiReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "PII detection on {} examples (match = overlaps a labelled entity of its kind)",
            self.examples
        )?;
        writeln!(
            f,
            "{:<12} {:>6} {:>9} {:>9} {:>7}",
            "kind", "gold", "predicted", "precision", "recall"
        )?;
        for k in &self.kinds {
            writeln!(
                f,
                "{:<12} {:>6} {:>9} {:>9.3} {:>7.3}",
                k.kind.name(),
                k.gold,
                k.predicted,
                k.precision,
                k.recall
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod wilson_tests {
    use super::wilson;

    #[test]
    fn the_wilson_interval_matches_published_values() {
        // Newcombe (1998), "Two-sided confidence intervals for the single proportion",
        // method 3 on his examples: 81/263 -> 0.2553 to 0.3662; 15/148 -> 0.0624 to 0.1605
        let (lo, hi) = wilson(81, 263);
        assert!(
            (lo - 0.2553).abs() < 5e-4 && (hi - 0.3662).abs() < 5e-4,
            "{lo} {hi}"
        );
        let (lo, hi) = wilson(15, 148);
        assert!(
            (lo - 0.0624).abs() < 5e-4 && (hi - 0.1605).abs() < 5e-4,
            "{lo} {hi}"
        );
        // none of 100: [0, 0.0370]
        let (lo, hi) = wilson(0, 100);
        assert!(lo == 0.0 && (hi - 0.0370).abs() < 5e-4, "{hi}");
        assert_eq!(wilson(0, 0), (0.0, 1.0));
    }
}

#[cfg(test)]
mod cutoff_tests {
    use super::{choose_yes_cutoff, Judged, Labelled, Sets};

    fn set(source: &str, category: &str, n: usize, label: u8) -> (String, String, Vec<Labelled>) {
        let texts = (0..n)
            .map(|i| Labelled {
                text: format!("{category} {i}"),
                label,
                split: None,
                category: None,
            })
            .collect();
        (source.into(), category.into(), texts)
    }

    #[test]
    fn the_yes_cutoff_is_the_lowest_that_keeps_ordinary_dev_texts_within_bounds() {
        // dev: 200 ordinary questions, 10 attacks; held out: 100 questions
        let sets: Sets = vec![
            set("dev split", "benign_question", 200, 0),
            set("dev split", "direct", 10, 1),
            set("held out", "benign_question", 100, 0),
        ];
        let mut judged = Vec::new();
        // two dev questions asked, the model says yes at 0.65 and 0.92: at 0.6 the stage
        // adds 1 %, at 0.7 0.5 % (within the bound)
        for i in 0..200 {
            let yes = [0.65, 0.92].get(i).copied();
            judged.push(Judged {
                set: 0,
                label: 0,
                before: false,
                yes,
            });
        }
        // attacks: 4 flagged by the classifier, 6 asked with yes from 0.55 to 0.8
        for i in 0..10 {
            let yes = (i >= 4).then(|| 0.55 + 0.05 * (i - 4) as f32);
            judged.push(Judged {
                set: 1,
                label: 1,
                before: i < 4,
                yes,
            });
        }
        // held-out texts never move the choice, however the model answers them
        for _ in 0..100 {
            judged.push(Judged {
                set: 2,
                label: 0,
                before: false,
                yes: Some(0.99),
            });
        }
        let (chosen, table) = choose_yes_cutoff(&sets, &judged, &super::ORDINARY);
        assert_eq!(chosen, Some(0.7));
        let at = |y: f32| table.iter().find(|r| r.yes == y).expect("row");
        assert!((at(0.6).added_false_positives - 0.01).abs() < 1e-9);
        assert!((at(0.7).added_false_positives - 0.005).abs() < 1e-9);
        // at 0.7: the 4 flagged and the asked ones with yes >= 0.7 (0.70, 0.75, 0.80)
        assert!(
            (at(0.7).detected - 0.7).abs() < 1e-6,
            "{}",
            at(0.7).detected
        );
        assert!((at(0.5).detected - 1.0).abs() < 1e-9);
    }
}
