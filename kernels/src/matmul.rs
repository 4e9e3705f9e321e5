//! `y = x · Wᵀ` against weights in GGML block formats.
//!
//! `x` is `m` rows of `cols` f32 values; `W` is `rows` rows of `cols` elements in one of the
//! [`Format`]s, in GGUF's byte layout. The result is `m × rows`, row-major.
//!
//! How it is computed:
//! - Quantised weights multiply against 8-bit activations (integer dot products, as llama.cpp
//!   does): the activations are quantised once per call into reused buffers, to blocks of 32
//!   for Q4_0/Q4_1/Q5_0/Q8_0 and of 256 for Q4_K/Q6_K. F16 weights are read as F16 and widened
//!   in registers; F32 weights are read as they are.
//! - The weight rows are split into chunks, one rayon task per chunk (rayon's global pool, so
//!   the thread count is the one docent configures). Decode (`m = 1`) is a multi-threaded gemv.
//! - Prefill (`m > 1`) is tiled: a task owns at most [`WEIGHT_TILE_BYTES`] of weight rows
//!   (they stay in L1/L2) and walks every activation row past them, [`R`] at a time; each
//!   micro-kernel call multiplies one weight row by R activation rows, so a weight block is
//!   loaded (and unpacked) once for R rows. On AVX2 the 32-element formats use a tile of 2
//!   weight rows × 4 activation rows instead, and decode a loop of their own per format.
//! - A few activation rows (up to [`R`]: a speculative step's draft) are split over the
//!   threads as decode is, and the AVX-512 micro-kernel is instantiated for exactly that many
//!   rows (no padding rows computed).
//! - The output is written once, without zero-filling it first.
//! - Q4_K weights interleaved by eight rows at load ([`q4k_x8`], type id [`q4k_x8::ID`]) run
//!   on that layout's kernels (AVX2, or AVX-512 VNNI) for every number of activation rows
//!   (one group of eight weight rows against up to 16 activation rows at a time); below AVX2
//!   the task's rows are unpacked to GGUF rows for the row kernels. Q6_K weights interleaved
//!   the same way ([`q6k_x8`], type id [`q6k_x8::ID`]) take the same path with their own
//!   kernels (AVX2, AVX-512 BW, AVX-512 VNNI).
//!
//! Every format has a plain scalar micro-kernel computing the same integer sums; the AVX2
//! kernels, the AVX-512 kernels (every format; VNNI where the processor has it) and, on
//! aarch64, the NEON kernels (with `sdot` where the processor has dotprod) are chosen at run
//! time. [`matmul_reference`]
//! dequantises each weight row to f32 and is what the tests compare against.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::cpu::Isa;
use crate::quant::{
    dequantize_row, f16_at, q4k_scale_min, q6k_values, resize, Format, Q8KRows, Q8Rows,
};
use crate::{q4k_x8, q5_0_x8, q6k_x8};

/// The layouts of weights with eight rows interleaved, by their type ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Interleaved {
    /// [`q4k_x8`]
    Q4K,
    /// [`q6k_x8`]
    Q6K,
    /// [`q5_0_x8`]
    Q50,
}

/// Rows per group of both interleaved layouts.
const GROUP_ROWS: usize = q4k_x8::ROWS;
const _: () = assert!(q6k_x8::ROWS == GROUP_ROWS && q5_0_x8::ROWS == GROUP_ROWS);

impl Interleaved {
    fn of(ggml_type: u32) -> Option<Self> {
        match ggml_type {
            q4k_x8::ID => Some(Self::Q4K),
            q6k_x8::ID => Some(Self::Q6K),
            q5_0_x8::ID => Some(Self::Q50),
            _ => None,
        }
    }

    /// The format of the rows the layout holds.
    fn format(self) -> Format {
        match self {
            Self::Q4K => Format::Q4K,
            Self::Q6K => Format::Q6K,
            Self::Q50 => Format::Q8_0,
        }
    }

    fn fits(self, rows: usize, cols: usize, bytes: usize) -> bool {
        match self {
            Self::Q4K => q4k_x8::fits(rows, cols, bytes),
            Self::Q6K => q6k_x8::fits(rows, cols, bytes),
            Self::Q50 => q5_0_x8::fits(rows, cols, bytes),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn has_kernel(self, isa: Isa) -> bool {
        match self {
            Self::Q4K => q4k_x8::has_kernel(isa),
            Self::Q6K => q6k_x8::has_kernel(isa),
            Self::Q50 => q5_0_x8::has_kernel(isa),
        }
    }

    fn deinterleave(self, data: &[u8], cols: usize, g0: usize, g1: usize, out: &mut Vec<u8>) {
        match self {
            Self::Q4K => q4k_x8::deinterleave(data, cols, g0, g1, out),
            Self::Q6K => q6k_x8::deinterleave(data, cols, g0, g1, out),
            Self::Q50 => q5_0_x8::deinterleave(data, cols, g0, g1, out),
        }
    }
}

/// A weight matrix: `rows` rows of `cols` elements in GGML type `ggml_type`.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    /// The GGML type id ([`crate::quant::ggml`]).
    pub ggml_type: u32,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of the format's block size).
    pub cols: usize,
    /// The rows' bytes, in the file's layout (or the repacked one).
    pub data: &'a [u8],
}

/// Activation rows per micro-kernel call in prefill.
pub const R: usize = 8;
/// Up to this many activation rows (decode, a speculative step's draft), the weight rows are
/// split as for decode rather than in cache-sized prefill tiles.
const FEW_ROWS: usize = R;
/// Activation rows per AVX2 micro-kernel call (16 vector registers; AVX-512 takes all [`R`]).
#[cfg(target_arch = "x86_64")]
const R_AVX2: usize = 4;
/// Bytes of weights one prefill task keeps hot (its rows are re-read for every R activation
/// rows).
pub const WEIGHT_TILE_BYTES: usize = 32 * 1024;

/// `x · Wᵀ` with the run-time instruction set. `None` when the format is not implemented or
/// the shapes do not fit (the caller then falls back to its own code).
pub fn matmul(w: &WeightView<'_>, x: &[f32], m: usize) -> Option<Vec<f32>> {
    matmul_with(crate::cpu::isa(), w, x, m)
}

/// Scalar reference: each weight row dequantised to f32, then a plain dot product per output.
pub fn matmul_reference(w: &WeightView<'_>, x: &[f32], m: usize) -> Option<Vec<f32>> {
    let format = Format::from_ggml(w.ggml_type)?;
    let rb = checked_row_bytes(format, w, x, m)?;
    let mut out = vec![0f32; m * w.rows];
    let mut row = vec![0f32; w.cols];
    for j in 0..w.rows {
        dequantize_row(format, &w.data[j * rb..(j + 1) * rb], &mut row);
        for i in 0..m {
            let xi = &x[i * w.cols..(i + 1) * w.cols];
            out[i * w.rows + j] = row.iter().zip(xi).map(|(a, b)| a * b).sum();
        }
    }
    Some(out)
}

fn checked_row_bytes(format: Format, w: &WeightView<'_>, x: &[f32], m: usize) -> Option<usize> {
    let rb = format.row_bytes(w.cols)?;
    let ok = w.rows > 0
        && w.cols > 0
        && m > 0
        && w.data.len() >= rb.checked_mul(w.rows)?
        && x.len() >= m.checked_mul(w.cols)?;
    ok.then_some(rb)
}

/// Quantised activations of one call, reused between calls on the same thread.
#[derive(Default)]
struct Scratch {
    q8: Q8Rows,
    q8k: Q8KRows,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// A task's interleaved Q4_K or Q6_K rows unpacked to GGUF rows (below AVX2: no kernel
    /// for the layout).
    static UNPACKED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One activation row as the micro-kernels see it.
#[derive(Clone, Copy)]
enum Act<'a> {
    F32(&'a [f32]),
    Q8 {
        qs: &'a [i8],
        d: &'a [f32],
        s: &'a [f32],
        /// `d` eight times per block (filled for AVX-512 only; empty otherwise).
        d8: &'a [f32],
    },
    Q8K {
        qs: &'a [i8],
        d: &'a [f32],
        bsums: &'a [i16],
    },
}

impl<'a> Act<'a> {
    /// The row of a float format (F32/F16 weights get float activations).
    fn floats(self) -> &'a [f32] {
        match self {
            Act::F32(x) => x,
            _ => unreachable!("float weights get float activations"),
        }
    }

    /// `(qs, d, s, d8)` of a row in 32-blocks (the Q4_0/Q4_1/Q5_0/Q8_0 weights).
    fn q8(self) -> (&'a [i8], &'a [f32], &'a [f32], &'a [f32]) {
        match self {
            Act::Q8 { qs, d, s, d8 } => (qs, d, s, d8),
            _ => unreachable!("32-element formats get 8-bit activations"),
        }
    }

