//! The meaning half of the prompt-injection detector: a small MLP (384 → 64 → 1) on the
//! MiniLM vector that retrieval already computes for every question and chunk, beside the
//! n-gram classifier ([`super::classifier`]). A text is flagged when either flags it.
//!
//! The vector of a whole text carries English overrides, prompt extraction and encodings
//! (held-out +4 to +7 points over the n-grams alone) at no cost for a question, whose vector
//! retrieval needs anyway; it carries little of a task planted in a long document.
//! Trained by `training/injection/dense_head.py` (the threshold chosen on the dev split)
//! and shipped in `injection_dense.model` beside this file.

use std::sync::LazyLock;

const MAGIC: &[u8; 8] = b"DOCPD001";

/// A trained head: `hidden` ReLU units over a `dim`-long unit vector, one output logit.
#[derive(Clone)]
pub struct Head {
    pub dim: usize,
    pub hidden: usize,
    /// `hidden` rows of `dim` weights.
    pub w1: Vec<f32>,
    pub b1: Vec<f32>,
    pub w2: Vec<f32>,
    pub b2: f32,
    /// The logit at or above which a vector is flagged.
    pub threshold: f32,
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

    /// `DOCPD001`, dim and hidden (u32 LE), the threshold (f32 LE), then W1 (hidden rows of
    /// dim), b1, W2 and b2, f32 LE: what `training/injection/dense_head.py` writes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(20 + 4 * (self.w1.len() + 2 * self.hidden + 1));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(self.dim as u32).to_le_bytes());
        out.extend_from_slice(&(self.hidden as u32).to_le_bytes());
        out.extend_from_slice(&self.threshold.to_le_bytes());
        for x in self.w1.iter().chain(&self.b1).chain(&self.w2) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&self.b2.to_le_bytes());
        out
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self, String> {
        let bad = |why: &str| format!("not a docent injection head ({} bytes): {why}", b.len());
        if b.get(..8) != Some(MAGIC.as_slice()) || b.len() < 20 {
            return Err(bad("no DOCPD001 header"));
        }
        let u = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
        let (dim, hidden) = (u(8), u(12));
        let floats = dim
            .checked_mul(hidden)
            .and_then(|n| n.checked_add(2 * hidden + 1))
            .ok_or_else(|| bad("sizes overflow"))?;
        if dim == 0 || hidden == 0 || b.len() != 20 + 4 * floats {
            return Err(bad(&format!(
                "expected {} bytes for {dim} × {hidden}",
                20 + 4 * floats
            )));
        }
        let f: Vec<f32> = b[16..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (threshold, rest) = (f[0], &f[1..]);
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
        let mut cut = h.to_bytes();
        cut.pop();
        assert!(Head::from_bytes(&cut).is_err());
        assert!(Head::from_bytes(b"DOCPD001").is_err());
    }

    #[test]
    fn the_shipped_head_reads_minilm_vectors() {
        let h = &*BUILTIN;
        assert_eq!((h.dim, h.hidden), (384, 64));
        // the zero vector scores the biases alone: finite, and a real vector is scored
        assert!(h.logit(&[0.0; 384]).is_some_and(f32::is_finite));
    }
}
