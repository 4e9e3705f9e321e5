//! `docent train-refusal`: trains the refusal probe ([`docent::query::generate::probe`]) for
//! one generation model, in three steps, each kept in a file so the later ones can be
//! repeated alone:
//!
//! 1. **Examples** (`training/refusal/examples.jsonl`, made when missing or with
//!    `--rebuild`): our own questions (`training/refusal/questions.jsonl` over the Rust Book
//!    and the RFCs, and encyclo-factoid's dev half) with the passages the query path
//!    retrieves for them, labelled by whether those passages hold the gold answer; and each
//!    answerable question again with every sentence that holds its answer taken out of the
//!    passages (the passages still speak of the subject, but do not answer). Never public
//!    benchmark sets. One question in five (by a hash of its id) is dev, with its variants.
//! 2. **States** (`--states FILE`, made when missing or with `--extract`): every layer's
//!    hidden state at each example's last prompt token, read by the prefill as the service
//!    reads it (the same templates; a fence of its own per example, fixed by its id).
//! 3. **Fit**: a linear probe at `--layer` on the train split (a logistic regression on
//!    standardised states by default; the difference of the class means with `--method`),
//!    the threshold on the calibration set (`training/refusal/calibration.jsonl`: natural
//!    questions written apart, half unanswerable; their retrieved passages and states kept
//!    like the examples'): the lowest that refuses at most `--max-false-refusals` of its
//!    questions the corpus answers, whatever retrieval found (without the set, of dev's
//!    examples whose passages hold the answer). The probe file
//!    is a function of the states at that layer and the examples' labels, so the shipped one
//!    is reproduced byte for byte from `training/refusal/<model>.states` (that layer only,
//!    committed) by the plain command.

use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::eval::{contains_answer, Dataset};
use docent::config::Config;
use docent::query::generate::probe::{self, Labelled, Probe, ProbeFile};
use docent::query::prompt::ContextBlock;
use docent::server::startup;

/// The layer the shipped probes read (0: after the first decoder layer), chosen on dev
/// by the sweep `--states` with every layer prints (docs/evaluation.md).
pub const DEFAULT_LAYER: usize = 16;

/// One question of `training/refusal/questions.jsonl`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Question {
    pub(crate) id: String,
    corpus: String,
    text: String,
    answerable: bool,
    #[serde(default)]
    pub(crate) answer: Option<String>,
}

/// One passage of an example's prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Passage {
    /// The title of the passage's document.
    pub title: String,
    /// The passage's source, as the search hit gives it.
    pub source: String,
    /// The passage's text (with the answer's sentences taken out in an `answer_removed`
    /// example).
    pub text: String,
}

/// One prompt to read, and whether its passages fail to answer its question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Example {
    /// `<question id>/<variant>`.
    pub id: String,
    /// Where the question comes from (`rust-book`, `rfcs`, `encyclo-factoid`).
    pub origin: String,
    /// `retrieved` (as the query path retrieves) or `answer_removed`.
    pub variant: String,
    /// `train` or `dev` (one question in five, by a hash of its id), or `calibration`.
    pub split: String,
    /// The question's text.
    pub question: String,
    /// The passages the prompt gives, in order.
    pub passages: Vec<Passage>,
    /// The passages do not hold the answer: the probe should refuse.
    pub refuse: bool,
    /// Whether the corpus answers the question (calibration examples only: a refusal of
    /// an answerable question is a false refusal to its user whatever retrieval found).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answerable: Option<bool>,
}

/// What the probe is taught to read from a training example.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Labels {
    /// Whether the corpus answers the question: our questions' retrieved examples labelled
    /// by their `answerable` (a user's answerable question stays answerable when retrieval
    /// misses the answer), the answer-removed variants left out; examples of questions
    /// without such a label (encyclo-factoid's) keep the passages' label. The target the
    /// service is judged on (issue 54's natural sets), and the shipped probes' recipe.
    Corpus,
    /// Whether the retrieved passages hold the gold answer, answer-removed variants in
    /// (the recipe before 2026-11-30).
    Passages,
}

/// `docent train-refusal`'s settings (its flags, with the paths resolved for the model).
#[derive(Debug, Clone)]
pub struct Settings {
    /// What the training examples' labels say.
    pub labels: Labels,
    /// Our questions (`training/refusal/questions.jsonl`), over the corpora below.
    pub questions: PathBuf,
    /// Corpus name (as the questions name it) → its `corpus.jsonl`.
    pub corpora: Vec<(String, PathBuf)>,
    /// encyclo-factoid's folder (its dev half is used), if any.
    pub encyclo: Option<PathBuf>,
    /// The examples file (step 1), made when missing or with `rebuild`.
    pub examples: PathBuf,
    /// The states file at `layer` (step 2), made when missing or with `extract`.
    pub states: PathBuf,
    /// Where the probe file is written.
    pub out: PathBuf,
    /// The layer the probe reads (0: after the first decoder layer).
    pub layer: usize,
    /// How the probe is fitted.
    pub method: Method,
    /// The highest share of the calibration set's answerable questions (without one, of
    /// dev's examples whose passages hold the answer) the threshold may refuse.
    pub max_false_refusals: f64,
    /// Make the examples again (and so the states).
    pub rebuild: bool,
    /// Read the states again, every layer's.
    pub extract: bool,
    /// Also time what reading the states adds to a prefill over this many examples.
    pub time: usize,
    /// Natural questions written apart to choose the threshold on, if any.
    pub calibration: Option<Calibration>,
}

