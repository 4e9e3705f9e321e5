//! The refusal probe: whether the passages answer the question, read off the model's own
//! hidden state at the prompt's last token (issue 54).
//!
//! During the prefill that gives an answer's first token, the vendored engine hands the
//! residual stream after every decoder layer at the prompt's last position to the request's
//! logits processors (vendor/PATCHES.md 20). A probe is a direction in that space at one
//! layer: a logistic regression on the standardised states (the shipped probes; or the
//! difference of the class means, Lavi, Milo and Geva, EACL 2026), trained on prompts of our
//! own questions labelled by whether the corpus answers the question (`docent train-refusal
//! --labels`), that turns the state into a probability. Scoring is one dot product on a
//! state the prefill computes anyway.
//!
//! A probe belongs to one model file: it names the file's sha256, which is checked when the
//! generator loads ([`Probe::for_model`]). The shipped probes are compiled in (named by
//! `models.toml`'s `refusal_probe`); `generation.refusal_probe` names a file of one's own
//! (`docent train-refusal` writes them). This module is not for training: that is
//! `tools::train_refusal`, which uses [`fit`] here so both read the same arithmetic.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// The probe files' format tag.
pub const FORMAT: &str = "docent-refusal-probe/1";

/// The probes shipped with docent, by the file name `models.toml` gives them.
const SHIPPED: &[(&str, &str)] = &[
    (
        "qwen2.5-coder-0.5b.refusal.json",
        include_str!("../../training/refusal/probes/qwen2.5-coder-0.5b.refusal.json"),
    ),
    (
        "qwen2.5-coder-1.5b.refusal.json",
        include_str!("../../training/refusal/probes/qwen2.5-coder-1.5b.refusal.json"),
    ),
];

/// The shipped probe file called `name`, if docent ships one.
pub fn shipped(name: &str) -> Option<&'static str> {
    SHIPPED.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// Why a probe cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The probe file could not be read.
    #[error("reading the refusal probe {path}: {message}")]
    Read {
        /// The probe file.
        path: PathBuf,
        /// Why it could not be read.
        message: String,
    },
    /// The text is not a probe file of this format, or its contents do not fit together.
    #[error("the refusal probe {name} is not a {FORMAT} file: {message}")]
    Format {
        /// The probe's name (its file, or the shipped probe's name).
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// The probe was trained for another model file than the one loaded.
    #[error(
        "the refusal probe {name} was trained for the model file with sha256 {expected}, but \
         {model} has sha256 {found}; run `make setup` to restore the pinned model, train a probe \
         for this file (`docent train-refusal --model {model}`) and name it in \
         generation.refusal_probe, or set generation.refusal = \"first_token\""
    )]
    ModelMismatch {
        /// The probe's name (its file).
        name: String,
        /// The model file loaded.
        model: String,
        /// The sha256 of the model file the probe was trained for.
        expected: String,
        /// The sha256 of the model file loaded.
        found: String,
    },
}

/// A probe file: the direction, the logistic fit and the threshold chosen on the dev split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeFile {
    /// The format tag, [`FORMAT`].
    pub format: String,
    /// The catalog name (or file name) of the model it was trained for.
    pub model: String,
    /// That model file's sha256.
    pub model_sha256: String,
    /// The layer whose output is read (0: after the first decoder layer).
    pub layer: usize,
    /// Weights over the state (the direction, scaled per dimension).
    pub weights: Vec<f32>,
    /// The logistic fit: probability = sigmoid(scale × (weights · state) + bias).
    pub scale: f32,
    /// The logistic fit's offset (see `scale`).
    pub bias: f32,
    /// The threshold (refused at or above), chosen on the calibration set (natural
    /// questions written apart) or, without one, on the dev split.
    pub threshold: f32,
    /// How it was trained: data, counts and dev figures (for people; not read).
    pub training: serde_json::Value,
}

/// A probe ready to score states.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// The probe as its file holds it.
    pub file: ProbeFile,
}

impl Probe {
    /// A probe over `layer` (threshold 0.5 until one is chosen; no training notes).
    pub fn new(
        model: &str,
        model_sha256: &str,
        layer: usize,
        weights: Vec<f32>,
        scale: f32,
        bias: f32,
    ) -> Probe {
        Probe {
            file: ProbeFile {
                format: FORMAT.into(),
                model: model.into(),
                model_sha256: model_sha256.into(),
                layer,
                weights,
                scale,
                bias,
                threshold: 0.5,
                training: serde_json::Value::Null,
            },
        }
    }

