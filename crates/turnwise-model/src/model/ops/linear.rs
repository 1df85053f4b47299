//! `x Wᵀ` for a weight in Hugging Face layout `[out, in]`, with the backward pass a trainer
//! needs: both gradients for a trained weight, the input's alone for a frozen one (LoRA).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Storage, Tensor};

/// `x Wᵀ` for `x: [M, K]` and `w: [N, K]`, on the CPU as one op whose backward writes each
/// gradient in its own layout:
///
/// - a trained weight (`w` records a graph): `dW = gᵀ x` straight into `[N, K]`, where
///   `x.matmul(&w.t())` leaves candle's backward a `[K, N]` product to transpose-copy into
///   the weight's layout (a strided copy of every weight's gradient, every step);
/// - a frozen weight (only `x` records a graph): the input's gradient `g W` alone.
///
/// Off the CPU, for other ranks, or when nothing records a graph this is
/// `x.matmul(&w.t())`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let cpu_2d = x.device().is_cpu() && x.rank() == 2 && w.rank() == 2;
    if cpu_2d && w.track_op() {
        return x.apply_op2(w, TrainedLinear);
    }
    if cpu_2d && x.track_op() {
        return x.apply_op1(FrozenLinear { w: w.clone() });
    }
    x.matmul(&w.t()?)
}

/// `x Wᵀ` from the storages: `w` is read through its transposed layout, so nothing is copied.
fn forward(
    s: &CpuStorage,
    l: &Layout,
    ws: &CpuStorage,
    wl: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let (m, k) = l.shape().dims2()?;
    let (n, k2) = wl.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("linear: input [{m}, {k}] against weight [{n}, {k2}]");
    }
    let out = s.matmul(ws, (1, m, n, k), l, &wl.transpose(0, 1)?)?;
    Ok((out, Shape::from((m, n))))
}

/// `x Wᵀ` with a trained weight: the gradients of both.
struct TrainedLinear;

impl CustomOp2 for TrainedLinear {
    fn name(&self) -> &'static str {
        "turnwise-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dx = x.track_op().then(|| grad.matmul(w)).transpose()?;
        // `[N, M] × [M, K]`: the weight's own layout, contiguous.
        let dw = grad.t()?.matmul(x)?;
        Ok((dx, Some(dw)))
    }
}

/// `x Wᵀ` with a frozen weight: the input's gradient only.
struct FrozenLinear {
    w: Tensor,
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "turnwise-frozen-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cpu(ws) = &*ws else {
            candle_core::bail!("frozen linear: the weight is not on the CPU");
        };
        forward(s, l, ws, wl)
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.w)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// The backward writes the weight's gradient contiguous in its own `[out, in]` layout:
    /// candle's backward of `x.matmul(&w.t())` leaves a transposed `[in, out]` product that
    /// the gradient store must copy, every weight, every step.
    #[test]
    fn the_weight_gradient_comes_out_in_the_weight_layout() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (37, 24), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 1., (19, 24), &dev).unwrap()).unwrap();
        let y = linear(&x, &w).unwrap();
        let g = Tensor::randn(0f32, 1., (37, 19), &dev).unwrap();
        let (dx, dw) = TrainedLinear.bwd(&x, &w, &y, &g).unwrap();
        let (dx, dw) = (dx.unwrap(), dw.unwrap());
        assert_eq!(dw.dims(), &[19, 24]);
        assert!(
            dw.is_contiguous(),
            "the weight's gradient is a strided view"
        );
        assert_eq!(dx.dims(), &[37, 24]);
        let want = g.t().unwrap().matmul(&x).unwrap();
        let d = (dw - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-5);
    }
}
