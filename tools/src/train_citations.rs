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

use crate::eval::{contains_answer, Dataset};
use crate::train_refusal::{self as refusal, Example, States};
use docent::config::Config;
use docent::query::generate::probe::{self, Labelled};
use docent::query::generate::steps::{self, StepReader};
use docent::query::generate::{Generator, Params};
use docent::server::startup;

/// One answer with what the sweep needs of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Answer {
    /// The example's id (`<question>/retrieved`).
    pub example: String,
    /// The example's split: `train` or `dev`.
    pub split: String,
    /// The model's text, as generated.
    pub text: String,
    /// Per passage: it holds a gold answer.
    pub good_passages: Vec<bool>,
    /// The refusal probe's score at the prompt (the service refuses at its threshold).
    pub refusal: Option<f32>,
    /// The markers the model wrote: (end offset in `text`, passage n, index of its states in
    /// the states file, when the step gave them).
    pub markers: Vec<(usize, usize, Option<usize>)>,
    /// Per claim sentence of `text` ([`docent::query::postprocess::claims`]): the index of
    /// the states at its last token before its markers (where the model decides to cite).
    #[serde(default)]
    pub claims: Vec<Option<usize>>,
}

impl Answer {
    /// The passages hold a gold answer: the question counts for coverage.
    pub fn answerable(&self) -> bool {
        self.good_passages.iter().any(|&g| g)
    }

    fn good(&self, n: usize) -> bool {
        n >= 1 && self.good_passages.get(n - 1).copied().unwrap_or(false)
    }
}

/// `docent train-citations`' settings (its flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Our questions (`training/refusal/questions.jsonl`), for their gold answers.
    pub questions: PathBuf,
    /// encyclo-factoid's folder, for its dev half's gold answers; `None` for none.
    pub encyclo: Option<PathBuf>,
    /// The refusal probe's examples (`training/refusal/examples.jsonl`); the `retrieved`
    /// ones are answered.
    pub examples: PathBuf,
    /// Tokens per answer.
    pub max_tokens: usize,
    /// Answer again instead of reading the answers and states kept in the model cache.
    pub extract: bool,
    /// The logistic probes' C (inverse L2 penalty).
    pub c: f64,
}

/// One way of citing, measured on dev.
#[derive(Debug, Clone, Serialize)]
pub struct SignalRow {
    /// The way of citing, in words.
    pub setting: String,
    /// Citations it gives over dev's shown answers.
    pub citations: usize,
    /// Citations whose passage holds a gold answer.
    pub precision: f64,
    /// Answerable answers (their passages hold a gold answer) with at least one such
    /// citation.
    pub coverage: f64,
}

/// What `docent train-citations` measured. Its `Display` is the printed report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Examples answered.
    pub answers: usize,
    /// Answers with a marker the model wrote.
    pub answers_with_markers: usize,
    /// The markers the model wrote that have a state: (train, dev).
    pub markers: (usize, usize),
    /// Dev AUROC of the support check, for telling the model's markers whose passage lacks
    /// the answer.
    pub support_auroc: f64,
    /// The same for the best layer's probe on the marker's state: (layer, dev AUROC);
    /// `None` when no probe could be fitted.
    pub probe_auroc: Option<(usize, f64)>,
    /// Claim sentences worth attributing that have a state: (train, dev).
    pub claims: (usize, usize),
    /// The best layer's claim probe (whether a sentence's best-supported passage lacks the
    /// answer): (layer, dev AUROC); `None` when none could be fitted.
    pub claim_probe_auroc: Option<(usize, f64)>,
    /// Dev answers shown (not refused by the refusal probe).
    pub dev_shown: usize,
    /// Of them, answers whose passages hold a gold answer.
    pub dev_answerable: usize,
    /// The ways of citing, measured on those dev answers.
    pub rows: Vec<SignalRow>,
}

