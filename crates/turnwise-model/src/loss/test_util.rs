//! Small helpers for the loss tests (f64 tensors on the CPU).

use candle_core::{DType, Device, Tensor, Var};

/// A [B, L] f64 tensor from rows.
pub(crate) fn t2(rows: &[&[f64]]) -> Tensor {
    let b = rows.len();
    let l = rows.first().map_or(0, |r| r.len());
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (b, l), &Device::Cpu).unwrap()
}

/// A trainable [B, L] f64 variable from rows.
pub(crate) fn var2(rows: &[&[f64]]) -> Var {
    Var::from_tensor(&t2(rows)).unwrap()
}

/// The value of a scalar tensor.
pub(crate) fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()[0]
}

/// The rows of a [B, L] tensor.
pub(crate) fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap()
}

/// Gradient rows of `loss` w.r.t. `v`.
pub(crate) fn grad_rows(loss: &Tensor, v: &Var) -> Vec<Vec<f64>> {
    let g = loss.backward().unwrap();
    rows(
        g.get(v.as_tensor())
            .expect("no gradient reached the variable"),
    )
}

/// Asserts element-wise closeness at absolute tolerance `tol`.
pub(crate) fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "length: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < tol, "{got:?} vs {want:?}");
    }
}