/// The calibration set: natural questions (half of them unanswerable from the corpus)
/// written apart from the training questions, only to choose the threshold on. Its
/// examples are the passages the query path retrieves for each (no answer-removed
/// variants), and a refusal counts as false when the corpus answers the question.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The calibration questions (`training/refusal/calibration.jsonl`).
    pub questions: PathBuf,
    /// Made when missing or with `--rebuild`.
    pub examples: PathBuf,
    /// The probe's layer's states (every layer's in the cache), made when missing or with
    /// `--extract`.
    pub states: PathBuf,
}

/// How the probe is fitted at its layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// An L2-regularised logistic regression on standardised states
    /// ([`probe::fit_logistic`]), with this `C` (inverse penalty).
    Logistic {
        /// The inverse L2 penalty.
        c: f64,
    },
    /// The difference of the class means (Lavi et al.), optionally scaled per dimension
    /// by the pooled variance ([`probe::fit`]).
    MeanDifference {
        /// Divide each dimension by the pooled variance.
        scaled: bool,
    },
}

/// The regularisation the shipped probes use (`--c`), chosen on dev with the layer.
pub const DEFAULT_C: f64 = 0.01;

impl Method {
    fn fit(self, train: &[Labelled<'_>]) -> Option<(Vec<f32>, f32, f32)> {
        match self {
            Method::Logistic { c } => probe::fit_logistic(train, c).map(|(w, b)| (w, 1.0, b)),
            Method::MeanDifference { scaled } => probe::fit(train, scaled),
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Examples read.
    pub examples: usize,
    /// Of them, in the train split.
    pub train: usize,
    /// Of them, in the dev split.
    pub dev: usize,
    /// Per layer read: dev AUROC of the logistic probe (at `--c`), the difference of
    /// means and the scaled difference.
    pub layers: Vec<(usize, f64, f64, f64)>,
    /// The layer the written probe reads.
    pub layer: usize,
    /// The written probe's AUROC on dev.
    pub dev_auroc: f64,
    /// The written probe's threshold (chosen on the calibration set, else on dev).
    pub threshold: f32,
    /// On dev at the threshold: the share of refuse examples refused.
    pub dev_refused: f64,
    /// On dev at the threshold: the share of answer examples refused.
    pub dev_false_refusals: f64,
    /// Dev curve: (threshold, refused, false refusals).
    pub curve: Vec<(f32, f64, f64)>,
    /// Where the probe file was written.
    pub out: PathBuf,
    /// `--time`: median ms of a first step without and with the probe's layer read, and
    /// the median of their paired differences.
    pub overhead_ms: Option<(f64, f64, f64)>,
    /// The calibration set at the threshold chosen on it, when there is one.
    pub calibration: Option<CalibrationReport>,
}

/// The probe on the calibration set (a refusal is false when the corpus answers).
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationReport {
    /// Calibration examples (one per question the query path retrieved passages for).
    pub examples: usize,
    /// Of them, questions the corpus does not answer.
    pub unanswerable: usize,
    /// AUROC of the score against "the corpus does not answer".
    pub auroc: f64,
    /// At the threshold: the share of the unanswerable questions refused.
    pub refused: f64,
    /// At the threshold: the share of the answerable questions refused.
    pub false_refusals: f64,
    /// (threshold, refused, false refusals) at [`CALIBRATION_CURVE`].
    pub curve: Vec<(f32, f64, f64)>,
}

/// Where the calibration curve is printed (the probes' scores crowd towards 1).
pub const CALIBRATION_CURVE: &[f32] = &[
    0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 0.999,
];

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "refusal probe: {} examples ({} train, {} dev)",
            self.examples, self.train, self.dev
        )?;
        if self.layers.len() > 1 {
            writeln!(
                f,
                "dev AUROC per layer: {:>6} {:>10} {:>10} {:>10}",
                "layer", "logistic", "mean diff", "scaled"
            )?;
            for (l, a, b, c) in &self.layers {
                writeln!(f, "{:>26} {a:>10.4} {b:>10.4} {c:>10.4}", l)?;
            }
        }
        writeln!(
            f,
            "layer {}: dev AUROC {:.4}; threshold {:.4}: dev refused {:.1} %, false refusals {:.1} %",
            self.layer,
            self.dev_auroc,
            self.threshold,
            self.dev_refused * 100.0,
            self.dev_false_refusals * 100.0
        )?;
        writeln!(f, "{:>10} {:>9} {:>9}", "threshold", "refused", "false")?;
        for (t, r, fr) in &self.curve {
            writeln!(f, "{t:>10.2} {:>8.1}% {:>8.1}%", r * 100.0, fr * 100.0)?;
        }
        if let Some(c) = &self.calibration {
            writeln!(
                f,
                "calibration ({} questions, {} unanswerable): AUROC {:.4}; at the threshold {:.1} % of the unanswerable refused, {:.1} % of the answerable",
                c.examples,
                c.unanswerable,
                c.auroc,
                c.refused * 100.0,
                c.false_refusals * 100.0
            )?;
            for (t, r, fr) in &c.curve {
                writeln!(f, "{t:>10.3} {:>8.1}% {:>8.1}%", r * 100.0, fr * 100.0)?;
            }
        }
        if let Some((plain, read, added)) = self.overhead_ms {
            writeln!(
                f,
                "prefill and first step (median): {plain:.1} ms, with the probe's layer read {read:.1} ms; added per prompt (median of paired differences): {added:+.2} ms"
            )?;
        }
        write!(f, "wrote {}", self.out.display())
    }
}

/// FNV-1a, for splits and fences that do not depend on anything but the id.
pub(crate) fn fnv(text: &str) -> u64 {
    fnv_bytes(text.as_bytes())
}

pub(crate) fn fnv_bytes(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn split_of(question_id: &str) -> &'static str {
    if fnv(question_id).is_multiple_of(5) {
        "dev"
    } else {
        "train"
    }
}

