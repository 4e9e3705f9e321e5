//! Stage **generate**: a mistral.rs engine over a local GGUF model, docent's only crate
//! that touches `vendor/` (the patched mistral.rs) and wires in docent's CPU kernels
//! (`docent-kernels`). It implements [`docent_engine::Engine`], the seam the answer path
//! holds; the service names no mistral.rs type.
//!
//! Loaded through `GGUFLoaderBuilder` rather than `GgufModelBuilder` so that the activation
//! dtype can be chosen (the builder hard-codes `Auto`, which picks BF16 on many CPUs and is
//! slower than F32 there), the prefix cache can be turned off (on CPU mistral.rs never evicts
//! it), and a missing file is an error instead of a Hugging Face lookup.
//!
//! Here: [`Generator`], what the rest of docent calls (stream an answer, complete, one-step
//! probabilities, tokens), and the requests it sends. Beside it: `config` (the
//! `[generation]` settings), `load` (weights, engine settings, pipeline, tokenizer),
//! `stream` (the engine's responses as [`StreamEvent`]s), `refusal` (the model's judgement:
//! first-token gate, probe gate, yes/no), `passages` (passage reuse on the answer path) and
//! [`reuse`] (the passage blocks, in memory and on disk), [`probe`], [`steps`],
//! [`lookup`] (prompt-lookup drafts), [`catalog`] (models.toml), [`device`] and
//! [`cpu_kernels`].
//!
//! Not for: retrieval, prompt templates, citations or safety (the service's `query` path);
//! a second engine would be a crate of its own beside this one.

#![warn(missing_docs)]
// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod catalog;
mod config;
pub mod cpu_kernels;
pub mod device;
mod load;
pub use load::isq_known;
pub mod lookup;
mod passages;
pub mod probe;
mod refusal;
pub mod reuse;
mod seam;
pub mod steps;
mod stream;

pub use config::*;
pub use docent_engine::{EngineStats, StreamEvent};
pub use docent_engine::{GenerateError, Generation, Params};
pub use docent_engine::{Judgement, RefusalSignals};
use passages::*;
use refusal::*;
pub use stream::GenerationStream;
use stream::*;

use serde::{Deserialize, Serialize};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use mistralrs::core::{
    parse_isq_value, DefaultSchedulerMethod, GGUFLoaderBuilder, GGUFSpecificConfig, IsqType,
    Loader, MistralRsBuilder, ModelDType, NormalLoaderBuilder, NormalSpecificConfig,
    SchedulerConfig, SpeculativeConfig, SpeculativeLoader,
};
use mistralrs::{
    AutoDeviceMapParams, Constraint, DeviceMapSetting, DrySamplingParams, Model, NormalRequest,
    Request, RequestLike, RequestMessage, Response, SamplingParams, StopTokens, TextMessageRole,
    TextMessages, TokenSource,
};
use tokio::sync::mpsc;

use docent_engine::{Prompt, Role, TokenCounter};

/// The drafts one request's decoding may read: speed only, greedy output is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Drafts {
    /// Most tokens of a prompt-lookup draft per step; 0 = off.
    lookup_tokens: usize,
    /// The draft model drafts (when the pipeline has one).
    draft_model: bool,
}

impl Drafts {
    /// Plain steps of the target only (one-step questions: a draft would only cost).
    const NONE: Drafts = Drafts {
        lookup_tokens: 0,
        draft_model: false,
    };

    fn of(params: &Params) -> Drafts {
        Drafts {
            lookup_tokens: params.lookup_tokens,
            draft_model: params.draft_model,
        }
    }
}

/// A finished generation with the engine's usage (token counts and timings; zero when
/// the engine sent none).
fn generation(
    text: String,
    finish_reason: String,
    usage: Option<&mistralrs::Usage>,
    token_ids: Option<Vec<u32>>,
) -> Generation {
    let (prompt_tokens, completion_tokens, prompt_secs, completion_secs) =
        usage.map_or((0, 0, 0.0, 0.0), |u| {
            (
                u.prompt_tokens,
                u.completion_tokens,
                f64::from(u.total_prompt_time_sec),
                f64::from(u.total_completion_time_sec),
            )
        });
    Generation {
        text,
        prompt_tokens,
        completion_tokens,
        finish_reason,
        token_ids,
        prompt_secs,
        completion_secs,
    }
}

