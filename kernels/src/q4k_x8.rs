//! Q4_K with eight weight rows interleaved: one layout for decode, drafts and prefill.
//!
//! In GGUF's row layout each Q4_K block carries its own packed six-bit scales and mins,
//! unpacked one row at a time, and each 32-element product ends in a multiply by that row's
//! scale. Here the blocks of eight consecutive rows sit together (idea from ggml's
//! `block_q4_Kx8`; the byte layout below is docent's own), so one register holds four bytes
//! of each of the eight rows, an activation load serves eight rows, and the scales, mins and
//! block scales of eight rows are vectors with one row per 32-bit lane. The kernels take one
//! group against a tile of activation rows: the group's nibbles are unpacked into registers
//! once and serve every row of the tile (up to four with AVX2, whose products of a
//! sub-block add up in 16 bits; up to eight with AVX-512 VNNI, whose `vpdpbusd` adds them in
//! 32 bits). The output of eight rows is one register, stored once.
//!
//! The layout is lossless and the same size as the rows it replaces (1,152 bytes per eight
//! 256-element blocks), so a model's tensor keeps its shape and byte count; only docent's
//! kernels can read it ([`ID`] tells them). [`deinterleave`] gives the GGUF rows back, byte
//! for byte: below AVX2 the matmul unpacks a task's rows into cache-sized scratch and runs
//! the row kernels.
//!
//! One 1,152-byte group (rows `8g..8g + 8`, 256-block `b`):
//! - `0..16`: the eight rows' `d` (f16), `16..32`: their `dmin` (f16);
//! - `32..128`: the 128 six-bit values `U` (per pair `p` of sub-blocks `2p, 2p + 1`: 16
//!   scales as `[row][sub-block]`, then 16 mins the same way), packed as 64 bytes of low
//!   nibbles (`U[i]` and `U[i + 64]`) and 32 bytes of high bit pairs (`U[i]`, `U[i + 32]`,
//!   `U[i + 64]`, `U[i + 96]`): one 32-byte register of `U` per pair after a few shifts;
//! - `128..1152`: the nibbles, `256p + 32k + 4r + t` ← byte `32p + 4k + t` of row `r`'s block
//!   (its low nibble is element `64p + 4k + t`, its high nibble element `64p + 32 + 4k + t`).

use crate::cpu::Isa;
use crate::quant::{q4k_scale_min, Format};

/// The layout's id where a GGML type id is expected (not a GGML type: no other code reads it).
pub const ID: u32 = 0x0001_000C;
/// One activation row in Q8_K: `qs`, a scale per 256-block, 16 `bsums` per block.
pub(crate) type Q8k<'a> = (&'a [i8], &'a [f32], &'a [i16]);

/// Rows per group.
pub const ROWS: usize = 8;
/// Bytes of one group's 256-block (eight Q4_K blocks).
pub const GROUP_BLOCK_BYTES: usize = ROWS * 144;

/// Whether this instruction set has the layout's kernels ([`gemm`]); below it the
/// matmul unpacks the rows again, so the layout only pays where this holds.
pub fn has_kernel(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa >= Isa::Avx2
}

/// Whether a Q4_K matrix of this shape can be interleaved.
pub fn fits(rows: usize, cols: usize, bytes: usize) -> bool {
    rows > 0
        && rows.is_multiple_of(ROWS)
        && cols.is_multiple_of(256)
        && Format::Q4K
            .row_bytes(cols)
            .is_some_and(|rb| rb * rows == bytes)
}

/// GGUF Q4_K rows → the interleaved layout. `None` when the shape does not [`fits`].
pub fn interleave(rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    if !fits(rows, cols, data.len()) {
        return None;
    }
    let nb = cols / 256;
    let rb = nb * 144;
    let mut out = vec![0u8; data.len()];
    for g in 0..rows / ROWS {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
            let mut u = [0u8; 128];
            for r in 0..ROWS {
                let blk = &data[(ROWS * g + r) * rb + b * 144..][..144];
                dst[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                for j in 0..8 {
                    let (s, m) = q4k_scale_min(j, &blk[4..16]);
                    let (p, h) = (j / 2, j % 2);
                    u[32 * p + 2 * r + h] = s;
                    u[32 * p + 16 + 2 * r + h] = m;
                }
                for p in 0..4 {
                    for k in 0..8 {
                        let from = 16 + 32 * p + 4 * k;
                        let to = 128 + 256 * p + 32 * k + 4 * r;
                        dst[to..to + 4].copy_from_slice(&blk[from..from + 4]);
                    }
                }
            }
            for i in 0..64 {
                dst[32 + i] = (u[i] & 15) | ((u[i + 64] & 15) << 4);
            }
            for i in 0..32 {
                dst[96 + i] = (u[i] >> 4)
                    | ((u[i + 32] >> 4) << 2)
                    | ((u[i + 64] >> 4) << 4)
                    | ((u[i + 96] >> 4) << 6);
            }
        }
    }
    Some(out)
}

