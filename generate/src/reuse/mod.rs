//! Passage reuse (issue 55): each retrieved passage's keys and values, computed once per
//! model and prompt prefix, placed into later prompts instead of being prefilled again.
//!
//! A prompt is `prefix · [1] passage₁ · [2] passage₂ · … · question`. A passage's block is
//! computed right after the prompt's own prefix up to its first passage (the system prompt,
//! the template's text, `[1]`), so in place 1 it is exactly what a prefill computes. In a
//! later place its keys are turned by the RoPE offset (values unchanged) and it misses what
//! it would have read of the passages before it; the markers between passages and the
//! question are prefilled as usual and read everything. The engine places the blocks
//! (vendor/PATCHES.md 23: `KvSplice`); this module finds where the passages lie in the
//! prompt's tokens, keeps the blocks (bounded in bytes, least recently used evicted) and
//! turns keys.
//!
//! Modes (`generation.passage_reuse`): `off` prefills every prompt whole; `exact` places only
//! blocks whose preceding tokens are the same as when they were computed (place 1), so the
//! keys and values are a prefill's; `passages` places every block it has, and computes the
//! missing ones (a one-token request each) before the answer's own request.

pub mod disk;
pub mod metrics;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mistralrs::{DType, Tensor};
use serde::{Deserialize, Serialize};

pub use docent_engine::ReuseStats;

/// Which passages' keys and values a prompt reuses (`generation.passage_reuse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PassageReuse {
    /// Every prompt prefilled whole.
    Off,
    /// Only blocks that equal a prefill's (computed after the same tokens: place 1).
    Exact,
    /// Every passage's block, computed when missing, turned to its place (the default:
    /// docs/evaluation.md, "The default re-chosen with passage reuse").
    #[default]
    Passages,
}

/// RoPE as the model applies it to keys: `dims` rotated dimensions per head, frequencies
/// `base^(-2i/dims)`, pairs `(i, i + dims/2)` (NeoX, rotate-half: Qwen2) or `(2i, 2i+1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The frequency base (`rope.freq_base`; 10000 when the file does not say).
    pub base: f32,
    /// Rotated dimensions per head (the whole head).
    pub dims: usize,
    /// Pairs `(i, i + dims/2)` (NeoX, rotate-half: Qwen2); false: `(2i, 2i+1)`.
    pub neox: bool,
}

impl Rope {
    /// The rotation of a GGUF model the engine's quantized Llama decoder runs (llama,
    /// mistral3, qwen2: `vendor/.../quantized_llama.rs`), from its metadata; `None` for
    /// other files or when it cannot be read (no reuse then).
    pub fn of_gguf(path: &Path) -> Option<Rope> {
        use candle_core::quantized::gguf_file::{Content, Value};
        let mut file = std::fs::File::open(path).ok()?;
        let content = Content::read(&mut file).ok()?;
        let get = |k: &str| content.metadata.get(k);
        let arch = get("general.architecture")?.to_string().ok()?.clone();
        if !matches!(arch.as_str(), "llama" | "mistral3" | "qwen2") {
            return None;
        }
        let number = |v: &Value| {
            v.to_u32()
                .ok()
                .or_else(|| v.to_u64().ok().map(|n| n as u32))
        };
        let heads = get(&format!("{arch}.attention.head_count")).and_then(number)? as usize;
        let width = get(&format!("{arch}.embedding_length")).and_then(number)? as usize;
        let head_dim = get(&format!("{arch}.attention.key_length"))
            .and_then(number)
            .map(|n| n as usize)
            .unwrap_or(width / heads.max(1));
        let dims = get(&format!("{arch}.rope.dimension_count"))
            .and_then(number)
            .map(|n| n as usize)
            .unwrap_or(head_dim);
        let base = get(&format!("{arch}.rope.freq_base"))
            .and_then(|v| v.to_f32().ok())
            .unwrap_or(10_000.0);
        // the engine rotates whole heads (RotaryEmbedding::new over rope_dim)
        (dims == head_dim && dims % 2 == 0).then_some(Rope {
            base,
            dims,
            neox: arch == "qwen2",
        })
    }