/// A loaded model and its mistral.rs engine: what the rest of docent generates with. One per
/// process ([`SharedGenerator`]).
pub struct Generator {
    model: Model,
    path: PathBuf,
    tokens: TokenCounter,
    /// The model's context length in tokens (prompt and answer together).
    context_tokens: usize,
    counters: Arc<Counters>,
    /// How long loading the weights took.
    load_ms: f64,
    /// The model's tokenizer, without special tokens.
    ids: Encoder,
    /// Token ids back to text, special tokens left out (as answers are streamed).
    text: Decoder,
    /// First tokens of the refusal phrase (`generation.refusal_phrase`), whose probability
    /// at an answer's first step is the model's judgement; empty when off.
    refusal_tokens: Vec<u32>,
    /// `generation.refusal_threshold` (see [`RefusalGate`]).
    refusal_threshold: f32,
    /// `generation.refusal_check`, after the fallback for a model without a probe.
    refusal_check: RefusalCheck,
    /// The refusal probe and its threshold, with [`RefusalCheck::Probe`].
    probe: Option<ProbeWithThreshold>,
    /// Tokens masked at an answer's first step (`generation.lead_with_marker = false`: the
    /// first tokens of a citation marker); empty when none are.
    lead_masked: Vec<u32>,
    /// First tokens of "yes" and "no", for [`RefusalCheck::Question`].
    yes_tokens: Vec<u32>,
    no_tokens: Vec<u32>,
    /// `generation.lookup_tokens` and the draft model: the drafts of raw completions
    /// ([`Generator::complete_tokens`], [`Generator::stream_tokens`]); chat requests carry
    /// their own in [`Params`]. `drafts.draft_model` is whether the pipeline is speculative
    /// (`generation.draft`): then each request says whether its draft model drafts for it.
    drafts: Drafts,
    /// `generation.passage_reuse` and its blocks (`None` when off or not possible).
    reuse: reuse::PassageReuse,
    passages: Option<Arc<reuse::PassageCache>>,
    /// `generation.passage_recompute_tokens`, `generation.passage_key_scale`.
    recompute_tokens: usize,
    key_scale: f32,
}

