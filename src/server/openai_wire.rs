//! The OpenAI wire format of `POST /v1/chat/completions` and `GET /v1/models`, and its
//! mapping onto docent's query path (the handlers are in [`crate::server::routes::openai`]).
//!
//! - A [`ChatRequest`] becomes a [`QueryRequest`]: the last message (a user message) is the
//!   question, the earlier user and assistant messages are the history; system and
//!   developer messages are ignored (docent's own system prompt grounds the answer in the
//!   retrieved chunks); sampling fields map onto `generation`; docent's retrieval options
//!   come in the extra `docent` object. Fields that would change what an answer means
//!   (tools, logprobs, `n > 1`, JSON output…) are refused with a 400 naming them; fields
//!   that do not (`user`, `metadata`…) are ignored; unknown fields are refused.
//! - A [`QueryResponse`] becomes a [`ChatCompletion`] (with the citations as an extra
//!   field), and a streamed answer's events become [`Chunk`]s ([`ChunkWriter`]).
//! - docent's JSON errors become OpenAI's `{"error": {"message", "type", "param", "code"}}`
//!   ([`error_body`]).

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::query::postprocess::Citation;
use crate::query::prompt::{Role, Turn};
use crate::query::{
    AnswerMode, GenerationOptions, QueryError, QueryEvent, QueryRequest, QueryResponse,
    RetrievalOptions,
};
use crate::server::error::ApiError;

/// The model name accepted besides the served model's own id.
pub const ALIAS: &str = "docent";

/// The paths that speak OpenAI's format, errors included.
pub fn is_openai_path(path: &str) -> bool {
    path == "/v1/chat/completions" || path == "/v1/models" || path.starts_with("/v1/models/")
}

/// The generation model this server answers with, as `GET /v1/models` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    /// The model's id: its catalog name, or its file or folder name without `.gguf`.
    pub id: String,
    /// Always `"model"`.
    pub object: &'static str,
    /// The weights file's modification time (Unix seconds; 0 when unknown).
    pub created: u64,
    /// Always `"docent"`.
    pub owned_by: &'static str,
}

impl ModelCard {
    /// The model at `path` (a catalog name such as `qwen2.5-coder-0.5b`, a GGUF file, a
    /// safetensors folder or a Hugging Face id): the name, or the file or folder name
    /// without `.gguf`.
    pub fn of(path: &Path) -> ModelCard {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let id = name.strip_suffix(".gguf").unwrap_or(&name).to_string();
        let created = std::fs::metadata(crate::query::generate::catalog::resolve(path))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        ModelCard {
            id,
            object: "model",
            created,
            owned_by: "docent",
        }
    }

    /// Whether a request's `model` names this model (its id or [`ALIAS`]).
    pub fn answers_to(&self, model: &str) -> bool {
        model == self.id || model == ALIAS
    }
}

/// Why a chat request cannot be answered, before the query path sees it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChatError {
    /// A 400 naming the parameter (`param`) with OpenAI's `code`.
    #[error("{message}")]
    Invalid {
        /// The offending request parameter, e.g. `stop` or `messages[2].role`.
        param: String,
        /// OpenAI's error code: `invalid_value`, `invalid_type`, `unsupported_value` or
        /// `unknown_parameter`.
        code: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A 404: the request's `model` is neither the served model's id nor [`ALIAS`].
    #[error("The model `{0}` does not exist on this server: GET /v1/models lists the one it serves (`docent` is accepted as its alias)")]
    ModelNotFound(String),
}

impl ChatError {
    fn invalid(param: impl Into<String>, code: &'static str, message: impl Into<String>) -> Self {
        ChatError::Invalid {
            param: param.into(),
            code,
            message: message.into(),
        }
    }
}

impl From<ChatError> for ApiError {
    fn from(e: ChatError) -> Self {
        let message = e.to_string();
        match e {
            ChatError::Invalid { param, code, .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, code, message)
                    .with_details(json!({ "field": param }))
            }
            ChatError::ModelNotFound(_) => {
                ApiError::new(StatusCode::NOT_FOUND, "model_not_found", message)
                    .with_details(json!({ "field": "model" }))
            }
        }
    }
}

