//! # turnwise-py
//!
//! The native module `turnwise._native` of the `turnwise` Python package (built with maturin,
//! see `pyproject.toml`): turnwise-core's plain-data algorithms on numpy arrays.
//!
//! - [`advantage`]: every advantage estimator of the registry, by name, on padded `[B, L]`
//!   token arrays and `[B, T]` per-turn arrays (plus a JSON form that takes a whole
//!   `AdvantageBatch`, AT2PO trees included).
//! - [`turns`]: turn ids from a multi-turn response mask, per-turn values spread onto their
//!   tokens, turn-reward placement (GAE token rewards) and the A2TGPO clip scale.
//! - [`text`]: the agent tag grammars (parse a turn, run a format validator) and the rewards
//!   (score a rollout by reward name; EM, F1 and friends).
//!
//! The Python layer (`python/turnwise/`) converts torch tensors and ragged lists to the
//! contiguous numpy arrays these functions take, and holds the torch policy losses.
//! Every refusal is a [`BindingError`], raised in Python as `ValueError`.

pub mod advantage;
pub mod error;
pub mod text;
pub mod turns;

pub use error::BindingError;

use pyo3::prelude::*;

/// The module `turnwise._native`.
#[pymodule(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    advantage::register(m)?;
    turns::register(m)?;
    text::register(m)?;
    Ok(())
}
