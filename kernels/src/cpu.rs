//! Run-time choice of the instruction set.
//!
//! The kernels are compiled for every level (through `#[target_feature]`) and the level is
//! picked once, from what the processor reports. `DOCENT_KERNELS_ISA=scalar|avx2|avx512` caps
//! it (for comparisons and tests); a cap above what the processor has is ignored.

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

/// The level the kernels use: [`detect`], capped by `DOCENT_KERNELS_ISA`.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let best = detect();
        let cap = match std::env::var("DOCENT_KERNELS_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") => Isa::Avx2,
            _ => Isa::Avx512,
        };
        best.min(cap)
    })
}