/// `text` without its sentences (and lines) that contain one of `answers`.
pub fn without_answer(text: &str, answers: &[String]) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let mut start = 0;
        let bytes = line.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let end_of_sentence = matches!(bytes[i], b'.' | b'?' | b'!')
                && bytes.get(i + 1).is_none_or(|c| c.is_ascii_whitespace());
            if end_of_sentence || i + 1 == bytes.len() {
                let piece = &line[start..=i];
                if !contains_answer(piece, answers) {
                    out.push_str(piece);
                }
                start = i + 1;
            }
            i += 1;
        }
    }
    out
}

pub(crate) fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<Vec<T>> {
    crate::eval::jsonl(path)
}

/// Questions over one corpus: (origin, corpus, questions as (id, text, answerable, answers)).
type QuestionSet = (
    String,
    Vec<crate::eval::CorpusLine>,
    Vec<(String, String, bool, Vec<String>)>,
);

/// The questions of `path`, grouped by the corpus they name (in `corpora`' order).
fn question_sets(path: &Path, corpora: &[(String, PathBuf)]) -> anyhow::Result<Vec<QuestionSet>> {
    let questions: Vec<Question> = read_jsonl(path)?;
    let mut sets = Vec::new();
    for (name, corpus) in corpora {
        let qs = questions
            .iter()
            .filter(|q| &q.corpus == name)
            .map(|q| {
                let answers = q.answer.iter().cloned().collect::<Vec<_>>();
                (q.id.clone(), q.text.clone(), q.answerable, answers)
            })
            .collect();
        sets.push((name.clone(), read_jsonl(corpus)?, qs));
    }
    Ok(sets)
}

/// Step 1: the examples, from the questions and the passages the query path retrieves.
pub async fn build_examples(
    config: &Config,
    settings: &Settings,
    generator: docent::query::generate::SharedGenerator,
) -> anyhow::Result<Vec<Example>> {
    let mut sets = question_sets(&settings.questions, &settings.corpora)?;
    if let Some(dir) = &settings.encyclo {
        let data = Dataset::load(dir)?;
        let split: BTreeMap<String, Vec<String>> =
            serde_json::from_reader(std::fs::File::open(dir.join("split.json"))?)
                .context("encyclo-factoid's split.json")?;
        let dev: std::collections::HashSet<&String> =
            split.get("dev").into_iter().flatten().collect();
        let qs = data
            .questions()
            .into_iter()
            .filter(|q| dev.contains(&q.0))
            .collect();
        let corpus = read_jsonl(&dir.join("corpus.jsonl"))?;
        sets.push(("encyclo-factoid".into(), corpus, qs));
    }
    examples_of(config, generator, sets, false).await
}

/// The calibration set's examples: each question with the passages the query path
/// retrieves for it.
pub async fn build_calibration(
    config: &Config,
    settings: &Settings,
    calibration: &Calibration,
    generator: docent::query::generate::SharedGenerator,
) -> anyhow::Result<Vec<Example>> {
    let sets = question_sets(&calibration.questions, &settings.corpora)?;
    examples_of(config, generator, sets, true).await
}

/// Every question of `sets` with the passages the query path retrieves for it, labelled by
/// whether they hold the gold answer; for training (not `calibration`), each question
/// whose passages hold it again with the answer's sentences taken out.
async fn examples_of(
    config: &Config,
    generator: docent::query::generate::SharedGenerator,
    sets: Vec<QuestionSet>,
    calibration: bool,
) -> anyhow::Result<Vec<Example>> {
    let mut examples = Vec::new();
    for (origin, corpus, qs) in sets {
        let c = config.clone();
        let (c, index, _cleanup, _) = tokio::task::spawn_blocking(move || {
            crate::eval::index_corpus(&c, &corpus, "train-refusal")
        })
        .await??;
        let engine = startup::query_engine_with(&c, index, generator.clone())?;
        for (id, text, answerable, answers) in qs {
            let search = engine
                .search(docent::query::SearchRequest {
                    question: text.clone(),
                    retrieval: Default::default(),
                })
                .await?;
            let passages: Vec<Passage> = search
                .hits
                .iter()
                .map(|h| Passage {
                    title: h.title.clone(),
                    source: h.source.clone(),
                    text: h.text.clone(),
                })
                .collect();
            if passages.is_empty() {
                continue;
            }
            let holds = answerable && passages.iter().any(|p| contains_answer(&p.text, &answers));
            let split = if calibration {
                "calibration".to_string()
            } else {
                split_of(&id).to_string()
            };
            examples.push(Example {
                id: format!("{id}/retrieved"),
                origin: origin.clone(),
                variant: "retrieved".into(),
                split: split.clone(),
                question: text.clone(),
                passages: passages.clone(),
                refuse: !holds,
                answerable: calibration.then_some(answerable),
            });
            if holds && !calibration {
                if let Some(removed) = answer_removed(&passages, &answers) {
                    examples.push(Example {
                        id: format!("{id}/answer_removed"),
                        origin: origin.clone(),
                        variant: "answer_removed".into(),
                        split,
                        question: text,
                        passages: removed,
                        refuse: true,
                        answerable: None,
                    });
                }
            }
        }
    }
    Ok(examples)
}

/// `passages` with every sentence that holds one of `answers` taken out, if something
/// is left and nothing left holds an answer.
fn answer_removed(passages: &[Passage], answers: &[String]) -> Option<Vec<Passage>> {
    let removed: Vec<Passage> = passages
        .iter()
        .map(|p| Passage {
            text: without_answer(&p.text, answers),
            ..p.clone()
        })
        .collect();
    let answered = removed.iter().any(|p| contains_answer(&p.text, answers));
    (!answered && removed.iter().any(|p| !p.text.trim().is_empty())).then_some(removed)
}

