//! The ONNX export of all-MiniLM-L6-v2 (made by `make setup` without torch) run through
//! fastembed must match the independent numpy forward pass the setup step recorded.

use docent_ingest::embed::{Embedder, EmbedderConfig};

use crate::helpers::models;

fn cos(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn onnx_export_matches_numpy_reference() {
    let dir = models().join("all-MiniLM-L6-v2");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).expect("reference.json"))
            .expect("json");
    let sentences: Vec<String> = serde_json::from_value(reference["sentences"].clone()).unwrap();
    let expected: Vec<Vec<f32>> = serde_json::from_value(reference["embeddings"].clone()).unwrap();
    assert!(sentences.len() >= 3);

    let embedder = Embedder::load(EmbedderConfig {
        model_dir: dir,
        ort_library: models().join("onnxruntime/libonnxruntime.so"),
        max_length: 256,
        threads: 2,
        batch_size: 4, // several batches, padded differently
        bm25: Default::default(),
    })
    .expect("load embedder");
    assert_eq!(embedder.dim(), 384);
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let got = embedder.embed_dense(&refs).unwrap();
    let mut worst = 0f32;
    for (g, e) in got.iter().zip(&expected) {
        for (a, b) in g.iter().zip(e) {
            worst = worst.max((a - b).abs());
        }
    }
    eprintln!(
        "max |fastembed - numpy| over {} sentences = {worst:.2e}",
        got.len()
    );
    assert!(worst <= 1e-4, "max |fastembed - numpy| = {worst}");

    let q = embedder.embed_dense(&["How do I install Rust?"]).unwrap();
    let near = embedder
        .embed_dense(&["Installing Rust with rustup"])
        .unwrap();
    let far = embedder
        .embed_dense(&["The 1973 oil crisis began in October"])
        .unwrap();
    let (c_near, c_far) = (cos(&q[0], &near[0]), cos(&q[0], &far[0]));
    eprintln!("cos(install, rustup) = {c_near:.4}, cos(install, oil crisis) = {c_far:.4}");
    assert!(c_near > c_far + 0.3, "near {c_near}, far {c_far}");
}

/// The int8 variant made by `make setup` runs through the same Rust path and stays close
/// to fp32 (the setup step checks the same against ONNX Runtime's Python API).
#[test]
fn int8_model_agrees_with_fp32_through_fastembed() {
    let load = |name: &str| {
        Embedder::load(EmbedderConfig {
            model_dir: models().join(name),
            ort_library: models().join("onnxruntime/libonnxruntime.so"),
            max_length: 256,
            threads: 2,
            batch_size: 4,
            bm25: Default::default(),
        })
        .expect("load embedder")
    };
    let (fp32, int8) = (load("all-MiniLM-L6-v2"), load("all-MiniLM-L6-v2-int8"));
    assert_ne!(fp32.model_sha256(), int8.model_sha256());
    let texts = [
        "How do I install Rust?",
        "Installing Rust with rustup",
        "The 1973 oil crisis began in October",
        "Ownership rules: each value has an owner, and there can be only one owner at a time.",
        "fn main() { println!(\"Hello, world!\"); }",
    ];
    let (a, b) = (
        fp32.embed_dense(&texts).unwrap(),
        int8.embed_dense(&texts).unwrap(),
    );
    for (t, (x, y)) in texts.iter().zip(a.iter().zip(&b)) {
        let c = cos(x, y);
        assert!(c >= 0.97, "cos(fp32, int8) = {c} for {t:?}");
    }
    // and it still ranks: install ~ rustup, not ~ oil crisis
    assert!(cos(&b[0], &b[1]) > cos(&b[0], &b[2]) + 0.3);
}

/// Concurrent questions are embedded together, and batching (with padding to the longest
/// question) gives the same vectors as embedding each question alone.
#[test]
fn concurrent_questions_are_batched_with_unchanged_vectors() {
    use docent::query::embed::QueryBatcher;
    use std::sync::{Arc, Barrier};
    let embedder = Arc::new(
        Embedder::load(EmbedderConfig {
            model_dir: models().join("all-MiniLM-L6-v2"),
            ort_library: models().join("onnxruntime/libonnxruntime.so"),
            max_length: 256,
            threads: 2,
            batch_size: 16,
            bm25: Default::default(),
        })
        .unwrap(),
    );
    let questions: Vec<String> = (0..16)
        .map(|i| {
            format!(
                "Question {i}: how does {} work?",
                "borrowing ".repeat(i % 5 + 1)
            )
        })
        .collect();
    let alone: Vec<Vec<f32>> = questions
        .iter()
        .map(|q| embedder.embed_dense(&[q.as_str()]).unwrap().remove(0))
        .collect();
    let batcher = Arc::new(QueryBatcher::new(embedder.clone(), 16));
    let barrier = Arc::new(Barrier::new(questions.len()));
    let together: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = questions
            .iter()
            .map(|q| {
                let (b, barrier) = (batcher.clone(), barrier.clone());
                s.spawn(move || {
                    barrier.wait();
                    b.embed(q).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, t) in alone.iter().zip(&together) {
        assert!(cos(a, t) > 0.99999, "cos {}", cos(a, t));
    }
    let (embedded, batches) = batcher.counts();
    assert_eq!(embedded, questions.len());
    assert!(
        batches < embedded,
        "{batches} batches for {embedded} questions"
    );
}
