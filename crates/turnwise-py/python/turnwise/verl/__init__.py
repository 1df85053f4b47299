"""verl integration: turnwise's turn-level advantage estimators and policy losses in verl's own
registries, so that a verl config selects them by name::

    algorithm.adv_estimator=turnwise_a2tgpo
    actor_rollout_ref.actor.policy_loss.loss_mode=turnwise_a2tgpo

Tested with ``verl==0.9.1`` (``scripts/verl-check.sh`` pins it). Installing the ``turnwise``
wheel is enough: it declares a ``verl.plugins`` entry point, which verl loads on ``import verl``
in every process (the driver that computes advantages and the Ray workers that compute the
loss), and that entry point calls :func:`register`. ``import turnwise.verl`` registers too.

How verl's batch maps onto turnwise's inputs:

- **Turns** are the runs of ``response_mask == 1`` (verl's multi-turn agent loops set the mask to
  0 on tool and observation tokens): :func:`turnwise.turn_ids_from_mask`.
- **Rewards** come from ``token_level_rewards`` (verl's reward manager, plus the KL penalty when
  ``algorithm.use_kl_in_reward``). Every token belongs to the turn that last started before it
  (observation tokens to the turn that called the tool), and a turn's reward is the sum over its
  tokens (:func:`split_turn_rewards`). The last turn's sum is the outcome (verl puts the score on
  the last response token); earlier turns' sums are the turn rewards of ``turnwise_mt_grpo`` and
  the information gains of ``turnwise_igpo`` and ``turnwise_a2tgpo`` (placed by
  :func:`turnwise.verl.info_gain.place_info_gain`, or by your own reward manager on each turn's
  last model token). Outcome-only estimators sum the whole row, as verl's ``grpo`` does.
- **Groups** are verl's ``uid`` (the ``index`` verl passes to custom estimators).
- **Settings**: ``algorithm.gamma`` is the discount of ``igpo``/``a2tgpo``;
  ``algorithm.norm_adv_by_std_in_grpo = False`` turns ``turnwise_grpo`` into ``dr_grpo``
  (verl's own switch). Every other estimator setting (``clip_beta``, ``ig_std``, ``form``, ...)
  comes from the JSON object in the environment variable ``TURNWISE_VERL_SETTINGS``, keyed by
  verl name (``{"turnwise_a2tgpo": {"clip_beta": 0.3}}``); ``"loss"`` holds loss settings
  (``turn_pooling``, ``clip_bias``, ``log_ratio_clamp``) and ``"info_gain"`` the probe text
  (``prefix``, ``suffix``) of :mod:`turnwise.verl.trainer`.
- **Losses** read verl's ``ActorConfig`` (``clip_ratio``, ``clip_ratio_low``/``_high``,
  ``clip_ratio_c``, ``loss_agg_mode``, ``loss_scale_factor``) and aggregate with verl's global
  batch denominators (``global_batch_info``: tokens and sequences of the whole mini-batch over
  the data-parallel ranks), so a micro-batch loss sums to the mini-batch loss as verl's own
  losses do. Set the clip ratios as the method needs them (turn-GSPO and A2TGPO: ``3e-3``/
  ``4e-3``; verl's default 0.2 is PPO's).
- **A2TGPO's adaptive clip** needs each turn's clip scale ``c`` in the loss, but verl hands a
  policy loss only the advantages. ``turnwise_a2tgpo`` (the estimator) therefore writes each
  process turn's ``c`` into the advantages tensor on the first observation token after the turn
  (a position the response mask removes from every loss and metric; the final turn's ``c`` is
  1), and the ``turnwise_a2tgpo`` loss reads it back. The loss refuses advantages that carry no
  clip scale (another estimator), naming the estimator it needs.
- **The clipping-bias correction** (``turnwise_s_ppo``, ``turnwise_st_ppo``,
  ``turnwise_s_grpo``) weights each sample's loss by ``1 − ρ_i``. turnwise's own trainer also
  divides the mini-batch gradient by the weights' mean before its norm clip and steps at
  ``lr·s̄``; a verl policy loss cannot reach the optimizer, so in verl the down-weighting acts
  through the loss weights only (the relative weight of clipped samples, and the gradient's
  size wherever ``actor.grad_clip`` does not bind).

Not in verl's registries (they need rollout-side structure verl's ``compute_advantage`` does not
pass): ``gigpo``/``t2po`` (anchor states per step; verl-agent has its own GiGPO), ``at2po`` and
``tree_grpo`` (rollout trees: entropy-guided tree search is a rollout strategy), T2PO's thinking
intervention and turn resampling (controlled sampling inside generation), and ``gae`` (verl's
own ``gae`` is the same estimator, tested equal). turnwise's rollout servers and ``turnwise
train`` carry those; see docs/scaling.md.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import losses as _losses
from ..advantage import estimate
from ..turns import turn_ids_from_mask

__all__ = [
    "TESTED_VERL_VERSION",
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "NOT_REGISTERED",
    "SETTINGS_ENV",
    "register",
    "split_turn_rewards",
    "turn_level_advantages",
    "clip_scale_from_advantages",
    "verl_policy_loss",
]

#: verl version this module was written and tested against.
TESTED_VERL_VERSION = "0.9.1"

#: verl ``algorithm.adv_estimator`` name → turnwise estimator.
ADVANTAGE_ESTIMATORS: Dict[str, str] = {
    "turnwise_grpo": "grpo",
    "turnwise_dr_grpo": "dr_grpo",
    "turnwise_rloo": "rloo",
    "turnwise_mt_grpo": "mt_grpo",
    "turnwise_igpo": "igpo",
    "turnwise_a2tgpo": "a2tgpo",
}

#: verl ``actor.policy_loss.loss_mode`` name → turnwise policy loss
#: (:func:`turnwise.losses.policy_loss`).
POLICY_LOSSES: Dict[str, str] = {
    "turnwise_turn": "turn",
    "turnwise_st_ppo": "st_ppo",
    "turnwise_s_ppo": "s_ppo",
    "turnwise_s_grpo": "s_grpo",
    "turnwise_gspo_turn": "gspo_turn",
    "turnwise_a2tgpo": "a2tgpo",
}

#: turnwise methods with no verl registry entry, and why.
NOT_REGISTERED: Dict[str, str] = {
    "gigpo": "needs per-step anchor states, which verl's compute_advantage does not pass "
    "(verl-agent ships its own GiGPO)",
    "t2po": "GiGPO's anchors plus thinking intervention and turn resampling inside generation",
    "at2po": "needs rollout trees (entropy-guided tree search is a rollout strategy)",
    "tree_grpo": "needs rollout trees",
    "gae": "verl's own `gae` is the same estimator (it needs the critic's values, which verl "
    "passes to its built-in GAE only)",
}

#: Environment variable holding estimator and loss settings as JSON (see the module docstring).
SETTINGS_ENV = "TURNWISE_VERL_SETTINGS"

_ESTIMATOR_KEYS = {"grpo", "dr_grpo", "rloo", "mt_grpo", "igpo", "a2tgpo"}


# ----------------------------------------------------------------------------- settings


def _env_settings() -> Dict[str, Any]:
    raw = os.environ.get(SETTINGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{SETTINGS_ENV} is not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{SETTINGS_ENV} must be a JSON object keyed by verl name, got {raw!r}")
    known = set(ADVANTAGE_ESTIMATORS) | {"loss", "info_gain"}
    unknown = sorted(set(out) - known)
    if unknown:
        raise ValueError(f"{SETTINGS_ENV} has unknown key(s) {unknown}; known: {sorted(known)}")
    return out


def _cfg_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    try:
        v = config.get(key, default)
    except AttributeError:
        v = getattr(config, key, default)
    return default if v is None else v


# ----------------------------------------------------------------------------- advantages


def split_turn_rewards(
    token_level_rewards: Any, response_mask: Any
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits verl's per-token rewards ``[B, L]`` into per-turn sums.

    Returns ``(turn_id [B, L], per_turn [B, T_max], num_turns [B])``: ``turn_id`` as
    :func:`turnwise.turn_ids_from_mask` gives it (-1 on observation tokens and padding), and
    ``per_turn[i, k]`` the sum of the rewards on the tokens of turn ``k`` and on the observation
    tokens after it (tokens before the first turn count to turn 0).
    """
    r = _np(token_level_rewards, np.float64, "token_level_rewards")
    m = _np(response_mask, np.float64, "response_mask")
    if r.ndim != 2 or r.shape != m.shape:
        raise ValueError(
            f"token_level_rewards {list(r.shape)} and response_mask {list(m.shape)} must both be [B, L]"
        )
    if not np.all(np.isfinite(r)):
        bad = np.argwhere(~np.isfinite(r))[0]
        raise ValueError(f"token_level_rewards[{bad[0]}, {bad[1]}] is not finite ({r[tuple(bad)]})")
    tid = np.asarray(turn_ids_from_mask(m.astype(np.int64)), dtype=np.int64)
    seg = np.maximum.accumulate(tid, axis=1)
    seg[seg < 0] = 0
    num_turns = tid.max(axis=1) + 1
    width = max(int(num_turns.max(initial=0)), 1)
    per_turn = np.zeros((r.shape[0], width), dtype=np.float64)
    rows = np.repeat(np.arange(r.shape[0])[:, None], r.shape[1], axis=1)
    np.add.at(per_turn, (rows, seg), r)
    return tid, per_turn, num_turns


