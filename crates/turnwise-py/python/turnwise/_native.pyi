"""Type stub of the native module ``turnwise._native`` (crates/turnwise-py/src, PyO3).

One entry per name the module exports (``python/tests/test_typing.py`` checks the names and each
function's parameters against the built module). Arrays are numpy arrays of exactly the dtype
given: the bindings take float64 and int64 arrays and do not convert others.
"""

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "__version__",
    "estimators",
    "estimate_arrays",
    "estimate_json",
    "turn_ids_from_mask",
    "turn_values_to_tokens",
    "place_rewards",
    "clip_scale",
    "formats",
    "validators",
    "reward_names",
    "parse_turn",
    "validate",
    "score",
    "normalize_answer",
    "em",
    "sub_em",
    "f1",
    "igpo_f1",
]

__version__: str

# --- advantage.rs

def estimators() -> list[tuple[str, str]]:
    """The registered estimators as ``(name, description)`` pairs."""

def estimate_arrays(
    name: str,
    settings: str,
    outcome: NDArray[np.float64],
    group: NDArray[np.int64],
    turn_id: NDArray[np.int64] | None = None,
    lengths: NDArray[np.int64] | None = None,
    num_turns: NDArray[np.int64] | None = None,
    turn_rewards: NDArray[np.float64] | None = None,
    info_gain: NDArray[np.float64] | None = None,
    token_rewards: NDArray[np.float64] | None = None,
    values: NDArray[np.float64] | None = None,
    tree: NDArray[np.int64] | None = None,
    leaf: NDArray[np.int64] | None = None,
    step_rewards: NDArray[np.float64] | None = None,
    step_scores: NDArray[np.float64] | None = None,
    anchors: Sequence[Sequence[str]] | None = None,
    anchor_scopes: Sequence[Sequence[str]] | None = None,
    trees_json: str | None = None,
    step_penalties: NDArray[np.float64] | None = None,
) -> dict[str, str | NDArray[np.float64] | NDArray[np.int64]]:
    """Runs estimator ``name`` (``settings``: a JSON object) on a padded batch.

    Returns ``estimator`` (its name), ``tokens`` ``[B, L]``, ``turns`` ``[B, T_max]``,
    ``num_turns`` ``[B]`` (int64) and, where the estimator gives them, ``returns``,
    ``clip_scale``, ``normalized_info_gain``, ``step_group``, ``step_group_size`` and
    ``trees_json`` (a JSON string).
    """

def estimate_json(name: str, settings: str, batch: str) -> str:
    """Runs estimator ``name`` on an ``AdvantageBatch`` given as JSON; returns the output as JSON."""

# --- turns.rs

def turn_ids_from_mask(mask: NDArray[np.int64]) -> NDArray[np.int64]:
    """Turn ids ``[B, L]`` of a 0/1 response mask: 0, 1, 2, ... per run of 1s, -1 elsewhere."""

def turn_values_to_tokens(
    turn_id: NDArray[np.int64], per_turn: NDArray[np.float64], fill: float = 0.0
) -> NDArray[np.float64]:
    """Spreads per-turn values ``[B, T]`` onto tokens ``[B, L]``; ``fill`` at turn id -1."""

def place_rewards(
    turn_id: NDArray[np.int64], turn_rewards: NDArray[np.float64], outcome: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Turn rewards on each turn's last model token, the outcome on a row's last (spec §3.3)."""

def clip_scale(normalized_info_gain: NDArray[np.float64], beta: float = 0.3) -> NDArray[np.float64]:
    """A2TGPO clip scale ``1 + beta * (2 * sigmoid(x) - 1)``, element-wise (spec §5.5)."""

# --- text.rs

def formats() -> list[str]:
    """The agent format names."""

def validators() -> list[tuple[str, str]]:
    """The validator names of :func:`validate` with a description of each."""

def reward_names() -> list[str]:
    """The reward names of :func:`score`."""

def parse_turn(format: str, text: str, script: str | None = None) -> str:
    """Parses one agent turn in ``format``; returns the ``ParsedTurn`` as JSON."""

def validate(rule: str, text: str, script: str | None = None) -> tuple[str, int | None] | None:
    """Runs validator ``rule`` on a response: ``None`` when it passes, else ``(reason, offset)``."""

def score(reward: str, turns: Sequence[tuple[str, str | None]], golds: Sequence[str]) -> str:
    """Scores one rollout with the reward ``reward`` (JSON); returns the ``RewardOutput`` as JSON."""

def normalize_answer(text: str) -> str:
    """§2.1 ``normalize_answer``."""

def em(prediction: str, golds: Sequence[str]) -> float:
    """§2.1 exact match."""

def sub_em(prediction: str, golds: Sequence[str]) -> float:
    """§2.1 SubEM."""

def f1(prediction: str, golds: Sequence[str]) -> float:
    """§2.2 SQuAD token F1, maximum over the golds."""

def igpo_f1(prediction: str, golds: Sequence[str]) -> float:
    """§2.2 IGPO's F1 variant, maximum over the golds."""
