//! Kernel timings on a model's layer shapes: `cargo bench -p docent-kernels [-- MODEL]`, MODEL
//! one of `smollm2` (SmolLM2-135M, the default), `qwen0.5b`, `qwen1.5b` (Qwen2.5 0.5B / 1.5B),
//! `qwen0.5b-output` / `qwen1.5b-output` (a model's output layer alone: decode from memory, not
//! cache), `qwen1.5b-layers` (all 28 layers of the 1.5B, timed as one pass: a whole step's
//! weights from memory; best with `DOCENT_BENCH_ROWS=1,3,5`, which picks the row counts), or
//! one shape `ROWSxCOLS` (e.g. `8960x1536`: from cache where it fits), or `ROWSxCOLS*N` (N
//! copies of it timed as one pass: from memory once they outgrow the caches, as in a model).
//!
//! For each weight format: decode (one activation row, a gemv: GB/s of weights read), five
//! rows (a speculative draft step: GFLOP/s) and prefill (600 rows: GFLOP/s), on every SIMD
//! level the processor runs (AVX-512 and AVX2 side by side on an AVX-512 machine) and on the
//! scalar one (`DOCENT_BENCH_NO_SCALAR=1` skips the scalar columns). A second argument keeps
//! one format: `cargo bench -p docent-kernels -- qwen1.5b Q4_K`. Q4_K and Q6_K are also
//! timed with eight rows interleaved ("Q4_K x8", "Q6_K x8": docent's layouts for them).

use std::time::Instant;

use docent_kernels::matmul::{matmul_with, WeightView};
use docent_kernels::quant::Format;
use docent_kernels::Isa;
use docent_kernels::{q4k_x8, q6k_x8};

fn rand_bytes(n: usize, seed: &mut u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 24) as u8
        })
        .collect()
}

fn weights(format: Format, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let rb = format.row_bytes(cols).expect("whole blocks");
    let mut data = rand_bytes(rows * rb, seed);
    // Sane scales: small f16 values where the format keeps its scales.
    let small = half::f16::from_f32(0.01).to_le_bytes();
    let bb = format.block_bytes();
    for blk in data.chunks_exact_mut(bb) {
        match format {
            Format::F32 => blk.copy_from_slice(&0.01f32.to_le_bytes()),
            Format::F16 => blk.copy_from_slice(&small),
            Format::Q6K => blk[208..210].copy_from_slice(&small),
            Format::Q4_1 | Format::Q4K => {
                blk[..2].copy_from_slice(&small);
                blk[2..4].copy_from_slice(&small);
            }
            _ => blk[..2].copy_from_slice(&small),
        }
    }
    data
}

/// `ROWSxCOLS`, or `ROWSxCOLS*N` (N copies), as the bench's shapes.
fn one_shape(arg: &str) -> Option<Vec<(usize, usize)>> {
    let (shape, copies) = arg.split_once('*').unwrap_or((arg, "1"));
    let (rows, cols) = shape.split_once('x')?;
    let shape = (rows.parse().ok()?, cols.parse().ok()?);
    Some(vec![shape; copies.parse().ok()?])
}

