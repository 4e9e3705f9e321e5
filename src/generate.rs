//! Stage **generate**: a mistral.rs engine over a local GGUF model.
//!
//! Loaded through `GGUFLoaderBuilder` rather than `GgufModelBuilder` so that the activation
//! dtype can be chosen (the builder hard-codes `Auto`, which picks BF16 on many CPUs and is
//! slower than F32 there), the prefix cache can be turned off (on CPU mistral.rs never evicts
//! it), and a missing file is an error instead of a Hugging Face lookup.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mistralrs::core::{
    DefaultSchedulerMethod, GGUFLoaderBuilder, GGUFSpecificConfig, MistralRsBuilder, ModelDType,
    SchedulerConfig,
};
use mistralrs::{
    AutoDeviceMapParams, Constraint, DeviceMapSetting, Model, NormalRequest, Request,
    RequestBuilder, RequestLike, RequestMessage, Response, SamplingParams, StopTokens,
    TextMessageRole, TokenSource,
};
use tokio::sync::mpsc;

use crate::config::GenerationConfig;

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("generation model {path} does not exist; run `make setup` or set generation.model")]
    ModelMissing { path: PathBuf },
    #[error("loading the generation model {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("the request was rejected by the engine: {0}")]
    Validation(String),
    #[error("generation failed: {0}")]
    Engine(String),
}

/// Per-request decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub max_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling mass; 1 = off. Ignored when greedy.
    pub top_p: f64,
    /// Top-k sampling; 0 = off. Ignored when greedy.
    pub top_k: usize,
    /// 1.0 is off; above 1 discourages repeating tokens already in the context.
    pub repetition_penalty: f32,
    /// Strings that end the answer; cut out of the text.
    pub stop: Vec<String>,
}

/// A finished generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: String,
    /// Ids of the generated tokens, when asked for (`complete_tokens`).
    pub token_ids: Option<Vec<u32>>,
}

pub struct Generator {
    model: Model,
    path: PathBuf,
}

fn dtype(name: &str) -> ModelDType {
    match name {
        "f16" => ModelDType::F16,
        "bf16" => ModelDType::BF16,
        "auto" => ModelDType::Auto,
        _ => ModelDType::F32,
    }
}

impl Generator {
    /// Loads the GGUF file named in `config` (blocking work; call before serving).
    pub async fn load(config: &GenerationConfig) -> Result<Self, GenerateError> {
        let path = config.model.clone();
        let canonical = path
            .canonicalize()
            .ok()
            .filter(|p| p.is_file())
            .ok_or_else(|| GenerateError::ModelMissing { path: path.clone() })?;
        let load_err = |message: String| GenerateError::Load {
            path: path.clone(),
            message,
        };
        let dir = canonical
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| load_err("no parent directory".into()))?;
        let file = canonical
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .ok_or_else(|| load_err("no file name".into()))?;
        let force_cpu = config.device == "cpu";
        let dtype = dtype(&config.dtype);
        let max_num_seqs = NonZeroUsize::new(config.max_num_seqs).unwrap_or(NonZeroUsize::MIN);

        let pipeline = tokio::task::spawn_blocking(move || {
            let loader = GGUFLoaderBuilder::new(
                None,
                None,
                dir.to_string_lossy().into_owned(),
                vec![file],
                GGUFSpecificConfig { topology: None },
                false,
                None,
            )
            .build();
            let device = mistralrs::best_device(force_cpu).map_err(|e| e.to_string())?;
            loader
                .load_model_from_hf(
                    None,
                    TokenSource::None,
                    &dtype,
                    &device,
                    true,
                    DeviceMapSetting::Auto(AutoDeviceMapParams::default_text()),
                    None,
                    None,
                )
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| load_err(e.to_string()))?
        .map_err(load_err)?;

        let runner = MistralRsBuilder::new(
            pipeline,
            SchedulerConfig::DefaultScheduler {
                method: DefaultSchedulerMethod::Fixed(max_num_seqs),
            },
            false,
            None,
        )
        .with_no_prefix_cache(true)
        .build()
        .await;
        Ok(Generator {
            model: Model::new(runner),
            path,
        })
    }

    pub fn model_path(&self) -> &Path {
        &self.path
    }

    /// Chat generation with the model's own chat template.
    pub async fn chat(
        &self,
        system: &str,
        user: &str,
        params: &Params,
    ) -> Result<Generation, GenerateError> {
        let mut builder = RequestBuilder::new()
            .add_message(TextMessageRole::System, system)
            .add_message(TextMessageRole::User, user);
        let messages = builder.take_messages();
        self.run(messages, sampling(params), false).await
    }

    /// Raw completion from token ids (no template), greedy; returns the generated ids too.
    pub async fn complete_tokens(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<Generation, GenerateError> {
        let params = Params {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            stop: vec![],
        };
        let mut sampling = sampling(&params);
        // The top-1 alternative of a greedy step is the chosen token: that is how the
        // engine's response carries token ids.
        sampling.top_n_logprobs = 1;
        self.run(RequestMessage::CompletionTokens(tokens), sampling, true)
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

    async fn run(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        logprobs: bool,
    ) -> Result<Generation, GenerateError> {
        let (tx, mut rx) = mpsc::channel(8);
        let request = Request::Normal(Box::new(NormalRequest {
            messages,
            sampling_params,
            response: tx,
            return_logprobs: logprobs,
            is_streaming: false,
            id: self.model.inner().next_request_id(),
            constraint: Constraint::None,
            suffix: None,
            tools: None,
            tool_choice: None,
            logits_processors: None,
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
            .map_err(|e| GenerateError::Engine(e.to_string()))?;
        let response = rx
            .recv()
            .await
            .ok_or_else(|| GenerateError::Engine("the engine dropped the request".into()))?;
        match response {
            Response::Done(r) => {
                let choice = r.choices.into_iter().next();
                Ok(Generation {
                    finish_reason: choice
                        .as_ref()
                        .map(|c| c.finish_reason.clone())
                        .unwrap_or_default(),
                    text: choice.and_then(|c| c.message.content).unwrap_or_default(),
                    prompt_tokens: r.usage.prompt_tokens,
                    completion_tokens: r.usage.completion_tokens,
                    token_ids: None,
                })
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
                Ok(Generation {
                    finish_reason: choice
                        .as_ref()
                        .map(|c| c.finish_reason.clone())
                        .unwrap_or_default(),
                    text: choice.map(|c| c.text).unwrap_or_default(),
                    prompt_tokens: r.usage.prompt_tokens,
                    completion_tokens: r.usage.completion_tokens,
                    token_ids,
                })
            }
            Response::ValidationError(e) => Err(GenerateError::Validation(e.to_string())),
            Response::InternalError(e) => Err(GenerateError::Engine(e.to_string())),
            Response::ModelError(m, _) | Response::CompletionModelError(m, _) => {
                Err(GenerateError::Engine(m))
            }
            _ => Err(GenerateError::Engine("unexpected response kind".into())),
        }
    }
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
            stop: vec!["END".into()],
        }
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
}
