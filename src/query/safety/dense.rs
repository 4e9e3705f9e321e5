//! The meaning half of the prompt-injection detector: a small MLP (384 → 64 → 1) on the
//! MiniLM vector that retrieval computes for every question, beside the n-gram classifier
//! ([`super::classifier`]). A question is flagged when either flags it.
//!
//! The vector of a whole text carries English overrides, prompt extraction and encodings
//! (held-out +6 to +11 points over the n-grams alone, docs/evaluation.md); it carries little
//! of a task planted in a long document, so chunks are left to the classifier.
//! Trained by `training/injection/dense_head.py` (the threshold chosen on the dev split)
//! and shipped in `injection_dense.model` beside this file, with a probe sentence and its
//! vector: at start-up the service embeds the probe, and a vector far from the stored one
//! means another embedding model, for which the head is switched off ([`Head::fits`]).

use std::sync::LazyLock;

const MAGIC: &[u8; 8] = b"DOCPD002";
/// The cosine at or above which the service's vector of the probe counts as the trained one
/// (the int8 export of the same model gives about 0.99; another model, far less).
const FITS_COSINE: f32 = 0.98;

/// A trained head: `hidden` ReLU units over a `dim`-long unit vector, one output logit.
#[derive(Clone)]
pub struct Head {
    /// Length of the input vector (the embedding model's dimension).
    pub dim: usize,
    /// Number of hidden ReLU units.
    pub hidden: usize,
    /// `hidden` rows of `dim` weights.
    pub w1: Vec<f32>,
    /// The hidden units' biases (`hidden` of them).
    pub b1: Vec<f32>,
    /// The output's weights over the hidden units (`hidden` of them).
    pub w2: Vec<f32>,
    /// The output's bias.
    pub b2: f32,
    /// The logit at or above which a vector is flagged.
    pub threshold: f32,
    /// A sentence, its vector under the model the head was trained on, and the head's
    /// logit there as the trainer computed it.
    pub probe: String,
    /// The probe's vector under the model the head was trained on.
    pub probe_vector: Vec<f32>,
    /// The head's logit at `probe_vector`, as the trainer computed it.
    pub probe_logit: f32,
}

impl std::fmt::Debug for Head {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Head")
            .field("dim", &self.dim)
            .field("hidden", &self.hidden)
            .field("threshold", &self.threshold)
            .finish()
    }
}

impl Head {
    /// The head's logit for `v`, or `None` when `v` is not `dim` long (a vector of another
    /// embedding model: the head does not apply).
    pub fn logit(&self, v: &[f32]) -> Option<f32> {
        if v.len() != self.dim {
            return None;
        }
        let mut out = self.b2;
        for (j, row) in self.w1.chunks_exact(self.dim).enumerate() {
            let a = self.b1[j] + row.iter().zip(v).map(|(w, x)| w * x).sum::<f32>();
            out += self.w2[j] * a.max(0.0);
        }
        Some(out)
    }

    /// Whether the head flags `v` (never for a vector of another length).
    pub fn flags(&self, v: &[f32]) -> bool {
        self.logit(v).is_some_and(|z| z >= self.threshold)
    }

    /// Whether `probe_vector`, the service's embedding of [`Self::probe`], is the vector the
    /// head was trained with (same length, cosine at least 0.98): the same embedding model.
    pub fn fits(&self, probe_vector: &[f32]) -> bool {
        probe_vector.len() == self.probe_vector.len()
            && crate::query::embed::cosine(probe_vector, &self.probe_vector) >= FITS_COSINE
    }

    /// `DOCPD002`, dim and hidden (u32 LE), the threshold and the probe's logit (f32 LE),
    /// the probe's length in bytes (u32 LE) and its UTF-8, the probe's vector (dim f32 LE),
    /// then W1 (hidden rows of dim), b1, W2 and b2, f32 LE: what
    /// `training/injection/dense_head.py` writes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(self.dim as u32).to_le_bytes());
        out.extend_from_slice(&(self.hidden as u32).to_le_bytes());
        out.extend_from_slice(&self.threshold.to_le_bytes());
        out.extend_from_slice(&self.probe_logit.to_le_bytes());
        out.extend_from_slice(&(self.probe.len() as u32).to_le_bytes());
        out.extend_from_slice(self.probe.as_bytes());
        let floats = self
            .probe_vector
            .iter()
            .chain(&self.w1)
            .chain(&self.b1)
            .chain(&self.w2);
        for x in floats.chain(std::iter::once(&self.b2)) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out
    }

    /// Reads what [`Self::to_bytes`] writes; an error for another format or a wrong length.
    pub fn from_bytes(b: &[u8]) -> Result<Self, String> {
        let bad = |why: &str| format!("not a docent injection head ({} bytes): {why}", b.len());
        if b.get(..8) != Some(MAGIC.as_slice()) || b.len() < 28 {
            return Err(bad("no DOCPD002 header"));
        }
        let u = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
        let f = |at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let (dim, hidden, threshold, probe_logit, probe_len) = (u(8), u(12), f(16), f(20), u(24));
        let probe = b
            .get(28..28 + probe_len)
            .and_then(|p| std::str::from_utf8(p).ok())
            .ok_or_else(|| bad("the probe is cut or not UTF-8"))?
            .to_string();
        let at = 28 + probe_len;
        let floats = dim
            .checked_mul(hidden + 1)
            .and_then(|n| n.checked_add(2 * hidden + 1))
            .and_then(|n| n.checked_mul(4))
            .and_then(|n| n.checked_add(at))
            .ok_or_else(|| bad("sizes overflow"))?;
        if dim == 0 || hidden == 0 || b.len() != floats {
            return Err(bad(&format!(
                "expected {floats} bytes for {dim} × {hidden}"
            )));
        }
        let v: Vec<f32> = b[at..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (probe_vector, rest) = v.split_at(dim);
        let (w1, rest) = rest.split_at(dim * hidden);
        let (b1, rest) = rest.split_at(hidden);
        let (w2, rest) = rest.split_at(hidden);
        Ok(Head {
            dim,
            hidden,
            w1: w1.to_vec(),
            b1: b1.to_vec(),
            w2: w2.to_vec(),
            b2: rest[0],
            threshold,
            probe,
            probe_vector: probe_vector.to_vec(),
            probe_logit,
        })
    }
}

