//! docent's CPU kernels for generation.
//!
//! What it is for: the arithmetic of a transformer forward pass on the CPU, fast on any x86-64
//! and aarch64 (and correct everywhere): matrix products against weights in GGML block formats
//! ([`matmul`]), and causal scaled dot-product attention with an online softmax
//! ([`attention`]). The instruction set is chosen at run time ([`cpu::Isa`]), never at build
//! time, so one binary runs on AVX-512, AVX2+FMA and older machines alike (and one aarch64
//! binary uses NEON, with `sdot` where the processor has dotprod).
//!
//! What it is not for: model structure, caches or scheduling. mistral.rs calls these kernels
//! through the hooks in `vendor/mistralrs-quant/src/cpu_hooks.rs`, which docent registers at
//! start-up ([`register`] is called by the service). Every SIMD kernel has a plain scalar
//! reference beside it, and the tests compare the two on random shapes.
//!
//! Work is spread over rayon's global pool, which docent sizes from `generation.threads`: the
//! matmuls and the attention share that one pool.

#![warn(missing_docs)]

pub mod attention;
pub mod cpu;
pub mod matmul;
pub mod q4k_x8;
pub mod q5_0_x8;
pub mod q6k_x8;
pub mod quant;

pub use cpu::Isa;
