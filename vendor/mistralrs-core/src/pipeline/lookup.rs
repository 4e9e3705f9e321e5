//! docent (vendor/PATCHES.md 17): a draft read from the sequence's own text, checked by the
//! model in one pass.
//!
//! A completion step of one sequence may take a draft: tokens that a registered proposer
//! (docent's prompt lookup) expects to follow. The model reads the last token and the draft
//! together; each of those positions' logits is then sampled exactly as a plain step would
//! sample it (the pipeline's own `sample_causal_gen`), and the draft is kept while the
//! sampled token equals it. Every emitted token is therefore the token plain decoding would
//! emit (greedy) or a sample from the same distribution (sampled requests); the KV cache is
//! cut back to the emitted tokens. No draft model, so nothing else to keep in step.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc, RwLock,
};

use candle_core::{Result, Tensor};
use rand_isaac::Isaac64Rng;

use crate::{prefix_cacher::PrefixCacheManagerV2, sequence::Sequence};

use super::{EitherCache, Pipeline};

/// Proposes up to `max` tokens to follow `tokens` (the prompt and the answer so far); an
/// empty draft means a plain step.
pub type DraftProposer = fn(tokens: &[u32], max: usize) -> Vec<u32>;

static PROPOSER: RwLock<Option<DraftProposer>> = RwLock::new(None);

/// Draft steps run, draft tokens read and draft tokens kept, over the process's life.
static STEPS: AtomicU64 = AtomicU64::new(0);
static PROPOSED: AtomicU64 = AtomicU64::new(0);
static ACCEPTED: AtomicU64 = AtomicU64::new(0);

/// Draft steps, draft tokens proposed and draft tokens accepted so far (all engines of the
/// process together; prompt-lookup drafts and a draft model's alike).
pub fn draft_counts() -> (u64, u64, u64) {
    (
        STEPS.load(Ordering::Relaxed),
        PROPOSED.load(Ordering::Relaxed),
        ACCEPTED.load(Ordering::Relaxed),
    )
}

/// Counts one draft step: `proposed` draft tokens read, `accepted` of them kept (both
/// kinds of draft: this module's and a draft model's, `speculative.rs`).
pub(crate) fn count_draft_step(proposed: usize, accepted: usize) {
    STEPS.fetch_add(1, Ordering::Relaxed);
    PROPOSED.fetch_add(proposed as u64, Ordering::Relaxed);
    ACCEPTED.fetch_add(accepted as u64, Ordering::Relaxed);
}

/// Registers the proposer (`None`: no drafts).
pub fn set_draft_proposer(proposer: Option<DraftProposer>) {
    *PROPOSER.write().unwrap_or_else(|e| e.into_inner()) = proposer;
}

/// The draft for a completion step: only for a step of one sequence that allows drafts, in
/// the middle of its answer, with room left in the context.
pub(crate) fn draft_for(seqs: &[&mut Sequence], max_seq_len: usize) -> Option<Vec<u32>> {
    let [seq] = seqs else { return None };
    let max = seq.draft_tokens();
    if max == 0 || !seq.is_completion() {
        return None;
    }
    let proposer = (*PROPOSER.read().unwrap_or_else(|e| e.into_inner()))?;
    let tokens = seq.get_toks();
    let room = max_seq_len.saturating_sub(tokens.len() + 1);
    let mut draft = proposer(tokens, max.min(room));
    draft.truncate(max.min(room));
    (!draft.is_empty()).then_some(draft)
}

/// Makes the sequence's next forward pass read its last token and the draft; returns the
/// `last_n_context_len` that asks for the logits of all of them.
pub(crate) fn read_draft_next(seq: &mut Sequence, draft: &[u32]) -> (usize, usize) {
    let toks = seq.get_toks();
    let base = toks.len() - 1; // positions already in the KV cache
    let mut read = Vec::with_capacity(draft.len() + 1);
    read.push(toks[base]);
    read.extend_from_slice(draft);
    // the input processor adds the sequence's token offset (a prefix-cache hit, prefill
    // chunks) to the position it is given
    let offset = base - seq.token_offset().min(base);
    seq.set_prefill_toks(read);
    (draft.len() + 1, offset)
}

fn set_cache_len<'a>(
    layers: impl Iterator<Item = &'a mut crate::kv_cache::KvCache>,
    len: usize,
) -> Result<()> {
    for layer in layers {
        layer.set_len(len)?;
    }
    Ok(())
}

/// Samples the positions of a draft step one after another, as plain steps would, until a
/// sampled token differs from the draft or the sequence ends; cuts the KV caches back to
/// the tokens emitted. Returns how many tokens were emitted.
pub(crate) async fn sample_draft<P: Pipeline + ?Sized>(
    pipeline: &P,
    seqs: &mut [&mut Sequence],
    logits: Tensor,
    draft: &[u32],
    prefix_cacher: &mut PrefixCacheManagerV2,
    disable_eos_stop: bool,
    rng: Arc<std::sync::Mutex<Isaac64Rng>>,
) -> Result<usize> {
    // [positions, vocab] (batch index taken), one row per position read
    let positions = draft.len() + 1;
    let logits = match logits.rank() {
        3 => logits.squeeze(0)?,
        _ => logits,
    };
    if logits.dim(0)? != positions {
        candle_core::bail!(
            "draft step: {} rows of logits for {positions} positions",
            logits.dim(0)?
        );
    }
    let held = seqs[0]
        .normal_cache()
        .iter()
        .flatten()
        .next()
        .map(|c| c.current_seq_len())
        .unwrap_or(0);
    let base = held.checked_sub(positions).ok_or_else(|| {
        candle_core::Error::msg(format!(
            "draft step: the KV cache holds {held} positions, fewer than the {positions} read"
        ))
    })?;
    let (mut emitted, mut accepted) = (0, 0);
    for (i, &expected) in draft.iter().chain(std::iter::once(&u32::MAX)).enumerate() {
        // the cache as a plain step would leave it: every token but the one sampled now
        // (what the prefix cache stores if the sequence ends here)
        set_cache_len(seqs[0].normal_cache().iter_mut().flatten(), base + i + 1)?;
        pipeline
            .sample_causal_gen(
                seqs,
                vec![logits.narrow(0, i, 1)?],
                prefix_cacher,
                disable_eos_stop,
                rng.clone(),
            )
            .await?;
        emitted += 1;
        let seq = &seqs[0];
        if seq.get_toks().last() != Some(&expected) {
            break;
        }
        accepted += 1;
        if seq.is_finished_paged_attn() {
            break;
        }
    }
    count_draft_step(draft.len(), accepted);
    // the pipeline's own cache (read as it is by the next step of the same sequence)
    if let EitherCache::Normal(normal) = pipeline.cache() {
        let mut normal = normal.lock().unwrap_or_else(|e| e.into_inner());
        set_cache_len(normal.0.iter_mut(), base + emitted)?;
    }
    Ok(emitted)
}
