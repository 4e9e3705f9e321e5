//! Q5_0 with eight weight rows interleaved, one byte per value: the prefill layout of the
//! Q5_0 weights on AVX2 machines ([`crate::q4k_x8`]'s idea for the 32-element format).
//!
//! Qwen2.5's 0.5B model keeps most of its matrices in Q5_0 (its 896 columns are not whole
//! 256-blocks, so the K formats cannot take them). Repacked as Q8_0 rows, its prefill on a
//! 2-core AVX2 machine spent 70 % of the time in the Q8_0 tile, whose every 32-element product
//! costs seven operations (a sign fix for `vpmaddubsw`, the product, a widening, a conversion
//! and a scaled add per weight row and activation row). Here the values are stored unsigned,
//! `u = q + 16` (0..31, as in GGUF), eight rows side by side: a 32-byte register holds four
//! consecutive values of each of the eight rows (one row per 32-bit lane), so one four-byte
//! activation load serves eight rows, `vpmaddubsw` takes the unsigned values as they are (no
//! sign fix), four products add up in 16 bits without overflow (8 · 31 · 127 < 2¹⁵), and one
//! conversion and one scaled add finish eight outputs. `16 · Σq` of the activation block comes
//! off each sum in integers (the activations carry their block sums), so each block's sum is
//! the exact integer Σ q·y, and each output `r` adds `d_r · d_y · Σ` block by block in its
//! own lane: the same arithmetic for any number of activation rows, so batched decode gives
//! the tokens of single decode.
//!
//! The layout is lossless and the size of the Q8_0 rows that the repack made before (34 bytes
//! per 32 values; Q5_0 itself takes 22): the matmul sees Q8_0 rows' shape ([`fits`]), and
//! [`deinterleave`] gives those Q8_0 rows back, byte for byte, for processors without the
//! kernel.
//!
//! One 272-byte group block (rows `8g..8g + 8`, 32-block `b`):
//! - `0..16`: the eight rows' `d` (f16);
//! - `16..272`: the values, byte `16 + 32k + 4r + t` (`k < 8`, `t < 4`) ← `u[4k + t]` of row
//!   `r`'s block.

use crate::cpu::Isa;
use crate::quant::Format;

/// The layout's id where a GGML type id is expected (not a GGML type: no other code reads it).
pub const ID: u32 = 0x0001_0006;

/// Rows per group.
pub const ROWS: usize = 8;
/// Bytes of one group's 32-block (eight Q8_0-sized blocks).
pub const GROUP_BLOCK_BYTES: usize = ROWS * 34;

/// One activation row in 32-blocks: `qs`, a scale per block, `Σq` per block.
pub(crate) type Q8<'a> = (&'a [i8], &'a [f32], &'a [i32]);

/// Whether this instruction set has the layout's kernel ([`gemm`]).
pub fn has_kernel(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa >= Isa::Avx2
}

/// Whether the repack should use the layout on this instruction set: where it was measured to
/// pay (AVX2 without AVX-512; with AVX-512 the Q8_0 rows have their own wider kernels).
pub fn preferred(isa: Isa) -> bool {
    has_kernel(isa) && isa < Isa::Avx512
}

/// Whether an interleaved matrix of this shape has these many bytes (Q8_0 rows' count).
pub fn fits(rows: usize, cols: usize, bytes: usize) -> bool {
    rows > 0
        && rows.is_multiple_of(ROWS)
        && cols.is_multiple_of(32)
        && Format::Q8_0
            .row_bytes(cols)
            .is_some_and(|rb| rb * rows == bytes)
}

/// GGUF Q5_0 rows → the interleaved layout. `None` when the shape does not fit (rows not a
/// multiple of eight, a partial block, or a byte count that is not `rows` Q5_0 rows).
pub fn interleave(rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    let rb5 = Format::Q5_0.row_bytes(cols)?;
    if rows == 0
        || !rows.is_multiple_of(ROWS)
        || !cols.is_multiple_of(32)
        || rb5 * rows != data.len()
    {
        return None;
    }
    let nb = cols / 32;
    let bb5 = Format::Q5_0.block_bytes();
    let mut out = vec![0u8; rows * nb * 34];
    for g in 0..rows / ROWS {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
            for r in 0..ROWS {
                let blk = &data[(ROWS * g + r) * rb5 + b * bb5..][..bb5];
                dst[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for e in 0..32 {
                    let nibble = if e < 16 {
                        blk[6 + e] & 15
                    } else {
                        blk[6 + e - 16] >> 4
                    };
                    let u = nibble | ((((qh >> e) & 1) as u8) << 4);
                    dst[16 + 32 * (e / 4) + 4 * r + e % 4] = u;
                }
            }
        }
    }
    Some(out)
}