impl Generator {
    /// Token ids of `text` with the model's tokenizer (no special tokens added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        (self.ids)(text)
    }

    /// Milliseconds loading the weights took (quantization included).
    pub fn load_ms(&self) -> f64 {
        self.load_ms
    }

    /// The model's tokenizer, for the prompt budget.
    pub fn tokens(&self) -> &TokenCounter {
        &self.tokens
    }

    /// Tokens the prompt and the answer may use together.
    pub fn context_tokens(&self) -> usize {
        self.context_tokens
    }

    /// Generations in the engine now, and streams cancelled so far.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            active: self.counters.active.load(Ordering::Relaxed),
            cancelled: self.counters.cancelled.load(Ordering::Relaxed),
        }
    }

    /// The model file (resolved from `generation.model`).
    pub fn model_path(&self) -> &Path {
        &self.path
    }

    /// Chat generation with the model's own chat template.
    pub async fn chat(
        &self,
        prompt: &Prompt,
        params: &Params,
    ) -> Result<Generation, GenerateError> {
        self.run(
            messages(prompt),
            sampling(params),
            false,
            Drafts::of(params),
            None,
        )
        .await
    }

    /// [`Self::chat`] with `reader` reading the hidden states at every generated token
    /// (no drafts: a verified draft has no states).
    pub async fn chat_reading(
        &self,
        prompt: &Prompt,
        params: &Params,
        reader: Arc<steps::StepReader>,
    ) -> Result<Generation, GenerateError> {
        self.run(
            messages(prompt),
            sampling(params),
            false,
            Drafts::NONE,
            Some(vec![reader]),
        )
        .await
    }

    /// Token ids back to text, as answers are streamed.
    pub fn decode(&self, ids: &[u32]) -> String {
        (self.text)(ids)
    }

    /// Chat generation, token by token; the stream also gives the model's refusal
    /// judgement ([`GenerationStream::judgement`]) when a refusal phrase is set. With
    /// [`RefusalCheck::Question`] the pre-question runs first; when it refuses, the answer
    /// is not started and the stream ends at once.
    pub async fn stream(
        &self,
        prompt: &Prompt,
        params: &Params,
    ) -> Result<GenerationStream, GenerateError> {
        let judging = self.refusal_check != RefusalCheck::Off
            && (!self.refusal_tokens.is_empty() || self.probe.is_some());
        let question = match self.refusal_check {
            RefusalCheck::Question if judging && !prompt.check.is_empty() => {
                Some(self.check(prompt).await?)
            }
            _ => None,
        };
        let refuse_first_token = match question {
            // the pre-question decides; the answer's first step is only recorded (and the
            // phrase masked there: the model answers what the check judged answerable)
            Some(_) => f32::INFINITY,
            None => self.refusal_threshold,
        };
        let first_token = judging.then(Arc::<OnceLock<f32>>::default);
        let probe = self
            .probe
            .as_ref()
            .filter(|_| judging)
            .map(|(p, threshold)| ProbeGate {
                read: probe::ProbeRead {
                    probe: p.clone(),
                    score: Arc::default(),
                },
                threshold: *threshold,
            });
        let judge = Judge {
            question,
            first_token: first_token.clone(),
            probe: probe.as_ref().map(|g| (g.read.score.clone(), g.threshold)),
            threshold: self.refusal_threshold,
        };
        if question.is_some_and(|q| q >= self.refusal_threshold) {
            return Ok(GenerationStream {
                rx: None,
                counters: self.counters.clone(),
                finished: true,
                pending_done: None,
                held: None,
                judge: Some(judge),
            });
        }
        let processors = (judging || !self.lead_masked.is_empty()).then(|| {
            vec![Arc::new(RefusalGate {
                tokens: if judging {
                    self.refusal_tokens.clone()
                } else {
                    Vec::new()
                },
                threshold: refuse_first_token,
                probability: first_token.clone().unwrap_or_default(),
                masked: self.lead_masked.clone(),
                probe: probe.filter(|_| question.is_none()),
            }) as Arc<dyn mistralrs::CustomLogitsProcessor>]
        });
        let plan = self.reuse_plan(prompt).await?;
        let processors = match (processors, plan.keep) {
            (p, None) => p,
            (p, Some(keep)) => {
                let mut p = p.unwrap_or_default();
                p.push(keep as Arc<dyn mistralrs::CustomLogitsProcessor>);
                Some(p)
            }
        };
        let mut stream = self
            .stream_request(
                messages(prompt),
                sampling(params),
                processors,
                Drafts::of(params),
                plan.splices,
            )
            .await?;
        stream.judge = judging.then_some(judge);
        Ok(stream)
    }

    /// Raw completion from token ids (no template), greedy, token by token.
    pub async fn stream_tokens(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<GenerationStream, GenerateError> {
        self.stream_request(
            RequestMessage::CompletionTokens(tokens),
            sampling(&Params::greedy(max_tokens)),
            None,
            self.drafts,
            Vec::new(),
        )
        .await
    }

    async fn stream_request(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
        drafts: Drafts,
        splices: Vec<mistralrs::core::KvSplice>,
    ) -> Result<GenerationStream, GenerateError> {
        // room for a few chunks: the engine waits on a full channel
        let (tx, rx) = mpsc::channel(64);
        self.send(
            messages,
            sampling_params,
            false,
            true,
            tx,
            processors,
            drafts,
            splices,
        )
        .await?;
        self.counters.active.fetch_add(1, Ordering::Relaxed);
        Ok(GenerationStream {
            rx: Some(rx),
            counters: self.counters.clone(),
            finished: false,
            pending_done: None,
            held: None,
            judge: None,
        })
    }

    /// Raw completion from token ids (no template), greedy, with the configured drafts;
    /// returns the generated ids too.
    pub async fn complete_tokens(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<Generation, GenerateError> {
        self.complete_with(tokens, &self.default_params(max_tokens))
            .await
    }

    /// Greedy decoding of up to `max_tokens` with the configured drafts
    /// (`generation.lookup_tokens`, the draft model when there is one).
    pub fn default_params(&self, max_tokens: usize) -> Params {
        Params {
            lookup_tokens: self.drafts.lookup_tokens,
            draft_model: self.drafts.draft_model,
            ..Params::greedy(max_tokens)
        }
    }

    /// Raw completion from token ids (no template) with `params`' sampling and drafts
    /// (a request's own choice of drafts, as [`Generator::chat`] takes it). The generated
    /// ids come back when the decoding is greedy (`temperature` 0); read `text` otherwise.
    pub async fn complete_with(
        &self,
        tokens: Vec<u32>,
        params: &Params,
    ) -> Result<Generation, GenerateError> {
        let mut sampling = sampling(params);
        let greedy = params.temperature <= 0.0;
        if greedy {
            // The top-1 alternative of a greedy step is the chosen token: that is how the
            // engine's response carries token ids.
            sampling.top_n_logprobs = 1;
        }
        self.run(
            RequestMessage::CompletionTokens(tokens),
            sampling,
            greedy,
            Drafts::of(params),
            None,
        )
        .await
    }

    /// Decodes token ids with the model's tokenizer (the whole sequence at once).
    /// `skip_special` drops tokens the tokenizer marks special; note that mistral.rs's GGUF
    /// tokenizer conversion marks SentencePiece byte tokens (`<0x0A>`, …) special too.
    pub async fn detokenize(
        &self,
        ids: Vec<u32>,
        skip_special: bool,
    ) -> Result<String, GenerateError> {
        self.model
            .detokenize(ids, skip_special)
            .await
            .map_err(|e| GenerateError::Engine(e.to_string()))
    }

    // one private call site per kind of request; each argument is one NormalRequest field
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
        is_streaming: bool,
        tx: mpsc::Sender<Response>,
        logits_processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
        drafts: Drafts,
        splices: Vec<mistralrs::core::KvSplice>,
    ) -> Result<(), GenerateError> {
        let id = self.model.inner().next_request_id();
        // what the request type has no field for travels in the request as a processor the
        // engine takes out when it adds it (vendor/PATCHES.md 26)
        let mut logits_processors = logits_processors.unwrap_or_default();
        logits_processors.push(Arc::new(mistralrs::core::RequestSettings {
            draft_tokens: drafts.lookup_tokens,
            skips_draft_model: self.drafts.draft_model && !drafts.draft_model,
            kv_splices: splices,
        }));
        let request = Request::Normal(Box::new(NormalRequest {
            messages,
            sampling_params,
            response: tx,
            return_logprobs: logprobs,
            is_streaming,
            id,
            constraint: Constraint::None,
            suffix: None,
            tools: None,
            tool_choice: None,
            logits_processors: Some(logits_processors),
            return_raw_logits: false,
            web_search_options: None,
            model_id: None,
            truncate_sequence: false,
        }));
        self.model
            .inner()
            .get_sender(None)
            .map_err(|e| GenerateError::Engine(e.to_string()))?
            .send(request)
            .await
            .map_err(|e| GenerateError::Engine(e.to_string()))
    }

    /// One request, not streamed: its one response.
    async fn request_once(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
        processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
        drafts: Drafts,
        splices: Vec<mistralrs::core::KvSplice>,
    ) -> Result<Response, GenerateError> {
        let (tx, mut rx) = mpsc::channel(8);
        // counted while it runs, also when the caller gives up waiting (a dropped future)
        let _active = Active::new(&self.counters);
        self.send(
            messages,
            sampling_params,
            logprobs,
            false,
            tx,
            processors,
            drafts,
            splices,
        )
        .await?;
        rx.recv()
            .await
            .ok_or_else(|| GenerateError::Engine("the engine dropped the request".into()))
    }

    async fn run(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
        drafts: Drafts,
        processors: Option<Vec<Arc<dyn mistralrs::CustomLogitsProcessor>>>,
    ) -> Result<Generation, GenerateError> {
        match self
            .request_once(
                messages,
                sampling_params,
                logprobs,
                processors,
                drafts,
                Vec::new(),
            )
            .await?
        {
            Response::Done(r) => {
                let choice = r.choices.into_iter().next();
                let finish_reason = choice
                    .as_ref()
                    .map(|c| c.finish_reason.clone())
                    .unwrap_or_default();
                let text = choice.and_then(|c| c.message.content).unwrap_or_default();
                Ok(generation(text, finish_reason, Some(&r.usage), None))
            }
            Response::CompletionDone(r) => {
                let choice = r.choices.into_iter().next();
                let token_ids = choice
                    .as_ref()
                    .and_then(|c| c.logprobs.as_ref())
                    .and_then(|l| l.content.as_ref())
                    .map(|c| {
                        c.iter()
                            .filter_map(|t| t.top_logprobs.first().map(|t| t.token))
                            .collect()
                    });
                let finish_reason = choice
                    .as_ref()
                    .map(|c| c.finish_reason.clone())
                    .unwrap_or_default();
                let text = choice.map(|c| c.text).unwrap_or_default();
                Ok(generation(text, finish_reason, Some(&r.usage), token_ids))
            }
            other => Err(response_error(other)),
        }
    }
}

