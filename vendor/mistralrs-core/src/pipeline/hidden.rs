//! docent (vendor/PATCHES.md 20): the hidden states of a prompt's last token, kept by the
//! model during the prefill, handed to the logits processors of the sequences that read them;
//! with PATCHES.md 22, those of every decode step's input token too.

use candle_core::{IndexOp, Result, Tensor};

use crate::sequence::Sequence;

/// The layers some sequence of a prompt step (or a decode step) asks for (`None`: none;
/// empty: every layer).
pub(crate) fn wanted(seqs: &mut [&mut Sequence], is_prompt: bool) -> Option<Vec<usize>> {
    crate::sampler::merge_layers(
        seqs.iter_mut()
            .map(|s| s.sampler().hidden_state_layers(is_prompt)),
    )
}

/// `states` holds one (batch, hidden) tensor per layer (`None` for a layer not kept), rows
/// in the order of `seq_indices` (row `i` belongs to `seqs[seq_indices[i]]`). A model that
/// kept nothing leaves the processors uncalled.
pub(crate) fn deliver(
    seqs: &mut [&mut Sequence],
    seq_indices: &[usize],
    states: &[Option<Tensor>],
    is_prompt: bool,
) -> Result<()> {
    if states.is_empty() {
        return Ok(());
    }
    for (row, &seq) in seq_indices.iter().enumerate() {
        let sampler = seqs[seq].sampler();
        if sampler.hidden_state_layers(is_prompt).is_none() {
            continue;
        }
        let layers = states
            .iter()
            .map(|layer| match layer {
                Some(t) => t.i(row)?.to_vec1::<f32>(),
                None => Ok(Vec::new()),
            })
            .collect::<Result<Vec<_>>>()?;
        sampler.observe_hidden_states(&layers, is_prompt);
    }
    Ok(())
}
