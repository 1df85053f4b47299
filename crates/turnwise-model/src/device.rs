//! Picking the device and the weight dtype by name.
//!
//! `"cpu"` is always available; `"cuda"` / `"cuda:N"` (also `"gpu"`, `"gpu:N"`) need the crate's
//! `cuda` feature (and a CUDA toolkit at build time). On CPU the natural weight dtype is F32; on
//! CUDA it is BF16 (see [`default_dtype`]).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

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

/// Where a model lives: a device and the dtype its floating-point weights take there.
///
/// Models are loaded and initialised on the CPU in `f32` (every loader does); a placement moves
/// them to their device and dtype once, and moves what is written to disk back to the CPU in
/// `f32`, so that a checkpoint or export reads the same on every device.
#[derive(Debug, Clone)]
pub struct Placement {
    /// The device.
    pub device: Device,
    /// The dtype of floating-point weights (integer tensors keep theirs).
    pub dtype: DType,
}

impl PartialEq for Placement {
    fn eq(&self, other: &Self) -> bool {
        self.device.same_device(&other.device) && self.dtype == other.dtype
    }
}

impl Default for Placement {
    fn default() -> Self {
        Self::cpu()
    }
}

impl Placement {
    /// The CPU in `f32`: where models are loaded, and what checkpoints hold.
    pub fn cpu() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
        }
    }

    /// Whether this is the CPU in `f32` (placing is then a no-op).
    pub fn is_cpu_f32(&self) -> bool {
        self.device.is_cpu() && self.dtype == DType::F32
    }

    /// `t` in this placement's dtype (if it is a float tensor) on its device; `t` itself when
    /// it is already there (no copy).
    pub fn tensor(&self, t: &Tensor) -> Result<Tensor> {
        let t = if t.dtype().is_float() && t.dtype() != self.dtype {
            t.to_dtype(self.dtype)?
        } else {
            t.clone()
        };
        Ok(if t.device().same_device(&self.device) {
            t
        } else {
            t.to_device(&self.device)?
        })
    }

    /// Every tensor of `tensors` placed ([`Placement::tensor`]).
    pub fn tensors(&self, tensors: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        tensors
            .into_iter()
            .map(|(k, t)| Ok((k, self.tensor(&t)?)))
            .collect()
    }

    /// Whether every variable of `varmap` is on this device in this dtype (integers aside).
    pub fn holds(&self, varmap: &VarMap) -> bool {
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        data.values().all(|v| {
            v.device().same_device(&self.device)
                && (!v.dtype().is_float() || v.dtype() == self.dtype)
        })
    }

    /// `varmap` itself when its variables are already placed here, else a new `VarMap` with
    /// the same names holding placed copies (fresh `Var`s: the old ones are not updated).
    pub fn varmap(&self, varmap: &VarMap) -> Result<VarMap> {
        if self.holds(varmap) {
            return Ok(varmap.clone());
        }
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        let out = VarMap::new();
        {
            let mut dst = out.data().lock().unwrap_or_else(|e| e.into_inner());
            for (name, var) in data.iter() {
                let t = self.tensor(&var.as_tensor().detach())?;
                dst.insert(name.clone(), Var::from_tensor(&t)?);
            }
        }
        Ok(out)
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

/// Process-start settings measured to speed up candle on CPU (crates/turnwise-model/benches):
/// element-wise ops on one thread (`CANDLE_NUM_THREADS=1`: candle's pool otherwise spin-waits
/// for descheduled threads, 1.4-1.9x slower training on 2 cores) and mimalloc keeping freed
/// pages (`MIMALLOC_PURGE_DELAY=-1`: the kernel otherwise re-zeroes them every step, about 1.15x).
/// mimalloc reads its options when the process starts, so the binary re-executes itself once
/// with them set; a user's own values are kept. Call it first in `main`, before any thread
/// starts (the `turnwise` binary and the benches do).
#[cfg(unix)]
pub fn reexec_with_fast_settings() {
    use std::os::unix::process::CommandExt;
    const MARK: &str = "TURNWISE_REEXEC";
    if std::env::var_os(MARK).is_some() || std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .env(MARK, "1")
        .env("MIMALLOC_PURGE_DELAY", "-1");
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        cmd.env("CANDLE_NUM_THREADS", "1");
    }
    // `exec` only returns on failure; then carry on without the settings.
    let err = cmd.exec();
    eprintln!("note: could not re-execute with the speed settings ({err}); continuing");
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
    fn placement_converts_floats_and_keeps_placed_varmaps() {
        let vm = VarMap::new();
        {
            let mut d = vm.data().lock().unwrap();
            let w = Tensor::new(&[[1.0f32, 2.5], [-3.0, 0.125]], &Device::Cpu).unwrap();
            d.insert("w".into(), Var::from_tensor(&w).unwrap());
            let i = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
            d.insert("i".into(), Var::from_tensor(&i).unwrap());
        }
        let cpu = Placement::cpu();
        assert!(cpu.is_cpu_f32());
        // Already placed: the same variables (an update through one shows in the other).
        let same = cpu.varmap(&vm).unwrap();
        let w0 = vm.data().lock().unwrap()["w"].clone();
        let w1 = same.data().lock().unwrap()["w"].clone();
        w0.set(&Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        assert_eq!(
            w1.as_tensor()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
        // bf16: float tensors convert (these values are exact in bf16), integers keep theirs.
        w0.set(&Tensor::new(&[[1.0f32, 2.5], [-3.0, 0.125]], &Device::Cpu).unwrap())
            .unwrap();
        let bf = Placement {
            device: Device::Cpu,
            dtype: DType::BF16,
        };
        let placed = bf.varmap(&vm).unwrap();
        let d = placed.data().lock().unwrap();
        assert_eq!(d["w"].dtype(), DType::BF16);
        assert_eq!(d["i"].dtype(), DType::U32);
        let back = cpu.tensor(d["w"].as_tensor()).unwrap();
        assert_eq!(
            back.to_vec2::<f32>().unwrap(),
            vec![vec![1.0, 2.5], vec![-3.0, 0.125]]
        );
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
