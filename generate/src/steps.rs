//! The hidden states at every generated token, for the citation check (issue 54): the state
//! where a citation marker ends says whether the model grounded what it cited.
//!
//! The vendored engine hands a decode step's states at the position of the step's input
//! token (the token sampled at the step before) to the processors that ask for them
//! (vendor/PATCHES.md 22). [`StepReader`] keeps them per generated token with the generated
//! ids, and [`marker_states`] finds, for each citation marker of the answer's text, the state
//! of the token that completed it. A step that verifies drafts (prompt lookup, a draft
//! model) gives none: those tokens have no state.

use std::sync::Mutex;

/// The states at one generated token, per asked layer (in the order of
/// [`StepReader::layers`]); `None` where the step gave none.
pub type TokenStates = Option<Vec<Vec<f32>>>;

/// A logits processor that keeps the states of some layers at every generated token.
pub struct StepReader {
    /// The layers read (0: after the first decoder layer; empty: every layer).
    pub layers: Vec<usize>,
    steps: Mutex<Steps>,
}

/// What a [`StepReader`] kept.
#[derive(Debug, Default, Clone)]
pub struct Steps {
    /// The prompt's token ids (the context of the first call).
    pub prompt: Option<Vec<u32>>,
    /// Observed at this step, waiting for the step's sampling.
    pending: TokenStates,
    /// Per generated token, in order: its states (the last token generated has none: no
    /// step read it).
    pub states: Vec<TokenStates>,
    /// The generated ids, up to the last one a step read.
    pub ids: Vec<u32>,
    /// The states at the prompt's last token (the prefill's), at the same layers.
    pub prompt_states: TokenStates,
}

impl StepReader {
    /// A reader of `layers` (0: after the first decoder layer; empty: every layer), nothing
    /// kept yet.
    pub fn new(layers: Vec<usize>) -> Self {
        StepReader {
            layers,
            steps: Mutex::default(),
        }
    }

    /// What was kept so far.
    pub fn steps(&self) -> Steps {
        self.steps.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl mistralrs::CustomLogitsProcessor for StepReader {
    fn apply(
        &self,
        logits: &mistralrs::Tensor,
        context: &[u32],
    ) -> mistralrs::Result<mistralrs::Tensor> {
        if let Ok(mut s) = self.steps.lock() {
            match s.prompt.as_ref().map(Vec::len) {
                None => s.prompt = Some(context.to_vec()),
                Some(p) if context.len() > p => {
                    // the step's state belongs to the last generated token of the context
                    let seen = context.len() - p;
                    let pending = s.pending.take();
                    s.states.resize(seen - 1, None);
                    s.states.push(pending);
                    s.ids = context[p..].to_vec();
                }
                Some(_) => {}
            }
        }
        Ok(logits.clone())
    }

    fn hidden_state_layers(&self) -> Option<Vec<usize>> {
        Some(self.layers.clone())
    }

    fn hidden_states_in_decode(&self) -> bool {
        true
    }

    fn observe_hidden_states(&self, states: &[Vec<f32>]) {
        let kept = self.kept(states);
        if let Ok(mut s) = self.steps.lock() {
            s.prompt_states = Some(kept);
        }
    }

    fn observe_decode_states(&self, states: &[Vec<f32>]) {
        let kept = self.kept(states);
        if let Ok(mut s) = self.steps.lock() {
            s.pending = Some(kept);
        }
    }
}

impl StepReader {
    fn kept(&self, states: &[Vec<f32>]) -> Vec<Vec<f32>> {
        if self.layers.is_empty() {
            states.to_vec()
        } else {
            self.layers
                .iter()
                .map(|&l| states.get(l).cloned().unwrap_or_default())
                .collect()
        }
    }
}

/// For each end offset in `ends` (bytes into the generated text, ascending), the index of
/// the first generated token whose decoded prefix reaches it: the token that completed the
/// text up to there. `decode` turns ids into text as the answer was streamed.
pub fn token_at_ends(
    ids: &[u32],
    ends: &[usize],
    decode: &dyn Fn(&[u32]) -> String,
) -> Vec<Option<usize>> {
    let mut out = Vec::with_capacity(ends.len());
    let mut token = 0;
    let mut reached = 0;
    for &end in ends {
        while reached < end && token < ids.len() {
            reached = decode(&ids[..=token]).len();
            if reached >= end {
                break;
            }
            token += 1;
        }
        out.push((reached >= end && token < ids.len()).then_some(token));
    }
    out
}

/// The states at the token completing each of `ends` (see [`token_at_ends`]).
pub fn marker_states<'a>(
    steps: &'a Steps,
    ends: &[usize],
    decode: &dyn Fn(&[u32]) -> String,
) -> Vec<Option<&'a Vec<Vec<f32>>>> {
    token_at_ends(&steps.ids, ends, decode)
        .into_iter()
        .map(|t| t.and_then(|t| steps.states.get(t)?.as_ref()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoder of single characters: id `c` is the character `c`.
    fn chars(ids: &[u32]) -> String {
        ids.iter().filter_map(|&i| char::from_u32(i)).collect()
    }

    #[test]
    fn a_marker_end_maps_to_the_token_that_completed_it() {
        // "ab[1]c" with "[1]" one token: the text "ab" "[1]" "c"
        let ids: Vec<u32> = vec!['a' as u32, 'b' as u32, '[' as u32, ']' as u32, 'c' as u32];
        // "ab[]" ends at byte 4 (token 3), "ab" at 2 (token 1), past the end: none
        assert_eq!(
            token_at_ends(&ids, &[2, 4, 9], &chars),
            vec![Some(1), Some(3), None]
        );
        assert_eq!(token_at_ends(&ids, &[1, 1], &chars), vec![Some(0), Some(0)]);
    }

    #[test]
    fn the_reader_keeps_each_steps_state_with_its_token() {
        use mistralrs::CustomLogitsProcessor;
        let r = StepReader::new(vec![1]);
        let logits =
            mistralrs::Tensor::zeros(4, mistralrs::DType::F32, &mistralrs::Device::Cpu).unwrap();
        // prompt step: context = the prompt (3 tokens)
        r.apply(&logits, &[7, 8, 9]).unwrap();
        // step 2: the state of generated token 0 (id 5), layers 0 and 1 given
        r.observe_decode_states(&[vec![0.0], vec![1.5]]);
        r.apply(&logits, &[7, 8, 9, 5]).unwrap();
        // step 3 without states (a verified draft), then step 4 with
        r.apply(&logits, &[7, 8, 9, 5, 6]).unwrap();
        r.observe_decode_states(&[vec![0.0], vec![2.5]]);
        r.apply(&logits, &[7, 8, 9, 5, 6, 4]).unwrap();
        let s = r.steps();
        assert_eq!(s.ids, vec![5, 6, 4]);
        assert_eq!(
            s.states,
            vec![Some(vec![vec![1.5]]), None, Some(vec![vec![2.5]])]
        );
        let ends = marker_states(&s, &[1, 3], &chars);
        assert_eq!(ends[0], Some(&vec![vec![1.5]]));
        assert_eq!(ends[1], Some(&vec![vec![2.5]]));
    }
}
