//! Turn structure on token arrays: turn ids from a response mask, per-turn values onto their
//! tokens, turn-reward placement, and the A2TGPO clip scale.

use numpy::ndarray::{Array2, Dimension};
use numpy::{
    IntoPyArray, PyArray2, PyArrayDyn, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn,
};
use pyo3::prelude::*;
use turnwise_core::advantage::{a2tgpo_clip_scale, broadcast_turns, place_turn_rewards};
use turnwise_core::trajectory::mask_run_turns;

use crate::advantage::{check_rows, turn_id_of};
use crate::error::{BindingError, Result};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(turn_ids_from_mask, m)?)?;
    m.add_function(wrap_pyfunction!(turn_values_to_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(place_rewards, m)?)?;
    m.add_function(wrap_pyfunction!(clip_scale, m)?)?;
    Ok(())
}

/// Turn ids of a multi-turn response mask `[B, L]` (1 = model token, 0 = tool/observation
/// token, as verl's and TRL's multi-turn loops mark them): each maximal run of model tokens is
/// one turn, numbered 0, 1, 2, … per row; tool tokens (and padding) get −1 (spec §1.2).
#[pyfunction]
pub fn turn_ids_from_mask<'py>(
    py: Python<'py>,
    mask: PyReadonlyArray2<'py, i64>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let mask = mask.as_array();
    let (b, l) = mask.dim();
    let mut out = Array2::from_elem((b, l), -1i64);
    let mut row = vec![0u8; l];
    for i in 0..b {
        for (t, (&m, slot)) in mask.row(i).iter().zip(row.iter_mut()).enumerate() {
            *slot = match m {
                0 => 0,
                1 => 1,
                other => {
                    return Err(BindingError::invalid(
                        "mask",
                        format!("must hold 0 and 1 only, found {other} at index [{i}, {t}]"),
                    )
                    .into());
                }
            };
        }
        for (k, (start, end)) in mask_run_turns(&row).into_iter().enumerate() {
            for t in start..end {
                out[[i, t]] = k as i64;
            }
        }
    }
    Ok(out.into_pyarray(py))
}

/// Row `i` of `turn_id` as `i32` turn ids, checking that every id indexes `per_turn`'s
/// `cols` columns.
fn row_ids(
    turn_id: &numpy::ndarray::ArrayView2<'_, i64>,
    i: usize,
    cols: usize,
    per_turn_arg: &'static str,
) -> Result<Vec<i32>> {
    turn_id
        .row(i)
        .iter()
        .enumerate()
        .map(|(t, &v)| {
            let id = turn_id_of("turn_id", v, (i, t))?;
            if id >= 0 && id as usize >= cols {
                return Err(BindingError::Shape {
                    arg: per_turn_arg,
                    got: vec![turn_id.nrows(), cols],
                    expected: format!(
                        "at least {} columns: `turn_id` names turn {id} at index [{i}, {t}]",
                        id + 1
                    ),
                });
            }
            Ok(id)
        })
        .collect()
}

/// Checks that the entries of `a` that `used(i, k)` selects are finite.
fn check_finite(
    arg: &'static str,
    a: &numpy::ndarray::ArrayView2<'_, f64>,
    used: impl Fn(usize, usize) -> bool,
) -> Result<()> {
    for ((i, k), &v) in a.indexed_iter() {
        if !v.is_finite() && used(i, k) {
            return Err(BindingError::NonFinite {
                arg,
                index: vec![i, k],
                value: v,
            });
        }
    }
    Ok(())
}

