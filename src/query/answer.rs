//! One answer orchestration for JSON and streamed answers, as stages. Before the model
//! ([`QueryEngine::prepare`]): check the question → answer cache → admission → retrieval
//! and relevance → injection screening → support → prompt fitting → guards; each stage may
//! end the answer early. Then ([`QueryEngine::drive`]) the model's tokens through the
//! post-processor and the guards into events, and the fallback (withheld, extractive,
//! refusal) when nothing usable is left; a JSON answer is the same events collected.
//!
//! The answer is released a unit (sentence or line) at a time, each unit checked before it
//! is shown: the degeneration guards (loops, echoes, repeated injections), the deny
//! patterns, personal data, and support by the retrieved chunks (attribution). Nothing
//! released is ever changed, so the `done` event's answer is exactly the streamed text.
//! When nothing usable is left, the extractive answer is streamed instead.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use crate::metrics::metrics;

use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tracing::info;

use crate::query::engine::TokenStream;
use crate::query::generate::{Generation, Judgement, StreamEvent};
use crate::query::postprocess::guard::{self, Guard, Units, Verdict};
use crate::query::postprocess::{self, extractive, AnswerStream, Citation};
use crate::query::prompt::{Budget, ContextBlock, Prompt};
use crate::query::response::search_hit;
use crate::query::safety::{
    model_check_prompt, ChunkVerdict, SafetyReport, Suspicion, MODEL_CHECK_SYSTEM,
};
use crate::query::{
    AnswerMode, QueryEngine, QueryError, QueryEvent, QueryRequest, QueryResponse, RefusalReason,
    SearchResponse, Usage, ValidQuery,
};
use docent_ingest::store::Hit;

/// The answer text when the safety filter withholds it.
const WITHHELD: &str = "The safety filter withheld this answer.";

impl QueryEngine {
    /// The answer as one response: the same orchestration as [`Self::answer_stream`]
    /// (one path for JSON and streamed answers), its events collected until `done`.
    pub async fn answer(
        self: &Arc<Self>,
        request: QueryRequest,
    ) -> Result<QueryResponse, QueryError> {
        let mut events = self.answer_stream(request).await?;
        while let Some(event) = events.recv().await {
            match event {
                QueryEvent::Done(response) => return Ok(*response),
                QueryEvent::Error(e) => return Err(e),
                _ => {}
            }
        }
        Err(QueryError::Internal(
            "the answer ended without a result".into(),
        ))
    }

    /// The answer as a stream of events. Errors before the model starts (bad request, busy,
    /// prompt too long) are returned here, so they get a plain HTTP status; later ones
    /// arrive as an `error` event. Dropping the receiver cancels the generation.
    pub async fn answer_stream(
        self: &Arc<Self>,
        request: QueryRequest,
    ) -> Result<mpsc::Receiver<QueryEvent>, QueryError> {
        let started = Instant::now();
        let q = request.validate(&self.limits)?;
        let (tx, rx) = mpsc::channel(64);
        let engine = self.clone();
        match self.prepare(q, started).await? {
            Prepared::Ready(ready) => {
                tokio::spawn(async move { engine.replay(*ready, started, tx).await });
            }
            Prepared::Answer(mut p) => {
                let stream = match &p.prompt {
                    Some(prompt) => {
                        let mut stream = self.generator.stream(prompt, &p.q.params).await?;
                        // the queue place is free again when the engine lets go of the
                        // sequence, not when the answer is abandoned
                        if let Some(slot) = p.slot.take() {
                            stream.hold(slot);
                        }
                        Some(stream)
                    }
                    None => None,
                };
                tokio::spawn(async move { engine.drive(*p, stream, tx).await });
            }
        }
        Ok(rx)
    }

    /// The prompt the answer path would give the model for `request` (the same retrieval,
    /// safety filter and budget; nothing generated), or `None` when the answer would not use
    /// the model (refused, withheld, cached, extractive). `docent bench prefill` sends these
    /// prompts to a peer.
    pub async fn prompt_for(&self, request: QueryRequest) -> Result<Option<Prompt>, QueryError> {
        let q = request.validate(&self.limits)?;
        Ok(match self.prepare(q, Instant::now()).await? {
            Prepared::Answer(p) => p.prompt,
            Prepared::Ready(_) => None,
        })
    }

    /// An answer made without the model (cached, refused, withheld) as the same events a
    /// generated one has: `retrieval` (when there was one), the text, its citations, `done`
    /// with the usage of this request.
    async fn replay(&self, ready: Ready, started: Instant, tx: mpsc::Sender<QueryEvent>) {
        let Ready {
            mut response,
            search,
        } = ready;
        let mut events = Vec::new();
        if let Some(search) = search {
            events.push(QueryEvent::Retrieval(Box::new(search)));
        }
        if !response.answer.is_empty() {
            events.push(QueryEvent::Delta {
                text: response.answer.clone(),
            });
        }
        events.extend(response.citations.iter().cloned().map(QueryEvent::Citation));
        let elapsed = started.elapsed().as_secs_f64() * 1e3;
        response.usage.total_ms = elapsed;
        if response.usage.ttft_ms.is_some() || response.cached {
            response.usage.ttft_ms = Some(elapsed);
        }
        events.push(QueryEvent::Done(Box::new(response)));
        for e in events {
            if tx.send(e).await.is_err() {
                return;
            }
        }
    }

