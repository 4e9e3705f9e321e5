//! Wires docent's CPU kernels (`kernels/`) into mistral.rs, and sizes the one compute pool.
//!
//! mistral.rs calls the hooks in `vendor/mistralrs-quant/src/cpu_hooks.rs` for every GGUF
//! matmul and every f32 attention on the CPU. They are registered once per process, before
//! the first model loads (F16 weights are kept as F16 only when they are); `generation.kernels
//! = "candle"` switches them off at run time, so mistral.rs's and candle's own code runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Once;

use mistralrs_quant::cpu_hooks;

static MATMULS: AtomicU64 = AtomicU64::new(0);
static ATTENTIONS: AtomicU64 = AtomicU64::new(0);
static ATTENTIONS_F16: AtomicU64 = AtomicU64::new(0);
static REPACKED: AtomicU64 = AtomicU64::new(0);
static INTERLEAVED: AtomicU64 = AtomicU64::new(0);
/// `generation.repack`: Q5_0 weights are rewritten as Q8_0 and Q4_K and Q6_K weights
/// interleaved by eight rows when a model loads.
static REPACK: AtomicBool = AtomicBool::new(true);

/// Calls docent's kernels answered so far in this process: (matmuls, attentions).
pub fn calls() -> (u64, u64) {
    (
        MATMULS.load(Ordering::Relaxed),
        ATTENTIONS.load(Ordering::Relaxed),
    )
}

/// Of [`calls`]' attentions, those over an F16 KV cache (`generation.kv_cache = "f16"`).
pub fn f16_attentions() -> u64 {
    ATTENTIONS_F16.load(Ordering::Relaxed)
}

/// Weight tensors rewritten at load so far in this process (see [`install`]).
pub fn repacked() -> u64 {
    REPACKED.load(Ordering::Relaxed)
}

/// Of [`repacked`]'s tensors, the Q4_K and Q6_K ones interleaved by eight rows.
pub fn interleaved() -> u64 {
    INTERLEAVED.load(Ordering::Relaxed)
}

/// Registers the hooks (once) and turns them on or off for the models loaded from now on;
/// `isa` (`generation.isa`) caps the instruction set, for the process; `repack`
/// (`generation.repack`) rewrites Q5_0 weights as Q8_0 and interleaves Q4_K weights at load,
/// for the models loaded from now on (lossless: see [`repack_weight`]).
pub fn install(enabled: bool, isa: &str, repack: bool) {
    static REGISTER: Once = Once::new();
    cpu_hooks::set_enabled(enabled);
    REPACK.store(repack, Ordering::SeqCst);
    REGISTER.call_once(|| {
        docent_kernels::cpu::set_cap(match isa {
            "scalar" => docent_kernels::Isa::Scalar,
            "avx2" => docent_kernels::Isa::Avx2,
            _ => docent_kernels::Isa::Avx512,
        });
        cpu_hooks::set_matmul(matmul);
        cpu_hooks::set_repack(repack_weight);
        cpu_hooks::set_attention(attention);
        cpu_hooks::set_attention_f16(attention_f16);
        tracing::info!(
            isa = docent_kernels::cpu::isa().name(),
            "docent CPU kernels registered"
        );
    });
}

/// Sizes rayon's global pool, which candle's operations and docent's kernels share; the first
/// call in a process decides (later calls with another size are logged and ignored).
pub fn init_threads(threads: usize) {
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("docent-compute-{i}"))
        // a worker may run a whole forward pass (mistral.rs's, inside rayon::scope), and
        // work stealing can nest another one on the same stack
        .stack_size(8 << 20)
        .build_global();
    match built {
        Ok(()) => tracing::info!(threads = rayon::current_num_threads(), "compute pool"),
        Err(_) if threads != 0 && threads != rayon::current_num_threads() => tracing::warn!(
            wanted = threads,
            running = rayon::current_num_threads(),
            "the compute pool was sized earlier in this process; keeping it"
        ),
        Err(_) => {}
    }
}

