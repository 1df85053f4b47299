"""Outcome and turn-level rewards (spec §2), computed in Rust: score a rollout by reward name,
and the answer metrics (EM, SubEM, F1)."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _native

__all__ = ["REWARDS", "score", "normalize_answer", "em", "sub_em", "f1", "igpo_f1"]

#: Reward names accepted by :func:`score`.
REWARDS: List[str] = list(_native.reward_names())

Turn = Union[str, Tuple[str, Optional[str]]]


def _golds(golds: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds]


def score(
    reward: str,
    response: Union[str, Sequence[Turn]],
    golds: Union[str, Sequence[str]],
    **settings: Any,
) -> Dict[str, Any]:
    """Scores one rollout with the reward named ``reward`` (see :data:`REWARDS`).

    ``response`` is the agent's whole text (one turn) or its turns, each a string or a
    ``(generated, observation)`` pair (observation ``None`` after the last turn). ``golds``
    are the accepted answers. ``settings`` override the reward's defaults (e.g.
    ``format_failure=0.0`` for ``boxed_em``). Returns ``score``, ``turn_rewards`` (turn-level
    rewards), ``em``, ``format_ok``, ``reason`` and ``parts`` (named components).
    """
    if isinstance(response, str):
        turns: List[Tuple[str, Optional[str]]] = [(response, None)]
    else:
        turns = []
        for t in response:
            if isinstance(t, str):
                turns.append((t, None))
            else:
                g, o = t
                turns.append((str(g), None if o is None else str(o)))
    cfg = dict(settings)
    for k, v in cfg.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"`{k}` = {v} is not finite")
    if "name" in cfg:
        raise ValueError("`settings` must not hold `name`: pass the reward name as `reward`")
    if reward not in REWARDS:
        raise ValueError(f"unknown reward {reward!r}; known rewards: {', '.join(REWARDS)}")
    cfg["name"] = reward
    out = json.loads(_native.score(json.dumps(cfg), turns, _golds(golds)))
    out["parts"] = {k: v for k, v in out["parts"]}
    return out


def normalize_answer(text: str) -> str:
    """§2.1 ``normalize_answer``: lower case, punctuation and articles removed, spaces
    collapsed."""
    return _native.normalize_answer(text)


def em(prediction: str, golds: Union[str, Sequence[str]]) -> float:
    """§2.1 exact match of the normalized strings (1.0 or 0.0)."""
    return _native.em(prediction, _golds(golds))


def sub_em(prediction: str, golds: Union[str, Sequence[str]]) -> float:
    """§2.1 SubEM: a normalized gold occurs in the normalized prediction."""
    return _native.sub_em(prediction, _golds(golds))


def f1(prediction: str, golds: Union[str, Sequence[str]]) -> float:
    """§2.2 SQuAD token F1 (maximum over the golds)."""
    return _native.f1(prediction, _golds(golds))


def igpo_f1(prediction: str, golds: Union[str, Sequence[str]]) -> float:
    """§2.2 IGPO's F1 variant (maximum over the golds)."""
    return _native.igpo_f1(prediction, _golds(golds))
