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
    /// aarch64 with NEON (always there on aarch64); the integer dot products use `sdot` where
    /// the processor has the dotprod extension ([`has_dotprod`]). Below the x86 levels, so a
    /// cap of `Avx2`/`Avx512` leaves an aarch64 processor at `Neon`, and a cap of `Neon` on
    /// x86-64 means `Scalar`.
    Neon,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 F/BW/VL (implies `Avx2`).
    Avx512,
}

impl Isa {
    /// The level's name, as `generation.isa` and the reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Neon => "neon",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512",
        }
    }

    /// Every level this processor can run, lowest first (for tests and benchmarks).
    pub fn available() -> Vec<Isa> {
        let best = detect();
        let levels: &[Isa] = if cfg!(target_arch = "aarch64") {
            &[Isa::Scalar, Isa::Neon]
        } else {
            &[Isa::Scalar, Isa::Avx2, Isa::Avx512]
        };
        levels.iter().copied().filter(|&i| i <= best).collect()
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
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return Isa::Neon;
    }
    Isa::Scalar
}

/// Whether this aarch64 processor has the dotprod extension (`sdot`), used by the
/// [`Isa::Neon`] integer kernels when present; false elsewhere.
pub fn has_dotprod() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        static DOTPROD: OnceLock<bool> = OnceLock::new();
        *DOTPROD.get_or_init(|| std::arch::is_aarch64_feature_detected!("dotprod"))
    }
    #[cfg(not(target_arch = "aarch64"))]
    false
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_caps_are_ordered_across_architectures() {
        assert!(Isa::Scalar < Isa::Neon && Isa::Neon < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        let levels = Isa::available();
        assert_eq!(levels[0], Isa::Scalar);
        assert_eq!(levels.last().copied(), Some(detect()));
        // The default cap (`Avx512`, docent's "auto") and the "avx2" cap leave NEON alone.
        assert_eq!(detect().min(Isa::Avx512), detect());
        if cfg!(target_arch = "aarch64") {
            assert_eq!(
                levels,
                [Isa::Scalar, Isa::Neon],
                "NEON is tested on aarch64"
            );
            assert_eq!(detect().min(Isa::Avx2), Isa::Neon);
        } else {
            assert!(!levels.contains(&Isa::Neon));
            assert!(!has_dotprod());
        }
    }
}
