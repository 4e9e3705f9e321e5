//! An engine that answers from a script: deterministic, instant, no model. The answer
//! path's tests put it behind docent's `QueryEngine` to check what the path does
//! with an answer (budget, screen, refusal, stop sequences, citations, cache) in
//! milliseconds; the real models' tests stay beside them.
//!
//! Tokens are words (whitespace-separated), the template adds 8 tokens and 4 per message.
//! The script sees each prompt; every prompt streamed and every yes/no question asked is
//! recorded for the test to read.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::FutureExt;

use crate::{
    Engine, EngineStats, GenerateError, Generation, Judgement, Params, RefusalSignals, ReuseStats,
    StreamEvent, TokenStream,
};
use crate::{Prompt, TokenCounter};

/// What the scripted model does for one prompt.
#[derive(Debug, Clone, Default)]
pub struct Script {
    /// The answer's text, as the deltas it streams in.
    pub deltas: Vec<String>,
    /// The model's refusal judgement, known from the start (`None`: it judges nothing).
    pub judgement: Option<Judgement>,
    /// After this many deltas the engine fails (`None`: it does not).
    pub fail_after: Option<usize>,
    /// The judgement is known once the first delta is out (as the first-token signal is),
    /// not before the answer starts (as a pre-question's is).
    pub judged_at_first_token: bool,
    /// The first delta waits until the test notifies this (`None`: it does not wait), so
    /// that a test can hold an answer in flight.
    pub gate: Option<Arc<tokio::sync::Notify>>,
}

impl Script {
    /// `text`, a word (with the space before it) per delta.
    pub fn text(text: &str) -> Script {
        let mut deltas = Vec::new();
        let mut current = String::new();
        for c in text.chars() {
            if c.is_whitespace() && !current.trim().is_empty() {
                deltas.push(std::mem::take(&mut current));
            }
            current.push(c);
        }
        if !current.is_empty() {
            deltas.push(current);
        }
        Script {
            deltas,
            ..Script::default()
        }
    }

    /// The same answer, with the model judging that the passages do not answer the
    /// question with `probability` (refused at or above `threshold`).
    pub fn judged(mut self, probability: f32, threshold: f32) -> Script {
        self.judgement = Some(Judgement {
            probability,
            refuse: probability >= threshold,
            signals: RefusalSignals {
                probe: Some(probability),
                ..RefusalSignals::default()
            },
        });
        self
    }

    /// The same judgement, known only once the first delta is out.
    pub fn at_first_token(mut self) -> Script {
        self.judged_at_first_token = true;
        self
    }

    /// The same answer, the engine failing after `deltas` deltas.
    pub fn failing_after(mut self, deltas: usize) -> Script {
        self.fail_after = Some(deltas);
        self
    }

    /// The same answer, its first delta held until `gate` is notified.
    pub fn gated(mut self, gate: Arc<tokio::sync::Notify>) -> Script {
        self.gate = Some(gate);
        self
    }
}

type Answer = dyn Fn(&Prompt) -> Script + Send + Sync;

/// The scripted engine (see the module docs).
pub struct ScriptedEngine {
    answer: Box<Answer>,
    yes: f32,
    tokens: TokenCounter,
    context_tokens: usize,
    path: PathBuf,
    active: Arc<AtomicUsize>,
    cancelled: Arc<AtomicU64>,
    seen: Mutex<Seen>,
}

/// What the scripted engine was asked.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Every prompt streamed, in order.
    pub prompts: Vec<Prompt>,
    /// Every yes/no question (the user message), in order.
    pub questions: Vec<String>,
    /// Prompts whose passages were computed ahead.
    pub precomputed: usize,
}

impl ScriptedEngine {
    /// An engine that answers every prompt with `answer(prompt)`.
    pub fn new(answer: impl Fn(&Prompt) -> Script + Send + Sync + 'static) -> Self {
        ScriptedEngine {
            answer: Box::new(answer),
            yes: 0.0,
            tokens: TokenCounter::new(|t| t.split_whitespace().count(), 8, 4),
            context_tokens: 4096,
            path: PathBuf::from("scripted"),
            active: Arc::default(),
            cancelled: Arc::default(),
            seen: Mutex::default(),
        }
    }

    /// An engine that answers every prompt with `text`.
    pub fn answering(text: &str) -> Self {
        let text = text.to_string();
        Self::new(move |_| Script::text(&text))
    }

