//! [`Generator`] behind the answer path's seam ([`docent_engine::Engine`]): each
//! method is the generator's own.

use futures::future::BoxFuture;
use futures::FutureExt;

use super::*;
use docent_engine::{Engine, TokenStream};

impl Engine for Generator {
    fn stream<'a>(
        &'a self,
        prompt: &'a Prompt,
        params: &'a Params,
    ) -> BoxFuture<'a, Result<Box<dyn TokenStream>, GenerateError>> {
        async move {
            let stream = Generator::stream(self, prompt, params).await?;
            Ok(Box::new(stream) as Box<dyn TokenStream>)
        }
        .boxed()
    }

    fn yes_probability<'a>(
        &'a self,
        system: &'a str,
        user: &'a str,
    ) -> BoxFuture<'a, Result<f32, GenerateError>> {
        Generator::yes_probability(self, system, user).boxed()
    }

    fn tokens(&self) -> &TokenCounter {
        Generator::tokens(self)
    }

    fn context_tokens(&self) -> usize {
        Generator::context_tokens(self)
    }

    fn stats(&self) -> EngineStats {
        Generator::stats(self)
    }

    fn model_path(&self) -> &Path {
        Generator::model_path(self)
    }

    fn precompute_passages<'a>(
        &'a self,
        prompt: &'a Prompt,
    ) -> BoxFuture<'a, Result<usize, GenerateError>> {
        Generator::precompute_passages(self, prompt).boxed()
    }

    fn reuse_stats(&self) -> Option<reuse::ReuseStats> {
        Generator::reuse_stats(self)
    }

    fn flush_passages(&self) -> BoxFuture<'_, ()> {
        Generator::flush_passages(self).boxed()
    }

    fn clear_passages(&self) {
        Generator::clear_passages(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl TokenStream for GenerationStream {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<StreamEvent, GenerateError>>> {
        GenerationStream::next(self).boxed()
    }

    fn judgement(&self) -> Option<Judgement> {
        GenerationStream::judgement(self)
    }

    fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        GenerationStream::hold(self, permit)
    }
}
