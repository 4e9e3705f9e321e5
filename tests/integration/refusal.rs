//! The refusal probe (issue 54) with the real default model: the hidden state at the
//! prompt's last token decides whether the passages answer the question, before any answer
//! token is shown.

use serde_json::{json, Value};

use crate::helpers::{client, post_json, qwen_0_5b, repo, server_over, shared};

/// The shipped probe of the default model.
fn shipped_probe() -> docent::query::generate::probe::Probe {
    let name = "qwen2.5-coder-0.5b.refusal.json";
    let text = docent::query::generate::probe::shipped(name).expect("the default model's probe");
    docent::query::generate::probe::Probe::parse(name, text).unwrap()
}

/// A server over the whole demo corpus (the Rust Book) with the service's default chunking,
/// retrieval and generation settings, on the default model.
fn demo_server() -> (crate::helpers::OwnServer, String) {
    // ingested on a thread of its own: the store's writes must not wait on the test's
    // runtime, which this call would block
    std::thread::spawn(demo_server_on_this_thread)
        .join()
        .expect("the demo server")
}

fn demo_server_on_this_thread() -> (crate::helpers::OwnServer, String) {
    let mut files: Vec<_> = std::fs::read_dir(shared().join("data/corpus/rust-book/src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort();
    server_over(&files, |c| {
        let d = docent::config::Config::default();
        c.chunking = d.chunking;
        c.retrieval = d.retrieval;
        c.generation.model = qwen_0_5b();
        c.generation.max_tokens = d.generation.max_tokens;
        c.generation.cache_size = 0;
    })
}

async fn ask(c: &reqwest::Client, url: &str, question: &str) -> Value {
    let answer = post_json(c, url, &json!({ "question": question })).await;
    eprintln!("{question} -> {answer}");
    answer
}

/// The probe's score of `prompt` from a prefill that reads its layer (no answer).
async fn prefill_score(
    g: &docent::query::generate::Generator,
    probe: &docent::query::generate::probe::Probe,
    prompt: &docent::query::prompt::Prompt,
) -> f32 {
    let states = g
        .hidden_states(prompt, &[probe.file.layer])
        .await
        .unwrap()
        .expect("states");
    probe.score(&states).expect("a score")
}

/// The judgement a short greedy answer of `prompt` streams with (read at its first step).
async fn judged(
    g: &docent::query::generate::Generator,
    prompt: &docent::query::prompt::Prompt,
) -> docent::query::generate::Judgement {
    let mut stream = g
        .stream(prompt, &docent::query::generate::Params::greedy(4))
        .await
        .unwrap();
    while let Some(event) = stream.next().await {
        event.unwrap();
    }
    stream.judgement().expect("a judgement")
}

/// The issue's own questions over the demo corpus with the default settings: what the book
/// never speaks of is refused, what it answers is answered.
#[tokio::test]
async fn the_demo_corpus_refuses_what_it_never_speaks_of() {
    let (_index, address) = demo_server();
    let c = client();
    let url = format!("{address}/v1/query");
    let mut scores = Vec::new();
    for question in [
        "How do I deploy a Rust web service to Kubernetes with Helm?",
        "Which company acquired the Rust Foundation in 2024?",
    ] {
        let a = ask(&c, &url, question).await;
        assert_eq!(a["refused"], true, "{a}");
        assert_eq!(a["mode"], "refusal", "{a}");
        assert!(a["citations"].as_array().unwrap().is_empty(), "{a}");
        if a["refusal_reason"] == "model" {
            // the probe decided: its score is the deciding one
            let probe = a["refusal_signals"]["probe"]
                .as_f64()
                .expect("the probe's score");
            assert_eq!(a["refusal_probability"].as_f64(), Some(probe), "{a}");
            scores.push((question, probe));
        }
    }
    for (question, words) in [
        ("How do I create a new Cargo project?", &["cargo new"][..]),
        (
            "What is a dangling reference?",
            &["reference", "memory", "freed", "dangl"][..],
        ),
    ] {
        let a = ask(&c, &url, question).await;
        assert_eq!(a["refused"], false, "{a}");
        let text = a["answer"].as_str().unwrap().to_lowercase();
        assert!(words.iter().any(|w| text.contains(w)), "{a}");
        assert!(!a["citations"].as_array().unwrap().is_empty(), "{a}");
        let probe = a["refusal_signals"]["probe"].as_f64();
        assert!(probe.is_some(), "the probe read the state: {a}");
        scores.push((question, probe.unwrap_or_default()));
    }
    // asked all at once (their prompts read beside each other's answers, continuous
    // batching), each gets its own prompt's score
    let together = futures::future::join_all(scores.iter().map(|(q, _)| ask(&c, &url, q))).await;
    for ((q, alone), a) in scores.iter().zip(&together) {
        let probe = a["refusal_signals"]["probe"].as_f64().expect("a score");
        assert!(
            (probe - alone).abs() < 0.02,
            "{q}: alone {alone}, together {probe}"
        );
    }
}

/// With retrieval's refusal off, the model's path decides: a refusal by the probe streams
/// no answer token (one delta, the refusal text), and the score is in the `done` event.
#[tokio::test]
async fn a_refusal_by_the_probe_streams_no_answer_token() {
    let (_index, address) = server_over(
        &[crate::helpers::rust_book(crate::helpers::OWNERSHIP)],
        |c| {
            c.generation.model = qwen_0_5b();
            c.generation.cache_size = 0;
            c.retrieval.min_score = 0.0;
        },
    );
    let c = client();
    let url = format!("{address}/v1/query");
    let body = json!({
        "question": "Which company acquired the Rust Foundation in 2024?",
        "stream": true
    });
    let done = crate::helpers::streamed_refusal(&c, &url, &body).await;
    assert_eq!(done["refused"], true, "{done}");
    assert_eq!(done["refusal_reason"], "model", "{done}");
    let probe = done["refusal_signals"]["probe"]
        .as_f64()
        .expect("the probe");
    assert!(probe >= shipped_probe().file.threshold as f64, "{done}");
    assert!(
        done["answer"].as_str().unwrap().starts_with("I don't know"),
        "{done}"
    );
}

/// The probe's score on one passage, with a question it answers and one it does not
/// (the real model's states, read in the prefill).
#[tokio::test]
async fn the_probe_score_moves_the_right_way_on_a_fixed_pair() {
    let mut config = crate::helpers::config(&std::env::temp_dir());
    config.generation.model = qwen_0_5b();
    let generator = docent::query::generate::Generator::load(&config.generation)
        .await
        .expect("the default model");
    let (probe, threshold) = generator.probe().expect("the default model has a probe");
    let prompts = docent::server::startup::prompts(&config).unwrap();
    let blocks = crate::helpers::office_guide();
    let prompt = |question: &str| prompts.render(question, &blocks).unwrap();
    let answered = prefill_score(&generator, probe, &prompt(crate::helpers::OFFICE_ANSWERED)).await;
    let not_answered = prefill_score(
        &generator,
        probe,
        &prompt(crate::helpers::OFFICE_NOT_ANSWERED),
    )
    .await;
    eprintln!("answered {answered:.3}, not answered {not_answered:.3}, threshold {threshold}");
    assert!(answered < not_answered, "{answered} vs {not_answered}");
    assert!(answered < threshold && not_answered >= threshold);
}

/// `docent train-refusal` with the committed examples and states writes the shipped
/// probe byte for byte (the examples' labels, the layer's states and the fit are all it
/// reads; no model is loaded).
#[test]
fn training_reproduces_the_shipped_probe() {
    // each shipped probe with the layer it was chosen at (docs/evaluation.md)
    for (model, layer) in [("qwen2.5-coder-0.5b", 16), ("qwen2.5-coder-1.5b", 21)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("probe.json");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_docent"));
        cmd.current_dir(repo())
            .env("DOCENT_GENERATION__MODEL", model)
            .arg("train-refusal")
            .arg("--layer")
            .arg(layer.to_string())
            .arg("--out")
            .arg(&out);
        let output = crate::helpers::run_ok(&mut cmd);
        eprintln!("{}", String::from_utf8_lossy(&output.stdout));
        let shipped =
            std::fs::read(repo().join(format!("training/refusal/probes/{model}.refusal.json")))
                .unwrap();
        assert!(
            std::fs::read(&out).unwrap() == shipped,
            "{model}: the probe differs from the shipped one"
        );
    }
}

/// A probe trained for another file of the model stops the start-up with what to do.
#[tokio::test]
async fn a_probe_for_another_model_file_is_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut file = shipped_probe().file;
    file.model_sha256 = "0".repeat(64);
    let path = dir.path().join("other.json");
    std::fs::write(&path, serde_json::to_string(&file).unwrap()).unwrap();
    let mut c = crate::helpers::generation();
    c.model = qwen_0_5b();
    c.refusal_probe = Some(path);
    let e = match docent::query::generate::Generator::load(&c).await {
        Ok(_) => panic!("a probe for another model file was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("sha256") && e.contains("train-refusal"), "{e}");
    // with the first-token signal the same model starts
    c.refusal_check = docent::query::generate::RefusalCheck::FirstToken;
    assert!(docent::query::generate::Generator::load(&c).await.is_ok());
}

/// The committed states are what the model reads now: the first examples' states at the
/// probe's layer, extracted again, score within a small tolerance of the committed ones (the
/// kernels' summation order differs between AVX-512 and AVX2 machines).
#[tokio::test]
async fn the_committed_states_are_the_models_own() {
    use docent_tools::train_refusal::{Example, States};
    let root = repo().join("training/refusal");
    let examples: Vec<Example> = std::fs::read_to_string(root.join("examples.jsonl"))
        .unwrap()
        .lines()
        .take(4)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (committed, sha) = States::read(&root.join("qwen2.5-coder-0.5b.states")).unwrap();
    let probe = shipped_probe();
    assert_eq!(sha, probe.file.model_sha256);
    let mut config = crate::helpers::config(&std::env::temp_dir());
    config.generation.model = qwen_0_5b();
    let generator = docent::query::generate::Generator::load(&config.generation)
        .await
        .unwrap();
    let again = docent_tools::train_refusal::extract(&config, &generator, &examples)
        .await
        .unwrap();
    let layer = probe.file.layer;
    for (n, e) in examples.iter().enumerate() {
        let now = probe.score(&again.values[n]).unwrap();
        let mut then = vec![Vec::new(); layer + 1];
        then[layer] = committed.values[n][0].clone();
        let then = probe.score(&then).unwrap();
        eprintln!("{}: committed {then:.4}, now {now:.4}", e.id);
        assert!((now - then).abs() < 0.02, "{}: {then} vs {now}", e.id);
    }
}

/// With a draft model (speculative decoding), the probe reads the target's state in the
/// pass that checks the first draft, and that score is the one the answer's judgement
/// decides with: the same as the plain prefill's (vendor/PATCHES.md 21).
#[tokio::test]
async fn a_speculative_answer_reads_the_probe_from_its_target() {
    use docent::query::generate::Generator;
    let mut config = crate::helpers::config(&std::env::temp_dir());
    config.generation.model = qwen_0_5b();
    config.generation.prefix_cache = false;
    let plain = Generator::load(&config.generation).await.unwrap();
    config.generation.draft = Some(docent::config::DraftConfig {
        model: qwen_0_5b(),
        gamma: 3,
    });
    let speculative = Generator::load(&config.generation).await.unwrap();
    let (probe, threshold) = plain.probe().expect("the default model has a probe");
    let prompts = docent::server::startup::prompts(&config).unwrap();
    let blocks = crate::helpers::office_guide();
    for question in [
        crate::helpers::OFFICE_ANSWERED,
        crate::helpers::OFFICE_NOT_ANSWERED,
    ] {
        let prompt = prompts.render(question, &blocks).unwrap();
        let want = prefill_score(&plain, probe, &prompt).await;
        let judgement = judged(&speculative, &prompt).await;
        let got = judgement
            .signals
            .probe
            .expect("the probe's score with a draft model");
        eprintln!("{question}: plain {want:.4}, speculative {got:.4}");
        assert!((got - want).abs() < 0.02, "{got} vs {want}");
        assert_eq!(judgement.refuse, got >= threshold);
        assert_eq!(judgement.probability, got, "the probe decides");
    }
}

/// The probe's score of a request is the one its own prefill gives, however the engine
/// reads the prompt: two requests prefilled together under continuous batching each get
/// their own prompt's score, and a prompt whose passages' keys and values are placed from
/// the passage cache (passage reuse, vendor/PATCHES.md 23) gets the score a full prefill
/// gives: to four places with exact reuse, the same decision with the default (passages,
/// blocks turned to their places).
#[tokio::test]
async fn the_probe_reads_each_requests_own_state_batched_and_with_passage_reuse() {
    use docent::query::generate::reuse::PassageReuse;
    use docent::query::generate::Generator;
    let mut config = crate::helpers::config(&std::env::temp_dir());
    config.generation.model = qwen_0_5b();
    config.generation.prefix_cache = false;
    let plain = Generator::load(&config.generation).await.unwrap();
    let (probe, threshold) = plain.probe().expect("the default model has a probe");
    let prompts = docent::server::startup::prompts(&config).unwrap();
    let blocks = crate::helpers::office_guide();
    let questions = [
        crate::helpers::OFFICE_ANSWERED,
        crate::helpers::OFFICE_NOT_ANSWERED,
    ];
    let rendered: Vec<_> = questions
        .iter()
        .map(|q| prompts.render(q, &blocks).unwrap())
        .collect();
    let mut want = Vec::new();
    for prompt in &rendered {
        want.push(prefill_score(&plain, probe, prompt).await);
    }
    assert!(want[0] < threshold && want[1] >= threshold, "{want:?}");

    // the probe's score in one answer's judgement
    async fn scored(g: &Generator, prompt: &docent::query::prompt::Prompt) -> f32 {
        judged(g, prompt)
            .await
            .signals
            .probe
            .expect("the probe's score")
    }

    // both prompts at once: under continuous batching they are prefilled in the same steps
    let (a, b) = tokio::join!(scored(&plain, &rendered[0]), scored(&plain, &rendered[1]));
    eprintln!("alone {want:?}, together [{a:.4}, {b:.4}]");
    assert!((a - want[0]).abs() < 0.02 && (b - want[1]).abs() < 0.02);

    for (reuse, tolerance) in [
        (PassageReuse::Exact, Some(1e-3)),
        (PassageReuse::Passages, None),
    ] {
        config.generation.passage_reuse = reuse;
        let g = Generator::load(&config.generation).await.unwrap();
        for (prompt, want) in rendered.iter().zip(&want) {
            // a full prefill first (the exact mode keeps its blocks), then the blocks placed
            let _ = scored(&g, prompt).await;
            g.precompute_passages(prompt).await.unwrap();
            let placed = mistralrs::core::kv_spliced_positions();
            let got = scored(&g, prompt).await;
            assert!(
                mistralrs::core::kv_spliced_positions() > placed,
                "{reuse:?}: no passage was placed"
            );
            eprintln!("{reuse:?}: full prefill {want:.4}, passages placed {got:.4}");
            if let Some(t) = tolerance {
                assert!((got - want).abs() < t, "{reuse:?}: {got} vs {want}");
            }
            assert_eq!(
                got >= threshold,
                *want >= threshold,
                "{reuse:?}: {got} vs {want}"
            );
        }
    }
}
