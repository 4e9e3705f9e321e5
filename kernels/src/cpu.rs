//! Run-time choice of the instruction set.
//!
//! The kernels are compiled for every level (through `#[target_feature]`) and the level is
//! picked once, from what the processor reports. [`set_cap`] lowers it (for comparisons;
//! docent sets it from `generation.isa`); a cap above what the processor has is ignored.

use std::sync::OnceLock;

/// The instruction-set levels the kernels are written for, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust: the reference, and the fallback on any other processor.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 F/BW/VL (implies `Avx2`).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512",
        }
    }

    /// Every level this processor can run, lowest first (for tests and benchmarks).
    pub fn available() -> Vec<Isa> {
        let best = detect();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }
}

/// The best level this processor supports.
pub fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl");
        if avx512 {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

static CAP: OnceLock<Isa> = OnceLock::new();

/// Caps the level the kernels use. Only the first call counts, and only before the first
/// kernel runs (the level is fixed then).
pub fn set_cap(cap: Isa) {
    let _ = CAP.set(cap);
}

/// The level the kernels use: [`detect`], capped by [`set_cap`].
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| detect().min(*CAP.get_or_init(|| Isa::Avx512)))
}
