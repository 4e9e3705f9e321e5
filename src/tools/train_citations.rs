//! `docent train-citations`: measures which signal tells a citation the model wrote whose
//! passage does not hold the answer (issue 54, item 4), on our own data only.
//!
//! 1. **Answers**: the refusal probe's examples as retrieved
//!    (`training/refusal/examples.jsonl`, our own questions over the Rust Book, the RFCs and
//!    encyclo-factoid's dev half, with the passages the query path retrieves) answered by
//!    the model greedily through the service's templates, reading the hidden state of every
//!    layer at each generated token (vendor/PATCHES.md 22). Kept with every citation marker's
//!    state, at the token that completed the marker, in the model cache (`--extract` redoes
//!    them).
//! 2. **Labels**: a citation is good when its passage holds a gold answer (the evaluation's
//!    definition of citation precision).
//! 3. **Signals** on the dev split (one question in five, by its id, as for the refusal
//!    probe), each fitted on train: a linear probe on the marker's state at each layer; the
//!    support check the answer path has (the share of the claim's content words in the passage
//!    with the cosine of their embeddings); both together. Printed: each one's dev AUROC and
//!    the precision and coverage of the model's own markers when those below a threshold are
//!    dropped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::query::generate::probe::{self, Labelled};
use crate::query::generate::steps::{self, StepReader};
use crate::query::generate::{Generator, Params};
use crate::server::startup;
use crate::tools::eval::{contains_answer, Dataset};
use crate::tools::train_refusal::{self as refusal, Example, States};

/// One citation marker the model wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Marker {
    /// The example's id (`<question>/retrieved`).
    pub example: String,
    pub split: String,
    /// The cited passage (1-based).
    pub n: usize,
    /// Its passage holds a gold answer.
    pub good: bool,
    /// The support check's score of the claim sentence against the cited passage.
    pub support: f32,
    /// The passages of the example hold a gold answer (the question counts for coverage).
    pub answerable: bool,
    pub claim: String,
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub questions: PathBuf,
    pub encyclo: Option<PathBuf>,
    pub examples: PathBuf,
    pub max_tokens: usize,
    pub extract: bool,
    pub c: f64,
}

/// One signal's result on dev.
#[derive(Debug, Clone, Serialize)]
pub struct SignalRow {
    pub signal: String,
    pub auroc: f64,
    /// (threshold on the probability of a bad citation, precision, coverage, citations kept)
    pub curve: Vec<(f64, f64, f64, usize)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub answers: usize,
    pub markers: usize,
    pub train: usize,
    pub dev: usize,
    pub dev_good: usize,
    /// Dev questions whose passages hold the answer.
    pub dev_answerable: usize,
    pub rows: Vec<SignalRow>,
}

/// Gold answers by question id: our questions' and encyclo-factoid's.
fn golds(settings: &Settings) -> anyhow::Result<HashMap<String, Vec<String>>> {
    #[derive(Deserialize)]
    struct Q {
        id: String,
        #[serde(default)]
        answer: Option<String>,
    }
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for q in refusal::read_jsonl::<Q>(&settings.questions)? {
        out.insert(q.id, q.answer.into_iter().collect());
    }
    if let Some(dir) = &settings.encyclo {
        for (id, _, _, answers) in Dataset::load(dir)?.questions() {
            out.insert(id, answers);
        }
    }
    Ok(out)
}

/// The markers of `answer` with their end offsets and claim sentences, in order.
fn markers_of(answer: &str) -> Vec<(usize, usize, String)> {
    let re = regex::Regex::new(r"\[(\d+)\]").expect("marker pattern");
    let mut out = Vec::new();
    for claim in crate::query::postprocess::claims(answer) {
        for m in re.captures_iter(&answer[claim.start..claim.end]) {
            let (Some(whole), Ok(n)) = (m.get(0), m[1].parse::<usize>()) else {
                continue;
            };
            if claim.markers.contains(&n) {
                out.push((claim.start + whole.end(), n, claim.text.clone()));
            }
        }
    }
    out
}

