//! The checks of `[generation]` (the settings themselves belong to the generate stage:
//! `query::generate::GenerationConfig`).

use super::*;

/// `[generation]` as its checks see it: the settings belong to the generate stage's crate,
/// the checks (and the messages that say what to fix) to the configuration.
pub(super) struct Checks<'a>(pub(super) &'a GenerationConfig);

impl std::ops::Deref for Checks<'_> {
    type Target = GenerationConfig;
    fn deref(&self) -> &GenerationConfig {
        self.0
    }
}

impl Checks<'_> {
    /// The engine's settings, sampling, passage reuse, the models and the refusal.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.validate_engine()?;
        self.validate_sampling()?;
        self.validate_passage_reuse()?;
        self.validate_models()?;
        self.validate_refusal()
    }

    /// dtype, device, kernels, instruction set, KV cache, prefill chunks, threads, queue.
    fn validate_engine(&self) -> Result<(), ConfigError> {
        use crate::query::generate::device::{DeviceChoice, CUDA_BUILT};
        if !["f32", "f16", "bf16", "auto"].contains(&self.dtype.as_str()) {
            return invalid(
                "generation.dtype",
                format!("must be one of f32, f16, bf16, auto, got {:?}", self.dtype),
            );
        }
        match self.device.parse::<DeviceChoice>() {
            Err(e) => return invalid("generation.device", e),
            Ok(DeviceChoice::Cuda(_)) if !CUDA_BUILT => {
                return invalid(
                    "generation.device",
                    "this binary was built without CUDA: build with `--features cuda` \
                     (scripts/cuda-toolkit.sh), or use cpu or auto"
                        .into(),
                );
            }
            Ok(_) => {}
        }
        if !["docent", "candle"].contains(&self.kernels.as_str()) {
            return invalid(
                "generation.kernels",
                format!("must be docent or candle, got {:?}", self.kernels),
            );
        }
        if !["auto", "avx512", "avx2", "scalar"].contains(&self.isa.as_str()) {
            return invalid(
                "generation.isa",
                format!("must be auto, avx512, avx2 or scalar, got {:?}", self.isa),
            );
        }
        if !["f32", "f16"].contains(&self.kv_cache.as_str()) {
            return invalid(
                "generation.kv_cache",
                format!("must be f32 or f16, got {:?}", self.kv_cache),
            );
        }
        if self.prefill_chunk_tokens != 0 && !(16..=65_536).contains(&self.prefill_chunk_tokens) {
            return invalid(
                "generation.prefill_chunk_tokens",
                format!(
                    "must be 0 (off) or between 16 and 65536, got {}",
                    self.prefill_chunk_tokens
                ),
            );
        }
        if self.threads > 1024 {
            return invalid(
                "generation.threads",
                format!("must be 0 (one per core) to 1024, got {}", self.threads),
            );
        }
        if self.max_queue == 0 {
            return invalid("generation.max_queue", "must be at least 1".into());
        }
        Ok(())
    }

    /// Answer mode, temperature, top_p, penalties and token limits.
    fn validate_sampling(&self) -> Result<(), ConfigError> {
        if !matches!(
            self.answer_mode,
            crate::query::AnswerMode::Generative | crate::query::AnswerMode::Extractive
        ) {
            return invalid(
                "generation.answer_mode",
                format!(
                    "must be generative or extractive, got {:?}",
                    self.answer_mode
                ),
            );
        }
        if !(0.0..=2.0).contains(&self.temperature) {
            return invalid(
                "generation.temperature",
                format!("must be in 0..=2, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(
                "generation.top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            );
        }
        if !(0.5..=2.0).contains(&self.repetition_penalty) {
            return invalid(
                "generation.repetition_penalty",
                format!("must be in 0.5..=2, got {}", self.repetition_penalty),
            );
        }
        if !(0.0..=5.0).contains(&self.dry_multiplier) {
            return invalid(
                "generation.dry_multiplier",
                format!("must be in 0..=5 (0 is off), got {}", self.dry_multiplier),
            );
        }
        if self.max_tokens > self.max_tokens_limit {
            return invalid(
                "generation.max_tokens",
                format!(
                    "must not exceed generation.max_tokens_limit ({}), got {}",
                    self.max_tokens_limit, self.max_tokens
                ),
            );
        }
        if self.max_tokens == 0 || self.max_num_seqs == 0 {
            return invalid(
                "generation.max_tokens",
                "generation.max_tokens and generation.max_num_seqs must be at least 1".into(),
            );
        }
        Ok(())
    }

    /// The placed keys' scale and the memory bound, when passage reuse is on. (With a
    /// draft model or without continuous batching reuse is off with a warning, not an
    /// error: it is on by default; see `query::generate::passage_cache`.)
    fn validate_passage_reuse(&self) -> Result<(), ConfigError> {
        if self.passage_reuse == crate::query::generate::reuse::PassageReuse::Off {
            return Ok(());
        }
        let scale = self.passage_key_scale;
        if !(scale.is_finite() && scale > 0.0 && scale <= 4.0) {
            return invalid(
                "generation.passage_key_scale",
                format!(
                    "must be above 0 and at most 4 (1 leaves placed keys as they are), not {scale}"
                ),
            );
        }
        if self.passage_cache_mib == 0 {
            return invalid(
                "generation.passage_cache_mib",
                "must be at least 1 with generation.passage_reuse on".to_string(),
            );
        }
        Ok(())
    }

    /// In-place quantization, UQFF, the model names, prompt lookup and the draft model.
    fn validate_models(&self) -> Result<(), ConfigError> {
        use crate::query::generate::catalog;
        if let Some(isq) = &self.isq {
            if !crate::query::generate::isq_known(isq) {
                return invalid(
                    "generation.isq",
                    format!("unknown quantization {isq:?}; use q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k or q8k"),
                );
            }
        }
        if self.uqff.is_some() && self.isq.is_none() {
            return invalid(
                "generation.uqff",
                "needs generation.isq (the quantization to write)".into(),
            );
        }
        let models = [
            ("generation.model", Some(&self.model)),
            (
                "generation.draft.model",
                self.draft.as_ref().map(|d| &d.model),
            ),
        ];
        for (field, model) in models {
            let Some(model) = model else { continue };
            let name = model.to_string_lossy();
            if catalog::looks_like_name(model) && catalog::find(&name).is_none() {
                let known: Vec<&str> = catalog::known().iter().map(|m| m.name.as_str()).collect();
                return invalid(
                    field,
                    format!(
                        "{name:?} is neither a known model ({}; `docent models` lists them) nor an existing file; give a name or the path of a GGUF file",
                        known.join(", ")
                    ),
                );
            }
        }
        let lookup_max = crate::query::generate::lookup::MAX_DRAFT_TOKENS;
        if self.lookup_tokens > lookup_max {
            return invalid(
                "generation.lookup_tokens",
                format!(
                    "must be between 0 (off) and {lookup_max}, got {}",
                    self.lookup_tokens
                ),
            );
        }
        if self.draft.is_some() && self.lookup_tokens > 0 {
            return invalid(
                "generation.lookup_tokens",
                "prompt-lookup drafts and a draft model (generation.draft) are alternatives: set generation.lookup_tokens = 0 or remove generation.draft".into(),
            );
        }
        if let Some(draft) = &self.draft {
            if !(1..=16).contains(&draft.gamma) {
                return invalid(
                    "generation.draft.gamma",
                    format!("must be between 1 and 16, got {}", draft.gamma),
                );
            }
            if self.temperature != 0.0 {
                return invalid(
                    "generation.temperature",
                    "speculative decoding (generation.draft) is greedy only in mistral.rs: set temperature = 0".into(),
                );
            }
        }
        Ok(())
    }

    /// The refusal threshold, and the question check's need of a refusal phrase.
    fn validate_refusal(&self) -> Result<(), ConfigError> {
        let t = self.refusal_threshold;
        if !(t > 0.0 && t <= 1.0) {
            return invalid(
                "generation.refusal_threshold",
                format!("is a probability above 0 and at most 1 (1: refuse only when the model writes the refusal phrase), got {t}"),
            );
        }
        if self.refusal_check == crate::query::generate::RefusalCheck::Question
            && self.refusal_phrase.trim().is_empty()
        {
            return invalid(
                "generation.refusal",
                "\"question\" asks the model whether the passages hold the answer, which is off when generation.refusal_phrase is empty; set a refusal phrase or use \"first_token\"".to_string(),
            );
        }
        Ok(())
    }
}