/// The shipped head (`injection_dense.model`).
pub static BUILTIN: LazyLock<Head> = LazyLock::new(|| {
    Head::from_bytes(include_bytes!("injection_dense.model")).unwrap_or_else(|e| {
        // the file is part of the source tree; a broken one is a build defect
        panic!("src/query/safety/injection_dense.model: {e}")
    })
});

#[cfg(test)]
mod tests {
    use super::*;

    /// Two hidden units over 3 dimensions, by hand.
    fn small() -> Head {
        Head {
            dim: 3,
            hidden: 2,
            w1: vec![1.0, 0.0, 0.0, 0.0, -1.0, 0.0],
            b1: vec![0.0, 0.5],
            w2: vec![2.0, 1.0],
            b2: -1.0,
            threshold: 0.0,
            probe: "a probe".into(),
            probe_vector: vec![0.6, 0.8, 0.0],
            probe_logit: 0.0,
        }
    }

    #[test]
    fn the_head_is_a_relu_mlp_and_its_file_round_trips() {
        let h = small();
        // unit 0: relu(x0) = 1 → 2; unit 1: relu(0.5 - x1) = relu(0.5 - 1) = 0 → 0; -1 + 2
        assert_eq!(h.logit(&[1.0, 1.0, 0.0]), Some(1.0));
        // unit 0: relu(-1) = 0; unit 1: relu(0.5 + 1) = 1.5 → 1.5; -1 + 1.5
        assert_eq!(h.logit(&[-1.0, -1.0, 0.0]), Some(0.5));
        assert_eq!(h.logit(&[0.0, 2.0, 0.0]), Some(-1.0));
        assert!(h.flags(&[1.0, 1.0, 0.0]) && !h.flags(&[0.0, 2.0, 0.0]));
        // another model's vector: no opinion
        assert_eq!(h.logit(&[1.0; 4]), None);
        assert!(!h.flags(&[1.0; 384]));
        let back = Head::from_bytes(&h.to_bytes()).expect("round trip");
        assert_eq!(back.logit(&[-1.0, -1.0, 0.0]), Some(0.5));
        assert_eq!((back.dim, back.hidden, back.threshold), (3, 2, 0.0));
        assert_eq!(
            (back.probe.as_str(), back.probe_vector.as_slice()),
            ("a probe", [0.6, 0.8, 0.0].as_slice())
        );
        // the probe fits itself, a near vector, not another direction or length
        assert!(h.fits(&[0.6, 0.8, 0.0]) && h.fits(&[0.62, 0.78, 0.01]));
        assert!(!h.fits(&[0.8, -0.6, 0.0]) && !h.fits(&[0.6, 0.8]) && !h.fits(&[0.0; 3]));
        let mut cut = h.to_bytes();
        cut.pop();
        assert!(Head::from_bytes(&cut).is_err());
        assert!(Head::from_bytes(b"DOCPD001").is_err());
    }

    #[test]
    fn the_shipped_head_computes_what_its_trainer_computed() {
        let h = &*BUILTIN;
        assert_eq!((h.dim, h.hidden), (384, 64));
        // numpy's logit on the probe's vector, stored beside it: the same weights read in
        // the same layout give it back (a transposed W1 or a shifted bias would not)
        let z = h.logit(&h.probe_vector).expect("384 long");
        assert!((z - h.probe_logit).abs() < 1e-3, "{z} vs {}", h.probe_logit);
        // the probe is an attack, and the head flags it
        assert!(h.flags(&h.probe_vector), "{z}");
        assert!(h.fits(&h.probe_vector));
    }
}
