//! `docent eval-injection` / `docent eval-pii`: the safety filter measured on labelled sets.
//!
//! Precision and recall of [`find_pii`] per kind on a labelled set.

use crate::query::safety::*;
use serde::{Deserialize, Serialize};
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

/// Detection on a labelled set (`{"text", "label"}` lines, 1 = injection) and false
/// positives on ordinary questions (BEIR `queries.jsonl`), at several thresholds.
#[derive(Debug, Clone, Serialize)]
pub struct InjectionReport {
    pub labelled: String,
    pub injections: usize,
    pub benign: usize,
    pub questions: String,
    pub ordinary: usize,
    /// (threshold, detection rate, false-positive rate on the set's benign texts,
    /// false-positive rate on the ordinary questions)
    pub rows: Vec<(f32, f64, f64, f64)>,
}

pub fn injection(
    labelled: &Path,
    questions: &Path,
    limit: usize,
) -> anyhow::Result<InjectionReport> {
    #[derive(Deserialize)]
    struct Row {
        text: String,
        label: u8,
    }
    let rows: Vec<Row> = crate::tools::eval::jsonl(labelled)?;
    let mut ordinary = crate::tools::eval::questions(questions)?;
    ordinary.truncate(limit);
    let scored: Vec<(f32, u8)> = rows
        .iter()
        .map(|r| (injection_score(&r.text).0, r.label))
        .collect();
    let ordinary_scores: Vec<f32> = ordinary.iter().map(|q| injection_score(q).0).collect();
    let injections = scored.iter().filter(|(_, l)| *l == 1).count();
    let benign = scored.len() - injections;
    let rate = |hits: usize, n: usize| if n == 0 { 0.0 } else { hits as f64 / n as f64 };
    let rows = [0.5f32, 1.0, 1.5, 2.0]
        .iter()
        .map(|&th| {
            let tp = scored.iter().filter(|(s, l)| *l == 1 && *s >= th).count();
            let fp = scored.iter().filter(|(s, l)| *l == 0 && *s >= th).count();
            let ofp = ordinary_scores.iter().filter(|s| **s >= th).count();
            (
                th,
                rate(tp, injections),
                rate(fp, benign),
                rate(ofp, ordinary.len()),
            )
        })
        .collect();
    Ok(InjectionReport {
        labelled: labelled.display().to_string(),
        injections,
        benign,
        questions: questions.display().to_string(),
        ordinary: ordinary.len(),
        rows,
    })
}

impl fmt::Display for InjectionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "prompt injection: {} ({} injections, {} benign); ordinary questions: {} ({})",
            self.labelled, self.injections, self.benign, self.questions, self.ordinary
        )?;
        writeln!(
            f,
            "{:>9} {:>9} {:>12} {:>14}",
            "threshold", "detection", "FP (benign)", "FP (questions)"
        )?;
        for (th, d, fp, ofp) in &self.rows {
            let mark = if (*th - INJECTION_THRESHOLD).abs() < 1e-6 {
                " (default)"
            } else {
                ""
            };
            writeln!(f, "{th:>9.1} {d:>9.3} {fp:>12.3} {ofp:>14.3}{mark}")?;
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
