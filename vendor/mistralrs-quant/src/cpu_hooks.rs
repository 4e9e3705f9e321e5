//! Hooks through which an application supplies its own CPU kernels (docent: `kernels/`).
//!
//! Added for docent (see vendor/PATCHES.md). Nothing here depends on the application: it
//! registers plain functions once at start-up; until then, and whenever a hook answers
//! `None`, the crate's own code runs as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// A weight matrix in GGML block layout: `rows` rows of `cols` elements each.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    /// GGML type id (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K, ...).
    pub ggml_type: u32,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

/// `y[m, rows] = x[m, cols] · Wᵀ`, `x` row-major and contiguous. `None`: not handled.
pub type MatMulHook = fn(w: &WeightView<'_>, x: &[f32], m: usize) -> Option<Vec<f32>>;

/// Scaled dot-product attention over f32 queries; keys and values are `KV` (f32, or
/// `half::f16` for an F16 KV cache).
#[derive(Debug, Clone, Copy)]
pub struct AttentionArgs<'a, KV = f32> {
    /// Query, key and value data, each indexed as `b * s[0] + pos * s[1] + head * s[2] + d`
    /// with the given strides `s` (elements); the last axis is contiguous.
    pub q: &'a [f32],
    pub k: &'a [KV],
    pub v: &'a [KV],
    pub q_strides: [usize; 3],
    pub k_strides: [usize; 3],
    pub v_strides: [usize; 3],
    pub batch: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Logit soft-capping (`0.0`: none).
    pub softcap: f32,
    /// Additive mask of shape (q_len, kv_len), row-major, shared by batches and heads.
    pub mask: Option<&'a [f32]>,
}

/// Returns the output as (batch, n_heads, q_len, head_dim), contiguous. `None`: not handled.
pub type AttentionHook = fn(args: &AttentionArgs<'_>) -> Option<Vec<f32>>;

/// The same over an F16 KV cache (f32 queries and output).
pub type AttentionHookF16 = fn(args: &AttentionArgs<'_, half::f16>) -> Option<Vec<f32>>;

/// Rewrites a weight, once at load, into a layout the registered matmul runs faster, with the
/// same values: `(ggml type id, bytes)` of the new tensor (same shape). `None`: keep it.
pub type RepackHook = fn(w: &WeightView<'_>) -> Option<(u32, Vec<u8>)>;

static MATMUL: OnceLock<MatMulHook> = OnceLock::new();
static REPACK: OnceLock<RepackHook> = OnceLock::new();
static ATTENTION: OnceLock<AttentionHook> = OnceLock::new();
static ATTENTION_F16: OnceLock<AttentionHookF16> = OnceLock::new();
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the registered hooks on or off (process-wide; models loaded while they are off keep
/// candle's own weight layout).
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::SeqCst);
}

/// Registers the CPU matmul for GGUF weights (the first registration wins).
pub fn set_matmul(hook: MatMulHook) {
    let _ = MATMUL.set(hook);
}

/// Registers the load-time weight rewrite (the first registration wins).
pub fn set_repack(hook: RepackHook) {
    let _ = REPACK.set(hook);
}

/// Registers the CPU attention (the first registration wins).
pub fn set_attention(hook: AttentionHook) {
    let _ = ATTENTION.set(hook);
}

/// Registers the CPU attention over an F16 KV cache (the first registration wins).
pub fn set_attention_f16(hook: AttentionHookF16) {
    let _ = ATTENTION_F16.set(hook);
}

/// The registered matmul, unless the hooks are off.
pub fn matmul() -> Option<MatMulHook> {
    MATMUL.get().copied().filter(|_| ENABLED.load(Ordering::Relaxed))
}

/// The registered weight rewrite, unless the hooks are off.
pub fn repack() -> Option<RepackHook> {
    REPACK.get().copied().filter(|_| ENABLED.load(Ordering::Relaxed))
}

/// The registered attention, unless the hooks are off.
pub fn attention() -> Option<AttentionHook> {
    ATTENTION.get().copied().filter(|_| ENABLED.load(Ordering::Relaxed))
}

/// The registered attention over an F16 KV cache, unless the hooks are off.
pub fn attention_f16() -> Option<AttentionHookF16> {
    ATTENTION_F16
        .get()
        .copied()
        .filter(|_| ENABLED.load(Ordering::Relaxed))
}