    /// Parses a probe file's text (`name` for messages).
    pub fn parse(name: &str, text: &str) -> Result<Probe, ProbeError> {
        let format = |message: String| ProbeError::Format {
            name: name.to_string(),
            message,
        };
        let file: ProbeFile = serde_json::from_str(text).map_err(|e| format(e.to_string()))?;
        if file.format != FORMAT {
            return Err(format(format!("format is {:?}", file.format)));
        }
        if file.weights.is_empty() || file.weights.iter().any(|w| !w.is_finite()) {
            return Err(format("weights are empty or not finite".into()));
        }
        if !(file.scale.is_finite() && file.bias.is_finite() && file.threshold.is_finite()) {
            return Err(format("scale, bias and threshold must be finite".into()));
        }
        Ok(Probe { file })
    }

    /// Reads a probe file from disk.
    pub fn read(path: &Path) -> Result<Probe, ProbeError> {
        let text = std::fs::read_to_string(path).map_err(|e| ProbeError::Read {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Probe::parse(&path.display().to_string(), &text)
    }

    /// The probe checked against the model file it will read: `model_sha256` is the file's
    /// sha256 (hashed once per process and file, see [`file_sha256`]).
    pub fn for_model(
        self,
        name: &str,
        model_file: &Path,
        model_sha256: &str,
    ) -> Result<Probe, ProbeError> {
        if !self.file.model_sha256.eq_ignore_ascii_case(model_sha256) {
            return Err(ProbeError::ModelMismatch {
                name: name.to_string(),
                model: model_file.display().to_string(),
                expected: self.file.model_sha256.clone(),
                found: model_sha256.to_string(),
            });
        }
        Ok(self)
    }

    /// The probability that the documents do not answer the question, from the states of every
    /// layer (`None` when the model gave fewer layers or another width than the probe's).
    pub fn score(&self, states: &[Vec<f32>]) -> Option<f32> {
        let state = states.get(self.file.layer)?;
        if state.len() != self.file.weights.len() {
            return None;
        }
        let dot: f64 = state
            .iter()
            .zip(&self.file.weights)
            .map(|(&s, &w)| s as f64 * w as f64)
            .sum();
        Some(sigmoid(self.file.scale as f64 * dot + self.file.bias as f64) as f32)
    }
}

/// The logistic function.
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The sha256 of a model file, hashed once per process for each (path, size, modified).
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::collections::HashMap;
    use std::sync::LazyLock;
    type Key = (PathBuf, u64, Option<std::time::SystemTime>);
    static SEEN: LazyLock<Mutex<HashMap<Key, String>>> = LazyLock::new(Default::default);
    let meta = std::fs::metadata(path)?;
    let key = (
        std::fs::canonicalize(path)?,
        meta.len(),
        meta.modified().ok(),
    );
    if let Some(h) = SEEN.lock().ok().and_then(|s| s.get(&key).cloned()) {
        return Ok(h);
    }
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    let hash = hex::encode(hasher.finalize());
    if let Ok(mut seen) = SEEN.lock() {
        seen.insert(key, hash.clone());
    }
    Ok(hash)
}

/// A logits processor that only keeps the prompt's hidden states (for training and tests).
#[derive(Default)]
pub struct StateReader {
    /// The layers to read (empty: every layer).
    pub layers: Vec<usize>,
    /// The states at the prompt's last token, one per layer read, once the prefill ran.
    pub states: Mutex<Option<Vec<Vec<f32>>>>,
}

impl mistralrs::CustomLogitsProcessor for StateReader {
    fn apply(
        &self,
        logits: &mistralrs::Tensor,
        _context: &[u32],
    ) -> mistralrs::Result<mistralrs::Tensor> {
        Ok(logits.clone())
    }

    fn hidden_state_layers(&self) -> Option<Vec<usize>> {
        Some(self.layers.clone())
    }

