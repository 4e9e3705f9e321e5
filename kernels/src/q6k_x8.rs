//! Q6_K with eight weight rows interleaved: [`crate::q4k_x8`]'s idea for Q6_K weights.
//!
//! In GGUF's row layout a Q6_K block keeps each six-bit value's low four bits in `ql` and its
//! high two in `qh`, spread so that the AVX2 row kernel spends 21 shifts, masks and ors on
//! every four registers of values, and its sixteen signed scales are broadcast one at a time.
//! Here the blocks of eight consecutive rows sit together (docent's own byte layout): a
//! 32-byte register holds four consecutive values of each of the eight rows (one row per
//! 32-bit lane), so one four-byte activation load serves eight rows, and the scales of eight
//! rows are a vector with one row per lane. Each value sits whole in the low six bits of a
//! byte, and every three such bytes carry a fourth value in their top two bits: three loads
//! give four registers of values in eleven operations (nine with AVX-512's ternary logic).
//!
//! The kernels take one group against a tile of activation rows (up to four with AVX2, eight
//! with AVX-512): a group's four registers of values (16 per row) are unpacked once and serve
//! every row of the tile. With AVX2 a product's 16-bit pairs (`vpmaddubsw`, values 0..63 times activations up
//! to ±127) are added two registers at a time and widened by a multiply-add with the group's
//! scales; with AVX-512 VNNI `vpdpbusd` sums a group's 16 products per row in 32 bits and one
//! multiply applies the scales (AVX-512 without VNNI runs the AVX2 arithmetic with the
//! ternary-logic unpacking and twice the registers). The values are stored as `q + 32`
//! (0..63, as in GGUF), so `32 · Σ scale · (the activations' group sum)` comes off each
//! block's sum; the Q8_K activations carry those sums (`bsums`). The output of eight rows is
//! one register, stored once.
//!
//! The layout is lossless and the same size as the rows it replaces (1,680 bytes per eight
//! 256-element blocks), so a model's tensor keeps its shape and byte count; only docent's
//! kernels can read it ([`ID`] tells them). [`deinterleave`] gives the GGUF rows back, byte
//! for byte: below AVX2 the matmul unpacks a task's rows into cache-sized scratch and runs
//! the row kernels.
//!
//! On the 2-core Zen 4 machine (EPYC 9004, AVX-512 VNNI; a noisy VM, medians of repeated
//! runs), decode from memory streamed Q6_K at 22–27 GB/s interleaved against 12–16 GB/s as
//! rows for Qwen2.5-1.5B's 8960 × 1536 and 151936 × 1536 (17–21 against 14–17 for its
//! 1536 × 8960), as fast as interleaved Q4_K on the same shapes; 64-row prefill ran at
//! 190–237 GFLOP/s against 110–123 with AVX-512, 138–168 against 69–76 with AVX2
//! (`cargo bench -p docent-kernels -- '8960x1536*28' Q6_K`).
//!
//! One 1,680-byte group block (rows `8g..8g + 8`, 256-block `b`), with `v` a row's 256 stored
//! six-bit values (GGUF's `ql`/`qh` put together, element order):
//! - `0..16`: the eight rows' `d` (f16);
//! - `16..144`: the scales (i8), `16 + 16p + 2r + h` ← scale `2p + h` of row `r`: one 16-byte
//!   load widened to 16 bits is a register with row `r`'s scales of groups `2p`, `2p + 1` in
//!   the two halves of lane `r`;
//! - `144..1680`: the values, 96 bytes per group `j` of 16 (`0..16`): byte
//!   `144 + 96j + 32k + 4r + t` (`k < 3`, `t < 4`) holds `v[16j + 4k + t]` of row `r` in its
//!   low six bits, and bits `2k, 2k + 1` of `v[16j + 12 + t]` in its top two.

use crate::cpu::Isa;
// One activation row in Q8_K, as q4k_x8's kernels take it: `qs`, a scale per 256-block,
// 16 `bsums` per block.
#[cfg(target_arch = "x86_64")]
use crate::q4k_x8::Q8k;
use crate::quant::Format;

