//! `x Wᵀ` with a frozen weight: the gradient flows to `x` only.
//!
//! candle's matmul backward computes the gradients of both operands, whether or not an operand
//! is a detached tensor: for a frozen weight that is one wasted `[out, in]` product (a third of
//! the layer's training FLOPs, and the `[V, hidden]` one of the output projection) and a
//! weight-sized gradient buffer, per layer and step. [`linear`] wraps the product in a custom op
//! whose backward is `grad W` alone. It is what LoRA training runs on (the base weights are
//! detached views of the frozen `Var`s); every other case is candle's matmul.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

/// `x Wᵀ` for `x: [M, K]` and `w: [N, K]`. When `x` records a graph and `w` does not (a frozen
/// weight), on the CPU, the backward pass computes only `x`'s gradient; otherwise this is
/// `x.matmul(&w.t())`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let wt = w.t()?;
    if !x.track_op() || w.track_op() || !x.device().is_cpu() || x.rank() != 2 || w.rank() != 2 {
        return x.matmul(&wt);
    }
    x.apply_op1(FrozenLinear { w: w.clone() })
}

struct FrozenLinear {
    w: Tensor,
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "turnwise-frozen-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        let (n, k2) = self.w.dims2()?;
        if k != k2 {
            candle_core::bail!("frozen linear: input [{m}, {k}] against weight [{n}, {k2}]");
        }
        let wt = self.w.t()?;
        let (ws, _) = self.w.storage_and_layout();
        let Storage::Cpu(ws) = &*ws else {
            candle_core::bail!("frozen linear: the weight is not on the CPU");
        };
        let out = s.matmul(ws, (1, m, n, k), l, wt.layout())?;
        Ok((out, Shape::from((m, n))))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.w)?))
    }
}
