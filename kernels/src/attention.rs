//! Scaled dot-product attention on the CPU: tiled, with an online softmax (flash-attention
//! style), the SIMD level chosen at run time.
//!
//! # What it computes
//!
//! For every batch `b`, query head `h` and query position `i` (GQA: `g = n_heads / n_kv_heads`
//! query heads share the key/value head `h / g`):
//!
//! ```text
//! s_ij        = cap(scale · q[b,i,h] · k[b,j,h/g]) + mask[i,j]
//! cap(x)      = softcap · tanh(x / softcap)       (when softcap != 0)
//! out[b,h,i]  = Σ_j softmax_j(s_ij) · v[b,j,h/g]
//! ```
//!
//! Key `j` is visible to query `i` iff `mask[i, j]` is finite (without a mask every key is
//! visible); finite mask values are added to the scores. A query that sees no key at all gets
//! zeros, never NaN. [`attention_reference`] is the plain, materialising version of exactly
//! this, and the tests compare the two.
//!
//! # How
//!
//! * **Visible spans.** The mask is read once: for every query row, the span `first..=last`
//!   of keys with a finite mask value. Keys outside a row's span are never touched for that
//!   row; inside it, the mask values are added (so `-inf` holes inside a span are honoured, and
//!   nothing assumes the mask is causal). For a causal mask the spans are `0..=i + kv_len -
//!   q_len`, which halves the work of a prefill.
//! * **Prefill (`q_len >= 8`): packed tiles.** The keys of each (batch, kv head) are packed
//!   once, transposed, into tiles of [`BC`] = 64 keys (`d × 64`, zero-padded past `kv_len`),
//!   for the tiles some row can see. Each task takes a block of query rows of one head (8 with
//!   AVX-512, 6 with AVX2, 4 scalar: what fits the registers) and walks only the key tiles
//!   that intersect the union of its rows' spans; within a tile, a row's scores outside its
//!   span are set to `-inf` before the softmax, so they weigh exactly 0. Per tile:
//!   `S = Q·Kᵀ` as rank-1 updates (one broadcast query element times a row of 16 or 8 keys:
//!   no horizontal sums), then per row the running max `m`, running sum `l` and accumulator
//!   `acc` of the online softmax (the accumulator is rescaled by `exp(m_old - m_new)` when the
//!   max grows), then `acc += P·V` with `V` read in place (one broadcast probability times a
//!   row of V). Tasks are (batch, head, row block) and write disjoint output rows. Most of
//!   the time goes to the FMAs of `Q·Kᵀ` and `P·V`; the exponentials take under a tenth and
//!   the packing a few percent.
//! * **Decode and short queries (`q_len < 8`): direct.** Packing would cost as much as the
//!   attention itself, so keys are read in place and `q·k` is a SIMD dot product with a
//!   horizontal sum. The rows of all `g` query heads of a kv head are processed together (one
//!   read of K and V serves them all), and the visible key range is split into chunks so a
//!   single sequence still spreads over the pool. Each (batch, kv head, chunk) task leaves a
//!   partial `(acc, m, l)` per row; a final pass merges the chunks
//!   (`m = max m_c`, `l = Σ l_c e^{m_c - m}`, `acc = Σ acc_c e^{m_c - m}`) and divides.
//! * **Parallelism**: rayon's global pool only (`par_chunks_mut` over disjoint outputs).
//! * **SIMD**: AVX-512 (16 lanes), AVX2+FMA (8 lanes), NEON (4 lanes, aarch64) or scalar,
//!   behind one generic kernel: the [`Simd`] trait's operations are `#[inline(always)]` and
//!   the generic code is instantiated inside `#[target_feature]` entry points, reached only
//!   through a token that exists when [`cpu::detect`] found the instructions. `head_dim`
//!   tails use masked loads. Keys and values are f32, or F16 (an F16 KV cache:
//!   [`attention_f16`]), widened in registers.
//!
//! # The exponential
//!
//! `exp(x)` (Cephes `expf`): `n = round(x·log2 e)`, `r = x - n·ln 2` (ln 2 split in two
//! constants so `r` is exact to ~1 ulp), `e^r ≈ 1 + r + r²·P(r)` with `P` of degree 5 on
//! `|r| ≤ ln2/2`, then `2^n` built in the exponent bits. Relative error below 1e-7 over
//! [-87, 88] (measured against f64: 8e-8); inputs below `ln(f32::MIN_POSITIVE) ≈ -87.34` (and `-inf`, NaN) give exactly 0,
//! inputs above 88 are clamped. `tanh` (soft-capping) is `(1 - e^{-2|x|}) / (1 + e^{-2|x|})`
//! with the sign put back (absolute error ~1e-7).

use crate::cpu::{self, Isa};
use half::f16;
use rayon::prelude::*;

/// Scaled dot-product attention over f32 queries, with keys and values of type `KV`: `f32`,
/// or `half::f16` for an F16 KV cache (mirrors `mistralrs_quant::cpu_hooks`).
#[derive(Debug, Clone, Copy)]
pub struct AttentionArgs<'a, KV = f32> {
    /// Query, key and value data, each indexed as `b * s[0] + pos * s[1] + head * s[2] + d`
    /// with the given strides `s` (elements); the head_dim axis is contiguous.
    pub q: &'a [f32],
    /// Keys (see `q`).
    pub k: &'a [KV],
    /// Values (see `q`).
    pub v: &'a [KV],
    /// Strides of `q` over (batch, position, head), in elements.
    pub q_strides: [usize; 3],
    /// Strides of `k`.
    pub k_strides: [usize; 3],
    /// Strides of `v`.
    pub v_strides: [usize; 3],
    /// Sequences in the batch.
    pub batch: usize,
    /// Query positions per sequence.
    pub q_len: usize,
    /// Key and value positions per sequence (the queries are the last `q_len`).
    pub kv_len: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key and value heads (grouped-query attention: `n_heads` is a multiple).
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Factor applied to each query-key product (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Logit soft-capping: `s = softcap * tanh(s / softcap)` when `softcap != 0.0`.
    pub softcap: f32,
    /// Additive mask (q_len, kv_len), row-major, shared by all batches and heads (a longer
    /// slice is fine: the first `q_len * kv_len` values are used). A key is visible iff its
    /// value is finite. `None`: every query sees every key.
    pub mask: Option<&'a [f32]>,
}

/// Keys per tile.
const BC: usize = 64;
/// Below this many query positions the direct (decode) path runs.
const DIRECT_MAX_Q: usize = 8;
/// The direct path does not split the key range into chunks shorter than this.
const MIN_CHUNK: usize = 256;

/// Output: (batch, n_heads, q_len, head_dim), contiguous, with the best instruction set
/// ([`cpu::isa`]). `None` only when the arguments are inconsistent (`n_kv_heads == 0`,
/// `n_heads % n_kv_heads != 0`, a slice too short for its shape and strides, sizes that
/// overflow); it never panics on them.
pub fn attention(args: &AttentionArgs<'_>) -> Option<Vec<f32>> {
    attention_with(cpu::isa(), args)
}

/// [`attention`] with an explicit instruction set; a level above [`cpu::detect`] falls back to
/// the best one available.
pub fn attention_with(isa: Isa, args: &AttentionArgs<'_>) -> Option<Vec<f32>> {
    attention_planned(isa, args, Plan::DEFAULT)
}

/// [`attention`] over an F16 KV cache: keys and values are read as F16 and widened to f32
/// in registers (half the bytes of an f32 cache); the arithmetic is the same.
pub fn attention_f16(args: &AttentionArgs<'_, f16>) -> Option<Vec<f32>> {
    attention_f16_with(cpu::isa(), args)
}

/// [`attention_f16`] with an explicit instruction set.
pub fn attention_f16_with(isa: Isa, args: &AttentionArgs<'_, f16>) -> Option<Vec<f32>> {
    attention_planned(isa, args, Plan::DEFAULT)
}

/// A key/value element type the kernels read: `f32` or `f16`.
trait Elem: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    /// Loads `S::LANES` values as f32.
    ///
    /// # Safety
    ///
    /// As [`Simd::load`].
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
    /// Loads `n < S::LANES` values as f32 (zeros in the other lanes).
    ///
    /// # Safety
    ///
    /// As [`Simd::load_part`].
    unsafe fn load_part<S: Simd>(p: *const Self, n: usize) -> S::V;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    unsafe fn load_part<S: Simd>(p: *const f32, n: usize) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { S::load_part(p, n) }
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f16) -> S::V {
        // SAFETY: the caller's contract (f16 is a u16 in memory).
        unsafe { S::load_f16(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_part<S: Simd>(p: *const f16, n: usize) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { S::load_part_f16(p.cast(), n) }
    }
}

/// Which path runs and how the direct path splits keys (tests force each).
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// `q_len` below this takes the direct path.
    direct_max_q: usize,
    /// Forced number of key chunks on the direct path (`None`: from the pool size).
    chunks: Option<usize>,
}

impl Plan {
    const DEFAULT: Plan = Plan {
        direct_max_q: DIRECT_MAX_Q,
        chunks: None,
    };
}