/// The prompt the service would give the model for `e` (its fence fixed by the id).
pub(crate) fn prompt_of(
    prompts: &docent::query::prompt::Prompts,
    spotlight: bool,
    e: &Example,
) -> anyhow::Result<docent::query::prompt::Prompt> {
    let blocks: Vec<ContextBlock<'_>> = e
        .passages
        .iter()
        .enumerate()
        .map(|(i, p)| ContextBlock {
            n: i + 1,
            title: &p.title,
            source: &p.source,
            text: &p.text,
        })
        .collect();
    let fence = if spotlight {
        format!("doc-{:08x}", fnv(&e.id) as u32)
    } else {
        String::new()
    };
    Ok(prompts.render_fenced(&e.question, &blocks, &fence)?)
}

/// States of every example: `layers` per example, each `hidden` values.
#[derive(Debug, Clone, PartialEq)]
pub struct States {
    /// The layers kept, in order.
    pub layers: Vec<usize>,
    /// Values per state (the model's hidden size).
    pub hidden: usize,
    /// Per example (in the examples' order), per kept layer, the state.
    pub values: Vec<Vec<Vec<f32>>>,
}

#[derive(Serialize, Deserialize)]
struct StatesHeader {
    format: String,
    model_sha256: String,
    examples: usize,
    layers: Vec<usize>,
    hidden: usize,
}

const STATES_FORMAT: &str = "docent-refusal-states/1";

impl States {
    /// Writes a JSON header line, then every value as f32 little-endian.
    pub fn write(&self, path: &Path, model_sha256: &str) -> anyhow::Result<()> {
        let header = StatesHeader {
            format: STATES_FORMAT.into(),
            model_sha256: model_sha256.into(),
            examples: self.values.len(),
            layers: self.layers.clone(),
            hidden: self.hidden,
        };
        let tmp = path.with_extension("tmp");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        serde_json::to_writer(&mut f, &header)?;
        f.write_all(b"\n")?;
        for v in self.values.iter().flatten().flatten() {
            f.write_all(&v.to_le_bytes())?;
        }
        f.into_inner()?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    /// Reads what [`States::write`] wrote; also the model's sha256.
    pub fn read(path: &Path) -> anyhow::Result<(States, String)> {
        let mut f = std::io::BufReader::new(
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?,
        );
        let mut line = String::new();
        f.read_line(&mut line)?;
        let h: StatesHeader = serde_json::from_str(&line)
            .with_context(|| format!("{}: not a states file", path.display()))?;
        anyhow::ensure!(
            h.format == STATES_FORMAT,
            "{}: format {}",
            path.display(),
            h.format
        );
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)?;
        let n = h.examples * h.layers.len() * h.hidden;
        anyhow::ensure!(
            bytes.len() == n * 4,
            "{}: {} bytes of values, expected {}",
            path.display(),
            bytes.len(),
            n * 4
        );
        let flat: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let per_example = h.layers.len() * h.hidden;
        let values = flat
            .chunks(per_example.max(1))
            .take(h.examples)
            .map(|e| e.chunks(h.hidden.max(1)).map(<[f32]>::to_vec).collect())
            .collect();
        Ok((
            States {
                layers: h.layers,
                hidden: h.hidden,
                values,
            },
            h.model_sha256,
        ))
    }

    /// Only `layer`.
    pub fn only(&self, layer: usize) -> Option<States> {
        let i = self.layers.iter().position(|&l| l == layer)?;
        Some(States {
            layers: vec![layer],
            hidden: self.hidden,
            values: self.values.iter().map(|e| vec![e[i].clone()]).collect(),
        })
    }
}

