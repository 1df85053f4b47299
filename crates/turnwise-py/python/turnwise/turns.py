"""Turn structure on token arrays (spec §1.2, §3.3, §5.5), computed in Rust.

Every function takes one row (1-D) or a batch (2-D, ``[B, L]``) as numpy arrays, torch
tensors or lists, and returns the same kind (torch in → torch out, on the input's device).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _native
from ._convert import Returner, array, rows2d

__all__ = [
    "turn_ids_from_mask",
    "turn_values_to_tokens",
    "place_turn_rewards",
    "a2tgpo_clip_scale",
]


def turn_ids_from_mask(mask: Any) -> Any:
    """Turn ids of a multi-turn response mask (1 = model token, 0 = tool/observation token,
    as verl's and TRL's multi-turn loops mark them): each maximal run of model tokens is one
    turn, numbered 0, 1, 2, … per row; tool tokens and padding get -1. Returns int64.

    >>> turn_ids_from_mask([1, 1, 0, 0, 1, 1, 0])
    array([ 0,  0, -1, -1,  1,  1, -1])
    """
    ret = Returner(mask)
    m, one = rows2d(_as_int_mask(mask), np.int64, "mask")
    out = _native.turn_ids_from_mask(m)
    return ret(out[0] if one else out)


def _as_int_mask(mask: Any) -> Any:
    from ._convert import is_torch

    if is_torch(mask):
        mask = mask.detach().cpu().numpy()
    a = np.asarray(mask)
    if a.dtype == np.bool_:
        return a.astype(np.int64)
    if a.dtype.kind == "f":
        if not np.all((a == 0) | (a == 1)):
            bad = a[(a != 0) & (a != 1)].flat[0]
            raise ValueError(f"`mask`: must hold 0 and 1 only, found {bad}")
        return a.astype(np.int64)
    return a


def turn_values_to_tokens(turn_id: Any, per_turn: Any, fill: float = 0.0) -> Any:
    """Spreads per-turn values onto their tokens (the inverse of grouping tokens into turns):
    token ``t`` gets ``per_turn[turn_id[t]]``, tool tokens (``turn_id = -1``) get ``fill``.

    ``turn_id`` is ``[L]`` or ``[B, L]``, ``per_turn`` ``[T]`` or ``[B, T]`` (every turn id must
    index a column). This is how a per-turn advantage reaches the tokens of its turn.
    """
    ret = Returner(turn_id, per_turn)
    tid, one = rows2d(turn_id, np.int64, "turn_id")
    pt, one_pt = rows2d(per_turn, np.float64, "per_turn", pad=np.nan)
    if one != one_pt:
        raise ValueError(
            f"`per_turn` has shape {list(np.shape(per_turn))} but `turn_id` has shape "
            f"{list(np.shape(turn_id))}: give both as one row (1-D) or both as a batch (2-D)"
        )
    out = _native.turn_values_to_tokens(tid, pt, float(fill))
    return ret(out[0] if one else out)


def place_turn_rewards(turn_id: Any, turn_rewards: Any, outcome: Any) -> Any:
    """Token rewards for GAE (spec §3.3, turn-level-rewards.md eq. 10): ``turn_rewards[k]`` on
    the last model token of turn ``k``, ``outcome`` on the last model token of the response, 0
    elsewhere. One row (``turn_id`` ``[L]``, ``turn_rewards`` ``[T]``, scalar ``outcome``) or a
    batch (``[B, L]``, ``[B, T]``, ``[B]``); row ``i`` reads its first ``max(turn_id[i]) + 1``
    rewards. A turn with a non-zero reward and no model token is an error."""
    ret = Returner(turn_id, turn_rewards, outcome)
    tid, one = rows2d(turn_id, np.int64, "turn_id")
    tr, one_tr = rows2d(turn_rewards, np.float64, "turn_rewards", pad=np.nan)
    if one and not one_tr:
        raise ValueError("`turn_rewards` is a batch (2-D) but `turn_id` is one row (1-D)")
    if one_tr and not one:
        raise ValueError("`turn_rewards` is one row (1-D) but `turn_id` is a batch (2-D)")
    oc = array(outcome, np.float64, "outcome")
    oc = oc.reshape(1) if one else oc
    if oc.ndim != 1:
        raise ValueError(f"`outcome` has shape {list(oc.shape)}, expected [{tid.shape[0]}]")
    out = _native.place_rewards(tid, tr, oc)
    return ret(out[0] if one else out)


def a2tgpo_clip_scale(normalized_info_gain: Any, beta: float = 0.3) -> Any:
    """A2TGPO clip scale ``c = 1 + β(2σ(îg) − 1)`` (spec §5.5 eq. 10), element-wise; the clip
    bounds of a turn are ``[1 − c·ε_low, 1 + c·ε_high]``."""
    ret = Returner(normalized_info_gain)
    a = array(normalized_info_gain, np.float64, "normalized_info_gain")
    return ret(np.asarray(_native.clip_scale(a, float(beta))))
