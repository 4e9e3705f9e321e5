//! Streamed answers (Server-Sent Events), cancellation on disconnect, and the prompt budget,
//! on the real server and model.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::{client, get_json, own_server, post_json};

/// One parsed SSE event: its type and JSON data; keep-alive comments as `": keep-alive"`.
#[derive(Debug)]
struct Event {
    name: String,
    data: Value,
}

/// Reads SSE frames from a streaming response until `stop` says so or the body ends.
async fn read_events(
    res: &mut reqwest::Response,
    mut stop: impl FnMut(&Event) -> bool,
) -> Vec<Event> {
    let mut buf = String::new();
    let mut events = Vec::new();
    while let Some(bytes) = res.chunk().await.expect("read the stream") {
        buf.push_str(std::str::from_utf8(&bytes).expect("utf-8 frames"));
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            let frame = frame.trim_end();
            let event = if let Some(comment) = frame.strip_prefix(':') {
                Event {
                    name: format!(":{comment}"),
                    data: Value::Null,
                }
            } else {
                let mut name = String::new();
                let mut data = String::new();
                for line in frame.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        name = v.to_string();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                Event {
                    name,
                    data: serde_json::from_str(&data).expect("JSON data"),
                }
            };
            let done = stop(&event);
            events.push(event);
            if done {
                return events;
            }
        }
    }
    events
}

fn deltas(events: &[Event]) -> String {
    events
        .iter()
        .filter(|e| e.name == "delta")
        .map(|e| e.data["text"].as_str().expect("delta text"))
        .collect()
}

