//! GGML block formats: layouts, scalar dequantisation (the reference), and the quantisation
//! of activations that the integer dot products multiply against.
//!
//! Weights keep GGML's byte layout exactly as a GGUF file stores them (little-endian):
//!
//! | type | elements | bytes | layout |
//! |---|---|---|---|
//! | F32  | 1   | 4   | `f32` |
//! | F16  | 1   | 2   | IEEE half |
//! | Q4_0 | 32  | 18  | `d: f16, qs: [u8; 16]`; element `i < 16` is `qs[i] & 15`, `16 + i` is `qs[i] >> 4`; value `d·(q − 8)` |
//! | Q4_1 | 32  | 20  | `d: f16, m: f16, qs: [u8; 16]`; value `d·q + m` |
//! | Q5_0 | 32  | 22  | `d: f16, qh: u32, qs: [u8; 16]`; bit `i` of `qh` is bit 4 of element `i`; value `d·(q − 16)` |
//! | Q8_0 | 32  | 34  | `d: f16, qs: [i8; 32]`; value `d·q` |
//! | Q4_K | 256 | 144 | `d, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: eight sub-blocks of 32 with 6-bit scales and mins |
//! | Q6_K | 256 | 210 | `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: sixteen groups of 16, 6-bit values − 32 |
//!
//! Activations are quantised per row to 8 bits: in blocks of 32 ([`Q8Rows`], for the 32-element
//! formats) with the scale `d` and `s = d·Σq` (what Q4_0/Q4_1/Q5_0 need for their offsets), or
//! in blocks of 256 ([`Q8KRows`], for the K formats) with per-16 sums of the quantised values.

use half::f16;

/// GGML type ids (as in GGUF files).
pub mod ggml {
    /// 32-bit floats.
    pub const F32: u32 = 0;
    /// 16-bit floats.
    pub const F16: u32 = 1;
    /// 4-bit blocks of 32 with a scale.
    pub const Q4_0: u32 = 2;
    /// 4-bit blocks of 32 with a scale and a minimum.
    pub const Q4_1: u32 = 3;
    /// 5-bit blocks of 32 with a scale.
    pub const Q5_0: u32 = 6;
    /// 8-bit blocks of 32 with a scale.
    pub const Q8_0: u32 = 8;
    /// 4-bit super-blocks of 256 with 6-bit sub-block scales and minimums.
    pub const Q4_K: u32 = 12;
    /// 6-bit super-blocks of 256 with 8-bit sub-block scales.
    pub const Q6_K: u32 = 14;
}

/// The formats the kernels implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// [`ggml::F32`].
    F32,
    /// [`ggml::F16`].
    F16,
    /// [`ggml::Q4_0`].
    Q4_0,
    /// [`ggml::Q4_1`].
    Q4_1,
    /// [`ggml::Q5_0`].
    Q5_0,
    /// [`ggml::Q8_0`].
    Q8_0,
    /// [`ggml::Q4_K`].
    Q4K,
    /// [`ggml::Q6_K`].
    Q6K,
}

impl Format {
    /// Every format.
    pub const ALL: [Format; 8] = [
        Format::F32,
        Format::F16,
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q8_0,
        Format::Q4K,
        Format::Q6K,
    ];

    /// The format of a GGML type id, if the kernels implement it.
    pub fn from_ggml(id: u32) -> Option<Format> {
        Some(match id {
            ggml::F32 => Format::F32,
            ggml::F16 => Format::F16,
            ggml::Q4_0 => Format::Q4_0,
            ggml::Q4_1 => Format::Q4_1,
            ggml::Q5_0 => Format::Q5_0,
            ggml::Q8_0 => Format::Q8_0,
            ggml::Q4_K => Format::Q4K,
            ggml::Q6_K => Format::Q6K,
            _ => return None,
        })
    }