    fn observe_hidden_states(&self, states: &[Vec<f32>]) {
        if let Ok(mut s) = self.states.lock() {
            *s = Some(states.to_vec());
        }
    }
}

/// A probe's score for one request, set during its prefill (the last prompt chunk's call
/// wins) and read at the answer's first step.
#[derive(Default)]
pub struct ProbeScore(Mutex<Option<f32>>);

impl ProbeScore {
    /// Records the score (`None`: the states did not fit the probe); a later call replaces it.
    pub fn set(&self, score: Option<f32>) {
        if let Ok(mut s) = self.0.lock() {
            *s = score;
        }
    }

    /// The score recorded, if any.
    pub fn get(&self) -> Option<f32> {
        self.0.lock().ok().and_then(|s| *s)
    }
}

/// The probe a request reads with, and where its score goes.
#[derive(Clone)]
pub struct ProbeRead {
    /// The probe to score the prompt's state with.
    pub probe: Arc<Probe>,
    /// Where the score goes.
    pub score: Arc<ProbeScore>,
}

// ---- training arithmetic (shared with `docent train-refusal`) ----

/// One training example's state at the probe's layer and whether its passages do not hold
/// the answer (`true`: should be refused).
pub struct Labelled<'a> {
    /// The hidden state at the probe's layer, at the prompt's last token.
    pub state: &'a [f32],
    /// True when the passages do not hold the answer (the question should be refused).
    pub refuse: bool,
}