/// The layout's id where a GGML type id is expected (not a GGML type: no other code reads it).
pub const ID: u32 = 0x0001_000E;

/// Rows per group.
pub const ROWS: usize = 8;
/// Bytes of one group's 256-block (eight Q6_K blocks).
pub const GROUP_BLOCK_BYTES: usize = ROWS * 210;
/// Where a group block's scales start.
const SCALES: usize = 16;
/// Where a group block's values start.
const VALUES: usize = 144;

/// Whether this instruction set has the layout's kernels ([`gemm`]); below it the
/// matmul unpacks the rows again, so the layout only pays where this holds.
pub fn has_kernel(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa >= Isa::Avx2
}

/// Whether a Q6_K matrix of this shape can be interleaved.
pub fn fits(rows: usize, cols: usize, bytes: usize) -> bool {
    rows > 0
        && rows.is_multiple_of(ROWS)
        && cols.is_multiple_of(256)
        && Format::Q6K
            .row_bytes(cols)
            .is_some_and(|rb| rb * rows == bytes)
}

/// The 256 six-bit values (0..63, `q + 32`) of a GGUF Q6_K block, in element order.
fn values_of(blk: &[u8]) -> [u8; 256] {
    let mut v = [0u8; 256];
    for half in 0..2 {
        let (ql, qh) = (&blk[64 * half..], &blk[128 + 32 * half..]);
        let v = &mut v[128 * half..];
        for l in 0..32 {
            let h = qh[l];
            v[l] = (ql[l] & 15) | ((h & 3) << 4);
            v[l + 32] = (ql[l + 32] & 15) | (((h >> 2) & 3) << 4);
            v[l + 64] = (ql[l] >> 4) | (((h >> 4) & 3) << 4);
            v[l + 96] = (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4);
        }
    }
    v
}

/// [`values_of`] undone: a block's `ql` and `qh` (its bytes `0..192`) from its values.
fn pack_values(v: &[u8; 256], blk: &mut [u8]) {
    for half in 0..2 {
        let v = &v[128 * half..];
        for l in 0..32 {
            blk[64 * half + l] = (v[l] & 15) | ((v[l + 64] & 15) << 4);
            blk[64 * half + l + 32] = (v[l + 32] & 15) | ((v[l + 96] & 15) << 4);
            blk[128 + 32 * half + l] = (v[l] >> 4)
                | ((v[l + 32] >> 4) << 2)
                | ((v[l + 64] >> 4) << 4)
                | ((v[l + 96] >> 4) << 6);
        }
    }
}

/// GGUF Q6_K rows → the interleaved layout. `None` when the shape does not [`fits`].
pub fn interleave(rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    if !fits(rows, cols, data.len()) {
        return None;
    }
    let nb = cols / 256;
    let rb = nb * 210;
    let mut out = vec![0u8; data.len()];
    for g in 0..rows / ROWS {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
            for r in 0..ROWS {
                let blk = &data[(ROWS * g + r) * rb + b * 210..][..210];
                dst[2 * r..2 * r + 2].copy_from_slice(&blk[208..210]);
                for s in 0..16 {
                    dst[SCALES + 16 * (s / 2) + 2 * r + s % 2] = blk[192 + s];
                }
                let v = values_of(blk);
                for j in 0..16 {
                    for k in 0..3 {
                        for t in 0..4 {
                            let top = (v[16 * j + 12 + t] >> (2 * k)) & 3;
                            dst[VALUES + 96 * j + 32 * k + 4 * r + t] =
                                v[16 * j + 4 * k + t] | (top << 6);
                        }
                    }
                }
            }
        }
    }
    Some(out)
}

