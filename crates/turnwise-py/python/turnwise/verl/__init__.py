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
- **Rewards** come from ``token_level_rewards`` (verl's reward manager). Every token belongs to the turn that last started before it
  (observation tokens to the turn that called the tool), and a turn's reward is the sum over its
  tokens (:func:`split_turn_rewards`). The last turn's sum is the outcome (verl puts the score on
  the last response token); earlier turns' sums are the turn rewards of ``turnwise_mt_grpo`` and
  the information gains of ``turnwise_igpo`` and ``turnwise_a2tgpo`` (placed by
  :func:`turnwise.verl.info_gain.place_info_gain`, or by your own reward manager on each turn's
  last model token). Outcome-only estimators sum the whole row, as verl's ``grpo`` does.
  ``algorithm.use_kl_in_reward`` is refused for the estimators that read per-turn sums
  (``turnwise_mt_grpo``, ``turnwise_igpo``, ``turnwise_a2tgpo``): verl subtracts β·KL on every
  token, which would turn each turn's reward into "reward − that turn's KL" (turnwise's own
  trainer refuses the same combination); use ``actor.use_kl_loss`` instead.
- **Information gain must have been computed**: ``turnwise_igpo`` and ``turnwise_a2tgpo`` refuse
  a batch unless :class:`turnwise.verl.trainer.TurnwiseRayPPOTrainer` recorded its probes' IG for
  it (:func:`record_info_gain`; the rewards must still hold those values) or
  ``TURNWISE_VERL_SETTINGS`` declares ``{"info_gain": {"placed_by": "reward_manager"}}`` (then a
  batch whose process turns all carry exactly 0 is refused). Under verl's stock ``main_ppo`` no IG
  is computed, and these estimators would silently be GRPO with a constant clip: they stop instead,
  naming ``python -m turnwise.verl.trainer``.