/// The block numbers of the `citation` events and of the `done` event's citations, sorted.
fn citation_numbers(events: &[Event], done: &Value) -> (Vec<u64>, Vec<u64>) {
    let mut streamed: Vec<u64> = events
        .iter()
        .filter(|e| e.name == "citation")
        .map(|e| e.data["n"].as_u64().unwrap())
        .collect();
    let mut cited: Vec<u64> = done["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["n"].as_u64().unwrap())
        .collect();
    streamed.sort_unstable();
    cited.sort_unstable();
    (streamed, cited)
}

/// The streamed text, concatenated, is the non-streamed answer for the same greedy request,
/// also when a stop sequence cuts it; the `done` event is the non-streamed body.
#[tokio::test]
async fn a_streamed_answer_equals_the_non_streamed_one() {
    // fallback attribution on (the default): it works unit by unit, before text is shown
    let (_dir, address) = own_server(|c| {
        c.generation.cache_size = 0;
    });
    let c = client();
    let url = format!("{address}/v1/query");
    let body = |stream: bool, stop: &[&str]| {
        json!({"question": "What is ownership in Rust?", "stream": stream,
               "retrieval": {"top_k": 2},
               "generation": {"max_tokens": 40, "stop": stop}})
    };
    let plain = post_json(&c, &url, &body(false, &[])).await;
    let answer = plain["answer"].as_str().unwrap().to_string();
    assert!(!answer.is_empty(), "{plain}");

    let mut res = c.post(&url).json(&body(true, &[])).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let events = read_events(&mut res, |_| false).await;
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names.first(), Some(&"retrieval"), "{names:?}");
    assert_eq!(names.last(), Some(&"done"), "{names:?}");
    // a sentence (or line) per delta
    assert!(
        names.iter().filter(|n| **n == "delta").count() >= 1,
        "{names:?}"
    );
    let hits = events[0].data["hits"].as_array().unwrap();
    assert_eq!(hits.len(), 2, "{}", events[0].data);
    assert_eq!(deltas(&events), answer);
    let done = &events.last().unwrap().data;
    assert_eq!(done["answer"], plain["answer"]);
    assert_eq!(done["citations"], plain["citations"]);
    assert_eq!(
        done["usage"]["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    let ttft = done["usage"]["ttft_ms"].as_f64().unwrap();
    assert!(ttft > 0.0 && ttft <= done["usage"]["total_ms"].as_f64().unwrap());
    assert!(done["usage"]["tokens_per_second"].as_f64().unwrap() > 0.0);
    // one citation event per cited block
    let (streamed, cited) = citation_numbers(&events, done);
    assert_eq!(streamed, cited);

    // a request stop sequence from the middle of the answer: cut in both, never streamed
    let words: Vec<&str> = answer.split_whitespace().collect();
    assert!(words.len() >= 4, "{answer}");
    let stop = words[words.len() / 2];
    let cut = post_json(&c, &url, &body(false, &[stop])).await;
    let mut res = c
        .post(&url)
        .json(&body(true, &[stop]))
        .send()
        .await
        .unwrap();
    let events = read_events(&mut res, |_| false).await;
    let streamed = deltas(&events);
    assert!(
        !streamed.contains(stop),
        "{stop:?} streamed in {streamed:?}"
    );
    assert_eq!(streamed, cut["answer"].as_str().unwrap());
    assert!(streamed.len() < answer.len());
}

/// Property: whatever the stop sequences and the token budget, the `done` answer is exactly
/// the concatenated deltas, the citation events are its citations, and the JSON answer to
/// the same greedy request is the same text.
#[tokio::test]
async fn property_the_final_answer_is_the_streamed_text() {
    let (_dir, address) = own_server(|c| {
        c.generation.cache_size = 0;
    });
    let c = client();
    let url = format!("{address}/v1/query");
    let questions = [
        "What is ownership in Rust?",
        "What happens when a variable goes out of scope?",
        "How does Rust manage memory?",
    ];
    let base = post_json(
        &c,
        &url,
        &json!({"question": questions[0], "generation": {"max_tokens": 48}}),
    )
    .await;
    let words: Vec<String> = base["answer"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let mut rng = fastrand::Rng::with_seed(0x2545_F491_4F6C_DD1D);
    let mut next = move |n: usize| rng.usize(..n.max(1));
    for round in 0..10 {
        let mut stops: Vec<String> = Vec::new();
        for _ in 0..next(3) {
            let pick = match next(4) {
                0 if !words.is_empty() => words[next(words.len())].clone(),
                1 => ".".into(),
                2 => "[".into(),
                _ => "\n".into(),
            };
            if !stops.contains(&pick) {
                stops.push(pick);
            }
        }
        let body = |stream: bool| {
            json!({"question": questions[round % questions.len()], "stream": stream,
                   "generation": {"max_tokens": 4 + next_budget(round), "stop": stops}})
        };
        let mut res = c.post(&url).json(&body(true)).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let events = read_events(&mut res, |_| false).await;
        let done = &events.last().expect("events").data;
        assert_eq!(events.last().unwrap().name, "done", "{events:?}");
        let streamed = deltas(&events);
        assert_eq!(
            done["answer"].as_str().unwrap(),
            streamed,
            "stops {stops:?}"
        );
        // (docent's own inferred markers may hold a `[`; the model's text never does)
        for stop in stops.iter().filter(|s| !s.contains('[')) {
            if done["mode"] == "generative" {
                assert!(
                    !streamed.contains(stop.as_str()),
                    "{stop:?} in {streamed:?}"
                );
            }
        }
        let (events_n, done_n) = citation_numbers(&events, done);
        assert_eq!(events_n, done_n, "{done}");
        let plain = post_json(&c, &url, &body(false)).await;
        assert_eq!(plain["answer"], done["answer"], "stops {stops:?}");
        assert_eq!(plain["mode"], done["mode"]);
    }
}

/// Token budgets the property test cycles through (short ones end mid-sentence).
fn next_budget(round: usize) -> usize {
    [1, 7, 20, 44, 3, 12, 60, 30, 9, 16][round % 10]
}

/// A cached answer streams the same events as a fresh one (retrieval, deltas, citations,
/// done), with a complete usage block and `cached: true`.
#[tokio::test]
async fn a_cached_answer_streams_like_a_fresh_one() {
    let (_dir, address) = own_server(|_| {});
    let c = client();
    let url = format!("{address}/v1/query");
    let body = json!({"question": "What is ownership in Rust?", "stream": true,
                      "generation": {"max_tokens": 24}});
    let mut fresh = Vec::new();
    for _ in 0..2 {
        let mut res = c.post(&url).json(&body).send().await.unwrap();
        fresh.push(read_events(&mut res, |_| false).await);
    }
    let (first, second) = (&fresh[0], &fresh[1]);
    // the same kinds of event in the same order (a fresh answer may have several deltas)
    let names = |events: &[Event]| -> Vec<String> {
        let mut n: Vec<String> = events
            .iter()
            .map(|e| e.name.clone())
            .filter(|n| !n.starts_with(':'))
            .collect();
        n.sort();
        n.dedup();
        n
    };
    assert_eq!(names(first), names(second));
    assert_eq!(first[0].name, "retrieval");
    assert_eq!(second[0].name, "retrieval");
    assert_eq!(deltas(first), deltas(second));
    let (a, b) = (&first.last().unwrap().data, &second.last().unwrap().data);
    assert_eq!(a["cached"], false);
    assert_eq!(b["cached"], true, "{b}");
    assert_eq!(a["answer"], b["answer"]);
    assert_eq!(first[0].data["hits"], second[0].data["hits"]);
    let usage = &b["usage"];
    for field in ["prompt_tokens", "completion_tokens", "total_ms", "ttft_ms"] {
        assert!(usage[field].is_number(), "{field} missing: {usage}");
    }
    assert_eq!(usage["completion_tokens"], a["usage"]["completion_tokens"]);
}

async fn generation_stats(c: &reqwest::Client, address: &str) -> Value {
    let health = get_json(c, &format!("{address}/readyz")).await;
    health["generation"].clone()
}

/// A client that goes away cancels its generation: the engine drops the sequence (its
/// channel closes) long before the requested 1,000 tokens; waits get keep-alive comments.
#[tokio::test]
async fn a_disconnect_cancels_the_generation() {
    let (_dir, address) = own_server(|c| {
        c.generation.cache_size = 0;
        c.server.keep_alive_ms = 20;
    });
    let c = client();
    // temperature 2 makes near-uniform tokens: no early end of sequence
    let mut res = c
        .post(format!("{address}/v1/query"))
        .json(
            &json!({"question": "What is ownership in Rust?", "stream": true,
                      "retrieval": {"top_k": 1},
                      "generation": {"max_tokens": 1000, "temperature": 2.0}}),
        )
        .send()
        .await
        .unwrap();
    // text is shown a sentence at a time, after the guards: wait on keep-alives instead
    let mut alive = 0;
    let events = read_events(&mut res, |e| {
        alive += usize::from(e.name == ": keep-alive");
        alive == 3 || e.name == "done"
    })
    .await;
    assert!(
        events.iter().all(|e| e.name != "done"),
        "the answer ended early: {events:?}"
    );
    assert_eq!(generation_stats(&c, &address).await["active"], 1);
    let dropped = Instant::now();
    drop(res);
    loop {
        let stats = generation_stats(&c, &address).await;
        if stats["cancelled"] == 1 && stats["active"] == 0 {
            break;
        }
        assert!(
            dropped.elapsed() < Duration::from_secs(20),
            "the generation was not cancelled: {stats}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "engine dropped the sequence {:?} after the disconnect",
        dropped.elapsed()
    );
    // the engine serves the next request
    let next = c
        .post(format!("{address}/v1/query"))
        .json(&json!({"question": "What is ownership in Rust?",
                      "generation": {"max_tokens": 4}}))
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
}

/// A prompt larger than the model's context loses its lowest-scored chunks, then its oldest
/// turns; what is left fits, counted by the engine. With no room for one chunk: 422.
#[tokio::test]
async fn oversized_prompts_are_cut_to_the_context() {
    let (_dir, address) = own_server(|c| {
        c.generation.cache_size = 0;
        c.generation.context_tokens = 600;
    });
    let c = client();
    let url = format!("{address}/v1/query");
    let history: Vec<Value> = (0..12)
        .map(|i| {
            json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                   "content": format!("Turn {i}: tell me more about borrowing and moves in Rust, please.")})
        })
        .collect();
    let res = post_json(
        &c,
        &url,
        &json!({"question": "What is ownership in Rust?",
                      "retrieval": {"top_k": 8},
                      "history": history,
                      "generation": {"max_tokens": 16}}),
    )
    .await;
    let usage = &res["usage"];
    eprintln!("{usage}");
    assert!(
        usage["context_chunks_dropped"].as_u64().unwrap() > 0,
        "{res}"
    );
    assert!(
        usage["history_turns_dropped"].as_u64().unwrap() > 0,
        "{res}"
    );
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt + 16 <= 600, "{prompt} prompt tokens do not fit");
    // the budget is used, not wasted: what was left out would not have fitted
    assert!(prompt > 400, "{prompt}");
    // the citations point only at chunks that were in the prompt
    let kept = 8 - usage["context_chunks_dropped"].as_u64().unwrap();
    for cit in res["citations"].as_array().unwrap() {
        assert!(cit["n"].as_u64().unwrap() <= kept, "{res}");
    }
    // no room for even one chunk after reserving max_tokens
    let res = c
        .post(&url)
        .json(&json!({"question": "What is ownership in Rust?",
                      "generation": {"max_tokens": 590}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 422);
    let error: Value = res.json().await.unwrap();
    assert_eq!(error["error"]["code"], "prompt_too_long", "{error}");
}
