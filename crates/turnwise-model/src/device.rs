//! Picking the device and the weight dtype by name.
//!
//! `"cpu"` is always available; `"cuda"` / `"cuda:N"` (also `"gpu"`, `"gpu:N"`) need the crate's
//! `cuda` feature (and a CUDA toolkit at build time). On CPU the natural weight dtype is F32; on
//! CUDA it is BF16 (see [`default_dtype`]).

use candle_core::{DType, Device};

use crate::error::{ModelError, Result};

/// Which device a name asks for, before any device is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The host CPU.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Parses `"cpu"`, `"cuda"`, `"cuda:N"`, `"gpu"` or `"gpu:N"` (case-insensitive, surrounding
    /// whitespace ignored).
    pub fn parse(name: &str) -> Result<Self> {
        let lower = name.trim().to_ascii_lowercase();
        let bad = || {
            ModelError::invalid_input(
                "device",
                format!("`{name}`: expected cpu, cuda, cuda:N, gpu or gpu:N"),
            )
        };
        match lower.as_str() {
            "cpu" => return Ok(Self::Cpu),
            "cuda" | "gpu" => return Ok(Self::Cuda(0)),
            _ => {}
        }
        let rest = lower
            .strip_prefix("cuda:")
            .or_else(|| lower.strip_prefix("gpu:"))
            .ok_or_else(bad)?;
        rest.parse::<usize>().map(Self::Cuda).map_err(|_| bad())
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    /// The weight dtype to use on this device: F32 on CPU, BF16 on CUDA.
    pub fn default_dtype(self) -> DType {
        match self {
            Self::Cpu => DType::F32,
            Self::Cuda(_) => DType::BF16,
        }
    }

    /// Creates the device. CUDA fails with a clear error when the crate was built without the
    /// `cuda` feature or no such GPU exists.
    pub fn create(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => {
                if !cuda_compiled() {
                    return Err(ModelError::invalid_input(
                        "device",
                        format!(
                            "cuda:{ordinal} requested but turnwise-model was built without the \
                             `cuda` feature"
                        ),
                    ));
                }
                Device::new_cuda(ordinal).map_err(|e| {
                    ModelError::invalid_input("device", format!("cuda:{ordinal}: {e}"))
                })
            }
        }
    }
}

/// Creates the device named by `name` (see [`DeviceSpec::parse`]).
pub fn pick_device(name: &str) -> Result<Device> {
    DeviceSpec::parse(name)?.create()
}

/// The weight dtype for `device`: F32 on CPU, BF16 on CUDA (and Metal).
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    }
}

/// Whether the crate was built with the `cuda` feature.
pub fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}

/// Whether a CUDA device can actually be used here (feature compiled in and a GPU present).
pub fn cuda_available() -> bool {
    cuda_compiled() && Device::new_cuda(0).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!(DeviceSpec::parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse(" CPU ").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("cuda").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("gpu").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        assert_eq!(DeviceSpec::parse("GPU:1").unwrap(), DeviceSpec::Cuda(1));
        for bad in ["", "tpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0"] {
            let err = DeviceSpec::parse(bad).unwrap_err();
            assert!(err.to_string().contains("device"), "{bad}: {err}");
        }
    }

    #[test]
    fn dtypes_and_cpu_creation() {
        assert_eq!(DeviceSpec::Cpu.default_dtype(), DType::F32);
        assert_eq!(DeviceSpec::Cuda(0).default_dtype(), DType::BF16);
        assert!(DeviceSpec::Cuda(0).is_cuda() && !DeviceSpec::Cpu.is_cuda());
        let cpu = pick_device("cpu").unwrap();
        assert!(cpu.is_cpu());
        assert_eq!(default_dtype(&cpu), DType::F32);
        if !cuda_compiled() {
            let err = pick_device("cuda:0").unwrap_err();
            assert!(err.to_string().contains("`cuda` feature"), "{err}");
            assert!(!cuda_available());
        }
    }
}
