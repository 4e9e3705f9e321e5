//! The default generation model (models.toml's `DEFAULT_MODEL`, Qwen2.5-Coder-1.5B-Instruct
//! in Qwen's Q4_K_M GGUF, installed by `make setup`) with the default passage reuse, through
//! the real server: an answer
//! taken from the context with its citation, and a question the context does not answer,
//! refused by the model's own judgement, in JSON and streamed.

use serde_json::{json, Value};

use crate::helpers::{client, default_model, get_json, post_json, server_over};

const GUIDE: &str = "# Office guide\n\n\
Staff park in the north lot; visitors use the south lot next to reception. \
The office opens at 8:00 and closes at 18:00 on weekdays, and the canteen serves lunch \
from 11:30 to 14:00.\n\n\
## Printing\n\n\
The second-floor printer is reserved for the finance team; everyone else prints on the \
ground floor.\n";

/// A server over the office guide with the default model and passage reuse as by default
/// (`passages`, computed in the background), no answer cache, 64 answer
/// tokens, and every question reaching the model (the refusals below are the model's, not
/// retrieval's); `adjust` changes the rest.
fn guide_server(
    adjust: impl FnOnce(&mut docent::config::Config),
) -> (tempfile::TempDir, crate::helpers::OwnServer, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("office-guide.md");
    std::fs::write(&path, GUIDE).unwrap();
    let (index, address) = server_over(&[path], |c| {
        c.generation.model = default_model();
        let defaults = docent::config::Config::default().generation;
        c.generation.passage_reuse = defaults.passage_reuse;
        c.generation.passage_precompute = defaults.passage_precompute;
        c.generation.cache_size = 0;
        c.generation.max_tokens = 64;
        c.retrieval.min_score = 0.0;
        adjust(c);
    });
    (dir, index, address)
}

#[tokio::test]
async fn the_default_model_answers_from_the_context_and_refuses_what_it_lacks() {
    let (_dir, _index, address) = guide_server(|_| {});
    let c = client();
    let url = format!("{address}/v1/query");

    // /v1/models names the catalog model
    let models = get_json(&c, &format!("{address}/v1/models")).await;
    assert!(
        models
            .to_string()
            .contains("qwen2.5-coder-1.5b-instruct-q4_k_m"),
        "{models}"
    );

    let answer = ask_printer(&c, &url).await;
    let p = answer["refusal_probability"]
        .as_f64()
        .expect("the model's judgement");
    assert!(
        p < 0.5,
        "the model answers, so it is unlikely to refuse: {answer}"
    );

    for stream in [false, true] {
        let refused = ask_wifi_password(&c, &url, stream).await;
        assert_eq!(refused["refused"], true, "{refused}");
        assert_eq!(refused["refusal_reason"], "model", "{refused}");
        assert_eq!(refused["mode"], "refusal", "{refused}");
        assert_eq!(refused["answerable"], false, "{refused}");
        assert!(
            refused["answer"]
                .as_str()
                .unwrap()
                .starts_with("I don't know"),
            "{refused}"
        );
        assert!(refused["citations"].as_array().unwrap().is_empty());
    }
}

/// Asks the guide's server a question it answers: a generated answer with its citation.
async fn ask_printer(c: &reqwest::Client, url: &str) -> Value {
    let question = json!({"question": "Which team is the second-floor printer reserved for?"});
    let answer = post_json(c, url, &question).await;
    eprintln!("answer: {answer}");
    let text = answer["answer"].as_str().unwrap().to_lowercase();
    assert!(text.contains("finance"), "{answer}");
    assert_eq!(answer["refused"], false, "{answer}");
    assert_eq!(answer["mode"], "generative", "{answer}");
    assert!(
        !answer["citations"].as_array().unwrap().is_empty(),
        "{answer}"
    );
    answer
}

/// Asks the guide's server a question it does not answer, in JSON or streamed; a streamed
/// refusal has one delta (the refusal itself, nothing of the model's text before it).
async fn ask_wifi_password(c: &reqwest::Client, url: &str, stream: bool) -> Value {
    let body = json!({"question": "What is the password of the guest wifi?", "stream": stream});
    let refused = if stream {
        crate::helpers::streamed_refusal(c, url, &body).await
    } else {
        post_json(c, url, &body).await
    };
    eprintln!("refused: {refused}");
    refused
}

/// `generation.refusal_check = "question"`: the yes/no pre-question decides before the
/// answer starts. A question the guide answers is answered, with both signals read; one
/// it does not answer is refused by the pre-question alone (the answer never started, so
/// there is no first-token signal), in JSON and streamed.
#[tokio::test]
async fn the_pre_question_refuses_before_the_answer_starts() {
    let (_dir, _index, address) = guide_server(|c| {
        c.generation.refusal_check = docent::query::generate::RefusalCheck::Question;
        // the pre-question's "no" is likelier than the first token's phrase: on this guide
        // the 0.5B model gives about 0.58 to the printer question and 0.72 to the wifi
        // password (llama.cpp on the same prompts: 0.57 and 0.72; the 1.5B: 0.33 and 0.87)
        c.generation.refusal_threshold = 0.65;
    });
    let c = client();
    let url = format!("{address}/v1/query");

    let answer = ask_printer(&c, &url).await;
    let signals = &answer["refusal_signals"];
    let question = signals["question"].as_f64().expect("the pre-question read");
    assert!(question < 0.65, "{answer}");
    assert!(signals["first_token"].as_f64().is_some(), "{answer}");
    // the deciding signal is the pre-question's
    assert_eq!(answer["refusal_probability"].as_f64(), Some(question));

    for stream in [false, true] {
        let refused = ask_wifi_password(&c, &url, stream).await;
        assert_eq!(refused["refused"], true, "{refused}");
        assert_eq!(refused["refusal_reason"], "model", "{refused}");
        assert!(
            refused["refusal_signals"]["question"]
                .as_f64()
                .is_some_and(|p| p >= 0.65),
            "{refused}"
        );
        assert!(
            refused["refusal_signals"].get("first_token").is_none(),
            "the answer never started: {refused}"
        );
        assert_eq!(refused["usage"]["completion_tokens"], 0, "{refused}");
    }
}

/// Speculative decoding with a draft of another shape: Qwen2.5-Coder 0.5B (head_dim 64)
/// drafting for the 1.5B (head_dim 128), the catalog's pair. mistral.rs handed the draft
/// the sequence's caches preallocated in the target's shape, and its first append failed
/// ("shape mismatch"); the draft now allocates its own. The output is the 1.5B's own
/// greedy output.
#[tokio::test]
async fn the_0_5b_drafts_for_the_1_5b() {
    use docent::query::generate::Generator;
    let big = crate::helpers::qwen_1_5b();
    let small = crate::helpers::qwen_0_5b();
    let mut c = crate::helpers::generation();
    c.model = big;
    c.prefix_cache = false;
    let plain = Generator::load(&c).await.expect("load the 1.5B");
    c.draft = Some(docent::config::DraftConfig {
        model: small,
        gamma: 4,
    });
    let speculative = Generator::load(&c)
        .await
        .expect("load the 1.5B with the 0.5B draft");
    // "fn main() {" in Qwen's tokenizer, then greedy
    let prompt = plain.encode("// Rust: print the sum of 2 and 3\nfn main() {");
    let want = plain.complete_tokens(prompt.clone(), 12).await.unwrap();
    let got = speculative.complete_tokens(prompt, 12).await.unwrap();
    assert_eq!(
        got.token_ids, want.token_ids,
        "{:?} vs {:?}",
        got.text, want.text
    );
}