    /// Its GGML type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            Format::F32 => ggml::F32,
            Format::F16 => ggml::F16,
            Format::Q4_0 => ggml::Q4_0,
            Format::Q4_1 => ggml::Q4_1,
            Format::Q5_0 => ggml::Q5_0,
            Format::Q8_0 => ggml::Q8_0,
            Format::Q4K => ggml::Q4_K,
            Format::Q6K => ggml::Q6_K,
        }
    }

    /// Its name as GGUF tools write it (`Q4_K`, …).
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "F32",
            Format::F16 => "F16",
            Format::Q4_0 => "Q4_0",
            Format::Q4_1 => "Q4_1",
            Format::Q5_0 => "Q5_0",
            Format::Q8_0 => "Q8_0",
            Format::Q4K => "Q4_K",
            Format::Q6K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Format::F32 | Format::F16 => 1,
            Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q8_0 => 32,
            Format::Q4K | Format::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::F16 => 2,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }

    /// Bytes of one row of `cols` elements; `None` when `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        cols.is_multiple_of(self.block_elems())
            .then(|| cols / self.block_elems() * self.block_bytes())
    }
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block's 12 scale bytes.
#[inline(always)]
pub(crate) fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The four signed 6-bit values of a Q6_K half-block at position `l` (0..32): elements `l`,
/// `l + 32`, `l + 64` and `l + 96` of the half, from its `ql` (64 bytes) and `qh` (32 bytes).
#[inline(always)]
pub(crate) fn q6k_values(ql: &[u8], qh: &[u8], l: usize) -> [i32; 4] {
    [
        ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i32 - 32,
        ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32,
        ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32,
        ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32,
    ]
}