fn time<F: FnMut()>(mut f: F) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let isa = docent_kernels::cpu::isa();
    println!(
        "docent-kernels: run-time ISA {}, {} rayon threads",
        isa.name(),
        rayon::current_num_threads()
    );
    // (rows, cols): attention q/o, k/v, ffn gate/up, ffn down (the output layer is left out).
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let model = args.first().cloned().unwrap_or_else(|| "smollm2".into());
    // an optional second argument keeps one format (e.g. Q4_K)
    let only = args.get(1).cloned();
    let shapes: Vec<(usize, usize)> = match model.as_str() {
        "qwen0.5b" => vec![(896, 896), (128, 896), (4864, 896), (896, 4864)],
        "qwen1.5b" => vec![(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)],
        // the output layer of Qwen2.5-0.5B: a gemv over ~145 MB of Q8_0, from memory
        "qwen0.5b-output" => vec![(151_936, 896)],
        // the output layer of Qwen2.5-1.5B (Q6_K in its Q4_K_M file, ~190 MB): from memory
        "qwen1.5b-output" => vec![(151_936, 1536)],
        // every layer of Qwen2.5-1.5B (28 × q, k, v, o, gate, up, down; 0.74 GB in Q4_K):
        // a whole decode step's weights, read from memory as in the model
        "qwen1.5b-layers" => [
            (1536, 1536),
            (256, 1536),
            (256, 1536),
            (1536, 1536),
            (8960, 1536),
            (8960, 1536),
            (1536, 8960),
        ]
        .repeat(28),
        m => one_shape(m).unwrap_or_else(|| vec![(576, 576), (192, 576), (1536, 576), (576, 1536)]),
    };
    let scalar = std::env::var_os("DOCENT_BENCH_NO_SCALAR").is_none();
    println!("shapes of {model}: {shapes:?}");
    // Every SIMD level this processor runs (AVX2 beside AVX-512 on an AVX-512 machine), then
    // the scalar one.
    let mut levels: Vec<Isa> = Isa::available()
        .into_iter()
        .rev()
        .filter(|&l| l != Isa::Scalar)
        .collect();
    if scalar || levels.is_empty() {
        levels.push(Isa::Scalar);
    }
    let mut seed = 0x1234_5678_9abc_def0u64;
    // decode (1 row: GB/s of weights), a few rows (a speculative draft step: GFLOP/s),
    // prefill (600 rows: GFLOP/s); DOCENT_BENCH_ROWS=1,3,5 picks other row counts
    let rows_asked: Vec<usize> = std::env::var("DOCENT_BENCH_ROWS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 5, 600]);
    let cases: Vec<(usize, String)> = rows_asked
        .iter()
        .map(|&m| match m {
            1 => (m, "decode GB/s".to_string()),
            600 => (m, "prefill 600 GFLOP/s".to_string()),
            m => (m, format!("{m} rows GFLOP/s")),
        })
        .collect();
    // Many shapes (a whole model's layers): one timed pass over all of them, as a forward
    // pass reads them, so each weight comes from memory; few shapes: each timed alone.
    let whole_pass = shapes.len() > 8;
    let mut header = vec!["format".to_string()];
    for (_, what) in &cases {
        for l in &levels {
            header.push(format!("{what} ({})", l.name()));
        }
    }
    println!("| {} |", header.join(" | "));
    println!("|{}", "---|".repeat(header.len()));
    // every format in GGUF's row layout, and Q4_K and Q6_K with eight rows interleaved
    // ("Q4_K x8", "Q6_K x8", docent's layouts for them) after their rows
    let entries = Format::ALL.into_iter().flat_map(|f| {
        let x8 = matches!(f, Format::Q4K | Format::Q6K).then_some((f, true));
        std::iter::once((f, false)).chain(x8)
    });
    for (format, interleaved) in entries {
        if only.as_deref().is_some_and(|o| o != format.name()) {
            continue;
        }
        let ggml_type = match (interleaved, format) {
            (true, Format::Q6K) => q6k_x8::ID,
            (true, _) => q4k_x8::ID,
            (false, _) => format.ggml_id(),
        };
        let cols_ok = |c: usize| c.is_multiple_of(format.block_elems());
        let shapes: Vec<_> = shapes
            .iter()
            .copied()
            .filter(|&(_, c)| cols_ok(c))
            .collect();
        // the weights, made once per format: every column reads the same bytes
        let data: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(rows, cols)| {
                let w = weights(format, rows, cols, &mut seed);
                match (interleaved, format) {
                    (true, Format::Q6K) => {
                        q6k_x8::interleave(rows, cols, &w).expect("whole groups of 8 rows")
                    }
                    (true, _) => {
                        q4k_x8::interleave(rows, cols, &w).expect("whole groups of 8 rows")
                    }
                    (false, _) => w,
                }
            })
            .collect();
        let bytes: usize = data.iter().map(Vec::len).sum();
        let mut cells = Vec::new();
        for &(m, _) in &cases {
            let x: Vec<f32> = (0..m * shapes.iter().map(|s| s.1).max().unwrap_or(0))
                .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
                .collect();
            let flops: usize = shapes.iter().map(|&(rows, cols)| 2 * m * rows * cols).sum();
            for &level in &levels {
                if shapes.is_empty() {
                    cells.push("–".into());
                    continue;
                }
                let run = |&(rows, cols): &(usize, usize), data: &[u8]| {
                    let w = WeightView {
                        ggml_type,
                        rows,
                        cols,
                        data,
                    };
                    std::hint::black_box(matmul_with(level, &w, &x[..m * cols], m));
                };
                let secs = if whole_pass {
                    time(|| shapes.iter().zip(&data).for_each(|(s, d)| run(s, d)))
                } else {
                    shapes
                        .iter()
                        .zip(&data)
                        .map(|(s, d)| time(|| run(s, d)))
                        .sum()
                };
                cells.push(if m == 1 {
                    format!("{:.1}", bytes as f64 / secs / 1e9)
                } else {
                    format!("{:.1}", flops as f64 / secs / 1e9)
                });
            }
        }
        let name = format!("{}{}", format.name(), if interleaved { " x8" } else { "" });
        println!("| {name} | {} |", cells.join(" | "));
    }
}