def _groups(index: Any, b: int) -> np.ndarray:
    if index is None:
        raise ValueError(
            "turnwise's group estimators need verl's `uid` (the prompt of each response), and "
            "compute_advantage passed none: is `uid` in data.non_tensor_batch?"
        )
    idx = list(np.asarray(index, dtype=object).reshape(-1))
    if len(idx) != b:
        raise ValueError(f"index has {len(idx)} entries for a batch of {b} responses")
    ids: Dict[Any, int] = {}
    return np.array([ids.setdefault(u, len(ids)) for u in idx], dtype=np.int64)


def turn_level_advantages(
    estimator: str,
    token_level_rewards: Any,
    response_mask: Any,
    index: Any,
    **settings: Any,
) -> Tuple[np.ndarray, Dict[str, Any]]:
    """turnwise estimator ``estimator`` (``grpo``, ``dr_grpo``, ``rloo``, ``mt_grpo``,
    ``igpo``, ``a2tgpo``) on verl's inputs; returns the per-token advantages ``[B, L]`` (0 on
    observation tokens and padding) and the estimator's extra outputs (``turn_id``,
    ``num_turns``, ``per_turn``; ``clip_scale`` ``[B, T_max]`` for ``a2tgpo``)."""
    if estimator not in _ESTIMATOR_KEYS:
        raise ValueError(
            f"unknown estimator {estimator!r} for verl; known: {sorted(_ESTIMATOR_KEYS)}"
        )
    tid, per_turn, num_turns = split_turn_rewards(token_level_rewards, response_mask)
    b = tid.shape[0]
    group = _groups(index, b)
    empty = np.flatnonzero(num_turns == 0)
    if empty.size:
        raise ValueError(
            f"response {int(empty[0])} has no model token (response_mask is all 0): "
            f"{empty.size} such row(s) in the batch"
        )
    last = per_turn[np.arange(b), num_turns - 1]
    if estimator in ("grpo", "dr_grpo", "rloo"):
        out = estimate(estimator, per_turn.sum(axis=1), group, tid, **settings)
    elif estimator == "mt_grpo":
        out = estimate(estimator, np.zeros(b), group, tid, turn_rewards=per_turn, **settings)
    else:
        ig = per_turn[:, : max(per_turn.shape[1] - 1, 1)].copy()
        for i in range(b):
            ig[i, num_turns[i] - 1 :] = 0.0
        out = estimate(estimator, last, group, tid, info_gain=ig, **settings)
    extra: Dict[str, Any] = {"turn_id": tid, "num_turns": num_turns, "per_turn": per_turn}
    if out.clip_scale is not None:
        extra["clip_scale"] = np.asarray(out.clip_scale, dtype=np.float64)
    return np.asarray(out.tokens, dtype=np.float64), extra