fn matmul(w: &cpu_hooks::WeightView<'_>, x: &[f32], m: usize) -> Option<Vec<f32>> {
    let w = docent_kernels::matmul::WeightView {
        ggml_type: w.ggml_type,
        rows: w.rows,
        cols: w.cols,
        data: w.data,
    };
    let out = docent_kernels::matmul::matmul(&w, x, m);
    if out.is_some() {
        MATMULS.fetch_add(1, Ordering::Relaxed);
    }
    out
}

/// The load-time rewrites, when `generation.repack` is on:
/// - Q5_0 → Q8_0: the same values without the fifth bit to unpack; prefill then runs on the
///   Q8_0 tile (decode reads 34 bytes per 32 weights instead of 22, measured no slower:
///   docs/benchmarks.md, "Qwen2.5-Coder on docent's engine"); with AVX2 and no AVX-512, the
///   same bytes as eight rows interleaved, one unsigned byte per value
///   ([`docent_kernels::q5_0_x8`]);
/// - Q4_K and Q6_K → eight rows interleaved ([`docent_kernels::q4k_x8`],
///   [`docent_kernels::q6k_x8`]), where the processor runs that layout's kernel (x86-64 with
///   AVX2): the same bytes rearranged, read eight rows at once by every matmul.
fn repack_weight(w: &cpu_hooks::WeightView<'_>) -> Option<(u32, Vec<u8>)> {
    use docent_kernels::quant::Format;
    if !REPACK.load(Ordering::Relaxed) {
        return None;
    }
    let isa = docent_kernels::cpu::isa();
    let out = if w.ggml_type == Format::Q5_0.ggml_id() {
        match docent_kernels::q5_0_x8::preferred(isa)
            .then(|| docent_kernels::q5_0_x8::interleave(w.rows, w.cols, w.data))
            .flatten()
        {
            Some(out) => (docent_kernels::q5_0_x8::ID, out),
            None => (
                Format::Q8_0.ggml_id(),
                docent_kernels::quant::q5_0_as_q8_0(w.data)?,
            ),
        }
    } else if w.ggml_type == Format::Q4K.ggml_id() && docent_kernels::q4k_x8::has_kernel(isa) {
        let out = docent_kernels::q4k_x8::interleave(w.rows, w.cols, w.data)?;
        INTERLEAVED.fetch_add(1, Ordering::Relaxed);
        (docent_kernels::q4k_x8::ID, out)
    } else if w.ggml_type == Format::Q6K.ggml_id() && docent_kernels::q6k_x8::has_kernel(isa) {
        let out = docent_kernels::q6k_x8::interleave(w.rows, w.cols, w.data)?;
        INTERLEAVED.fetch_add(1, Ordering::Relaxed);
        (docent_kernels::q6k_x8::ID, out)
    } else {
        return None;
    };
    REPACKED.fetch_add(1, Ordering::Relaxed);
    Some(out)
}

fn attention(a: &cpu_hooks::AttentionArgs<'_>) -> Option<Vec<f32>> {
    counted(docent_kernels::attention::attention(&args(a)))
}

fn attention_f16(a: &cpu_hooks::AttentionArgs<'_, half::f16>) -> Option<Vec<f32>> {
    let out = counted(docent_kernels::attention::attention_f16(&args(a)));
    if out.is_some() {
        ATTENTIONS_F16.fetch_add(1, Ordering::Relaxed);
    }
    out
}

fn counted(out: Option<Vec<f32>>) -> Option<Vec<f32>> {
    if out.is_some() {
        ATTENTIONS.fetch_add(1, Ordering::Relaxed);
    }
    out
}

/// The hook's arguments as the kernel's (the same fields).
fn args<'a, KV>(
    a: &cpu_hooks::AttentionArgs<'a, KV>,
) -> docent_kernels::attention::AttentionArgs<'a, KV> {
    docent_kernels::attention::AttentionArgs {
        q: a.q,
        k: a.k,
        v: a.v,
        q_strides: a.q_strides,
        k_strides: a.k_strides,
        v_strides: a.v_strides,
        batch: a.batch,
        q_len: a.q_len,
        kv_len: a.kv_len,
        n_heads: a.n_heads,
        n_kv_heads: a.n_kv_heads,
        head_dim: a.head_dim,
        scale: a.scale,
        softcap: a.softcap,
        mask: a.mask,
    }
}
