//! docent (vendor/PATCHES.md 20): the hidden states of a prompt's last token, kept by the
//! model during the prefill, handed to the logits processors of the sequences that read them.

use candle_core::{IndexOp, Result, Tensor};

use crate::sequence::Sequence;

/// The layers some sequence of the step asks for (`None`: none; empty: every layer).
pub(crate) fn wanted(seqs: &mut [&mut Sequence]) -> Option<Vec<usize>> {
    crate::sampler::merge_layers(seqs.iter_mut().map(|s| s.sampler().hidden_state_layers()))
}

/// `states` holds one (batch, hidden) tensor per layer (`None` for a layer not kept), rows
/// in the order of `seq_indices` (row `i` belongs to `seqs[seq_indices[i]]`). A model that
/// kept nothing leaves the processors uncalled.
pub(crate) fn deliver(
    seqs: &mut [&mut Sequence],
    seq_indices: &[usize],
    states: &[Option<Tensor>],
) -> Result<()> {
    if states.is_empty() {
        return Ok(());
    }
    for (row, &seq) in seq_indices.iter().enumerate() {
        let sampler = seqs[seq].sampler();
        if sampler.hidden_state_layers().is_none() {
            continue;
        }
        let layers = states
            .iter()
            .map(|layer| match layer {
                Some(t) => t.i(row)?.to_vec1::<f32>(),
                None => Ok(Vec::new()),
            })
            .collect::<Result<Vec<_>>>()?;
        sampler.observe_hidden_states(&layers);
    }
    Ok(())
}
