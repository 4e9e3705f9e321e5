//! The model's judgement of whether the passages answer: the first-token gate, the probe's
//! gate, the pre-question's yes/no, and the token sets they read.

use super::*;

/// The model's judgement at the first generated step: its probability of starting the
/// answer with one of `tokens` (the refusal phrase's first tokens). At or above
/// `threshold` the logits pass unchanged (the model refuses, and docent stops it there);
/// below, those tokens are masked at that step, so the model answers instead of writing
/// the phrase it was only somewhat inclined to write. `masked` tokens are masked at that
/// step whatever the judgement (`generation.lead_with_marker`); with no refusal tokens the
/// gate only masks.
pub(super) struct RefusalGate {
    pub(super) tokens: Vec<u32>,
    pub(super) threshold: f32,
    pub(super) probability: Arc<OnceLock<f32>>,
    pub(super) masked: Vec<u32>,
    /// With [`RefusalCheck::Probe`]: the probe reads the prompt's hidden states in the
    /// prefill, and its score decides at the first step instead of `threshold`.
    pub(super) probe: Option<ProbeGate>,
}

/// The probe a [`RefusalGate`] decides with.
pub(super) struct ProbeGate {
    pub(super) read: probe::ProbeRead,
    pub(super) threshold: f32,
}

impl mistralrs::CustomLogitsProcessor for RefusalGate {
    fn apply(
        &self,
        logits: &mistralrs::Tensor,
        _context: &[u32],
    ) -> mistralrs::Result<mistralrs::Tensor> {
        if self.probability.get().is_some() {
            return Ok(logits.clone());
        }
        let mut values: Vec<f32> = logits
            .flatten_all()?
            .to_dtype(mistralrs::DType::F32)?
            .to_vec1()?;
        let probability = token_probability(&values, &self.tokens);
        let _ = self.probability.set(probability);
        let probe = self
            .probe
            .as_ref()
            .and_then(|g| Some((g.read.score.get()?, g.threshold)));
        let refuse = match probe {
            Some((score, threshold)) => score >= threshold,
            None => !self.tokens.is_empty() && probability >= self.threshold,
        };
        if refuse {
            return Ok(logits.clone());
        }
        for &t in self.tokens.iter().chain(&self.masked) {
            if let Some(v) = values.get_mut(t as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        mistralrs::Tensor::from_vec(values, logits.shape(), logits.device())?
            .to_dtype(logits.dtype())
    }

    fn hidden_state_layers(&self) -> Option<Vec<usize>> {
        self.probe.as_ref().map(|g| vec![g.read.probe.file.layer])
    }

    fn observe_hidden_states(&self, states: &[Vec<f32>]) {
        if let Some(g) = &self.probe {
            g.read.score.set(g.read.probe.score(states));
        }
    }
}

/// A refusal probe and the threshold it decides at.
pub(super) type ProbeWithThreshold = (Arc<probe::Probe>, f32);

/// The refusal signal `config` asks for, after the fallback for a model without a probe,
/// and the probe with its threshold (`generation.refusal_probe_threshold`, else the file's).
pub(super) fn refusal_signal(
    config: &GenerationConfig,
) -> Result<(RefusalCheck, Option<ProbeWithThreshold>), String> {
    Ok(match config.refusal_check {
        RefusalCheck::Probe => match refusal_probe(config, &catalog::resolve(&config.model))
            .map_err(|e| e.to_string())?
        {
            Some(p) => {
                let threshold = config.refusal_probe_threshold.unwrap_or(p.file.threshold);
                (RefusalCheck::Probe, Some((Arc::new(p), threshold)))
            }
            None => {
                tracing::warn!(
                    model = %config.model.display(),
                    "no refusal probe for this model (generation.refusal_probe); refusals \
                     fall back to the first-token signal (generation.refusal = \"first_token\")"
                );
                (RefusalCheck::FirstToken, None)
            }
        },
        other => (other, None),
    })
}

/// The refusal probe for `config.model` (whose file is `model_file`): the file
/// `generation.refusal_probe` names, else the one shipped for the catalog model (named, or a
/// path to a file of the same size and sha256); `None` when there is none. Checked against
/// the model file's sha256: a probe for another file is an error that says what to do.
pub(super) fn refusal_probe(
    config: &GenerationConfig,
    model_file: &Path,
) -> Result<Option<probe::Probe>, probe::ProbeError> {
    if !model_file.is_file() {
        // a hub id or a missing file: the loader says what is wrong
        return Ok(None);
    }
    let sha = || {
        probe::file_sha256(model_file).map_err(|e| probe::ProbeError::Read {
            path: model_file.to_path_buf(),
            message: e.to_string(),
        })
    };
    let (name, probe) = match &config.refusal_probe {
        Some(path) => (path.display().to_string(), probe::Probe::read(path)?),
        None => {
            let named = config.model.to_str().and_then(catalog::find);
            let size = std::fs::metadata(model_file).map(|m| m.len()).ok();
            let entry = match named {
                Some(m) => Some(m),
                // a path: the catalog file it is, by size, then by hash
                None => match catalog::known()
                    .iter()
                    .find(|m| m.refusal_probe.is_some() && m.bytes.is_some() && m.bytes == size)
                {
                    Some(m) if m.sha256.as_deref() == Some(sha()?.as_str()) => Some(m),
                    _ => None,
                },
            };
            let shipped = entry
                .and_then(|m| m.refusal_probe.as_deref())
                .and_then(|name| Some((name, probe::shipped(name)?)));
            match shipped {
                Some((name, text)) => (name.to_string(), probe::Probe::parse(name, text)?),
                None => return Ok(None),
            }
        }
    };
    probe.for_model(&name, model_file, &sha()?).map(Some)
}

/// Reads the pre-question's first step: the probability of `no` against `yes`
/// (their softmax masses, normalised to the two), 0.5 when neither is likely at all.
pub(super) struct YesNo {
    pub(super) yes: Vec<u32>,
    pub(super) no: Vec<u32>,
    pub(super) probability: Arc<OnceLock<f32>>,
}

impl mistralrs::CustomLogitsProcessor for YesNo {
    fn apply(
        &self,
        logits: &mistralrs::Tensor,
        _context: &[u32],
    ) -> mistralrs::Result<mistralrs::Tensor> {
        if self.probability.get().is_none() {
            let values: Vec<f32> = logits
                .flatten_all()?
                .to_dtype(mistralrs::DType::F32)?
                .to_vec1()?;
            let _ = self
                .probability
                .set(no_against_yes(&values, &self.yes, &self.no));
        }
        Ok(logits.clone())
    }
}

/// P(no) / (P(yes) + P(no)) under `logits`; 0.5 when both are 0.
pub(super) fn no_against_yes(logits: &[f32], yes: &[u32], no: &[u32]) -> f32 {
    let (y, n) = (
        token_probability(logits, yes),
        token_probability(logits, no),
    );
    if y + n > 0.0 {
        n / (y + n)
    } else {
        0.5
    }
}

/// The softmax probability of `tokens` together under `logits` (0 for ids out of range).
pub(super) fn token_probability(logits: &[f32], tokens: &[u32]) -> f32 {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return 0.0;
    }
    let total: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let hit: f64 = tokens
        .iter()
        .filter_map(|&t| logits.get(t as usize))
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    (hit / total) as f32
}

/// The first token of `phrase` as an answer starts with it, alone and after a blank
/// (tokenizers that mark a word's start), without repeats; none for an empty phrase.
pub(super) fn first_tokens(
    phrase: &str,
    encode: &(dyn Fn(&str) -> Vec<u32> + Send + Sync),
) -> Vec<u32> {
    let phrase = phrase.trim();
    if phrase.is_empty() {
        return Vec::new();
    }
    let mut tokens: Vec<u32> = [phrase.to_string(), format!(" {phrase}")]
        .iter()
        .filter_map(|p| encode(p).first().copied())
        .collect();
    tokens.dedup();
    tokens
}

impl Generator {
    /// The pre-question ([`RefusalCheck::Question`]): the prompt with `prompt.check` after
    /// the question, one greedy step; the probability of "no" against "yes" there.
    pub(super) async fn check(&self, prompt: &Prompt) -> Result<f32, GenerateError> {
        let mut asked = prompt.clone();
        asked.user = format!("{}\n\n{}", prompt.user, prompt.check);
        self.no_against_yes(&asked).await
    }

