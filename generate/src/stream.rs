//! A generation as a stream of events: the engine's responses turned into text deltas
//! and a summary, the model's judgement beside them, and the engine's counters.

use super::*;

/// What the engine is doing, for `/healthz` and the tests.
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Generations running or waiting in the engine.
    pub(super) active: AtomicUsize,
    /// Streams given up by their client whose sequence the engine has dropped.
    pub(super) cancelled: AtomicU64,
}

/// One generation in [`Counters::active`] while this lives.
pub(super) struct Active<'a>(&'a Counters);

impl<'a> Active<'a> {
    pub(super) fn new(counters: &'a Counters) -> Self {
        counters.active.fetch_add(1, Ordering::Relaxed);
        Active(counters)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A generation in progress. Dropping it before `Done` cancels the generation: the engine
/// notices at its next token and drops the sequence (counted in `cancelled` once it has).
pub struct GenerationStream {
    pub(super) rx: Option<mpsc::Receiver<Response>>,
    pub(super) counters: Arc<Counters>,
    /// `Done` was delivered (or an error): the engine is finished with the sequence.
    pub(super) finished: bool,
    /// `Done`, held back while the text of the last chunk is delivered.
    pub(super) pending_done: Option<Generation>,
    /// Released only once the engine has let go of the sequence (see [`Self::hold`]).
    pub(super) held: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The model's signals; `None` when no refusal phrase is configured.
    pub(super) judge: Option<Judge>,
}

/// What a stream knows of the model's judgement.
pub(super) struct Judge {
    /// The pre-question's probability of "no" ([`RefusalCheck::Question`]): it decides.
    pub(super) question: Option<f32>,
    /// Set at the first generated step: the probability of the refusal phrase's first
    /// token (see [`RefusalGate`]); it decides when there is no pre-question.
    pub(super) first_token: Option<Arc<OnceLock<f32>>>,
    /// The probe's score (set in the prefill) and its threshold: it decides when there is
    /// no pre-question and the model gave its states.
    pub(super) probe: Option<(Arc<probe::ProbeScore>, f32)>,
    pub(super) threshold: f32,
}

impl Judge {
    pub(super) fn judgement(&self) -> Option<Judgement> {
        let first_token = self.first_token.as_ref().and_then(|p| p.get().copied());
        let probe = self.probe.as_ref().and_then(|(s, _)| s.get());
        let (probability, threshold) = match (self.question, probe, &self.probe) {
            (Some(q), _, _) => (q, self.threshold),
            (None, Some(p), Some((_, t))) => (p, *t),
            _ => (first_token?, self.threshold),
        };
        Some(Judgement {
            probability,
            refuse: probability >= threshold,
            signals: RefusalSignals {
                first_token,
                question: self.question,
                probe,
            },
        })
    }
}

impl GenerationStream {
    /// Keeps `permit` (a place in the generation queue) until the engine is done with the
    /// sequence, also when this stream is dropped early: a cancelled sequence lives on in
    /// the engine until its next step, so releasing the place at once would let abandoned
    /// requests (timeouts, clients gone) pile up in the engine, with their memory, beyond
    /// `generation.max_queue` (seen under load).
    pub fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        self.held = Some(permit);
    }

    /// The model's judgement: with a pre-question from the start, else once the first
    /// token is out (`None` before, or when no refusal phrase is configured).
    pub fn judgement(&self) -> Option<Judgement> {
        self.judge.as_ref().and_then(Judge::judgement)
    }

    /// The next event; `None` after `Done` or an error.
    pub async fn next(&mut self) -> Option<Result<StreamEvent, GenerateError>> {
        if let Some(done) = self.pending_done.take() {
            self.finished = true;
            return Some(Ok(StreamEvent::Done(done)));
        }
        if self.finished {
            return None;
        }
        let rx = self.rx.as_mut()?;
        let Some(response) = rx.recv().await else {
            self.finished = true;
            return Some(Err(GenerateError::Engine(
                "the engine dropped the request".into(),
            )));
        };
        // chat requests stream `Chunk`s; raw completions (`stream_tokens`) `CompletionChunk`s
        let (text, finish_reason, usage) = match response {
            Response::Chunk(chunk) => match chunk.choices.into_iter().next() {
                Some(c) => (
                    c.delta.content.unwrap_or_default(),
                    c.finish_reason,
                    chunk.usage,
                ),
                None => (String::new(), None, chunk.usage),
            },
            Response::CompletionChunk(chunk) => match chunk.choices.into_iter().next() {
                Some(c) => (c.text, c.finish_reason, None),
                None => (String::new(), None, None),
            },
            Response::CompletionDone(r) => {
                let reason = r.choices.first().map(|c| c.finish_reason.clone());
                (String::new(), reason.or(Some("stop".into())), Some(r.usage))
            }
            other => {
                self.finished = true;
                return Some(Err(response_error(other)));
            }
        };
        if let Some(finish_reason) = finish_reason {
            let done = generation(String::new(), finish_reason, usage.as_ref(), None);
            if text.is_empty() {
                self.finished = true;
                return Some(Ok(StreamEvent::Done(done)));
            }
            self.pending_done = Some(done);
        }
        Some(Ok(StreamEvent::Delta(text)))
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        let counters = self.counters.clone();
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        if self.finished {
            counters.active.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        // Closing the channel makes the engine's next send fail, which cancels the
        // sequence; the channel reports its end once the engine has dropped the sequence.
        rx.close();
        let held = self.held.take();
        let wait = async move {
            while rx.recv().await.is_some() {}
            counters.cancelled.fetch_add(1, Ordering::Relaxed);
            counters.active.fetch_sub(1, Ordering::Relaxed);
            drop(held);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(wait);
            }
            Err(_) => {
                self.counters.active.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

pub(super) fn response_error(response: Response) -> GenerateError {
    match response {
        Response::ValidationError(e) => GenerateError::Validation(e.to_string()),
        Response::InternalError(e) => GenerateError::Engine(e.to_string()),
        Response::ModelError(m, _) | Response::CompletionModelError(m, _) => {
            GenerateError::Engine(m)
        }
        _ => GenerateError::Engine("unexpected response kind".into()),
    }
}