    /// `(qs, d, bsums)` of a row in 256-blocks (the K formats).
    fn q8k(self) -> (&'a [i8], &'a [f32], &'a [i16]) {
        match self {
            Act::Q8K { qs, d, bsums } => (qs, d, bsums),
            _ => unreachable!("K formats get 8-bit activations in 256-blocks"),
        }
    }
}

/// The output pointer, shared by the tasks; each writes a disjoint set of columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint elements (their own weight rows' columns) and the buffer
// outlives the parallel section.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The element pointer (a method, so closures capture the whole `Out`, which is `Sync`).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `x · Wᵀ` with an explicit instruction set (capped at what the processor has).
pub fn matmul_with(isa: Isa, w: &WeightView<'_>, x: &[f32], m: usize) -> Option<Vec<f32>> {
    let isa = isa.min(crate::cpu::detect());
    // Q4_K or Q6_K with eight rows interleaved: the layout's own kernels where there are
    // some, else the GGUF rows unpacked per task
    let interleaved = Interleaved::of(w.ggml_type);
    let format = match interleaved {
        Some(layout) => layout.format(),
        None => Format::from_ggml(w.ggml_type)?,
    };
    let rb = checked_row_bytes(format, w, x, m)?;
    if interleaved.is_some_and(|layout| !layout.fits(w.rows, w.cols, w.data.len())) {
        return None;
    }
    let (rows, cols) = (w.rows, w.cols);
    let x = &x[..m * cols];

    // The buffers are taken out of the thread-local for the call: while this thread waits in
    // the parallel section below, rayon may run another matmul on it (work stealing), which
    // then finds the slot empty and uses buffers of its own.
    let mut taken = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let out = {
        let scratch = &mut taken;
        match format {
            Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q8_0 => {
                scratch.q8.quantize(isa, x, m, cols)
            }
            Format::Q4K | Format::Q6K => scratch.q8k.quantize(isa, x, m, cols),
            Format::F32 | Format::F16 => {}
        }
        let act = |i: usize| -> Act<'_> {
            match format {
                Format::F32 | Format::F16 => Act::F32(&x[i * cols..(i + 1) * cols]),
                Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q8_0 => {
                    let nb = cols / 32;
                    let q = &scratch.q8;
                    Act::Q8 {
                        qs: &q.qs[i * cols..(i + 1) * cols],
                        d: &q.d[i * nb..(i + 1) * nb],
                        s: &q.s[i * nb..(i + 1) * nb],
                        d8: q.d8.get(i * nb * 8..(i + 1) * nb * 8).unwrap_or(&[]),
                    }
                }
                Format::Q4K | Format::Q6K => {
                    let nb = cols / 256;
                    let q = &scratch.q8k;
                    Act::Q8K {
                        qs: &q.qs[i * cols..(i + 1) * cols],
                        d: &q.d[i * nb..(i + 1) * nb],
                        bsums: &q.bsums[i * nb * 16..(i + 1) * nb * 16],
                    }
                }
            }
        };

        let mut out: Vec<f32> = Vec::with_capacity(m * rows);
        let out_ptr = Out(out.as_mut_ptr());
        let threads = rayon::current_num_threads().max(1);
        // Enough chunks to balance the threads, few enough that each is worth a task; in
        // prefill a chunk's weights stay in L1/L2 while every activation row passes by.
        let per_task = if m <= FEW_ROWS {
            // decode, or a draft step's few rows: each weight row is read once from memory
            // and serves every activation row, so large chunks (few tasks) do best
            rows.div_ceil(threads * 4).max(16)
        } else {
            rows.div_ceil(threads * 8)
                .min((WEIGHT_TILE_BYTES / rb).max(4))
                .max(4)
        };
        // interleaved weights come in groups of eight rows
        let per_task = if interleaved.is_some() {
            per_task.next_multiple_of(GROUP_ROWS)
        } else {
            per_task
        };
        // Weight rows j0..j1 (their bytes `wd`, in GGUF's row layout) against every activation
        // row, into columns j0..j1 of the output.
        let rows_of = |wd: &[u8], j0: usize, j1: usize| {
            #[cfg(target_arch = "x86_64")]
            if m == 1 && avx2::q32_handles(isa, format) {
                // SAFETY: AVX2/FMA/F16C are present (isa was capped at what the processor
                // has, and q32_handles checks the level); rows j0..j1 lie inside the
                // weights, and their outputs are columns j0..j1 of the one output row, which
                // no other task writes.
                unsafe {
                    let out = std::slice::from_raw_parts_mut(out_ptr.at(j0), j1 - j0);
                    avx2::gemv_q32(format, wd, rb, cols, act(0), out);
                }
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if m > 1 && avx2::q32_handles(isa, format) {
                // SAFETY: as above; the tile writes rows 0..m of columns j0..j1 only.
                unsafe {
                    avx2::gemm_q32(format, wd, rb, cols, m, &act, |i, j, v| {
                        *out_ptr.at(i * rows + j0 + j) = v
                    })
                };
                return;
            }
            let mut i = 0;
            while i < m {
                let n = (m - i).min(R);
                // Built once per R activation rows, reused for every weight row of the chunk.
                let acts: [Act<'_>; R] = std::array::from_fn(|r| act(i + r.min(n - 1)));
                for j in j0..j1 {
                    let wrow = &wd[(j - j0) * rb..(j - j0 + 1) * rb];
                    let mut res = [0f32; R];
                    dot_rows(isa, format, wrow, cols, &acts, n, &mut res);
                    for (r, v) in res.iter().enumerate().take(n) {
                        // SAFETY: (i + r) < m and j < rows, so the index is inside the
                        // m × rows buffer; no other task writes column j.
                        unsafe { *out_ptr.at((i + r) * rows + j) = *v };
                    }
                }
                i += n;
            }
        };
        let run = |chunk: usize| {
            let j0 = chunk * per_task;
            let j1 = (j0 + per_task).min(rows);
            if let Some(layout) = interleaved {
                // the layout's kernels, group by group against tiles of activation rows
                // ([`Groups::run`]); without them, the task's rows unpacked for the row kernels
                #[cfg(target_arch = "x86_64")]
                if layout.has_kernel(isa) {
                    let tiles = Groups {
                        m,
                        j0,
                        j1,
                        rb,
                        rows,
                    };
                    // SAFETY (each kernel below): AVX2/FMA/F16C are present (isa was capped
                    // at what the processor has; `has_kernel`), and for Q4_K's `Vnni` AVX-512
                    // F/BW/VL/VNNI (`available`), for Q6_K's what `kernel` checked; `tiles`
                    // hands each a whole group of rows inside the weights (`fits`, per_task a
                    // multiple of 8), activations of `cols` values (with `cols / 32` scales
                    // and sums for Q5_0), and the output of columns j..j + 8 of its rows,
                    // which are this task's alone.
                    match layout {
                        Interleaved::Q4K => {
                            let kernel = if isa >= Isa::Avx512 && q4k_x8::avx512::available() {
                                q4k_x8::Kernel::Vnni
                            } else {
                                q4k_x8::Kernel::Avx2
                            };
                            tiles.run(
                                w.data,
                                out_ptr,
                                |i| act(i).q8k(),
                                |wg, acts, o| unsafe {
                                    q4k_x8::gemm(kernel, wg, cols, acts, o, rows)
                                },
                            );
                        }
                        Interleaved::Q6K => {
                            let kernel = q6k_x8::kernel(isa).unwrap_or(q6k_x8::Kernel::Avx2);
                            tiles.run(
                                w.data,
                                out_ptr,
                                |i| act(i).q8k(),
                                |wg, acts, o| unsafe {
                                    q6k_x8::gemm(kernel, wg, cols, acts, o, rows)
                                },
                            );
                        }
                        Interleaved::Q50 => {
                            let nb = cols / 32;
                            let q8 = |i: usize| {
                                let (qs, d, _, _) = act(i).q8();
                                (qs, d, &scratch.q8.sums[i * nb..(i + 1) * nb])
                            };
                            tiles.run(w.data, out_ptr, q8, |wg, acts, o| unsafe {
                                q5_0_x8::gemm(wg, cols, acts, o, rows)
                            });
                        }
                    }
                    return;
                }
                UNPACKED.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    let (g0, g1) = (j0 / GROUP_ROWS, j1 / GROUP_ROWS);
                    layout.deinterleave(w.data, cols, g0, g1, &mut buf);
                    rows_of(&buf, j0, j1);
                });
                return;
            }
            rows_of(&w.data[j0 * rb..j1 * rb], j0, j1);
        };
        let chunks = rows.div_ceil(per_task);
        if chunks == 1 || threads == 1 {
            (0..chunks).for_each(run);
        } else {
            (0..chunks).into_par_iter().for_each(run);
        }
        // SAFETY: every element of the m × rows buffer was written above.
        unsafe { out.set_len(m * rows) };
        out
    };
    SCRATCH.with(|s| *s.borrow_mut() = taken);
    Some(out)
}

/// A task's share of an interleaved matmul: activation rows `0..m` against weight rows
/// `j0..j1` (whole groups of eight, `rb` bytes a row) of a `rows`-column output.
#[cfg(target_arch = "x86_64")]
struct Groups {
    m: usize,
    j0: usize,
    j1: usize,
    rb: usize,
    rows: usize,
}

#[cfg(target_arch = "x86_64")]
impl Groups {
    /// Group by group against tiles of activation rows: a group's weights are read from
    /// memory once and stay in L1 while the tile passes by. `act(i)` is activation row `i` as
    /// the layout's kernel takes it; `kernel(group, tile, out)` writes the tile's results for
    /// the group's eight columns from `out` (the tile's first row) on.
    fn run<A>(
        &self,
        data: &[u8],
        out: Out,
        act: impl Fn(usize) -> A,
        kernel: impl Fn(&[u8], &[A], *mut f32),
    ) {
        const TILE: usize = 16;
        let group = GROUP_ROWS * self.rb;
        for i0 in (0..self.m).step_by(TILE) {
            let acts: Vec<A> = (i0..(i0 + TILE).min(self.m)).map(&act).collect();
            for j in (self.j0..self.j1).step_by(GROUP_ROWS) {
                kernel(
                    &data[j * self.rb..][..group],
                    &acts,
                    out.at(i0 * self.rows + j),
                );
            }
        }
    }
}