    /// A yes/no question put to the model (`system`, then `user`): the probability of
    /// "yes" against "no" at the first step of the answer.
    pub async fn yes_probability(&self, system: &str, user: &str) -> Result<f32, GenerateError> {
        let prompt = Prompt {
            system: system.to_string(),
            history: Vec::new(),
            user: user.to_string(),
            check: String::new(),
            fence: String::new(),
            passages: Vec::new(),
        };
        Ok(1.0 - self.no_against_yes(&prompt).await?)
    }

    /// One greedy step after `asked`; the probability of "no" against "yes" there.
    async fn no_against_yes(&self, asked: &Prompt) -> Result<f32, GenerateError> {
        let probability = Arc::<OnceLock<f32>>::default();
        let reader = YesNo {
            yes: self.yes_tokens.clone(),
            no: self.no_tokens.clone(),
            probability: probability.clone(),
        };
        self.one_step(messages(asked), Arc::new(reader)).await?;
        probability
            .get()
            .copied()
            .ok_or_else(|| GenerateError::Engine("the pre-question was not read".into()))
    }

    /// One greedy step after `prompt` with `reader` as its logits processor (which reads
    /// what it needs: the step's logits, the prompt's hidden states).
    pub(super) async fn one_step(
        &self,
        messages: RequestMessage,
        reader: Arc<dyn mistralrs::CustomLogitsProcessor>,
    ) -> Result<(), GenerateError> {
        let response = self
            .request_once(
                messages,
                sampling(&Params::greedy(1)),
                false,
                Some(vec![reader]),
                Drafts::NONE,
                Vec::new(),
            )
            .await?;
        match response {
            Response::Done(_) | Response::CompletionDone(_) => Ok(()),
            other => Err(response_error(other)),
        }
    }