/// The engine's messages for a prompt: system, the earlier turns, then the question.
fn messages(prompt: &Prompt) -> RequestMessage {
    text_messages(prompt).take_messages()
}

/// The prompt's messages: system, earlier turns, user.
fn text_messages(prompt: &Prompt) -> TextMessages {
    let mut m = TextMessages::new().add_message(TextMessageRole::System, &prompt.system);
    for turn in &prompt.history {
        let role = match turn.role {
            Role::User => TextMessageRole::User,
            Role::Assistant => TextMessageRole::Assistant,
        };
        m = m.add_message(role, &turn.content);
    }
    m.add_message(TextMessageRole::User, &prompt.user)
}

/// Measures what the chat template adds around messages, with the engine's own template
/// rendering and tokenizer: two and three messages of one word each.
async fn template_overhead(
    model: &Model,
    encode: impl Fn(&str) -> usize + Send + Sync + 'static,
) -> Result<TokenCounter, String> {
    let word = "hello";
    let count = |n: usize| {
        let mut m = TextMessages::new().add_message(TextMessageRole::System, word);
        for i in 1..n {
            let role = if i % 2 == 1 {
                TextMessageRole::User
            } else {
                TextMessageRole::Assistant
            };
            m = m.add_message(role, word);
        }
        async move {
            model
                .tokenize(either::Either::Left(m), None, true, true, None)
                .await
                .map(|t| t.len())
                .map_err(|e| e.to_string())
        }
    };
    let (two, three) = (count(2).await?, count(3).await?);
    let w = encode(word);
    let per_message = three.saturating_sub(two + w).max(1);
    let base = two.saturating_sub(2 * (w + per_message));
    Ok(TokenCounter::new(encode, base, per_message))
}

