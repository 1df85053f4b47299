"""Advantage estimators (turnwise-core, spec §3), computed in Rust on numpy arrays.

A batch of ``B`` rollouts is given as:

- ``outcome`` ``[B]``: the outcome reward of each rollout (the GRPO score);
- ``group`` ``[B]``: prompt-group id (rollouts of the same prompt share it; default: one group);
- ``turn_id`` ``[B, L]`` (optional): the agent-turn index of every response token, ``-1`` for
  tool/observation tokens and padding (``turn_ids_from_mask`` builds it from a response mask).
  Without it the estimators return per-turn (for outcome-only ones: per-rollout) advantages only;
- per-turn inputs ``[B, T]`` (``turn_rewards``, ``info_gain``, ``step_rewards``, …): row ``i``
  uses its first ``num_turns_i`` entries (``num_turns_i - 1`` for ``info_gain``, one per
  process turn); the rest is padding and is never read (pad with anything, NaN included).
  A list of 1-D rows of different lengths is accepted too;
- per-token inputs ``[B, L]`` (``values``, ``token_rewards``) aligned with ``turn_id``;
- ``lengths`` ``[B]`` (optional): real response lengths (tokens beyond are padding).

Inputs may be numpy arrays, torch tensors (results then come back as torch tensors on the same
device) or nested lists. Estimator settings are keyword arguments with the names of the Rust
config fields (``epsilon``, ``std="population"``, ``gamma``, ``clip_beta``, …); missing ones take
the spec defaults and unknown ones raise ``ValueError``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from . import _native
from ._convert import Returner, array, int_array, optional, strings

__all__ = [
    "Advantages",
    "ESTIMATORS",
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
]

#: Registered estimator names with the spec section of each.
ESTIMATORS: List[Tuple[str, str]] = list(_native.estimators())


@dataclass
class Advantages:
    """What an estimator returns (numpy arrays, or torch tensors when given torch inputs)."""

    #: Registry name of the estimator.
    estimator: str
    #: ``[B, L]`` per-token advantages aligned with ``turn_id`` (0 on padding; tool tokens hold 0
    #: unless the reference code writes a value there, which the loss mask removes).
    tokens: Any
    #: ``[B, T_max]`` per-turn advantages (0-padded beyond each rollout's ``num_turns``).
    turns: Any
    #: ``[B]`` number of agent turns of each rollout.
    num_turns: Any
    #: ``[B, L]`` GAE value targets ``A + V`` (before whitening); ``None`` for other estimators.
    returns: Any = None
    #: ``[B, T_max]`` A2TGPO clip scale per turn (1 for the final turn and padding).
    clip_scale: Any = None
    #: ``[B, T_max - 1]`` A2TGPO normalized information gain per process turn.
    normalized_info_gain: Any = None
    #: ``[B, T_max]`` GiGPO/T2PO anchor group of each step (its id in the batch, numbered in
    #: first appearance; -1 on padding).
    step_group: Any = None
    #: ``[B, T_max]`` GiGPO/T2PO size of each step's anchor group in step samples (0 on padding).
    step_group_size: Any = None
    #: AT2PO per-tree ``{"values": [...], "advantages": [...]}``; ``None`` otherwise.
    trees: Optional[list] = None


def _settings(settings: dict) -> str:
    for k, v in settings.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"settings: `{k}` = {v} is not finite")
    try:
        return json.dumps(settings, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`settings` must be JSON numbers, strings and booleans: {e}") from None


def estimate(
    name: str,
    outcome: Any,
    group: Any = None,
    turn_id: Any = None,
    *,
    lengths: Any = None,
    num_turns: Any = None,
    turn_rewards: Any = None,
    info_gain: Any = None,
    token_rewards: Any = None,
    values: Any = None,
    tree: Any = None,
    leaf: Any = None,
    step_rewards: Any = None,
    step_scores: Any = None,
    step_penalties: Any = None,
    anchors: Optional[List[List[str]]] = None,
    anchor_scopes: Optional[List[List[str]]] = None,
    trees: Optional[list] = None,
    **settings: Any,
) -> Advantages:
    """Runs the estimator registered as ``name`` (see ``ESTIMATORS``) on a padded batch.

    ``tree``/``leaf`` ``[B]`` are the Tree-GRPO tree label / AT2PO tree index and leaf node
    (``-1`` = none); ``trees`` are AT2PO rollout trees as dicts in turnwise-core's serde form
    (``{"group": 0, "nodes": [{"parent": null, "is_leaf": false, "entropy": 0.0, "reward":
    null, "span": 0}, ...]}``). ``anchors``/``anchor_scopes`` are GiGPO/T2PO per-step anchor
    strings, one list per rollout.
    """
    ret = Returner(outcome, group, turn_id, turn_rewards, info_gain, token_rewards, values, step_rewards)
    outcome = array(outcome, np.float64, "outcome", ndim=1)
    b = outcome.shape[0]
    group = np.zeros(b, dtype=np.int64) if group is None else int_array(group, "group", ndim=1)
    f2 = lambda x, n: array(x, np.float64, n, ndim=2, pad=np.nan)  # noqa: E731
    out = _native.estimate_arrays(
        name,
        _settings(settings),
        outcome,
        group,
        turn_id=optional(turn_id, int_array, "turn_id", 2),
        lengths=optional(lengths, int_array, "lengths", 1),
        num_turns=optional(num_turns, int_array, "num_turns", 1),
        turn_rewards=optional(turn_rewards, f2, "turn_rewards"),
        info_gain=optional(info_gain, f2, "info_gain"),
        token_rewards=optional(token_rewards, lambda x, n: array(x, np.float64, n, ndim=2), "token_rewards"),
        values=optional(values, lambda x, n: array(x, np.float64, n, ndim=2), "values"),
        tree=optional(tree, int_array, "tree", 1),
        leaf=optional(leaf, int_array, "leaf", 1),
        step_rewards=optional(step_rewards, f2, "step_rewards"),
        step_scores=optional(step_scores, f2, "step_scores"),
        step_penalties=optional(step_penalties, f2, "step_penalties"),
        anchors=strings(anchors, "anchors"),
        anchor_scopes=strings(anchor_scopes, "anchor_scopes"),
        trees_json=None if trees is None else json.dumps(trees),
    )
    tj = out.get("trees_json")
    return Advantages(
        estimator=out["estimator"],
        tokens=ret(out["tokens"]),
        turns=ret(out["turns"]),
        num_turns=ret(out["num_turns"]),
        returns=ret(out.get("returns")),
        clip_scale=ret(out.get("clip_scale")),
        normalized_info_gain=ret(out.get("normalized_info_gain")),
        step_group=ret(out.get("step_group")),
        step_group_size=ret(out.get("step_group_size")),
        trees=None if tj is None else json.loads(tj),
    )


def estimate_json(name: str, batch: dict, **settings: Any) -> dict:
    """Runs estimator ``name`` on a whole ``AdvantageBatch`` in turnwise-core's serde form
    (``{"rollouts": [{"group": 0, "num_turns": 2, "turn_id": [...], "outcome": 1.0, ...}],
    "trees": [...]}``) and returns the ``AdvantageOutput`` as a dict. Every estimator input is
    reachable this way."""
    return json.loads(_native.estimate_json(name, _settings(settings), json.dumps(batch)))


def grpo(outcome: Any, group: Any = None, turn_id: Any = None, **settings: Any) -> Advantages:
    """§3.1 GRPO: ``(s − mean_g) / (std_g + ε)`` per prompt group (settings ``std`` =
    ``"unbiased"``/``"population"``, ``epsilon`` = 1e-6), broadcast to every agent token."""
    return estimate("grpo", outcome, group, turn_id, **settings)


def dr_grpo(outcome: Any, group: Any = None, turn_id: Any = None, **settings: Any) -> Advantages:
    """§3.1 Dr.GRPO: ``s − mean_g``."""
    return estimate("dr_grpo", outcome, group, turn_id, **settings)


def rloo(outcome: Any, group: Any = None, turn_id: Any = None, **settings: Any) -> Advantages:
    """§3.1 RLOO: ``s_i − mean_{j≠i} s_j``."""
    return estimate("rloo", outcome, group, turn_id, **settings)


def mt_grpo(
    turn_rewards: Any,
    group: Any = None,
    turn_id: Any = None,
    *,
    outcome: Any = None,
    num_turns: Any = None,
    **settings: Any,
) -> Advantages:
    """§3.2 MT-GRPO: per-turn group normalization of ``turn_rewards`` ``[B, K]`` and the sum of
    the current and future turn advantages (settings ``std``, ``epsilon``, ``state_key``).
    Without ``turn_id`` every rollout has ``K`` turns (or ``num_turns``)."""
    tr = array(turn_rewards, np.float64, "turn_rewards", ndim=2, pad=np.nan)
    b, k = tr.shape
    if outcome is None:
        outcome = np.zeros(b)
    if turn_id is None and num_turns is None:
        num_turns = np.full(b, k, dtype=np.int64)
    ret = Returner(turn_rewards, group, turn_id)
    out = estimate(
        "mt_grpo", outcome, group, turn_id, turn_rewards=tr, num_turns=num_turns, **settings
    )
    return _retype(out, ret)


def gae(
    turn_id: Any,
    values: Any,
    *,
    outcome: Any = None,
    turn_rewards: Any = None,
    token_rewards: Any = None,
    lengths: Any = None,
    **settings: Any,
) -> Advantages:
    """§3.3 GAE (PPO, MT-PPO, ST-PPO) with critic ``values`` ``[B, L]``. Token rewards are
    ``token_rewards`` ``[B, L]`` if given, else placed from ``turn_rewards`` (last model token of
    each turn) and ``outcome`` (last model token). Settings ``gamma``, ``lam`` (1.0),
    ``skip_observations`` (True: current verl), ``whiten`` (True). ``returns`` holds ``A + V``."""
    tid = int_array(turn_id, "turn_id", ndim=2)
    if outcome is None:
        outcome = np.zeros(tid.shape[0])
    ret = Returner(turn_id, values, outcome, turn_rewards, token_rewards)
    out = estimate(
        "gae",
        outcome,
        None,
        tid,
        values=values,
        turn_rewards=turn_rewards,
        token_rewards=token_rewards,
        lengths=lengths,
        **settings,
    )
    return _retype(out, ret)


def igpo(
    info_gain: Any, outcome: Any, group: Any = None, turn_id: Any = None, **settings: Any
) -> Advantages:
    """§3.4 IGPO: information-gain turn rewards ``info_gain`` ``[B, T-1]`` (one per process turn)
    plus the outcome (settings ``form`` = ``"paper"``/``"code"``, ``gamma``, ``std``,
    ``epsilon``)."""
    return estimate("igpo", outcome, group, turn_id, info_gain=info_gain, **settings)


def a2tgpo(
    info_gain: Any,
    outcome: Any,
    group: Any = None,
    turn_id: Any = None,
    *,
    num_turns: Any = None,
    **settings: Any,
) -> Advantages:
    """§3.5 A2TGPO: turn-group normalized information gain, discounted with variance rescaling,
    plus the GRPO-normalized outcome; also returns ``clip_scale`` ``c = 1 + β(2σ(îg) − 1)``
    per turn (§5.5) for ``losses.policy_loss(..., policy_loss="a2tgpo")``. ``info_gain`` is
    ``[B, T-1]``; without ``turn_id`` give ``num_turns``. Settings ``gamma`` (1.0),
    ``clip_beta`` (0.3), ``ig_epsilon``, ``ig_std``, ``outcome_std``, ``outcome_epsilon``,
    ``variance_rescaling``."""
    return estimate(
        "a2tgpo", outcome, group, turn_id, info_gain=info_gain, num_turns=num_turns, **settings
    )


def tree_grpo(
    outcome: Any, group: Any, tree: Any, turn_id: Any = None, **settings: Any
) -> Advantages:
    """§3.8 Tree-GRPO: inter- and intra-tree GRPO (``tree`` ``[B]`` labels the tree of each
    rollout within its group; settings ``mode``, ``epsilon``)."""
    return estimate("tree_grpo", outcome, group, turn_id, tree=tree, **settings)


def gigpo(
    step_rewards: Any,
    anchors: List[List[str]],
    group: Any = None,
    turn_id: Any = None,
    *,
    outcome: Any = None,
    step_penalties: Any = None,
    name: str = "gigpo",
    **settings: Any,
) -> Advantages:
    """§3.7 GiGPO (``name="t2po"`` for T2PO's fusion): episode advantages plus anchor-state step
    advantages from per-step ``step_rewards`` ``[B, T]`` and ``anchors`` (one string per step).

    ``step_penalties`` ``[B, T]`` (e.g. the invalid-action penalty) are taken off each step's
    discounted return after discounting, as verl-agent's ``apply_invalid_action_penalty``: a
    penalty lowers only its own step's return. Subtracting it from ``step_rewards`` instead
    would also lower every earlier step's return by ``γ^{k−j}·p``."""
    sr = array(step_rewards, np.float64, "step_rewards", ndim=2, pad=np.nan)
    if outcome is None:
        outcome = np.zeros(sr.shape[0])
    num_turns = None
    if turn_id is None:
        num_turns = np.array([len(a) for a in anchors], dtype=np.int64)
    ret = Returner(step_rewards, group, turn_id)
    out = estimate(
        name,
        outcome,
        group,
        turn_id,
        step_rewards=sr,
        step_penalties=step_penalties,
        anchors=anchors,
        num_turns=num_turns,
        **settings,
    )
    return _retype(out, ret)


def at2po(
    outcome: Any,
    trees: list,
    tree: Any,
    leaf: Any,
    group: Any = None,
    turn_id: Any = None,
    **settings: Any,
) -> Advantages:
    """§3.6 AT2PO tree node values and turn-wise credit: each rollout is the root→leaf path of
    ``trees[tree[i]]`` ending at node ``leaf[i]``."""
    return estimate(
        "at2po", outcome, group, turn_id, tree=tree, leaf=leaf, trees=trees, **settings
    )


def _retype(out: Advantages, ret: Returner) -> Advantages:
    """Re-applies the caller's torch/numpy choice when inputs were converted beforehand."""
    if not ret.torch:
        return out
    for f in (
        "tokens",
        "turns",
        "num_turns",
        "returns",
        "clip_scale",
        "normalized_info_gain",
        "step_group",
        "step_group_size",
    ):
        v = getattr(out, f)
        if isinstance(v, np.ndarray):
            setattr(out, f, ret(v))
    return out