/// Groups `g0..g1` of an interleaved matrix (`cols` wide) back to GGUF Q6_K rows
/// `8·g0..8·g1`, written into `out` (resized), byte for byte what [`interleave`] read.
pub fn deinterleave(data: &[u8], cols: usize, g0: usize, g1: usize, out: &mut Vec<u8>) {
    let block = (GROUP_BLOCK_BYTES, 210);
    crate::q4k_x8::ungroup(
        data,
        cols / 256,
        block.0,
        block.1,
        (g0, g1),
        out,
        |src, r, blk| {
            blk[208..210].copy_from_slice(&src[2 * r..2 * r + 2]);
            for s in 0..16 {
                blk[192 + s] = src[SCALES + 16 * (s / 2) + 2 * r + s % 2];
            }
            let mut v = [0u8; 256];
            for j in 0..16 {
                for k in 0..3 {
                    for t in 0..4 {
                        let byte = src[VALUES + 96 * j + 32 * k + 4 * r + t];
                        v[16 * j + 4 * k + t] = byte & 63;
                        v[16 * j + 12 + t] |= (byte >> 6) << (2 * k);
                    }
                }
            }
            pack_values(&v, blk);
        },
    );
}

/// The kernels of the layout on x86-64.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AVX2: tiles of up to four activation rows, a group's products added in 16 bits two
    /// registers at a time, then widened by a multiply-add with the scales.
    Avx2,
    /// AVX-512 F/BW/VL without VNNI: the AVX2 arithmetic, the values unpacked with ternary
    /// logic, tiles of up to eight activation rows (32 vector registers).
    Avx512,
    /// AVX-512 VNNI: tiles of up to eight activation rows, a group's sums by `vpdpbusd` in
    /// 32 bits, one multiply by the scales per group.
    Vnni,
}

/// The layout's kernel at this instruction-set level (capped at what the processor has), or
/// `None` below AVX2.
#[cfg(target_arch = "x86_64")]
pub(crate) fn kernel(isa: Isa) -> Option<Kernel> {
    if !has_kernel(isa) {
        None
    } else if isa < Isa::Avx512 {
        Some(Kernel::Avx2)
    } else if crate::q4k_x8::avx512::available() {
        Some(Kernel::Vnni)
    } else {
        Some(Kernel::Avx512)
    }
}

