//! Advantage estimators (turnwise-core `advantage`, spec §3) on numpy arrays.
//!
//! A batch of `B` rollouts is given as padded arrays: `turn_id` `[B, L]` (agent-turn index per
//! response token, `-1` for tool/observation tokens and padding), per-rollout `outcome` and
//! `group` `[B]`, per-turn inputs `[B, T]` (row `i` uses its first `num_turns_i` entries, or
//! `num_turns_i − 1` for `info_gain`; the rest is padding and is not read) and per-token inputs
//! `[B, L]`. `lengths` `[B]` cuts each row to its real response length (positions beyond it are
//! padding the estimator never sees).

use numpy::ndarray::{Array1, Array2, ArrayView1, ArrayView2};
use numpy::{IntoPyArray, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use turnwise_core::advantage::{
    AdvantageBatch, AdvantageConfig, AdvantageOutput, Channel, ESTIMATORS, Rollout, RolloutTree,
    estimate,
};

use crate::error::{BindingError, Result, from_json, to_json};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(estimators, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_json, m)?)?;
    Ok(())
}

/// The registered estimators as `(name, description)` pairs.
#[pyfunction]
pub fn estimators() -> Vec<(&'static str, &'static str)> {
    ESTIMATORS.to_vec()
}

/// Errors unless `got` has `rows` rows.
pub(crate) fn check_rows(arg: &'static str, got: &[usize], rows: usize, what: &str) -> Result<()> {
    if got.first() == Some(&rows) {
        Ok(())
    } else {
        Err(BindingError::Shape {
            arg,
            got: got.to_vec(),
            expected: format!("{rows} rows ({what})"),
        })
    }
}

/// A turn id as `i32`, refusing values below −1 or beyond `i32`.
pub(crate) fn turn_id_of(arg: &'static str, v: i64, at: (usize, usize)) -> Result<i32> {
    if v < -1 || v > i64::from(i32::MAX) {
        return Err(BindingError::invalid(
            arg,
            format!(
                "value {v} at index [{}, {}] is not a turn id (−1 for a tool/observation token, \
                 else 0, 1, 2, …)",
                at.0, at.1
            ),
        ));
    }
    Ok(v as i32)
}

/// The settings of estimator `name` from a JSON object (`"{}"` = the defaults).
fn config(name: &str, settings_json: &str) -> Result<AdvantageConfig> {
    let settings: serde_json::Value = from_json("settings", settings_json)?;
    Ok(AdvantageConfig::from_settings(name, settings)?)
}

/// The first `need` entries of row `i` of a per-turn array (all of the row when it is
/// shorter: the estimator then names the length mismatch).
fn per_turn(a: &ArrayView2<'_, f64>, i: usize, need: usize) -> Vec<f64> {
    let row = a.row(i);
    row.iter().take(need).copied().collect()
}

/// Per-token inputs of the rollouts, checked against `turn_id`'s shape.
fn per_token(
    arg: &'static str,
    a: &ArrayView2<'_, f64>,
    shape: Option<(usize, usize)>,
    lengths: &[usize],
) -> Result<Vec<Vec<f64>>> {
    let Some((b, l)) = shape else {
        return Err(BindingError::invalid(
            arg,
            "per-token inputs need `turn_id` (the token layout)",
        ));
    };
    if a.dim() != (b, l) {
        return Err(BindingError::Shape {
            arg,
            got: a.shape().to_vec(),
            expected: format!("[{b}, {l}] (the shape of `turn_id`)"),
        });
    }
    Ok((0..b)
        .map(|i| a.row(i).iter().take(lengths[i]).copied().collect())
        .collect())
}

/// Per-rollout strings (anchors, scopes): one list per rollout.
fn per_rollout_strings(
    arg: &'static str,
    v: Option<Vec<Vec<String>>>,
    b: usize,
) -> Result<Option<Vec<Vec<String>>>> {
    match v {
        Some(v) if v.len() != b => Err(BindingError::Shape {
            arg,
            got: vec![v.len()],
            expected: format!("one list per rollout ({b})"),
        }),
        other => Ok(other),
    }
}

