//! The peer that sparse search is measured against: a plain BM25 over whole documents
//! (lower-cased letter-and-digit runs, no stemming, no stop words; k1 = 1.2, b = 0.75), as
//! a few lines of Python would compute it. `docent eval` reports it as `bm25-doc`.

use std::collections::HashMap;

use super::CorpusLine;

/// An in-memory BM25 index over a corpus.
pub struct Bm25 {
    ids: Vec<String>,
    /// Term → (document index, term frequency).
    postings: HashMap<String, Vec<(usize, u32)>>,
    lengths: Vec<f32>,
    average: f32,
}

const K1: f32 = 1.2;
const B: f32 = 0.75;

/// Lower-cased runs of letters and digits.
pub fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_lowercase)
        .collect()
}

impl Bm25 {
    /// Indexes every document of `corpus` (its title and text together).
    pub fn new(corpus: &[CorpusLine]) -> Self {
        let mut postings: HashMap<String, Vec<(usize, u32)>> = HashMap::new();
        let mut lengths = Vec::with_capacity(corpus.len());
        for (i, doc) in corpus.iter().enumerate() {
            let text = format!("{} {}", doc.title, doc.text);
            let t = terms(&text);
            lengths.push(t.len() as f32);
            let mut tf: HashMap<String, u32> = HashMap::new();
            for term in t {
                *tf.entry(term).or_default() += 1;
            }
            for (term, n) in tf {
                postings.entry(term).or_default().push((i, n));
            }
        }
        let average = lengths.iter().sum::<f32>() / lengths.len().max(1) as f32;
        Bm25 {
            ids: corpus.iter().map(|c| c.id.clone()).collect(),
            postings,
            lengths,
            average,
        }
    }

    /// The `k` best document ids for `query`, best first.
    pub fn search(&self, query: &str, k: usize) -> Vec<String> {
        let n = self.ids.len() as f32;
        let mut scores: HashMap<usize, f32> = HashMap::new();
        let mut seen = Vec::new();
        for term in terms(query) {
            // a repeated query term counts once
            if seen.contains(&term) {
                continue;
            }
            let Some(list) = self.postings.get(&term) else {
                seen.push(term);
                continue;
            };
            let df = list.len() as f32;
            let idf = ((n - df + 0.5) / (df + 0.5) + 1.0).ln();
            for &(doc, tf) in list {
                let tf = tf as f32;
                let norm = K1 * (1.0 - B + B * self.lengths[doc] / self.average.max(1.0));
                *scores.entry(doc).or_default() += idf * tf * (K1 + 1.0) / (tf + norm);
            }
            seen.push(term);
        }
        let mut ranked: Vec<(usize, f32)> = scores.into_iter().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked
            .into_iter()
            .take(k)
            .map(|(d, _)| self.ids[d].clone())
            .collect()
    }
}

/// Fusions compared by `docent eval` beside the configured one, from the same candidate
/// lists (point id, score; best first).
pub mod fusions {
    use docent_ingest::store::{Fusion, FusionMethod};

    /// Reciprocal rank fusion, k = 60, equal weights.
    pub fn rrf(dense: &[(u64, f32)], sparse: &[(u64, f32)]) -> Vec<(u64, f32)> {
        Fusion {
            method: FusionMethod::Rrf,
            ..Fusion::default()
        }
        .fuse(dense, sparse)
    }

    /// How far a list's best score stands above the rest of its candidates, in standard
    /// deviations: a confident ranking has a clear winner.
    pub fn confidence(list: &[(u64, f32)]) -> f32 {
        if list.len() < 3 {
            return 1.0;
        }
        let rest = &list[1..];
        let mean = rest.iter().map(|p| p.1).sum::<f32>() / rest.len() as f32;
        let var = rest.iter().map(|p| (p.1 - mean).powi(2)).sum::<f32>() / rest.len() as f32;
        let sd = var.sqrt().max(1e-6);
        ((list[0].1 - mean) / sd).max(0.0)
    }

    /// DBSF with each list weighted by its confidence: weights `1 ± strength · (cd − cs) /
    /// (cd + cs)` (they sum to 2, as the default's 1 + 1; strength 1 gives weights
    /// proportional to the confidences).
    pub fn confident_dbsf_with(
        dense: &[(u64, f32)],
        sparse: &[(u64, f32)],
        strength: f32,
    ) -> Vec<(u64, f32)> {
        let (cd, cs) = (confidence(dense), confidence(sparse));
        let lean = strength * (cd - cs) / (cd + cs).max(1e-6);
        Fusion {
            dense_weight: 1.0 + lean,
            sparse_weight: 1.0 - lean,
            ..Fusion::default()
        }
        .fuse(dense, sparse)
    }

    /// [`confident_dbsf_with`] at full strength.
    pub fn confident_dbsf(dense: &[(u64, f32)], sparse: &[(u64, f32)]) -> Vec<(u64, f32)> {
        confident_dbsf_with(dense, sparse, 1.0)
    }

    /// [`confident_dbsf_with`] at half strength.
    pub fn confident_dbsf_half(dense: &[(u64, f32)], sparse: &[(u64, f32)]) -> Vec<(u64, f32)> {
        confident_dbsf_with(dense, sparse, 0.5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(id: &str, text: &str) -> CorpusLine {
        CorpusLine {
            id: id.into(),
            title: String::new(),
            text: text.into(),
        }
    }

    #[test]
    fn bm25_ranks_the_rare_term_first_and_normalises_length() {
        let corpus = [
            doc("a", "the cat sat on the mat"),
            doc(
                "b",
                "the dog chased the cat around the big garden all day long",
            ),
            doc("c", "a platypus is a mammal"),
        ];
        let bm = Bm25::new(&corpus);
        assert_eq!(bm.search("platypus", 3), ["c"]);
        // both mention the cat once; the shorter one is ranked first
        assert_eq!(bm.search("cat", 3), ["a", "b"]);
        assert!(bm.search("unicorn", 3).is_empty());
    }

    #[test]
    fn confidence_weights_the_list_with_a_clear_winner() {
        let flat = [(1, 0.50), (2, 0.49), (3, 0.49), (4, 0.48)];
        let sharp = [(5, 0.90), (6, 0.30), (7, 0.29), (8, 0.28)];
        assert!(fusions::confidence(&sharp) > fusions::confidence(&flat));
        let fused = fusions::confident_dbsf(&flat, &sharp);
        assert_eq!(fused[0].0, 5);
    }
}