- **Groups** are verl's ``uid`` (the ``index`` verl passes to custom estimators).
- **Settings**: ``algorithm.gamma`` is the discount of ``igpo``/``a2tgpo``;
  ``algorithm.norm_adv_by_std_in_grpo = False`` turns ``turnwise_grpo`` into ``dr_grpo``
  (verl's own switch). Every other estimator setting (``clip_beta``, ``ig_std``, ``form``, ...)
  comes from the JSON object in the environment variable ``TURNWISE_VERL_SETTINGS``, keyed by
  verl name (``{"turnwise_a2tgpo": {"clip_beta": 0.3}}``); ``"loss"`` holds loss settings
  (``turn_pooling``, ``clip_bias``, ``log_ratio_clamp``) and ``"info_gain"`` the probe text
  (``prefix``, ``suffix``) of :mod:`turnwise.verl.trainer`.
- **Losses** read verl's ``ActorConfig`` (``clip_ratio``, ``clip_ratio_low``/``_high``,
  ``clip_ratio_c``, ``loss_agg_mode``, ``loss_scale_factor``) and aggregate exactly as verl
  0.9.1's ``core_algos.agg_loss`` (value and gradient, every mode including ``token-sum`` and
  ``seq-mean-token-sum-norm``'s division by the sequence count, which turnwise's own trainer
  shares) with verl's global batch denominators
  (``global_batch_info``), so a micro-batch loss sums to the mini-batch loss and verl's entropy
  and KL terms keep their weight. Set the clip ratios as the method needs them (turn-GSPO and
  A2TGPO: ``3e-3``/``4e-3``; verl's ``ActorConfig`` always supplies PPO's 0.2, so turnwise's own
  defaults never apply in verl). ``turnwise_a2tgpo`` and ``turnwise_gspo_turn`` warn
  (:class:`TurnwiseVerlWarning`) when they meet clip ratio 0.2, and ``turnwise_a2tgpo`` when it
  meets ``token-mean`` aggregation (A2TGPO's is ``seq-mean-token-mean``).
- **A2TGPO's adaptive clip** needs each turn's clip scale ``c`` in the loss, but verl hands a
  policy loss only the advantages. ``turnwise_a2tgpo`` (the estimator) therefore writes each
  process turn's ``c`` into the advantages tensor on the first observation token after the turn
  (a position the response mask removes from every loss and metric; the final turn's ``c`` is
  1), tagged as ``CLIP_SCALE_TAG + c`` so that no other estimator's values pass for it, and the
  ``turnwise_a2tgpo`` loss reads it back. The loss refuses advantages that carry no tagged clip
  scale (another estimator, e.g. verl's ``gae``, which whitens every position), naming the
  estimator it needs.
- **The clipping-bias correction** (``turnwise_s_ppo``, ``turnwise_st_ppo``,
  ``turnwise_s_grpo``) weights each sample's loss by ``1 − ρ_i``, as turnwise's own trainer
  does (spec §5.6): the weights change the mix of the samples' gradients within a mini-batch,
  which survives AdamW; neither trainer scales the step (a step-size factor is undone by
  AdamW's later moments).

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
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import losses as _losses
from ..advantage import estimate
from ..turns import turn_ids_from_mask

__all__ = [
    "TESTED_VERL_VERSION",
    "IG_ESTIMATORS",
    "TURN_REWARD_ESTIMATORS",
    "CLIP_SCALE_TAG",
    "TurnwiseVerlWarning",
    "record_info_gain",
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

#: verl estimators whose process-turn rewards are IGPO's information gain.
IG_ESTIMATORS = ("turnwise_igpo", "turnwise_a2tgpo")

#: verl estimators that read per-turn reward sums (KL-in-reward would enter them).
TURN_REWARD_ESTIMATORS = IG_ESTIMATORS + ("turnwise_mt_grpo",)

#: Offset of A2TGPO's clip scale on the observation channel: the estimator writes
#: ``CLIP_SCALE_TAG + c`` (c in (0, 2)), the loss accepts only values in
#: ``(CLIP_SCALE_TAG, CLIP_SCALE_TAG + 2)``. A power of two, so float32 keeps c to 3e-5.
CLIP_SCALE_TAG = 256.0


class TurnwiseVerlWarning(UserWarning):
    """A verl setting that silently changes what a turnwise method trains."""


_WARNED: set = set()

# The information gain TurnwiseRayPPOTrainer computed for the batch whose advantages come next
# (this process: verl computes advantages in the driver, where the trainer runs).
_IG_RECORD: Dict[str, Any] = {}


def record_info_gain(token_rewards: Any, written: Sequence[Tuple[int, int]]) -> None:
    """Records that ``token_rewards`` ``[B, L]`` holds the information gain of this step's batch
    at the ``(row, position)`` pairs ``written`` (what :func:`turnwise.verl.info_gain.place_info_gain`
    returns). The next ``turnwise_igpo``/``turnwise_a2tgpo`` advantage computation in this
    process consumes the record and refuses rewards that do not hold these values.
    :class:`turnwise.verl.trainer.TurnwiseRayPPOTrainer` calls it after its probes."""
    r = _np(token_rewards, np.float64, "token_rewards")
    _IG_RECORD.clear()
    _IG_RECORD.update(
        rows=int(r.shape[0]),
        written=[(int(i), int(p)) for i, p in written],
        values=[float(r[i, p]) for i, p in written],
        consumed=False,
    )


def _check_info_gain(verl_name: str, r: np.ndarray, per_turn: np.ndarray, num_turns: np.ndarray) -> None:
    """Refuses IG turn rewards that nobody computed (see the module docstring)."""
    placed_by = str(_env_settings().get("info_gain", {}).get("placed_by", "trainer"))
    if placed_by not in ("trainer", "reward_manager"):
        raise ValueError(
            f"{SETTINGS_ENV}: info_gain.placed_by must be 'trainer' or 'reward_manager', got {placed_by!r}"
        )
    if placed_by == "reward_manager":
        process = [per_turn[i, : int(n) - 1] for i, n in enumerate(num_turns) if n > 1]
        if process and all(np.all(p == 0.0) for p in process):
            raise ValueError(
                f"{verl_name}: every process turn of the batch has reward exactly 0, so the "
                f"information gain is 0 everywhere ({SETTINGS_ENV} info_gain.placed_by="
                "'reward_manager' says your reward manager places it on each turn's last model token)"
            )
        return
    if not _IG_RECORD or _IG_RECORD.get("consumed"):
        raise ValueError(
            f"{verl_name}: no information gain was computed for this batch. Its turn rewards are "
            "IGPO's information gain, which only turnwise.verl.trainer.TurnwiseRayPPOTrainer "
            "computes (run `python -m turnwise.verl.trainer trainer.use_v1=false ...` instead of "
            "verl.trainer.main_ppo); without it every turn's IG would be 0. If your reward manager "
            f"places IG itself, set {SETTINGS_ENV}='{{\"info_gain\": {{\"placed_by\": \"reward_manager\"}}}}'"
        )
    rec = dict(_IG_RECORD)
    _IG_RECORD["consumed"] = True
    if rec["rows"] != r.shape[0]:
        raise ValueError(
            f"{verl_name}: the information gain was recorded for {rec['rows']} responses, the "
            f"batch has {r.shape[0]}"
        )
    for (i, p), v in zip(rec["written"], rec["values"]):
        if not math.isclose(float(r[i, p]), v, rel_tol=1e-5, abs_tol=1e-6):
            raise ValueError(
                f"{verl_name}: token_level_rewards[{i}, {p}] is {float(r[i, p])}, but the "
                f"information-gain reward recorded there is {v}: the rewards changed between the "
                "probes and the advantages"
            )


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
        adv[i, pos] = CLIP_SCALE_TAG + cs[i, t]


def clip_scale_from_advantages(advantages: Any, response_mask: Any) -> torch.Tensor:
    """A2TGPO's per-token clip scale ``c`` ``[B, L]`` read back from advantages that the
    ``turnwise_a2tgpo`` estimator wrote (see the module docstring): each process turn's ``c``
    sits on the first observation token after it as ``CLIP_SCALE_TAG + c``, the final turn's is 1.
    Raises ``ValueError`` when a process turn carries none (the advantages came from another
    estimator) or the shapes disagree."""
    if tuple(advantages.shape) != tuple(response_mask.shape) or advantages.dim() != 2:
        raise ValueError(
            f"turnwise_a2tgpo loss: `advantages` has shape {list(advantages.shape)} and "
            f"`response_mask` {list(response_mask.shape)}; both must be [B, L]"
        )
    adv = advantages.detach().to("cpu", torch.float64).numpy()
    mask = response_mask.detach().to("cpu").to(torch.int64).numpy()
    tid = np.asarray(turn_ids_from_mask(mask), dtype=np.int64)
    num_turns = tid.max(axis=1) + 1
    per_turn = np.ones((tid.shape[0], max(int(num_turns.max(initial=0)), 1)))
    for i, t, pos in _channel_positions(tid, num_turns):
        enc = adv[i, pos]
        c = enc - CLIP_SCALE_TAG
        if not (math.isfinite(c) and 0.0 < c < 2.0):
            raise ValueError(
                f"turnwise_a2tgpo loss: response {i}, turn {t} carries no adaptive clip scale "
                f"(found {enc} on the observation token after it; expected {CLIP_SCALE_TAG:g} + c "
                "with c in (0, 2)): set algorithm.adv_estimator=turnwise_a2tgpo, whose advantages carry it"
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
        if verl_name in TURN_REWARD_ESTIMATORS and bool(_cfg_get(config, "use_kl_in_reward", False)):
            raise ValueError(
                f"{verl_name} reads each turn's reward sum, and algorithm.use_kl_in_reward=true "
                "would subtract that turn's KL from it (the information gain / turn reward would "
                "rank turns by KL): set algorithm.use_kl_in_reward=false and use "
                "actor_rollout_ref.actor.use_kl_loss for the KL term"
            )
        name = tw_name
        if name == "grpo" and not _cfg_get(config, "norm_adv_by_std_in_grpo", True):
            name = "dr_grpo"
        if name in ("igpo", "a2tgpo"):
            settings.setdefault("gamma", float(_cfg_get(config, "gamma", 1.0)))
        adv, extra = turn_level_advantages(name, token_level_rewards, response_mask, index, **settings)
        if verl_name in IG_ESTIMATORS:
            _check_info_gain(
                verl_name, _np(token_level_rewards, np.float64, "token_level_rewards"),
                extra["per_turn"], extra["num_turns"],
            )
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
    _check_loss_shapes(kind, old_log_prob, log_prob, advantages, response_mask)
    if kind in ("a2tgpo", "gspo_turn"):
        _warn_turn_clip_settings(kind, config, loss_agg_mode)
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
        agg_convention="verl",
        dp_size=dp,
        **loss_settings,
    )
    metrics = {k: float(v) for k, v in out.metrics.items() if k != "actor/pg_loss"}
    return out.loss, metrics


def _check_loss_shapes(kind: str, old_log_prob: Any, log_prob: Any, advantages: Any, response_mask: Any) -> None:
    named = (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages),
             ("response_mask", response_mask))
    for arg, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"turnwise_{kind} loss: `{arg}` is a {type(t).__name__}, expected a torch.Tensor [B, L]")
    if log_prob.dim() != 2:
        raise ValueError(f"turnwise_{kind} loss: `log_prob` has shape {list(log_prob.shape)}, expected [B, L]")
    for arg, t in named[1:]:
        if tuple(t.shape) != tuple(log_prob.shape):
            raise ValueError(
                f"turnwise_{kind} loss: `{arg}` has shape {list(t.shape)}, expected "
                f"{list(log_prob.shape)} (the shape of `log_prob`)"
            )


def _warn_turn_clip_settings(kind: str, config: Any, loss_agg_mode: str) -> None:
    """Warns (once per process and issue) where verl's PPO defaults replace the method's:
    clip 0.2 for A2TGPO's / turn-GSPO's 3e-3/4e-3, token-mean for A2TGPO's seq-mean-token-mean
    (turn-GSPO refuses any other aggregation itself)."""
    low = _cfg_get(config, "clip_ratio_low", None)
    high = _cfg_get(config, "clip_ratio_high", None)
    issues = []
    if low == 0.2 or high == 0.2:
        issues.append(
            ((kind, "clip"), f"turnwise_{kind} loss: clip_ratio_low/high = {low}/{high} includes verl's PPO "
             "default 0.2 (the method's turn clip is 3e-3/4e-3; set actor_rollout_ref.actor.clip_ratio_low=0.003 "
             "and clip_ratio_high=0.004)")
        )
    if kind == "a2tgpo" and loss_agg_mode == "token-mean":
        issues.append(
            ((kind, "agg"), "turnwise_a2tgpo loss: loss_agg_mode token-mean (verl's default) replaces A2TGPO's "
             "seq-mean-token-mean (eq. 12); set actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
        )
    for key, msg in issues:
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(msg, TurnwiseVerlWarning, stacklevel=3)


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