/// `POST /v1/chat/completions` body. Fields not named here are checked by
/// [`check_extra`]: ignored, accepted with their neutral value only, or refused.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The model to answer with: the served model's id or [`ALIAS`].
    pub model: String,
    /// The conversation; the last one must be a user message, the question.
    pub messages: Vec<Message>,
    /// Deprecated by OpenAI in favour of `max_completion_tokens`; both are accepted.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Most tokens to generate; default `generation.max_tokens`. Must equal `max_tokens`
    /// when both are sent.
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// Default: docent's (`generation.temperature`, greedy), not OpenAI's 1.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, (0, 1]; only with a temperature above 0.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Stop sequences: a string or an array of strings.
    #[serde(default)]
    pub stop: Option<Value>,
    /// Answer as a stream of chunks ending in `data: [DONE]`; default false.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Options of a streamed answer; refused unless `stream` is true.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// How many answers to make: only 1.
    #[serde(default)]
    pub n: Option<u64>,
    /// Refused, as on `/v1/query` (the engine cannot seed one request).
    #[serde(default)]
    pub seed: Option<i64>,
    /// docent's own options: retrieval, and the answer mode.
    #[serde(default)]
    pub docent: Option<DocentOptions>,
    /// Every other top-level field, for [`check_extra`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The `stream_options` object of a chat request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// One more chunk before `[DONE]`, with the usage and no choices.
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// Accepted and ignored: docent does not pad its chunks.
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// The extra `docent` object: the same `retrieval` and `mode` as `/v1/query`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocentOptions {
    /// How to retrieve (`top_k`, `mode`, `filter`…), as `retrieval` in `/v1/query`.
    #[serde(default)]
    pub retrieval: RetrievalOptions,
    /// `generative` (the default) or `extractive`, as `mode` in `/v1/query`.
    #[serde(default)]
    pub mode: Option<AnswerMode>,
}

/// The author of a chat message, as OpenAI names them (lowercase on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    /// Instructions from the client; ignored (docent's own system prompt applies).
    System,
    /// OpenAI's newer name for system instructions; ignored like `system`.
    Developer,
    /// A user's message; the last message must be one (the question).
    User,
    /// An earlier answer, kept in the history.
    Assistant,
    /// A tool's result; refused, as docent calls no tools.
    Tool,
    /// The older form of a tool's result; refused.
    Function,
}

impl std::fmt::Display for ChatRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChatRole::System => "system",
            ChatRole::Developer => "developer",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
            ChatRole::Function => "function",
        })
    }
}

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// Who wrote the message.
    pub role: ChatRole,
    /// A string or an array of `{"type": "text", "text": …}` parts.
    #[serde(default)]
    pub content: Option<Value>,
    /// Every other field of the message: `name`, `refusal` and `annotations` are ignored,
    /// `tool_calls`, `function_call` and `audio` accepted only when null or empty, the rest
    /// refused.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A chat request as docent answers it.
#[derive(Debug, Clone)]
pub struct Mapped {
    /// The request to put to the query path.
    pub query: QueryRequest,
    /// Whether to answer as a stream of chunks.
    pub stream: bool,
    /// Whether a stream ends with a usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The request's name for the token budget, for errors about it.
    max_tokens_param: &'static str,
}

/// Top-level fields that do not change the answer: accepted and ignored.
const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "parallel_tool_calls",
];

/// Top-level fields docent cannot honour: accepted only with the value that leaves the
/// answer as docent makes it (or null); the second column says which.
const NEUTRAL_ONLY: &[(&str, &str)] = &[
    ("frequency_penalty", "0"),
    ("presence_penalty", "0"),
    ("logprobs", "false"),
    ("top_logprobs", "0"),
    ("logit_bias", "{}"),
    ("response_format", "{\"type\": \"text\"}"),
    ("modalities", "[\"text\"]"),
    ("tools", "[]"),
    ("functions", "[]"),
    ("tool_choice", "\"none\" or \"auto\""),
    ("function_call", "\"none\" or \"auto\""),
    ("audio", "null"),
    ("prediction", "null"),
    ("reasoning_effort", "null"),
    ("verbosity", "null"),
    ("web_search_options", "null"),
];

fn is_neutral(name: &str, v: &Value) -> bool {
    match name {
        _ if v.is_null() => true,
        "frequency_penalty" | "presence_penalty" | "top_logprobs" => v.as_f64() == Some(0.0),
        "logprobs" => v == &Value::Bool(false),
        "logit_bias" => v.as_object().is_some_and(Map::is_empty),
        "response_format" => v == &json!({ "type": "text" }),
        "modalities" => v == &json!(["text"]),
        "tools" | "functions" => v.as_array().is_some_and(Vec::is_empty),
        "tool_choice" | "function_call" => v == "none" || v == "auto",
        _ => false,
    }
}

/// The fields outside [`ChatRequest`]'s own: ignored, neutral, or refused.
pub fn check_extra(extra: &Map<String, Value>) -> Result<(), ChatError> {
    for (name, value) in extra {
        if IGNORED.contains(&name.as_str()) {
            continue;
        }
        match NEUTRAL_ONLY.iter().find(|(n, _)| n == name) {
            Some((_, neutral)) if !is_neutral(name, value) => {
                return Err(ChatError::invalid(
                    name.clone(),
                    "unsupported_value",
                    format!("{name}: {value} is not supported by docent, which answers from the retrieved documents in plain text with citations; leave it out or send {neutral}"),
                ));
            }
            Some(_) => {}
            None => {
                return Err(ChatError::invalid(
                    name.clone(),
                    "unknown_parameter",
                    format!("Unrecognized request argument supplied: {name}"),
                ))
            }
        }
    }
    Ok(())
}