/// One group (`cols / 256` blocks of eight rows, `w`) against the activation rows `acts`:
/// the eight results of activation row `i` go to `out[i * stride..i * stride + 8]`.
///
/// # Safety
/// The processor has `kernel`'s instructions (AVX2, FMA, F16C; for [`Kernel::Avx512`] also
/// AVX-512 F/BW/VL, for [`Kernel::Vnni`] also AVX-512 VNNI: what [`kernel`] picks); `w` holds
/// one group of `cols / 256` blocks; each activation holds `cols` values, `cols / 256` scales
/// and `cols / 16` bsums; `out` is valid for writes at every `i * stride + r`
/// (`i < acts.len()`, `r < 8`), which nothing else reads or writes meanwhile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm(
    kernel: Kernel,
    w: &[u8],
    cols: usize,
    acts: &[Q8k<'_>],
    out: *mut f32,
    stride: usize,
) {
    let largest = if kernel == Kernel::Avx2 { 4 } else { 8 };
    for (i, n) in crate::q4k_x8::pieces(acts.len(), largest) {
        let (a, o) = (&acts[i..i + n], out.add(i * stride));
        match (kernel, n) {
            (Kernel::Vnni, 8) => avx512::tile_vnni::<8>(w, cols, a, o, stride),
            (Kernel::Vnni, 4) => avx512::tile_vnni::<4>(w, cols, a, o, stride),
            (Kernel::Vnni, 2) => avx512::tile_vnni::<2>(w, cols, a, o, stride),
            (Kernel::Vnni, _) => avx512::tile_vnni::<1>(w, cols, a, o, stride),
            (Kernel::Avx512, 8) => avx512::tile_bw::<8>(w, cols, a, o, stride),
            (Kernel::Avx512, 4) => avx512::tile_bw::<4>(w, cols, a, o, stride),
            (Kernel::Avx512, 2) => avx512::tile_bw::<2>(w, cols, a, o, stride),
            (Kernel::Avx512, _) => avx512::tile_bw::<1>(w, cols, a, o, stride),
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

    use super::{Q8k, GROUP_BLOCK_BYTES, SCALES, VALUES};

    /// A group block's scales as eight registers: pair `p`'s lane `r` holds row `r`'s scales
    /// of groups `2p` (low half) and `2p + 1` (high half) as i16.
    #[inline(always)]
    pub(crate) unsafe fn scale_pairs(blk: *const u8) -> [__m256i; 8] {
        let mut sp = [_mm256_setzero_si256(); 8];
        for (p, s) in sp.iter_mut().enumerate() {
            *s = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(SCALES + 16 * p) as *const __m128i));
        }
        sp
    }

    /// The `pshufb` patterns that copy, in each 32-bit lane, the low (`[0]`: group `2p`) or
    /// the high (`[1]`: group `2p + 1`) 16-bit scale of a [`scale_pairs`] register into both
    /// halves.
    #[inline(always)]
    pub(crate) unsafe fn scale_picks() -> [__m256i; 2] {
        // byte indices within each 128-bit half: lane r' takes bytes 4r', 4r' + 1 (the low
        // scale) or 4r' + 2, 4r' + 3 (the high one), twice
        #[rustfmt::skip]
        let (lo, hi) = (
            _mm256_setr_epi8(
                0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
            ),
            _mm256_setr_epi8(
                2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
            ),
        );
        [lo, hi]
    }

    /// The offset of the stored values (`q + 32`) for each activation row: per weight row
    /// (32-bit lane), `−32 · Σ scale · (the activations' sum over the group)`, the start of
    /// the block's integer sum.
    #[inline(always)]
    pub(crate) unsafe fn offsets<const N: usize>(
        sp: &[__m256i; 8],
        b: usize,
        acts: &[Q8k<'_>],
    ) -> [__m256i; N] {
        let mut sumi = [_mm256_setzero_si256(); N];
        for i in 0..N {
            // the bsums of groups 2p, 2p + 1: one 32-bit load
            let bs = acts.get_unchecked(i).2.as_ptr().add(16 * b);
            let mut c = _mm256_setzero_si256();
            for (p, &s) in sp.iter().enumerate() {
                let pair = _mm256_set1_epi32((bs.add(2 * p) as *const i32).read_unaligned());
                c = _mm256_add_epi32(c, _mm256_madd_epi16(s, pair));
            }
            sumi[i] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(c, 5));
        }
        sumi
    }

    /// A group's four registers of values (0..63) from its 96 bytes at `q`: register `k` holds
    /// values `4k..4k + 4` of the group, four bytes per row.
    #[inline(always)]
    pub(crate) unsafe fn values(q: *const u8) -> [__m256i; 4] {
        let m6 = _mm256_set1_epi8(0x3F);
        let top = _mm256_set1_epi8(0xC0u8 as i8);
        let p0 = _mm256_loadu_si256(q as *const __m256i);
        let p1 = _mm256_loadu_si256(q.add(32) as *const __m256i);
        let p2 = _mm256_loadu_si256(q.add(64) as *const __m256i);
        // the top two bits of each byte, moved down in 16-bit lanes: a masked byte's bits
        // never reach its neighbour
        let t = _mm256_or_si256(
            _mm256_or_si256(
                _mm256_srli_epi16(_mm256_and_si256(p0, top), 6),
                _mm256_srli_epi16(_mm256_and_si256(p1, top), 4),
            ),
            _mm256_srli_epi16(_mm256_and_si256(p2, top), 2),
        );
        [
            _mm256_and_si256(p0, m6),
            _mm256_and_si256(p1, m6),
            _mm256_and_si256(p2, m6),
            t,
        ]
    }

    /// Σ over a group of one activation row (16 values at `ap`) · the group's values (`u`),
    /// times the scales `s` (row `r`'s in both halves of lane `r`): 8 × i32. A `vpmaddubsw`
    /// pair is at most 2 · 63 · 127, so two registers' pairs add up in 16 bits.
    #[inline(always)]
    pub(crate) unsafe fn group_dot(u: &[__m256i; 4], ap: *const i8, s: __m256i) -> __m256i {
        let mut a = [_mm256_setzero_si256(); 4];
        for (k, x) in a.iter_mut().enumerate() {
            *x = _mm256_set1_epi32((ap.add(4 * k) as *const i32).read_unaligned());
        }
        let t0 = _mm256_add_epi16(
            _mm256_maddubs_epi16(u[0], a[0]),
            _mm256_maddubs_epi16(u[1], a[1]),
        );
        let t1 = _mm256_add_epi16(
            _mm256_maddubs_epi16(u[2], a[2]),
            _mm256_maddubs_epi16(u[3], a[3]),
        );
        _mm256_add_epi32(_mm256_madd_epi16(t0, s), _mm256_madd_epi16(t1, s))
    }

    /// The end of a group block: each activation row's integer sums times the block scales
    /// (`d` of the eight rows times the row's own), added to its accumulators.
    #[inline(always)]
    pub(crate) unsafe fn scale_block<const N: usize>(
        blk: *const u8,
        b: usize,
        acts: &[Q8k<'_>],
        sumi: &[__m256i; N],
        acc: &mut [__m256; N],
    ) {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        for i in 0..N {
            let dy = _mm256_set1_ps(*acts.get_unchecked(i).1.get_unchecked(b));
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dy), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
        }
    }

    /// The eight results of each activation row `i`, to `o[i * stride..]`.
    #[inline(always)]
    pub(crate) unsafe fn store<const N: usize>(o: *mut f32, stride: usize, acc: &[__m256; N]) {
        for i in 0..N {
            _mm256_storeu_ps(o.add(i * stride), acc[i]);
        }
    }

    /// [`super::gemm`] with AVX2 for exactly `N` activation rows: each group's values are
    /// unpacked into four registers once and serve the `N` rows (up to four).
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
        let picks = scale_picks();
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(b * GROUP_BLOCK_BYTES);
            let sp = scale_pairs(blk);
            let mut sumi = offsets::<N>(&sp, b, acts);
            for (p, &pair) in sp.iter().enumerate() {
                for (h, &pick) in picks.iter().enumerate() {
                    let j = 2 * p + h;
                    let s = _mm256_shuffle_epi8(pair, pick);
                    let u = values(blk.add(VALUES + 96 * j));
                    for i in 0..N {
                        let ap = acts.get_unchecked(i).0.as_ptr().add(256 * b + 16 * j);
                        sumi[i] = _mm256_add_epi32(sumi[i], group_dot(&u, ap, s));
                    }
                }
            }
            scale_block(blk, b, acts, &sumi, &mut acc);
        }
        store(o, stride, &acc);
    }
}