/// Step 2: every layer's state at each example's last prompt token.
pub async fn extract(
    config: &Config,
    generator: &docent::query::generate::Generator,
    examples: &[Example],
) -> anyhow::Result<States> {
    let prompts = startup::prompts(config)?;
    let bar = indicatif::ProgressBar::new(examples.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} prompts read, {eta} left")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut values = Vec::with_capacity(examples.len());
    for e in examples {
        let prompt = prompt_of(&prompts, config.safety.spotlight, e)?;
        let states = generator.hidden_states(&prompt, &[]).await?.context(
            "the model gave no hidden states (only GGUF models on the Llama/Qwen2 decoder do)",
        )?;
        values.push(states);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let layers = values.first().map_or(0, Vec::len);
    let hidden = values.first().and_then(|v| v.first()).map_or(0, Vec::len);
    Ok(States {
        layers: (0..layers).collect(),
        hidden,
        values,
    })
}

/// What reading the probe's layer adds to a prefill: over the first `n` examples, one
/// greedy step as an answer's first without and with that layer's state read (the order
/// alternating from one example to the next); the median of each and of their paired
/// differences, in ms. The generator should have no prefix cache (each prompt is read twice).
pub async fn overhead(
    config: &Config,
    generator: &docent::query::generate::Generator,
    examples: &[Example],
    n: usize,
    layer: usize,
) -> anyhow::Result<(f64, f64, f64)> {
    let prompts = startup::prompts(config)?;
    let (mut plain, mut read, mut added) = (Vec::new(), Vec::new(), Vec::new());
    for (i, e) in examples.iter().take(n).enumerate() {
        let prompt = prompt_of(&prompts, config.safety.spotlight, e)?;
        let (mut p, mut r) = (0.0, 0.0);
        for turn in 0..2 {
            let t = std::time::Instant::now();
            if (turn + i) % 2 == 0 {
                generator
                    .chat(&prompt, &docent::query::generate::Params::greedy(1))
                    .await?;
                p = t.elapsed().as_secs_f64() * 1e3;
            } else {
                let states = generator.hidden_states(&prompt, &[layer]).await?;
                r = t.elapsed().as_secs_f64() * 1e3;
                anyhow::ensure!(states.is_some(), "no states");
            }
        }
        plain.push(p);
        read.push(r);
        added.push(r - p);
    }
    for v in [&mut plain, &mut read, &mut added] {
        v.sort_by(f64::total_cmp);
    }
    let median = |v: &[f64]| crate::eval::percentile(v, 50.0);
    Ok((median(&plain), median(&read), median(&added)))
}

/// The training examples (and their states) as [`Labels::Corpus`] labels them: each of our
/// questions' retrieved examples refused when the corpus does not answer the question
/// (its `answerable` in `questions`), the answer-removed variants left out, the rest as
/// they are.
pub(crate) fn corpus_labels(
    examples: &[Example],
    states: &States,
    questions: &[Question],
) -> (Vec<Example>, States) {
    let answerable: std::collections::HashMap<&str, bool> = questions
        .iter()
        .map(|q| (q.id.as_str(), q.answerable))
        .collect();
    let mut kept = Vec::new();
    let mut values = Vec::new();
    for (e, v) in examples.iter().zip(&states.values) {
        if e.variant == "answer_removed" {
            continue;
        }
        let id = e.id.split('/').next().unwrap_or(&e.id);
        let mut e = e.clone();
        if let Some(&a) = answerable.get(id) {
            e.refuse = !a;
            e.answerable = Some(a);
        }
        kept.push(e);
        values.push(v.clone());
    }
    let states = States {
        layers: states.layers.clone(),
        hidden: states.hidden,
        values,
    };
    (kept, states)
}

/// Step 3: the probe at `layer`, fitted on train, its threshold chosen on the calibration
/// set when there is one (else on dev).
pub fn fit_probe(
    examples: &[Example],
    states: &States,
    calibration: Option<(&[Example], &States)>,
    model: &str,
    model_sha256: &str,
    settings: &Settings,
) -> anyhow::Result<(ProbeFile, Report)> {
    anyhow::ensure!(
        states.values.len() == examples.len(),
        "{} states for {} examples: extract them again (--extract)",
        states.values.len(),
        examples.len()
    );
    let at = |layer: usize, split: &str| -> Vec<(usize, Labelled<'_>)> {
        let i = states.layers.iter().position(|&l| l == layer);
        examples
            .iter()
            .enumerate()
            .filter(|(_, e)| e.split == split)
            .filter_map(|(n, e)| {
                Some((
                    n,
                    Labelled {
                        state: &states.values[n][i?],
                        refuse: e.refuse,
                    },
                ))
            })
            .collect()
    };
    let dev_scores = |p: &Probe, layer: usize| -> Vec<(f64, bool)> {
        at(layer, "dev")
            .iter()
            .filter_map(|(_, l)| Some((score_at(p, layer, l.state)?, l.refuse)))
            .collect()
    };
    let make = |layer: usize, method: Method| -> Option<Probe> {
        let train: Vec<Labelled<'_>> = at(layer, "train").into_iter().map(|(_, l)| l).collect();
        let (weights, scale, bias) = method.fit(&train)?;
        Some(Probe::new(model, model_sha256, layer, weights, scale, bias))
    };
    // the sweep, when the states hold more than one layer
    let mut layers = Vec::new();
    if states.layers.len() > 1 {
        for &l in &states.layers {
            let auc = |m| make(l, m).map_or(0.5, |p| probe::auroc(&dev_scores(&p, l)));
            let c = match settings.method {
                Method::Logistic { c } => c,
                Method::MeanDifference { .. } => DEFAULT_C,
            };
            layers.push((
                l,
                auc(Method::Logistic { c }),
                auc(Method::MeanDifference { scaled: false }),
                auc(Method::MeanDifference { scaled: true }),
            ));
        }
    }
    let mut p = make(settings.layer, settings.method).with_context(|| {
        format!(
            "no probe at layer {}: the states lack it, or the train split lacks one of the classes",
            settings.layer
        )
    })?;
    let dev = dev_scores(&p, settings.layer);
    let dev_auroc = probe::auroc(&dev);
    let calibrated = calibration
        .map(|(e, s)| calibration_scores(&p, e, s, settings.layer))
        .transpose()?;
    let threshold = lowest_threshold(
        calibrated.as_deref().unwrap_or(&dev),
        settings.max_false_refusals,
    );
    let calibration = calibrated.map(|c| calibration_report(&c, threshold));
    let rate = |t: f32, refuse: bool| refused_share(&dev, t, refuse);
    let curve = crate::eval::REFUSAL_THRESHOLDS
        .iter()
        .map(|&t| (t, rate(t, true), rate(t, false)))
        .collect();
    let count = |split: &str| examples.iter().filter(|e| e.split == split).count();
    p.file.threshold = threshold;
    p.file.training = training_record(
        examples,
        settings,
        (dev_auroc, rate(threshold, true), rate(threshold, false)),
    );
    if let Some(c) = &calibration {
        record_calibration(&mut p.file.training, c);
    }
    let report = Report {
        examples: examples.len(),
        train: count("train"),
        dev: count("dev"),
        layers,
        layer: settings.layer,
        dev_auroc,
        threshold,
        dev_refused: rate(threshold, true),
        dev_false_refusals: rate(threshold, false),
        curve,
        out: settings.out.clone(),
        overhead_ms: None,
        calibration,
    };
    Ok((p.file, report))
}

/// The probe's score of one state read at `layer`.
fn score_at(p: &Probe, layer: usize, state: &[f32]) -> Option<f64> {
    let mut s = vec![Vec::new(); layer + 1];
    s[layer] = state.to_vec();
    Some(p.score(&s)? as f64)
}

/// How the probe was trained, for the probe file (for people; not read): the data, the
/// splits' sizes and dev's (AUROC, refused, false refusals) at the threshold.
fn training_record(
    examples: &[Example],
    settings: &Settings,
    (auroc, refused, false_refusals): (f64, f64, f64),
) -> serde_json::Value {
    let count = |split: &str, refuse: bool| {
        examples
            .iter()
            .filter(|e| e.split == split && (!refuse || e.refuse))
            .count()
    };
    let round = |x: f64| (x * 1e4).round() / 1e4;
    serde_json::json!({
        "data": "training/refusal: examples.jsonl (our own questions; never public benchmark sets)",
        "command": "docent train-refusal",
        "layer": settings.layer,
        "method": settings.method,
        "labels": settings.labels,
        "train": { "examples": count("train", false), "refuse": count("train", true) },
        "dev": {
            "examples": count("dev", false),
            "refuse": count("dev", true),
            "auroc": round(auroc),
            "refused_at_threshold": round(refused),
            "false_refusals_at_threshold": round(false_refusals),
        },
        "max_false_refusals": settings.max_false_refusals,
    })
}

/// The calibration set's figures in the probe file's training record (for people).
fn record_calibration(training: &mut serde_json::Value, c: &CalibrationReport) {
    training["threshold_from"] = "calibration".into();
    training["calibration"] = serde_json::json!({
        "data": "training/refusal/calibration.jsonl (natural questions written apart; threshold only)",
        "questions": c.examples,
        "unanswerable": c.unanswerable,
        "auroc": (c.auroc * 1e4).round() / 1e4,
        "refused_at_threshold": (c.refused * 1e4).round() / 1e4,
        "false_refusals_at_threshold": (c.false_refusals * 1e4).round() / 1e4,
    });
}

/// The probe's score of each calibration example, and whether the corpus leaves its
/// question unanswered (what a refusal should follow).
fn calibration_scores(
    p: &Probe,
    examples: &[Example],
    states: &States,
    layer: usize,
) -> anyhow::Result<Vec<(f64, bool)>> {
    anyhow::ensure!(
        states.values.len() == examples.len(),
        "{} calibration states for {} examples: extract them again (--extract)",
        states.values.len(),
        examples.len()
    );
    let i = states
        .layers
        .iter()
        .position(|&l| l == layer)
        .with_context(|| format!("the calibration states lack layer {layer}"))?;
    examples
        .iter()
        .zip(&states.values)
        .map(|(e, v)| {
            let score = score_at(p, layer, &v[i]).context("no score")?;
            let answerable = e
                .answerable
                .with_context(|| format!("{}: a calibration example without `answerable`", e.id))?;
            Ok((score, !answerable))
        })
        .collect()
}

/// The calibration set's figures at `threshold` and along [`CALIBRATION_CURVE`].
fn calibration_report(scores: &[(f64, bool)], threshold: f32) -> CalibrationReport {
    CalibrationReport {
        examples: scores.len(),
        unanswerable: scores.iter().filter(|s| s.1).count(),
        auroc: probe::auroc(scores),
        refused: refused_share(scores, threshold, true),
        false_refusals: refused_share(scores, threshold, false),
        curve: CALIBRATION_CURVE
            .iter()
            .map(|&t| {
                (
                    t,
                    refused_share(scores, t, true),
                    refused_share(scores, t, false),
                )
            })
            .collect(),
    }
}

/// The lowest threshold (to 4 decimals) whose false refusals on `dev` (score, should
/// refuse) stay within `max_false_refusals`.
fn lowest_threshold(dev: &[(f64, bool)], max_false_refusals: f64) -> f32 {
    let mut answer_scores: Vec<f64> = dev.iter().filter(|d| !d.1).map(|d| d.0).collect();
    answer_scores.sort_by(|a, b| b.total_cmp(a));
    let allowed = (max_false_refusals * answer_scores.len() as f64).floor() as usize;
    let above = answer_scores.get(allowed).copied().unwrap_or(0.0);
    (((above + 1e-9) * 1e4).ceil() / 1e4).min(1.0) as f32
}

/// The share of `dev`'s examples of one class (should refuse or not) refused at `t`.
fn refused_share(dev: &[(f64, bool)], t: f32, refuse: bool) -> f64 {
    let n = dev.iter().filter(|d| d.1 == refuse).count().max(1);
    dev.iter()
        .filter(|d| d.1 == refuse && d.0 >= t as f64)
        .count() as f64
        / n as f64
}

/// The probe file's text as written (pretty JSON and a newline).
pub fn probe_text(file: &ProbeFile) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(file)? + "\n")
}