/// Message fields docent ignores (`name`, and what an echoed assistant message carries).
const MESSAGE_IGNORED: &[&str] = &["name", "refusal", "annotations"];
/// Message fields accepted only when null or empty (no tool calls, no audio).
const MESSAGE_EMPTY_ONLY: &[&str] = &["tool_calls", "function_call", "audio"];

/// A message's text: its string, or its text parts joined by newlines.
fn message_text(i: usize, m: &Message) -> Result<String, ChatError> {
    let param = format!("messages[{i}].content");
    for (key, value) in &m.extra {
        let empty = value.is_null() || value.as_array().is_some_and(Vec::is_empty);
        if MESSAGE_IGNORED.contains(&key.as_str())
            || (MESSAGE_EMPTY_ONLY.contains(&key.as_str()) && empty)
        {
            continue;
        }
        return Err(ChatError::invalid(
            format!("messages[{i}].{key}"),
            if MESSAGE_EMPTY_ONLY.contains(&key.as_str()) {
                "unsupported_value"
            } else {
                "unknown_parameter"
            },
            format!("messages[{i}].{key} is not supported: docent answers in text, without tools or audio"),
        ));
    }
    let text = match &m.content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    (Some("text"), _) => {
                        return Err(ChatError::invalid(
                            format!("{param}[{j}].text"),
                            "invalid_value",
                            format!("{param}[{j}]: a text part needs a string `text`"),
                        ))
                    }
                    (kind, _) => {
                        return Err(ChatError::invalid(
                            format!("{param}[{j}].type"),
                            "unsupported_value",
                            format!(
                                "{param}[{j}]: only text parts are supported, got {}",
                                kind.map_or("no type".into(), |k| format!("{k:?}"))
                            ),
                        ))
                    }
                }
            }
            texts.join("\n")
        }
        Some(other) => {
            return Err(ChatError::invalid(
                param,
                "invalid_type",
                format!(
                    "messages[{i}].content must be a string or an array of text parts, got {other}"
                ),
            ))
        }
        None => String::new(),
    };
    if text.trim().is_empty() {
        return Err(ChatError::invalid(
            param,
            "invalid_value",
            format!("messages[{i}] has no text"),
        ));
    }
    Ok(text)
}

impl ChatRequest {
    /// The [`QueryRequest`] this request asks, once its model is known to be served:
    /// every OpenAI-specific rule checked here, docent's own ranges by the query path.
    pub fn into_query(self) -> Result<Mapped, ChatError> {
        check_extra(&self.extra)?;
        if self.n.is_some_and(|n| n != 1) {
            return Err(ChatError::invalid(
                "n",
                "unsupported_value",
                "n: docent makes one answer per request; send n = 1 or leave it out",
            ));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ChatError::invalid(
                "stream_options",
                "invalid_value",
                "stream_options is only allowed when stream is true",
            ));
        }
        let (max_tokens, max_tokens_param) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(a), Some(b)) if a != b => {
                return Err(ChatError::invalid(
                    "max_tokens",
                    "invalid_value",
                    format!(
                        "max_tokens ({b}) and max_completion_tokens ({a}) differ; send one of them"
                    ),
                ))
            }
            (Some(a), _) => (Some(a), "max_completion_tokens"),
            (None, b) => (b, "max_tokens"),
        };
        let stop = match self.stop {
            None | Some(Value::Null) => vec![],
            Some(Value::String(s)) => vec![s],
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    other => Err(ChatError::invalid(
                        "stop",
                        "invalid_type",
                        format!("stop: each sequence must be a string, got {other}"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(ChatError::invalid(
                    "stop",
                    "invalid_type",
                    format!("stop must be a string or an array of strings, got {other}"),
                ))
            }
        };
        let (question, history) = conversation(&self.messages)?;
        let docent = self.docent.unwrap_or_default();
        Ok(Mapped {
            query: QueryRequest {
                question,
                retrieval: docent.retrieval,
                generation: GenerationOptions {
                    max_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    stop,
                    // any seed is refused by the query path's own check, with its reason
                    seed: self.seed.map(i64::unsigned_abs),
                    ..GenerationOptions::default()
                },
                stream,
                history,
                mode: docent.mode,
            },
            stream,
            include_usage: self
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            max_tokens_param,
        })
    }
}

/// The question (the last message, a user message) and the history (the earlier user and
/// assistant messages; system and developer messages are left out).
fn conversation(messages: &[Message]) -> Result<(String, Vec<Turn>), ChatError> {
    let Some(last) = messages.last() else {
        return Err(ChatError::invalid(
            "messages",
            "invalid_value",
            "messages must hold at least one message, the last a user message",
        ));
    };
    if last.role != ChatRole::User {
        return Err(ChatError::invalid(
            format!("messages[{}].role", messages.len() - 1),
            "invalid_value",
            format!(
                "the last message must be a user message (the question), got {}",
                last.role
            ),
        ));
    }
    let mut history = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role {
            ChatRole::System | ChatRole::Developer => continue,
            ChatRole::User => Role::User,
            ChatRole::Assistant => Role::Assistant,
            ChatRole::Tool | ChatRole::Function => {
                return Err(ChatError::invalid(
                    format!("messages[{i}].role"),
                    "unsupported_value",
                    format!(
                        "messages[{i}]: {} messages are not supported: docent calls no tools",
                        m.role
                    ),
                ))
            }
        };
        history.push(Turn {
            role,
            content: message_text(i, m)?,
        });
    }
    let question = history.pop().map(|t| t.content).unwrap_or_default();
    Ok((question, history))
}