/// With AVX-512: the values unpacked with ternary logic (one instruction per or-of-masked),
/// tiles of up to eight activation rows in the 32 vector registers, and with VNNI a group's
/// sums by `vpdpbusd` (four products per 32-bit lane, no 16-bit stage), then one multiply by
/// the group's scales. 256-bit registers throughout, as [`crate::q4k_x8`]'s AVX-512 kernel:
/// a register is four values of each of the eight rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // activation rows and their accumulators side by side
pub(crate) mod avx512 {
    use super::avx2::{group_dot, offsets, scale_block, scale_pairs, scale_picks, store};
    use super::{Q8k, GROUP_BLOCK_BYTES, VALUES};
    use std::arch::x86_64::*;

    /// `a | (b & c)`, as `vpternlogd`'s truth table.
    const OR_AND: i32 = 0xF8;

    /// [`super::avx2::values`] with ternary logic: the top bits gathered by shifts of two.
    #[inline(always)]
    unsafe fn values(q: *const u8) -> [__m256i; 4] {
        let m6 = _mm256_set1_epi8(0x3F);
        let top = _mm256_set1_epi8(0xC0u8 as i8);
        let p0 = _mm256_loadu_si256(q as *const __m256i);
        let p1 = _mm256_loadu_si256(q.add(32) as *const __m256i);
        let p2 = _mm256_loadu_si256(q.add(64) as *const __m256i);
        let t = _mm256_srli_epi16(_mm256_and_si256(p0, top), 2);
        let t = _mm256_srli_epi16(_mm256_ternarylogic_epi32(t, p1, top, OR_AND), 2);
        let t = _mm256_srli_epi16(_mm256_ternarylogic_epi32(t, p2, top, OR_AND), 2);
        [
            _mm256_and_si256(p0, m6),
            _mm256_and_si256(p1, m6),
            _mm256_and_si256(p2, m6),
            t,
        ]
    }