/// Gold answers by question id: our questions' and encyclo-factoid's.
fn golds(settings: &Settings) -> anyhow::Result<HashMap<String, Vec<String>>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for q in refusal::read_jsonl::<refusal::Question>(&settings.questions)? {
        out.insert(q.id, q.answer.into_iter().collect());
    }
    if let Some(dir) = &settings.encyclo {
        for (id, _, _, answers) in Dataset::load(dir)?.questions() {
            out.insert(id, answers);
        }
    }
    Ok(out)
}

/// The markers of `answer` with their end offsets, in order.
fn markers_of(answer: &str) -> Vec<(usize, usize)> {
    let re = regex::Regex::new(r"\[(\d+)\]").expect("marker pattern");
    let mut out = Vec::new();
    for claim in docent::query::postprocess::claims(answer) {
        for m in re.captures_iter(&answer[claim.start..claim.end]) {
            let (Some(whole), Ok(n)) = (m.get(0), m[1].parse::<usize>()) else {
                continue;
            };
            if claim.markers.contains(&n) {
                out.push((claim.start + whole.end(), n));
            }
        }
    }
    out
}

/// Where each claim of `answer` ends before its markers and trailing blanks.
fn claim_ends(answer: &str) -> Vec<usize> {
    let re = regex::Regex::new(r" ?\[\d+\]").expect("marker pattern");
    docent::query::postprocess::claims(answer)
        .iter()
        .map(|c| {
            let seg = &answer[c.start..c.end];
            let body = re.find(seg).map_or(seg, |m| &seg[..m.start()]);
            c.start + body.trim_end().len()
        })
        .collect()
}

/// Every example answered as the service would (greedy, the service's templates), with
/// the states of every layer at each marker the model wrote and the refusal probe's score.
async fn answer_all(
    config: &Config,
    generator: &Generator,
    examples: &[&Example],
    golds: &HashMap<String, Vec<String>>,
    max_tokens: usize,
) -> anyhow::Result<(Vec<Answer>, States)> {
    let prompts = startup::prompts(config)?;
    let bar = indicatif::ProgressBar::new(examples.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} answers, {eta} left")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (mut answers, mut values) = (Vec::new(), Vec::new());
    for e in examples {
        bar.inc(1);
        let question = e.id.split('/').next().unwrap_or(&e.id);
        let gold = golds.get(question).cloned().unwrap_or_default();
        let prompt = refusal::prompt_of(&prompts, config.safety.spotlight, e)?;
        let reader = std::sync::Arc::new(StepReader::new(Vec::new()));
        let generation = generator
            .chat_reading(&prompt, &Params::greedy(max_tokens), reader.clone())
            .await?;
        let steps = reader.steps();
        let found = markers_of(&generation.text);
        let ends: Vec<usize> = found.iter().map(|m| m.0).collect();
        let decode = |ids: &[u32]| generator.decode(ids);
        let mut keep = |state: Option<&Vec<Vec<f32>>>| {
            state.map(|s| {
                values.push(s.clone());
                values.len() - 1
            })
        };
        let states = steps::marker_states(&steps, &ends, &decode);
        let mut markers = Vec::new();
        for ((end, n), state) in found.into_iter().zip(states) {
            markers.push((end, n, keep(state)));
        }
        let claims: Vec<Option<usize>> =
            steps::marker_states(&steps, &claim_ends(&generation.text), &decode)
                .into_iter()
                .map(&mut keep)
                .collect();
        let refusal = generator
            .probe()
            .zip(steps.prompt_states.as_ref())
            .and_then(|((p, _), s)| p.score(s));
        answers.push(Answer {
            example: e.id.clone(),
            split: e.split.clone(),
            text: generation.text,
            good_passages: e
                .passages
                .iter()
                .map(|p| contains_answer(&p.text, &gold))
                .collect(),
            refusal,
            markers,
            claims,
        });
    }
    bar.finish_and_clear();
    let layers = values.first().map_or(0, Vec::len);
    let hidden = values.first().and_then(|v| v.first()).map_or(0, Vec::len);
    Ok((
        answers,
        States {
            layers: (0..layers).collect(),
            hidden,
            values,
        },
    ))
}