/// Where every layer's states are kept between runs (outside the work tree: tens of MB).
pub(crate) fn states_cache() -> PathBuf {
    std::env::var_os("DOCENT_MODEL_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/docent-models")))
        .unwrap_or_else(std::env::temp_dir)
        .join("refusal-states")
}

/// Which examples [`examples_and_states`] reads or makes.
#[derive(Clone, Copy)]
enum Set<'a> {
    Training,
    Calibration(&'a Calibration),
}

/// The model, loaded once for whichever step needs it first.
async fn generator_for(
    config: &Config,
    slot: &mut Option<docent::query::generate::SharedGenerator>,
) -> anyhow::Result<docent::query::generate::SharedGenerator> {
    if let Some(g) = slot {
        return Ok(g.clone());
    }
    let g =
        std::sync::Arc::new(docent::query::generate::Generator::load(&config.generation).await?);
    *slot = Some(g.clone());
    Ok(g)
}

/// Steps 1 and 2 for one set: its examples and their states (with the model file's
/// sha256), each from its file when it is there and not asked to be redone.
async fn examples_and_states(
    config: &Config,
    settings: &Settings,
    set: Set<'_>,
    generator: &mut Option<docent::query::generate::SharedGenerator>,
) -> anyhow::Result<(Vec<Example>, States, String)> {
    let (examples_path, states_path, tag) = match set {
        Set::Training => (&settings.examples, &settings.states, ""),
        Set::Calibration(c) => (&c.examples, &c.states, "-calibration"),
    };
    let examples: Vec<Example> = if settings.rebuild || !examples_path.is_file() {
        let g = generator_for(config, generator).await?;
        let examples = match set {
            Set::Training => build_examples(config, settings, g).await?,
            Set::Calibration(c) => build_calibration(config, settings, c, g).await?,
        };
        let mut f = std::io::BufWriter::new(std::fs::File::create(examples_path)?);
        for e in &examples {
            serde_json::to_writer(&mut f, e)?;
            f.write_all(b"\n")?;
        }
        f.flush()?;
        tracing::info!(examples = examples.len(), path = %examples_path.display(), "examples written");
        examples
    } else {
        read_jsonl(examples_path)?
    };
    // the committed states hold the probe's layer; every layer's are kept in the cache,
    // and read when there (the sweep is printed from them)
    let model_name = config.generation.model.display().to_string();
    let stem = model_name.rsplit('/').next().unwrap_or(&model_name);
    let text = std::fs::read(examples_path)?;
    let full = states_cache().join(format!("{stem}{tag}-{:016x}.states", fnv_bytes(&text)));
    let (states, sha) = if settings.extract || (!full.is_file() && !states_path.is_file()) {
        let model_file = docent::query::generate::catalog::resolve(&config.generation.model);
        let sha = probe::file_sha256(&model_file)
            .with_context(|| format!("hashing {}", model_file.display()))?;
        let g = generator_for(config, generator).await?;
        let states = extract(config, &g, &examples).await?;
        std::fs::create_dir_all(states_cache())?;
        states.write(&full, &sha)?;
        (states, sha)
    } else if full.is_file() {
        States::read(&full)?
    } else {
        States::read(states_path)?
    };
    if states.layers.len() > 1 {
        states
            .only(settings.layer)
            .with_context(|| format!("the states lack layer {}", settings.layer))?
            .write(states_path, &sha)?;
    }
    Ok((examples, states, sha))
}