    /// Everything before the model runs, as stages in order: check the question's words,
    /// look up the answer cache, admit into the queue, retrieve (with the embedding head's
    /// check and the relevance refusal), screen the chunks for injections, refuse by
    /// content, fit the prompt, and set up the guards. Each stage may end the answer early
    /// (withheld, cached, busy, refused).
    async fn prepare(&self, q: ValidQuery, started: Instant) -> Result<Prepared, QueryError> {
        let mut safety = SafetyReport::default();
        // the question's words first (no embedding needed to block them)
        if self.safety.question(&q.search.question, &mut safety) {
            let response = self.withheld(safety, Usage::default());
            return Ok(Prepared::ready(response, None));
        }
        let (cache_key, version) = match self.cached(&q).await? {
            Flow::Continue(c) => c,
            Flow::Break(done) => return Ok(done),
        };
        let slot = self.admit(&q)?;
        let retrieved = match self.retrieve_relevant(&q, &mut safety).await? {
            Flow::Continue(r) => r,
            Flow::Break(done) => return Ok(done),
        };
        let retrieval_ms = retrieved.retrieval_ms;
        let mut screened = self.screen(retrieved, &mut safety).await?;
        if screened.hits.is_empty() {
            let response = self.refuse(&q, safety, retrieval_ms, RefusalReason::NoSafeContext)?;
            return Ok(Prepared::ready(response, None));
        }
        // refusal by content: no retrieved sentence answers the question well enough
        if self.limits.min_support > 0.0 {
            let best = self
                .extractive_answer(&q.search.question, &screened.hits)
                .await?
                .map_or(0.0, |(_, score)| score);
            if best < self.limits.min_support {
                let search = screened.search(q.search.mode, retrieval_ms);
                let response = self.refuse(&q, safety, retrieval_ms, RefusalReason::Content)?;
                return Ok(Prepared::ready(response, Some(search)));
            }
        }
        let fitted = self.fit(&q, &mut screened)?;
        let (guard, markup) = self.guards(&q, fitted.prompt.as_ref(), &screened);
        Ok(Prepared::Answer(Box::new(Pending {
            markup,
            search: screened.search(q.search.mode, retrieval_ms),
            hits: screened.hits,
            prompt: fitted.prompt,
            prompt_tokens: fitted.prompt_tokens,
            guard,
            context_chunks_dropped: fitted.context_chunks_dropped,
            history_turns_dropped: fitted.history_turns_dropped,
            q,
            started,
            cache_key,
            version,
            safety,
            slot,
        })))
    }

    /// The answer cache: greedy answers are a function of the request and the index, so a
    /// stored one is replayed. Continues with the cache key (for storing this answer) and
    /// the index revision it is valid for.
    async fn cached(
        &self,
        q: &ValidQuery,
    ) -> Result<Flow<Prepared, (Option<String>, u64)>, QueryError> {
        let cache_key = (q.params.temperature <= 0.0 || q.mode == AnswerMode::Extractive)
            .then(|| format!("{:?}", (&q.search, &q.params, &q.history, q.mode)));
        let version = self
            .index
            .store
            .revision()
            .await
            .map_err(docent_ingest::Error::from)?;
        let Some(key) = cache_key.as_deref() else {
            return Ok(Flow::Continue((None, version)));
        };
        let cached = self.cache.get(key, version);
        let result = if cached.is_some() { "hit" } else { "miss" };
        metrics().cache.with_label_values(&[result]).inc();
        Ok(match cached {
            Some((hit, search)) => {
                let response = QueryResponse {
                    cached: true,
                    // token counts describe the answer; the times are this request's
                    usage: Usage {
                        retrieval_ms: 0.0,
                        generation_ms: 0.0,
                        ..hit.usage
                    },
                    ..hit
                };
                Flow::Break(Prepared::ready(response, search))
            }
            None => Flow::Continue((cache_key, version)),
        })
    }