/// Step 1 and 2: every example answered, its markers with their states (every layer) and
/// support.
async fn answer_all(
    config: &Config,
    generator: &Generator,
    examples: &[&Example],
    golds: &HashMap<String, Vec<String>>,
    max_tokens: usize,
) -> anyhow::Result<(Vec<Marker>, States, usize)> {
    let prompts = startup::prompts(config)?;
    let embedder = startup::embedder(config)?;
    let bar = indicatif::ProgressBar::new(examples.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} answers, {eta} left")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (mut markers, mut values) = (Vec::new(), Vec::new());
    let mut answers = 0;
    for e in examples {
        bar.inc(1);
        let question = e.id.split('/').next().unwrap_or(&e.id);
        let gold = golds.get(question).cloned().unwrap_or_default();
        let prompt = refusal::prompt_of(&prompts, config.safety.spotlight, e)?;
        let reader = std::sync::Arc::new(StepReader::new(Vec::new()));
        let generation = generator
            .chat_reading(&prompt, &Params::greedy(max_tokens), reader.clone())
            .await?;
        answers += 1;
        let text = &generation.text;
        let found = markers_of(text);
        if found.is_empty() {
            continue;
        }
        let steps = reader.steps();
        let ends: Vec<usize> = found.iter().map(|m| m.0).collect();
        let decode = |ids: &[u32]| generator.decode(ids);
        let states = steps::marker_states(&steps, &ends, &decode);
        let claims: Vec<&str> = found.iter().map(|m| m.2.as_str()).collect();
        let passages: Vec<&str> = e.passages.iter().map(|p| p.text.as_str()).collect();
        let texts: Vec<&str> = claims.iter().chain(&passages).copied().collect();
        let vectors = embedder.embed_dense(&texts)?;
        let (cv, pv) = vectors.split_at(claims.len());
        let answerable = e.passages.iter().any(|p| contains_answer(&p.text, &gold));
        for (i, ((_, n, claim), state)) in found.iter().zip(states).enumerate() {
            let (Some(state), Some(passage)) = (state, e.passages.get(n.wrapping_sub(1))) else {
                continue;
            };
            let support = (crate::query::postprocess::lexical_support(claim, &passage.text)
                + crate::query::embed::cosine(&cv[i], &pv[n - 1]))
                / 2.0;
            markers.push(Marker {
                example: e.id.clone(),
                split: e.split.clone(),
                n: *n,
                good: contains_answer(&passage.text, &gold),
                support,
                answerable,
                claim: claim.clone(),
            });
            values.push(state.clone());
        }
    }
    bar.finish_and_clear();
    let layers = values.first().map_or(0, Vec::len);
    let hidden = values.first().and_then(|v| v.first()).map_or(0, Vec::len);
    Ok((
        markers,
        States {
            layers: (0..layers).collect(),
            hidden,
            values,
        },
        answers,
    ))
}

/// Precision and coverage of the dev markers kept (`p_bad` below `t`), and how many.
fn decide(dev: &[(&Marker, f64)], answerable: &[&str], t: f64) -> (f64, f64, usize) {
    let kept: Vec<&(&Marker, f64)> = dev.iter().filter(|(_, p)| *p < t).collect();
    let good = kept.iter().filter(|(m, _)| m.good).count();
    let covered = answerable
        .iter()
        .filter(|q| kept.iter().any(|(m, _)| m.good && m.example == **q))
        .count();
    (
        if kept.is_empty() {
            1.0
        } else {
            good as f64 / kept.len() as f64
        },
        covered as f64 / answerable.len().max(1) as f64,
        kept.len(),
    )
}