/// The 128 six-bit values of a group's block (see the module's layout).
fn unpacked(dst: &[u8]) -> [u8; 128] {
    let mut u = [0u8; 128];
    for i in 0..64 {
        let (l, h) = (dst[32 + i], dst[96 + i % 32]);
        let shift = if i < 32 { 0 } else { 2 };
        u[i] = (l & 15) | (((h >> shift) & 3) << 4);
        u[i + 64] = (l >> 4) | (((h >> (shift + 4)) & 3) << 4);
    }
    u
}

/// Groups `g0..g1` of an interleaved matrix (`cols` wide) back to GGUF Q4_K rows
/// `8·g0..8·g1`, written into `out` (resized), byte for byte what [`interleave`] read.
pub fn deinterleave(data: &[u8], cols: usize, g0: usize, g1: usize, out: &mut Vec<u8>) {
    let nb = cols / 256;
    let rb = nb * 144;
    out.clear();
    out.resize((g1 - g0) * ROWS * rb, 0);
    for g in g0..g1 {
        for b in 0..nb {
            let src = &data[(g * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
            let u = unpacked(src);
            for r in 0..ROWS {
                let blk = &mut out[((g - g0) * ROWS + r) * rb + b * 144..][..144];
                blk[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
                blk[2..4].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
                let (mut s, mut m) = ([0u8; 8], [0u8; 8]);
                for j in 0..8 {
                    let (p, h) = (j / 2, j % 2);
                    s[j] = u[32 * p + 2 * r + h];
                    m[j] = u[32 * p + 16 + 2 * r + h];
                }
                let q = &mut blk[4..16];
                for j in 0..4 {
                    q[j] = (s[j] & 63) | ((s[j + 4] >> 4) << 6);
                    q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
                    q[j + 8] = (s[j + 4] & 15) | ((m[j + 4] & 15) << 4);
                }
                for p in 0..4 {
                    for k in 0..8 {
                        let from = 128 + 256 * p + 32 * k + 4 * r;
                        let to = 16 + 32 * p + 4 * k;
                        blk[to..to + 4].copy_from_slice(&src[from..from + 4]);
                    }
                }
            }
        }
    }
}

/// The frame of a layout's `deinterleave` ([`crate::q6k_x8`], [`crate::q5_0_x8`]): groups
/// `g0..g1` of an interleaved matrix with `nb` blocks per row and `group_block` bytes per
/// group block, as rows of `row_block` bytes per block, written into `out` (resized);
/// `f(src, r, blk)` fills row `r`'s block `blk` from its group block `src`.
#[allow(clippy::too_many_arguments)] // the shape of the two layouts, then the work
pub(crate) fn ungroup(
    data: &[u8],
    nb: usize,
    group_block: usize,
    row_block: usize,
    (g0, g1): (usize, usize),
    out: &mut Vec<u8>,
    mut f: impl FnMut(&[u8], usize, &mut [u8]),
) {
    let rb = nb * row_block;
    out.clear();
    out.resize((g1 - g0) * ROWS * rb, 0);
    for g in g0..g1 {
        for b in 0..nb {
            let src = &data[(g * nb + b) * group_block..][..group_block];
            for r in 0..ROWS {
                let at = ((g - g0) * ROWS + r) * rb + b * row_block;
                f(src, r, &mut out[at..at + row_block]);
            }
        }
    }
}

/// `len` activation rows as pieces `(start, count)` of powers of two, at most `largest`
/// (itself a power of two), largest first: the kernels keep a piece's accumulators in
/// registers, so each count is its own instantiation (this layout's and [`crate::q6k_x8`]'s).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn pieces(len: usize, largest: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut start = 0;
    std::iter::from_fn(move || {
        let left = len - start;
        (left > 0).then(|| {
            let n = largest.min(1 << left.ilog2());
            start += n;
            (start - n, n)
        })
    })
}

/// The kernels of the layout on x86-64.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AVX2: tiles of up to four activation rows, sub-block sums in 16 bits.
    Avx2,
    /// AVX-512 VNNI: tiles of up to eight activation rows (the sixteen
    /// nibble registers stay in the 32 vector registers, accumulators that do not fit go to
    /// L1), sub-block sums by `vpdpbusd` in 32 bits.
    Vnni,
}

/// One group (`cols / 256` blocks of eight rows, `w`) against the activation rows `acts`:
/// the eight results of activation row `i` go to `out[i * stride..i * stride + 8]`.
///
/// # Safety
/// The processor has `kernel`'s instructions (AVX2, FMA, F16C; for [`Kernel::Vnni`] also
/// [`avx512::available`]); `w` holds one group of `cols / 256` blocks; each activation holds
/// `cols` values, `cols / 256` scales and `cols / 16` bsums; `out` is valid for writes at
/// every `i * stride + r` (`i < acts.len()`, `r < 8`), which nothing else reads or writes
/// meanwhile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm(
    kernel: Kernel,
    w: &[u8],
    cols: usize,
    acts: &[Q8k<'_>],
    out: *mut f32,
    stride: usize,
) {
    let largest = if kernel == Kernel::Vnni { 8 } else { 4 };
    for (i, n) in pieces(acts.len(), largest) {
        let (a, o) = (&acts[i..i + n], out.add(i * stride));
        match (kernel, n) {
            (Kernel::Vnni, 8) => avx512::tile::<8>(w, cols, a, o, stride),
            (Kernel::Vnni, 4) => avx512::tile::<4>(w, cols, a, o, stride),
            (Kernel::Vnni, 2) => avx512::tile::<2>(w, cols, a, o, stride),
            (Kernel::Vnni, _) => avx512::tile::<1>(w, cols, a, o, stride),
            (Kernel::Avx2, 4) => avx2::tile::<4>(w, cols, a, o, stride),
            (Kernel::Avx2, 2) => avx2::tile::<2>(w, cols, a, o, stride),
            (Kernel::Avx2, _) => avx2::tile::<1>(w, cols, a, o, stride),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // activation rows and their accumulators side by side
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{Q8k, GROUP_BLOCK_BYTES};

    /// A group block's six-bit scales and mins: `U[32p..32p + 32]` for pair `p`, one per byte
    /// (16 scales as `[row][sub-block]`, then 16 mins).
    #[inline(always)]
    pub(crate) unsafe fn scales_mins(blk: *const u8) -> [__m256i; 4] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let l0 = _mm256_loadu_si256(blk.add(32) as *const __m256i);
        let l1 = _mm256_loadu_si256(blk.add(64) as *const __m256i);
        let h = _mm256_loadu_si256(blk.add(96) as *const __m256i);
        [
            _mm256_or_si256(
                _mm256_and_si256(l0, m4),
                _mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(l1, m4),
                _mm256_and_si256(_mm256_slli_epi16(h, 2), m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                _mm256_and_si256(h, m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(h, 2), m30),
            ),
        ]
    }

    /// The mins' part of a group block for each activation row: per weight row (32-bit lane)
    /// the sum over the eight sub-blocks of its min times the activations' sub-block sum.
    #[inline(always)]
    pub(crate) unsafe fn mins_block<const N: usize>(
        u: &[__m256i; 4],
        b: usize,
        acts: &[Q8k<'_>],
    ) -> [__m256i; N] {
        let mut summ = [_mm256_setzero_si256(); N];
        for i in 0..N {
            // the activations' sub-block sums, as four pairs (one per 32-bit lane)
            let bs = acts.get_unchecked(i).2.as_ptr().add(16 * b);
            let sub = _mm_hadd_epi16(
                _mm_loadu_si128(bs as *const __m128i),
                _mm_loadu_si128(bs.add(8) as *const __m128i),
            );
            for (p, &up) in u.iter().enumerate() {
                let mn = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(up, 1));
                let pair = _mm256_set1_epi32(match p {
                    0 => _mm_extract_epi32(sub, 0),
                    1 => _mm_extract_epi32(sub, 1),
                    2 => _mm_extract_epi32(sub, 2),
                    _ => _mm_extract_epi32(sub, 3),
                });
                summ[i] = _mm256_add_epi32(summ[i], _mm256_madd_epi16(mn, pair));
            }
        }
        summ
    }

    /// The end of a group block: each activation row's integer sums times the block scales
    /// (`d` of the eight rows times the row's own), added to its accumulators.
    #[inline(always)]
    pub(crate) unsafe fn scale_block<const N: usize>(
        blk: *const u8,
        b: usize,
        acts: &[Q8k<'_>],
        sumi: &[__m256i; N],
        summ: &[__m256i; N],
        acc: &mut [__m256; N],
        accm: &mut [__m256; N],
    ) {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
        for i in 0..N {
            let dy = _mm256_set1_ps(*acts.get_unchecked(i).1.get_unchecked(b));
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dy), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
            accm[i] = _mm256_fmadd_ps(
                _mm256_mul_ps(dmin, dy),
                _mm256_cvtepi32_ps(summ[i]),
                accm[i],
            );
        }
    }

    /// The eight results of each activation row `i`, to `o[i * stride..]`.
    #[inline(always)]
    pub(crate) unsafe fn store<const N: usize>(
        o: *mut f32,
        stride: usize,
        acc: &[__m256; N],
        accm: &[__m256; N],
    ) {
        for i in 0..N {
            _mm256_storeu_ps(o.add(i * stride), _mm256_sub_ps(acc[i], accm[i]));
        }
    }

    /// [`super::gemm`] with AVX2 for exactly `N` activation rows: each sub-block's nibbles
    /// are unpacked into eight registers once and serve the `N` rows (up to four; the
    /// unpacking costs about as much as one row's products).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present, `acts.len() == N`, and what [`super::gemm`]
    /// asks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn tile<const N: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Q8k<'_>],
        o: *mut f32,
        stride: usize,
    ) {
        let nb = cols / 256;
        debug_assert!(acts.len() == N && w.len() >= nb * GROUP_BLOCK_BYTES);
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut accm = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(b * GROUP_BLOCK_BYTES);
            let u = scales_mins(blk);
            let summ = mins_block::<N>(&u, b, acts);
            let mut sumi = [_mm256_setzero_si256(); N];
            for (p, &up) in u.iter().enumerate() {
                let sc = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(up));
                let q = blk.add(128 + 256 * p);
                // h = 0: the low nibbles (sub-block 2p), h = 1: the high (2p + 1)
                for h in 0..2 {
                    let s = if h == 0 {
                        _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc, 0xA0), 0xA0)
                    } else {
                        _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc, 0xF5), 0xF5)
                    };
                    let mut wq = [_mm256_setzero_si256(); 8];
                    for (k, x) in wq.iter_mut().enumerate() {
                        let v = _mm256_loadu_si256(q.add(32 * k) as *const __m256i);
                        let v = if h == 0 { v } else { _mm256_srli_epi16(v, 4) };
                        *x = _mm256_and_si256(v, m4);
                    }
                    for i in 0..N {
                        let ap = acts
                            .get_unchecked(i)
                            .0
                            .as_ptr()
                            .add(256 * b + 64 * p + 32 * h);
                        let mut t = _mm256_setzero_si256();
                        for (k, &x) in wq.iter().enumerate() {
                            let a =
                                _mm256_set1_epi32((ap.add(4 * k) as *const i32).read_unaligned());
                            // 16 products of ≤ 15 · 127 per 16-bit lane: no overflow
                            t = _mm256_add_epi16(t, _mm256_maddubs_epi16(x, a));
                        }
                        sumi[i] = _mm256_add_epi32(sumi[i], _mm256_madd_epi16(t, s));
                    }
                }
            }
            scale_block(blk, b, acts, &sumi, &summ, &mut acc, &mut accm);
        }
        store(o, stride, &acc, &accm);
    }
}

