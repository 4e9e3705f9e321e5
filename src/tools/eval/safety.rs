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

/// `model`: a model file to score with instead of the one built in.
pub fn injection(
    dataset: &Path,
    heldout: &Path,
    model: Option<&Path>,
) -> anyhow::Result<InjectionReport> {
    use crate::query::safety::classifier::BUILTIN;
    let mut sets: Vec<(String, String, Vec<Labelled>)> = Vec::new();
    let test: Vec<Labelled> = crate::tools::eval::jsonl(dataset).map_err(|e| {
        anyhow::anyhow!("{e} (make it with: python3 training/injection/make_dataset.py)")
    })?;
    let mut by_cat: BTreeMap<String, Vec<Labelled>> = BTreeMap::new();
    for r in test {
        if r.split.as_deref() == Some("test") {
            let c = r.category.clone().unwrap_or_default();
            by_cat.entry(c).or_default().push(r);
        }
    }
    for (c, rows) in by_cat {
        sets.push(("test split".into(), c, rows));
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
            "{:<11} {:<22} {:>6} {:>8} {:>10}  measures",
            "source", "category", "texts", "rules", "classifier"
        )?;
        for r in &self.rows {
            let what = if r.label == 1 {
                "detection"
            } else {
                "false positives"
            };
            writeln!(
                f,
                "{:<11} {:<22} {:>6} {:>7.1}% {:>9.1}%  {what}",
                r.source,
                r.category,
                r.texts,
                100.0 * r.rules,
                100.0 * r.classifier,
            )?;
        }
        writeln!(
            f,
            "classifier cost: {:.0} us per chunk ({:.0} characters on average), {:.0} us per question",
            self.us_per_chunk, self.chunk_chars, self.us_per_question
        )
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