/// The rollouts described by the arrays (see the module docs).
#[allow(clippy::too_many_arguments)]
fn rollouts(
    outcome: ArrayView1<'_, f64>,
    group: ArrayView1<'_, i64>,
    turn_id: Option<ArrayView2<'_, i64>>,
    lengths: Option<ArrayView1<'_, i64>>,
    num_turns: Option<ArrayView1<'_, i64>>,
    tree: Option<ArrayView1<'_, i64>>,
    leaf: Option<ArrayView1<'_, i64>>,
) -> Result<Vec<Rollout>> {
    let b = outcome.len();
    check_rows("group", group.shape(), b, "one per rollout, as `outcome`")?;
    let width = match &turn_id {
        Some(t) => {
            check_rows("turn_id", t.shape(), b, "one per rollout, as `outcome`")?;
            t.ncols()
        }
        None => 0,
    };
    let lengths: Vec<usize> = match lengths {
        None => vec![width; b],
        Some(l) => {
            check_rows("lengths", l.shape(), b, "one per rollout, as `outcome`")?;
            if turn_id.is_none() {
                return Err(BindingError::invalid(
                    "lengths",
                    "response lengths need `turn_id`",
                ));
            }
            l.iter()
                .enumerate()
                .map(|(i, &n)| {
                    usize::try_from(n)
                        .ok()
                        .filter(|&n| n <= width)
                        .ok_or_else(|| {
                            BindingError::invalid(
                                "lengths",
                                format!("lengths[{i}] = {n} is outside 0..={width} (the width of `turn_id`)"),
                            )
                        })
                })
                .collect::<Result<_>>()?
        }
    };
    for (arg, a) in [("num_turns", &num_turns), ("tree", &tree), ("leaf", &leaf)] {
        if let Some(a) = a {
            check_rows(arg, a.shape(), b, "one per rollout, as `outcome`")?;
        }
    }
    let mut out = Vec::with_capacity(b);
    for i in 0..b {
        let g = usize::try_from(group[i]).map_err(|_| {
            BindingError::invalid("group", format!("group[{i}] = {} is negative", group[i]))
        })?;
        let mut r = match &turn_id {
            Some(t) => {
                let ids = t
                    .row(i)
                    .iter()
                    .take(lengths[i])
                    .enumerate()
                    .map(|(k, &v)| turn_id_of("turn_id", v, (i, k)))
                    .collect::<Result<Vec<i32>>>()?;
                Rollout::new(g, ids, outcome[i])
            }
            None => Rollout::with_turns(g, 1, outcome[i]),
        };
        if let Some(nt) = &num_turns {
            let n = usize::try_from(nt[i])
                .ok()
                .filter(|&n| turn_id.is_none() || n >= r.num_turns)
                .ok_or_else(|| {
                    BindingError::invalid(
                        "num_turns",
                        format!(
                            "num_turns[{i}] = {} is below the {} turns `turn_id` row {i} names",
                            nt[i], r.num_turns
                        ),
                    )
                })?;
            r.num_turns = n;
        }
        if let Some(t) = &tree {
            r.tree = usize::try_from(t[i]).ok();
        }
        if let Some(l) = &leaf {
            r.leaf = usize::try_from(l[i]).ok();
        }
        out.push(r);
    }
    Ok(out)
}