    /// [`offsets`] with VNNI's `vpdpwssd`.
    #[inline(always)]
    unsafe fn offsets_vnni<const N: usize>(
        sp: &[__m256i; 8],
        b: usize,
        acts: &[Q8k<'_>],
    ) -> [__m256i; N] {
        let mut sumi = [_mm256_setzero_si256(); N];
        for i in 0..N {
            let bs = acts.get_unchecked(i).2.as_ptr().add(16 * b);
            let mut c = _mm256_setzero_si256();
            for (p, &s) in sp.iter().enumerate() {
                let pair = _mm256_set1_epi32((bs.add(2 * p) as *const i32).read_unaligned());
                c = _mm256_dpwssd_epi32(c, s, pair);
            }
            sumi[i] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(c, 5));
        }
        sumi
    }

    /// [`super::gemm`] with AVX-512 for exactly `N` activation rows (`VNNI`: `vpdpbusd`, else
    /// the AVX2 arithmetic).
    #[inline(always)]
    unsafe fn tile<const N: usize, const VNNI: bool>(
        w: &[u8],
        cols: usize,
        acts: &[Q8k<'_>],
        o: *mut f32,
        stride: usize,
    ) {
        let nb = cols / 256;
        debug_assert!(acts.len() == N && w.len() >= nb * GROUP_BLOCK_BYTES);
        let picks = scale_picks();
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(b * GROUP_BLOCK_BYTES);
            let sp = scale_pairs(blk);
            let mut sumi = if VNNI {
                offsets_vnni::<N>(&sp, b, acts)
            } else {
                offsets::<N>(&sp, b, acts)
            };
            for (p, &pair) in sp.iter().enumerate() {
                for h in 0..2 {
                    let j = 2 * p + h;
                    let u = values(blk.add(VALUES + 96 * j));
                    if VNNI {
                        // row r's scale of group j as the i32 of lane r
                        let s = if h == 0 {
                            _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16)
                        } else {
                            _mm256_srai_epi32(pair, 16)
                        };
                        for i in 0..N {
                            let ap = acts.get_unchecked(i).0.as_ptr().add(256 * b + 16 * j);
                            let mut t = _mm256_setzero_si256();
                            for k in 0..4 {
                                let a = _mm256_set1_epi32(
                                    (ap.add(4 * k) as *const i32).read_unaligned(),
                                );
                                t = _mm256_dpbusd_epi32(t, u[k], a);
                            }
                            // |t| ≤ 16 · 63 · 127: times an i8 scale, no overflow
                            sumi[i] = _mm256_add_epi32(sumi[i], _mm256_mullo_epi32(t, s));
                        }
                    } else {
                        let s = _mm256_shuffle_epi8(pair, picks[h]);
                        for i in 0..N {
                            let ap = acts.get_unchecked(i).0.as_ptr().add(256 * b + 16 * j);
                            sumi[i] = _mm256_add_epi32(sumi[i], group_dot(&u, ap, s));
                        }
                    }
                }
            }
            scale_block(blk, b, acts, &sumi, &mut acc);
        }
        store(o, stride, &acc);
    }

    /// [`super::gemm`] with AVX-512 VNNI for exactly `N` activation rows.
    ///
    /// # Safety
    /// [`crate::q4k_x8::avx512::available`] holds (AVX-512 VNNI), `acts.len() == N`, and what
    /// [`super::gemm`] asks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn tile_vnni<const N: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Q8k<'_>],
        o: *mut f32,
        stride: usize,
    ) {
        tile::<N, true>(w, cols, acts, o, stride)
    }

    /// [`super::gemm`] with AVX-512 F/BW/VL (no VNNI) for exactly `N` activation rows.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C are present, `acts.len() == N`, and what
    /// [`super::gemm`] asks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(crate) unsafe fn tile_bw<const N: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Q8k<'_>],
        o: *mut f32,
        stride: usize,
    ) {
        tile::<N, false>(w, cols, acts, o, stride)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::q6k_values;
    use crate::quant::testutil::{random_row, Rng};

    fn random_rows(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
        (0..rows)
            .flat_map(|_| random_row(rng, Format::Q6K, cols))
            .collect()
    }

    #[test]
    fn interleaving_round_trips_byte_for_byte() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for (rows, cols) in [(8, 256), (24, 512), (16, 1536)] {
            let data = random_rows(&mut rng, rows, cols);
            let x = interleave(rows, cols, &data).expect("fits");
            assert_eq!(x.len(), data.len());
            assert_ne!(x, data, "the layout moves bytes");
            let mut back = Vec::new();
            deinterleave(&x, cols, 0, rows / ROWS, &mut back);
            assert!(back == data, "rows {rows} cols {cols}: not the same bytes");
            // a range of groups gives those rows
            let rb = cols / 256 * 210;
            deinterleave(&x, cols, 1, rows / ROWS, &mut back);
            assert!(
                back == data[8 * rb..],
                "rows {rows} cols {cols}: groups 1.."
            );
        }
        // every bit pattern of a value's byte survives: all-ones and all-zeros blocks
        for fill in [0x00, 0xFF, 0xAA, 0x55] {
            let data = vec![fill; 8 * 210];
            let x = interleave(8, 256, &data).expect("fits");
            let mut back = Vec::new();
            deinterleave(&x, 256, 0, 1, &mut back);
            assert_eq!(back, data, "fill {fill:#04x}");
        }
    }

    #[test]
    fn layout_puts_values_and_scales_where_the_module_says() {
        let mut rng = Rng(5);
        let (rows, cols) = (8, 512);
        let data = random_rows(&mut rng, rows, cols);
        let x = interleave(rows, cols, &data).expect("fits");
        for r in 0..rows {
            for b in 0..2 {
                let blk = &data[r * 420 + b * 210..][..210];
                let dst = &x[b * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
                assert_eq!(dst[2 * r..2 * r + 2], blk[208..210]);
                let v = values_of(blk);
                // the values in element order, as the reference reads them
                for half in 0..2 {
                    let (ql, qh) = (&blk[64 * half..], &blk[128 + 32 * half..]);
                    for l in 0..32 {
                        let want = q6k_values(ql, qh, l);
                        for (k, &q) in want.iter().enumerate() {
                            assert_eq!(v[128 * half + 32 * k + l] as i32 - 32, q);
                        }
                    }
                }
                for (e, &want) in v.iter().enumerate() {
                    let (j, i) = (e / 16, e % 16);
                    let got = if i < 12 {
                        dst[VALUES + 96 * j + 32 * (i / 4) + 4 * r + i % 4] & 63
                    } else {
                        (0..3)
                            .map(|k| {
                                (dst[VALUES + 96 * j + 32 * k + 4 * r + i - 12] >> 6) << (2 * k)
                            })
                            .sum()
                    };
                    assert_eq!(got, want, "row {r} block {b} value {e}");
                }
                for s in 0..16 {
                    assert_eq!(dst[SCALES + 16 * (s / 2) + 2 * r + s % 2], blk[192 + s]);
                }
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_declined() {
        assert!(interleave(12, 256, &[0u8; 12 * 210]).is_none());
        assert!(interleave(8, 256, &[0u8; 7 * 210]).is_none());
        assert!(interleave(8, 300, &[0u8; 8 * 210]).is_none());
        assert!(interleave(0, 256, &[]).is_none());
    }

    /// Every kernel this processor runs (AVX2; AVX-512 BW; AVX-512 VNNI), every tile size,
    /// against the GGUF rows dequantised and multiplied in f64 by the same 8-bit activations:
    /// only the order of float additions differs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn kernels_match_the_dequantised_rows_on_the_same_activations() {
        use crate::quant::{dequantize_row, Q8KRows};
        let mut kernels = Vec::new();
        if crate::cpu::detect() >= Isa::Avx2 {
            kernels.push(Kernel::Avx2);
        }
        if crate::cpu::detect() >= Isa::Avx512 {
            kernels.push(Kernel::Avx512);
            if crate::q4k_x8::avx512::available() {
                kernels.push(Kernel::Vnni);
            }
        }
        let mut rng = Rng(61);
        for (rows, cols) in [(8, 256), (16, 512), (24, 1536), (8, 2304)] {
            let data = random_rows(&mut rng, rows, cols);
            let packed = interleave(rows, cols, &data).expect("fits");
            let rb = cols / 256 * 210;
            let deq: Vec<Vec<f32>> = (0..rows)
                .map(|j| {
                    let mut y = vec![0f32; cols];
                    dequantize_row(Format::Q6K, &data[j * rb..(j + 1) * rb], &mut y);
                    y
                })
                .collect();
            for m in [1, 3, 4, 5, 8, 9, 17] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f32() * 2.0).collect();
                let mut q = Q8KRows::default();
                q.quantize(Isa::Scalar, &x, m, cols);
                let nb = cols / 256;
                let acts: Vec<Q8k<'_>> = (0..m)
                    .map(|i| {
                        (
                            &q.qs[i * cols..(i + 1) * cols],
                            &q.d[i * nb..(i + 1) * nb],
                            &q.bsums[i * nb * 16..(i + 1) * nb * 16],
                        )
                    })
                    .collect();
                // the reference: dequantised weights · dequantised activations, in f64, and
                // the sum of the products' magnitudes (what float rounding is relative to)
                let want: Vec<(f64, f64)> = (0..m)
                    .flat_map(|i| {
                        let acts = &acts;
                        deq.iter().map(move |row| {
                            (0..cols)
                                .map(|e| {
                                    let p = row[e] as f64
                                        * acts[i].0[e] as f64
                                        * acts[i].1[e / 256] as f64;
                                    (p, p.abs())
                                })
                                .fold((0.0, 0.0), |(s, a), (p, q)| (s + p, a + q))
                        })
                    })
                    .collect();
                for &kernel in &kernels {
                    let mut got = vec![f32::NAN; m * rows];
                    for g in 0..rows / ROWS {
                        let w = &packed[g * ROWS * rb..(g + 1) * ROWS * rb];
                        // SAFETY: the kernel's instructions were detected above; `w` is one
                        // group, the activations hold `cols` values, and `got` is m × rows.
                        unsafe {
                            gemm(kernel, w, cols, &acts, got.as_mut_ptr().add(g * ROWS), rows)
                        };
                    }
                    for (k, (&g, &(w, mag))) in got.iter().zip(&want).enumerate() {
                        // float rounding only: a few f32 roundings of the products' magnitude
                        let tol = 4e-6 * mag + 1e-6;
                        assert!(
                            (g as f64 - w).abs() <= tol,
                            "{kernel:?} rows {rows} cols {cols} m {m}: [{k}] {g} vs {w} (tol {tol})"
                        );
                    }
                }
            }
        }
    }
}