/// A probe's probability of a bad citation for `state`.
fn apply(weights: &[f32], bias: f32, state: &[f32]) -> f64 {
    probe::sigmoid(
        state
            .iter()
            .zip(weights)
            .map(|(&s, &w)| s as f64 * w as f64)
            .sum::<f64>()
            + bias as f64,
    )
}

/// Precision and coverage of citations per answer (`(n, good)` lists).
fn score(setting: String, per_answer: &[(bool, Vec<bool>)]) -> SignalRow {
    let citations: usize = per_answer.iter().map(|(_, c)| c.len()).sum();
    let good: usize = per_answer
        .iter()
        .map(|(_, c)| c.iter().filter(|&&g| g).count())
        .sum();
    let answerable = per_answer.iter().filter(|(a, _)| *a).count();
    let covered = per_answer
        .iter()
        .filter(|(a, c)| *a && c.iter().any(|&g| g))
        .count();
    SignalRow {
        setting,
        citations,
        precision: good as f64 / citations.max(1) as f64,
        coverage: covered as f64 / answerable.max(1) as f64,
    }
}

/// Fits a logistic probe per layer on `train` (state index, bad) and returns the layer
/// whose probe tells `dev` apart best: (layer position, dev AUROC, weights, bias).
fn best_probe(states: &States, train: &[(usize, bool)], dev: &[(usize, bool)], c: f64) -> Fitted {
    let mut best: Option<(usize, f64, Vec<f32>, f32)> = None;
    for li in 0..states.layers.len() {
        let labelled: Vec<Labelled<'_>> = train
            .iter()
            .map(|&(i, bad)| Labelled {
                state: &states.values[i][li],
                refuse: bad,
            })
            .collect();
        let Some((w, b)) = probe::fit_logistic(&labelled, c) else {
            continue;
        };
        let scores: Vec<(f64, bool)> = dev
            .iter()
            .map(|&(i, bad)| (apply(&w, b, &states.values[i][li]), bad))
            .collect();
        let auroc = probe::auroc(&scores);
        if best.as_ref().is_none_or(|p| auroc > p.1) {
            best = Some((li, auroc, w, b));
        }
    }
    best
}

/// One answer ready for the attribution: its passages as hits, its normal-form text,
/// claims, their support of each passage, and each claim's state index.
struct Ready<'a> {
    answer: &'a Answer,
    hits: Vec<docent_ingest::store::Hit>,
    text: String,
    claims: Vec<docent::query::postprocess::Claim>,
    support: Vec<Vec<f32>>,
    claim_states: Vec<Option<usize>>,
}

impl Ready<'_> {
    /// Claims worth attributing (two content words or more) with a state: (claim, state
    /// index, its best-supported passage lacks the answer).
    fn labelled(&self) -> Vec<(usize, usize, bool)> {
        self.claims
            .iter()
            .enumerate()
            .filter(|(_, c)| docent::query::postprocess::content_word_count(&c.text) >= 2)
            .filter_map(|(k, _)| {
                let s = (*self.claim_states.get(k)?)?;
                let best = self.support[k]
                    .iter()
                    .enumerate()
                    .max_by(|x, y| x.1.total_cmp(y.1))?
                    .0;
                Some((k, s, !self.answer.good(best + 1)))
            })
            .collect()
    }
}