fn row(signal: String, dev: &[(&Marker, f64)], answerable: &[&str]) -> SignalRow {
    let auroc = probe::auroc(&dev.iter().map(|(m, p)| (*p, !m.good)).collect::<Vec<_>>());
    let curve = [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, f64::INFINITY]
        .iter()
        .map(|&t| {
            let (p, c, k) = decide(dev, answerable, t);
            (t, p, c, k)
        })
        .collect();
    SignalRow {
        signal,
        auroc,
        curve,
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// A probe's probability of a bad citation for `state`.
fn apply(weights: &[f32], bias: f32, state: &[f32]) -> f64 {
    sigmoid(
        state
            .iter()
            .zip(weights)
            .map(|(&s, &w)| s as f64 * w as f64)
            .sum::<f64>()
            + bias as f64,
    )
}

/// Step 3: every signal fitted on train, measured on dev.
pub fn sweep(markers: &[Marker], states: &States, c: f64) -> Report {
    let is_dev = |m: &Marker| m.split == "dev";
    let mut answerable: Vec<&str> = markers
        .iter()
        .filter(|m| is_dev(m) && m.answerable)
        .map(|m| m.example.as_str())
        .collect();
    answerable.sort_unstable();
    answerable.dedup();
    let mut rows = Vec::new();
    let dev_of = |score: &dyn Fn(usize) -> f64| -> Vec<(&Marker, f64)> {
        markers
            .iter()
            .enumerate()
            .filter(|(_, m)| is_dev(m))
            .map(|(i, m)| (m, score(i)))
            .collect()
    };
    rows.push(row(
        "none (every marker kept)".into(),
        &dev_of(&|_| 0.0),
        &answerable,
    ));
    // the support check: its probability of a bad citation by a 1-D logistic fit on train
    let train_support: Vec<(f64, bool)> = markers
        .iter()
        .filter(|m| !is_dev(m))
        .map(|m| (m.support as f64, !m.good))
        .collect();
    let (a, b) = probe::logistic_1d(&train_support);
    rows.push(row(
        "support check (words + embedding)".into(),
        &dev_of(&|i| sigmoid(a * markers[i].support as f64 + b)),
        &answerable,
    ));
    let mut best: Option<(f64, usize)> = None;
    for (li, &layer) in states.layers.iter().enumerate() {
        let train: Vec<Labelled<'_>> = markers
            .iter()
            .zip(&states.values)
            .filter(|(m, _)| !is_dev(m))
            .map(|(m, v)| Labelled {
                state: &v[li],
                refuse: !m.good,
            })
            .collect();
        let Some((w, bias)) = probe::fit_logistic(&train, c) else {
            continue;
        };
        let r = row(
            format!("state probe, layer {layer}"),
            &dev_of(&|i| apply(&w, bias, &states.values[i][li])),
            &answerable,
        );
        if best.is_none_or(|(a, _)| r.auroc > a) {
            best = Some((r.auroc, li));
        }
        rows.push(r);
    }
    // both: the best layer's probe logit and the support, in one logistic regression
    if let Some((_, li)) = best {
        let train: Vec<Labelled<'_>> = markers
            .iter()
            .zip(&states.values)
            .filter(|(m, _)| !is_dev(m))
            .map(|(m, v)| Labelled {
                state: &v[li],
                refuse: !m.good,
            })
            .collect();
        if let Some((w, bias)) = probe::fit_logistic(&train, c) {
            let features: Vec<Vec<f32>> = markers
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let p = apply(&w, bias, &states.values[i][li]).clamp(1e-6, 1.0 - 1e-6);
                    vec![(p / (1.0 - p)).ln() as f32, m.support]
                })
                .collect();
            let train: Vec<Labelled<'_>> = markers
                .iter()
                .zip(&features)
                .filter(|(m, _)| !is_dev(m))
                .map(|(m, f)| Labelled {
                    state: f,
                    refuse: !m.good,
                })
                .collect();
            if let Some((w2, b2)) = probe::fit_logistic(&train, 1.0) {
                rows.push(row(
                    format!("state probe (layer {}) + support check", states.layers[li]),
                    &dev_of(&|i| apply(&w2, b2, &features[i])),
                    &answerable,
                ));
            }
        }
    }
    let dev: Vec<&Marker> = markers.iter().filter(|m| is_dev(m)).collect();
    Report {
        answers: 0,
        markers: markers.len(),
        train: markers.len() - dev.len(),
        dev: dev.len(),
        dev_good: dev.iter().filter(|m| m.good).count(),
        dev_answerable: answerable.len(),
        rows,
    }
}