/// Spreads per-turn values `[B, T]` onto tokens `[B, L]`: token `t` of row `i` gets
/// `per_turn[i, turn_id[i, t]]`, tool tokens (`turn_id = −1`) get `fill`. Every turn id must
/// index a column of `per_turn`.
#[pyfunction]
#[pyo3(signature = (turn_id, per_turn, fill=0.0))]
pub fn turn_values_to_tokens<'py>(
    py: Python<'py>,
    turn_id: PyReadonlyArray2<'py, i64>,
    per_turn: PyReadonlyArray2<'py, f64>,
    fill: f64,
) -> PyResult<Bound<'py, PyArray2<f64>>> {
    let (tid, vals) = (turn_id.as_array(), per_turn.as_array());
    let (b, l) = tid.dim();
    check_rows("per_turn", vals.shape(), b, "one per row of `turn_id`")?;
    let mut out = Array2::zeros((b, l));
    for i in 0..b {
        let ids = row_ids(&tid, i, vals.ncols(), "per_turn")?;
        let row: Vec<f64> = vals.row(i).to_vec();
        if let Some((k, &v)) = ids
            .iter()
            .filter(|&&id| id >= 0)
            .map(|&id| (id as usize, &row[id as usize]))
            .find(|(_, v)| !v.is_finite())
        {
            return Err(BindingError::NonFinite {
                arg: "per_turn",
                index: vec![i, k],
                value: v,
            }
            .into());
        }
        for (t, v) in broadcast_turns(&ids, &row, fill).into_iter().enumerate() {
            out[[i, t]] = v;
        }
    }
    Ok(out.into_pyarray(py))
}

/// Turn-reward placement for GAE (spec §3.3, turn-level-rewards.md eq. 10): `turn_rewards[i,
/// k]` on the last model token of turn `k`, `outcome[i]` on the last model token of row `i`,
/// 0 elsewhere. Row `i` reads its first `max(turn_id[i]) + 1` rewards (the rest is padding).
#[pyfunction]
pub fn place_rewards<'py>(
    py: Python<'py>,
    turn_id: PyReadonlyArray2<'py, i64>,
    turn_rewards: PyReadonlyArray2<'py, f64>,
    outcome: PyReadonlyArray1<'py, f64>,
) -> PyResult<Bound<'py, PyArray2<f64>>> {
    let (tid, tr, oc) = (
        turn_id.as_array(),
        turn_rewards.as_array(),
        outcome.as_array(),
    );
    let (b, l) = tid.dim();
    check_rows("turn_rewards", tr.shape(), b, "one per row of `turn_id`")?;
    check_rows("outcome", oc.shape(), b, "one per row of `turn_id`")?;
    let mut out = Array2::zeros((b, l));
    for i in 0..b {
        let ids = row_ids(&tid, i, tr.ncols(), "turn_rewards")?;
        let n = ids
            .iter()
            .copied()
            .max()
            .map_or(0, |m| (m + 1).max(0) as usize);
        if !oc[i].is_finite() {
            return Err(BindingError::NonFinite {
                arg: "outcome",
                index: vec![i],
                value: oc[i],
            }
            .into());
        }
        let rewards: Vec<f64> = tr.row(i).iter().take(n).copied().collect();
        check_finite("turn_rewards", &tr, |r, k| r == i && k < n)?;
        let placed = place_turn_rewards(&ids, &rewards, oc[i])
            .map_err(|m| BindingError::invalid("turn_rewards", format!("row {i}: {m}")))?;
        for (t, v) in placed.into_iter().enumerate() {
            out[[i, t]] = v;
        }
    }
    Ok(out.into_pyarray(py))
}

/// A2TGPO clip scale `c = 1 + β(2σ(îg) − 1)` (spec §5.5 eq. 10), element-wise.
#[pyfunction]
#[pyo3(signature = (normalized_info_gain, beta=0.3))]
pub fn clip_scale<'py>(
    py: Python<'py>,
    normalized_info_gain: PyReadonlyArrayDyn<'py, f64>,
    beta: f64,
) -> PyResult<Bound<'py, PyArrayDyn<f64>>> {
    if !beta.is_finite() {
        return Err(BindingError::invalid("beta", format!("must be finite, got {beta}")).into());
    }
    let a = normalized_info_gain.as_array();
    if let Some((idx, &v)) = a.indexed_iter().find(|(_, v)| !v.is_finite()) {
        return Err(BindingError::NonFinite {
            arg: "normalized_info_gain",
            index: idx.slice().to_vec(),
            value: v,
        }
        .into());
    }
    Ok(a.mapv(|x| a2tgpo_clip_scale(x, beta)).into_pyarray(py))
}
