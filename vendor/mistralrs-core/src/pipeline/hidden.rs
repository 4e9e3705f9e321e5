//! docent (vendor/PATCHES.md 20): the hidden states of a prompt's last token, kept by the
//! model during the prefill, handed to the logits processors of the sequences that read them.

use candle_core::{IndexOp, Result, Tensor};

use crate::sequence::Sequence;

/// `states` holds one (batch, hidden) tensor per layer, rows in the order of `seq_indices`
/// (row `i` belongs to `seqs[seq_indices[i]]`). A model that kept nothing leaves the
/// processors uncalled.
pub(crate) fn deliver(
    seqs: &mut [&mut Sequence],
    seq_indices: &[usize],
    states: &[Tensor],
) -> Result<()> {
    if states.is_empty() {
        return Ok(());
    }
    for (row, &seq) in seq_indices.iter().enumerate() {
        let sampler = seqs[seq].sampler();
        if !sampler.wants_hidden_states() {
            continue;
        }
        let layers = states
            .iter()
            .map(|layer| layer.i(row)?.to_vec1::<f32>())
            .collect::<Result<Vec<_>>>()?;
        sampler.observe_hidden_states(&layers);
    }
    Ok(())
}