    /// The hidden states at `prompt`'s last token, per layer (0: after the first; `layers`
    /// only, the others empty; every layer when `layers` is empty), read in one greedy step's
    /// prefill as an answer's would be; `None` when the model does not give them (not the
    /// quantized Llama decoder, or a draft model's step).
    pub async fn hidden_states(
        &self,
        prompt: &Prompt,
        layers: &[usize],
    ) -> Result<Option<Vec<Vec<f32>>>, GenerateError> {
        let reader = Arc::new(probe::StateReader {
            layers: layers.to_vec(),
            states: Default::default(),
        });
        self.one_step(messages(prompt), reader.clone()).await?;
        Ok(reader.states.lock().ok().and_then(|mut s| s.take()))
    }

    /// The hidden states at the last of `tokens` (a raw completion's prefill: no template),
    /// as [`Self::hidden_states`] reads them.
    pub async fn token_states(
        &self,
        tokens: Vec<u32>,
        layers: &[usize],
    ) -> Result<Option<Vec<Vec<f32>>>, GenerateError> {
        let reader = Arc::new(probe::StateReader {
            layers: layers.to_vec(),
            states: Default::default(),
        });
        self.one_step(RequestMessage::CompletionTokens(tokens), reader.clone())
            .await?;
        Ok(reader.states.lock().ok().and_then(|mut s| s.take()))
    }

    /// The refusal probe this generator decides with, and its threshold.
    pub fn probe(&self) -> Option<(&probe::Probe, f32)> {
        self.probe.as_ref().map(|(p, t)| (p.as_ref(), *t))
    }
}