impl<'a> Ready<'a> {
    /// `a` (an answer to `e`) with its passages as hits and its claims' support.
    fn of(
        embedder: &docent_ingest::embed::Embedder,
        e: &Example,
        a: &'a Answer,
    ) -> anyhow::Result<Ready<'a>> {
        use docent::query::postprocess as post;
        let hits: Vec<docent_ingest::store::Hit> = e
            .passages
            .iter()
            .enumerate()
            .map(|(i, p)| docent_ingest::store::Hit {
                payload: docent_ingest::store::ChunkPayload {
                    document_id: format!("{}#{i}", e.id),
                    source: p.source.clone(),
                    title: p.title.clone(),
                    text: p.text.clone(),
                    ..Default::default()
                },
                score: 0.0,
            })
            .collect();
        let (text, _) = post::cite(&a.text, &hits);
        let claims = post::claims(&text);
        let claim_texts: Vec<&str> = claims.iter().map(|c| c.text.as_str()).collect();
        let passages: Vec<&str> = hits.iter().map(|h| h.payload.text.as_str()).collect();
        let texts: Vec<&str> = claim_texts.iter().chain(&passages).copied().collect();
        let vectors = if claims.is_empty() {
            Vec::new()
        } else {
            embedder.embed_dense(&texts)?
        };
        let (cv, pv) = vectors.split_at(claims.len().min(vectors.len()));
        let support = post::support_matrix(&claims, cv, &passages, pv);
        // the raw text's claims carry the states; normal form keeps the same sentences
        let claim_states = if a.claims.len() == claims.len() {
            a.claims.clone()
        } else {
            vec![None; claims.len()]
        };
        Ok(Ready {
            answer: a,
            hits,
            text,
            claims,
            support,
            claim_states,
        })
    }
}

/// The citations the answer path gives each of `shown` with attribution `a` (per answer:
/// answerable, and whether each citation is good); a claim `veto` judges bad gets none (its
/// support row is zeroed).
fn attribute_all(
    shown: &[&Ready],
    a: docent::query::postprocess::Attribution,
    veto: &dyn Fn(&Ready, usize) -> bool,
) -> Vec<(bool, Vec<bool>)> {
    shown
        .iter()
        .map(|r| {
            let support: Vec<Vec<f32>> = r
                .support
                .iter()
                .enumerate()
                .map(|(k, row)| {
                    if veto(r, k) {
                        vec![0.0; row.len()]
                    } else {
                        row.clone()
                    }
                })
                .collect();
            let (_, cits) =
                docent::query::postprocess::attribute(&r.text, &r.claims, &support, &r.hits, a);
            (
                r.answer.answerable(),
                cits.iter().map(|c| r.answer.good(c.n)).collect(),
            )
        })
        .collect()
}

/// A fitted probe: (layer position, dev AUROC, weights, bias).
type Fitted = Option<(usize, f64, Vec<f32>, f32)>;

/// The ways of citing measured on `shown`: the model's markers, the support check at
/// several settings, and each probe's veto on top of the configured support check.
fn citation_rows(
    config: &Config,
    shown: &[&Ready],
    states: &States,
    marker_probe: &Fitted,
    claim_probe: &Fitted,
) -> Vec<SignalRow> {
    use docent::query::postprocess::Attribution;
    let configured = Attribution {
        add_at: config.citations.add_at,
        drop_below: config.citations.drop_below,
        unsupported_below: 0.0,
    };
    let run = |a: Attribution, veto: &dyn Fn(&Ready, usize) -> bool| attribute_all(shown, a, veto);
    let never = |_: &Ready, _: usize| false;
    let mut rows = Vec::new();
    let model_only: Vec<(bool, Vec<bool>)> = shown
        .iter()
        .map(|r| {
            let (_, cits) = docent::query::postprocess::cite(&r.answer.text, &r.hits);
            (
                r.answer.answerable(),
                cits.iter().map(|c| r.answer.good(c.n)).collect(),
            )
        })
        .collect();
    rows.push(score("the model's markers only".into(), &model_only));
    rows.push(score(
        format!(
            "support check as configured (add_at {}, drop_below {})",
            configured.add_at, configured.drop_below
        ),
        &run(configured, &never),
    ));
    for &(add_at, drop_below) in &[(0.4, 0.3), (0.5, 0.1), (0.5, 0.4), (0.6, 0.1), (0.6, 0.5)] {
        rows.push(score(
            format!("support check, add_at {add_at}, drop_below {drop_below}"),
            &run(
                Attribution {
                    add_at,
                    drop_below,
                    unsupported_below: 0.0,
                },
                &never,
            ),
        ));
    }
    if let Some((li, _, w, b)) = &marker_probe {
        let veto = |r: &Ready, k: usize| {
            let claim = &r.claims[k];
            r.answer.markers.iter().any(|&(_, n, s)| {
                claim.markers.contains(&n)
                    && s.is_some_and(|s| apply(w, *b, &states.values[s][*li]) >= 0.5)
            })
        };
        rows.push(score(
            format!(
                "as configured + the marker probe (layer {}) at 0.5",
                states.layers[*li]
            ),
            &run(configured, &veto),
        ));
    }
    if let Some((li, _, w, b)) = &claim_probe {
        for t in [0.5, 0.6, 0.7, 0.8] {
            let veto = |r: &Ready, k: usize| {
                r.claim_states
                    .get(k)
                    .copied()
                    .flatten()
                    .is_some_and(|s| apply(w, *b, &states.values[s][*li]) >= t)
            };
            rows.push(score(
                format!(
                    "as configured + the claim probe (layer {}) at {t}",
                    states.layers[*li]
                ),
                &run(configured, &veto),
            ));
        }
    }
    rows
}