def _channel_positions(turn_id: np.ndarray, num_turns: np.ndarray) -> List[Tuple[int, int, int]]:
    """``(row, turn, position)``: the first token after each process turn (an observation)."""
    out = []
    for i in range(turn_id.shape[0]):
        row = turn_id[i]
        for t in range(int(num_turns[i]) - 1):
            end = int(np.flatnonzero(row == t)[-1])
            out.append((i, t, end + 1))
    return out


def _encode_clip_scale(adv: np.ndarray, extra: Dict[str, Any]) -> None:
    cs = extra["clip_scale"]
    for i, t, pos in _channel_positions(extra["turn_id"], extra["num_turns"]):
        adv[i, pos] = cs[i, t]


def clip_scale_from_advantages(advantages: Any, response_mask: Any) -> torch.Tensor:
    """A2TGPO's per-token clip scale ``c`` ``[B, L]`` read back from advantages that the
    ``turnwise_a2tgpo`` estimator wrote (see the module docstring): each process turn's ``c``
    sits on the first observation token after it, the final turn's is 1. Raises ``ValueError``
    when a process turn carries none (the advantages came from another estimator)."""
    adv = advantages.detach().to("cpu", torch.float64).numpy()
    mask = response_mask.detach().to("cpu").to(torch.int64).numpy()
    tid = np.asarray(turn_ids_from_mask(mask), dtype=np.int64)
    num_turns = tid.max(axis=1) + 1
    per_turn = np.ones((tid.shape[0], max(int(num_turns.max(initial=0)), 1)))
    for i, t, pos in _channel_positions(tid, num_turns):
        c = adv[i, pos]
        if not (math.isfinite(c) and 0.0 < c < 2.0):
            raise ValueError(
                f"turnwise_a2tgpo loss: response {i}, turn {t} carries no adaptive clip scale "
                f"(found {c} on the observation token after it; expected c in (0, 2)): set "
                "algorithm.adv_estimator=turnwise_a2tgpo, whose advantages carry it"
            )
        per_turn[i, t] = c
    out = np.ones_like(adv)
    has = tid >= 0
    rows = np.nonzero(has)[0]
    out[has] = per_turn[rows, tid[has]]
    return torch.from_numpy(out).to(advantages.device)