/// With AVX-512 VNNI: one group against several activation rows at once. A pair of
/// sub-blocks' nibbles is unpacked into sixteen registers once and serves every activation
/// row of the tile (the AVX2 [`avx2::tile`] does so for up to four), and `vpdpbusd`
/// adds four products per 32-bit lane, so a lane holds its row's whole sub-block sum with no
/// 16-bit stage.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // activation rows and their accumulators side by side
pub(crate) mod avx512 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use super::avx2::{mins_block, scale_block, scales_mins, store};
    use super::{Q8k, GROUP_BLOCK_BYTES};

    /// Whether the processor has the instructions [`tile`] needs.
    pub(crate) fn available() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }

    /// [`super::gemm`] with AVX-512 VNNI for exactly `N` activation rows.
    ///
    /// # Safety
    /// [`available`] holds, `acts.len() == N`, and what [`super::gemm`] asks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn tile<const N: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Q8k<'_>],
        o: *mut f32,
        stride: usize,
    ) {
        let nb = cols / 256;
        debug_assert!(acts.len() == N && w.len() >= nb * GROUP_BLOCK_BYTES);
        let m4 = _mm256_set1_epi8(0x0F);
        let lo16 = _mm256_set1_epi32(0xFFFF);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut accm = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(b * GROUP_BLOCK_BYTES);
            let u = scales_mins(blk);
            let summ = mins_block::<N>(&u, b, acts);
            let mut sumi = [_mm256_setzero_si256(); N];
            for (p, &up) in u.iter().enumerate() {
                // per row (32-bit lane): scale 2p in the low half, 2p + 1 in the high half
                let sc = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(up));
                let (sc_lo, sc_hi) = (_mm256_and_si256(sc, lo16), _mm256_srli_epi32(sc, 16));
                let q = blk.add(128 + 256 * p);
                let mut lo = [_mm256_setzero_si256(); 8];
                let mut hi = [_mm256_setzero_si256(); 8];
                for k in 0..8 {
                    let v = _mm256_loadu_si256(q.add(32 * k) as *const __m256i);
                    lo[k] = _mm256_and_si256(v, m4);
                    hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                for i in 0..N {
                    let ap = acts.get_unchecked(i).0.as_ptr().add(256 * b + 64 * p);
                    let mut sl = _mm256_setzero_si256();
                    let mut sh = _mm256_setzero_si256();
                    for k in 0..8 {
                        let al = _mm256_set1_epi32((ap.add(4 * k) as *const i32).read_unaligned());
                        let ah =
                            _mm256_set1_epi32((ap.add(32 + 4 * k) as *const i32).read_unaligned());
                        sl = _mm256_dpbusd_epi32(sl, lo[k], al);
                        sh = _mm256_dpbusd_epi32(sh, hi[k], ah);
                    }
                    sumi[i] = _mm256_add_epi32(
                        sumi[i],
                        _mm256_add_epi32(
                            _mm256_mullo_epi32(sl, sc_lo),
                            _mm256_mullo_epi32(sh, sc_hi),
                        ),
                    );
                }
            }
            scale_block(blk, b, acts, &sumi, &summ, &mut acc, &mut accm);
        }
        store(o, stride, &acc, &accm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::{random_row, Rng};

    #[test]
    fn interleaving_round_trips_byte_for_byte() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (rows, cols) = (24, 512);
        let data: Vec<u8> = (0..rows)
            .flat_map(|_| random_row(&mut rng, Format::Q4K, cols))
            .collect();
        let x = interleave(rows, cols, &data).expect("fits");
        assert_eq!(x.len(), data.len());
        assert_ne!(x, data, "the layout moves bytes");
        let mut back = Vec::new();
        deinterleave(&x, cols, 0, rows / ROWS, &mut back);
        assert_eq!(back, data);
        // a range of groups gives those rows
        deinterleave(&x, cols, 1, 3, &mut back);
        let rb = cols / 256 * 144;
        assert_eq!(back, data[8 * rb..24 * rb]);
    }

    #[test]
    fn activation_rows_split_into_powers_of_two() {
        let p = |len, largest| pieces(len, largest).collect::<Vec<_>>();
        assert_eq!(p(0, 8), []);
        assert_eq!(p(1, 8), [(0, 1)]);
        assert_eq!(p(7, 8), [(0, 4), (4, 2), (6, 1)]);
        assert_eq!(p(16, 8), [(0, 8), (8, 8)]);
        assert_eq!(p(13, 4), [(0, 4), (4, 4), (8, 4), (12, 1)]);
        assert_eq!(p(17, 8), [(0, 8), (8, 8), (16, 1)]);
        assert_eq!(p(7, 4), [(0, 4), (4, 2), (6, 1)]);
    }

    #[test]
    fn shapes_that_do_not_fit_are_declined() {
        assert!(interleave(12, 256, &[0u8; 12 * 144]).is_none());
        assert!(interleave(8, 256, &[0u8; 7 * 144]).is_none());
        assert!(interleave(8, 300, &[0u8; 8 * 144]).is_none());
    }
}