fn sampling(params: &Params) -> SamplingParams {
    let stop = (!params.stop.is_empty()).then(|| StopTokens::Seqs(params.stop.clone()));
    let mut s = if params.temperature <= 0.0 {
        SamplingParams::deterministic()
    } else {
        SamplingParams {
            temperature: Some(params.temperature),
            top_p: (params.top_p < 1.0).then_some(params.top_p),
            top_k: (params.top_k > 0).then_some(params.top_k),
            ..SamplingParams::neutral()
        }
    };
    s.max_len = Some(params.max_tokens);
    s.repetition_penalty = (params.repetition_penalty != 1.0).then_some(params.repetition_penalty);
    s.dry_params = (params.dry_multiplier > 0.0).then(|| DrySamplingParams {
        multiplier: params.dry_multiplier,
        allowed_length: params.dry_allowed_length,
        ..DrySamplingParams::default()
    });
    s.stop_toks = stop;
    s
}

/// The engine is shared by all requests.
pub type SharedGenerator = Arc<Generator>;

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_p: f64, top_k: usize) -> Params {
        Params {
            max_tokens: 7,
            temperature,
            top_p,
            top_k,
            repetition_penalty: 1.0,
            dry_multiplier: 0.0,
            dry_allowed_length: 2,
            stop: vec!["END".into()],
            lookup_tokens: 0,
            draft_model: false,
        }
    }

    /// The first-step gate: below the threshold the refusal tokens and the masked ones are
    /// masked at the first step only, and the judgement is recorded; at or above it the
    /// logits pass unchanged (the answer is refused there).
    #[test]
    fn the_first_step_gate_masks_then_passes() {
        use mistralrs::CustomLogitsProcessor;
        let logits =
            |v: Vec<f32>| mistralrs::Tensor::from_vec(v, 4, &mistralrs::Device::Cpu).unwrap();
        let values = |t: mistralrs::Tensor| t.to_vec1::<f32>().unwrap();
        let gate = |threshold: f32, masked: Vec<u32>| RefusalGate {
            tokens: vec![1],
            threshold,
            probability: Arc::default(),
            masked,
            probe: None,
        };
        // a marker token (3) masked whatever the judgement, the refusal token (1) under it
        let g = gate(0.9, vec![3]);
        let first = values(g.apply(&logits(vec![1.0, 0.0, 1.0, 2.0]), &[]).unwrap());
        assert_eq!(first[0], 1.0);
        assert_eq!(first[2], 1.0);
        assert!(
            first[1] == f32::NEG_INFINITY && first[3] == f32::NEG_INFINITY,
            "{first:?}"
        );
        let p = *g.probability.get().expect("the judgement is recorded");
        assert!((p - token_probability(&[1.0, 0.0, 1.0, 2.0], &[1])).abs() < 1e-6);
        // later steps pass unchanged
        assert_eq!(
            values(g.apply(&logits(vec![1.0, 0.0, 1.0, 2.0]), &[5]).unwrap()),
            vec![1.0, 0.0, 1.0, 2.0]
        );
        // a refusal: unchanged, so the phrase can start
        let g = gate(0.1, vec![3]);
        assert_eq!(
            values(g.apply(&logits(vec![0.0, 3.0, 0.0, 0.0]), &[]).unwrap()),
            vec![0.0, 3.0, 0.0, 0.0]
        );
        // no refusal phrase: only the masked tokens, never a refusal
        let g = RefusalGate {
            tokens: vec![],
            threshold: 0.0,
            probability: Arc::default(),
            masked: vec![0],
            probe: None,
        };
        let first = values(g.apply(&logits(vec![5.0, 0.0, 1.0, 2.0]), &[]).unwrap());
        assert_eq!(first[0], f32::NEG_INFINITY);
        assert_eq!(&first[1..], &[0.0, 1.0, 2.0]);
    }

    /// With a probe the gate asks for the prompt's states, scores them, and decides by the
    /// probe's threshold whatever the first token says.
    #[test]
    fn the_gate_decides_by_the_probe_when_it_has_one() {
        use mistralrs::CustomLogitsProcessor;
        let logits =
            |v: Vec<f32>| mistralrs::Tensor::from_vec(v, 4, &mistralrs::Device::Cpu).unwrap();
        let values = |t: mistralrs::Tensor| t.to_vec1::<f32>().unwrap();
        let gate = || RefusalGate {
            tokens: vec![1],
            // the first token alone would refuse anything
            threshold: 0.0,
            probability: Arc::default(),
            masked: vec![],
            probe: Some(ProbeGate {
                read: probe::ProbeRead {
                    probe: Arc::new(probe::Probe::new(
                        "m",
                        &"0".repeat(64),
                        1,
                        vec![1.0, 0.0],
                        1.0,
                        0.0,
                    )),
                    score: Arc::default(),
                },
                threshold: 0.5,
            }),
        };
        let g = gate();
        assert_eq!(g.hidden_state_layers(), Some(vec![1]));
        // layer 1's state projects to -3: score 0.047, below 0.5: the model answers
        g.observe_hidden_states(&[vec![9.0, 9.0], vec![-3.0, 1.0]]);
        let first = values(g.apply(&logits(vec![0.0, 3.0, 0.0, 0.0]), &[]).unwrap());
        assert_eq!(first[1], f32::NEG_INFINITY, "{first:?}");
        // a later chunk's call wins: +3 → 0.95, refused (logits unchanged)
        let g = gate();
        g.observe_hidden_states(&[vec![0.0, 0.0], vec![-3.0, 1.0]]);
        g.observe_hidden_states(&[vec![0.0, 0.0], vec![3.0, 1.0]]);
        assert!(g.probe.as_ref().unwrap().read.score.get().unwrap() > 0.9);
        assert_eq!(
            values(g.apply(&logits(vec![0.0, 3.0, 0.0, 0.0]), &[]).unwrap()),
            vec![0.0, 3.0, 0.0, 0.0]
        );
    }

    #[test]
    fn sampling_settings_reach_the_engine_explicitly() {
        // greedy: the engine's deterministic settings (top_k 1), whatever top_p/top_k say
        let s = sampling(&params(0.0, 0.5, 40));
        assert_eq!((s.top_k, s.temperature), (Some(1), None));
        assert_eq!(s.max_len, Some(7));
        assert!(matches!(&s.stop_toks, Some(StopTokens::Seqs(v)) if v == &["END".to_string()]));
        // sampling: only what is switched on is sent
        let s = sampling(&params(0.7, 0.9, 40));
        assert_eq!(
            (s.temperature, s.top_p, s.top_k),
            (Some(0.7), Some(0.9), Some(40))
        );
        let s = sampling(&params(0.7, 1.0, 0));
        assert_eq!((s.top_p, s.top_k), (None, None));
        assert_eq!(s.repetition_penalty, None);
    }

    #[test]
    fn the_refusal_probability_is_the_softmax_mass_of_its_tokens() {
        // logits 0, ln 3, 0: probabilities 0.2, 0.6, 0.2
        let logits = [0.0, 3f32.ln(), 0.0];
        assert!((token_probability(&logits, &[1]) - 0.6).abs() < 1e-6);
        assert!((token_probability(&logits, &[0, 2]) - 0.4).abs() < 1e-6);
        // ids beyond the vocabulary and masked logits count nothing
        assert_eq!(token_probability(&logits, &[7]), 0.0);
        let masked = [f32::NEG_INFINITY, 0.0, 0.0];
        assert!((token_probability(&masked, &[1]) - 0.5).abs() < 1e-6);
        assert_eq!(token_probability(&masked, &[0]), 0.0);
        // large logits do not overflow
        assert!((token_probability(&[1000.0, 1000.0], &[0]) - 0.5).abs() < 1e-6);
    }

    #[test]
    fn the_pre_question_reads_no_against_yes() {
        // probabilities 0.1 (yes), 0.3 (no), 0.6 (other): no against yes is 0.75
        let logits = [0.1f32.ln(), 0.3f32.ln(), 0.6f32.ln()];
        assert!((no_against_yes(&logits, &[0], &[1]) - 0.75).abs() < 1e-6);
        // several spellings of each count together
        let logits = [0.1f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.4f32.ln()];
        assert!((no_against_yes(&logits, &[0, 3], &[1, 2]) - 0.5).abs() < 1e-6);
        // neither likely at all: undecided
        let masked = [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0];
        assert_eq!(no_against_yes(&masked, &[0], &[1]), 0.5);
    }

    #[test]
    fn a_stream_judges_by_its_pre_question_when_there_is_one() {
        let first = Arc::new(OnceLock::new());
        let judge = |question| Judge {
            question,
            first_token: Some(first.clone()),
            probe: None,
            threshold: 0.6,
        };
        // no pre-question: nothing until the first token, then the first token decides
        assert_eq!(judge(None).judgement(), None);
        let pre = judge(Some(0.7)).judgement().unwrap();
        assert!(pre.refuse && pre.probability == 0.7 && pre.signals.first_token.is_none());
        first.set(0.9).unwrap();
        let j = judge(None).judgement().unwrap();
        assert!(j.refuse && j.probability == 0.9);
        // with one, it decides; the first token is only recorded
        let j = judge(Some(0.2)).judgement().unwrap();
        assert!(!j.refuse && j.probability == 0.2);
        assert_eq!(
            j.signals,
            RefusalSignals {
                first_token: Some(0.9),
                question: Some(0.2),
                probe: None,
            }
        );
    }

    #[test]
    fn the_probe_decides_at_its_own_threshold_once_the_prefill_gave_its_score() {
        let first = Arc::new(OnceLock::new());
        let score = Arc::new(probe::ProbeScore::default());
        let judge = |question| Judge {
            question,
            first_token: Some(first.clone()),
            probe: Some((score.clone(), 0.3)),
            threshold: 0.9,
        };
        assert_eq!(judge(None).judgement(), None);
        // the prefill gave no states (e.g. a draft model's step): the first token decides
        first.set(0.5).unwrap();
        let j = judge(None).judgement().unwrap();
        assert!(!j.refuse && j.probability == 0.5 && j.signals.probe.is_none());
        score.set(Some(0.35));
        let j = judge(None).judgement().unwrap();
        assert!(j.refuse && j.probability == 0.35, "{j:?}");
        assert_eq!(j.signals.first_token, Some(0.5));
        score.set(Some(0.25));
        assert!(!judge(None).judgement().unwrap().refuse);
        // a pre-question still decides when asked
        assert!(judge(Some(0.95)).judgement().unwrap().refuse);
    }

    #[test]
    fn the_refusal_phrase_starts_with_its_first_tokens() {
        let encode = |t: &str| -> Vec<u32> { t.split(' ').map(|w| w.len() as u32).collect() };
        // "I don't know." and " I don't know." start with different tokens here
        assert_eq!(first_tokens("I don't know.", &encode), vec![1, 0]);
        assert!(first_tokens("  ", &encode).is_empty());
    }
}