fn attention_planned<E: Elem>(
    isa: Isa,
    args: &AttentionArgs<'_, E>,
    plan: Plan,
) -> Option<Vec<f32>> {
    let sh = Shape::new(args)?;
    if sh.out_len == 0 {
        return Some(Vec::new());
    }
    let isa = isa.min(cpu::detect());
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 {
            if let Some(t) = x86::Avx512::token() {
                return Some(run(t, args, &sh, plan));
            }
        }
        if isa >= Isa::Avx2 {
            if let Some(t) = x86::Avx2::token() {
                return Some(run(t, args, &sh, plan));
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa >= Isa::Neon {
        if let Some(t) = arm::Neon::token() {
            return Some(run(t, args, &sh, plan));
        }
    }
    let _ = isa;
    Some(run(Scalar, args, &sh, plan))
}

/// The validated shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    batch: usize,
    q_len: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv: usize,
    /// Query heads per kv head.
    g: usize,
    d: usize,
    out_len: usize,
}

impl Shape {
    fn new<E>(a: &AttentionArgs<'_, E>) -> Option<Shape> {
        if a.n_kv_heads == 0 || !a.n_heads.is_multiple_of(a.n_kv_heads) {
            return None;
        }
        let out_len = a
            .batch
            .checked_mul(a.n_heads)?
            .checked_mul(a.q_len)?
            .checked_mul(a.head_dim)?;
        let fits = |len: usize, s: [usize; 3], seq: usize, heads: usize| -> bool {
            if a.batch == 0 || seq == 0 || heads == 0 || a.head_dim == 0 {
                return true;
            }
            let end = (|| {
                (a.batch - 1)
                    .checked_mul(s[0])?
                    .checked_add((seq - 1).checked_mul(s[1])?)?
                    .checked_add((heads - 1).checked_mul(s[2])?)?
                    .checked_add(a.head_dim)
            })();
            matches!(end, Some(end) if end <= len)
        };
        if !fits(a.q.len(), a.q_strides, a.q_len, a.n_heads)
            || !fits(a.k.len(), a.k_strides, a.kv_len, a.n_kv_heads)
            || !fits(a.v.len(), a.v_strides, a.kv_len, a.n_kv_heads)
        {
            return None;
        }
        if let Some(m) = a.mask {
            if m.len() < a.q_len.checked_mul(a.kv_len)? {
                return None;
            }
        }
        Some(Shape {
            batch: a.batch,
            q_len: a.q_len,
            kv_len: a.kv_len,
            n_heads: a.n_heads,
            n_kv: a.n_kv_heads,
            g: a.n_heads / a.n_kv_heads,
            d: a.head_dim,
            out_len,
        })
    }
}

/// Keys `lo..hi` (empty when `lo >= hi`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    lo: usize,
    hi: usize,
}

impl Span {
    const EMPTY: Span = Span { lo: 0, hi: 0 };

    fn is_empty(self) -> bool {
        self.lo >= self.hi
    }

    /// The smallest span holding every non-empty one of `spans` (`None`: all empty).
    fn hull(spans: &[Span]) -> Option<Span> {
        spans.iter().filter(|s| !s.is_empty()).fold(None, |h, s| {
            Some(match h {
                None => *s,
                Some(h) => Span {
                    lo: h.lo.min(s.lo),
                    hi: h.hi.max(s.hi),
                },
            })
        })
    }

    /// The part inside `j0..j1` (possibly empty).
    fn within(self, j0: usize, j1: usize) -> Span {
        Span {
            lo: self.lo.max(j0),
            hi: self.hi.min(j1),
        }
    }

    /// The part inside `j0..j1`, shifted to start at `j0` (tile-local).
    fn local(self, j0: usize, j1: usize) -> Span {
        let w = self.within(j0, j1);
        if w.is_empty() {
            Span::EMPTY
        } else {
            Span {
                lo: w.lo - j0,
                hi: w.hi - j0,
            }
        }
    }
}

/// Per query row, the span `first..=last` of keys with a finite mask value.
fn row_spans(mask: Option<&[f32]>, q_len: usize, kv_len: usize) -> Vec<Span> {
    let Some(mask) = mask else {
        return vec![Span { lo: 0, hi: kv_len }; q_len];
    };
    let span = |i: usize| {
        let row = &mask[i * kv_len..(i + 1) * kv_len];
        match row.iter().position(|x| x.is_finite()) {
            None => Span::EMPTY,
            Some(lo) => Span {
                lo,
                hi: row.iter().rposition(|x| x.is_finite()).unwrap_or(lo) + 1,
            },
        }
    };
    if q_len * kv_len >= 1 << 16 {
        (0..q_len)
            .into_par_iter()
            .with_min_len(16)
            .map(span)
            .collect()
    } else {
        (0..q_len).map(span).collect()
    }
}

/// Everything a task reads.
struct Ctx<'a, E> {
    a: AttentionArgs<'a, E>,
    sh: Shape,
    spans: &'a [Span],
    /// `scale` (divided by `softcap` when capping: `cap(x) = softcap · tanh(x / softcap)`).
    qscale: f32,
    /// Packed transposed keys (prefill path): per (batch, kv head) `n_tiles` tiles of `d × BC`.
    kt: &'a [f32],
    n_tiles: usize,
}

fn run<L: Level, E: Elem>(lvl: L, a: &AttentionArgs<'_, E>, sh: &Shape, plan: Plan) -> Vec<f32> {
    let spans = row_spans(a.mask, sh.q_len, sh.kv_len);
    let qscale = if a.softcap != 0.0 {
        a.scale / a.softcap
    } else {
        a.scale
    };
    let cx = Ctx {
        a: *a,
        sh: *sh,
        spans: &spans,
        qscale,
        kt: &[],
        n_tiles: 0,
    };
    if sh.q_len < plan.direct_max_q {
        direct(lvl, cx, plan)
    } else {
        packed(lvl, cx)
    }
}

/// The prefill path: pack Kᵀ tiles, then one task per (batch, head, block of `L::BLOCK` rows).
fn packed<L: Level, E: Elem>(lvl: L, cx: Ctx<'_, E>) -> Vec<f32> {
    let sh = cx.sh;
    let (d, kv_len) = (sh.d, sh.kv_len);
    let n_tiles = kv_len.div_ceil(BC);
    // Tiles some row can see (a difference array over the rows' spans).
    let mut cover = vec![0isize; n_tiles + 1];
    for sp in cx.spans.iter().filter(|s| !s.is_empty()) {
        cover[sp.lo / BC] += 1;
        cover[sp.hi.div_ceil(BC)] -= 1;
    }
    let mut needed = vec![false; n_tiles];
    let mut run_sum = 0;
    for (t, n) in needed.iter_mut().enumerate() {
        run_sum += cover[t];
        *n = run_sum > 0;
    }
    let tile = d * BC;
    let mut kt = vec![0.0f32; sh.batch * sh.n_kv * n_tiles * tile];
    let (k, ks) = (cx.a.k, cx.a.k_strides);
    kt.par_chunks_mut(tile).enumerate().for_each(|(idx, dst)| {
        let t = idx % n_tiles;
        if !needed[t] {
            return;
        }
        let bk = idx / n_tiles;
        let base = (bk / sh.n_kv) * ks[0] + (bk % sh.n_kv) * ks[2];
        let j0 = t * BC;
        for j in 0..BC.min(kv_len - j0) {
            let row = &k[base + (j0 + j) * ks[1]..][..d];
            for (col, &x) in dst.chunks_exact_mut(BC).zip(row) {
                col[j] = x.to_f32();
            }
        }
    });
    let cx = &Ctx {
        kt: &kt,
        n_tiles,
        ..cx
    };
    let mut out = vec![0.0f32; sh.out_len];
    out.par_chunks_mut(sh.q_len * d)
        .enumerate()
        .flat_map(|(bh, o)| {
            o.par_chunks_mut(L::BLOCK * d)
                .enumerate()
                .map(move |(blk, ob)| (bh, blk, ob))
        })
        .for_each_init(Scratch::default, |sc, (bh, blk, ob)| {
            let at = Block {
                b: bh / sh.n_heads,
                h: bh % sh.n_heads,
                i0: blk * L::BLOCK,
            };
            lvl.packed_block(cx, at, ob, sc);
        });
    out
}

/// The decode path: tasks per (batch, kv head, key chunk) leave partial `(acc, m, l)` per row
/// (rows: `g` query heads × `q_len` positions); a second pass merges them.
fn direct<L: Level, E: Elem>(lvl: L, cx: Ctx<'_, E>, plan: Plan) -> Vec<f32> {
    let sh = cx.sh;
    let d = sh.d;
    let mut out = vec![0.0f32; sh.out_len];
    let Some(Span { lo, hi }) = Span::hull(cx.spans) else {
        return out; // no query sees any key
    };
    let vis = hi - lo;
    let base = sh.batch * sh.n_kv;
    let n_chunks = match plan.chunks {
        Some(c) => c.clamp(1, vis.div_ceil(BC)),
        None => (4 * rayon::current_num_threads())
            .div_ceil(base)
            .min(vis.div_ceil(MIN_CHUNK))
            .max(1),
    };
    let chunk_len = vis.div_ceil(n_chunks).div_ceil(BC) * BC;
    let n_chunks = vis.div_ceil(chunk_len);
    let rows = sh.g * sh.q_len;
    let rec = d + 2;
    let mut part = vec![0.0f32; base * n_chunks * rows * rec];
    let cxr = &cx;
    part.par_chunks_mut(rows * rec).enumerate().for_each_init(
        Scratch::default,
        |sc, (task, pt)| {
            let (bk, c) = (task / n_chunks, task % n_chunks);
            let c0 = lo + c * chunk_len;
            let at = Chunk {
                b: bk / sh.n_kv,
                kh: bk % sh.n_kv,
                c0,
                c1: (c0 + chunk_len).min(hi),
            };
            lvl.direct_task(cxr, at, pt, sc);
        },
    );
    out.par_chunks_mut(sh.q_len * d)
        .enumerate()
        .for_each(|(bh, o)| {
            let (b, h) = (bh / sh.n_heads, bh % sh.n_heads);
            let task0 = (b * sh.n_kv + h / sh.g) * n_chunks;
            for (i, dst) in o.chunks_exact_mut(d).enumerate() {
                let row = (h % sh.g) * sh.q_len + i;
                let recs = (0..n_chunks).map(|c| &part[((task0 + c) * rows + row) * rec..][..rec]);
                let m = recs.clone().map(|r| r[d]).fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue; // sees no key: zeros
                }
                let mut l = 0.0f32;
                for r in recs.filter(|r| r[d] > f32::NEG_INFINITY) {
                    let w = (r[d] - m).exp();
                    l += w * r[d + 1];
                    for (x, &y) in dst.iter_mut().zip(&r[..d]) {
                        *x += w * y;
                    }
                }
                if l > 0.0 {
                    let inv = 1.0 / l;
                    dst.iter_mut().for_each(|x| *x *= inv);
                }
            }
        });
    out
}