impl Mapped {
    /// The query path's error in OpenAI's terms: a field of the [`QueryRequest`] is named
    /// by the request parameter it came from.
    pub fn error(&self, e: QueryError) -> ApiError {
        match e {
            QueryError::Invalid { field, message } => {
                let (param, what) = self.param(field);
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_value",
                    format!("{what}: {message}"),
                )
                .with_details(json!({ "field": param }))
            }
            other => ApiError::from(other),
        }
    }

    /// The parameter a query field came from, and how to name it in a message.
    fn param(&self, field: &str) -> (String, String) {
        let same = |p: &str| (p.to_string(), p.to_string());
        match field {
            "question" => ("messages".into(), "the last user message".into()),
            "history" => ("messages".into(), "the earlier messages".into()),
            "generation.max_tokens" => same(self.max_tokens_param),
            "mode" => same("docent.mode"),
            f => match f.strip_prefix("generation.") {
                Some(g) => same(g),
                None => same(&format!("docent.{f}")),
            },
        }
    }
}

/// Token counts of one answer, in OpenAI's `usage` shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatUsage {
    /// Tokens of the prompt the model was given.
    pub prompt_tokens: usize,
    /// Tokens the model generated.
    pub completion_tokens: usize,
    /// The sum of the two.
    pub total_tokens: usize,
}

impl ChatUsage {
    fn of(r: &QueryResponse) -> Self {
        ChatUsage {
            prompt_tokens: r.usage.prompt_tokens,
            completion_tokens: r.usage.completion_tokens,
            total_tokens: r.usage.prompt_tokens + r.usage.completion_tokens,
        }
    }
}

/// Safety reasons that end an answer before a sentence that is never shown.
const CUT_BY_SAFETY: &[&str] = &["deny", "system_prompt_echo"];

/// Why the answer ended: `content_filter` when the safety filter withheld it or ended it
/// early (a deny pattern, an echo of the system prompt), `length` when the model used all
/// of `max_tokens`, `stop` otherwise (end of text, a stop sequence, a guard, a refusal or
/// an extractive answer).
pub fn finish_reason(r: &QueryResponse, max_tokens: usize) -> &'static str {
    let cut = r
        .safety
        .reasons
        .iter()
        .any(|reason| CUT_BY_SAFETY.contains(&reason.as_str()));
    if r.mode == AnswerMode::Withheld || r.safety.blocked || cut {
        "content_filter"
    } else if r.mode == AnswerMode::Generative && r.usage.completion_tokens >= max_tokens {
        "length"
    } else {
        "stop"
    }
}

/// `POST /v1/chat/completions` response (`stream: false`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    /// The completion's id: `chatcmpl-` and a random UUID.
    pub id: String,
    /// Always `"chat.completion"`.
    pub object: &'static str,
    /// When the request was received, Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// The one answer.
    pub choices: Vec<Choice>,
    /// Token counts of the answer.
    pub usage: ChatUsage,
    /// docent's extra: the cited chunks, as `/v1/query` returns them.
    pub citations: Vec<Citation>,
}

/// One answer of a [`ChatCompletion`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    /// Always 0: docent makes one answer per request.
    pub index: u32,
    /// The answer.
    pub message: AssistantMessage,
    /// Always null: docent returns no log probabilities.
    pub logprobs: Option<Value>,
    /// Why the answer ended: `stop`, `length` or `content_filter` (see [`finish_reason`]).
    pub finish_reason: &'static str,
}

/// The answer as an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssistantMessage {
    /// Always `"assistant"`.
    pub role: &'static str,
    /// The answer's text, as `answer` in `/v1/query` returns it.
    pub content: String,
    /// Always null: a refusal is given as the answer's text.
    pub refusal: Option<String>,
}

/// One `data:` object of a streamed completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Chunk {
    /// The completion's id, the same on every chunk of a stream.
    pub id: String,
    /// Always `"chat.completion.chunk"`.
    pub object: &'static str,
    /// When the request was received, Unix seconds; the same on every chunk.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// One choice with this chunk's delta; empty on the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Absent without `stream_options.include_usage`; with it, null on every chunk but
    /// the last, which has it (and no choices).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<ChatUsage>>,
    /// On the chunk with the `finish_reason`: the cited chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub citations: Option<Vec<Citation>>,
}

/// The one choice of a streamed [`Chunk`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// What this chunk adds to the answer.
    pub delta: Delta,
    /// Always null: docent returns no log probabilities.
    pub logprobs: Option<Value>,
    /// Null until the last chunk with a choice, which says why the answer ended.
    pub finish_reason: Option<&'static str>,
}

