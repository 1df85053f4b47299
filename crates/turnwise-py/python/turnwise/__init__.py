"""turnwise: turn-level RL for LLM agents, from Python.

The algorithms of the Rust crate turnwise-core on numpy arrays (torch tensors accepted and
returned): every advantage estimator (:mod:`turnwise.advantage`), turn structure and
turn-reward placement (:mod:`turnwise.turns`), the agent tag grammars
(:mod:`turnwise.grammar`) and rewards (:mod:`turnwise.rewards`); plus the turn-level policy
losses in torch (:mod:`turnwise.losses`, imported on first use: only it needs torch).
Formulas and section numbers follow turnwise's ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Any

from . import _native
from .advantage import (
    ESTIMATORS,
    Advantages,
    a2tgpo,
    at2po,
    dr_grpo,
    estimate,
    estimate_json,
    gae,
    gigpo,
    grpo,
    igpo,
    mt_grpo,
    rloo,
    tree_grpo,
)
from .grammar import FORMATS, VALIDATORS, parse_turn, validate
from .rewards import REWARDS, em, f1, igpo_f1, normalize_answer, score, sub_em
from .turns import a2tgpo_clip_scale, place_turn_rewards, turn_ids_from_mask, turn_values_to_tokens

__version__: str = _native.__version__

__all__ = [
    "ESTIMATORS",
    "Advantages",
    "estimate",
    "estimate_json",
    "grpo",
    "dr_grpo",
    "rloo",
    "mt_grpo",
    "gae",
    "igpo",
    "a2tgpo",
    "tree_grpo",
    "gigpo",
    "at2po",
    "turn_ids_from_mask",
    "turn_values_to_tokens",
    "place_turn_rewards",
    "a2tgpo_clip_scale",
    "FORMATS",
    "VALIDATORS",
    "parse_turn",
    "validate",
    "REWARDS",
    "score",
    "normalize_answer",
    "em",
    "sub_em",
    "f1",
    "igpo_f1",
    "losses",
]


def __getattr__(name: str) -> Any:
    # `turnwise.losses` needs torch: import it on first use only.
    if name == "losses":
        import importlib

        return importlib.import_module(".losses", __name__)
    raise AttributeError(f"module 'turnwise' has no attribute {name!r}")