    /// Keys of shape (1, heads, positions, head dim), computed at positions `p..`, as they
    /// are at `p + delta..` (values need no turn). The same dtype comes back.
    pub fn turn(&self, keys: &Tensor, delta: i64) -> mistralrs::Result<Tensor> {
        if delta == 0 {
            return Ok(keys.clone());
        }
        let dtype = keys.dtype();
        let head_dim = keys.dim(3)?;
        let mut data = keys.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        self.turn_rows(&mut data, head_dim, delta);
        Tensor::from_vec(data, keys.shape(), keys.device())?.to_dtype(dtype)
    }

    /// Turns every `head_dim` row of `data` by `delta` positions.
    pub fn turn_rows(&self, data: &mut [f32], head_dim: usize, delta: i64) {
        let half = self.dims / 2;
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..half)
            .map(|i| {
                let freq = 1f32 / self.base.powf((2 * i) as f32 / self.dims as f32);
                let angle = delta as f64 * f64::from(freq);
                (angle.cos() as f32, angle.sin() as f32)
            })
            .unzip();
        for row in data.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = if self.neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x, y) = (row[a], row[b]);
                row[a] = x * cos[i] - y * sin[i];
                row[b] = y * cos[i] + x * sin[i];
            }
        }
    }
}

/// One passage's keys and values, computed after `context` (its hash and length).
pub struct Block {
    /// Hash of the tokens before the passage ([`hash_tokens`]).
    pub context: u64,
    /// Number of tokens before the passage: the position its first token was computed at.
    pub context_len: usize,
    /// The passage's token ids.
    pub tokens: Vec<u32>,
    /// Per layer (1, kv heads, tokens, head dim), keys at positions `context_len..`.
    pub layers: Arc<Vec<(Tensor, Tensor)>>,
    /// Memory the block takes: keys, values and token ids, in bytes.
    pub bytes: usize,
    /// Whether the keys and values are the prefill's own (false: read back from 8-bit on
    /// disk), so that in place 1 they are exact.
    pub exact: bool,
}

impl Block {
    /// The block of `tokens` computed after `context`, from each layer's keys and values
    /// (exact: the prefill's own).
    pub fn new(context: &[u32], tokens: Vec<u32>, layers: Vec<(Tensor, Tensor)>) -> Block {
        let bytes = layers
            .iter()
            .map(|(k, v)| {
                (k.elem_count() * k.dtype().size_in_bytes())
                    + (v.elem_count() * v.dtype().size_in_bytes())
            })
            .sum::<usize>()
            + tokens.len() * 4;
        Block {
            context: hash_tokens(0, context),
            context_len: context.len(),
            tokens,
            layers: Arc::new(layers),
            bytes,
            exact: true,
        }
    }
}

