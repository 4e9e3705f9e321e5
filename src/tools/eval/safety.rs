//! `docent eval-injection` / `docent eval-pii`: the safety filter measured on labelled sets.
//!
//! Precision and recall of [`find_pii`] per kind on a labelled set.

use crate::query::safety::*;
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

#[derive(Debug, Clone, Serialize)]
pub struct KindScore {
    pub kind: PiiKind,
    /// Labelled entities of the kind.
    pub gold: usize,
    /// Matches reported as the kind.
    pub predicted: usize,
    /// Matches that overlap a labelled entity of the kind.
    pub true_positives: usize,
    /// Labelled entities that a match of the kind overlaps.
    pub found: usize,
    pub precision: f64,
    pub recall: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PiiReport {
    pub examples: usize,
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
    /// `test split` (of `training/injection/dataset.jsonl`) or `held out` (written apart
    /// from the training data, `training/injection/heldout/`).
    pub source: String,
    pub category: String,
    pub label: u8,
    pub texts: usize,
    /// Shares flagged (detection for attacks, false positives for benign texts): by the
    /// rules alone (the detector before the classifier), and by the classifier (the
    /// detector the service runs; the rules are among its features).
    pub rules: f64,
    pub classifier: f64,
    /// Wilson 95 % interval of `classifier`.
    pub classifier_interval: (f64, f64),
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
    pub threshold: f32,
    pub rows: Vec<InjectionRow>,
    /// Mean classifier time per ordinary document chunk and per question, microseconds.
    pub us_per_chunk: f64,
    pub us_per_question: f64,
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
pub fn load_model(path: &Path) -> anyhow::Result<crate::query::safety::classifier::Model> {
    crate::query::safety::classifier::Model::from_bytes(&std::fs::read(path)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Labelled texts by (source, category).
type Sets = Vec<(String, String, Vec<Labelled>)>;

/// The test split and the evaluation-only rows of the data set, then the held-out files.
fn load_sets(dataset: &Path, heldout: &Path) -> anyhow::Result<Sets> {
    let mut sets: Sets = Vec::new();
    let test: Vec<Labelled> = crate::tools::eval::jsonl(dataset).map_err(|e| {
        anyhow::anyhow!("{e} (make it with: python3 training/injection/make_dataset.py)")
    })?;
    // the test split, then the sets kept for evaluation only (public sets, our QA
    // questions: never trained on, never used for the threshold)
    let mut by_cat: BTreeMap<(u8, String), Vec<Labelled>> = BTreeMap::new();
    for r in test {
        let order = match r.split.as_deref() {
            Some("test") => 0,
            Some("eval") => 1,
            _ => continue,
        };
        let c = r.category.clone().unwrap_or_default();
        by_cat.entry((order, c)).or_default().push(r);
    }
    for ((order, c), rows) in by_cat {
        let source = if order == 0 {
            "test split"
        } else {
            "eval only"
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
            sets.push(("held out".into(), c, crate::tools::eval::jsonl(&f)?));
        }
    }
    Ok(sets)
}

/// `model`: a model file to score with instead of the one built in.
pub fn injection(
    dataset: &Path,
    heldout: &Path,
    model: Option<&Path>,
) -> anyhow::Result<InjectionReport> {
    use crate::query::safety::classifier::BUILTIN;
    let sets = load_sets(dataset, heldout)?;
    let loaded = model.map(load_model).transpose()?;
    let m = loaded.as_ref().unwrap_or(&*BUILTIN);
    let mut rows = Vec::new();
    for (source, category, texts) in &sets {
        for label in [1u8, 0] {
            let of: Vec<&Labelled> = texts.iter().filter(|t| t.label == label).collect();
            if of.is_empty() {
                continue;
            }
            let (mut r, mut c) = (0usize, 0usize);
            for t in &of {
                r += usize::from(injection_score(&t.text).0 >= INJECTION_THRESHOLD);
                c += usize::from(m.score(&t.text) >= m.threshold);
            }
            let n = of.len() as f64;
            rows.push(InjectionRow {
                source: source.clone(),
                category: category.clone(),
                label,
                texts: of.len(),
                rules: r as f64 / n,
                classifier: c as f64 / n,
                classifier_interval: wilson(c, of.len()),
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
            "{:<11} {:<24} {:>6} {:>8} {:>10} {:>15}  measures",
            "source", "category", "texts", "rules", "classifier", "95 % interval"
        )?;
        for r in &self.rows {
            let what = measures(r.label);
            let (lo, hi) = r.classifier_interval;
            writeln!(
                f,
                "{:<11} {:<24} {:>6} {:>7.1}% {:>9.1}% {:>15}  {what}",
                r.source,
                r.category,
                r.texts,
                100.0 * r.rules,
                100.0 * r.classifier,
                format!("[{:.1}, {:.1}]", 100.0 * lo, 100.0 * hi),
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
    pub source: String,
    pub category: String,
    pub label: u8,
    pub texts: usize,
    /// Texts in the band, put to the model.
    pub asked: usize,
    /// Flagged by the classifier alone, and with the second stage.
    pub before: usize,
    pub after: usize,
}

/// `docent eval-injection --model-check BAND`: what the second stage adds on the held-out
/// sets and the evaluation-only ones, and what it costs per question put to the model.
#[derive(Debug, Clone, Serialize)]
pub struct SecondStageReport {
    pub band: f32,
    pub threshold: f32,
    pub rows: Vec<SecondStageRow>,
    pub asked: usize,
    pub ms_per_ask_p50: f64,
    pub ms_per_ask_p95: f64,
}

/// Scores every held-out and evaluation-only text with the built-in classifier; those in
/// the band below its threshold are asked of `generator` (the service's second stage).
pub async fn second_stage(
    dataset: &Path,
    heldout: &Path,
    generator: &crate::query::generate::Generator,
    band: f32,
) -> anyhow::Result<SecondStageReport> {
    use crate::query::safety::{classifier::BUILTIN, model_check_prompt, MODEL_CHECK_SYSTEM};
    let m = &*BUILTIN;
    let sets = load_sets(dataset, heldout)?;
    let mut rows = Vec::new();
    let mut ms = Vec::new();
    for (source, category, texts) in sets.iter().filter(|(s, _, _)| s != "test split") {
        for label in [1u8, 0] {
            let of: Vec<&Labelled> = texts.iter().filter(|t| t.label == label).collect();
            if of.is_empty() {
                continue;
            }
            let mut row = SecondStageRow {
                source: source.clone(),
                category: category.clone(),
                label,
                texts: of.len(),
                asked: 0,
                before: 0,
                after: 0,
            };
            for t in of {
                let (score, piece) = m.score_with_piece(&t.text);
                if score >= m.threshold {
                    row.before += 1;
                    row.after += 1;
                } else if score >= m.threshold - band {
                    let started = std::time::Instant::now();
                    let yes = generator
                        .yes_probability(MODEL_CHECK_SYSTEM, &model_check_prompt(&piece))
                        .await?;
                    ms.push(started.elapsed().as_secs_f64() * 1e3);
                    row.asked += 1;
                    row.after += usize::from(yes >= 0.5);
                }
            }
            rows.push(row);
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(SecondStageReport {
        band,
        threshold: m.threshold,
        asked: ms.len(),
        ms_per_ask_p50: crate::tools::eval::percentile(&ms, 50.0),
        ms_per_ask_p95: crate::tools::eval::percentile(&ms, 95.0),
        rows,
    })
}

impl fmt::Display for SecondStageReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "second stage: texts scored in [{:.3}, {:.3}) asked of the model ({} asked; {:.0} ms p50, {:.0} ms p95 each)",
            self.threshold - self.band,
            self.threshold,
            self.asked,
            self.ms_per_ask_p50,
            self.ms_per_ask_p95
        )?;
        writeln!(
            f,
            "{:<11} {:<24} {:>6} {:>6} {:>22} {:>22}  measures",
            "source", "category", "texts", "asked", "classifier", "with second stage"
        )?;
        for r in &self.rows {
            let what = measures(r.label);
            let cell = |hits: usize| rate_with_interval(hits, r.texts);
            writeln!(
                f,
                "{:<11} {:<24} {:>6} {:>6} {:>22} {:>22}  {what}",
                r.source,
                r.category,
                r.texts,
                r.asked,
                cell(r.before),
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