/// Groups `g0..g1` of an interleaved matrix (`cols` wide) as Q8_0 rows `8·g0..8·g1` (the
/// values `u − 16`), written into `out` (resized): byte for byte what
/// [`crate::quant::q5_0_as_q8_0`] makes of the Q5_0 rows.
pub fn deinterleave(data: &[u8], cols: usize, g0: usize, g1: usize, out: &mut Vec<u8>) {
    let block = (GROUP_BLOCK_BYTES, 34);
    crate::q4k_x8::ungroup(
        data,
        cols / 32,
        block.0,
        block.1,
        (g0, g1),
        out,
        |src, r, blk| {
            blk[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            for e in 0..32 {
                blk[2 + e] = (src[16 + 32 * (e / 4) + 4 * r + e % 4] as i8 - 16) as u8;
            }
        },
    );
}

/// One group (`cols / 32` blocks of eight rows, `w`) against the activation rows `acts`: the
/// eight results of activation row `i` go to `out[i * stride..i * stride + 8]`.
///
/// # Safety
/// AVX2, FMA and F16C are present; `w` holds one group of `cols / 32` blocks; each activation
/// holds `cols` values and `cols / 32` scales and sums; `out` is valid for writes at every
/// `i * stride + r` (`i < acts.len()`, `r < 8`), which nothing else reads or writes meanwhile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm(w: &[u8], cols: usize, acts: &[Q8<'_>], out: *mut f32, stride: usize) {
    for (i, n) in crate::q4k_x8::pieces(acts.len(), 4) {
        let (a, o) = (&acts[i..i + n], out.add(i * stride));
        match n {
            4 => avx2::tile::<4>(w, cols, a, o, stride),
            2 => avx2::tile::<2>(w, cols, a, o, stride),
            _ => avx2::tile::<1>(w, cols, a, o, stride),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // activation rows and their accumulators side by side
mod avx2 {
    use std::arch::x86_64::*;

    use super::{GROUP_BLOCK_BYTES, Q8};

    /// [`super::gemm`] for exactly `N` activation rows: a block's eight registers of values
    /// are loaded once and serve the `N` rows.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present, `acts.len() == N`, and what [`super::gemm`] asks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<const N: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Q8<'_>],
        o: *mut f32,
        stride: usize,
    ) {
        let nb = cols / 32;
        debug_assert!(acts.len() == N && w.len() >= nb * GROUP_BLOCK_BYTES);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(b * GROUP_BLOCK_BYTES);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let q = blk.add(16);
            let mut wq = [_mm256_setzero_si256(); 8];
            for (k, x) in wq.iter_mut().enumerate() {
                *x = _mm256_loadu_si256(q.add(32 * k) as *const __m256i);
            }
            for i in 0..N {
                let (qs, d, sums) = *acts.get_unchecked(i);
                let ap = qs.as_ptr().add(32 * b);
                let y =
                    |k: usize| _mm256_set1_epi32((ap.add(4 * k) as *const i32).read_unaligned());
                // four products of ≤ 31 · 127 per 16-bit pair, twice: no overflow
                let lo = _mm256_add_epi16(
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(wq[0], y(0)),
                        _mm256_maddubs_epi16(wq[1], y(1)),
                    ),
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(wq[2], y(2)),
                        _mm256_maddubs_epi16(wq[3], y(3)),
                    ),
                );
                let hi = _mm256_add_epi16(
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(wq[4], y(4)),
                        _mm256_maddubs_epi16(wq[5], y(5)),
                    ),
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(wq[6], y(6)),
                        _mm256_maddubs_epi16(wq[7], y(7)),
                    ),
                );
                let s = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
                // the values are q + 16: take 16 · Σy off, leaving the exact Σ q·y per row
                let s = _mm256_sub_epi32(s, _mm256_set1_epi32(16 * *sums.get_unchecked(b)));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*d.get_unchecked(b)));
                acc[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[i]);
            }
        }
        for i in 0..N {
            _mm256_storeu_ps(o.add(i * stride), acc[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::{random_row, Rng};

    #[test]
    fn interleaving_round_trips_to_the_q8_0_rows() {
        let mut rng = Rng(0x51_7cc1_b727_220a);
        let (rows, cols) = (24, 96);
        let data: Vec<u8> = (0..rows)
            .flat_map(|_| random_row(&mut rng, Format::Q5_0, cols))
            .collect();
        let x = interleave(rows, cols, &data).expect("fits");
        let q8 = crate::quant::q5_0_as_q8_0(&data).expect("q8_0");
        assert_eq!(x.len(), q8.len());
        assert!(fits(rows, cols, x.len()));
        assert_ne!(x, q8, "the layout moves bytes");
        let mut back = Vec::new();
        deinterleave(&x, cols, 0, rows / ROWS, &mut back);
        assert_eq!(back, q8);
        // a range of groups gives those rows
        deinterleave(&x, cols, 1, 3, &mut back);
        let rb = cols / 32 * 34;
        assert_eq!(back, q8[8 * rb..24 * rb]);
    }

    #[test]
    fn shapes_that_do_not_fit_are_declined() {
        let rb = Format::Q5_0.row_bytes(64).expect("row bytes");
        assert!(interleave(12, 64, &vec![0u8; 12 * rb]).is_none());
        assert!(interleave(8, 64, &vec![0u8; 7 * rb]).is_none());
        assert!(interleave(8, 48, &vec![0u8; 8 * rb]).is_none());
        assert!(interleave(0, 64, &[]).is_none());
        assert!(!fits(8, 64, 8 * rb));
    }
}