def _estimator_fn(verl_name: str, tw_name: str) -> Callable[..., Tuple[torch.Tensor, torch.Tensor]]:
    def compute(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        config: Any = None,
        index: Any = None,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        settings = dict(_env_settings().get(verl_name, {}))
        name = tw_name
        if name == "grpo" and not _cfg_get(config, "norm_adv_by_std_in_grpo", True):
            name = "dr_grpo"
        if name in ("igpo", "a2tgpo"):
            settings.setdefault("gamma", float(_cfg_get(config, "gamma", 1.0)))
        adv, extra = turn_level_advantages(name, token_level_rewards, response_mask, index, **settings)
        if name == "a2tgpo":
            _encode_clip_scale(adv, extra)
        t = torch.from_numpy(adv).to(device=token_level_rewards.device, dtype=torch.float32)
        return t, t.clone()

    compute.__name__ = f"compute_{verl_name}_advantage"
    compute.__doc__ = f"verl advantage estimator `{verl_name}`: turnwise's `{tw_name}` (turnwise.verl)."
    return compute


# ----------------------------------------------------------------------------- losses


def verl_policy_loss(
    kind: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """turnwise policy loss ``kind`` with verl's policy-loss signature and settings (see the
    module docstring). Returns ``(loss, metrics)`` as verl's registered losses do."""
    if rollout_is_weights is not None:
        raise ValueError(
            f"turnwise_{kind} loss does not take verl's rollout importance weights "
            "(algorithm.rollout_correction); switch rollout correction off for this loss"
        )
    if config is None:
        raise ValueError(f"turnwise_{kind} loss needs verl's ActorConfig (config=None)")
    loss_settings = dict(_env_settings().get("loss", {}))
    mask = response_mask.to(log_prob.dtype)
    info = dict(_cfg_get(config, "global_batch_info", {}) or {})
    dp = int(info.get("dp_size") or 1)
    tokens, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    denominators = None
    if tokens is not None or seqs is not None or dp > 1:
        if tokens is None or seqs is None:
            raise ValueError(
                f"turnwise_{kind} loss: verl's global_batch_info gives batch_num_tokens={tokens} "
                f"and global_batch_size={seqs}; both are needed with dp_size={dp}"
            )
        denominators = (float(tokens) / dp, float(seqs) / dp)
    scale_factor = info.get("loss_scale_factor", None)
    if scale_factor is None:
        scale_factor = _cfg_get(config, "loss_scale_factor", None)
    clip_scale = None
    if kind == "a2tgpo":
        clip_scale = clip_scale_from_advantages(advantages, response_mask).to(log_prob.dtype)
        advantages = advantages * mask
    out = _losses.policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        policy_loss=kind,
        clip_scale=clip_scale,
        clip_ratio=_cfg_get(config, "clip_ratio", None),
        clip_ratio_low=_cfg_get(config, "clip_ratio_low", None),
        clip_ratio_high=_cfg_get(config, "clip_ratio_high", None),
        clip_ratio_c=_cfg_get(config, "clip_ratio_c", 3.0),
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=scale_factor,
        denominators=denominators,
        **loss_settings,
    )
    metrics = {k: float(v) for k, v in out.metrics.items() if k != "actor/pg_loss"}
    return out.loss, metrics


_ESTIMATOR_FNS = {v: _estimator_fn(v, t) for v, t in ADVANTAGE_ESTIMATORS.items()}
# verl calls a policy loss by keyword with `verl_policy_loss`'s own parameter names.
_LOSS_FNS = {v: functools.partial(verl_policy_loss, k) for v, k in POLICY_LOSSES.items()}


def register() -> List[str]:
    """Registers every estimator of :data:`ADVANTAGE_ESTIMATORS` with verl's
    ``register_adv_est`` and every loss of :data:`POLICY_LOSSES` with ``register_policy_loss``
    (idempotent). Returns the registered names."""
    from verl.trainer.ppo import core_algos

    for name, fn in _ESTIMATOR_FNS.items():
        if core_algos.ADV_ESTIMATOR_REGISTRY.get(name) is not fn:
            core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)
            core_algos.register_adv_est(name)(fn)
    for name, fn in _LOSS_FNS.items():
        core_algos.register_policy_loss(name)(fn)
    return sorted(_ESTIMATOR_FNS) + sorted(_LOSS_FNS)


def _np(x: Any, dtype: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu")
        x = x.to(torch.float64 if dtype == np.float64 else torch.int64).numpy()
    return np.asarray(x, dtype=dtype)


register()