/// What a streamed chunk adds to the answer: the role on the first chunk, text after it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Delta {
    /// `"assistant"` on the first chunk; omitted on the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// The next piece of the answer's text; omitted when there is none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// What every response to one request shares: its id, time and model.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The completion's id: `chatcmpl-` and a random UUID as 32 hex digits.
    pub id: String,
    /// When the reply was started, Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// The request's token budget (resolved), for `finish_reason`.
    pub max_tokens: usize,
}

impl Reply {
    /// A reply with a new id and the current time, for `model` with a budget of
    /// `max_tokens`.
    pub fn new(model: String, max_tokens: usize) -> Reply {
        Reply {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model,
            max_tokens,
        }
    }

    /// The non-streamed response for the answer `r`.
    pub fn completion(&self, r: QueryResponse) -> ChatCompletion {
        ChatCompletion {
            id: self.id.clone(),
            object: "chat.completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![Choice {
                index: 0,
                finish_reason: finish_reason(&r, self.max_tokens),
                message: AssistantMessage {
                    role: "assistant",
                    content: r.answer.clone(),
                    refusal: None,
                },
                logprobs: None,
            }],
            usage: ChatUsage::of(&r),
            citations: r.citations,
        }
    }
}

/// Turns a streamed answer's events into the `data:` payloads of OpenAI's stream: a chunk
/// with the role, one per `delta` event, one with the `finish_reason` and the citations,
/// the usage chunk when asked for, then `[DONE]`. A failure after the start is one
/// `{"error": …}` payload (which OpenAI's clients raise), and the stream ends.
#[derive(Debug)]
pub struct ChunkWriter {
    reply: Reply,
    include_usage: bool,
    finished: bool,
}

impl ChunkWriter {
    /// A writer for `reply`'s stream; `include_usage` adds the usage chunk before
    /// `[DONE]`.
    pub fn new(reply: Reply, include_usage: bool) -> ChunkWriter {
        ChunkWriter {
            reply,
            include_usage,
            finished: false,
        }
    }

    fn chunk(&self, delta: Delta, finish_reason: Option<&'static str>) -> Chunk {
        Chunk {
            id: self.reply.id.clone(),
            object: "chat.completion.chunk",
            created: self.reply.created,
            model: self.reply.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason,
            }],
            usage: self.include_usage.then_some(None),
            citations: None,
        }
    }

    fn data(chunk: &Chunk) -> String {
        serde_json::to_string(chunk)
            .unwrap_or_else(|e| error_payload(&ApiError::from(QueryError::Internal(e.to_string()))))
    }

    /// The first payload: the assistant's role, no text yet.
    pub fn start(&self) -> String {
        Self::data(&self.chunk(
            Delta {
                role: Some("assistant"),
                content: Some(String::new()),
            },
            None,
        ))
    }

    /// True once the stream has said all it will.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The payloads for one answer event (none for retrieval and citation events: the
    /// citations come with the last chunk).
    pub fn event(&mut self, event: QueryEvent) -> Vec<String> {
        if self.finished {
            return vec![];
        }
        match event {
            QueryEvent::Retrieval(_) | QueryEvent::Citation(_) => vec![],
            QueryEvent::Delta { text } if text.is_empty() => vec![],
            QueryEvent::Delta { text } => vec![Self::data(&self.chunk(
                Delta {
                    role: None,
                    content: Some(text),
                },
                None,
            ))],
            QueryEvent::Done(r) => {
                self.finished = true;
                let mut last = self.chunk(
                    Delta::default(),
                    Some(finish_reason(&r, self.reply.max_tokens)),
                );
                let usage = ChatUsage::of(&r);
                last.citations = Some(r.citations);
                let mut out = vec![Self::data(&last)];
                if self.include_usage {
                    let mut tail = self.chunk(Delta::default(), None);
                    tail.choices.clear();
                    tail.usage = Some(Some(usage));
                    out.push(Self::data(&tail));
                }
                out.push("[DONE]".into());
                out
            }
            QueryEvent::Error(e) => {
                self.finished = true;
                vec![error_payload(&ApiError::from(e))]
            }
        }
    }

    /// The events ended without `done` or `error` (should not happen): an error payload.
    pub fn end(&mut self) -> Vec<String> {
        self.event(QueryEvent::Error(QueryError::Internal(
            "the answer ended without a result".into(),
        )))
    }
}

/// An error as an in-stream payload: `{"error": {…}}` in OpenAI's shape.
fn error_payload(e: &ApiError) -> String {
    use actix_web::ResponseError;
    let docent = serde_json::to_value(e).unwrap_or(Value::Null);
    json!({ "error": error_body(e.status_code(), &docent).1 }).to_string()
}

