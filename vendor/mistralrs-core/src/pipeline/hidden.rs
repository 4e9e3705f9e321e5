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

/// docent (vendor/PATCHES.md 23): each sequence whose processors read the prompt's keys and
/// values gets them from its cache, once the whole prompt is there.
pub(crate) fn deliver_prompt_kv(seqs: &mut [&mut Sequence]) -> Result<()> {
    for seq in seqs.iter_mut() {
        let sampler = seq.sampler();
        if !sampler.reads_prompt_kv() {
            continue;
        }
        let mut layers = Vec::new();
        for cache in seq.normal_cache().iter() {
            match cache.as_ref().map(|c| (c.k(), c.v())) {
                Some((Ok(Some(k)), Ok(Some(v)))) => layers.push((k, v)),
                _ => return Ok(()), // no normal cache: nothing to hand over
            }
        }
        sampler.observe_prompt_kv(&layers);
    }
    Ok(())
}