/// An instruction-set level able to run the tasks (the receiver proves it is available).
trait Level: Simd + Send + Sync {
    /// Query rows per prefill block (rows sharing every K/V tile load).
    const BLOCK: usize;
    /// One block of `out.len() / d <= BLOCK` query rows (prefill path).
    fn packed_block<E: Elem>(self, cx: &Ctx<'_, E>, at: Block, out: &mut [f32], sc: &mut Scratch);
    /// All rows of a kv head against a chunk of keys: records `(acc[d], m, l)` (direct path).
    fn direct_task<E: Elem>(self, cx: &Ctx<'_, E>, at: Chunk, out: &mut [f32], sc: &mut Scratch);
}

/// The vector operations the kernels use.
///
/// # Safety
///
/// Every method may only be called where the type's instruction set is available (the
/// [`Level`] tokens guarantee it); pointer methods additionally read or write `LANES`
/// consecutive `f32` (or `n` for [`Simd::load_part`]) that must be valid.
trait Simd: Copy {
    const LANES: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// Loads `n < LANES` values (zeros in the other lanes); reads nothing past `p + n`.
    unsafe fn load_part(p: *const f32, n: usize) -> Self::V;
    /// Loads `LANES` F16 values (raw bits), widened to f32.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// Loads `n < LANES` F16 values, widened (zeros in the other lanes); reads nothing past
    /// `p + n`.
    unsafe fn load_part_f16(p: *const u16, n: usize) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn abs(a: Self::V) -> Self::V;
    /// `mag` (non-negative) with the sign of `sign`.
    unsafe fn with_sign(mag: Self::V, sign: Self::V) -> Self::V;
    unsafe fn hsum(a: Self::V) -> f32;
    unsafe fn hmax(a: Self::V) -> f32;
    /// `e^x`, see the module docs.
    unsafe fn exp(x: Self::V) -> Self::V;
}

// Cephes expf constants.
const EXP_LO: f32 = -87.33655; // ln(f32::MIN_POSITIVE): below, exp gives 0
const EXP_HI: f32 = 88.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -0.000_212_194_44;
const EXP_P: [f32; 6] = [
    0.000_198_756_91,
    0.001_398_199_9,
    0.008_333_452,
    0.041_665_796,
    0.166_666_66,
    0.5,
];

/// The scalar twin of the vector `exp` (same reduction and polynomial).
#[inline(always)]
fn exp_scalar(x: f32) -> f32 {
    if x.is_nan() || x < EXP_LO {
        return 0.0; // -inf, NaN and underflow
    }
    let x = x.min(EXP_HI);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut y = EXP_P[0];
    for &c in &EXP_P[1..] {
        y = y * r + c;
    }
    let y = y * (r * r) + r + 1.0;
    // n is in [-126, 127]: a normal power of two.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `tanh(x)` from [`Simd::exp`].
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn tanh_v<S: Simd>(x: S::V) -> S::V {
    let e = S::exp(S::mul(S::abs(x), S::splat(-2.0)));
    let one = S::splat(1.0);
    S::with_sign(S::div(S::sub(one, e), S::add(one, e)), x)
}

/// Plain Rust, one lane.
#[derive(Debug, Clone, Copy)]
struct Scalar;

// The scalar operations have no requirements beyond valid pointers.
impl Simd for Scalar {
    const LANES: usize = 1;
    type V = f32;
    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> f32 {
        // SAFETY: the caller's contract (one valid value).
        f16::from_bits(unsafe { p.read_unaligned() }).to_f32()
    }
    #[inline(always)]
    unsafe fn load_part_f16(_p: *const u16, _n: usize) -> f32 {
        0.0 // n < LANES = 1: no value
    }
    #[inline(always)]
    unsafe fn load_part(_p: *const f32, _n: usize) -> f32 {
        0.0 // n < 1
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v;
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c // no FMA instruction guaranteed: mul_add would call a slow soft fma
    }
    #[inline(always)]
    unsafe fn abs(a: f32) -> f32 {
        a.abs()
    }
    #[inline(always)]
    unsafe fn with_sign(mag: f32, sign: f32) -> f32 {
        mag.copysign(sign)
    }
    #[inline(always)]
    unsafe fn hsum(a: f32) -> f32 {
        a
    }
    #[inline(always)]
    unsafe fn hmax(a: f32) -> f32 {
        a
    }
    #[inline(always)]
    unsafe fn exp(x: f32) -> f32 {
        exp_scalar(x)
    }
}

/// Prefill block rows of the scalar level.
const SCALAR_BLOCK: usize = 4;

impl Level for Scalar {
    const BLOCK: usize = SCALAR_BLOCK;
    fn packed_block<E: Elem>(self, cx: &Ctx<'_, E>, at: Block, out: &mut [f32], sc: &mut Scratch) {
        // SAFETY: the scalar level needs no special instructions.
        unsafe { packed_block::<Scalar, E, SCALAR_BLOCK, 4, 4>(cx, at, out, sc) }
    }
    fn direct_task<E: Elem>(self, cx: &Ctx<'_, E>, at: Chunk, out: &mut [f32], sc: &mut Scratch) {
        // SAFETY: the scalar level needs no special instructions.
        unsafe { direct_task::<Scalar, E, 4, 4>(cx, at, out, sc) }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX2+FMA and AVX-512 levels. Their methods are only reachable through a token
    //! (`Avx2` / `Avx512` values), which `token()` hands out only when [`cpu::detect`] found
    //! the instructions; the trait methods themselves are `unsafe` (see [`Simd`]).

    use super::*;
    use std::arch::x86_64::*;

    /// AVX2 + FMA (+ F16C), 8 lanes.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Avx2(());

    impl Avx2 {
        pub(super) fn token() -> Option<Avx2> {
            (cpu::detect() >= Isa::Avx2).then_some(Avx2(()))
        }
    }

    /// AVX-512 F/BW/VL (and AVX2 + FMA), 16 lanes.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Avx512(());

    impl Avx512 {
        pub(super) fn token() -> Option<Avx512> {
            (cpu::detect() >= Isa::Avx512).then_some(Avx512(()))
        }
    }

    impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, n: usize) -> __m256 {
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx);
            // Masked-off lanes are not accessed (no fault past p + n).
            _mm256_maskload_ps(p, m)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
        #[inline(always)]
        unsafe fn load_part_f16(p: *const u16, n: usize) -> __m256 {
            let mut buf = [0u16; 8];
            // n < 8 values: copied, so nothing past p + n is read.
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            _mm256_cvtph_ps(_mm_loadu_si128(buf.as_ptr().cast()))
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            _mm256_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn abs(a: __m256) -> __m256 {
            _mm256_andnot_ps(_mm256_set1_ps(-0.0), a)
        }
        #[inline(always)]
        unsafe fn with_sign(mag: __m256, sign: __m256) -> __m256 {
            _mm256_or_ps(mag, _mm256_and_ps(sign, _mm256_set1_ps(-0.0)))
        }
        #[inline(always)]
        unsafe fn hsum(a: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
        #[inline(always)]
        unsafe fn hmax(a: __m256) -> f32 {
            let s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
        }
        #[inline(always)]
        unsafe fn exp(x: __m256) -> __m256 {
            let lo = _mm256_set1_ps(EXP_LO);
            let valid = _mm256_cmp_ps::<_CMP_GE_OQ>(x, lo);
            let x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(EXP_HI));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut y = _mm256_set1_ps(EXP_P[0]);
            for &c in &EXP_P[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
            }
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
                _mm256_set1_ps(1.0),
            );
            let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            _mm256_and_ps(valid, _mm256_mul_ps(y, _mm256_castsi256_ps(pow)))
        }
    }

    impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, n: usize) -> __m512 {
            // Masked-off lanes are not accessed (no fault past p + n).
            _mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, p)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        }
        #[inline(always)]
        unsafe fn load_part_f16(p: *const u16, n: usize) -> __m512 {
            // Masked-off lanes are not accessed (AVX-512 BW + VL).
            let m = ((1u32 << n) - 1) as __mmask16;
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast()))
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            _mm512_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn abs(a: __m512) -> __m512 {
            _mm512_abs_ps(a)
        }
        #[inline(always)]
        unsafe fn with_sign(mag: __m512, sign: __m512) -> __m512 {
            let s = _mm512_and_epi32(_mm512_castps_si512(sign), _mm512_set1_epi32(i32::MIN));
            _mm512_castsi512_ps(_mm512_or_epi32(_mm512_castps_si512(mag), s))
        }
        #[inline(always)]
        unsafe fn hsum(a: __m512) -> f32 {
            _mm512_reduce_add_ps(a)
        }
        #[inline(always)]
        unsafe fn hmax(a: __m512) -> f32 {
            _mm512_reduce_max_ps(a)
        }
        #[inline(always)]
        unsafe fn exp(x: __m512) -> __m512 {
            let lo = _mm512_set1_ps(EXP_LO);
            let valid = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, lo);
            let x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(EXP_HI));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
            let mut y = _mm512_set1_ps(EXP_P[0]);
            for &c in &EXP_P[1..] {
                y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
            }
            let y = _mm512_add_ps(
                _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r),
                _mm512_set1_ps(1.0),
            );
            let pow = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            ));
            _mm512_maskz_mul_ps(valid, y, _mm512_castsi512_ps(pow))
        }
    }

    /// Prefill block rows: AVX2 has 16 registers, so 6 rows × 2 vectors of accumulators.
    const AVX2_BLOCK: usize = 6;
    /// Prefill block rows: 8 rows × 2 vectors (of 16 lanes) of accumulators.
    const AVX512_BLOCK: usize = 8;

    impl Level for Avx2 {
        const BLOCK: usize = AVX2_BLOCK;
        fn packed_block<E: Elem>(
            self,
            cx: &Ctx<'_, E>,
            at: Block,
            out: &mut [f32],
            sc: &mut Scratch,
        ) {
            // SAFETY: an `Avx2` value exists only where AVX2, FMA and F16C were detected.
            unsafe { packed_block_avx2::<E>(cx, at, out, sc) }
        }
        fn direct_task<E: Elem>(
            self,
            cx: &Ctx<'_, E>,
            at: Chunk,
            out: &mut [f32],
            sc: &mut Scratch,
        ) {
            // SAFETY: an `Avx2` value exists only where AVX2, FMA and F16C were detected.
            unsafe { direct_task_avx2::<E>(cx, at, out, sc) }
        }
    }

    impl Level for Avx512 {
        const BLOCK: usize = AVX512_BLOCK;
        fn packed_block<E: Elem>(
            self,
            cx: &Ctx<'_, E>,
            at: Block,
            out: &mut [f32],
            sc: &mut Scratch,
        ) {
            // SAFETY: an `Avx512` value exists only where AVX-512 F/BW/VL, AVX2 and FMA were
            // detected.
            unsafe { packed_block_avx512::<E>(cx, at, out, sc) }
        }
        fn direct_task<E: Elem>(
            self,
            cx: &Ctx<'_, E>,
            at: Chunk,
            out: &mut [f32],
            sc: &mut Scratch,
        ) {
            // SAFETY: an `Avx512` value exists only where AVX-512 F/BW/VL, AVX2 and FMA were
            // detected.
            unsafe { direct_task_avx512::<E>(cx, at, out, sc) }
        }
    }

    // The entry points: the generic kernels compiled for each instruction set. Safety: the
    // processor supports the enabled features.

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn packed_block_avx2<E: Elem>(
        cx: &Ctx<'_, E>,
        at: Block,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        // SAFETY: AVX2 + FMA are enabled here and available (caller's contract).
        unsafe { packed_block::<Avx2, E, AVX2_BLOCK, 2, 2>(cx, at, out, sc) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn direct_task_avx2<E: Elem>(
        cx: &Ctx<'_, E>,
        at: Chunk,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        // SAFETY: AVX2 + FMA are enabled here and available (caller's contract).
        unsafe { direct_task::<Avx2, E, 4, 2>(cx, at, out, sc) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn packed_block_avx512<E: Elem>(
        cx: &Ctx<'_, E>,
        at: Block,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        // SAFETY: AVX-512 F/BW/VL are enabled here and available (caller's contract).
        unsafe { packed_block::<Avx512, E, AVX512_BLOCK, 2, 2>(cx, at, out, sc) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn direct_task_avx512<E: Elem>(
        cx: &Ctx<'_, E>,
        at: Chunk,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        // SAFETY: AVX-512 F/BW/VL are enabled here and available (caller's contract).
        unsafe { direct_task::<Avx512, E, 4, 4>(cx, at, out, sc) }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    //! The NEON level (aarch64), 4 lanes. NEON is part of every aarch64 processor docent runs
    //! on, but the token still comes from [`cpu::detect`] like the x86 ones.

    use super::*;
    use std::arch::aarch64::*;

    /// NEON, 4 lanes.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Neon(());

    impl Neon {
        pub(super) fn token() -> Option<Neon> {
            (cpu::detect() >= Isa::Neon).then_some(Neon(()))
        }
    }

    impl Simd for Neon {
        const LANES: usize = 4;
        type V = float32x4_t;
        #[inline(always)]
        unsafe fn zero() -> float32x4_t {
            vdupq_n_f32(0.0)
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> float32x4_t {
            vdupq_n_f32(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> float32x4_t {
            vld1q_f32(p)
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, n: usize) -> float32x4_t {
            let mut buf = [0f32; 4];
            // n < 4 values: copied, so nothing past p + n is read.
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            vld1q_f32(buf.as_ptr())
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> float32x4_t {
            crate::matmul::neon::f16x4(vld1_u16(p))
        }
        #[inline(always)]
        unsafe fn load_part_f16(p: *const u16, n: usize) -> float32x4_t {
            let mut buf = [0u16; 4];
            // n < 4 values: copied, so nothing past p + n is read.
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            crate::matmul::neon::f16x4(vld1_u16(buf.as_ptr()))
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: float32x4_t) {
            vst1q_f32(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vaddq_f32(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vsubq_f32(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vmulq_f32(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vdivq_f32(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vmaxq_f32(a, b)
        }
        #[inline(always)]
        unsafe fn fma(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
            vfmaq_f32(c, a, b)
        }
        #[inline(always)]
        unsafe fn abs(a: float32x4_t) -> float32x4_t {
            vabsq_f32(a)
        }
        #[inline(always)]
        unsafe fn with_sign(mag: float32x4_t, sign: float32x4_t) -> float32x4_t {
            // The sign bit from `sign`, every other bit from `mag`.
            vbslq_f32(vdupq_n_u32(0x8000_0000), sign, mag)
        }
        #[inline(always)]
        unsafe fn hsum(a: float32x4_t) -> f32 {
            vaddvq_f32(a)
        }
        #[inline(always)]
        unsafe fn hmax(a: float32x4_t) -> f32 {
            vmaxvq_f32(a)
        }
        #[inline(always)]
        unsafe fn exp(x: float32x4_t) -> float32x4_t {
            let lo = vdupq_n_f32(EXP_LO);
            // False for NaN and below EXP_LO: those lanes give 0.
            let valid = vcgeq_f32(x, lo);
            let x = vminq_f32(vmaxq_f32(x, lo), vdupq_n_f32(EXP_HI));
            // Round to nearest, ties to even.
            let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
            let r = vfmsq_f32(x, n, vdupq_n_f32(LN2_HI));
            let r = vfmsq_f32(r, n, vdupq_n_f32(LN2_LO));
            let mut y = vdupq_n_f32(EXP_P[0]);
            for &c in &EXP_P[1..] {
                y = vfmaq_f32(vdupq_n_f32(c), y, r);
            }
            let y = vaddq_f32(vfmaq_f32(r, y, vmulq_f32(r, r)), vdupq_n_f32(1.0));
            let pow = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
            let e = vmulq_f32(y, vreinterpretq_f32_s32(pow));
            vreinterpretq_f32_u32(vandq_u32(valid, vreinterpretq_u32_f32(e)))
        }
    }

    /// Prefill block rows: 32 registers, 8 rows × 2 vectors of accumulators.
    const NEON_BLOCK: usize = 8;

    impl Level for Neon {
        const BLOCK: usize = NEON_BLOCK;
        fn packed_block<E: Elem>(
            self,
            cx: &Ctx<'_, E>,
            at: Block,
            out: &mut [f32],
            sc: &mut Scratch,
        ) {
            // SAFETY: a `Neon` value exists only where NEON was detected.
            unsafe { packed_block_neon::<E>(cx, at, out, sc) }
        }
        fn direct_task<E: Elem>(
            self,
            cx: &Ctx<'_, E>,
            at: Chunk,
            out: &mut [f32],
            sc: &mut Scratch,
        ) {
            // SAFETY: a `Neon` value exists only where NEON was detected.
            unsafe { direct_task_neon::<E>(cx, at, out, sc) }
        }
    }

    // The entry points: the generic kernels compiled for NEON. Safety: the processor has it.

    #[target_feature(enable = "neon")]
    unsafe fn packed_block_neon<E: Elem>(
        cx: &Ctx<'_, E>,
        at: Block,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        // SAFETY: NEON is enabled here and available (caller's contract).
        unsafe { packed_block::<Neon, E, NEON_BLOCK, 2, 2>(cx, at, out, sc) }
    }

    #[target_feature(enable = "neon")]
    unsafe fn direct_task_neon<E: Elem>(
        cx: &Ctx<'_, E>,
        at: Chunk,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        // SAFETY: NEON is enabled here and available (caller's contract).
        unsafe { direct_task::<Neon, E, 4, 4>(cx, at, out, sc) }
    }
}

/// A prefill task: the block of query rows from `i0` of batch `b`, head `h`.
#[derive(Debug, Clone, Copy)]
struct Block {
    b: usize,
    h: usize,
    i0: usize,
}

/// A direct-path task: every row of kv head `kh` in batch `b` against keys `c0..c1`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    b: usize,
    kh: usize,
    c0: usize,
    c1: usize,
}

/// Per-worker scratch (query rows and accumulators), reused across the tasks a rayon job runs.
#[derive(Default)]
struct Scratch {
    qs: Vec<f32>,
    acc: Vec<f32>,
}

impl Scratch {
    /// Zeroed buffers of `nq` and `nacc` values.
    fn take(&mut self, nq: usize, nacc: usize) -> (&mut [f32], &mut [f32]) {
        for (buf, n) in [(&mut self.qs, nq), (&mut self.acc, nacc)] {
            buf.clear();
            buf.resize(n, 0.0);
        }
        (&mut self.qs, &mut self.acc)
    }
}

/// Rows of K or V for one (batch, kv head): key `j` at `data[base + j * stride..][..d]`.
#[derive(Clone, Copy)]
struct Rows<'a, E> {
    data: &'a [E],
    base: usize,
    stride: usize,
}

impl<E> Rows<'_, E> {
    /// Whether keys `jl..jh` (relative to `base`) lie inside `data`, `d` values each.
    fn holds(&self, jl: usize, jh: usize, d: usize) -> bool {
        jl >= jh || self.base + (jh - 1) * self.stride + d <= self.data.len()
    }
}

/// The online-softmax state of `R` rows.
struct RowState<const R: usize> {
    m: [f32; R],
    l: [f32; R],
}

impl<const R: usize> RowState<R> {
    fn new() -> Self {
        RowState {
            m: [f32::NEG_INFINITY; R],
            l: [0.0; R],
        }
    }
}

/// One block of query rows of head `h` (prefill path).
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn packed_block<S: Simd, E: Elem, const R: usize, const NQ: usize, const NP: usize>(
    cx: &Ctx<'_, E>,
    Block { b, h, i0 }: Block,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let (a, sh) = (&cx.a, &cx.sh);
    let d = sh.d;
    debug_assert!(out.len() <= R * d);
    let rows = (out.len() / d).min(R);
    let dp = d.div_ceil(S::LANES) * S::LANES;
    let kh = h / sh.g;
    let (qs, acc) = sc.take(R * d, R * dp);
    let mut s = [[0.0f32; BC]; R];
    let mut st = RowState::new();
    let mut spans = [Span::EMPTY; R];
    let mut pos = [0usize; R];
    for r in 0..rows {
        let i = i0 + r;
        let qb = b * a.q_strides[0] + i * a.q_strides[1] + h * a.q_strides[2];
        for (x, &y) in qs[r * d..(r + 1) * d].iter_mut().zip(&a.q[qb..qb + d]) {
            *x = y * cx.qscale;
        }
        spans[r] = cx.spans[i];
        pos[r] = i;
    }
    if let Some(Span { lo, hi }) = Span::hull(&spans) {
        let tile = d * BC;
        let kt = &cx.kt[(b * sh.n_kv + kh) * cx.n_tiles * tile..][..cx.n_tiles * tile];
        let v = Rows {
            data: a.v,
            base: b * a.v_strides[0] + kh * a.v_strides[2],
            stride: a.v_strides[1],
        };
        for t in lo / BC..hi.div_ceil(BC) {
            let j0 = t * BC;
            let loc = spans.map(|sp| sp.local(j0, (j0 + BC).min(sh.kv_len)));
            if loc.iter().all(|s| s.is_empty()) {
                continue; // no row of the block sees this tile
            }
            // SAFETY: the caller guarantees S's instruction set.
            unsafe {
                qk_packed::<S, R, NQ>(qs, d, &kt[t * tile..][..tile], &mut s);
                tile_update::<S, E, R, NP>(cx, &mut s, &loc, &pos, j0, &mut st, acc, dp, v);
            }
        }
    }
    for (r, o) in out.chunks_exact_mut(d).enumerate().take(rows) {
        finish_row(o, &acc[r * dp..][..d], st.l[r]);
    }
}

/// `o = acc / l`, or zeros when the row saw no key.
fn finish_row(o: &mut [f32], acc: &[f32], l: f32) {
    if l > 0.0 {
        let inv = 1.0 / l;
        for (x, &y) in o.iter_mut().zip(acc) {
            *x = y * inv;
        }
    } else {
        o.fill(0.0);
    }
}

/// All rows (g heads × q_len) of kv head `kh` against keys `c0..c1` (direct path); writes
/// `(acc[0..d], m, l)` per row into `out`.
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn direct_task<S: Simd, E: Elem, const R: usize, const NP: usize>(
    cx: &Ctx<'_, E>,
    Chunk { b, kh, c0, c1 }: Chunk,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let (a, sh) = (&cx.a, &cx.sh);
    let d = sh.d;
    let rows = sh.g * sh.q_len;
    let rec = d + 2;
    let dp = d.div_ceil(S::LANES) * S::LANES;
    let (qs, acc) = sc.take(R * dp, R * dp);
    let mut s = [[0.0f32; BC]; R];
    let k = Rows {
        data: a.k,
        base: b * a.k_strides[0] + kh * a.k_strides[2],
        stride: a.k_strides[1],
    };
    let v = Rows {
        data: a.v,
        base: b * a.v_strides[0] + kh * a.v_strides[2],
        stride: a.v_strides[1],
    };
    for rg in (0..rows).step_by(R) {
        let nr = R.min(rows - rg);
        qs.fill(0.0);
        acc.fill(0.0);
        let mut st = RowState::new();
        let mut spans = [Span::EMPTY; R];
        let mut pos = [0usize; R];
        for r in 0..nr {
            let (hg, i) = ((rg + r) / sh.q_len, (rg + r) % sh.q_len);
            let h = kh * sh.g + hg;
            let qb = b * a.q_strides[0] + i * a.q_strides[1] + h * a.q_strides[2];
            for (x, &y) in qs[r * dp..r * dp + d].iter_mut().zip(&a.q[qb..qb + d]) {
                *x = y * cx.qscale;
            }
            spans[r] = cx.spans[i].within(c0, c1);
            pos[r] = i;
        }
        let mut j0 = c0;
        while j0 < c1 {
            let j1 = (j0 + BC).min(c1);
            let loc = spans.map(|sp| sp.local(j0, j1));
            if let Some(Span { lo: jl, hi: jh }) = Span::hull(&loc) {
                let kt = Rows {
                    base: k.base + j0 * k.stride,
                    ..k
                };
                // SAFETY: the caller guarantees S's instruction set.
                unsafe {
                    qk_direct::<S, E, R>(qs, dp, kt, d, jl, jh, &mut s);
                    tile_update::<S, E, R, NP>(cx, &mut s, &loc, &pos, j0, &mut st, acc, dp, v);
                }
            }
            j0 = j1;
        }
        for r in 0..nr {
            let o = &mut out[(rg + r) * rec..][..rec];
            o[..d].copy_from_slice(&acc[r * dp..][..d]);
            o[d] = st.m[r];
            o[d + 1] = st.l[r];
        }
    }
}

/// `s[r][0..BC] = qs[r] · Kᵀ` for one packed tile: `qs` holds `R` rows of `d`, `kt` is `d`
/// rows of `BC` keys. Rank-1 updates over `d`, `NQ` vectors of keys at a time.
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn qk_packed<S: Simd, const R: usize, const NQ: usize>(
    qs: &[f32],
    d: usize,
    kt: &[f32],
    s: &mut [[f32; BC]; R],
) {
    let w = NQ * S::LANES;
    assert!(qs.len() >= R * d && kt.len() >= d * BC && BC.is_multiple_of(w));
    let (qp, kp) = (qs.as_ptr(), kt.as_ptr());
    for c0 in (0..BC).step_by(w) {
        // SAFETY: S's instruction set is available (caller). Reads: kt[dd*BC + c0 + u*L..][..L]
        // with dd < d, c0 + w <= BC, so below d*BC <= kt.len(); qs[r*d + dd] < R*d <= qs.len().
        // Writes: s[r][c0 + u*L..][..L] with c0 + w <= BC.
        unsafe {
            let mut acc = [[S::zero(); NQ]; R];
            for dd in 0..d {
                let krow = kp.add(dd * BC + c0);
                let mut kv = [S::zero(); NQ];
                for u in 0..NQ {
                    kv[u] = S::load(krow.add(u * S::LANES));
                }
                for r in 0..R {
                    let qb = S::splat(*qp.add(r * d + dd));
                    for u in 0..NQ {
                        acc[r][u] = S::fma(qb, kv[u], acc[r][u]);
                    }
                }
            }
            for r in 0..R {
                for u in 0..NQ {
                    S::store(s[r].as_mut_ptr().add(c0 + u * S::LANES), acc[r][u]);
                }
            }
        }
    }
}

/// `s[r][j] = qs[r] · k_j` for keys `jl..jh` of a tile read in place (direct path); `qs` holds
/// `R` rows of `dp` (zero-padded past `d`).
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn qk_direct<S: Simd, E: Elem, const R: usize>(
    qs: &[f32],
    dp: usize,
    k: Rows<'_, E>,
    d: usize,
    jl: usize,
    jh: usize,
    s: &mut [[f32; BC]; R],
) {
    let l = S::LANES;
    let (full, rem) = (d / l, d % l);
    assert!(
        jh <= BC && dp >= d && dp.is_multiple_of(l) && qs.len() >= R * dp && k.holds(jl, jh, d)
    );
    let qp = qs.as_ptr();
    for j in jl..jh {
        // SAFETY: S's instruction set is available (caller). Key j's row lies in k.data
        // (`holds` above); full vectors read below `d`, the last one only `rem` values. Query
        // reads: r*dp + c*l + l <= R*dp.
        unsafe {
            let kp = k.data.as_ptr().add(k.base + j * k.stride);
            let mut acc = [S::zero(); R];
            for c in 0..full {
                let kv = E::load::<S>(kp.add(c * l));
                for r in 0..R {
                    acc[r] = S::fma(S::load(qp.add(r * dp + c * l)), kv, acc[r]);
                }
            }
            if rem > 0 {
                let kv = E::load_part::<S>(kp.add(full * l), rem);
                for r in 0..R {
                    acc[r] = S::fma(S::load(qp.add(r * dp + full * l)), kv, acc[r]);
                }
            }
            for r in 0..R {
                s[r][j] = S::hsum(acc[r]);
            }
        }
    }
}

/// The online-softmax step for one tile starting at key `j0`, given the raw scores `s`
/// (scaled): soft-capping, spans and mask, running max/sum, rescaling, then `acc += P·V`.
/// `loc[r]` is row r's visible span within the tile (tile-local).
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_update<S: Simd, E: Elem, const R: usize, const NP: usize>(
    cx: &Ctx<'_, E>,
    s: &mut [[f32; BC]; R],
    loc: &[Span; R],
    pos: &[usize; R],
    j0: usize,
    st: &mut RowState<R>,
    acc: &mut [f32],
    dp: usize,
    v: Rows<'_, E>,
) {
    let kv_len = cx.sh.kv_len;
    let (mut jmin, mut jmax) = (BC, 0);
    for (r, row) in s.iter_mut().enumerate() {
        let Span { lo, hi } = loc[r];
        if lo >= hi {
            row.fill(0.0);
            continue;
        }
        if cx.a.softcap != 0.0 {
            // SAFETY: S's instruction set is available (caller).
            unsafe { softcap_row::<S>(row, cx.a.softcap) };
        }
        row[..lo].fill(f32::NEG_INFINITY);
        row[hi..].fill(f32::NEG_INFINITY);
        if let Some(mask) = cx.a.mask {
            let m = &mask[pos[r] * kv_len + j0..][lo..hi];
            for (x, &y) in row[lo..hi].iter_mut().zip(m) {
                *x = if y.is_finite() {
                    *x + y
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        // SAFETY: S's instruction set is available (caller).
        let m_new = unsafe { row_max::<S>(row) }.max(st.m[r]);
        if m_new == f32::NEG_INFINITY {
            row.fill(0.0); // every key seen so far has a -inf score (mask holes)
            continue;
        }
        // The rescaling factor: 1 while the max holds, 0 when m was -inf.
        let alpha = if m_new == st.m[r] {
            1.0
        } else {
            exp_scalar(st.m[r] - m_new)
        };
        // SAFETY: S's instruction set is available (caller).
        let sum = unsafe { row_exp::<S>(row, m_new) };
        st.l[r] = st.l[r] * alpha + sum;
        st.m[r] = m_new;
        if alpha != 1.0 {
            acc[r * dp..(r + 1) * dp]
                .iter_mut()
                .for_each(|x| *x *= alpha);
        }
        jmin = jmin.min(lo);
        jmax = jmax.max(hi);
    }
    if jmin < jmax {
        let vt = Rows {
            base: v.base + j0 * v.stride,
            ..v
        };
        // SAFETY: S's instruction set is available (caller).
        unsafe { pv::<S, E, R, NP>(s, jmin, jmax, vt, cx.sh.d, acc, dp) };
    }
}

/// `row = softcap · tanh(row)` (the scores were scaled by `scale / softcap`).
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn softcap_row<S: Simd>(row: &mut [f32; BC], softcap: f32) {
    let p = row.as_mut_ptr();
    // SAFETY: BC is a multiple of LANES, so every vector lies in the row.
    unsafe {
        let c = S::splat(softcap);
        for j in (0..BC).step_by(S::LANES) {
            S::store(p.add(j), S::mul(c, tanh_v::<S>(S::load(p.add(j)))));
        }
    }
}

/// The maximum of a row.
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn row_max<S: Simd>(row: &[f32; BC]) -> f32 {
    let p = row.as_ptr();
    // SAFETY: BC is a multiple of LANES, so every vector lies in the row.
    unsafe {
        let mut m = S::splat(f32::NEG_INFINITY);
        for j in (0..BC).step_by(S::LANES) {
            m = S::max(m, S::load(p.add(j)));
        }
        S::hmax(m)
    }
}

/// `row = exp(row - m)`, returning the sum.
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn row_exp<S: Simd>(row: &mut [f32; BC], m: f32) -> f32 {
    let p = row.as_mut_ptr();
    // SAFETY: BC is a multiple of LANES, so every vector lies in the row.
    unsafe {
        let (mv, mut sum) = (S::splat(m), S::zero());
        for j in (0..BC).step_by(S::LANES) {
            let e = S::exp(S::sub(S::load(p.add(j)), mv));
            S::store(p.add(j), e);
            sum = S::add(sum, e);
        }
        S::hsum(sum)
    }
}

/// `acc[r][0..d] += Σ_{j in jl..jh} p[r][j] · v_j` (`acc` rows are `dp` long).
///
/// # Safety
///
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn pv<S: Simd, E: Elem, const R: usize, const NP: usize>(
    p: &[[f32; BC]; R],
    jl: usize,
    jh: usize,
    v: Rows<'_, E>,
    d: usize,
    acc: &mut [f32],
    dp: usize,
) {
    let l = S::LANES;
    let (full, rem) = (d / l, d % l);
    assert!(jh <= BC && dp >= d && acc.len() >= R * dp && v.holds(jl, jh, d));
    // SAFETY (all calls): S's instruction set is available (caller); the column blocks cover
    // 0..d exactly, each within dp, and only the last reads a partial vector (`rem` values).
    unsafe {
        let mut c = 0;
        while c + NP <= full {
            pv_cols::<S, E, R, NP, false>(p, jl, jh, v, c * l, 0, acc, dp);
            c += NP;
        }
        while c < full {
            pv_cols::<S, E, R, 1, false>(p, jl, jh, v, c * l, 0, acc, dp);
            c += 1;
        }
        if rem > 0 {
            pv_cols::<S, E, R, 1, true>(p, jl, jh, v, c * l, rem, acc, dp);
        }
    }
}

/// `pv` for the columns `off..off + NV·LANES` (the last vector only `rem` wide when `PART`).
///
/// # Safety
///
/// `S`'s instruction set is available; `off + NV·LANES <= dp`, and `off + NV·LANES <= d`
/// (`off + (NV-1)·LANES + rem == d` when `PART`); the `pv` asserts hold.
#[inline(always)]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
unsafe fn pv_cols<S: Simd, E: Elem, const R: usize, const NV: usize, const PART: bool>(
    p: &[[f32; BC]; R],
    jl: usize,
    jh: usize,
    v: Rows<'_, E>,
    off: usize,
    rem: usize,
    acc: &mut [f32],
    dp: usize,
) {
    let l = S::LANES;
    let ap = acc.as_mut_ptr();
    // SAFETY: the caller's contract: acc reads/writes at r*dp + off + u*l..+l <= R*dp; V reads
    // within key rows jl..jh (`holds`), columns below d.
    unsafe {
        let mut a = [[S::zero(); NV]; R];
        for r in 0..R {
            for u in 0..NV {
                a[r][u] = S::load(ap.add(r * dp + off + u * l));
            }
        }
        for j in jl..jh {
            let vp = v.data.as_ptr().add(v.base + j * v.stride + off);
            let mut vv = [S::zero(); NV];
            for u in 0..NV {
                vv[u] = if PART && u + 1 == NV {
                    E::load_part::<S>(vp.add(u * l), rem)
                } else {
                    E::load::<S>(vp.add(u * l))
                };
            }
            for r in 0..R {
                let pb = S::splat(p[r][j]);
                for u in 0..NV {
                    a[r][u] = S::fma(pb, vv[u], a[r][u]);
                }
            }
        }
        for r in 0..R {
            for u in 0..NV {
                S::store(ap.add(r * dp + off + u * l), a[r][u]);
            }
        }
    }
}

/// The plain reference: for each (batch, head, query) materialise the scores (f64), subtract
/// the max, exponentiate, and take the weighted sum of the values. Same validation and the
/// same semantics as [`attention`] (keys with a non-finite mask value are invisible; a query
/// that sees no key gets zeros).
pub fn attention_reference(args: &AttentionArgs<'_>) -> Option<Vec<f32>> {
    reference(args)
}

/// [`attention_reference`] over an F16 KV cache (each key and value widened exactly).
pub fn attention_f16_reference(args: &AttentionArgs<'_, f16>) -> Option<Vec<f32>> {
    reference(args)
}

fn reference<E: Elem>(args: &AttentionArgs<'_, E>) -> Option<Vec<f32>> {
    let sh = Shape::new(args)?;
    let a = args;
    let d = sh.d;
    let mut out = vec![0.0f32; sh.out_len];
    let mut scores = vec![0.0f64; sh.kv_len];
    let idx = |s: [usize; 3], b: usize, p: usize, h: usize| b * s[0] + p * s[1] + h * s[2];
    for b in 0..sh.batch {
        for h in 0..sh.n_heads {
            let kh = h / sh.g;
            for i in 0..sh.q_len {
                let q = &a.q[idx(a.q_strides, b, i, h)..][..d];
                for (j, sc) in scores.iter_mut().enumerate() {
                    let k = &a.k[idx(a.k_strides, b, j, kh)..][..d];
                    let dot: f64 = q
                        .iter()
                        .zip(k)
                        .map(|(&x, &y)| x as f64 * y.to_f32() as f64)
                        .sum();
                    let mut x = dot * a.scale as f64;
                    if a.softcap != 0.0 {
                        let c = a.softcap as f64;
                        x = c * (x / c).tanh();
                    }
                    if let Some(mask) = a.mask {
                        let m = mask[i * sh.kv_len + j];
                        x = if m.is_finite() {
                            x + m as f64
                        } else {
                            f64::NEG_INFINITY
                        };
                    }
                    *sc = x;
                }
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    continue; // sees no key: zeros
                }
                let mut o = vec![0.0f64; d];
                let mut sum = 0.0f64;
                for (j, &sc) in scores.iter().enumerate() {
                    let w = (sc - mx).exp();
                    sum += w;
                    let v = &a.v[idx(a.v_strides, b, j, kh)..][..d];
                    for (x, &y) in o.iter_mut().zip(v) {
                        *x += w * y.to_f32() as f64;
                    }
                }
                let dst = &mut out[((b * sh.n_heads + h) * sh.q_len + i) * d..][..d];
                for (x, y) in dst.iter_mut().zip(o) {
                    *x = (y / sum) as f32;
                }
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::quant::testutil::Rng;

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Mask {
        None,
        /// Query i sees keys j <= i + kv_len - q_len.
        Causal,
        /// Causal with finite non-zero biases and some -inf holes inside the spans.
        CausalBiased,
        /// Finite everywhere (no -inf), random values in [-4, 4].
        Finite,
        /// Bidirectional window |j - (i + off)| <= w with a distance bias: spans start past 0.
        Window(usize),
        /// Causal, and some rows (the first included) see nothing.
        DeadRows,
    }

    #[derive(Debug, Clone, Copy)]
    enum Layout {
        /// (batch, seq, heads, d), each axis padded by `pad`.
        Bshd,
        /// (batch, heads, seq, d), each axis padded by `pad`.
        Bhsd,
    }

    #[derive(Debug, Clone, Copy)]
    struct Case {
        batch: usize,
        q_len: usize,
        kv_len: usize,
        n_heads: usize,
        n_kv: usize,
        d: usize,
        softcap: f32,
        mask: Mask,
        layouts: [Layout; 3],
        pad: usize,
        seed: u64,
    }

    impl Case {
        fn new(batch: usize, q_len: usize, kv_len: usize, heads: (usize, usize), d: usize) -> Case {
            Case {
                batch,
                q_len,
                kv_len,
                n_heads: heads.0,
                n_kv: heads.1,
                d,
                softcap: 0.0,
                mask: Mask::Causal,
                layouts: [Layout::Bshd; 3],
                pad: 0,
                seed: 1,
            }
        }
        fn mask(self, mask: Mask) -> Case {
            Case { mask, ..self }
        }
    }

    struct Data {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        strides: [[usize; 3]; 3],
        mask: Option<Vec<f32>>,
    }

    /// A tensor in the given layout; padding is NaN, so reading it poisons the result.
    fn tensor(
        rng: &mut Rng,
        (batch, len, heads, d): (usize, usize, usize, usize),
        layout: Layout,
        pad: usize,
    ) -> (Vec<f32>, [usize; 3]) {
        let s = match layout {
            Layout::Bshd => {
                let s2 = d + pad;
                let s1 = heads * s2 + pad;
                [len * s1 + pad, s1, s2]
            }
            Layout::Bhsd => {
                let s1 = d + pad;
                let s2 = len * s1 + pad;
                [heads * s2 + pad, s1, s2]
            }
        };
        let mut buf = vec![f32::NAN; batch * s[0]];
        for b in 0..batch {
            for p in 0..len {
                for h in 0..heads {
                    for x in 0..d {
                        buf[b * s[0] + p * s[1] + h * s[2] + x] = rng.f32();
                    }
                }
            }
        }
        (buf, s)
    }

    fn build(c: &Case) -> Data {
        let mut rng = Rng(c.seed);
        let (q, qs) = tensor(
            &mut rng,
            (c.batch, c.q_len, c.n_heads, c.d),
            c.layouts[0],
            c.pad,
        );
        let (k, ks) = tensor(
            &mut rng,
            (c.batch, c.kv_len, c.n_kv, c.d),
            c.layouts[1],
            c.pad,
        );
        let (v, vs) = tensor(
            &mut rng,
            (c.batch, c.kv_len, c.n_kv, c.d),
            c.layouts[2],
            c.pad,
        );
        let off = c.kv_len as isize - c.q_len as isize;
        let causal = |i: usize, j: usize| j as isize <= i as isize + off;
        let ninf = f32::NEG_INFINITY;
        let mask = (c.mask != Mask::None).then(|| {
            let mut m = vec![0.0f32; c.q_len * c.kv_len];
            for i in 0..c.q_len {
                for j in 0..c.kv_len {
                    m[i * c.kv_len + j] = match c.mask {
                        Mask::None => 0.0,
                        Mask::Causal => {
                            if causal(i, j) {
                                0.0
                            } else {
                                ninf
                            }
                        }
                        Mask::CausalBiased => {
                            if !causal(i, j) || rng.below(7) == 0 {
                                ninf
                            } else {
                                3.0 * rng.f32() - 1.0
                            }
                        }
                        Mask::Finite => 4.0 * rng.f32(),
                        Mask::Window(w) => {
                            let dist = (j as isize - (i as isize + off)).unsigned_abs();
                            if dist <= w {
                                -0.05 * dist as f32
                            } else {
                                ninf
                            }
                        }
                        Mask::DeadRows => {
                            if causal(i, j) && i % 5 != 2 && i != 0 {
                                0.0
                            } else {
                                ninf
                            }
                        }
                    };
                }
            }
            m
        });
        Data {
            q,
            k,
            v,
            strides: [qs, ks, vs],
            mask,
        }
    }

    fn args<'a>(c: &Case, x: &'a Data) -> AttentionArgs<'a> {
        AttentionArgs {
            q: &x.q,
            k: &x.k,
            v: &x.v,
            q_strides: x.strides[0],
            k_strides: x.strides[1],
            v_strides: x.strides[2],
            batch: c.batch,
            q_len: c.q_len,
            kv_len: c.kv_len,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv,
            head_dim: c.d,
            scale: 1.0 / (c.d as f32).sqrt(),
            softcap: c.softcap,
            mask: x.mask.as_deref(),
        }
    }

    /// The plans every case runs under: the default, always direct with split keys, always
    /// packed.
    const PLANS: [Plan; 3] = [
        Plan::DEFAULT,
        Plan {
            direct_max_q: usize::MAX,
            chunks: Some(3),
        },
        Plan {
            direct_max_q: 0,
            chunks: None,
        },
    ];

    /// Compares every ISA and plan against the reference (max error at most 1e-5 of the
    /// output magnitude; measured: about 2e-7); returns the reference output.
    fn check(c: &Case) -> Vec<f32> {
        let x = build(c);
        let a = args(c, &x);
        let want = attention_reference(&a).expect("valid arguments");
        assert_eq!(want.len(), c.batch * c.n_heads * c.q_len * c.d);
        assert!(
            want.iter().all(|y| y.is_finite()),
            "{c:?}: reference not finite"
        );
        let mag = want.iter().fold(1.0f32, |m, y| m.max(y.abs()));
        for isa in Isa::available() {
            for plan in PLANS {
                let got = attention_planned(isa, &a, plan).expect("valid arguments");
                assert_eq!(got.len(), want.len());
                let mut worst = (0.0f32, 0);
                for (n, (g, w)) in got.iter().zip(&want).enumerate() {
                    let e = if g.is_finite() {
                        (g - w).abs()
                    } else {
                        f32::INFINITY
                    };
                    if e > worst.0 {
                        worst = (e, n);
                    }
                }
                assert!(
                    worst.0 <= 1e-5 * mag,
                    "{c:?} {isa:?} {plan:?}: max error {} at {} (got {}, want {})",
                    worst.0,
                    worst.1,
                    got[worst.1],
                    want[worst.1]
                );
            }
        }
        want
    }

    /// The F16 KV path on one case: every level and plan against the F16 reference (keys and
    /// values widened exactly), and the F16 reference near the f32 one (F16 rounding only).
    fn check_f16(c: &Case) {
        let x = build(c);
        let to16 = |v: &[f32]| v.iter().map(|&y| f16::from_f32(y)).collect::<Vec<f16>>();
        let (k16, v16) = (to16(&x.k), to16(&x.v));
        let a32 = args(c, &x);
        let a = AttentionArgs::<'_, f16> {
            q: a32.q,
            k: &k16,
            v: &v16,
            q_strides: a32.q_strides,
            k_strides: a32.k_strides,
            v_strides: a32.v_strides,
            batch: a32.batch,
            q_len: a32.q_len,
            kv_len: a32.kv_len,
            n_heads: a32.n_heads,
            n_kv_heads: a32.n_kv_heads,
            head_dim: a32.head_dim,
            scale: a32.scale,
            softcap: a32.softcap,
            mask: a32.mask,
        };
        let want = attention_f16_reference(&a).expect("valid arguments");
        let want32 = attention_reference(&a32).expect("valid arguments");
        let mag = want.iter().fold(1.0f32, |m, y| m.max(y.abs()));
        let near = want
            .iter()
            .zip(&want32)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            near <= 1e-2 * mag,
            "{c:?}: F16 reference off the f32 one by {near}"
        );
        for isa in Isa::available() {
            for plan in PLANS {
                let got = attention_planned(isa, &a, plan).expect("valid arguments");
                assert_eq!(got.len(), want.len());
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| {
                        if g.is_finite() {
                            (g - w).abs()
                        } else {
                            f32::INFINITY
                        }
                    })
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= 1e-5 * mag,
                    "{c:?} {isa:?} {plan:?}: max error {worst}"
                );
            }
        }
    }

    #[test]
    fn f16_kv_matches_the_reference_on_random_shapes() {
        let mut rng = Rng(7);
        for (q_len, kv_len) in [(1, 1), (1, 300), (3, 129), (8, 8), (37, 100), (70, 200)] {
            for d in [64, 20, 9] {
                let heads = [(1, 1), (4, 2), (9, 3)][rng.below(3)];
                let c = Case {
                    pad: rng.below(3),
                    layouts: [Layout::Bshd, Layout::Bhsd, Layout::Bshd],
                    seed: rng.next_u64(),
                    ..Case::new(1 + rng.below(2), q_len, kv_len, heads, d)
                };
                check_f16(&c);
                check_f16(&c.mask(Mask::CausalBiased));
            }
        }
    }

    #[test]
    fn attention_vector_exp_matches_std() {
        let mut xs: Vec<f32> = (0..=200_000)
            .map(|i| -87.0 * i as f32 / 200_000.0)
            .collect();
        xs.extend((0..=20_000).map(|i| 88.0 * i as f32 / 20_000.0));
        xs.extend([-1e-30, -1e-7, 1e-7, -0.5 * std::f32::consts::LN_2, -87.33]);
        for isa in Isa::available() {
            let got = exp_with(isa, &xs);
            let mut worst = 0.0f64;
            for (&x, &e) in xs.iter().zip(&got) {
                let want = (x as f64).exp();
                worst = worst.max(((e as f64 - want) / want).abs());
            }
            assert!(worst < 1e-6, "{isa:?}: relative error {worst}");
            let special = exp_with(
                isa,
                &[f32::NEG_INFINITY, -88.0, -100.0, -1e30, f32::NAN, 0.0],
            );
            assert_eq!(special, [0.0, 0.0, 0.0, 0.0, 0.0, 1.0], "{isa:?}");
        }
    }

    #[test]
    fn attention_vector_tanh_matches_std() {
        let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 / 200.0).collect();
        for isa in Isa::available() {
            let got = tanh_with(isa, &xs);
            for (&x, &t) in xs.iter().zip(&got) {
                let e = (t as f64 - (x as f64).tanh()).abs();
                assert!(e < 3e-7, "{isa:?}: tanh({x}) = {t}, error {e}");
            }
        }
    }

    /// Applies the ISA's vector exp (lanes padded with zeros).
    fn exp_with(isa: Isa, xs: &[f32]) -> Vec<f32> {
        map_with(isa, xs, false)
    }

    fn tanh_with(isa: Isa, xs: &[f32]) -> Vec<f32> {
        map_with(isa, xs, true)
    }

    fn map_with(isa: Isa, xs: &[f32], tanh: bool) -> Vec<f32> {
        /// # Safety: S's instruction set is available.
        unsafe fn go<S: Simd>(xs: &[f32], tanh: bool) -> Vec<f32> {
            let mut buf = xs.to_vec();
            buf.resize(xs.len().div_ceil(S::LANES) * S::LANES, 0.0);
            for c in buf.chunks_exact_mut(S::LANES) {
                // SAFETY: the chunk holds LANES values; the ISA is available (caller).
                unsafe {
                    let x = S::load(c.as_ptr());
                    let y = if tanh { tanh_v::<S>(x) } else { S::exp(x) };
                    S::store(c.as_mut_ptr(), y);
                }
            }
            buf.truncate(xs.len());
            buf
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if x86::Avx512::token().is_some() => {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                unsafe fn f(xs: &[f32], t: bool) -> Vec<f32> {
                    // SAFETY: enabled here, available per the token checked by the caller.
                    unsafe { go::<x86::Avx512>(xs, t) }
                }
                // SAFETY: the token exists, so AVX-512 is available.
                unsafe { f(xs, tanh) }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if x86::Avx2::token().is_some() => {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn f(xs: &[f32], t: bool) -> Vec<f32> {
                    // SAFETY: enabled here, available per the token checked by the caller.
                    unsafe { go::<x86::Avx2>(xs, t) }
                }
                // SAFETY: the token exists, so AVX2 + FMA are available.
                unsafe { f(xs, tanh) }
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon if arm::Neon::token().is_some() => {
                #[target_feature(enable = "neon")]
                unsafe fn f(xs: &[f32], t: bool) -> Vec<f32> {
                    // SAFETY: enabled here, available per the token checked by the caller.
                    unsafe { go::<arm::Neon>(xs, t) }
                }
                // SAFETY: the token exists, so NEON is available.
                unsafe { f(xs, tanh) }
            }
            // SAFETY: the scalar level needs nothing.
            _ => unsafe { go::<Scalar>(xs, tanh) },
        }
    }

    #[test]
    fn attention_reference_matches_hand_computation() {
        // One query, two keys, d = 2: weights softmax([q·k0, q·k1] · scale + mask).
        let q = [1.0, 2.0];
        let k = [1.0, 0.0, 0.0, 1.0];
        let v = [10.0, 20.0, 30.0, 40.0];
        let mut a = AttentionArgs {
            q: &q,
            k: &k,
            v: &v,
            q_strides: [2, 2, 2],
            k_strides: [4, 2, 2],
            v_strides: [4, 2, 2],
            batch: 1,
            q_len: 1,
            kv_len: 2,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 0.5,
            softcap: 0.0,
            mask: None,
        };
        let (s0, s1) = (0.5f64, 1.0f64);
        let w1 = s1.exp() / (s0.exp() + s1.exp());
        let want = [10.0 + 20.0 * w1, 20.0 + 20.0 * w1];
        let mask = [0.0, f32::NEG_INFINITY];
        for (mask, want) in [(None, want), (Some(&mask[..]), [10.0, 20.0])] {
            a.mask = mask;
            for got in [attention_reference(&a), attention(&a)] {
                let got = got.expect("valid arguments");
                for (g, w) in got.iter().zip(want) {
                    assert!((*g as f64 - w).abs() < 1e-5, "{got:?} vs {want:?}");
                }
            }
        }
        // Soft-capping: s = c · tanh(s / c).
        a.mask = None;
        a.softcap = 0.3;
        let (c0, c1) = (0.3 * (s0 / 0.3).tanh(), 0.3 * (s1 / 0.3).tanh());
        let w1 = c1.exp() / (c0.exp() + c1.exp());
        let got = attention_reference(&a).expect("valid arguments");
        assert!((got[0] as f64 - (10.0 + 20.0 * w1)).abs() < 1e-5, "{got:?}");
    }

    #[test]
    fn attention_prefill_causal() {
        check(&Case::new(1, 130, 130, (2, 2), 64));
        check(&Case::new(1, 100, 230, (3, 1), 64)); // causal offset 130, GQA 3
        check(&Case::new(2, 64, 128, (6, 2), 40)); // tile-aligned lengths
        check(&Case::new(1, 77, 77, (2, 1), 128));
        check(&Case::new(1, 9, 200, (3, 3), 72)); // just above the direct path
        check(&Case::new(1, 256, 600, (6, 2), 64)); // a chunk of new tokens after a cache
    }

    #[test]
    fn attention_decode() {
        for (kv, d) in [
            (1, 64),
            (63, 33),
            (64, 64),
            (65, 40),
            (300, 64),
            (700, 72),
            (2100, 64),
        ] {
            check(&Case::new(1, 1, kv, (3, 1), d));
            check(&Case::new(2, 1, kv, (4, 4), d).mask(Mask::None));
        }
    }

    #[test]
    fn attention_short_queries() {
        for q in 2..8 {
            check(&Case::new(2, q, 150 + q, (6, 2), 48));
        }
    }

    #[test]
    fn attention_odd_head_dims() {
        for d in [1, 7, 8, 9, 15, 16, 17, 33, 40, 72, 100] {
            check(&Case::new(1, 20, 90, (3, 1), d));
            check(&Case::new(1, 1, 90, (2, 1), d));
        }
    }

    #[test]
    fn attention_no_mask() {
        check(&Case::new(1, 70, 70, (2, 2), 64).mask(Mask::None));
        check(&Case::new(2, 30, 150, (3, 1), 33).mask(Mask::None)); // q_len < kv_len
        check(&Case::new(1, 90, 20, (2, 1), 16).mask(Mask::None)); // q_len > kv_len
    }

    #[test]
    fn attention_finite_and_non_causal_masks() {
        check(&Case::new(1, 90, 170, (3, 1), 64).mask(Mask::CausalBiased));
        check(&Case::new(2, 3, 100, (2, 2), 40).mask(Mask::CausalBiased));
        check(&Case::new(1, 50, 120, (2, 1), 24).mask(Mask::Finite));
        check(&Case::new(1, 1, 120, (3, 1), 24).mask(Mask::Finite));
        check(&Case::new(1, 100, 260, (2, 2), 64).mask(Mask::Window(37)));
        check(&Case::new(1, 4, 260, (3, 1), 64).mask(Mask::Window(70)));
    }

    #[test]
    fn attention_fully_masked_rows_are_zero() {
        for c in [
            Case::new(1, 40, 100, (2, 1), 32).mask(Mask::DeadRows),
            Case::new(1, 3, 100, (2, 1), 32).mask(Mask::DeadRows),
        ] {
            let want = check(&c);
            let x = build(&c);
            let a = args(&c, &x);
            for isa in Isa::available() {
                for plan in PLANS {
                    let got = attention_planned(isa, &a, plan).expect("valid arguments");
                    for (n, (row, want_row)) in got.chunks(c.d).zip(want.chunks(c.d)).enumerate() {
                        let i = n % c.q_len;
                        if i == 0 || i % 5 == 2 {
                            assert!(row.iter().all(|&y| y == 0.0), "{isa:?} {plan:?} row {i}");
                            assert!(want_row.iter().all(|&y| y == 0.0), "reference row {i}");
                        }
                    }
                }
            }
        }
        // No visible key at all (every row masked, or no keys).
        let mut c = Case::new(1, 5, 30, (2, 1), 16).mask(Mask::DeadRows);
        c.q_len = 1; // the only row is row 0: dead
        check(&c);
        let c = Case::new(1, 10, 0, (2, 1), 16).mask(Mask::None);
        let x = build(&c);
        let got = attention(&args(&c, &x)).expect("valid arguments");
        assert!(got.len() == 2 * 10 * 16 && got.iter().all(|&y| y == 0.0));
    }

    #[test]
    fn attention_strided_layouts() {
        let mut c = Case::new(2, 45, 110, (6, 2), 36);
        c.pad = 3;
        for layouts in [
            [Layout::Bshd, Layout::Bhsd, Layout::Bhsd],
            [Layout::Bhsd, Layout::Bshd, Layout::Bhsd],
            [Layout::Bshd, Layout::Bshd, Layout::Bshd],
        ] {
            check(&Case { layouts, ..c });
            check(&Case {
                layouts,
                q_len: 1,
                ..c
            });
        }
    }

    #[test]
    fn attention_softcap() {
        let mut c = Case::new(1, 60, 140, (3, 1), 40);
        c.softcap = 0.7;
        check(&c);
        check(&Case { q_len: 1, ..c });
        check(&Case {
            softcap: 30.0,
            mask: Mask::CausalBiased,
            ..c
        });
    }

    #[test]
    fn attention_random_shapes() {
        let mut rng = Rng(42);
        for seed in 0..12 {
            let n_kv = 1 + rng.below(2);
            let g = [1, 3][rng.below(2)];
            let q_len = [1, 1, 3, 1 + rng.below(90)][rng.below(4)];
            let kv_len = q_len + rng.below(150);
            let mut c = Case::new(
                1 + rng.below(2),
                q_len,
                kv_len,
                (n_kv * g, n_kv),
                1 + rng.below(80),
            );
            c.mask = [
                Mask::None,
                Mask::Causal,
                Mask::CausalBiased,
                Mask::Window(20),
            ][rng.below(4)];
            c.pad = rng.below(3);
            c.layouts = [
                Layout::Bshd,
                [Layout::Bshd, Layout::Bhsd][rng.below(2)],
                Layout::Bhsd,
            ];
            c.softcap = [0.0, 0.0, 2.0][rng.below(3)];
            c.seed = seed;
            check(&c);
        }
    }

    #[test]
    fn attention_inconsistent_arguments_give_none() {
        let c = Case::new(1, 4, 8, (4, 2), 8);
        let x = build(&c);
        let good = args(&c, &x);
        assert!(attention(&good).is_some());
        let bad = [
            AttentionArgs {
                n_kv_heads: 3,
                ..good
            },
            AttentionArgs {
                n_kv_heads: 0,
                ..good
            },
            AttentionArgs {
                q: &x.q[1..],
                ..good
            },
            AttentionArgs {
                k: &x.k[..x.k.len() - 1],
                ..good
            },
            AttentionArgs { v: &[], ..good },
            AttentionArgs {
                head_dim: 9,
                ..good
            },
            AttentionArgs { kv_len: 9, ..good },
            AttentionArgs {
                mask: Some(&[0.0; 31]),
                ..good
            },
            AttentionArgs {
                q_strides: [1, usize::MAX, 1],
                ..good
            },
            AttentionArgs {
                batch: usize::MAX,
                ..good
            },
        ];
        for (n, a) in bad.iter().enumerate() {
            assert!(attention_reference(a).is_none(), "case {n}");
            for isa in Isa::available() {
                assert!(attention_with(isa, a).is_none(), "case {n} {isa:?}");
            }
        }
        // Empty outputs are fine.
        let empty = AttentionArgs {
            q_len: 0,
            mask: None,
            ..good
        };
        assert_eq!(attention(&empty), Some(Vec::new()));
    }

    #[test]
    fn attention_isa_above_detected_falls_back() {
        let c = Case::new(1, 20, 50, (3, 1), 24);
        let x = build(&c);
        let a = args(&c, &x);
        let best = attention_with(cpu::detect(), &a);
        assert_eq!(attention_with(Isa::Avx512, &a), best);
        assert_eq!(attention(&a), attention_with(cpu::isa(), &a));
    }

    /// `cargo test -p docent-kernels --lib attention_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn attention_timing() {
        let time = |c: &Case, isa: Isa, reps: usize| {
            let x = build(c);
            let a = args(c, &x);
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t = std::time::Instant::now();
                let out = attention_with(isa, &a).expect("valid arguments");
                best = best.min(t.elapsed().as_secs_f64() * 1e3);
                std::hint::black_box(out);
            }
            best
        };
        let mut prefill = Case::new(1, 1200, 1200, (9, 3), 64);
        prefill.layouts = [Layout::Bshd, Layout::Bhsd, Layout::Bhsd];
        let chunk = Case {
            q_len: 256,
            kv_len: 856,
            ..prefill
        };
        let decode = Case {
            q_len: 1,
            ..prefill
        };
        println!("threads: {}", rayon::current_num_threads());
        for isa in Isa::available() {
            println!(
                "{:>9}: prefill 1200 {:8.3} ms | 256 after 600 {:8.3} ms | decode 1x1200 {:7.4} ms",
                isa.name(),
                time(&prefill, isa, 10),
                time(&chunk, isa, 10),
                time(&decode, isa, 200),
            );
        }
    }
}
