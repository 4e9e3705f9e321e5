//! The seam between docent's answer path and a generation engine: what answering a
//! question needs from a model, and nothing of how the model runs.
//!
//! [`Engine`] is what docent's `QueryEngine` holds: stream an answer for a prompt
//! (with the model's refusal judgement beside it), ask a yes/no question (the injection
//! screen's second stage), count tokens for the prompt budget, and keep passage blocks
//! ahead of the questions. `docent_generate::Generator` (mistral.rs over a local
//! model, in its own crate) implements it; [`scripted::ScriptedEngine`] answers from a script, so the answer
//! path's own logic (budget, screen, refusal, stops, citations, cache) is tested in
//! milliseconds without a model.
//!
//! Not for: loading models, engine settings, raw completions or hidden states for training
//! (those are the generator's own, used by the tools that train and measure it).

#![warn(missing_docs)]
// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

mod prompt;
pub mod scripted;
mod types;

pub use prompt::*;
pub use types::*;

use std::path::Path;
use std::sync::Arc;

use futures::future::BoxFuture;

/// One engine, shared by every request of a process.
pub type SharedEngine = Arc<dyn Engine>;

/// What the answer path needs from a generation engine.
pub trait Engine: Send + Sync + 'static {
    /// The answer to `prompt`, token by token, with the model's refusal judgement; an engine
    /// whose judgement refuses before the answer starts may end the stream at once.
    fn stream<'a>(
        &'a self,
        prompt: &'a Prompt,
        params: &'a Params,
    ) -> BoxFuture<'a, Result<Box<dyn TokenStream>, GenerateError>>;

    /// The probability of "yes" against "no" for a yes/no question (`system`, then `user`).
    fn yes_probability<'a>(
        &'a self,
        system: &'a str,
        user: &'a str,
    ) -> BoxFuture<'a, Result<f32, GenerateError>>;

    /// The tokenizer's counts and the chat template's overhead, for the prompt budget.
    fn tokens(&self) -> &TokenCounter;

    /// Tokens the prompt and the answer may use together.
    fn context_tokens(&self) -> usize;

    /// Generations running or waiting now, and streams cancelled so far.
    fn stats(&self) -> EngineStats;

    /// The model file, as `/healthz` and `/v1/models` name it.
    fn model_path(&self) -> &Path;

    /// Computes the passage blocks of `prompt` that are not kept yet; how many it computed
    /// (0 when the engine keeps none).
    fn precompute_passages<'a>(
        &'a self,
        prompt: &'a Prompt,
    ) -> BoxFuture<'a, Result<usize, GenerateError>>;

    /// What passage reuse has done (`None`: the engine keeps no passage blocks).
    fn reuse_stats(&self) -> Option<ReuseStats>;

    /// Waits until every passage block kept so far is on disk.
    fn flush_passages(&self) -> BoxFuture<'_, ()>;

    /// Forgets every passage block kept in memory.
    fn clear_passages(&self);

    /// The engine as itself, for the tools that need a concrete engine's own methods
    /// (docent's `QueryEngine::generator`).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// An answer being generated. Dropping it before `Done` cancels the generation.
pub trait TokenStream: Send {
    /// The next event: text deltas, then `Done`; `None` after `Done` or an error.
    fn next(&mut self) -> BoxFuture<'_, Option<Result<StreamEvent, GenerateError>>>;

    /// The model's refusal judgement: from the start when it was asked before the answer,
    /// else once the first token is out (`None` before, or when the engine judges nothing).
    fn judgement(&self) -> Option<Judgement>;

    /// Keeps `permit` (a place in the answer queue) until the engine has let go of the
    /// generation, also when the stream is dropped early.
    fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit);
}