/// A direction and its logistic fit over `examples`: the difference of the class means,
/// each dimension divided by its pooled variance (a diagonal linear discriminant; with
/// `whiten = false` the plain difference of means), then `scale` and `bias` by Newton's
/// method on the projections. Deterministic: fixed order, f64 sums.
pub fn fit(examples: &[Labelled<'_>], whiten: bool) -> Option<(Vec<f32>, f32, f32)> {
    let dim = examples.first()?.state.len();
    let (mut sum, mut count) = ([vec![0f64; dim], vec![0f64; dim]], [0usize; 2]);
    for e in examples {
        if e.state.len() != dim {
            return None;
        }
        let c = e.refuse as usize;
        count[c] += 1;
        for (s, &x) in sum[c].iter_mut().zip(e.state) {
            *s += x as f64;
        }
    }
    if count[0] == 0 || count[1] == 0 {
        return None;
    }
    let mean: Vec<Vec<f64>> = (0..2)
        .map(|c| sum[c].iter().map(|s| s / count[c] as f64).collect())
        .collect();
    let mut var = vec![0f64; dim];
    for e in examples {
        let m = &mean[e.refuse as usize];
        for ((v, &x), mu) in var.iter_mut().zip(e.state).zip(m) {
            let d = x as f64 - mu;
            *v += d * d;
        }
    }
    let n = examples.len() as f64;
    // a floor keeps near-constant dimensions from dominating
    let floor = var.iter().sum::<f64>() / n / dim as f64 * 1e-2;
    let weights: Vec<f64> = (0..dim)
        .map(|i| {
            let d = mean[1][i] - mean[0][i];
            if whiten {
                d / (var[i] / n).max(floor)
            } else {
                d
            }
        })
        .collect();
    let norm = weights.iter().map(|w| w * w).sum::<f64>().sqrt().max(1e-12);
    let weights: Vec<f64> = weights.iter().map(|w| w / norm).collect();
    let project = |s: &[f32]| -> f64 { s.iter().zip(&weights).map(|(&x, w)| x as f64 * w).sum() };
    let points: Vec<(f64, bool)> = examples
        .iter()
        .map(|e| (project(e.state), e.refuse))
        .collect();
    let (scale, bias) = logistic_1d(&points);
    Some((
        weights.iter().map(|&w| w as f32).collect(),
        scale as f32,
        bias as f32,
    ))
}

/// An L2-regularised logistic regression over `examples` (a linear probe): each dimension
/// standardised by the examples' mean and spread, then Newton's method on
/// `c` × Σ log-loss + ½ |w|² (the intercept not penalised), folded back so the weights and
/// bias apply to the raw state. Deterministic: fixed order, f64 sums, a Cholesky solve.
pub fn fit_logistic(examples: &[Labelled<'_>], c: f64) -> Option<(Vec<f32>, f32)> {
    let dim = examples.first()?.state.len();
    let n = examples.len();
    if examples.iter().any(|e| e.state.len() != dim)
        || examples.iter().all(|e| e.refuse)
        || examples.iter().all(|e| !e.refuse)
    {
        return None;
    }
    let mut mean = vec![0f64; dim];
    for e in examples {
        for (m, &x) in mean.iter_mut().zip(e.state) {
            *m += x as f64 / n as f64;
        }
    }
    let mut sd = vec![0f64; dim];
    for e in examples {
        for ((v, &x), m) in sd.iter_mut().zip(e.state).zip(&mean) {
            *v += (x as f64 - m).powi(2) / n as f64;
        }
    }
    let sd: Vec<f64> = sd.iter().map(|v| v.sqrt() + 1e-3).collect();
    // standardised rows with a trailing 1 for the intercept
    let rows: Vec<Vec<f64>> = examples
        .iter()
        .map(|e| {
            let mut r: Vec<f64> = e
                .state
                .iter()
                .zip(&mean)
                .zip(&sd)
                .map(|((&x, m), s)| (x as f64 - m) / s)
                .collect();
            r.push(1.0);
            r
        })
        .collect();
    let d = dim + 1;
    let mut w = vec![0f64; d];
    for _ in 0..50 {
        let mut grad: Vec<f64> = w.clone();
        grad[dim] = 0.0;
        let mut hess = vec![0f64; d * d];
        for i in 0..dim {
            hess[i * d + i] = 1.0;
        }
        for (r, e) in rows.iter().zip(examples) {
            let z: f64 = r.iter().zip(&w).map(|(a, b)| a * b).sum();
            let p = sigmoid(z);
            let g = c * (p - e.refuse as u8 as f64);
            let h = c * p * (1.0 - p);
            for (gi, ri) in grad.iter_mut().zip(r) {
                *gi += g * ri;
            }
            for i in 0..d {
                let hr = h * r[i];
                let row = &mut hess[i * d..i * d + i + 1];
                for (hij, rj) in row.iter_mut().zip(&r[..=i]) {
                    *hij += hr * rj;
                }
            }
        }
        // the lower triangle holds the Hessian: solve H Δ = g
        hess[dim * d + dim] += 1e-9;
        let step = cholesky_solve(&mut hess, d, &grad)?;
        let size: f64 = step.iter().map(|v| v.abs()).fold(0.0, f64::max);
        for (wi, si) in w.iter_mut().zip(&step) {
            *wi -= si;
        }
        if size < 1e-10 {
            break;
        }
    }
    let weights: Vec<f32> = (0..dim).map(|i| (w[i] / sd[i]) as f32).collect();
    let bias = w[dim] - (0..dim).map(|i| w[i] * mean[i] / sd[i]).sum::<f64>();
    Some((weights, bias as f32))
}

/// Solves `a x = b` for a symmetric positive-definite `a` (n × n, row-major, lower triangle
/// read, overwritten by its Cholesky factor); `None` when it is not positive definite.
fn cholesky_solve(a: &mut [f64], n: usize, b: &[f64]) -> Option<Vec<f64>> {
    for j in 0..n {
        let mut diag = a[j * n + j];
        for k in 0..j {
            diag -= a[j * n + k] * a[j * n + k];
        }
        if diag <= 0.0 || !diag.is_finite() {
            return None;
        }
        let diag = diag.sqrt();
        a[j * n + j] = diag;
        for i in j + 1..n {
            let mut v = a[i * n + j];
            for k in 0..j {
                v -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = v / diag;
        }
    }
    let mut y = b.to_vec();
    for i in 0..n {
        for k in 0..i {
            y[i] -= a[i * n + k] * y[k];
        }
        y[i] /= a[i * n + i];
    }
    for i in (0..n).rev() {
        for k in i + 1..n {
            y[i] -= a[k * n + i] * y[k];
        }
        y[i] /= a[i * n + i];
    }
    Some(y)
}

/// `a`, `b` of p = sigmoid(a x + b) by Newton's method (a small ridge keeps separable data
/// finite).
pub fn logistic_1d(points: &[(f64, bool)]) -> (f64, f64) {
    let n = points.len().max(1) as f64;
    let mean = points.iter().map(|p| p.0).sum::<f64>() / n;
    let sd = (points.iter().map(|p| (p.0 - mean).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(1e-12);
    // on standardised x, then mapped back
    let (mut a, mut b) = (0f64, 0f64);
    let ridge = 1e-2;
    for _ in 0..100 {
        let (mut ga, mut gb, mut haa, mut hab, mut hbb) = (ridge * a, 0f64, ridge, 0f64, 0f64);
        for &(x, y) in points {
            let z = (x - mean) / sd;
            let p = sigmoid(a * z + b);
            let r = p - y as u8 as f64;
            let w = p * (1.0 - p);
            ga += r * z;
            gb += r;
            haa += w * z * z;
            hab += w * z;
            hbb += w;
        }
        let det = haa * hbb - hab * hab;
        if det.abs() < 1e-18 {
            break;
        }
        let da = (hbb * ga - hab * gb) / det;
        let db = (haa * gb - hab * ga) / det;
        a -= da;
        b -= db;
        if da.abs() + db.abs() < 1e-12 {
            break;
        }
    }
    (a / sd, b - a * mean / sd)
}

/// The area under the ROC curve of `scores` (higher: more likely `true`), ties counted half.
pub fn auroc(scores: &[(f64, bool)]) -> f64 {
    let pos = scores.iter().filter(|s| s.1).count();
    let neg = scores.len() - pos;
    if pos == 0 || neg == 0 {
        return 0.5;
    }
    let mut wins = 0f64;
    for &(p, _) in scores.iter().filter(|s| s.1) {
        for &(q, _) in scores.iter().filter(|s| !s.1) {
            wins += if p > q {
                1.0
            } else if p == q {
                0.5
            } else {
                0.0
            };
        }
    }
    wins / (pos * neg) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(layer: usize, weights: Vec<f32>, scale: f32, bias: f32) -> Probe {
        Probe::new("m", &"ab".repeat(32), layer, weights, scale, bias)
    }

    #[test]
    fn the_score_is_the_logistic_of_the_layers_projection() {
        let p = probe(1, vec![1.0, -1.0], 2.0, -1.0);
        let states = vec![vec![9.0, 9.0], vec![1.0, 0.5]];
        // 2 × (1 − 0.5) − 1 = 0 → 0.5
        assert!((p.score(&states).unwrap() - 0.5).abs() < 1e-6);
        let states = vec![vec![0.0, 0.0], vec![3.0, 0.0]];
        assert!(p.score(&states).unwrap() > 0.99);
        // too few layers or another width: no score
        assert_eq!(p.score(&states[..1]), None);
        assert_eq!(p.score(&[vec![0.0], vec![1.0, 2.0, 3.0]]), None);
    }

    #[test]
    fn a_probe_for_another_model_file_is_refused_with_what_to_do() {
        let p = probe(0, vec![1.0], 1.0, 0.0);
        let e = p
            .clone()
            .for_model("x.json", Path::new("models/m.gguf"), &"cd".repeat(32))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("make setup") && e.contains("train-refusal"),
            "{e}"
        );
        assert!(e.contains("generation.refusal"), "{e}");
        assert!(p
            .for_model("x.json", Path::new("m"), &"AB".repeat(32))
            .is_ok());
    }

    #[test]
    fn probe_files_are_checked_when_parsed() {
        let good = serde_json::to_string(&probe(0, vec![1.0], 1.0, 0.0).file).unwrap();
        assert!(Probe::parse("g", &good).is_ok());
        let other = good.replace(FORMAT, "other/1");
        assert!(Probe::parse("o", &other).is_err());
        assert!(Probe::parse("e", "{").is_err());
        let empty = serde_json::to_string(&probe(0, vec![], 1.0, 0.0).file).unwrap();
        assert!(Probe::parse("w", &empty).is_err());
    }

    #[test]
    fn every_shipped_probe_parses() {
        for (name, text) in SHIPPED {
            let p = Probe::parse(name, text).unwrap();
            assert_eq!(p.file.model_sha256.len(), 64, "{name}");
        }
    }

    /// Uniform values in [-0.5, 0.5) from a fixed seed.
    fn uniform(seed: u64) -> impl FnMut() -> f32 {
        let mut rng = fastrand::Rng::with_seed(seed);
        move || rng.f32() - 0.5
    }

    /// Fits on the first half of `states` and gives the AUROC of the second half's scores.
    fn held_out_auroc(
        states: &[(Vec<f32>, bool)],
        fit: impl Fn(&[Labelled<'_>]) -> Option<(Vec<f32>, f32, f32)>,
    ) -> f64 {
        let (train, test) = states.split_at(states.len() / 2);
        let examples: Vec<Labelled> = train
            .iter()
            .map(|(s, r)| Labelled {
                state: s,
                refuse: *r,
            })
            .collect();
        let (w, scale, bias) = fit(&examples).unwrap();
        let p = probe(0, w, scale, bias);
        let scored: Vec<(f64, bool)> = test
            .iter()
            .map(|(s, r)| (p.score(std::slice::from_ref(s)).unwrap() as f64, *r))
            .collect();
        // the fit says which side is which: scores rise with the refused class
        auroc(&scored)
    }

    #[test]
    fn the_fit_separates_two_clouds_and_says_which_is_which() {
        // class 1 shifted along dimension 0; dimension 1 is noise of spread `noise`
        let clouds = |noise: f32| -> Vec<(Vec<f32>, bool)> {
            let mut next = uniform(7);
            (0..400)
                .map(|i| {
                    let refuse = i % 2 == 0;
                    let shift = if refuse { 1.0 } else { 0.0 };
                    (vec![shift + next() * 0.5, next() * noise], refuse)
                })
                .collect()
        };
        let auc = |noise, scaled| held_out_auroc(&clouds(noise), |e| fit(e, scaled));
        assert!(auc(0.5, false) > 0.9 && auc(0.5, true) > 0.9);
        // a noisy dimension pulls the plain difference of means off; scaled, it is not
        let (plain, scaled) = (auc(20.0, false), auc(20.0, true));
        assert!(scaled > 0.9 && scaled > plain + 0.1, "{plain} {scaled}");
        // one class only: nothing to fit
        let one = [Labelled {
            state: &[1.0],
            refuse: true,
        }];
        assert!(fit(&one, true).is_none());
    }

    #[test]
    fn the_logistic_probe_finds_a_direction_hidden_in_correlated_dimensions() {
        // the class is in x0 - x1; both carry a large shared term, so neither alone (nor
        // their means' difference) separates well
        let mut next = uniform(11);
        let states: Vec<(Vec<f32>, bool)> = (0..400)
            .map(|i| {
                let refuse = i % 2 == 0;
                let shared = next() * 20.0;
                let signal = if refuse { 0.5 } else { -0.5 } + next() * 0.3;
                (vec![shared + signal, shared, next()], refuse)
            })
            .collect();
        let logistic = |e: &[Labelled<'_>]| fit_logistic(e, 1.0).map(|(w, b)| (w, 1.0, b));
        let auc = held_out_auroc(&states, logistic);
        assert!(auc > 0.95, "{auc}");
        // the fit is a function of the data: the same twice
        let examples: Vec<Labelled> = states
            .iter()
            .map(|(s, r)| Labelled {
                state: s,
                refuse: *r,
            })
            .collect();
        assert_eq!(fit_logistic(&examples, 1.0), fit_logistic(&examples, 1.0));
        assert!(fit_logistic(&examples[..1], 1.0).is_none());
    }

    #[test]
    fn cholesky_solves_a_small_system() {
        let mut a = vec![4.0, 0.0, 2.0, 3.0];
        let x = cholesky_solve(&mut a, 2, &[2.0, 1.0]).unwrap();
        // [[4, 2], [2, 3]] x = [2, 1]: x = [0.5, 0]
        assert!((x[0] - 0.5).abs() < 1e-12 && x[1].abs() < 1e-12, "{x:?}");
        let mut not_pd = vec![-1.0, 0.0, 0.0, 1.0];
        assert!(cholesky_solve(&mut not_pd, 2, &[1.0, 1.0]).is_none());
    }

    #[test]
    fn auroc_counts_pairs() {
        assert_eq!(auroc(&[(1.0, true), (0.0, false)]), 1.0);
        assert_eq!(auroc(&[(0.0, true), (1.0, false)]), 0.0);
        assert_eq!(auroc(&[(1.0, true), (1.0, false)]), 0.5);
    }
}