/// Answers (from the cache unless `--extract`), then the sweep.
pub async fn run(config: &Config, settings: &Settings) -> anyhow::Result<Report> {
    let examples: Vec<Example> = refusal::read_jsonl(&settings.examples)
        .with_context(|| format!("reading {}", settings.examples.display()))?;
    let retrieved: Vec<&Example> = examples
        .iter()
        .filter(|e| e.variant == "retrieved")
        .collect();
    let model = config.generation.model.display().to_string();
    let stem = model.rsplit('/').next().unwrap_or(&model).to_string();
    let text = std::fs::read(&settings.examples)?;
    let key = refusal::fnv_bytes(&text) ^ settings.max_tokens as u64;
    let dir = refusal::states_cache();
    let states_path = dir.join(format!("{stem}-citations-{key:016x}.states"));
    let markers_path = dir.join(format!("{stem}-citations-{key:016x}.jsonl"));
    let (markers, states, answers) =
        if settings.extract || !states_path.is_file() || !markers_path.is_file() {
            let generator = Generator::load(&config.generation).await?;
            let golds = golds(settings)?;
            let (markers, states, answers) =
                answer_all(config, &generator, &retrieved, &golds, settings.max_tokens).await?;
            let sha = probe::file_sha256(&crate::query::generate::catalog::resolve(
                &config.generation.model,
            ))?;
            std::fs::create_dir_all(&dir)?;
            states.write(&states_path, &sha)?;
            write_jsonl(&markers_path, &markers)?;
            (markers, states, answers)
        } else {
            let (states, _) = States::read(&states_path)?;
            let markers: Vec<Marker> = refusal::read_jsonl(&markers_path)?;
            (markers, states, retrieved.len())
        };
    let mut report = sweep(&markers, &states, settings.c);
    report.answers = answers;
    Ok(report)
}

fn write_jsonl<T: Serialize>(path: &Path, rows: &[T]) -> anyhow::Result<()> {
    let mut out = String::new();
    for r in rows {
        out.push_str(&serde_json::to_string(r)?);
        out.push('\n');
    }
    std::fs::write(path, out)?;
    Ok(())
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} answers, {} citation markers (train {}, dev {}: {} good); {} dev questions whose passages hold the answer",
            self.answers, self.markers, self.train, self.dev, self.dev_good, self.dev_answerable
        )?;
        for r in &self.rows {
            write!(f, "{:<44} dev AUROC {:.3} |", r.signal, r.auroc)?;
            for (t, p, c, k) in &r.curve {
                if t.is_finite() {
                    write!(f, " <{t}: {:.1}/{:.1} ({k})", 100.0 * p, 100.0 * c)?;
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_with_their_claims_and_ends() {
        let a = "Cargo builds it [1]. It also tests it [2][3]. No marker here.";
        let m = markers_of(a);
        assert_eq!(
            m.iter().map(|x| x.1).collect::<Vec<_>>(),
            vec![1, 2, 3],
            "{m:?}"
        );
        assert_eq!(&a[..m[0].0], "Cargo builds it [1]");
        assert_eq!(&a[..m[2].0], "Cargo builds it [1]. It also tests it [2][3]");
        assert!(m[1].2.contains("tests it"));
    }

    #[test]
    fn dropping_below_a_threshold_trades_coverage_for_precision() {
        let mk = |ex: &str, good: bool| Marker {
            example: ex.into(),
            split: "dev".into(),
            n: 1,
            good,
            support: 0.0,
            answerable: true,
            claim: String::new(),
        };
        let (a, b, c) = (mk("q1", true), mk("q1", false), mk("q2", true));
        let dev = vec![(&a, 0.1), (&b, 0.8), (&c, 0.6)];
        assert_eq!(
            decide(&dev, &["q1", "q2"], f64::INFINITY),
            (2.0 / 3.0, 1.0, 3)
        );
        assert_eq!(decide(&dev, &["q1", "q2"], 0.7), (1.0, 1.0, 2));
        assert_eq!(decide(&dev, &["q1", "q2"], 0.5), (1.0, 0.5, 1));
    }
}