    /// Every yes/no question gets `p` as its probability of "yes" (0 unless set).
    pub fn with_yes_probability(mut self, p: f32) -> Self {
        self.yes = p;
        self
    }

    /// The context the prompt and the answer share, in words (4096 unless set).
    pub fn with_context_tokens(mut self, n: usize) -> Self {
        self.context_tokens = n;
        self
    }

    /// What the engine was asked so far.
    pub fn seen(&self) -> Seen {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn record(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self.seen.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn words(&self, prompt: &Prompt) -> usize {
        let messages = 2 + prompt.history.len();
        let history: usize = prompt
            .history
            .iter()
            .map(|t| self.tokens.text(&t.content))
            .sum();
        self.tokens.text(&prompt.system)
            + self.tokens.text(&prompt.user)
            + history
            + self.tokens.template(messages)
    }
}

impl Engine for ScriptedEngine {
    fn stream<'a>(
        &'a self,
        prompt: &'a Prompt,
        params: &'a Params,
    ) -> BoxFuture<'a, Result<Box<dyn TokenStream>, GenerateError>> {
        async move {
            self.record(|s| s.prompts.push(prompt.clone()));
            let mut script = (self.answer)(prompt);
            script.deltas.truncate(params.max_tokens);
            let completion_tokens = script.deltas.len();
            // a refusal known before the answer starts ends the stream at once: nothing is
            // generated, nothing is counted (as a real engine's refused pre-question)
            let refused =
                script.judgement.is_some_and(|j| j.refuse) && !script.judged_at_first_token;
            if !refused {
                self.active.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Box::new(ScriptedStream {
                done: (!refused).then(|| Generation {
                    text: String::new(),
                    prompt_tokens: self.words(prompt),
                    completion_tokens,
                    finish_reason: if completion_tokens == params.max_tokens {
                        "length".into()
                    } else {
                        "stop".into()
                    },
                    token_ids: None,
                    prompt_secs: 0.0,
                    completion_secs: 0.0,
                }),
                deltas: if refused {
                    VecDeque::new()
                } else {
                    script.deltas.into()
                },
                fail_after: script.fail_after,
                gate: script.gate,
                sent: 0,
                judgement: script.judgement,
                judged_at_first_token: script.judged_at_first_token,
                counted: !refused,
                active: self.active.clone(),
                cancelled: self.cancelled.clone(),
                held: None,
            }) as Box<dyn TokenStream>)
        }
        .boxed()
    }

    fn yes_probability<'a>(
        &'a self,
        _system: &'a str,
        user: &'a str,
    ) -> BoxFuture<'a, Result<f32, GenerateError>> {
        self.record(|s| s.questions.push(user.to_string()));
        futures::future::ready(Ok(self.yes)).boxed()
    }

    fn tokens(&self) -> &TokenCounter {
        &self.tokens
    }

    fn context_tokens(&self) -> usize {
        self.context_tokens
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            active: self.active.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
        }
    }

    fn model_path(&self) -> &Path {
        &self.path
    }

    fn precompute_passages<'a>(
        &'a self,
        _prompt: &'a Prompt,
    ) -> BoxFuture<'a, Result<usize, GenerateError>> {
        self.record(|s| s.precomputed += 1);
        futures::future::ready(Ok(0)).boxed()
    }

    fn reuse_stats(&self) -> Option<ReuseStats> {
        None
    }

    fn flush_passages(&self) -> BoxFuture<'_, ()> {
        futures::future::ready(()).boxed()
    }

    fn clear_passages(&self) {}

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A scripted answer being streamed.
struct ScriptedStream {
    deltas: VecDeque<String>,
    done: Option<Generation>,
    fail_after: Option<usize>,
    gate: Option<Arc<tokio::sync::Notify>>,
    sent: usize,
    judgement: Option<Judgement>,
    judged_at_first_token: bool,
    /// In the engine's `active` count (a stream refused before its answer is not).
    counted: bool,
    active: Arc<AtomicUsize>,
    cancelled: Arc<AtomicU64>,
    /// Released when the stream drops (a real engine holds it until it has let go of the
    /// sequence, a step later: tests of the queue's bound need the real engine).
    held: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl ScriptedStream {
    fn step(&mut self) -> Option<Result<StreamEvent, GenerateError>> {
        if self.fail_after.is_some_and(|n| self.sent >= n) && self.done.is_some() {
            self.done = None;
            self.deltas.clear();
            return Some(Err(GenerateError::Engine("scripted failure".into())));
        }
        if let Some(d) = self.deltas.pop_front() {
            self.sent += 1;
            return Some(Ok(StreamEvent::Delta(d)));
        }
        self.done.take().map(|d| Ok(StreamEvent::Done(d)))
    }
}

impl TokenStream for ScriptedStream {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<StreamEvent, GenerateError>>> {
        async move {
            // a real engine yields between tokens; so does the script (and nothing is
            // taken before the future is polled to its end)
            tokio::task::yield_now().await;
            if let Some(gate) = self.gate.take() {
                gate.notified().await;
            }
            self.step()
        }
        .boxed()
    }