/// Runs estimator `name` (settings: a JSON object, missing fields take the spec defaults) on a
/// padded batch; see the module docs for the layout. Returns a dict of numpy arrays: `tokens`
/// `[B, L]` (0 at padding), `turns` `[B, T_max]` (0-padded), `num_turns` `[B]`, and where the
/// estimator gives them `returns` `[B, L]` (GAE), `clip_scale` `[B, T_max]` (A2TGPO, 1-padded),
/// `normalized_info_gain` `[B, T_max − 1]` (A2TGPO, 0-padded) and `trees_json` (AT2PO).
#[pyfunction]
#[pyo3(signature = (
    name, settings, outcome, group, turn_id=None, lengths=None, num_turns=None,
    turn_rewards=None, info_gain=None, token_rewards=None, values=None, tree=None, leaf=None,
    step_rewards=None, step_scores=None, anchors=None, anchor_scopes=None, trees_json=None,
    step_penalties=None
))]
#[allow(clippy::too_many_arguments)]
pub fn estimate_arrays<'py>(
    py: Python<'py>,
    name: &str,
    settings: &str,
    outcome: PyReadonlyArray1<'py, f64>,
    group: PyReadonlyArray1<'py, i64>,
    turn_id: Option<PyReadonlyArray2<'py, i64>>,
    lengths: Option<PyReadonlyArray1<'py, i64>>,
    num_turns: Option<PyReadonlyArray1<'py, i64>>,
    turn_rewards: Option<PyReadonlyArray2<'py, f64>>,
    info_gain: Option<PyReadonlyArray2<'py, f64>>,
    token_rewards: Option<PyReadonlyArray2<'py, f64>>,
    values: Option<PyReadonlyArray2<'py, f64>>,
    tree: Option<PyReadonlyArray1<'py, i64>>,
    leaf: Option<PyReadonlyArray1<'py, i64>>,
    step_rewards: Option<PyReadonlyArray2<'py, f64>>,
    step_scores: Option<PyReadonlyArray2<'py, f64>>,
    anchors: Option<Vec<Vec<String>>>,
    anchor_scopes: Option<Vec<Vec<String>>>,
    trees_json: Option<&str>,
    step_penalties: Option<PyReadonlyArray2<'py, f64>>,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = config(name, settings)?;
    let tid = turn_id.as_ref().map(|t| t.as_array());
    let mut rs = rollouts(
        outcome.as_array(),
        group.as_array(),
        tid,
        lengths.as_ref().map(|a| a.as_array()),
        num_turns.as_ref().map(|a| a.as_array()),
        tree.as_ref().map(|a| a.as_array()),
        leaf.as_ref().map(|a| a.as_array()),
    )?;
    let b = rs.len();
    let shape = tid.map(|t| t.dim());
    let lens: Vec<usize> = rs.iter().map(|r| r.turn_id.len()).collect();
    for (arg, a, minus) in [
        ("turn_rewards", &turn_rewards, 0),
        ("info_gain", &info_gain, 1),
        ("step_rewards", &step_rewards, 0),
        ("step_scores", &step_scores, 0),
        ("step_penalties", &step_penalties, 0),
    ] {
        let Some(a) = a else { continue };
        let a = a.as_array();
        check_rows(arg, a.shape(), b, "one per rollout, as `outcome`")?;
        for (i, r) in rs.iter_mut().enumerate() {
            let v = per_turn(&a, i, r.num_turns.saturating_sub(minus));
            match arg {
                "turn_rewards" => r.turn_rewards = v,
                "info_gain" => r.info_gain = v,
                "step_rewards" => r.step_rewards = v,
                "step_penalties" => r.step_penalties = v,
                _ => r.step_scores = Some(v),
            }
        }
    }
    for (arg, a) in [("token_rewards", &token_rewards), ("values", &values)] {
        let Some(a) = a else { continue };
        let rows = per_token(arg, &a.as_array(), shape, &lens)?;
        for (r, v) in rs.iter_mut().zip(rows) {
            if arg == "values" {
                r.values = Some(v);
            } else {
                r.token_rewards = Some(v);
            }
        }
    }
    if let Some(a) = per_rollout_strings("anchors", anchors, b)? {
        for (r, v) in rs.iter_mut().zip(a) {
            r.anchors = v;
        }
    }
    if let Some(a) = per_rollout_strings("anchor_scopes", anchor_scopes, b)? {
        for (r, v) in rs.iter_mut().zip(a) {
            r.anchor_scopes = v;
        }
    }
    let trees: Vec<RolloutTree> = match trees_json {
        Some(t) => from_json("trees", t)?,
        None => Vec::new(),
    };
    let batch = AdvantageBatch::with_trees(rs, trees);
    let out = py
        .detach(|| estimate(&batch, &cfg))
        .map_err(BindingError::from)?;
    output_dict(py, &batch, &out, shape.map_or(0, |s| s.1))
}