/// docent's error (`{"code", "message", "details"}`, the value of its `error` key) with its
/// status, as OpenAI's: the status (422 becomes 400, as OpenAI answers invalid requests)
/// and the `{"message", "type", "param", "code"}` object.
pub fn error_body(status: StatusCode, docent: &Value) -> (StatusCode, Value) {
    let code = docent.get("code").and_then(Value::as_str).unwrap_or("");
    let message = docent
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_string());
    let param = docent
        .get("details")
        .and_then(|d| d.get("field"))
        .cloned()
        .unwrap_or(Value::Null);
    let status = if status == StatusCode::UNPROCESSABLE_ENTITY {
        StatusCode::BAD_REQUEST
    } else {
        status
    };
    let kind = match status.as_u16() {
        401 => "invalid_request_error",
        403 => "permission_error",
        429 => "requests",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    };
    let code = match (status.as_u16(), code) {
        (401, _) => json!("invalid_api_key"),
        (429, _) => json!("rate_limit_exceeded"),
        (_, "prompt_too_long") => json!("context_length_exceeded"),
        (_, "invalid_request") => json!("invalid_value"),
        (_, "") => Value::Null,
        (_, c) => json!(c),
    };
    (
        status,
        json!({ "message": message, "type": kind, "param": param, "code": code }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::{SearchResponse, Usage};
    use docent_ingest::store::SearchMode;

    fn request(body: Value) -> Result<Mapped, ChatError> {
        let chat: ChatRequest = serde_json::from_value(body).expect("parses");
        chat.into_query()
    }

    fn invalid_param(r: Result<Mapped, ChatError>) -> (String, &'static str) {
        match r {
            Err(ChatError::Invalid { param, code, .. }) => (param, code),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn last_user_message_is_the_question_and_earlier_ones_the_history() {
        let m = request(json!({
            "model": "docent",
            "messages": [
                {"role": "system", "content": "You are a pirate."},
                {"role": "user", "content": "What is a crate?"},
                {"role": "assistant", "content": [{"type": "text", "text": "A compilation unit."}], "refusal": null},
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "And a"}, {"type": "text", "text": "package?"}], "name": "ann"}
            ],
            "max_completion_tokens": 64, "temperature": 0, "top_p": 0.9, "stop": "\n\n",
            "user": "u-1", "metadata": {"a": "b"}, "store": false, "logprobs": false,
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
            "docent": {"retrieval": {"top_k": 3, "mode": "sparse", "filter": {"collection": "book"}}, "mode": "extractive"}
        }))
        .unwrap();
        let q = &m.query;
        assert_eq!(q.question, "And a\npackage?");
        assert_eq!(
            q.history,
            vec![
                Turn {
                    role: Role::User,
                    content: "What is a crate?".into()
                },
                Turn {
                    role: Role::Assistant,
                    content: "A compilation unit.".into()
                },
            ]
        );
        assert_eq!(q.generation.max_tokens, Some(64));
        assert_eq!(q.generation.temperature, Some(0.0));
        assert_eq!(q.generation.top_p, Some(0.9));
        assert_eq!(q.generation.stop, vec!["\n\n".to_string()]);
        assert_eq!(q.retrieval.top_k, Some(3));
        assert_eq!(q.retrieval.mode, Some(SearchMode::Sparse));
        assert_eq!(q.retrieval.filter.collection.as_deref(), Some("book"));
        assert_eq!(q.mode, Some(AnswerMode::Extractive));
        assert!(!m.stream && !m.include_usage);
        assert_eq!(m.max_tokens_param, "max_completion_tokens");
    }

    #[test]
    fn streaming_options_and_stop_arrays() {
        let m = request(json!({
            "model": "x", "messages": [{"role": "user", "content": "q"}],
            "stream": true, "stream_options": {"include_usage": true}, "stop": ["a", "b"],
            "max_tokens": 10, "n": 1
        }))
        .unwrap();
        assert!(m.stream && m.include_usage && m.query.stream);
        assert_eq!(
            m.query.generation.stop,
            vec!["a".to_string(), "b".to_string()]
        );
        assert_eq!(m.query.generation.max_tokens, Some(10));
        assert_eq!(m.max_tokens_param, "max_tokens");
    }

    #[test]
    fn refuses_what_would_change_the_answer() {
        let base = |extra: Value| {
            let mut b = json!({"model": "docent", "messages": [{"role": "user", "content": "q"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            invalid_param(request(b))
        };
        assert_eq!(base(json!({"n": 2})), ("n".into(), "unsupported_value"));
        assert_eq!(
            base(json!({"logprobs": true})),
            ("logprobs".into(), "unsupported_value")
        );
        assert_eq!(base(json!({"presence_penalty": 0.5})).0, "presence_penalty");
        assert_eq!(
            base(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})).0,
            "tools"
        );
        assert_eq!(base(json!({"tool_choice": "required"})).0, "tool_choice");
        assert_eq!(
            base(json!({"response_format": {"type": "json_object"}})).0,
            "response_format"
        );
        assert_eq!(
            base(json!({"frobnicate": 1})),
            ("frobnicate".into(), "unknown_parameter")
        );
        assert_eq!(
            base(json!({"stream_options": {"include_usage": true}})).0,
            "stream_options"
        );
        assert_eq!(
            base(json!({"max_tokens": 5, "max_completion_tokens": 6})).0,
            "max_tokens"
        );
        assert_eq!(base(json!({"stop": 3})), ("stop".into(), "invalid_type"));
        // neutral values and ignored fields pass
        assert!(request(json!({"model": "docent", "messages": [{"role": "user", "content": "q"}],
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "modalities": ["text"],
            "parallel_tool_calls": true, "service_tier": "auto", "seed": null, "n": null})).is_ok());
    }

    #[test]
    fn message_rules() {
        let msgs = |m: Value| invalid_param(request(json!({"model": "docent", "messages": m})));
        assert_eq!(msgs(json!([])).0, "messages");
        assert_eq!(
            msgs(json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]))
                .0,
            "messages[1].role"
        );
        assert_eq!(
            msgs(json!([{"role": "user", "content": "q"}, {"role": "system", "content": "s"}])).0,
            "messages[1].role"
        );
        assert_eq!(
            msgs(json!([{"role": "tool", "content": "r", "tool_call_id": "1"}, {"role": "user", "content": "q"}])).0,
            "messages[0].role"
        );
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
            ),
            ("messages[0].content[0].type".into(), "unsupported_value")
        );
        assert_eq!(
            msgs(json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}, {"role": "user", "content": "q"}])).0,
            "messages[0].tool_calls"
        );
        assert_eq!(
            msgs(json!([{"role": "assistant", "content": "  "}, {"role": "user", "content": "q"}]))
                .0,
            "messages[0].content"
        );
        assert_eq!(
            msgs(json!([{"role": "user", "content": 5}])).1,
            "invalid_type"
        );
        // an unknown role is a body error (serde), not a mapping one
        assert!(serde_json::from_value::<ChatRequest>(
            json!({"model": "m", "messages": [{"role": "robot", "content": "q"}]})
        )
        .is_err());
    }

    #[test]
    fn query_errors_name_the_openai_parameter() {
        let m = request(json!({"model": "docent", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 9})).unwrap();
        let body = |e: ApiError| serde_json::to_value(&e).unwrap();
        let e = body(m.error(QueryError::Invalid {
            field: "generation.max_tokens",
            message: "too big".into(),
        }));
        assert_eq!(e["details"]["field"], "max_completion_tokens");
        assert_eq!(e["message"], "max_completion_tokens: too big");
        for (field, param) in [
            ("generation.seed", "seed"),
            ("generation.temperature", "temperature"),
            ("question", "messages"),
            ("history", "messages"),
            ("retrieval.top_k", "docent.retrieval.top_k"),
            (
                "retrieval.filter.collection",
                "docent.retrieval.filter.collection",
            ),
            ("mode", "docent.mode"),
        ] {
            let message = "x".to_string();
            let e = body(m.error(QueryError::Invalid { field, message }));
            assert_eq!(e["details"]["field"], param, "{field}");
        }
        // a seed reaches the query path's own refusal
        let s = request(
            json!({"model": "docent", "messages": [{"role": "user", "content": "q"}], "seed": -3}),
        )
        .unwrap();
        assert_eq!(s.query.generation.seed, Some(3));
    }

    #[test]
    fn errors_in_openai_shape() {
        let docent = |code: &str, field: Option<&str>| json!({"code": code, "message": "m", "details": field.map(|f| json!({"field": f}))});
        let (s, b) = error_body(
            StatusCode::UNPROCESSABLE_ENTITY,
            &docent("invalid_request", Some("temperature")),
        );
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert_eq!(
            b,
            json!({"message": "m", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"})
        );
        let (s, b) = error_body(StatusCode::UNAUTHORIZED, &docent("unauthorized", None));
        assert_eq!(
            (s.as_u16(), &b["type"], &b["code"], &b["param"]),
            (
                401,
                &json!("invalid_request_error"),
                &json!("invalid_api_key"),
                &Value::Null
            )
        );
        let (s, b) = error_body(StatusCode::TOO_MANY_REQUESTS, &docent("rate_limited", None));
        assert_eq!(
            (s.as_u16(), &b["code"]),
            (429, &json!("rate_limit_exceeded"))
        );
        let (s, b) = error_body(StatusCode::SERVICE_UNAVAILABLE, &docent("overloaded", None));
        assert_eq!(
            (s.as_u16(), &b["type"], &b["code"]),
            (503, &json!("server_error"), &json!("overloaded"))
        );
        let (_, b) = error_body(
            StatusCode::UNPROCESSABLE_ENTITY,
            &docent("prompt_too_long", None),
        );
        assert_eq!(b["code"], "context_length_exceeded");
        let (s, b) = error_body(
            StatusCode::PAYLOAD_TOO_LARGE,
            &docent("payload_too_large", None),
        );
        assert_eq!(
            (s.as_u16(), &b["type"]),
            (413, &json!("invalid_request_error"))
        );
        let model: ApiError = ChatError::ModelNotFound("gpt-4o".into()).into();
        let (s, b) = error_body(
            StatusCode::NOT_FOUND,
            &serde_json::to_value(&model).unwrap(),
        );
        assert_eq!(
            (s.as_u16(), &b["code"], &b["param"]),
            (404, &json!("model_not_found"), &json!("model"))
        );
        assert!(b["message"].as_str().unwrap().contains("gpt-4o"));
    }

    fn response(answer: &str, mode: AnswerMode, completion_tokens: usize) -> QueryResponse {
        QueryResponse {
            answer: answer.into(),
            citations: vec![],
            answerable: true,
            mode,
            degenerate: vec![],
            cached: false,
            usage: Usage {
                prompt_tokens: 100,
                completion_tokens,
                ..Usage::default()
            },
            safety: Default::default(),
            refused: false,
            refusal_reason: None,
            refusal_probability: None,
            refusal_signals: None,
        }
    }

    #[test]
    fn finish_reasons() {
        for (mode, completion_tokens, reason) in [
            (AnswerMode::Generative, 48, "length"),
            (AnswerMode::Generative, 12, "stop"),
            (AnswerMode::Extractive, 48, "stop"),
            (AnswerMode::Refusal, 0, "stop"),
            (AnswerMode::Withheld, 3, "content_filter"),
        ] {
            let r = response("a", mode, completion_tokens);
            assert_eq!(
                finish_reason(&r, 48),
                reason,
                "{mode:?} {completion_tokens}"
            );
        }
        let mut ended = response("a", AnswerMode::Generative, 12);
        ended.safety.reasons = vec!["pii:email".into()];
        assert_eq!(finish_reason(&ended, 48), "stop");
        ended.safety.reasons.push("deny".into());
        assert_eq!(finish_reason(&ended, 48), "content_filter");
    }

    #[test]
    fn completion_and_chunks() {
        let reply = Reply::new("SmolLM2".into(), 48);
        assert!(reply.id.starts_with("chatcmpl-"));
        let c =
            serde_json::to_value(reply.completion(response("Hi [1].", AnswerMode::Generative, 7)))
                .unwrap();
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(
            c["choices"][0]["message"],
            json!({"role": "assistant", "content": "Hi [1].", "refusal": null})
        );
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            c["usage"],
            json!({"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107})
        );
        assert_eq!(c["citations"], json!([]));

        let mut w = ChunkWriter::new(reply.clone(), true);
        let first: Value = serde_json::from_str(&w.start()).unwrap();
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(first["usage"], Value::Null);
        assert!(first.get("usage").is_some());
        let search = SearchResponse {
            mode: SearchMode::Hybrid,
            hits: vec![],
            retrieval_ms: 1.0,
        };
        assert!(w.event(QueryEvent::Retrieval(Box::new(search))).is_empty());
        let d: Value =
            serde_json::from_str(&w.event(QueryEvent::Delta { text: "Hi".into() })[0]).unwrap();
        assert_eq!(d["choices"][0]["delta"], json!({"content": "Hi"}));
        assert_eq!(d["object"], "chat.completion.chunk");
        assert_eq!(d["id"], json!(reply.id));
        let end = w.event(QueryEvent::Done(Box::new(response(
            "Hi",
            AnswerMode::Generative,
            48,
        ))));
        assert_eq!(end.len(), 3);
        let last: Value = serde_json::from_str(&end[0]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["citations"], json!([]));
        let usage: Value = serde_json::from_str(&end[1]).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 148);
        assert_eq!(end[2], "[DONE]");
        assert!(
            w.finished()
                && w.event(QueryEvent::Delta {
                    text: "late".into()
                })
                .is_empty()
        );

        // without include_usage: no usage field, no usage chunk
        let mut w = ChunkWriter::new(reply.clone(), false);
        assert!(serde_json::from_str::<Value>(&w.start())
            .unwrap()
            .get("usage")
            .is_none());
        let end = w.event(QueryEvent::Done(Box::new(response(
            "Hi",
            AnswerMode::Generative,
            2,
        ))));
        assert_eq!(end.len(), 2);
        // a failure mid-stream: one error payload, no [DONE]
        let mut w = ChunkWriter::new(reply, false);
        let e = w.end();
        let err: Value = serde_json::from_str(&e[0]).unwrap();
        assert_eq!(err["error"]["type"], "server_error");
        assert_eq!(e.len(), 1);
        assert!(w.finished());
    }

    #[test]
    fn model_card_and_aliases() {
        let card = ModelCard::of(Path::new("/nowhere/SmolLM2-135M-Instruct.Q8_0.gguf"));
        assert_eq!(card.id, "SmolLM2-135M-Instruct.Q8_0");
        assert_eq!(card.created, 0);
        assert!(card.answers_to("SmolLM2-135M-Instruct.Q8_0") && card.answers_to("docent"));
        assert!(!card.answers_to("gpt-4o"));
        assert!(is_openai_path("/v1/models/abc") && is_openai_path("/v1/chat/completions"));
        assert!(!is_openai_path("/v1/query"));
    }
}