    fn judgement(&self) -> Option<Judgement> {
        if self.judged_at_first_token && self.sent == 0 {
            return None;
        }
        self.judgement
    }

    fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        self.held = Some(permit);
    }
}

impl Drop for ScriptedStream {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        if self.done.is_some() {
            self.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.active.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(user: &str) -> Prompt {
        Prompt {
            system: "Answer from the passages.".into(),
            history: vec![],
            user: user.into(),
            check: String::new(),
            fence: String::new(),
            passages: vec![],
        }
    }

    async fn drain(s: &mut Box<dyn TokenStream>) -> (String, Option<Generation>, bool) {
        let (mut text, mut done, mut failed) = (String::new(), None, false);
        while let Some(e) = s.next().await {
            match e {
                Ok(StreamEvent::Delta(d)) => text.push_str(&d),
                Ok(StreamEvent::Done(g)) => done = Some(g),
                Err(_) => failed = true,
            }
        }
        (text, done, failed)
    }

    #[test]
    fn a_script_streams_its_text_word_by_word() {
        let s = Script::text("Visitors park  on level -2 [1].");
        assert_eq!(s.deltas.concat(), "Visitors park  on level -2 [1].");
        assert_eq!(s.deltas.len(), 6);
    }

    #[tokio::test]
    async fn the_engine_streams_counts_and_records() {
        let e = ScriptedEngine::answering("one two three four");
        let p = prompt("what is it");
        let mut s = e.stream(&p, &Params::greedy(3)).await.unwrap();
        assert_eq!(e.stats().active, 1);
        let (text, done, failed) = drain(&mut s).await;
        assert_eq!(text, "one two three");
        let done = done.unwrap();
        assert_eq!(
            (done.completion_tokens, done.finish_reason.as_str()),
            (3, "length")
        );
        // 4 + 3 words, 8 for the template and 4 per message
        assert_eq!(done.prompt_tokens, 7 + 8 + 8);
        assert!(!failed);
        drop(s);
        assert_eq!(e.stats().active, 0);
        assert_eq!(e.seen().prompts, vec![p]);
    }

    #[tokio::test]
    async fn a_refusal_ends_the_stream_and_a_failure_is_an_error() {
        let e = ScriptedEngine::new(|_| Script::text("the answer").judged(0.9, 0.5));
        let mut s = e.stream(&prompt("q"), &Params::greedy(8)).await.unwrap();
        assert!(s.judgement().is_some_and(|j| j.refuse));
        assert_eq!(e.stats().active, 0, "a refused stream is not generating");
        let (text, done, failed) = drain(&mut s).await;
        assert_eq!((text.as_str(), done.is_none(), failed), ("", true, false));
        drop(s);
        assert_eq!(e.stats().cancelled, 0);

        // judged at the first token: nothing known before it, the refusal after it
        let e =
            ScriptedEngine::new(|_| Script::text("the answer").judged(0.9, 0.5).at_first_token());
        let mut s = e.stream(&prompt("q"), &Params::greedy(8)).await.unwrap();
        assert!(s.judgement().is_none());
        assert!(s.next().await.is_some_and(|d| d.is_ok()));
        assert!(s.judgement().is_some_and(|j| j.refuse));

        let e = ScriptedEngine::new(|_| Script::text("a b c d").failing_after(2));
        let mut s = e.stream(&prompt("q"), &Params::greedy(8)).await.unwrap();
        let (text, done, failed) = drain(&mut s).await;
        assert_eq!((text.as_str(), done.is_none(), failed), ("a b", true, true));
        drop(s);
        assert_eq!(e.stats().cancelled, 0, "a failure is not a cancellation");
        // a stream dropped before its end is
        let mut s = e.stream(&prompt("q"), &Params::greedy(8)).await.unwrap();
        assert!(s.next().await.is_some_and(|d| d.is_ok()));
        drop(s);
        assert_eq!((e.stats().cancelled, e.stats().active), (1, 0));
    }
}