/// One weight row against `n` (≤ R) activation rows; `acts[n..]` repeat the last row.
#[inline]
fn dot_rows(
    isa: Isa,
    format: Format,
    w: &[u8],
    cols: usize,
    acts: &[Act<'_>; R],
    n: usize,
    out: &mut [f32; R],
) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && avx512::handles(format, cols) {
        // SAFETY: the caller capped `isa` at what the processor supports, so AVX-512 F/BW/VL
        // (and AVX2/FMA/F16C) are present; the slices were checked to hold `cols` elements.
        // A kernel for each row count: a draft step's few rows compute no padding rows.
        macro_rules! exactly {
            ($k:literal) => {{
                let part: &[Act<'_>; $k] = acts[..$k].try_into().expect("k <= R");
                let mut res = [0f32; $k];
                avx512::dot_rows(format, w, cols, part, &mut res);
                out[..$k].copy_from_slice(&res);
            }};
        }
        unsafe {
            match n {
                1 => exactly!(1),
                2 => exactly!(2),
                3 => exactly!(3),
                4 => exactly!(4),
                5 => exactly!(5),
                6 => exactly!(6),
                7 => exactly!(7),
                _ => avx512::dot_rows(format, w, cols, acts, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: the caller capped `isa` at what the processor supports, so AVX2, FMA and
        // F16C are present; the slices were checked to hold `cols` elements.
        unsafe {
            if n == 1 {
                // A gemv row: one activation row, no padding rows computed.
                let mut one = [0f32; 1];
                avx2::dot_rows(isa, format, w, cols, &[acts[0]], &mut one);
                out[0] = one[0];
            } else {
                for h in 0..n.div_ceil(R_AVX2) {
                    let part: &[Act<'_>; R_AVX2] = acts[h * R_AVX2..(h + 1) * R_AVX2]
                        .try_into()
                        .expect("R is a multiple of R_AVX2");
                    let mut res = [0f32; R_AVX2];
                    avx2::dot_rows(isa, format, w, cols, part, &mut res);
                    out[h * R_AVX2..(h + 1) * R_AVX2].copy_from_slice(&res);
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa >= Isa::Neon {
        // SAFETY: the caller capped `isa` at what the processor supports, so NEON is present
        // (`neon::dot_rows` checks dotprod itself); the slices were checked to hold `cols`
        // elements.
        unsafe {
            if n == 1 {
                let mut one = [0f32; 1];
                neon::dot_rows(format, w, cols, &[acts[0]], &mut one);
                out[0] = one[0];
            } else {
                neon::dot_rows(format, w, cols, acts, out);
            }
        }
        return;
    }
    let _ = isa;
    for r in 0..n {
        out[r] = scalar::dot(format, w, cols, acts[r]);
    }
}

// The activation rows' quantisation lives here, beside the SIMD block quantisers it calls,
// so that `quant` (formats and the scalar reference) does not depend on this module.
impl Q8Rows {
    /// Quantises `rows` rows of `cols` elements (`cols` a multiple of 32), reusing the buffers.
    pub fn quantize(&mut self, isa: crate::Isa, x: &[f32], rows: usize, cols: usize) {
        let nb = cols / 32;
        self.cols = cols;
        resize(&mut self.qs, rows * cols);
        resize(&mut self.d, rows * nb);
        resize(&mut self.s, rows * nb);
        resize(&mut self.sums, rows * nb);
        let wide = isa >= crate::Isa::Avx512;
        resize(&mut self.d8, if wide { rows * nb * 8 } else { 0 });
        let x = &x[..rows * cols];
        for (b, (((xb, qb), (d, s)), sums)) in x
            .chunks_exact(32)
            .zip(self.qs.chunks_exact_mut(32))
            .zip(self.d.iter_mut().zip(self.s.iter_mut()))
            .zip(self.sums.iter_mut())
            .enumerate()
        {
            let (scale, sum) = quantize_block(isa, xb, qb);
            *d = scale;
            *s = scale * sum as f32;
            *sums = sum;
            if wide {
                self.d8[8 * b..8 * b + 8].fill(scale);
            }
        }
    }
}

impl Q8KRows {
    /// Quantises `rows` rows of `cols` elements (`cols` a multiple of 256), reusing the buffers.
    pub fn quantize(&mut self, isa: crate::Isa, x: &[f32], rows: usize, cols: usize) {
        let nb = cols / 256;
        self.cols = cols;
        resize(&mut self.qs, rows * cols);
        resize(&mut self.d, rows * nb);
        resize(&mut self.bsums, rows * nb * 16);
        let x = &x[..rows * cols];
        for (((xb, qb), d), bs) in x
            .chunks_exact(256)
            .zip(self.qs.chunks_exact_mut(256))
            .zip(self.d.iter_mut())
            .zip(self.bsums.chunks_exact_mut(16))
        {
            *d = quantize_block(isa, xb, qb).0;
            for (b, q) in bs.iter_mut().zip(qb.chunks_exact(16)) {
                *b = q.iter().map(|&v| v as i16).sum();
            }
        }
    }
}

/// Quantises one block (32 or 256 values) of activations; returns its scale and Σq.
pub(crate) fn quantize_block(isa: Isa, x: &[f32], q: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && x.len().is_multiple_of(32) && q.len() == x.len() {
        // SAFETY: AVX2 is present (isa was capped by the caller); lengths checked above.
        return unsafe { avx2::quantize_block(x, q) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa >= Isa::Neon && x.len().is_multiple_of(16) && q.len() == x.len() {
        // SAFETY: NEON is present (isa was capped by the caller); lengths checked above.
        return unsafe { neon::quantize_block(x, q) };
    }
    let _ = isa;
    crate::quant::quantize_block_scalar(x, q)
}

/// The scalar micro-kernels: the same integer sums as the SIMD ones, one element at a time.
mod scalar {
    use super::*;

    pub(super) fn dot(format: Format, w: &[u8], cols: usize, act: Act<'_>) -> f32 {
        match (format, act) {
            (Format::F32, Act::F32(x)) => w
                .chunks_exact(4)
                .zip(x)
                .map(|(b, x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
                .sum(),
            (Format::F16, Act::F32(x)) => (0..cols).map(|i| f16_at(w, 2 * i) * x[i]).sum(),
            (
                Format::Q8_0 | Format::Q4_0 | Format::Q4_1 | Format::Q5_0,
                Act::Q8 { qs, d, s, .. },
            ) => {
                let bb = format.block_bytes();
                let mut acc = 0f32;
                for (b, blk) in w.chunks_exact(bb).enumerate() {
                    let a = &qs[32 * b..32 * b + 32];
                    let dw = f16_at(blk, 0);
                    let (sum, offset) = match format {
                        Format::Q8_0 => (
                            (0..32).map(|i| blk[2 + i] as i8 as i32 * a[i] as i32).sum(),
                            0.0,
                        ),
                        Format::Q4_0 => (nibble_dot(&blk[2..18], a), -8.0 * dw * s[b]),
                        Format::Q4_1 => (nibble_dot(&blk[4..20], a), f16_at(blk, 2) * s[b]),
                        _ => {
                            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                            let mut sum = 0i32;
                            for i in 0..16 {
                                let lo = (blk[6 + i] & 15) as i32 | (((qh >> i) & 1) << 4) as i32;
                                let hi =
                                    (blk[6 + i] >> 4) as i32 | (((qh >> (i + 16)) & 1) << 4) as i32;
                                sum += lo * a[i] as i32 + hi * a[i + 16] as i32;
                            }
                            (sum, -16.0 * dw * s[b])
                        }
                    };
                    acc += dw * d[b] * sum as f32 + offset;
                }
                acc
            }
            (Format::Q4K, Act::Q8K { qs, d, bsums }) => {
                let mut acc = 0f32;
                for (b, blk) in w.chunks_exact(144).enumerate() {
                    let (dw, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                    let scales = &blk[4..16];
                    let q4 = &blk[16..144];
                    let a = &qs[256 * b..256 * b + 256];
                    let (mut sumi, mut summ) = (0i32, 0i32);
                    for j in 0..4 {
                        let (sc1, m1) = q4k_scale_min(2 * j, scales);
                        let (sc2, m2) = q4k_scale_min(2 * j + 1, scales);
                        let (mut s1, mut s2) = (0i32, 0i32);
                        for l in 0..32 {
                            let q = q4[32 * j + l];
                            s1 += (q & 15) as i32 * a[64 * j + l] as i32;
                            s2 += (q >> 4) as i32 * a[64 * j + 32 + l] as i32;
                        }
                        sumi += sc1 as i32 * s1 + sc2 as i32 * s2;
                        let bs = &bsums[16 * b..];
                        summ += m1 as i32 * (bs[4 * j] as i32 + bs[4 * j + 1] as i32)
                            + m2 as i32 * (bs[4 * j + 2] as i32 + bs[4 * j + 3] as i32);
                    }
                    acc += d[b] * (dw * sumi as f32 - dmin * summ as f32);
                }
                acc
            }
            (Format::Q6K, Act::Q8K { qs, d, .. }) => {
                let mut acc = 0f32;
                for (b, blk) in w.chunks_exact(210).enumerate() {
                    let dw = f16_at(blk, 208);
                    let a = &qs[256 * b..256 * b + 256];
                    let mut sumi = 0i32;
                    for half in 0..2 {
                        let ql = &blk[64 * half..];
                        let qh = &blk[128 + 32 * half..];
                        let sc = &blk[192 + 8 * half..];
                        let a = &a[128 * half..];
                        for l in 0..32 {
                            let is = l / 16;
                            let [q1, q2, q3, q4] = q6k_values(ql, qh, l);
                            sumi += sc[is] as i8 as i32 * q1 * a[l] as i32
                                + sc[is + 2] as i8 as i32 * q2 * a[l + 32] as i32
                                + sc[is + 4] as i8 as i32 * q3 * a[l + 64] as i32
                                + sc[is + 6] as i8 as i32 * q4 * a[l + 96] as i32;
                        }
                    }
                    acc += dw * d[b] * sumi as f32;
                }
                acc
            }
            _ => unreachable!("activation kind is chosen from the format"),
        }
    }

    /// Σ nibble·a over a 32-element block whose low nibbles are elements 0..16.
    fn nibble_dot(qs: &[u8], a: &[i8]) -> i32 {
        (0..16)
            .map(|i| (qs[i] & 15) as i32 * a[i] as i32 + (qs[i] >> 4) as i32 * a[i + 16] as i32)
            .sum()
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // lanes and rows indexed side by side
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Act, Format, Isa, R_AVX2};

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    #[inline(always)]
    pub(super) unsafe fn f16(p: *const u8) -> f32 {
        let bits = (p as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 16 bytes of nibbles → 32 bytes: low nibbles in the low lane, high nibbles in the high.
    #[inline(always)]
    pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
        let t = _mm_loadu_si128(p as *const __m128i);
        let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
        _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
    }

    /// Bit i of `x` → 0xFF in byte i.
    #[inline(always)]
    unsafe fn bits_to_bytes(x: u32) -> __m256i {
        let t = _mm256_set1_epi32(x as i32);
        let shuf = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let b = _mm256_shuffle_epi8(t, shuf);
        let b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
        _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1))
    }

    /// Σ u·s over byte pairs → 8 × i32 (u unsigned ≤ 127·2 safe in i16 for our ranges).
    #[inline(always)]
    unsafe fn dot_us(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// Σ a·b over signed bytes → 8 × i32, with |a| precomputed (`abs_a`) and `a` for signs.
    #[inline(always)]
    unsafe fn dot_ss(abs_a: __m256i, a: __m256i, b: __m256i) -> __m256i {
        dot_us(abs_a, _mm256_sign_epi8(b, a))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        let n = x.len();
        let sign = _mm256_set1_ps(-0.0);
        let mut amax = _mm256_setzero_ps();
        for c in (0..n).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(c));
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        }
        let lo = _mm256_castps256_ps128(amax);
        let hi = _mm256_extractf128_ps(amax, 1);
        let m = _mm_max_ps(lo, hi);
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let lim = _mm256_set1_epi32(127);
        let nlim = _mm256_set1_epi32(-127);
        let mut sum = _mm256_setzero_si256();
        for c in (0..n).step_by(32) {
            let mut v = [_mm256_setzero_si256(); 4];
            for (k, v) in v.iter_mut().enumerate() {
                let f = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(c + 8 * k)), id);
                // Round to nearest, ties to even (the MXCSR default), as the scalar reference.
                let r = _mm256_cvtps_epi32(f);
                *v = _mm256_max_epi32(_mm256_min_epi32(r, lim), nlim);
                sum = _mm256_add_epi32(sum, *v);
            }
            let a = _mm256_packs_epi32(v[0], v[1]);
            let b = _mm256_packs_epi32(v[2], v[3]);
            let p = _mm256_packs_epi16(a, b);
            // packs interleave 128-bit lanes: restore element order.
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().add(c) as *mut __m256i, p);
        }
        (d, hsum_i32(sum))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows<const R: usize>(
        isa: Isa,
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let _ = isa;
        match format {
            Format::F32 | Format::F16 => {
                let x: [&[f32]; R] = std::array::from_fn(|r| acts[r].floats());
                dot_f32(
                    w.as_ptr() as *const f32,
                    cols,
                    x,
                    out,
                    format == Format::F16,
                )
            }
            // one instantiation per format: no format test inside the block loop
            Format::Q8_0 => dot_q32::<R, Q8_0>(w, cols, acts, out),
            Format::Q4_0 => dot_q32::<R, Q4_0>(w, cols, acts, out),
            Format::Q4_1 => dot_q32::<R, Q4_1>(w, cols, acts, out),
            Format::Q5_0 => dot_q32::<R, Q5_0>(w, cols, acts, out),
            Format::Q4K => dot_q4k(w, cols, acts, out),
            Format::Q6K => dot_q6k(w, cols, acts, out),
        }
    }

    /// F32 or F16 weights (`f16` true: `w` points at halves) against R f32 rows.
    #[inline(always)]
    unsafe fn dot_f32<const R: usize>(
        w: *const f32,
        cols: usize,
        x: [&[f32]; R],
        out: &mut [f32; R],
        f16: bool,
    ) {
        let load_w = |i: usize| -> __m256 {
            if f16 {
                _mm256_cvtph_ps(_mm_loadu_si128((w as *const u16).add(i) as *const __m128i))
            } else {
                _mm256_loadu_ps(w.add(i))
            }
        };
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut i = 0;
        while i + 16 <= cols {
            let w0 = load_w(i);
            let w1 = load_w(i + 8);
            for r in 0..R {
                let xp = x[r].as_ptr().add(i);
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(8)), acc[r][1]);
            }
            i += 16;
        }
        while i + 8 <= cols {
            let w0 = load_w(i);
            for r in 0..R {
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r].as_ptr().add(i)), acc[r][0]);
            }
            i += 8;
        }
        for r in 0..R {
            let mut s = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
            for t in i..cols {
                let wv = if f16 {
                    half::f16::from_bits((w as *const u16).add(t).read_unaligned()).to_f32()
                } else {
                    w.add(t).read_unaligned()
                };
                s += wv * x[r][t];
            }
            out[r] = s;
        }
    }

    /// Whether [`gemv_q32`] and [`gemm_q32`] take this format at this instruction-set level
    /// (AVX-512 machines keep their own kernels for the formats those handle).
    pub(super) fn q32_handles(isa: Isa, format: Format) -> bool {
        isa >= Isa::Avx2
            && isa < Isa::Avx512
            && matches!(
                format,
                Format::Q8_0 | Format::Q4_0 | Format::Q4_1 | Format::Q5_0
            )
    }

    /// Decode (one activation row): the weight rows of `w` (`rb` bytes each) against one row of
    /// 8-bit activations into `out`, one weight row at a time, in a loop made for the format
    /// (no format test per block). One row, not several sharing each activation block:
    /// interleaving 4 rows streamed slower from memory on the 2-core Zen 3 machine (Qwen
    /// 0.5B's output layer, 145 MB of Q8_0: 12.0–12.7 GB/s with 4 rows, 13.5–17.4 with 1;
    /// Q5_0 6.8–9.1 vs 11.9–13.2; `cargo bench -p docent-kernels -- qwen0.5b-output Q8_0`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_q32(
        format: Format,
        w: &[u8],
        rb: usize,
        cols: usize,
        act: Act<'_>,
        out: &mut [f32],
    ) {
        match format {
            Format::Q8_0 => gemv_q32_as::<Q8_0>(w, rb, cols, act, out),
            Format::Q4_0 => gemv_q32_as::<Q4_0>(w, rb, cols, act, out),
            Format::Q4_1 => gemv_q32_as::<Q4_1>(w, rb, cols, act, out),
            _ => gemv_q32_as::<Q5_0>(w, rb, cols, act, out),
        }
    }

    /// Prefill: the weight rows of `w` against `m` activation rows (`act(i)`), in tiles of
    /// 2 weight rows × [`R_AVX2`] activation rows: each unpacked weight block serves four
    /// activation rows, each activation block two weight rows. `put(i, j, v)` stores the
    /// output of activation row i and weight row j (of `w`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemm_q32<'a>(
        format: Format,
        w: &[u8],
        rb: usize,
        cols: usize,
        m: usize,
        act: &impl Fn(usize) -> Act<'a>,
        put: impl FnMut(usize, usize, f32),
    ) {
        match format {
            Format::Q8_0 => gemm_q32_as::<Q8_0>(w, rb, cols, m, act, put),
            Format::Q4_0 => gemm_q32_as::<Q4_0>(w, rb, cols, m, act, put),
            Format::Q4_1 => gemm_q32_as::<Q4_1>(w, rb, cols, m, act, put),
            _ => gemm_q32_as::<Q5_0>(w, rb, cols, m, act, put),
        }
    }

    #[inline(always)]
    unsafe fn gemm_q32_as<'a, const F: u8>(
        w: &[u8],
        rb: usize,
        cols: usize,
        m: usize,
        act: &impl Fn(usize) -> Act<'a>,
        mut put: impl FnMut(usize, usize, f32),
    ) {
        let rows = w.len() / rb;
        let mut i = 0;
        while i < m {
            let n = (m - i).min(R_AVX2);
            let acts: [Act<'a>; R_AVX2] = std::array::from_fn(|r| act(i + r.min(n - 1)));
            let mut j = 0;
            while j < rows {
                let wr = (rows - j).min(2);
                let mut res = [[0f32; R_AVX2]; 2];
                if wr == 2 {
                    tile_q32::<2, F>(w.as_ptr().add(j * rb), rb, cols, &acts, &mut res);
                } else {
                    let mut one = [[0f32; R_AVX2]; 1];
                    tile_q32::<1, F>(w.as_ptr().add(j * rb), rb, cols, &acts, &mut one);
                    res[0] = one[0];
                }
                for (k, row) in res.iter().enumerate().take(wr) {
                    for (r, &v) in row.iter().enumerate().take(n) {
                        put(i + r, j + k, v);
                    }
                }
                j += wr;
            }
            i += n;
        }
    }

    /// One weight block of a 32-element format, ready for the integer dot product: Q8_0, Q4_0
    /// and Q5_0 as signed values (`s`) and their magnitudes (`a`), for `dot_ss`; Q4_1 as
    /// unsigned values in `a`, with its min in `min`.
    #[derive(Clone, Copy)]
    struct Block {
        a: __m256i,
        s: __m256i,
        d: f32,
        min: f32,
    }

    #[inline(always)]
    unsafe fn block<const F: u8>(blk: *const u8) -> Block {
        let d = f16(blk);
        let (s, min) = match F {
            Q8_0 => (_mm256_loadu_si256(blk.add(2) as *const __m256i), 0.0),
            Q4_0 => (
                _mm256_sub_epi8(nibbles(blk.add(2)), _mm256_set1_epi8(8)),
                0.0,
            ),
            Q4_1 => {
                let u = nibbles(blk.add(4));
                return Block {
                    a: u,
                    s: u,
                    d,
                    min: f16(blk.add(2)),
                };
            }
            _ => {
                let qh = (blk.add(2) as *const u32).read_unaligned();
                let hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
                let u = _mm256_or_si256(nibbles(blk.add(6)), hb);
                (_mm256_sub_epi8(u, _mm256_set1_epi8(16)), 0.0)
            }
        };
        Block {
            a: _mm256_sign_epi8(s, s),
            s,
            d,
            min,
        }
    }

    /// Σ weight · activation over one block, as 8 × i32.
    #[inline(always)]
    unsafe fn block_dot<const F: u8>(w: &Block, y: __m256i) -> __m256i {
        if F == Q4_1 {
            dot_us(w.a, y)
        } else {
            dot_ss(w.a, w.s, y)
        }
    }

    /// `W` weight rows (`rb` bytes apart) against [`R_AVX2`] activation rows. Per output the
    /// same operations in the same order as [`row_q32`], so a row's result does not depend
    /// on how many rows are computed with it (batched decode gives the tokens of single).
    #[inline(always)]
    unsafe fn tile_q32<const W: usize, const F: u8>(
        w: *const u8,
        rb: usize,
        cols: usize,
        acts: &[Act<'_>; R_AVX2],
        out: &mut [[f32; R_AVX2]; W],
    ) {
        const A: usize = R_AVX2;
        let mut qs = [std::ptr::null::<i8>(); A];
        let mut ds = [std::ptr::null::<f32>(); A];
        let mut ss = [std::ptr::null::<f32>(); A];
        for r in 0..A {
            let (q, d, s, _) = acts[r].q8();
            qs[r] = q.as_ptr();
            ds[r] = d.as_ptr();
            ss[r] = s.as_ptr();
        }
        let bb = block_bytes::<F>();
        let nb = cols / 32;
        let mut acc = [[_mm256_setzero_ps(); A]; W];
        let mut off = [[0f32; A]; W];
        for b in 0..nb {
            // a loop, not array::from_fn: a closure would not inherit the target features
            let mut blocks = [Block {
                a: _mm256_setzero_si256(),
                s: _mm256_setzero_si256(),
                d: 0.0,
                min: 0.0,
            }; W];
            for (k, blk) in blocks.iter_mut().enumerate() {
                *blk = block::<F>(w.add(k * rb + b * bb));
            }
            for r in 0..A {
                let y = _mm256_loadu_si256(qs[r].add(32 * b) as *const __m256i);
                let dy = *ds[r].add(b);
                for k in 0..W {
                    let p = block_dot::<F>(&blocks[k], y);
                    acc[k][r] = _mm256_fmadd_ps(
                        _mm256_set1_ps(blocks[k].d * dy),
                        _mm256_cvtepi32_ps(p),
                        acc[k][r],
                    );
                    if F == Q4_1 {
                        off[k][r] += blocks[k].min * *ss[r].add(b);
                    }
                }
            }
        }
        for k in 0..W {
            for r in 0..A {
                out[k][r] = hsum(acc[k][r]) + off[k][r];
            }
        }
    }

    #[inline(always)]
    fn block_bytes<const F: u8>() -> usize {
        match F {
            Q8_0 => Format::Q8_0,
            Q4_0 => Format::Q4_0,
            Q4_1 => Format::Q4_1,
            _ => Format::Q5_0,
        }
        .block_bytes()
    }

    #[inline(always)]
    unsafe fn gemv_q32_as<const F: u8>(
        w: &[u8],
        rb: usize,
        cols: usize,
        act: Act<'_>,
        out: &mut [f32],
    ) {
        for (j, o) in out.iter_mut().enumerate() {
            *o = row_q32::<F>(w.as_ptr().add(j * rb), cols, act);
        }
    }

    /// One weight row against one activation row.
    #[inline(always)]
    unsafe fn row_q32<const F: u8>(w: *const u8, cols: usize, act: Act<'_>) -> f32 {
        let (qs, ds, ss, _) = act.q8();
        let (qs, ds, ss) = (qs.as_ptr(), ds.as_ptr(), ss.as_ptr());
        let bb = block_bytes::<F>();
        let mut acc = _mm256_setzero_ps();
        let mut off = 0f32;
        for b in 0..cols / 32 {
            let y = _mm256_loadu_si256(qs.add(32 * b) as *const __m256i);
            let blk = block::<F>(w.add(b * bb));
            let p = block_dot::<F>(&blk, y);
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(blk.d * *ds.add(b)),
                _mm256_cvtepi32_ps(p),
                acc,
            );
            if F == Q4_1 {
                off += blk.min * *ss.add(b);
            }
        }
        hsum(acc) + off
    }

    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;
    const Q5_0: u8 = 3;

    /// One weight row of a 32-element format (`F`: one of the constants above) against R
    /// rows of 8-bit activations (R is 1 or [`R_AVX2`]), on the kernels of decode and prefill,
    /// for AVX-512 machines whose own kernels decline the shape.
    #[inline(always)]
    unsafe fn dot_q32<const R: usize, const F: u8>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        if R == 1 {
            out[0] = row_q32::<F>(w.as_ptr(), cols, acts[0]);
            return;
        }
        let acts: &[Act<'_>; R_AVX2] = acts.as_slice().try_into().expect("R is 1 or R_AVX2");
        let mut res = [[0f32; R_AVX2]; 1];
        tile_q32::<1, F>(w.as_ptr(), 0, cols, acts, &mut res);
        out.copy_from_slice(&res[0]);
    }

    #[inline(always)]
    pub(super) fn q8k(act: &Act<'_>) -> (*const i8, *const f32, *const i16) {
        let (qs, d, bsums) = act.q8k();
        (qs.as_ptr(), d.as_ptr(), bsums.as_ptr())
    }

    /// Q4_K's 12 bytes of six-bit scales and mins → (8 scales, 8 mins), one byte each, in two
    /// u64s (ggml's bit shuffle; the same values as [`super::q4k_scale_min`]).
    #[inline(always)]
    pub(super) unsafe fn q4k_scales_mins(p: *const u8) -> (u64, u64) {
        const K1: u32 = 0x3f3f_3f3f;
        const K2: u32 = 0x0f0f_0f0f;
        const K3: u32 = 0x0303_0303;
        let u0 = (p as *const u32).read_unaligned();
        let u1 = (p.add(4) as *const u32).read_unaligned();
        let u2 = (p.add(8) as *const u32).read_unaligned();
        let sc_lo = u0 & K1;
        let sc_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
        let mn_lo = u1 & K1;
        let mn_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
        (
            sc_lo as u64 | (sc_hi as u64) << 32,
            mn_lo as u64 | (mn_hi as u64) << 32,
        )
    }

    /// Σ over a row's 8 Q4_K sub-blocks of min · (sum of the sub-block's activations): the
    /// 16 bsums of a 256-block added in pairs, times the 8 mins → 4 × i32.
    #[inline(always)]
    unsafe fn q4k_min_sums(mins: __m128i, bs: *const i16) -> __m128i {
        let lo = _mm_loadu_si128(bs as *const __m128i);
        let hi = _mm_loadu_si128(bs.add(8) as *const __m128i);
        _mm_madd_epi16(mins, _mm_hadd_epi16(lo, hi))
    }

    /// `acc` plus `scale` × [`q4k_min_sums`] (the mins' correction of one Q4_K block for one
    /// activation row, 4 lanes).
    #[inline(always)]
    pub(super) unsafe fn q4k_mins_acc(
        acc: __m128,
        mins: __m128i,
        bs: *const i16,
        scale: f32,
    ) -> __m128 {
        let pm = q4k_min_sums(mins, bs);
        _mm_fmadd_ps(_mm_set1_ps(scale), _mm_cvtepi32_ps(pm), acc)
    }

    #[inline(always)]
    pub(super) unsafe fn hsum128(v: __m128) -> f32 {
        let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Q4_K against R rows of Q8_K activations. Per row the integer sums of a block go into a
    /// float vector (one horizontal sum per call, not per block), and the mins' correction is
    /// a vector multiply-add of the mins with the activations' pairwise block sums.
    #[inline(always)]
    unsafe fn dot_q4k<const R: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let a: [_; R] = std::array::from_fn(|r| q8k(&acts[r]));
        let nb = cols / 256;
        let mut acc = [_mm256_setzero_ps(); R];
        let mut accm = [_mm_setzero_ps(); R];
        let m4 = _mm256_set1_epi8(0x0F);
        for b in 0..nb {
            let blk = w.as_ptr().add(b * 144);
            let dw = f16(blk);
            let dmin = f16(blk.add(2));
            let (sc, mn) = q4k_scales_mins(blk.add(4));
            let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
            // a loop, not array::from_fn: a closure would not inherit the target features
            let mut scv = [_mm256_setzero_si256(); 8];
            for (j, v) in scv.iter_mut().enumerate() {
                *v = _mm256_set1_epi16(((sc >> (8 * j)) & 0xFF) as i16);
            }
            let mut lo = [_mm256_setzero_si256(); 4];
            let mut hi = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let q = _mm256_loadu_si256(blk.add(16 + 32 * j) as *const __m256i);
                lo[j] = _mm256_and_si256(q, m4);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            for r in 0..R {
                let (qs, d, bs) = a[r];
                let qs = qs.add(256 * b);
                let mut sumi = _mm256_setzero_si256();
                for j in 0..4 {
                    let yl = _mm256_loadu_si256(qs.add(64 * j) as *const __m256i);
                    let yh = _mm256_loadu_si256(qs.add(64 * j + 32) as *const __m256i);
                    let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], yl), scv[2 * j]);
                    let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], yh), scv[2 * j + 1]);
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
                }
                let dy = *d.add(b);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dy), _mm256_cvtepi32_ps(sumi), acc[r]);
                accm[r] = q4k_mins_acc(accm[r], mins, bs.add(16 * b), dmin * dy);
            }
        }
        for r in 0..R {
            out[r] = hsum(acc[r]) - hsum128(accm[r]);
        }
    }

    /// Q6_K against R rows of Q8_K activations; the stored values are q + 32, so 32 · Σ scale ·
    /// (sum of the group) comes off each block's integer sum, lane-wise in a vector.
    #[inline(always)]
    unsafe fn dot_q6k<const R: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let a: [_; R] = std::array::from_fn(|r| q8k(&acts[r]));
        let nb = cols / 256;
        let mut acc = [_mm256_setzero_ps(); R];
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        for b in 0..nb {
            let blk = w.as_ptr().add(b * 210);
            let dw = f16(blk.add(208));
            let sc = std::slice::from_raw_parts(blk.add(192) as *const i8, 16);
            // the 16 scales as i16, for the correction
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
            // Unpack the 256 six-bit values (0..63) once for all rows: u[half][k] holds
            // elements 128·half + 32·k .. + 32, whose groups of 16 use scales 8·half + 2k (+1).
            let mut u = [[_mm256_setzero_si256(); 4]; 2];
            let mut scv = [[_mm256_setzero_si256(); 4]; 2];
            for half in 0..2 {
                let ql = blk.add(64 * half);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * half) as *const __m256i);
                let ql0 = _mm256_loadu_si256(ql as *const __m256i);
                let ql1 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                let h0 = _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4);
                let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4);
                let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4);
                let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4);
                u[half][0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), h0);
                u[half][1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), h1);
                u[half][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), h2);
                u[half][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), h3);
                for k in 0..4 {
                    let s0 = sc[8 * half + 2 * k] as i16;
                    let s1 = sc[8 * half + 2 * k + 1] as i16;
                    scv[half][k] = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                }
            }
            for r in 0..R {
                let (qs, d, bs) = a[r];
                let qs = qs.add(256 * b);
                let mut sumi = _mm256_setzero_si256();
                for half in 0..2 {
                    for k in 0..4 {
                        let y = _mm256_loadu_si256(qs.add(128 * half + 32 * k) as *const __m256i);
                        let p =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u[half][k], y), scv[half][k]);
                        sumi = _mm256_add_epi32(sumi, p);
                    }
                }
                let bsv = _mm256_loadu_si256(bs.add(16 * b) as *const __m256i);
                let corr = _mm256_madd_epi16(sc16, bsv);
                let sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(corr, 5));
                let dy = *d.add(b);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dy), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
        for r in 0..R {
            out[r] = hsum(acc[r]);
        }
    }
}