/// All three steps, each from its file when it is there and not asked to be redone; the
/// calibration set's examples and states too, when it has questions or examples.
pub async fn run(config: &Config, settings: &Settings) -> anyhow::Result<Report> {
    let model_name = config.generation.model.display().to_string();
    let mut generator = None;
    let (examples, states, sha) =
        examples_and_states(config, settings, Set::Training, &mut generator).await?;
    let calibration = match settings
        .calibration
        .as_ref()
        .filter(|c| c.questions.is_file() || c.examples.is_file())
    {
        Some(c) => {
            let (e, s, c_sha) =
                examples_and_states(config, settings, Set::Calibration(c), &mut generator).await?;
            anyhow::ensure!(
                c_sha == sha,
                "the calibration states were read with another model file than the training states: extract them again (--extract)"
            );
            Some((e, s))
        }
        None => None,
    };
    let calibration = calibration.as_ref().map(|(e, s)| (e.as_slice(), s));
    let (examples, states) = match settings.labels {
        Labels::Corpus => corpus_labels(&examples, &states, &read_jsonl(&settings.questions)?),
        Labels::Passages => (examples, states),
    };
    let (file, report) = fit_probe(&examples, &states, calibration, &model_name, &sha, settings)?;
    if let Some(dir) = settings.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&settings.out, probe_text(&file)?)?;
    let mut report = report;
    if settings.time > 0 {
        let mut c = config.clone();
        c.generation.prefix_cache = false;
        let generator = docent::query::generate::Generator::load(&c.generation).await?;
        report.overhead_ms =
            Some(overhead(&c, &generator, &examples, settings.time, settings.layer).await?);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_sentence_is_taken_out_and_the_rest_kept() {
        let text = "Cargo builds code. Run cargo new to start a project! It makes a folder.\nAnother line with cargo new in it\nLast line.";
        let out = without_answer(text, &["cargo new".into()]);
        assert_eq!(out, "Cargo builds code. It makes a folder.\nLast line.");
        assert!(!contains_answer(&out, &["cargo new".into()]));
        assert_eq!(
            without_answer("No match here.", &["x y".into()]),
            "No match here."
        );
    }

    #[test]
    fn splits_follow_the_question_not_the_variant() {
        let dev = (0..1000)
            .filter(|i| split_of(&format!("q{i}")) == "dev")
            .count();
        assert!((150..250).contains(&dev), "{dev}");
        assert_eq!(split_of("t0042"), split_of("t0042"));
    }

    #[test]
    fn states_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let s = States {
            layers: vec![0, 1],
            hidden: 3,
            values: vec![
                vec![vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.5]],
                vec![vec![-1.0, 0.0, 1e-8], vec![7.0, 8.0, 9.0]],
            ],
        };
        let p = dir.path().join("s.states");
        s.write(&p, "abc").unwrap();
        let (back, sha) = States::read(&p).unwrap();
        assert_eq!((back.clone(), sha.as_str()), (s.clone(), "abc"));
        let one = back.only(1).unwrap();
        assert_eq!(one.values[1], vec![vec![7.0, 8.0, 9.0]]);
        // a truncated file is an error, not fewer examples
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        assert!(States::read(&p).is_err());
    }

    /// A one-layer example whose state is `x` (one dimension), of `split`.
    fn example(
        id: usize,
        split: &str,
        x: f32,
        refuse: bool,
        answerable: Option<bool>,
    ) -> (Example, Vec<Vec<f32>>) {
        let e = Example {
            id: format!("q{id}/retrieved"),
            origin: "test".into(),
            variant: "retrieved".into(),
            split: split.into(),
            question: format!("q{id}"),
            passages: Vec::new(),
            refuse,
            answerable,
        };
        (e, vec![vec![x, 0.5]])
    }

    fn settings() -> Settings {
        Settings {
            labels: Labels::Passages,
            questions: PathBuf::new(),
            corpora: Vec::new(),
            encyclo: None,
            examples: PathBuf::new(),
            states: PathBuf::new(),
            out: PathBuf::new(),
            layer: 0,
            method: Method::Logistic { c: 1.0 },
            max_false_refusals: 0.05,
            rebuild: false,
            extract: false,
            time: 0,
            calibration: None,
        }
    }

    /// Corpus labels: an answerable question whose passages missed the answer is not a
    /// refusal, an unanswerable one is, answer-removed variants go, examples of questions
    /// without a label keep the passages' label, and each state stays with its example.
    #[test]
    fn corpus_labels_follow_the_question_not_the_passages() {
        let q = |id: &str, answerable: bool| Question {
            id: id.into(),
            corpus: "rust-book".into(),
            text: String::new(),
            answerable,
            answer: None,
        };
        let questions = [q("q1", true), q("q2", false)];
        let (mut e1, v1) = example(1, "train", 1.0, true, None);
        let (mut removed, v1r) = example(1, "train", 2.0, true, None);
        removed.id = "q1/answer_removed".into();
        removed.variant = "answer_removed".into();
        let (e2, v2) = example(2, "train", 3.0, false, None);
        let (e3, v3) = example(3, "dev", 4.0, true, None);
        e1.origin = "rust-book".into();
        let states = States {
            layers: vec![0],
            hidden: 2,
            values: vec![v1, v1r, v2, v3],
        };
        let (kept, s) = corpus_labels(&[e1, removed, e2, e3], &states, &questions);
        let got: Vec<(&str, bool, Option<bool>, f32)> = kept
            .iter()
            .zip(&s.values)
            .map(|(e, v)| (e.id.as_str(), e.refuse, e.answerable, v[0][0]))
            .collect();
        assert_eq!(
            got,
            vec![
                ("q1/retrieved", false, Some(true), 1.0),
                ("q2/retrieved", true, Some(false), 3.0),
                ("q3/retrieved", true, None, 4.0),
            ]
        );
    }

    /// The threshold follows the calibration set's answerable questions when there is one:
    /// its answerable questions score like dev's refusals here (their passages missed the
    /// answer), so a threshold chosen on dev would refuse most of them.
    #[test]
    fn the_calibration_set_chooses_the_threshold() {
        let mut train = Vec::new();
        for i in 0..200 {
            let refuse = i % 2 == 0;
            let split = if i % 5 == 0 { "dev" } else { "train" };
            let x = if refuse { 1.0 } else { -1.0 } + (i % 7) as f32 * 0.05;
            train.push(example(i, split, x, refuse, None));
        }
        let (examples, values): (Vec<Example>, Vec<_>) = train.into_iter().unzip();
        let states = States {
            layers: vec![0],
            hidden: 2,
            values,
        };
        let (dev_file, dev_report) =
            fit_probe(&examples, &states, None, "m", "sha", &settings()).unwrap();
        assert!(dev_report.calibration.is_none());
        assert!(dev_report.dev_false_refusals <= 0.05);
        // calibration: 40 answerable questions spread from dev's answer side to its refuse
        // side, 40 unanswerable on the refuse side
        let mut cal = Vec::new();
        for i in 0..40 {
            cal.push(example(
                1000 + i,
                "calibration",
                -1.0 + i as f32 * 0.05,
                true,
                Some(true),
            ));
            cal.push(example(
                2000 + i,
                "calibration",
                1.5 + i as f32 * 0.01,
                true,
                Some(false),
            ));
        }
        let (cal_examples, cal_values): (Vec<Example>, Vec<_>) = cal.into_iter().unzip();
        let cal_states = States {
            layers: vec![0],
            hidden: 2,
            values: cal_values,
        };
        let (file, report) = fit_probe(
            &examples,
            &states,
            Some((&cal_examples, &cal_states)),
            "m",
            "sha",
            &settings(),
        )
        .unwrap();
        let c = report.calibration.expect("a calibration report");
        assert_eq!((c.examples, c.unanswerable), (80, 40));
        assert!(c.false_refusals <= 0.05, "{}", c.false_refusals);
        assert!(c.refused > 0.9, "{}", c.refused);
        // the same weights, a higher threshold than dev's, and the file says where it came from
        assert_eq!(file.weights, dev_file.weights);
        assert!(
            file.threshold > dev_file.threshold,
            "{} vs {}",
            file.threshold,
            dev_file.threshold
        );
        assert_eq!(file.training["threshold_from"], "calibration");
        // at dev's threshold most of the calibration's answerable questions are refused
        let scores: Vec<(f64, bool)> = calibration_scores(
            &Probe::new("m", "sha", 0, file.weights.clone(), file.scale, file.bias),
            &cal_examples,
            &cal_states,
            0,
        )
        .unwrap();
        assert!(refused_share(&scores, dev_file.threshold, false) > 0.3);
    }
}