/// Step 3: the signals fitted on train, the ways of citing measured on dev's answers that
/// the service shows (not refused by the refusal probe at `refusal_threshold`).
pub async fn sweep(
    config: &Config,
    examples: &[Example],
    answers: &[Answer],
    states: &States,
    c: f64,
    refusal_threshold: f32,
) -> anyhow::Result<Report> {
    let embedder = startup::embedder(config)?;
    let is_dev = |a: &Answer| a.split == "dev";
    let by_id: HashMap<&str, &Example> = examples.iter().map(|e| (e.id.as_str(), e)).collect();
    // every answer with its claims' support (train fits the claim probe, dev is measured)
    let mut ready = Vec::new();
    for a in answers {
        if let Some(e) = by_id.get(a.example.as_str()) {
            ready.push(Ready::of(&embedder, e, a)?);
        }
    }
    // the model's own markers: can their state tell a passage without the answer?
    let marks = |dev: bool| -> Vec<(usize, bool)> {
        answers
            .iter()
            .filter(|a| is_dev(a) == dev)
            .flat_map(|a| {
                a.markers
                    .iter()
                    .filter_map(|&(_, n, s)| Some((s?, !a.good(n))))
            })
            .collect()
    };
    let (train_marks, dev_marks) = (marks(false), marks(true));
    let marker_probe = best_probe(states, &train_marks, &dev_marks, c);
    let support_auroc = probe::auroc(
        &ready
            .iter()
            .filter(|r| is_dev(r.answer))
            .flat_map(|r| {
                r.claims
                    .iter()
                    .zip(&r.support)
                    .flat_map(move |(claim, row)| {
                        claim.markers.iter().filter_map(move |&n| {
                            Some((-(*row.get(n.wrapping_sub(1))? as f64), !r.answer.good(n)))
                        })
                    })
            })
            .collect::<Vec<_>>(),
    );
    // the claim probe: from the state where a sentence ends, is its best passage wrong?
    let claims_of = |dev: bool| -> Vec<(usize, bool)> {
        ready
            .iter()
            .filter(|r| is_dev(r.answer) == dev)
            .flat_map(|r| r.labelled().into_iter().map(|(_, s, bad)| (s, bad)))
            .collect()
    };
    let (train_claims, dev_claims) = (claims_of(false), claims_of(true));
    let claim_probe = best_probe(states, &train_claims, &dev_claims, c);
    // the dev answers the service shows
    let shown: Vec<&Ready> = ready
        .iter()
        .filter(|r| is_dev(r.answer) && r.answer.refusal.is_none_or(|s| s < refusal_threshold))
        .collect();
    let rows = citation_rows(config, &shown, states, &marker_probe, &claim_probe);
    Ok(Report {
        answers: answers.len(),
        answers_with_markers: answers.iter().filter(|a| !a.markers.is_empty()).count(),
        markers: (train_marks.len(), dev_marks.len()),
        support_auroc,
        probe_auroc: marker_probe.map(|p| (states.layers[p.0], p.1)),
        claims: (train_claims.len(), dev_claims.len()),
        claim_probe_auroc: claim_probe.map(|p| (states.layers[p.0], p.1)),
        dev_shown: shown.len(),
        dev_answerable: shown.iter().filter(|r| r.answer.answerable()).count(),
        rows,
    })
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
    let answers_path = dir.join(format!("{stem}-citations-{key:016x}.jsonl"));
    let generator = Generator::load(&config.generation).await?;
    let (answers, states) = if settings.extract || !states_path.is_file() || !answers_path.is_file()
    {
        let golds = golds(settings)?;
        let (answers, states) =
            answer_all(config, &generator, &retrieved, &golds, settings.max_tokens).await?;
        let sha = probe::file_sha256(&docent::query::generate::catalog::resolve(
            &config.generation.model,
        ))?;
        std::fs::create_dir_all(&dir)?;
        states.write(&states_path, &sha)?;
        write_jsonl(&answers_path, &answers)?;
        (answers, states)
    } else {
        let (states, _) = States::read(&states_path)?;
        (refusal::read_jsonl(&answers_path)?, states)
    };
    let threshold = generator.probe().map_or(f32::INFINITY, |(_, t)| t);
    sweep(config, &examples, &answers, &states, settings.c, threshold).await
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
            "{} answers, {} with a marker the model wrote ({} markers with states: train {}, dev {})",
            self.answers,
            self.answers_with_markers,
            self.markers.0 + self.markers.1,
            self.markers.0,
            self.markers.1
        )?;
        write!(
            f,
            "telling the model's dev markers whose passage lacks the answer: support check AUROC {:.3}",
            self.support_auroc
        )?;
        match self.probe_auroc {
            Some((layer, a)) => writeln!(f, ", marker state probe (best layer {layer}) {a:.3}")?,
            None => writeln!(f, ", marker state probe: too few markers to fit")?,
        }
        write!(
            f,
            "claim sentences with a state: train {}, dev {}",
            self.claims.0, self.claims.1
        )?;
        match self.claim_probe_auroc {
            Some((layer, a)) => writeln!(f, "; claim probe (best layer {layer}) dev AUROC {a:.3}")?,
            None => writeln!(f, "; claim probe: too few to fit")?,
        }
        writeln!(
            f,
            "dev answers shown (not refused): {}, of them answerable: {}",
            self.dev_shown, self.dev_answerable
        )?;
        writeln!(f, "| setting | citations | precision | coverage |")?;
        writeln!(f, "|---|---|---|---|")?;
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {} | {:.1} % | {:.1} % |",
                r.setting,
                r.citations,
                100.0 * r.precision,
                100.0 * r.coverage
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_with_their_ends() {
        let a = "Cargo builds it [1]. It also tests it [2][3]. No marker here.";
        let m = markers_of(a);
        assert_eq!(
            m.iter().map(|x| x.1).collect::<Vec<_>>(),
            vec![1, 2, 3],
            "{m:?}"
        );
        assert_eq!(&a[..m[0].0], "Cargo builds it [1]");
        assert_eq!(&a[..m[2].0], "Cargo builds it [1]. It also tests it [2][3]");
    }

    #[test]
    fn a_claim_ends_before_its_markers() {
        let a = "Cargo builds it [1]. It also tests it. Done [2]";
        let ends: Vec<&str> = claim_ends(a).iter().map(|&e| &a[..e]).collect();
        assert_eq!(
            ends,
            vec![
                "Cargo builds it",
                "Cargo builds it [1]. It also tests it.",
                "Cargo builds it [1]. It also tests it. Done"
            ]
        );
    }

    #[test]
    fn precision_counts_citations_and_coverage_answerable_answers() {
        let rows = vec![
            (true, vec![true, false]),
            (true, vec![]),
            (false, vec![false]),
        ];
        let r = score("x".into(), &rows);
        assert_eq!(r.citations, 3);
        assert!((r.precision - 1.0 / 3.0).abs() < 1e-9);
        assert!((r.coverage - 0.5).abs() < 1e-9);
    }
}