/// FNV-1a over token ids, from `seed`.
pub fn hash_tokens(seed: u64, tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64 ^ seed;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The blocks, bounded in bytes, the least recently used evicted first.
pub struct PassageCache {
    /// The model's rotation, to turn a block's keys to another place.
    pub rope: Rope,
    /// The model file the blocks come from (names the folder on disk).
    pub model_file: std::path::PathBuf,
    /// The fence a fenced prompt's passages are computed in (`safety.spotlight`; see
    /// [`docent_engine::Prompt::with_fence`]): random, never in a prompt that is
    /// answered, kept beside the blocks on disk so they serve after a restart.
    fence: Mutex<String>,
    limit: usize,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
    computed: AtomicU64,
    compute_us: AtomicU64,
    disk_hits: AtomicU64,
    /// The blocks on disk and the thread that writes them (`attach_disk`).
    disk: std::sync::OnceLock<(Arc<disk::DiskBlocks>, disk::Writer)>,
}

#[derive(Default)]
struct Inner {
    blocks: HashMap<u64, (Arc<Block>, u64)>,
    bytes: usize,
    tokens: usize,
    clock: u64,
}

impl PassageCache {
    /// An empty cache for a model rotating with `rope`, holding at most `limit_bytes` in memory
    /// (no disk until [`Self::attach_disk`]).
    pub fn new(rope: Rope, limit_bytes: usize) -> Self {
        PassageCache {
            rope,
            model_file: Default::default(),
            fence: Mutex::new(docent_engine::fence()),
            limit: limit_bytes,
            inner: Mutex::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            computed: AtomicU64::new(0),
            compute_us: AtomicU64::new(0),
            disk_hits: AtomicU64::new(0),
            disk: std::sync::OnceLock::new(),
        }
    }

    /// Keeps blocks on disk in `blocks` too: every block kept from now on is written there
    /// (by a thread of its own), and a block missing in memory is looked for there. Only
    /// the first folder attached counts.
    pub fn attach_disk(&self, blocks: disk::DiskBlocks) {
        if self.disk.get().is_some() {
            return;
        }
        if let Ok(mut fence) = self.fence.lock() {
            *fence = blocks.fence(&fence);
        }
        let blocks = Arc::new(blocks);
        let writer = disk::Writer::spawn(blocks.clone());
        let _ = self.disk.set((blocks, writer));
    }

    /// Whether blocks are kept on disk too (a lookup may then read a file).
    pub fn has_disk(&self) -> bool {
        self.disk.get().is_some()
    }

    /// The fence fenced prompts' passages are computed in.
    pub fn fence(&self) -> String {
        self.fence.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// The key of `tokens` computed after a context hashed `context`.
    pub fn key(context: u64, tokens: &[u32]) -> u64 {
        hash_tokens(context, tokens)
    }

    /// The block for `tokens` after `context`, counted as a hit or a miss.
    pub fn get(&self, context: u64, tokens: &[u32]) -> Option<Arc<Block>> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.clock += 1;
        let clock = inner.clock;
        let found = inner
            .blocks
            .get_mut(&Self::key(context, tokens))
            .filter(|(b, _)| b.context == context && b.tokens == tokens)
            .map(|(b, used)| {
                *used = clock;
                b.clone()
            });
        drop(inner);
        let found = found.or_else(|| {
            let (disk, _) = self.disk.get()?;
            let block = disk.load(context, tokens)?;
            self.disk_hits.fetch_add(1, Ordering::Relaxed);
            Some(self.keep(block))
        });
        let result = if found.is_some() { "hit" } else { "miss" };
        metrics::metrics()
            .lookups
            .with_label_values(&[result])
            .inc();
        match found {
            Some(b) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(b)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Waits until every block kept so far is on disk (blocking; nothing without a disk).
    pub fn flush_disk(&self) {
        if let Some((_, writer)) = self.disk.get() {
            writer.flush();
        }
    }

    /// Whether memory or disk holds the block (not counted as a lookup).
    pub fn contains(&self, context: u64, tokens: &[u32]) -> bool {
        let key = Self::key(context, tokens);
        let in_memory = {
            let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            inner
                .blocks
                .get(&key)
                .is_some_and(|(b, _)| b.context == context && b.tokens == tokens)
        };
        in_memory
            || self
                .disk
                .get()
                .is_some_and(|(d, _)| d.contains(context, tokens))
    }

    /// Keeps `block`, evicting the least recently used beyond the limit (a block larger
    /// than the whole limit is not kept).
    pub fn put(&self, block: Block) -> Arc<Block> {
        let block = self.keep(block);
        if let Some((_, writer)) = self.disk.get() {
            writer.send(block.clone());
        }
        block
    }

    /// Writes `block` to disk without keeping it in memory (blocks computed ahead must not
    /// push out those recent answers used); kept in memory when there is no disk.
    pub fn put_on_disk(&self, block: Block) -> Arc<Block> {
        match self.disk.get() {
            Some((_, writer)) => {
                let block = Arc::new(block);
                writer.send(block.clone());
                block
            }
            None => self.keep(block),
        }
    }

    /// Keeps `block` in memory only.
    fn keep(&self, block: Block) -> Arc<Block> {
        let block = Arc::new(block);
        if block.bytes > self.limit {
            return block;
        }
        let key = Self::key(block.context, &block.tokens);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.clock += 1;
        let clock = inner.clock;
        if let Some((old, _)) = inner.blocks.insert(key, (block.clone(), clock)) {
            inner.bytes -= old.bytes;
            inner.tokens -= old.tokens.len();
        }
        inner.bytes += block.bytes;
        inner.tokens += block.tokens.len();
        while inner.bytes > self.limit {
            let Some((&oldest, _)) = inner.blocks.iter().min_by_key(|(_, (_, used))| *used) else {
                break;
            };
            if let Some((b, _)) = inner.blocks.remove(&oldest) {
                inner.bytes -= b.bytes;
                inner.tokens -= b.tokens.len();
            }
        }
        metrics::metrics().bytes.set(inner.bytes as i64);
        block
    }

    /// Counts a block computed ahead of an answer, in `took`.
    pub fn note_computed(&self, took: std::time::Duration) {
        self.computed.fetch_add(1, Ordering::Relaxed);
        self.compute_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// Forgets every block (the counters stay).
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.blocks.clear();
        inner.bytes = 0;
        inner.tokens = 0;
        metrics::metrics().bytes.set(0);
    }

    /// The counters since start, and the blocks in memory and on disk now.
    pub fn stats(&self) -> ReuseStats {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        ReuseStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            computed: self.computed.load(Ordering::Relaxed),
            compute_us: self.compute_us.load(Ordering::Relaxed),
            blocks: inner.blocks.len(),
            bytes: inner.bytes,
            tokens: inner.tokens,
            disk_hits: self.disk_hits.load(Ordering::Relaxed),
            disk: self.disk.get().map(|(d, _)| d.stats()),
        }
    }
}

/// Where each passage's tokens lie in the prompt's `ids`, in order: the first of the
/// passage's tokenizations (with the space before it and the blank line after it, as the
/// template writes them, or the line break before a closing fence, then without) that
/// occurs after the one before. `None` for a passage not found; none ends at the prompt's
/// last token.
pub fn find_units(
    ids: &[u32],
    passages: &[String],
    encode: impl Fn(&str) -> Vec<u32>,
) -> Vec<Option<(usize, Vec<u32>)>> {
    let mut from = 0;
    passages
        .iter()
        .map(|p| {
            let variants = [
                format!(" {p}\n\n"),
                format!(" {p}"),
                format!("{p}\n\n"),
                // a fenced passage: the closing tag on the next line
                format!("{p}\n"),
                p.clone(),
            ];
            let found = variants.iter().find_map(|v| {
                let unit = encode(v);
                if unit.is_empty() {
                    return None;
                }
                let at = ids
                    .get(from..)?
                    .windows(unit.len())
                    .position(|w| w == unit.as_slice())?
                    + from;
                (at + unit.len() < ids.len()).then_some((at, unit))
            });
            if let Some((at, unit)) = &found {
                from = at + unit.len();
            }
            found
        })
        .collect()
}

/// The logits processor that keeps a passage's block from the prefill it rides on: the
/// keys and values of `tokens`, which follow `context` in the prompt (the engine hands the
/// prompt's over once it is read: `observe_prompt_kv`), copied into the cache.
pub struct KvReader {
    cache: Arc<PassageCache>,
    context: Vec<u32>,
    tokens: Vec<u32>,
    got: Mutex<Option<Arc<Block>>>,
    /// The block goes to disk only ([`PassageCache::put_on_disk`]).
    disk_only: bool,
}

impl KvReader {
    /// A reader that keeps the block of `tokens`, which follow `context` in the prompt, in
    /// `cache` (memory and disk).
    pub fn new(cache: Arc<PassageCache>, context: Vec<u32>, tokens: Vec<u32>) -> Self {
        KvReader {
            cache,
            context,
            tokens,
            got: Mutex::default(),
            disk_only: false,
        }
    }

    /// The same, its block written to disk without being kept in memory.
    pub fn disk_only(mut self) -> Self {
        self.disk_only = true;
        self
    }

    /// The block kept (once the prompt was read).
    pub fn take(&self) -> Option<Arc<Block>> {
        self.got.lock().ok().and_then(|mut g| g.take())
    }
}

impl mistralrs::CustomLogitsProcessor for KvReader {
    fn apply(&self, logits: &Tensor, _context: &[u32]) -> mistralrs::Result<Tensor> {
        Ok(logits.clone())
    }

    fn reads_prompt_kv(&self) -> bool {
        true
    }

    fn observe_prompt_kv(&self, layers: &[(Tensor, Tensor)]) {
        let (from, len) = (self.context.len(), self.tokens.len());
        let copy = |t: &Tensor| t.narrow(2, from, len)?.force_contiguous();
        let kept = layers
            .iter()
            .map(|(k, v)| Ok((copy(k)?, copy(v)?)))
            .collect::<mistralrs::Result<Vec<_>>>();
        match kept {
            Ok(kept) => {
                let block = Block::new(&self.context, self.tokens.clone(), kept);
                let block = if self.disk_only {
                    self.cache.put_on_disk(block)
                } else {
                    self.cache.put(block)
                };
                if let Ok(mut g) = self.got.lock() {
                    *g = Some(block);
                }
            }
            Err(e) => tracing::warn!(error = %e, "a passage's keys and values were not kept"),
        }
    }
}

/// A logits processor that copies the whole prompt's keys and values (checks and
/// measurements: [`super::Generator::prompt_kv`]).
#[derive(Default)]
pub struct KvSnapshot {
    got: Mutex<Option<Vec<(Tensor, Tensor)>>>,
}

impl KvSnapshot {
    /// The prompt's keys and values per layer, once it was read (taken: a second call gets
    /// `None`).
    pub fn take(&self) -> Option<Vec<(Tensor, Tensor)>> {
        self.got.lock().ok().and_then(|mut g| g.take())
    }
}

impl mistralrs::CustomLogitsProcessor for KvSnapshot {
    fn apply(&self, logits: &Tensor, _context: &[u32]) -> mistralrs::Result<Tensor> {
        Ok(logits.clone())
    }

    fn reads_prompt_kv(&self) -> bool {
        true
    }

    fn observe_prompt_kv(&self, layers: &[(Tensor, Tensor)]) {
        let kept = layers
            .iter()
            .map(|(k, v)| Ok((k.force_contiguous()?, v.force_contiguous()?)))
            .collect::<mistralrs::Result<Vec<_>>>();
        if let (Ok(kept), Ok(mut g)) = (kept, self.got.lock()) {
            *g = Some(kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(neox: bool) -> Rope {
        Rope {
            base: 1_000_000.0,
            dims: 8,
            neox,
        }
    }

    #[test]
    fn turning_by_a_then_b_is_turning_by_their_sum_and_back_is_the_identity() {
        for neox in [true, false] {
            let r = rope(neox);
            let start: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut two = start.clone();
            r.turn_rows(&mut two, 8, 5);
            r.turn_rows(&mut two, 8, 12);
            let mut one = start.clone();
            r.turn_rows(&mut one, 8, 17);
            let mut back = one.clone();
            r.turn_rows(&mut back, 8, -17);
            for i in 0..16 {
                assert!((two[i] - one[i]).abs() < 1e-5, "{neox} {i}");
                assert!((back[i] - start[i]).abs() < 1e-5, "{neox} {i}");
            }
            // a turn moves the vector (the fastest pair by 17 radians)
            assert!((one[0] - start[0]).abs() > 1e-2);
            // and keeps each pair's length
            let pair = |v: &[f32], a: usize, b: usize| (v[a] * v[a] + v[b] * v[b]).sqrt();
            let (a, b) = if neox { (1, 5) } else { (2, 3) };
            assert!((pair(&one, a, b) - pair(&start, a, b)).abs() < 1e-5);
        }
    }

    #[test]
    fn a_turn_matches_rope_at_the_new_position() {
        // the key of one token at position p, as the model rotates it, then turned by d,
        // equals the key rotated at position p + d
        let r = rope(true);
        let raw: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
        let at = |p: i64| {
            let mut v = raw.clone();
            r.turn_rows(&mut v, 8, p);
            v
        };
        let mut moved = at(40);
        r.turn_rows(&mut moved, 8, 23);
        let direct = at(63);
        for i in 0..8 {
            assert!((moved[i] - direct[i]).abs() < 1e-4);
        }
        let t = Tensor::from_vec(at(40), (1, 1, 1, 8), &mistralrs::Device::Cpu).unwrap();
        let turned = r.turn(&t, 23).unwrap().flatten_all().unwrap();
        let turned = turned.to_vec1::<f32>().unwrap();
        for i in 0..8 {
            assert!((turned[i] - direct[i]).abs() < 1e-4);
        }
    }

    #[test]
    fn units_are_found_in_order_and_never_at_the_prompts_end() {
        // a toy tokenizer: one id per character
        let encode = |s: &str| s.chars().map(|c| c as u32).collect::<Vec<_>>();
        let prompt = encode("sys [1] cat\n\n[2] dog\n\n[3] cat\n\nQ?");
        let units = find_units(
            &prompt,
            &["cat".into(), "dog".into(), "cat".into(), "bird".into()],
            encode,
        );
        let at = |i: usize| units[i].as_ref().map(|u| u.0);
        assert_eq!(at(0), Some(7));
        assert_eq!(at(1), Some(16));
        // the second "cat" is the one after "dog"
        assert_eq!(at(2), Some(25));
        assert_eq!(at(3), None);
        assert_eq!(units[0].as_ref().unwrap().1, encode(" cat\n\n"));
        // a fenced passage: its line break before the closing tag goes with it
        let prompt = encode("sys [1] <f>\ncat\n</f>\n\n[2] <f>\ndog\n</f>\n\nQ?");
        let units = find_units(&prompt, &["cat".into(), "dog".into()], encode);
        assert_eq!(units[0], Some((12, encode("cat\n"))));
        assert_eq!(
            units[1].as_ref().map(|u| u.1.clone()),
            Some(encode("dog\n"))
        );
        // a passage that would end at the last token is not a unit
        let prompt = encode("[1] cat");
        assert_eq!(find_units(&prompt, &["cat".into()], encode), vec![None]);
    }

    fn block(context: &[u32], tokens: Vec<u32>, floats: usize) -> Block {
        let t = Tensor::zeros((1, 1, floats, 1), DType::F32, &mistralrs::Device::Cpu).unwrap();
        Block::new(context, tokens, vec![(t.clone(), t)])
    }

    #[test]
    fn the_cache_keeps_the_most_recently_used_within_its_bytes() {
        let rope = rope(true);
        // each block: 2 x 100 floats + 1 token = 804 bytes; room for two
        let cache = PassageCache::new(rope, 1700);
        let ctx = [1, 2, 3];
        let c = hash_tokens(0, &ctx);
        cache.put(block(&ctx, vec![10], 100));
        cache.put(block(&ctx, vec![11], 100));
        assert!(cache.get(c, &[10]).is_some()); // 10 is now the most recent
        cache.put(block(&ctx, vec![12], 100)); // evicts 11
        assert!(cache.get(c, &[11]).is_none());
        assert!(cache.get(c, &[10]).is_some());
        assert!(cache.get(c, &[12]).is_some());
        // another context is another block
        assert!(cache.get(hash_tokens(0, &[9]), &[10]).is_none());
        let s = cache.stats();
        assert_eq!((s.blocks, s.bytes, s.hits, s.misses), (2, 1608, 3, 2));
        // a block larger than the limit is not kept
        cache.put(block(&ctx, vec![13], 1000));
        assert_eq!(cache.stats().blocks, 2);
    }
}