    /// Admission before any work: beyond `max_queue` answers in flight, say when to come
    /// back (the place is held until the answer is done; dropped with a refusal).
    /// Extractive answers do not use the model and are not queued.
    fn admit(&self, q: &ValidQuery) -> Result<Option<OwnedSemaphorePermit>, QueryError> {
        if q.mode == AnswerMode::Extractive {
            return Ok(None);
        }
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            let avg = self
                .generation_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            QueryError::Busy {
                queued: self.max_queue,
                retry_after_s: avg.div_ceil(1000).max(1),
            }
        })?;
        Ok(Some(slot))
    }

    /// The question's meaning checked when the embedding head reads it (the question is
    /// embedded once, and retrieval uses the same vector), then retrieval; ends with a
    /// refusal when nothing retrieved is relevant enough.
    async fn retrieve_relevant(
        &self,
        q: &ValidQuery,
        safety: &mut SafetyReport,
    ) -> Result<Flow<Prepared, RetrievedHits>, QueryError> {
        let embedded_at = Instant::now();
        let embedded = if self.safety.config.embedding_check {
            Some(self.index.embed_query(&q.search.question).await?)
        } else {
            None
        };
        if let Some(e) = &embedded {
            if self.safety.question_vector(&e.dense, safety) {
                let response = self.withheld(std::mem::take(safety), Usage::default());
                return Ok(Flow::Break(Prepared::ready(response, None)));
            }
        }
        let (retrieved, scores) = self
            .retrieve_with(
                q.search.clone(),
                embedded.as_ref().map(|e| (e, embedded_at)),
            )
            .await?;
        let relevant = crate::query::retrieve::relevance(
            retrieved.best_dense,
            retrieved.coverage,
            q.search.term_weight,
        )
        .is_some_and(|s| s >= q.search.min_score);
        let found = RetrievedHits {
            hits: retrieved.hits,
            scores,
            retrieval_ms: retrieved.elapsed_ms,
        };
        if found.hits.is_empty() || !relevant {
            let search =
                search_response(q.search.mode, found.retrieval_ms, &found.hits, found.scores);
            let reason = RefusalReason::Retrieval;
            let response = self.refuse(q, std::mem::take(safety), found.retrieval_ms, reason)?;
            return Ok(Flow::Break(Prepared::ready(response, Some(search))));
        }
        Ok(Flow::Continue(found))
    }

    /// Chunks that address the model: the instructions taken out (or the chunk dropped, or
    /// fenced as quoted data, as configured); an unsure one is asked of the model (the
    /// second stage).
    async fn screen(
        &self,
        retrieved: RetrievedHits,
        safety: &mut SafetyReport,
    ) -> Result<Screened, QueryError> {
        let n = retrieved.hits.len();
        let mut out = Screened {
            hits: Vec::with_capacity(n),
            scores: Vec::with_capacity(n),
            texts: Vec::with_capacity(n),
            injected: Vec::new(),
        };
        for (mut h, sc) in retrieved.hits.into_iter().zip(retrieved.scores) {
            let verdict = match self.safety.suspicion(&h.payload.text) {
                Suspicion::Clean => ChunkVerdict::Clean,
                Suspicion::Flagged => self.safety.flagged_chunk(&h.payload.text, safety),
                Suspicion::Unsure(piece) => {
                    let yes = self
                        .generator
                        .yes_probability(MODEL_CHECK_SYSTEM, &model_check_prompt(&piece))
                        .await?;
                    safety.model_checked += 1;
                    if yes >= self.safety.config.model_check_yes {
                        safety.reason("prompt_injection:model_check");
                        self.safety.flagged_chunk(&h.payload.text, safety)
                    } else {
                        ChunkVerdict::Clean
                    }
                }
            };
            let text = match verdict {
                ChunkVerdict::Drop => continue,
                ChunkVerdict::Clean => h.payload.text.clone(),
                ChunkVerdict::Quote => self.prompts.quoted(&h.payload.text)?,
                ChunkVerdict::Neutralised { text, spans } => {
                    out.injected.extend(spans);
                    // quotes and the retrieval event show the chunk without them too
                    h.payload.text = text;
                    self.prompts.quoted(&h.payload.text)?
                }
            };
            out.texts.push(text);
            out.hits.push(h);
            out.scores.push(sc);
        }
        Ok(out)
    }

    /// The prompt within the model's context (an extractive answer has none); the chunks
    /// that did not fit are dropped from `screened`.
    fn fit(&self, q: &ValidQuery, screened: &mut Screened) -> Result<Fitted, QueryError> {
        let mut fitted = Fitted {
            prompt: None,
            prompt_tokens: 0,
            context_chunks_dropped: 0,
            history_turns_dropped: 0,
        };
        if q.mode == AnswerMode::Extractive {
            return Ok(fitted);
        }
        let blocks: Vec<ContextBlock<'_>> = screened
            .hits
            .iter()
            .zip(&screened.texts)
            .enumerate()
            .map(|(i, (h, text))| ContextBlock {
                n: i + 1,
                title: &h.payload.title,
                source: &h.payload.source,
                text,
            })
            .collect();
        let budget = Budget {
            context_tokens: self.generator.context_tokens(),
            max_tokens: q.params.max_tokens,
        };
        let prompt_started = Instant::now();
        let rendered = self.prompts.render_within(
            &q.search.question,
            &blocks,
            &q.history,
            budget,
            self.generator.tokens(),
        )?;
        metrics().stage("prompt", prompt_started.elapsed().as_secs_f64());
        fitted.context_chunks_dropped = blocks.len() - rendered.blocks;
        fitted.history_turns_dropped = rendered.history_dropped;
        fitted.prompt = Some(rendered.prompt);
        fitted.prompt_tokens = rendered.prompt_tokens;
        let kept = rendered.blocks;
        screened.hits.truncate(kept);
        screened.scores.truncate(kept);
        screened.texts.truncate(kept);
        Ok(fitted)
    }

    /// What the model must not say back (the prompt without the context and question) and
    /// the markup it may copy from the prompt but must not show.
    fn guards(
        &self,
        q: &ValidQuery,
        prompt: Option<&Prompt>,
        screened: &Screened,
    ) -> (Guard, Vec<String>) {
        let question = q.search.question.as_str();
        let guard = match prompt {
            Some(prompt) => {
                let mut user = prompt.user.clone();
                for t in &screened.texts {
                    user = user.replace(t.as_str(), " ");
                }
                let user = user.replace(question, " ");
                Guard::new(
                    &[prompt.system.as_str(), user.as_str()],
                    question,
                    &screened.injected,
                )
            }
            None => Guard::new(&[], question, &screened.injected),
        }
        .with_context(
            &screened
                .texts
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        let mut markup = prompt.map(Prompt::markup).unwrap_or_default();
        markup.extend_from_slice(self.prompts.quote_markup());
        markup.push(crate::query::safety::NEUTRALISED.to_string());
        (guard, markup)
    }

    /// Runs an answer to its `done` event: the model's tokens (when there is a model) through
    /// the post-processor and the guards, then the extractive answer if nothing usable was
    /// left. Stops when the client goes away (which drops the generation, and so cancels it).
    async fn drive(
        &self,
        mut p: Pending,
        stream: Option<Box<dyn TokenStream>>,
        tx: mpsc::Sender<QueryEvent>,
    ) {
        if tx
            .send(QueryEvent::Retrieval(Box::new(p.search.clone())))
            .await
            .is_err()
        {
            return;
        }
        let mut out = Released::default();
        let generation_started = Instant::now();
        let streamed = match stream {
            Some(stream) => match self.stream_model(&mut p, stream, &mut out, &tx).await {
                Some(s) => s,
                None => return,
            },
            None => Streamed::default(),
        };
        let generation_ms = generation_started.elapsed().as_secs_f64() * 1e3;
        let fallback_started = Instant::now();
        let Some((mode, refusal)) = self.fallback(&mut p, &mut out, &tx).await else {
            return;
        };
        let (prompt_tokens, completion_tokens) = match &streamed.generation {
            Some(g) => (g.prompt_tokens, g.completion_tokens),
            // stopped early, or no model: the counted prompt and the tokens received
            None => (p.prompt_tokens, streamed.deltas),
        };
        let response = self.finish(
            &p,
            out,
            (mode, refusal),
            prompt_tokens,
            completion_tokens,
            generation_ms,
        );
        let m = metrics();
        let post_time = streamed.post_time + fallback_started.elapsed();
        m.stage("postprocess", post_time.as_secs_f64());
        if p.prompt.is_some() {
            m.stage("generate", generation_ms / 1e3);
            m.tokens.inc_by(completion_tokens as u64);
            if let Some(tps) = response.usage.tokens_per_second {
                m.tokens_per_second.observe(tps);
            }
            if let Some(ttft) = response.usage.ttft_ms {
                m.stage("ttft", ttft / 1e3);
            }
        }
        let _ = tx.send(QueryEvent::Done(Box::new(response))).await;
    }

    /// The model's tokens through the post-processor, cut into units (sentences, lines)
    /// that are checked and released in order; the refusal judgement read at the first
    /// step. `None` when the answer ends here (the client went away, or an error was
    /// sent); a generation stopped early is cancelled when `stream` drops.
    async fn stream_model(
        &self,
        p: &mut Pending,
        mut stream: Box<dyn TokenStream>,
        out: &mut Released,
        tx: &mpsc::Sender<QueryEvent>,
    ) -> Option<Streamed> {
        let mut streamed = Streamed::default();
        // a pre-question's judgement is there before the answer starts
        out.judgement = stream.judgement();
        if out.judgement.is_some_and(|j| j.refuse) {
            out.refused_by_model = true;
        }
        let mut post = AnswerStream::new(&p.q.params.stop);
        let mut units = Units::default();
        let mut ended = out.refused_by_model;
        while !ended {
            let next = tokio::select! {
                _ = tx.closed() => return None,
                next = stream.next() => next,
            };
            let ready = match next {
                None => break,
                Some(Err(e)) => {
                    let _ = tx.send(QueryEvent::Error(e.into())).await;
                    return None;
                }
                Some(Ok(StreamEvent::Done(g))) => {
                    streamed.generation = Some(g);
                    break;
                }
                Some(Ok(StreamEvent::Delta(text))) => {
                    streamed.deltas += 1;
                    if streamed.deltas == 1 {
                        // the answer's first step: its own signal is read there
                        let judgement = stream.judgement();
                        out.judgement = judgement;
                        if out.text.is_empty() && judgement.is_some_and(|j| j.refuse) {
                            // the model judges that the context does not answer the
                            // question: nothing is shown, the generation stops here
                            out.refused_by_model = true;
                            break;
                        }
                    }
                    let step = post.push(&text, &p.hits);
                    let mut ready = units.push(&step.text);
                    if let Some(cut) = guard::periodic_tail(units.pending()) {
                        // the same piece over and over: keep its first copy, stop
                        units.truncate_pending(cut);
                        ready.extend(units.finish());
                        out.degenerate("loop");
                        ended = true;
                    } else if step.stopped {
                        ready.extend(units.push(&post.finish_text(&p.hits)));
                        ready.extend(units.finish());
                        ended = true;
                    }
                    ready
                }
            };
            let released_at = Instant::now();
            let released = self.release_all(p, ready, out, tx).await;
            streamed.post_time += released_at.elapsed();
            match released {
                Ok(true) if !ended => {}
                Ok(_) => {
                    ended = true;
                    break;
                }
                Err(e) => {
                    let _ = tx.send(QueryEvent::Error(e)).await;
                    return None;
                }
            }
        }
        if !ended {
            // the model finished: what the post-processor still held back
            let released_at = Instant::now();
            let mut ready = units.push(&post.finish_text(&p.hits));
            ready.extend(units.finish());
            let released = self.release_all(p, ready, out, tx).await;
            streamed.post_time += released_at.elapsed();
            if let Err(e) = released {
                let _ = tx.send(QueryEvent::Error(e)).await;
                return None;
            }
        }
        Some(streamed)
    }

    /// When the model refused or left nothing usable: the withheld notice, the extractive
    /// answer, or the refusal text. Returns the answer's mode and refusal reason; `None`
    /// when the answer ends here (an error was sent).
    async fn fallback(
        &self,
        p: &mut Pending,
        out: &mut Released,
        tx: &mpsc::Sender<QueryEvent>,
    ) -> Option<(AnswerMode, Option<RefusalReason>)> {
        let mut mode = p.q.mode;
        let mut refusal = None;
        if out.refused_by_model {
            refusal = Some(RefusalReason::Model);
        } else if out.text.trim().is_empty() {
            if out.withheld {
                out.send_text(WITHHELD, tx).await;
                return Some((AnswerMode::Withheld, None));
            }
            if p.prompt.is_some() {
                out.degenerate("empty");
            }
            mode = AnswerMode::Extractive;
            match self.extract(p).await {
                Ok(Some(text)) => {
                    // the chunks' own sentences: personal data redacted like any answer
                    let text = self.safety.redact(&text, &mut p.safety);
                    let (text, citations) = postprocess::cite(&text, &p.hits);
                    let citations = self.redact_quotes(citations, &mut p.safety);
                    out.send(text, citations, tx).await;
                }
                Ok(None) => refusal = Some(RefusalReason::NoAnswer),
                Err(e) => {
                    let _ = tx.send(QueryEvent::Error(e)).await;
                    return None;
                }
            }
        }
        if let Some(reason) = refusal {
            match self.prompts.refusal(&p.q.search.question, reason.as_str()) {
                Ok(text) => out.send_text(&text, tx).await,
                Err(e) => {
                    let _ = tx.send(QueryEvent::Error(e.into())).await;
                    return None;
                }
            }
            return Some((AnswerMode::Refusal, refusal));
        }
        Some((mode, None))
    }

    /// Checks and shows units in order; false when the answer must end here.
    async fn release_all(
        &self,
        p: &mut Pending,
        units: Vec<String>,
        out: &mut Released,
        tx: &mpsc::Sender<QueryEvent>,
    ) -> Result<bool, QueryError> {
        for unit in units {
            if !self.release(p, &unit, out, tx).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// One unit: checked by the guards and the safety filter, attributed, then shown.
    async fn release(
        &self,
        p: &mut Pending,
        unit: &str,
        out: &mut Released,
        tx: &mpsc::Sender<QueryEvent>,
    ) -> Result<bool, QueryError> {
        // markup the model copied from its prompt is taken out first
        let stripped = postprocess::strip_markup(unit, &p.markup);
        let unit = stripped.as_str();
        // the blanks around a unit stay as they are; the checks see its text
        let core = unit.trim();
        if core.is_empty() {
            if !out.text.is_empty() {
                out.pending_blank.push_str(unit);
            }
            return Ok(true);
        }
        if postprocess::says_refusal(core, &self.limits.refusal_phrase) {
            // the model says the context does not answer: a refusal when nothing was shown
            // yet; after an answer, the answer ends here
            out.refused_by_model = out.text.is_empty();
            return Ok(false);
        }
        let lead = &unit[..unit.len() - unit.trim_start().len()];
        let trail = &unit[unit.trim_end().len()..];
        let verdict = match p.guard.check(core) {
            // measured without the answer checks (`safety.answer_check = false`)
            Verdict::Injection | Verdict::Followed(_) if !self.safety.config.answer_check => {
                Verdict::Keep
            }
            v => v,
        };
        match verdict {
            Verdict::Loop => {
                out.degenerate("loop");
                return Ok(false);
            }
            Verdict::Echo => {
                out.degenerate("echo");
                return Ok(true);
            }
            Verdict::Injection => {
                p.safety.reason("prompt_injection:answer");
                let text = format!("{lead}{}{trail}", guard::INJECTION_PLACEHOLDER);
                out.send(text, vec![], tx).await;
                return Ok(true);
            }
            Verdict::Followed(kind) => {
                // the answer carries out an instruction instead of answering: it ends
                // before this unit (the extractive answer stands in when nothing was shown)
                p.safety.reason(format!("prompt_injection:followed:{kind}"));
                out.degenerate("followed_instruction");
                return Ok(false);
            }
            Verdict::Keep => {}
        }
        let mut check = p.safety.clone();
        let system = p.prompt.as_ref().map_or("", |pr| pr.system.as_str());
        if self.safety.withhold(core, system, &mut check) {
            // a denied pattern or an echo of the system prompt is never shown; the answer
            // ends before it (withheld as a whole when nothing was shown)
            check.blocked = out.text.is_empty();
            out.withheld = check.blocked;
            p.safety = check;
            return Ok(false);
        }
        let text = self.safety.redact(core, &mut p.safety);
        let (text, citations, supported) = self.attribute_unit(p, &text, out).await?;
        if !supported {
            out.degenerate("unsupported");
            return Ok(true);
        }
        let citations = self.redact_quotes(citations, &mut p.safety);
        out.send(format!("{lead}{text}{trail}"), citations, tx)
            .await;
        Ok(true)
    }

    /// Citations of one unit, with the fallback attribution when on: markers added where a
    /// chunk supports an unmarked sentence, dropped where their chunk does not support it.
    /// `supported` is false when no chunk supports any of its sentences (with two content
    /// words or more).
    async fn attribute_unit(
        &self,
        p: &Pending,
        text: &str,
        out: &mut Released,
    ) -> Result<(String, Vec<Citation>, bool), QueryError> {
        let Some(a) = self.limits.attribution else {
            let (text, citations) = postprocess::cite(text, &p.hits);
            return Ok((text, citations, true));
        };
        let claims = postprocess::claims(text);
        if out.block_vectors.is_none() {
            let blocks: Vec<String> = p.hits.iter().map(|h| h.payload.text.clone()).collect();
            out.block_vectors = Some(self.embed_texts(blocks).await?);
        }
        let block_vectors = out.block_vectors.as_deref().unwrap_or_default();
        let claim_vectors = self
            .embed_texts(claims.iter().map(|c| c.text.clone()).collect())
            .await?;
        let blocks: Vec<&str> = p.hits.iter().map(|h| h.payload.text.as_str()).collect();
        let support = postprocess::support_matrix(&claims, &claim_vectors, &blocks, block_vectors);
        let supported = claims.iter().zip(&support).all(|(c, row)| {
            postprocess::content_word_count(&c.text) < 2
                || row.iter().any(|&s| s >= a.unsupported_below)
        }) || claims.is_empty();
        let (text, citations) = postprocess::attribute(text, &claims, &support, &p.hits, a);
        Ok((text, citations, supported))
    }

    /// Citations with personal data redacted in their quotes.
    fn redact_quotes(&self, citations: Vec<Citation>, report: &mut SafetyReport) -> Vec<Citation> {
        citations
            .into_iter()
            .map(|mut c| {
                c.quote = self.safety.redact(&c.quote, report);
                c
            })
            .collect()
    }

    /// The extractive answer for the prompt's chunks (see [`Self::extractive_answer`]).
    async fn extract(&self, p: &Pending) -> Result<Option<String>, QueryError> {
        Ok(self
            .extractive_answer(&p.q.search.question, &p.hits)
            .await?
            .map(|(text, _)| text))
    }

    /// The extractive answer: the chunks' sentences that best answer the question, by the
    /// mean of their share of the question's content words and their embedding's cosine
    /// with the question's; with the best sentence's score (how well the chunks answer the
    /// question, by their content).
    pub async fn extractive_answer(
        &self,
        question: &str,
        hits: &[Hit],
    ) -> Result<Option<(String, f32)>, QueryError> {
        let blocks: Vec<&str> = hits.iter().map(|h| h.payload.text.as_str()).collect();
        let mut candidates = extractive::candidates(&blocks);
        candidates.truncate(MAX_EXTRACTIVE_CANDIDATES);
        if candidates.is_empty() {
            return Ok(None);
        }
        let texts: Vec<String> = std::iter::once(question.to_string())
            .chain(candidates.iter().map(|c| c.text.clone()))
            .collect();
        let vectors = self.embed_texts(texts).await?;
        let (q, sentences) = vectors.split_at(1);
        let scores: Vec<f32> = candidates
            .iter()
            .zip(sentences)
            .map(|(c, v)| {
                (extractive::overlap(question, &c.text) + super::embed::cosine(&q[0], v)) / 2.0
            })
            .collect();
        let best = scores.iter().copied().fold(f32::MIN, f32::max);
        Ok(extractive::compose(&candidates, &scores).map(|text| (text, best)))
    }

    /// The response for a finished answer; cached when greedy.
    fn finish(
        &self,
        p: &Pending,
        out: Released,
        (mode, refusal): (AnswerMode, Option<RefusalReason>),
        prompt_tokens: usize,
        completion_tokens: usize,
        generation_ms: f64,
    ) -> QueryResponse {
        let generated = p.prompt.is_some();
        if generated {
            let avg = self
                .generation_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            self.generation_ms.store(
                (avg * 3 + generation_ms as u64) / 4,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        let usage = Usage {
            prompt_tokens,
            completion_tokens,
            retrieval_ms: p.search.retrieval_ms,
            generation_ms: if generated { generation_ms } else { 0.0 },
            total_ms: p.started.elapsed().as_secs_f64() * 1e3,
            ttft_ms: out
                .first_at
                .map(|t| t.duration_since(p.started).as_secs_f64() * 1e3),
            tokens_per_second: (generated && generation_ms > 0.0)
                .then(|| completion_tokens as f64 / (generation_ms / 1e3)),
            context_chunks_dropped: p.context_chunks_dropped,
            history_turns_dropped: p.history_turns_dropped,
        };
        info!(
            top_k = p.q.search.top_k,
            citations = out.citations.len(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            total_ms = usage.total_ms,
            mode = ?mode,
            degenerate = ?out.degenerate,
            stream = p.q.stream,
            "answered"
        );
        tracing::debug!(answer = %out.text, "answer text");
        self.count(&p.safety);
        let response = QueryResponse {
            answer: out.text,
            citations: out.citations,
            answerable: matches!(mode, AnswerMode::Generative | AnswerMode::Extractive),
            mode,
            degenerate: out.degenerate,
            cached: false,
            usage,
            safety: p.safety.clone(),
            refused: mode == AnswerMode::Refusal,
            refusal_reason: refusal,
            refusal_probability: out.judgement.map(|j| j.probability),
            refusal_signals: out.judgement.map(|j| j.signals),
        };
        if let Some(key) = &p.cache_key {
            self.cache.put(
                key.clone(),
                p.version,
                response.clone(),
                Some(p.search.clone()),
            );
        }
        response
    }

    /// The refusal before the model: nothing relevant (or nothing safe, or no sentence that
    /// answers) was retrieved; the model is not asked.
    fn refuse(
        &self,
        q: &ValidQuery,
        safety: SafetyReport,
        retrieval_ms: f64,
        reason: RefusalReason,
    ) -> Result<QueryResponse, QueryError> {
        self.count(&safety);
        Ok(QueryResponse {
            answer: self.prompts.refusal(&q.search.question, reason.as_str())?,
            citations: vec![],
            answerable: false,
            mode: AnswerMode::Refusal,
            degenerate: vec![],
            cached: false,
            usage: Usage {
                retrieval_ms,
                ..Usage::default()
            },
            safety,
            refused: true,
            refusal_reason: Some(reason),
            refusal_probability: None,
            refusal_signals: None,
        })
    }

    /// The answer when the filter withholds it.
    fn withheld(&self, report: SafetyReport, usage: Usage) -> QueryResponse {
        self.count(&report);
        QueryResponse {
            answer: WITHHELD.into(),
            citations: vec![],
            answerable: false,
            mode: AnswerMode::Withheld,
            degenerate: vec![],
            cached: false,
            usage,
            safety: report,
            refused: false,
            refusal_reason: None,
            refusal_probability: None,
            refusal_signals: None,
        }
    }
}

/// Sentences scored for an extractive answer, at most (the first ones, in prompt order).
const MAX_EXTRACTIVE_CANDIDATES: usize = 64;

/// What the client was shown so far: the answer is this text, nothing else.
#[derive(Default)]
struct Released {
    text: String,
    citations: Vec<Citation>,
    cited: HashSet<usize>,
    /// When the first text was sent.
    first_at: Option<Instant>,
    degenerate: Vec<String>,
    /// Blanks between units, sent with the next unit shown (never at the end).
    pending_blank: String,
    /// The answer was withheld before anything was shown.
    withheld: bool,
    /// Embeddings of the context blocks, computed for the first unit attributed.
    block_vectors: Option<Vec<Vec<f32>>>,
    /// The model's judgement: from the pre-question, or read at the answer's first token.
    judgement: Option<Judgement>,
    /// The model judged that the context does not answer the question (by that
    /// probability, or by writing the phrase) before anything was shown.
    refused_by_model: bool,
}

impl Released {
    fn degenerate(&mut self, reason: &str) {
        if !self.degenerate.iter().any(|r| r == reason) {
            self.degenerate.push(reason.to_string());
        }
    }

    /// Shows `text` (after the blanks held back) and the citations not shown yet.
    async fn send(
        &mut self,
        text: String,
        citations: Vec<Citation>,
        tx: &mpsc::Sender<QueryEvent>,
    ) {
        let mut text = std::mem::take(&mut self.pending_blank) + &text;
        if self.text.is_empty() {
            text = text.trim_start().to_string();
        }
        // trailing blanks wait for the next unit: the answer never ends in them
        let body = text.trim_end().len();
        self.pending_blank = text[body..].to_string();
        text.truncate(body);
        if !text.is_empty() {
            self.first_at.get_or_insert_with(Instant::now);
            self.text.push_str(&text);
            let _ = tx.send(QueryEvent::Delta { text }).await;
        }
        for c in citations {
            if self.cited.insert(c.n) {
                self.citations.push(c.clone());
                let _ = tx.send(QueryEvent::Citation(c)).await;
            }
        }
    }

    async fn send_text(&mut self, text: &str, tx: &mpsc::Sender<QueryEvent>) {
        self.send(text.to_string(), vec![], tx).await;
    }
}

/// What `prepare` found: an answer without the model, or one to make.
enum Prepared {
    Ready(Box<Ready>),
    Answer(Box<Pending>),
}

impl Prepared {
    fn ready(response: QueryResponse, search: Option<SearchResponse>) -> Self {
        Prepared::Ready(Box::new(Ready { response, search }))
    }
}

/// An answer made without running anything more: cached, refused or withheld.
struct Ready {
    response: QueryResponse,
    /// The retrieval, when there was one.
    search: Option<SearchResponse>,
}

/// A stage's outcome: go on with its result, or end the answer with this one.
type Flow<Done, Next> = std::ops::ControlFlow<Done, Next>;

/// What the model's stream gave: its summary (when it ran to the end), the steps received
/// and the time spent checking and releasing units.
#[derive(Default)]
struct Streamed {
    generation: Option<Generation>,
    deltas: usize,
    post_time: std::time::Duration,
}

/// What retrieval found, before the screening.
struct RetrievedHits {
    hits: Vec<Hit>,
    scores: Vec<crate::query::retrieve::Scores>,
    retrieval_ms: f64,
}

/// The chunks that passed the screening, with their scores, the text each gives the prompt
/// (quoted or with the instructions taken out) and the instructions found.
struct Screened {
    hits: Vec<Hit>,
    scores: Vec<crate::query::retrieve::Scores>,
    texts: Vec<String>,
    injected: Vec<String>,
}

impl Screened {
    /// The chunks as the `retrieval` event shows them (the scores are moved out).
    fn search(
        &mut self,
        mode: docent_ingest::store::SearchMode,
        retrieval_ms: f64,
    ) -> SearchResponse {
        search_response(
            mode,
            retrieval_ms,
            &self.hits,
            std::mem::take(&mut self.scores),
        )
    }
}

/// The prompt as fitted into the model's context.
struct Fitted {
    prompt: Option<Prompt>,
    prompt_tokens: usize,
    context_chunks_dropped: usize,
    history_turns_dropped: usize,
}

/// The `retrieval` event's body for these hits and scores.
fn search_response(
    mode: docent_ingest::store::SearchMode,
    retrieval_ms: f64,
    hits: &[Hit],
    scores: Vec<crate::query::retrieve::Scores>,
) -> SearchResponse {
    SearchResponse {
        mode,
        hits: hits
            .iter()
            .zip(scores)
            .map(|(h, scores)| search_hit(h, scores))
            .collect(),
        retrieval_ms,
    }
}

/// An answer about to be made.
struct Pending {
    q: ValidQuery,
    /// The chunks in the prompt, in block order (instructions taken out).
    hits: Vec<Hit>,
    /// The same, as the `retrieval` event shows them.
    search: SearchResponse,
    /// The model's prompt; `None` for an extractive answer.
    prompt: Option<Prompt>,
    /// The prompt's markup (fence tags, quoting lines, placeholders): taken out of units.
    markup: Vec<String>,
    prompt_tokens: usize,
    guard: Guard,
    context_chunks_dropped: usize,
    history_turns_dropped: usize,
    started: Instant,
    cache_key: Option<String>,
    version: u64,
    /// What the safety filter found and did.
    safety: SafetyReport,
    /// The place in the bounded queue, held until the answer is done (by the generation
    /// stream once there is one).
    slot: Option<OwnedSemaphorePermit>,
}