/// AVX-512 kernels: two 32-element blocks per 512-bit register for the 32-element formats
/// (with VNNI's `vpdpbusd` where the processor has it), 16 lanes for F32/F16, and 64 elements
/// per register for Q4_K/Q6_K (their scales applied as 16-bit multiply-adds, fused with the
/// accumulation by VNNI's `vpdpwssd` where the processor has it).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // lanes and rows indexed side by side
mod avx512 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use super::avx2::{f16, hsum128, nibbles, q4k_mins_acc, q4k_scales_mins, q8k};
    use super::{Act, Format};

    /// Whether these kernels take `format` at this width (an even number of 32-blocks; the K
    /// formats always come in whole 256-blocks).
    pub(super) fn handles(format: Format, cols: usize) -> bool {
        match format {
            Format::F32 | Format::F16 | Format::Q4K | Format::Q6K => true,
            Format::Q8_0 | Format::Q4_0 | Format::Q4_1 | Format::Q5_0 => cols.is_multiple_of(64),
        }
    }

    fn vnni() -> bool {
        static VNNI: OnceLock<bool> = OnceLock::new();
        *VNNI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vnni"))
    }

    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be present; `w` and the activations must hold
    /// `cols` elements.
    pub(super) unsafe fn dot_rows<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        match format {
            Format::F32 | Format::F16 => dot_float(format == Format::F16, w, cols, acts, out),
            Format::Q4K | Format::Q6K if vnni() => dot_k_vnni(format, w, cols, acts, out),
            Format::Q4K | Format::Q6K => dot_k_bw(format, w, cols, acts, out),
            _ if vnni() => dot_q32_vnni(format, w, cols, acts, out),
            _ => dot_q32_bw(format, w, cols, acts, out),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot_k_vnni<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        if format == Format::Q4K {
            dot_q4k::<R, true>(w, cols, acts, out)
        } else {
            dot_q6k::<R, true>(w, cols, acts, out)
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn dot_k_bw<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        if format == Format::Q4K {
            dot_q4k::<R, false>(w, cols, acts, out)
        } else {
            dot_q6k::<R, false>(w, cols, acts, out)
        }
    }

    /// `acc + Σ pairs of (u·s) · scale` → 16 × i32: `u` unsigned bytes, `s` signed bytes,
    /// `scale` 32 × i16 (one per pair of bytes).
    #[inline(always)]
    unsafe fn scaled_dot<const VNNI: bool>(
        acc: __m512i,
        u: __m512i,
        s: __m512i,
        scale: __m512i,
    ) -> __m512i {
        let p = _mm512_maddubs_epi16(u, s);
        if VNNI {
            _mm512_dpwssd_epi32(acc, p, scale)
        } else {
            _mm512_add_epi32(acc, _mm512_madd_epi16(p, scale))
        }
    }

    /// The activation rows' (qs, d, bsums) pointers.
    #[inline(always)]
    fn q8k_rows<const R: usize>(acts: &[Act<'_>; R]) -> [(*const i8, *const f32, *const i16); R] {
        let mut a = [(std::ptr::null(), std::ptr::null(), std::ptr::null()); R];
        for r in 0..R {
            a[r] = q8k(&acts[r]);
        }
        a
    }

    /// Σ over a 256-block of one activation row (`qs`) · the block's 4 registers of unpacked
    /// weights, each times its scales → 16 × i32.
    #[inline(always)]
    unsafe fn block_sum<const VNNI: bool>(
        qs: *const i8,
        q: &[__m512i; 4],
        scales: &[__m512i; 4],
    ) -> __m512i {
        let mut sumi = _mm512_setzero_si512();
        for k in 0..4 {
            let y = _mm512_loadu_si512(qs.add(64 * k) as *const _);
            sumi = scaled_dot::<VNNI>(sumi, q[k], y, scales[k]);
        }
        sumi
    }

    /// Q4_K against R rows of Q8_K activations. A register holds 64 weights, the low and the
    /// high nibbles of 32 bytes (two sub-blocks of 32, contiguous in the activations), with
    /// the two sub-blocks' scales in its two halves; the mins' correction as in the AVX2
    /// kernel.
    #[inline(always)]
    unsafe fn dot_q4k<const R: usize, const VNNI: bool>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let a = q8k_rows(acts);
        let nb = cols / 256;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut accm = [_mm_setzero_ps(); R];
        let m4 = _mm512_set1_epi8(0x0F);
        // the low half of a register keeps the low nibbles, the high half the high ones
        let shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
        // register j holds sub-blocks 2j (low half) and 2j + 1 (high half): its scales are
        // picked from the 8 (i16 lanes 0..8) by lanes 0..16 ← 2j, lanes 16..32 ← 2j + 1
        let mut pick = [_mm512_setzero_si512(); 4];
        for (j, p) in pick.iter_mut().enumerate() {
            let (lo, hi) = (2 * j as i16, 2 * j as i16 + 1);
            *p = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
                _mm256_set1_epi16(hi),
                1,
            );
        }
        for b in 0..nb {
            let blk = w.as_ptr().add(b * 144);
            let dw = f16(blk);
            let dmin = f16(blk.add(2));
            let (sc, mn) = q4k_scales_mins(blk.add(4));
            let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
            let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let mut q = [_mm512_setzero_si512(); 4];
            let mut scv = [_mm512_setzero_si512(); 4];
            for j in 0..4 {
                let raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    blk.add(16 + 32 * j) as *const __m256i
                ));
                q[j] = _mm512_and_si512(_mm512_srlv_epi64(raw, shift), m4);
                scv[j] = _mm512_permutexvar_epi16(pick[j], sc16);
            }
            for r in 0..R {
                let (qs, d, bs) = a[r];
                let sumi = block_sum::<VNNI>(qs.add(256 * b), &q, &scv);
                let dy = *d.add(b);
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * dy), _mm512_cvtepi32_ps(sumi), acc[r]);
                accm[r] = q4k_mins_acc(accm[r], mins, bs.add(16 * b), dmin * dy);
            }
        }
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(acc[r]) - hsum128(accm[r]);
        }
    }

    /// Q6_K against R rows of Q8_K activations. A register holds 64 six-bit values (0..63,
    /// the stored q + 32), contiguous in the activations; its four 128-bit lanes are four
    /// groups of 16 with a scale each. The 32 · Σ scale · (group sum) offset comes off each
    /// block's integer sum as in the AVX2 kernel.
    #[inline(always)]
    unsafe fn dot_q6k<const R: usize, const VNNI: bool>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let a = q8k_rows(acts);
        let nb = cols / 256;
        let mut acc = [_mm512_setzero_ps(); R];
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(0x03);
        // the high half of a register takes the high bits two places further up
        let shift = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
        // register g (of 4) covers the groups 4g .. 4g + 4, one per 128-bit lane
        let mut pick = [_mm512_setzero_si512(); 4];
        for (g, p) in pick.iter_mut().enumerate() {
            let g = 4 * g as i16;
            *p = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(g + 1), _mm_set1_epi16(g))),
                _mm256_set_m128i(_mm_set1_epi16(g + 3), _mm_set1_epi16(g + 2)),
                1,
            );
        }
        for b in 0..nb {
            let blk = w.as_ptr().add(b * 210);
            let dw = f16(blk.add(208));
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
            let sc512 = _mm512_castsi256_si512(sc16);
            // u[2h + k]: elements 128h + 64k .. + 64
            let mut u = [_mm512_setzero_si512(); 4];
            let mut scv = [_mm512_setzero_si512(); 4];
            for h in 0..2 {
                let ql = _mm512_loadu_si512(blk.add(64 * h) as *const _);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    blk.add(128 + 32 * h) as *const __m256i
                ));
                let qh = _mm512_srlv_epi64(qh, shift);
                let h01 = _mm512_slli_epi16(_mm512_and_si512(qh, m2), 4);
                let h23 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), m2), 4);
                u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), h01);
                u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), h23);
            }
            for g in 0..4 {
                scv[g] = _mm512_permutexvar_epi16(pick[g], sc512);
            }
            for r in 0..R {
                let (qs, d, bs) = a[r];
                let sumi = block_sum::<VNNI>(qs.add(256 * b), &u, &scv);
                let bsv = _mm256_loadu_si256(bs.add(16 * b) as *const __m256i);
                let corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsv), 5);
                let sumi = _mm512_sub_epi32(sumi, _mm512_zextsi256_si512(corr));
                let dy = *d.add(b);
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * dy), _mm512_cvtepi32_ps(sumi), acc[r]);
            }
        }
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(acc[r]);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn dot_float<const R: usize>(
        f16: bool,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let x: [*const f32; R] = std::array::from_fn(|r| acts[r].floats().as_ptr());
        let wp = w.as_ptr();
        let load_w = |i: usize| -> __m512 {
            if f16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(2 * i) as *const __m256i))
            } else {
                _mm512_loadu_ps(wp.add(4 * i) as *const f32)
            }
        };
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let mut i = 0;
        while i + 32 <= cols {
            let w0 = load_w(i);
            let w1 = load_w(i + 16);
            for r in 0..R {
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r].add(i)), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r].add(i + 16)), acc[r][1]);
            }
            i += 32;
        }
        if i < cols {
            // The tail, up to 31 elements, through masked loads (16 at a time).
            while i < cols {
                let k = (cols - i).min(16);
                let mask: __mmask16 = ((1u32 << k) - 1) as __mmask16;
                let wv = if f16 {
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wp.add(2 * i) as *const i16))
                } else {
                    _mm512_maskz_loadu_ps(mask, wp.add(4 * i) as *const f32)
                };
                for r in 0..R {
                    let xv = _mm512_maskz_loadu_ps(mask, x[r].add(i));
                    acc[r][0] = _mm512_fmadd_ps(wv, xv, acc[r][0]);
                }
                i += k;
            }
        }
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot_q32_vnni<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        dot_q32::<R, true>(format, w, cols, acts, out)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn dot_q32_bw<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        dot_q32::<R, false>(format, w, cols, acts, out)
    }

    /// Σ u·s over byte quadruples → 16 × i32 (`u` unsigned, `s` signed).
    #[inline(always)]
    unsafe fn dot_us<const VNNI: bool>(u: __m512i, s: __m512i) -> __m512i {
        if VNNI {
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s)
        } else {
            _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))
        }
    }

    /// The 32 bytes of one block as unsigned values (Q4_0/Q4_1/Q5_0) or signed ones (Q8_0).
    #[inline(always)]
    unsafe fn block_bytes(format: Format, blk: *const u8) -> __m256i {
        match format {
            Format::Q8_0 => _mm256_loadu_si256(blk.add(2) as *const __m256i),
            Format::Q4_0 => nibbles(blk.add(2)),
            Format::Q4_1 => nibbles(blk.add(4)),
            _ => {
                let qh = (blk.add(2) as *const u32).read_unaligned();
                let hb = _mm256_maskz_set1_epi8(qh, 0x10);
                _mm256_or_si256(nibbles(blk.add(6)), hb)
            }
        }
    }

    /// The constant a block adds per unit of activation sum: d·q + k·Σy (Q8_0 has none).
    #[inline(always)]
    unsafe fn offset(format: Format, blk: *const u8, dw: f32) -> f32 {
        match format {
            Format::Q4_0 => -8.0 * dw,
            Format::Q4_1 => f16(blk.add(2)),
            Format::Q5_0 => -16.0 * dw,
            _ => 0.0,
        }
    }

    #[inline(always)]
    unsafe fn dot_q32<const R: usize, const VNNI: bool>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let mut qs = [std::ptr::null::<i8>(); R];
        let mut d8s = [std::ptr::null::<f32>(); R];
        let mut ss = [std::ptr::null::<f32>(); R];
        for r in 0..R {
            let (q, _, s, d8) = acts[r].q8();
            assert!(d8.len() * 4 == q.len(), "AVX-512 activations carry d8");
            qs[r] = q.as_ptr();
            d8s[r] = d8.as_ptr();
            ss[r] = s.as_ptr();
        }
        let bb = format.block_bytes();
        let nb = cols / 32;
        let signed = format == Format::Q8_0;
        // Lanes 0..8 of a product belong to the first block of a pair, 8..16 to the second.
        let pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut off = [_mm_setzero_ps(); R];
        let wp = w.as_ptr();
        let mut b = 0;
        while b + 2 <= nb {
            let b0 = wp.add(b * bb);
            let b1 = wp.add((b + 1) * bb);
            let (d0, d1) = (f16(b0), f16(b1));
            let q = _mm512_inserti64x4(
                _mm512_castsi256_si512(block_bytes(format, b0)),
                block_bytes(format, b1),
                1,
            );
            let (u, neg) = if signed {
                (_mm512_abs_epi8(q), _mm512_movepi8_mask(q))
            } else {
                (q, 0)
            };
            let dw =
                _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_setr_ps(d0, d1, 0.0, 0.0)));
            let kw = _mm_setr_ps(offset(format, b0, d0), offset(format, b1, d1), 0.0, 0.0);
            for r in 0..R {
                let mut y = _mm512_loadu_si512(qs[r].add(32 * b) as *const _);
                if signed {
                    y = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
                }
                let p = _mm512_cvtepi32_ps(dot_us::<VNNI>(u, y));
                let scale = _mm512_mul_ps(dw, _mm512_loadu_ps(d8s[r].add(8 * b)));
                acc[r] = _mm512_fmadd_ps(p, scale, acc[r]);
                if !signed {
                    // two f32 (8 bytes, any alignment)
                    let sy = _mm_castsi128_ps(_mm_loadl_epi64(ss[r].add(b) as *const __m128i));
                    off[r] = _mm_fmadd_ps(kw, sy, off[r]);
                }
            }
            b += 2;
        }
        for r in 0..R {
            let o = _mm_add_ss(off[r], _mm_movehdup_ps(off[r]));
            out[r] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(o);
        }
    }

    #[cfg(test)]
    mod tests {
        use super::super::{scalar, Act};
        use super::*;
        use crate::quant::testutil::{random_row, Rng};
        use crate::quant::{Q8KRows, Q8Rows};

        /// The K formats' 512-bit variants (VNNI and plain AVX-512 BW, whichever the
        /// processor has) against the scalar micro-kernel on the same 8-bit activations, for
        /// one row (decode) and eight (prefill).
        #[test]
        fn k_format_variants_match_the_scalar_kernel() {
            if crate::cpu::detect() < crate::Isa::Avx512 {
                return;
            }
            let mut rng = Rng(78);
            for format in [Format::Q4K, Format::Q6K] {
                for _ in 0..4 {
                    let cols = 256 * (1 + rng.below(6));
                    let w = random_row(&mut rng, format, cols);
                    let x: Vec<f32> = (0..8 * cols).map(|_| rng.f32()).collect();
                    let mut q = Q8KRows::default();
                    q.quantize(crate::Isa::Avx512, &x, 8, cols);
                    let nb = cols / 256;
                    let acts: [Act<'_>; 8] = std::array::from_fn(|r| Act::Q8K {
                        qs: &q.qs[r * cols..(r + 1) * cols],
                        d: &q.d[r * nb..(r + 1) * nb],
                        bsums: &q.bsums[r * nb * 16..(r + 1) * nb * 16],
                    });
                    let mut bw = [0f32; 8];
                    let mut one = [0f32; 1];
                    // SAFETY: AVX-512 F/BW/VL were detected above.
                    unsafe {
                        dot_k_bw(format, &w, cols, &acts, &mut bw);
                        dot_k_bw(format, &w, cols, &[acts[0]], &mut one);
                    }
                    let mut variants = vec![("bw", bw.to_vec()), ("bw one row", one.to_vec())];
                    if std::arch::is_x86_feature_detected!("avx512vnni") {
                        let mut v = [0f32; 8];
                        let mut v1 = [0f32; 1];
                        // SAFETY: AVX-512 VNNI was detected too.
                        unsafe {
                            dot_k_vnni(format, &w, cols, &acts, &mut v);
                            dot_k_vnni(format, &w, cols, &[acts[0]], &mut v1);
                        }
                        variants.push(("vnni", v.to_vec()));
                        variants.push(("vnni one row", v1.to_vec()));
                    }
                    for (name, got) in &variants {
                        for (r, g) in got.iter().enumerate() {
                            let want = scalar::dot(format, &w, cols, acts[r]);
                            assert!(
                                (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                                "{} {name} row {r}: {g} vs {want}",
                                format.name()
                            );
                        }
                    }
                }
            }
        }

        /// Both 512-bit variants (VNNI and plain AVX-512 BW), whichever the processor has,
        /// against the scalar micro-kernel on the same 8-bit activations.
        #[test]
        fn vnni_and_bw_variants_match_the_scalar_kernel() {
            if crate::cpu::detect() < crate::Isa::Avx512 {
                return;
            }
            let mut rng = Rng(77);
            for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1, Format::Q5_0] {
                let cols = 64 * (1 + rng.below(12));
                let w = random_row(&mut rng, format, cols);
                let x: Vec<f32> = (0..4 * cols).map(|_| rng.f32()).collect();
                let mut q = Q8Rows::default();
                q.quantize(crate::Isa::Avx512, &x, 4, cols);
                let nb = cols / 32;
                let acts: [Act<'_>; 4] = std::array::from_fn(|r| Act::Q8 {
                    qs: &q.qs[r * cols..(r + 1) * cols],
                    d: &q.d[r * nb..(r + 1) * nb],
                    s: &q.s[r * nb..(r + 1) * nb],
                    d8: &q.d8[r * nb * 8..(r + 1) * nb * 8],
                });
                let mut bw = [0f32; 4];
                // SAFETY: AVX-512 F/BW/VL were detected above.
                unsafe { dot_q32_bw(format, &w, cols, &acts, &mut bw) };
                let mut variants = vec![("bw", bw)];
                if std::arch::is_x86_feature_detected!("avx512vnni") {
                    let mut v = [0f32; 4];
                    // SAFETY: AVX-512 VNNI was detected too.
                    unsafe { dot_q32_vnni(format, &w, cols, &acts, &mut v) };
                    variants.push(("vnni", v));
                }
                for r in 0..4 {
                    let want = scalar::dot(format, &w, cols, acts[r]);
                    for (name, got) in &variants {
                        assert!(
                            (got[r] - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{} {name}: {} vs {want}",
                            format.name(),
                            got[r]
                        );
                    }
                }
            }
        }
    }
}

