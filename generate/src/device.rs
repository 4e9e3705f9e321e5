//! Where generation runs: `generation.device`.
//!
//! - `cpu`: the CPU, always (docent's kernels, continuous batching, the F16 KV cache);
//! - `cuda` or `cuda:N`: GPU N (0 by default); an error when the binary was built without
//!   the `cuda` feature or the GPU cannot be opened, never a silent fall-back;
//! - `auto`: GPU 0 when the binary has CUDA and a GPU opens, else the CPU (with a warning
//!   in a CUDA build, where a missing GPU is worth knowing about).
//!
//! A CUDA build links the CUDA libraries and the driver's `libcuda.so.1` at start-up, so it
//! starts only where the driver is installed, whatever the device setting.

use std::fmt;
use std::str::FromStr;

use mistralrs::Device;

/// `generation.device`, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU (`cpu`).
    Cpu,
    /// GPU 0 when the build has CUDA and the GPU opens, else the CPU (`auto`).
    Auto,
    /// GPU n (`cuda` for 0, or `cuda:N`); an error in a build without CUDA.
    Cuda(usize),
}

/// Whether this binary was built with the `cuda` feature.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "auto" => Ok(Self::Auto),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| {
                    format!("must be cpu, auto, cuda or cuda:N (a GPU number), got {s:?}")
                }),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Auto => f.write_str("auto"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceChoice {
    /// Opens the device. `open_cuda` opens GPU n (a parameter so that the choice can be
    /// tested on machines without one).
    pub fn select_with(
        self,
        open_cuda: impl Fn(usize) -> Result<Device, String>,
    ) -> Result<Device, String> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(_) if !CUDA_BUILT => Err(format!(
                "generation.device = \"{self}\", but this binary was built without CUDA: \
                 build with `--features cuda` (scripts/cuda-toolkit.sh installs a toolkit), \
                 or set generation.device = \"cpu\""
            )),
            Self::Cuda(n) => open_cuda(n).map_err(|e| {
                format!(
                    "generation.device = \"{self}\": GPU {n} could not be opened ({e}); \
                     check nvidia-smi, or set generation.device = \"cpu\""
                )
            }),
            Self::Auto if !CUDA_BUILT => Ok(Device::Cpu),
            Self::Auto => match open_cuda(0) {
                Ok(device) => Ok(device),
                Err(e) => {
                    tracing::warn!(error = %e, "generation.device = \"auto\": no GPU opened; generating on the CPU");
                    Ok(Device::Cpu)
                }
            },
        }
    }

    /// Opens the device with candle's CUDA backend.
    pub fn select(self) -> Result<Device, String> {
        self.select_with(|n| Device::new_cuda(n).map_err(|e| e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_values_and_names_them_in_its_error() {
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        for bad in ["", "CUDA", "cuda:", "cuda:x", "cuda:-1", "metal", "cpu "] {
            let err = bad.parse::<DeviceChoice>().unwrap_err();
            assert!(err.contains("cpu, auto, cuda or cuda:N"), "{bad:?}: {err}");
        }
        assert_eq!(DeviceChoice::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn cpu_never_opens_a_gpu() {
        let device = DeviceChoice::Cpu
            .select_with(|_| panic!("the CPU choice opened a GPU"))
            .unwrap();
        assert!(device.is_cpu());
    }

    #[test]
    fn auto_falls_back_to_the_cpu_when_no_gpu_opens() {
        let device = DeviceChoice::Auto
            .select_with(|_| Err("no CUDA-capable device is detected".into()))
            .unwrap();
        assert!(device.is_cpu());
    }

    #[test]
    fn cuda_is_an_error_naming_the_fix_when_it_cannot_run() {
        let err = DeviceChoice::Cuda(1)
            .select_with(|n| Err(format!("device {n} missing")))
            .unwrap_err();
        if CUDA_BUILT {
            assert!(
                err.contains("GPU 1 could not be opened (device 1 missing)"),
                "{err}"
            );
        } else {
            assert!(err.contains("built without CUDA"), "{err}");
            assert!(err.contains("--features cuda"), "{err}");
        }
        assert!(err.contains("generation.device = \"cpu\""), "{err}");
    }

    #[test]
    fn cuda_asks_for_the_gpu_it_names_only_in_a_cuda_build() {
        let asked = std::sync::Mutex::new(None);
        let _ = DeviceChoice::Cuda(2).select_with(|n| {
            *asked.lock().unwrap() = Some(n);
            Err("none here".into())
        });
        let expected = if CUDA_BUILT { Some(2) } else { None };
        assert_eq!(*asked.lock().unwrap(), expected);
    }
}