/// A `[b, cols]` array holding row `i`'s values from `get(i)`, `pad` elsewhere.
fn padded<'a>(
    b: usize,
    cols: usize,
    pad: f64,
    get: impl Fn(usize) -> Option<&'a [f64]>,
) -> Array2<f64> {
    let mut a = Array2::from_elem((b, cols), pad);
    for i in 0..b {
        if let Some(v) = get(i) {
            for (k, &x) in v.iter().take(cols).enumerate() {
                a[[i, k]] = x;
            }
        }
    }
    a
}

/// The estimator output as padded numpy arrays (see [`estimate_arrays`]).
fn output_dict<'py>(
    py: Python<'py>,
    batch: &AdvantageBatch,
    out: &AdvantageOutput,
    width: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let b = batch.rollouts.len();
    let t_max = batch
        .rollouts
        .iter()
        .map(|r| r.num_turns)
        .max()
        .unwrap_or(0);
    let d = PyDict::new(py);
    d.set_item("estimator", &out.estimator)?;
    let tokens = padded(b, width, 0.0, |i| Some(&out.rollouts[i].tokens));
    d.set_item("tokens", tokens.into_pyarray(py))?;
    let turns = padded(b, t_max, 0.0, |i| Some(&out.rollouts[i].turns));
    d.set_item("turns", turns.into_pyarray(py))?;
    let nt: Array1<i64> = batch.rollouts.iter().map(|r| r.num_turns as i64).collect();
    d.set_item("num_turns", nt.into_pyarray(py))?;
    if out.rollouts.iter().any(|r| r.returns.is_some()) {
        let a = padded(b, width, 0.0, |i| out.rollouts[i].returns.as_deref());
        d.set_item("returns", a.into_pyarray(py))?;
    }
    // Each channel the estimator emitted, padded with its fill: [B, T_max] per agent turn,
    // [B, T_max − 1] per process turn.
    for c in Channel::ALL {
        if out.rollouts.iter().any(|r| r.channels.contains_key(&c)) {
            let width = if c.per_process_turn() {
                t_max.saturating_sub(1)
            } else {
                t_max
            };
            let a = padded(b, width, c.fill(), |i| {
                out.rollouts[i].channels.get(&c).map(Vec::as_slice)
            });
            d.set_item(c.key(), a.into_pyarray(py))?;
        }
    }
    if !out.trees.is_empty() {
        let js = to_json("trees", &out.trees)?;
        d.set_item("trees_json", js)?;
    }
    Ok(d)
}

/// Runs estimator `name` on a whole `AdvantageBatch` given as JSON (the serde form of
/// turnwise-core's `AdvantageBatch`: `{"rollouts": [...], "trees": [...]}`); returns the
/// `AdvantageOutput` as JSON. Covers every input, AT2PO trees included.
#[pyfunction]
pub fn estimate_json(py: Python<'_>, name: &str, settings: &str, batch: &str) -> PyResult<String> {
    let cfg = config(name, settings)?;
    let batch: AdvantageBatch = from_json("batch", batch)?;
    let out = py
        .detach(|| estimate(&batch, &cfg))
        .map_err(BindingError::from)?;
    Ok(to_json("output", &out)?)
}