/// NEON kernels (aarch64), 4 lanes: every format. The integer dot products use `sdot` (the
/// dotprod extension) where the processor has it, else widening multiplies (`smull`) and
/// pairwise accumulation (`sadalp`); both variants compute the same integer sums as the scalar
/// kernels. F16 weights are widened with `fcvtl` (base ARMv8, no FP16 extension needed).
#[cfg(target_arch = "aarch64")]
#[allow(clippy::needless_range_loop)] // lanes and rows indexed side by side
pub(crate) mod neon {
    use std::arch::aarch64::*;
    use std::arch::asm;

    use super::{Act, Format};

    /// Σ a·b over 16 byte pairs, added to the four i32 lanes of `acc` (which lane gets which
    /// pair is unspecified: callers only use the sum of the lanes). One of `a`, `b` must lie in
    /// -127..=127 (the activations do), so that two products fit an i16.
    pub(super) trait Dot {
        unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
    }

    /// `sdot` (dotprod extension): only instantiated in functions compiled with `dotprod`.
    pub(super) struct Sdot;

    /// Baseline NEON: `smull` + `smlal2` (two products per i16 lane) then `sadalp`.
    pub(super) struct Smull;

    impl Dot for Sdot {
        #[inline(always)]
        unsafe fn dot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            // SAFETY: register-only; the enclosing function enables dotprod, which the
            // dispatch checked.
            unsafe {
                asm!(
                    "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                    acc = inout(vreg) acc,
                    a = in(vreg) a,
                    b = in(vreg) b,
                    options(pure, nomem, nostack, preserves_flags)
                );
            }
            acc
        }
    }

    impl Dot for Smull {
        #[inline(always)]
        unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            // |a·b| <= 128·127 per product, so two of them fit an i16.
            let p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
            let p = vmlal_high_s8(p, a, b);
            vpadalq_s16(acc, p)
        }
    }

    /// Four F16 values (raw bits) widened to f32.
    #[inline(always)]
    pub(crate) unsafe fn f16x4(h: uint16x4_t) -> float32x4_t {
        let f: float32x4_t;
        // SAFETY: register-only; fcvtl from halves is base ARMv8 AdvSIMD.
        unsafe {
            asm!(
                "fcvtl {f:v}.4s, {h:v}.4h",
                f = out(vreg) f,
                h = in(vreg) h,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        f
    }

    /// Eight F16 values (raw bits) widened to f32: lanes 0..4 and 4..8.
    #[inline(always)]
    unsafe fn f16x8(h: uint16x8_t) -> (float32x4_t, float32x4_t) {
        let (lo, hi): (float32x4_t, float32x4_t);
        // SAFETY: register-only; `out` registers never share the input's register.
        unsafe {
            asm!(
                "fcvtl {lo:v}.4s, {h:v}.4h",
                "fcvtl2 {hi:v}.4s, {h:v}.8h",
                lo = out(vreg) lo,
                hi = out(vreg) hi,
                h = in(vreg) h,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        (lo, hi)
    }

    /// One F16 value at `p` (any alignment).
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> f32 {
        vgetq_lane_f32::<0>(f16x4(vld1_dup_u16(p as *const u16)))
    }

    /// 16 bytes of nibbles → elements 0..16 (low nibbles) and 16..32 (high nibbles).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> (int8x16_t, int8x16_t) {
        let v = vld1q_u8(p);
        (
            vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
            vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
        )
    }

    /// Bit i of `qh` → 0x10 in byte i (elements 0..16 and 16..32), else 0.
    #[inline(always)]
    unsafe fn high_bits(qh: u32) -> (int8x16_t, int8x16_t) {
        const IDX: [u8; 32] = [
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ];
        const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let q = vreinterpretq_u8_u32(vdupq_n_u32(qh));
        let bit = vld1q_u8(BIT.as_ptr());
        let h = vdupq_n_u8(0x10);
        let spread = |idx: *const u8| {
            let t = vqtbl1q_u8(q, vld1q_u8(idx));
            vreinterpretq_s8_u8(vandq_u8(vtstq_u8(t, bit), h))
        };
        (spread(IDX.as_ptr()), spread(IDX.as_ptr().add(16)))
    }

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        let n = x.len();
        let xp = x.as_ptr();
        // maxnm ignores NaN, as f32::max in the scalar reference.
        let mut amax = vdupq_n_f32(0.0);
        for c in (0..n).step_by(4) {
            amax = vmaxnmq_f32(amax, vabsq_f32(vld1q_f32(xp.add(c))));
        }
        let amax = vmaxnmvq_f32(amax);
        let d = amax / 127.0;
        let id = vdupq_n_f32(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (lim, nlim) = (vdupq_n_s32(127), vdupq_n_s32(-127));
        let mut sum = vdupq_n_s32(0);
        for c in (0..n).step_by(16) {
            let mut v = [vdupq_n_s32(0); 4];
            for (k, v) in v.iter_mut().enumerate() {
                // Round to nearest, ties to even, as the scalar reference.
                let r = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xp.add(c + 4 * k)), id));
                *v = vmaxq_s32(vminq_s32(r, lim), nlim);
                sum = vaddq_s32(sum, *v);
            }
            let a = vcombine_s16(vmovn_s32(v[0]), vmovn_s32(v[1]));
            let b = vcombine_s16(vmovn_s32(v[2]), vmovn_s32(v[3]));
            vst1q_s8(
                q.as_mut_ptr().add(c),
                vcombine_s8(vmovn_s16(a), vmovn_s16(b)),
            );
        }
        (d, vaddvq_s32(sum))
    }

    /// Whether the `sdot` variant runs (the processor has dotprod).
    fn dotprod() -> bool {
        crate::cpu::has_dotprod()
    }

    /// # Safety
    /// NEON must be present; `w` and the activations must hold `cols` elements.
    pub(super) unsafe fn dot_rows<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        match format {
            Format::F32 | Format::F16 => dot_float(format == Format::F16, w, cols, acts, out),
            _ if dotprod() => dot_rows_sdot(format, w, cols, acts, out),
            _ => dot_rows_smull(format, w, cols, acts, out),
        }
    }

    #[target_feature(enable = "neon,dotprod")]
    pub(super) unsafe fn dot_rows_sdot<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        dot_int::<Sdot, R>(format, w, cols, acts, out)
    }

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn dot_rows_smull<const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        dot_int::<Smull, R>(format, w, cols, acts, out)
    }

    #[inline(always)]
    unsafe fn dot_int<D: Dot, const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        match format {
            Format::Q4K => dot_q4k::<D, R>(w, cols, acts, out),
            Format::Q6K => dot_q6k::<D, R>(w, cols, acts, out),
            _ => dot_q32::<D, R>(format, w, cols, acts, out),
        }
    }

    /// F32 or F16 weights against R f32 rows, 8 columns a step.
    #[target_feature(enable = "neon")]
    unsafe fn dot_float<const R: usize>(
        f16w: bool,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let x: [*const f32; R] = std::array::from_fn(|r| acts[r].floats().as_ptr());
        let wp = w.as_ptr();
        let mut acc = [[vdupq_n_f32(0.0); 2]; R];
        let mut i = 0;
        while i + 8 <= cols {
            let (w0, w1) = if f16w {
                f16x8(vld1q_u16(wp.add(2 * i) as *const u16))
            } else {
                let p = wp.add(4 * i) as *const f32;
                (vld1q_f32(p), vld1q_f32(p.add(4)))
            };
            for r in 0..R {
                acc[r][0] = vfmaq_f32(acc[r][0], w0, vld1q_f32(x[r].add(i)));
                acc[r][1] = vfmaq_f32(acc[r][1], w1, vld1q_f32(x[r].add(i + 4)));
            }
            i += 8;
        }
        for r in 0..R {
            let mut s = vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1]));
            for t in i..cols {
                let wv = if f16w {
                    half::f16::from_bits((wp.add(2 * t) as *const u16).read_unaligned()).to_f32()
                } else {
                    (wp.add(4 * t) as *const f32).read_unaligned()
                };
                s += wv * *x[r].add(t);
            }
            out[r] = s;
        }
    }

    /// The 32-element formats against R rows of 8-bit activations: per block, Σ q·y in i32
    /// lanes, scaled by d_w·d_y into f32 lanes; the offsets (Q4_0/Q4_1/Q5_0) from Σy.
    #[inline(always)]
    unsafe fn dot_q32<D: Dot, const R: usize>(
        format: Format,
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let mut qs = [std::ptr::null::<i8>(); R];
        let mut ds = [std::ptr::null::<f32>(); R];
        let mut ss = [std::ptr::null::<f32>(); R];
        for r in 0..R {
            let (q, d, s, _) = acts[r].q8();
            qs[r] = q.as_ptr();
            ds[r] = d.as_ptr();
            ss[r] = s.as_ptr();
        }
        let bb = format.block_bytes();
        let nb = cols / 32;
        let mut acc = [vdupq_n_f32(0.0); R];
        let mut off = [0f32; R];
        let wp = w.as_ptr();
        for b in 0..nb {
            let blk = wp.add(b * bb);
            let dw = f16(blk);
            // The block's 32 values (signed for Q8_0, 0..15 or 0..31 otherwise) and the
            // constant it adds per unit of Σy.
            let (w0, w1, k) = match format {
                Format::Q8_0 => {
                    let q = blk.add(2) as *const i8;
                    (vld1q_s8(q), vld1q_s8(q.add(16)), 0.0)
                }
                Format::Q4_0 => {
                    let (lo, hi) = nibbles(blk.add(2));
                    (lo, hi, -8.0 * dw)
                }
                Format::Q4_1 => {
                    let (lo, hi) = nibbles(blk.add(4));
                    (lo, hi, f16(blk.add(2)))
                }
                _ => {
                    let (lo, hi) = nibbles(blk.add(6));
                    let (h0, h1) = high_bits((blk.add(2) as *const u32).read_unaligned());
                    (vorrq_s8(lo, h0), vorrq_s8(hi, h1), -16.0 * dw)
                }
            };
            for r in 0..R {
                let y = qs[r].add(32 * b);
                let p = D::dot(vdupq_n_s32(0), w0, vld1q_s8(y));
                let p = D::dot(p, w1, vld1q_s8(y.add(16)));
                acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(p), dw * *ds[r].add(b));
                off[r] += k * *ss[r].add(b);
            }
        }
        for r in 0..R {
            out[r] = vaddvq_f32(acc[r]) + off[r];
        }
    }

    #[inline(always)]
    fn q8k(act: &Act<'_>) -> (*const i8, *const f32, *const i16) {
        let (qs, d, bsums) = act.q8k();
        (qs.as_ptr(), d.as_ptr(), bsums.as_ptr())
    }

    #[inline(always)]
    unsafe fn dot_q4k<D: Dot, const R: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let a: [_; R] = std::array::from_fn(|r| q8k(&acts[r]));
        let nb = cols / 256;
        let mut acc = [0f32; R];
        let m4 = vdupq_n_u8(0x0F);
        for b in 0..nb {
            let blk = w.as_ptr().add(b * 144);
            let dw = f16(blk);
            let dmin = f16(blk.add(2));
            let sc_bytes = std::slice::from_raw_parts(blk.add(4), 12);
            let mut sc = [0i32; 8];
            let mut mn = [0i32; 8];
            for j in 0..8 {
                let (s, m) = super::q4k_scale_min(j, sc_bytes);
                sc[j] = s as i32;
                mn[j] = m as i32;
            }
            // Sub-block 2j: low nibbles of bytes 32j..32j+32; sub-block 2j+1: high nibbles.
            let mut u = [[vdupq_n_s8(0); 2]; 8];
            for j in 0..4 {
                for h in 0..2 {
                    let q = vld1q_u8(blk.add(16 + 32 * j + 16 * h));
                    u[2 * j][h] = vreinterpretq_s8_u8(vandq_u8(q, m4));
                    u[2 * j + 1][h] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q));
                }
            }
            for r in 0..R {
                let (qs, d, bs) = a[r];
                let qs = qs.add(256 * b);
                let bs = bs.add(16 * b);
                let mut sumi = vdupq_n_s32(0);
                for k in 0..8 {
                    let p = D::dot(vdupq_n_s32(0), u[k][0], vld1q_s8(qs.add(32 * k)));
                    let p = D::dot(p, u[k][1], vld1q_s8(qs.add(32 * k + 16)));
                    sumi = vmlaq_n_s32(sumi, p, sc[k]);
                }
                let mut summ = 0i32;
                for j in 0..8 {
                    summ += mn[j] * (*bs.add(2 * j) as i32 + *bs.add(2 * j + 1) as i32);
                }
                let dy = *d.add(b);
                acc[r] += dy * (dw * vaddvq_s32(sumi) as f32 - dmin * summ as f32);
            }
        }
        *out = acc;
    }

    #[inline(always)]
    unsafe fn dot_q6k<D: Dot, const R: usize>(
        w: &[u8],
        cols: usize,
        acts: &[Act<'_>; R],
        out: &mut [f32; R],
    ) {
        let a: [_; R] = std::array::from_fn(|r| q8k(&acts[r]));
        let nb = cols / 256;
        let mut acc = [0f32; R];
        let m4 = vdupq_n_u8(0x0F);
        let m30 = vdupq_n_u8(0x30);
        for b in 0..nb {
            let blk = w.as_ptr().add(b * 210);
            let dw = f16(blk.add(208));
            let sc = std::slice::from_raw_parts(blk.add(192) as *const i8, 16);
            // The 256 six-bit values (0..63), in groups of 16: group g = 8·half + 2k + h holds
            // elements 128·half + 32k + 16h .. + 16 and uses scale g.
            let mut u = [vdupq_n_s8(0); 16];
            for half in 0..2 {
                let ql = blk.add(64 * half);
                let qh = blk.add(128 + 32 * half);
                for h in 0..2 {
                    let ql0 = vld1q_u8(ql.add(16 * h));
                    let ql1 = vld1q_u8(ql.add(32 + 16 * h));
                    let qh = vld1q_u8(qh.add(16 * h));
                    // Bits 2k, 2k+1 of qh become bits 4, 5 of value k.
                    let vals = [
                        vorrq_u8(vandq_u8(ql0, m4), vandq_u8(vshlq_n_u8::<4>(qh), m30)),
                        vorrq_u8(vandq_u8(ql1, m4), vandq_u8(vshlq_n_u8::<2>(qh), m30)),
                        vorrq_u8(vshrq_n_u8::<4>(ql0), vandq_u8(qh, m30)),
                        vorrq_u8(vshrq_n_u8::<4>(ql1), vandq_u8(vshrq_n_u8::<2>(qh), m30)),
                    ];
                    for (k, v) in vals.into_iter().enumerate() {
                        u[8 * half + 2 * k + h] = vreinterpretq_s8_u8(v);
                    }
                }
            }
            for r in 0..R {
                let (qs, d, bs) = a[r];
                let qs = qs.add(256 * b);
                let bs = bs.add(16 * b);
                let mut sumi = vdupq_n_s32(0);
                let mut corr = 0i32;
                for g in 0..16 {
                    let p = D::dot(vdupq_n_s32(0), u[g], vld1q_s8(qs.add(16 * g)));
                    sumi = vmlaq_n_s32(sumi, p, sc[g] as i32);
                    corr += sc[g] as i32 * *bs.add(g) as i32;
                }
                // The stored values are q + 32: subtract 32 · Σ scale · (sum of the group).
                let dy = *d.add(b);
                acc[r] += dw * dy * (vaddvq_s32(sumi) - 32 * corr) as f32;
            }
        }
        *out = acc;
    }

    #[cfg(test)]
    mod tests {
        use super::super::{scalar, Act};
        use super::*;
        use crate::quant::testutil::{random_row, Rng};
        use crate::quant::{Q8KRows, Q8Rows};

        /// Both integer variants (`sdot` where the processor has dotprod, and `smull`/`sadalp`)
        /// against the scalar micro-kernel on the same 8-bit activations, every quantised
        /// format, for one and for four rows.
        #[test]
        fn sdot_and_smull_variants_match_the_scalar_kernel() {
            if crate::cpu::detect() < crate::Isa::Neon {
                return;
            }
            let mut rng = Rng(78);
            for format in [
                Format::Q8_0,
                Format::Q4_0,
                Format::Q4_1,
                Format::Q5_0,
                Format::Q4K,
                Format::Q6K,
            ] {
                let be = format.block_elems();
                let cols = be * (1 + rng.below(if be == 256 { 3 } else { 12 }));
                let w = random_row(&mut rng, format, cols);
                let x: Vec<f32> = (0..4 * cols).map(|_| rng.f32()).collect();
                let (mut q, mut qk) = (Q8Rows::default(), Q8KRows::default());
                let acts: [Act<'_>; 4] = if be == 32 {
                    q.quantize(crate::Isa::Neon, &x, 4, cols);
                    let nb = cols / 32;
                    let q = &q;
                    std::array::from_fn(|r| Act::Q8 {
                        qs: &q.qs[r * cols..(r + 1) * cols],
                        d: &q.d[r * nb..(r + 1) * nb],
                        s: &q.s[r * nb..(r + 1) * nb],
                        d8: &[],
                    })
                } else {
                    qk.quantize(crate::Isa::Neon, &x, 4, cols);
                    let nb = cols / 256;
                    let qk = &qk;
                    std::array::from_fn(|r| Act::Q8K {
                        qs: &qk.qs[r * cols..(r + 1) * cols],
                        d: &qk.d[r * nb..(r + 1) * nb],
                        bsums: &qk.bsums[r * nb * 16..(r + 1) * nb * 16],
                    })
                };
                let mut four = [0f32; 4];
                let mut one = [0f32; 1];
                // SAFETY: NEON was detected above.
                unsafe {
                    dot_rows_smull(format, &w, cols, &acts, &mut four);
                    dot_rows_smull(format, &w, cols, &[acts[3]], &mut one);
                }
                let mut variants = vec![("smull", four, one[0])];
                if crate::cpu::has_dotprod() {
                    // SAFETY: dotprod was detected too.
                    unsafe {
                        dot_rows_sdot(format, &w, cols, &acts, &mut four);
                        dot_rows_sdot(format, &w, cols, &[acts[3]], &mut one);
                    }
                    variants.push(("sdot", four, one[0]));
                }
                for r in 0..4 {
                    let want = scalar::dot(format, &w, cols, acts[r]);
                    for (name, got, got1) in &variants {
                        let got = if r == 3 { [got[r], *got1] } else { [got[r]; 2] };
                        for g in got {
                            assert!(
                                (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                                "{} {name}: {g} vs {want}",
                                format.name(),
                            );
                        }
                    }
                }
            }
        }

        /// The widening of F16 (normal, subnormal, zero, infinite and NaN values) agrees with
        /// `half`.
        #[test]
        fn f16_widening_matches_half() {
            if crate::cpu::detect() < crate::Isa::Neon {
                return;
            }
            let bits: Vec<u16> = (0..=u16::MAX).collect();
            for c in bits.chunks_exact(8) {
                // SAFETY: NEON was detected; the chunk holds 8 values.
                let (lo, hi) = unsafe { f16x8(vld1q_u16(c.as_ptr())) };
                let mut got = [0f32; 8];
                // SAFETY: `got` holds 8 values.
                unsafe {
                    vst1q_f32(got.as_mut_ptr(), lo);
                    vst1q_f32(got.as_mut_ptr().add(4), hi);
                }
                for (&b, g) in c.iter().zip(got) {
                    let want = half::f16::from_bits(b).to_f32();
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "{b:#06x}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::{random_row, Rng};

    fn check(format: Format, rows: usize, cols: usize, m: usize, seed: u64) {
        let mut rng = Rng(seed);
        let data: Vec<u8> = (0..rows)
            .flat_map(|_| random_row(&mut rng, format, cols))
            .collect();
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
        let w = WeightView {
            ggml_type: format.ggml_id(),
            rows,
            cols,
            data: &data,
        };
        let reference = matmul_reference(&w, &x, m).expect("reference");
        // The tolerance allows for the 8-bit activations of the integer formats: half a step
        // of max|x|/127 per element, summed over the row.
        let wmax = {
            let mut row = vec![0f32; cols];
            let rb = format.row_bytes(cols).expect("row bytes");
            let mut mx = 0f32;
            for j in 0..rows {
                dequantize_row(format, &data[j * rb..(j + 1) * rb], &mut row);
                mx = row.iter().fold(mx, |a, v| a.max(v.abs()));
            }
            mx
        };
        let tol = match format {
            Format::F32 | Format::F16 => 1e-4 * cols as f32 * wmax,
            _ => wmax * cols as f32 * (0.5 / 127.0) * 0.5 + 1e-3,
        };
        for isa in Isa::available() {
            let got = matmul_with(isa, &w, &x, m).expect("kernel");
            assert_eq!(got.len(), m * rows);
            for (k, (g, r)) in got.iter().zip(&reference).enumerate() {
                assert!(
                    (g - r).abs() <= tol,
                    "{} {isa:?} rows {rows} cols {cols} m {m}: [{k}] {g} vs {r} (tol {tol})",
                    format.name()
                );
            }
        }
    }

    #[test]
    fn every_format_matches_the_reference_on_random_shapes() {
        let mut rng = Rng(42);
        for format in Format::ALL {
            let be = format.block_elems().max(8);
            for case in 0..6 {
                let blocks = 1 + rng.below(if be == 256 { 3 } else { 24 });
                // F32/F16 get odd widths (tails); the block formats whole blocks.
                let cols = if be == 8 {
                    1 + rng.below(200)
                } else {
                    blocks * be
                };
                let rows = 1 + rng.below(70);
                let m = [1, 2, 3, 5, 7, 66][case];
                check(format, rows, cols, m, 1000 + case as u64);
            }
        }
    }

    /// One interleaved layout, checked against the rows it came from.
    struct LayoutCase {
        seed: u64,
        /// The file's format: the random rows, and the f32 reference.
        source: Format,
        /// The rows the matmul reads without the layout (Q5_0: its Q8_0 rewrite), in `plain`.
        plain: Format,
        to_plain: fn(&[u8]) -> Vec<u8>,
        id: u32,
        interleave: fn(usize, usize, &[u8]) -> Option<Vec<u8>>,
        has_kernel: fn(Isa) -> bool,
        shapes: &'static [(usize, usize)],
    }

    /// At every instruction-set level: with the layout's kernels only the order of float
    /// additions differs from the row kernels (on the same quantised activations); below, the
    /// rows are unpacked for the row kernels (bit-identical). Both within the 8-bit
    /// activations' rounding of the f32 reference; each activation row gives the same bits
    /// alone as beside others (batched decode gives the tokens of single decode), at every
    /// tile size of the kernels (pieces of 8/4/2/1 with AVX-512, 4/2/1 with AVX2), decode and
    /// draft rows (split as decode) and prefill tiles of 16; a shape that is not whole groups
    /// is declined, not misread.
    fn check_layout(c: &LayoutCase) {
        let mut rng = Rng(c.seed);
        for &(rows, cols) in c.shapes {
            let data: Vec<u8> = (0..rows)
                .flat_map(|_| random_row(&mut rng, c.source, cols))
                .collect();
            let plain_data = (c.to_plain)(&data);
            let packed = (c.interleave)(rows, cols, &data).expect("fits");
            let view = |ggml_type, data| WeightView {
                ggml_type,
                rows,
                cols,
                data,
            };
            let (source, plain, inter) = (
                view(c.source.ggml_id(), &data),
                view(c.plain.ggml_id(), &plain_data),
                view(c.id, &packed),
            );
            let wmax = {
                let mut row = vec![0f32; cols];
                let rb = c.source.row_bytes(cols).expect("row bytes");
                (0..rows).fold(0f32, |mx, j| {
                    dequantize_row(c.source, &data[j * rb..(j + 1) * rb], &mut row);
                    row.iter().fold(mx, |a, v| a.max(v.abs()))
                })
            };
            let tol_ref = wmax * cols as f32 * (0.5 / 127.0) * 0.5 + 1e-3;
            // the float rounding of sums of up to `cols` products of up to wmax (Q6_K's
            // values reach 32 · 127 · d, so results cancel from far larger terms than Q4_K's)
            let tol_rows = 1e-7 * wmax * cols as f32;
            for m in [1, 3, 4, 5, 8, 9, 17, 40] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
                let reference = matmul_reference(&source, &x, m).expect("reference");
                for isa in Isa::available() {
                    let at = format!("{isa:?} rows {rows} cols {cols} m {m}");
                    let want = matmul_with(isa, &plain, &x, m).expect("rows");
                    let got = matmul_with(isa, &inter, &x, m).expect("interleaved");
                    assert_eq!(got.len(), m * rows);
                    if !(c.has_kernel)(isa) {
                        assert_eq!(got, want, "{at}");
                    }
                    for (k, ((g, w), r)) in got.iter().zip(&want).zip(&reference).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()) + tol_rows,
                            "{at}: [{k}] {g} vs rows {w}"
                        );
                        assert!((g - r).abs() <= tol_ref, "{at}: [{k}] {g} vs reference {r}");
                    }
                    for i in [0, m - 1] {
                        let one = matmul_with(isa, &inter, &x[i * cols..(i + 1) * cols], 1)
                            .expect("one row");
                        assert_eq!(one, got[i * rows..(i + 1) * rows], "{at}: row {i} alone");
                    }
                }
            }
        }
        let (rows, cols) = (12, c.shapes[0].1);
        let bytes = c.plain.row_bytes(cols).expect("row bytes") * rows;
        let w = WeightView {
            ggml_type: c.id,
            rows,
            cols,
            data: &vec![0u8; bytes],
        };
        for isa in Isa::available() {
            assert!(matmul_with(isa, &w, &vec![0.5; cols], 1).is_none());
        }
    }

    const K_SHAPES: &[(usize, usize)] = &[(8, 256), (64, 512), (40, 768), (136, 1536)];

    #[test]
    fn interleaved_q4k_gives_what_its_rows_give() {
        check_layout(&LayoutCase {
            seed: 77,
            source: Format::Q4K,
            plain: Format::Q4K,
            to_plain: <[u8]>::to_vec,
            id: q4k_x8::ID,
            interleave: q4k_x8::interleave,
            has_kernel: q4k_x8::has_kernel,
            shapes: K_SHAPES,
        });
    }

    #[test]
    fn interleaved_q6k_gives_what_its_rows_give() {
        check_layout(&LayoutCase {
            seed: 78,
            source: Format::Q6K,
            plain: Format::Q6K,
            to_plain: <[u8]>::to_vec,
            id: q6k_x8::ID,
            interleave: q6k_x8::interleave,
            has_kernel: q6k_x8::has_kernel,
            shapes: K_SHAPES,
        });
    }

    #[test]
    fn interleaved_q5_0_gives_what_its_rows_give() {
        // the rows it replaces are the Q8_0 rewrite; the reference is the Q5_0 file's
        check_layout(&LayoutCase {
            seed: 79,
            source: Format::Q5_0,
            plain: Format::Q8_0,
            to_plain: |d| crate::quant::q5_0_as_q8_0(d).expect("whole blocks"),
            id: q5_0_x8::ID,
            interleave: q5_0_x8::interleave,
            has_kernel: q5_0_x8::has_kernel,
            shapes: &[(8, 32), (64, 96), (40, 896), (136, 4864)],
        });
    }

    #[test]
    fn simd_and_scalar_integer_sums_agree_exactly_enough() {
        // Same quantised activations, so the SIMD and scalar micro-kernels differ only in the
        // order of float additions.
        let mut rng = Rng(9);
        for format in [
            Format::Q8_0,
            Format::Q4_0,
            Format::Q4_1,
            Format::Q5_0,
            Format::Q4K,
            Format::Q6K,
        ] {
            let cols = 512;
            let rows = 33;
            let data: Vec<u8> = (0..rows)
                .flat_map(|_| random_row(&mut rng, format, cols))
                .collect();
            let x: Vec<f32> = (0..3 * cols).map(|_| rng.f32()).collect();
            let w = WeightView {
                ggml_type: format.ggml_id(),
                rows,
                cols,
                data: &data,
            };
            let s = matmul_with(Isa::Scalar, &w, &x, 3).expect("scalar");
            for isa in Isa::available() {
                let v = matmul_with(isa, &w, &x, 3).expect("simd");
                for (a, b) in s.iter().zip(&v) {
                    assert!(
                        (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                        "{} {isa:?}: {a} vs {b}",
                        format.name()
                    );
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_declined_not_panicked() {
        let data = vec![0u8; 34];
        // (type, rows, cols, x length, what is wrong)
        let cases = [
            (8, 1, 32, 31, "x too short"),
            (8, 2, 32, 32, "weights too short"),
            (8, 1, 33, 33, "not whole blocks"),
            (99, 1, 32, 32, "unknown format"),
        ];
        for (ggml_type, rows, cols, xlen, what) in cases {
            let w = WeightView {
                ggml_type,
                rows,
                cols,
                data: &data,
            };
            assert!(matmul(&w, &vec![0.0; xlen], 1).is_none(), "{what}");
        }
        let w = WeightView {
            ggml_type: 8,
            rows: 1,
            cols: 32,
            data: &data,
        };
        assert!(
            matmul(&w, &[0.0; 32], 1).is_some(),
            "the well-formed case runs"
        );
    }
}