/// Dequantises one row (`out.len()` elements) from its bytes: the plain reference.
pub fn dequantize_row(format: Format, row: &[u8], out: &mut [f32]) {
    let be = format.block_elems();
    let bb = format.block_bytes();
    for (blk, y) in row.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match format {
            Format::F32 => y[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            Format::F16 => y[0] = f16_at(blk, 0),
            Format::Q4_0 => {
                let d = f16_at(blk, 0);
                for i in 0..16 {
                    y[i] = d * ((blk[2 + i] & 15) as f32 - 8.0);
                    y[i + 16] = d * ((blk[2 + i] >> 4) as f32 - 8.0);
                }
            }
            Format::Q4_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                for i in 0..16 {
                    y[i] = d * (blk[4 + i] & 15) as f32 + m;
                    y[i + 16] = d * (blk[4 + i] >> 4) as f32 + m;
                }
            }
            Format::Q5_0 => {
                let d = f16_at(blk, 0);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for i in 0..16 {
                    let lo = (blk[6 + i] & 15) | ((((qh >> i) & 1) as u8) << 4);
                    let hi = (blk[6 + i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
                    y[i] = d * (lo as f32 - 16.0);
                    y[i + 16] = d * (hi as f32 - 16.0);
                }
            }
            Format::Q8_0 => {
                let d = f16_at(blk, 0);
                for i in 0..32 {
                    y[i] = d * (blk[2 + i] as i8) as f32;
                }
            }
            Format::Q4K => {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let scales = &blk[4..16];
                let qs = &blk[16..144];
                for j in 0..4 {
                    let (sc1, m1) = q4k_scale_min(2 * j, scales);
                    let (sc2, m2) = q4k_scale_min(2 * j + 1, scales);
                    let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                    for l in 0..32 {
                        let q = qs[32 * j + l];
                        y[64 * j + l] = d1 * (q & 15) as f32 - m1;
                        y[64 * j + 32 + l] = d2 * (q >> 4) as f32 - m2;
                    }
                }
            }
            Format::Q6K => {
                let d = f16_at(blk, 208);
                for half in 0..2 {
                    let ql = &blk[64 * half..];
                    let qh = &blk[128 + 32 * half..];
                    let sc = &blk[192 + 8 * half..];
                    let y = &mut y[128 * half..];
                    for l in 0..32 {
                        let is = l / 16;
                        let [q1, q2, q3, q4] = q6k_values(ql, qh, l);
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// Q5_0 blocks rewritten as Q8_0 blocks, losslessly: the same f16 scale, and each 5-bit
/// value (0..31, offset 16) as the signed byte it stands for (−16..15). Every product with
/// an activation block is the same integer, so results are bit-identical; the weights take
/// 34 bytes per 32 instead of 22, and the kernels skip unpacking the fifth bit (prefill
/// runs on the Q8_0 tile). `None` when `data` is not whole Q5_0 blocks.
pub fn q5_0_as_q8_0(data: &[u8]) -> Option<Vec<u8>> {
    let (bb5, bb8) = (Format::Q5_0.block_bytes(), Format::Q8_0.block_bytes());
    if !data.len().is_multiple_of(bb5) {
        return None;
    }
    let mut out = Vec::with_capacity(data.len() / bb5 * bb8);
    for blk in data.chunks_exact(bb5) {
        out.extend_from_slice(&blk[..2]);
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let value =
            |nibble: u8, bit: usize| ((nibble | ((((qh >> bit) & 1) as u8) << 4)) as i8 - 16) as u8;
        out.extend((0..16).map(|i| value(blk[6 + i] & 15, i)));
        out.extend((0..16).map(|i| value(blk[6 + i] >> 4, i + 16)));
    }
    Some(out)
}

/// Activation rows quantised to 8 bits in blocks of 32: `qs` (rows × cols), and per block
/// the scale `d`, `s = d·Σq` and `Σq`.
#[derive(Debug, Default)]
pub struct Q8Rows {
    /// Elements per row.
    pub cols: usize,
    /// The quantised values, row after row.
    pub qs: Vec<i8>,
    /// Each block's scale.
    pub d: Vec<f32>,
    /// Each block's `d·Σq`.
    pub s: Vec<f32>,
    /// Each block's `Σq` (for the interleaved Q5_0 layout, whose values are stored `+ 16`).
    pub sums: Vec<i32>,
    /// Each block's `d` eight times over (AVX-512 only: two blocks' scales are one vector
    /// load, lanes 0..8 and 8..16, matching the lanes of a two-block product).
    pub d8: Vec<f32>,
}

/// Activation rows quantised to 8 bits in blocks of 256: `qs`, a scale per block and the
/// sums of each 16 consecutive quantised values.
#[derive(Debug, Default)]
pub struct Q8KRows {
    /// Elements per row.
    pub cols: usize,
    /// The quantised values, row after row.
    pub qs: Vec<i8>,
    /// Each block's scale.
    pub d: Vec<f32>,
    /// Sums of each 16 consecutive quantised values.
    pub bsums: Vec<i16>,
}

/// Quantises one block of `x` (any length) to `q`: `d = max|x| / 127`, `q = round(x / d)`;
/// returns `d` and `Σq`. The scalar reference; the SIMD version rounds the same way (ties to
/// even).
#[inline]
pub fn quantize_block_scalar(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        sum += *q as i32;
    }
    (d, sum)
}

/// Sets the length of a scratch buffer, keeping its allocation (its contents are overwritten).
pub(crate) fn resize<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    if v.len() != n {
        v.resize(n, T::default());
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    /// splitmix64: a small seeded generator for the tests.
    pub struct Rng(pub u64);

    impl Rng {
        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        pub fn f32(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        pub fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }
        pub fn byte(&mut self) -> u8 {
            self.next_u64() as u8
        }
    }

    /// A random row of `format` with `cols` elements: random payload bytes, sane scales.
    pub fn random_row(rng: &mut Rng, format: Format, cols: usize) -> Vec<u8> {
        let bb = format.block_bytes();
        let nb = cols / format.block_elems();
        let mut out = Vec::with_capacity(nb * bb);
        let small_f16 = |rng: &mut Rng| f16::from_f32(rng.f32() * 0.05).to_le_bytes();
        for _ in 0..nb {
            let mut b: Vec<u8> = (0..bb).map(|_| rng.byte()).collect();
            match format {
                Format::F32 => b.copy_from_slice(&rng.f32().to_le_bytes()),
                Format::F16 => b.copy_from_slice(&f16::from_f32(rng.f32()).to_le_bytes()),
                Format::Q4_0 | Format::Q5_0 | Format::Q8_0 => {
                    b[..2].copy_from_slice(&small_f16(rng))
                }
                Format::Q4_1 | Format::Q4K => {
                    b[..2].copy_from_slice(&small_f16(rng));
                    b[2..4].copy_from_slice(&small_f16(rng));
                }
                Format::Q6K => b[208..210].copy_from_slice(&small_f16(rng)),
            }
            out.extend_from_slice(&b);
        }
        out
    }

    #[test]
    fn q5_0_rewritten_as_q8_0_dequantises_to_the_same_values() {
        let mut rng = Rng(11);
        let cols = 32 * 28;
        for _ in 0..8 {
            let q5 = random_row(&mut rng, Format::Q5_0, cols);
            let q8 = q5_0_as_q8_0(&q5).unwrap();
            assert_eq!(q8.len(), Format::Q8_0.row_bytes(cols).unwrap());
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            dequantize_row(Format::Q5_0, &q5, &mut a);
            dequantize_row(Format::Q8_0, &q8, &mut b);
            assert_eq!(a, b);
        }
        // the extremes: 0 → −16, 31 → 15
        let mut blk = vec![0u8; 22];
        blk[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        blk[2..6].copy_from_slice(&1u32.to_le_bytes());
        blk[6] = 0x0F;
        let q8 = q5_0_as_q8_0(&blk).unwrap();
        assert_eq!((q8[2] as i8, q8[3] as i8, q8[18] as i8), (15, -16, -16));
        assert!(q5_0_as_q8_0(&blk[..21]).is_none());
    }

    #[test]
    fn q4k_and_q6k_dequantise_known_values() {
        // Q4_K: d = 1, dmin = 0.5, sub-block 0 scale 3 min 2, nibble 5 -> 3*5 - 0.5*2 = 14.
        let mut b = vec![0u8; 144];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[4] = 3; // scale of sub-block 0
        b[8] = 2; // min of sub-block 0
        b[16] = 0x05;
        let mut y = vec![0f32; 256];
        dequantize_row(Format::Q4K, &b, &mut y);
        assert_eq!(y[0], 14.0);
        assert_eq!(y[1], -1.0);
        // Q6_K: d = 2, scale of group 0 = -3, element 0 = (ql 7 | qh 1<<4) - 32 = -9 -> 54.
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[192] = (-3i8) as u8;
        b[0] = 7;
        b[128] = 1;
        let mut y = vec![0f32; 256];
        dequantize_row(Format::Q6K, &b, &mut y);
        assert_eq!(y[0], 54.0);
    }

    #[test]
    fn activation_quantisation_round_trips_within_half_a_step() {
        let mut rng = Rng(7);
        let x: Vec<f32> = (0..512).map(|_| rng.f32() * 3.0).collect();
        for isa in crate::Isa::available() {
            let mut q = Q8KRows::default();
            q.quantize(isa, &x, 2, 256);
            for (r, xr) in x.chunks(256).enumerate() {
                let d = q.d[r];
                for (i, &v) in xr.iter().enumerate() {
                    let back = q.qs[r * 256 + i] as f32 * d;
                    assert!((back - v).abs() <= d * 0.5 + 1e-6, "{isa:?} {v} {back}");
                }
                let sum16: i16 = q.qs[r * 256..r * 256 + 16].iter().map(|&v| v as i16).sum();
                assert_eq!(q.bsums[r * 16], sum16);
            }
        }
    }
}
