"""Turn-level policy losses in torch (spec §5), equal to turnwise-model's losses and gradients.

Everything here works on ``[B, L]`` tensors laid out as verl's actor sees them: ``logp``
(current log-probs of the sampled tokens, differentiable), ``old_logp`` (behaviour log-probs),
``advantages`` (per token), ``loss_mask`` (1 = trained model token, 0 = prompt, tool/observation
token or padding) and optionally ``turn_id`` (agent-turn index per token, -1 on tool tokens;
without it a turn is a maximal run of ``loss_mask == 1``, spec §1.2).

:func:`policy_loss` is the one entry point (every loss of turnwise-model's registry, by name):

========== ============================================ ================== ==================
name       ratio                                        bounds (default)   aggregation
========== ============================================ ================== ==================
vanilla    token ``exp(clamp(logr, ±20))``, dual clip    1 ∓ 0.2            token-mean
dapo       token, dual clip                              1 − 0.2, 1 + 0.28  token-mean
gspo       sequence, stop-gradient form                  1 − 3e-4, 1 + 4e-4 seq-mean-token-mean
turn       turn, plain form (ST-PPO eq. 3)               1 ∓ 0.2            seq-mean-token-mean
gspo_turn  turn, stop-gradient form (AT2PO turn-GSPO)    1 − 3e-3, 1 + 4e-3 seq-mean-token-mean
a2tgpo     turn, stop-gradient, adaptive bounds (§5.5)   1 − c·3e-3, 1 + c·4e-3  seq-mean-token-mean
s_ppo      token + clipping-bias correction (§5.6)       1 ∓ 0.2            token-mean
st_ppo     turn (plain) + clipping-bias correction       1 ∓ 0.2            seq-mean-token-mean
s_grpo     token + clipping-bias correction              1 ∓ 0.2            token-mean
========== ============================================ ================== ==================

Turn/sequence ratios pool the token log-ratios of a turn: ``mean`` pooling (the geometric mean
of the token ratios, turnwise-model's and the papers' definition) or ``sum`` pooling (the
product of the token ratios), clamped at ≤ 10 in log space. The clipping-bias correction
(§5.6) has two rules: ``downweight`` (default; per-sample loss weight ``1 − ρ_i`` with
``ρ_i = ‖C_i‖/‖G_i‖``) and ``inverse_norm`` (the loss times ``1/‖C‖₂``, eq. 7/8 literally).

``torch`` is imported by this module only; the rest of the package needs numpy alone.
"""

from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

import torch

__all__ = [
    "POLICY_LOSS_NAMES",
    "AGG_MODES",
    "AGG_CONVENTIONS",
    "PolicyLossOutput",
    "policy_loss",
    "turn_ppo_loss",
    "st_ppo_loss",
    "gspo_turn_loss",
    "a2tgpo_loss",
    "turn_segments",
    "turn_ratio",
    "token_ratio",
    "adaptive_clip_scale",
    "adaptive_clip_bounds",
    "clip_bias",
    "agg_loss",
]

#: Every name :func:`policy_loss` answers to (``decoupled_clip`` is an alias of ``dapo``).
POLICY_LOSS_NAMES = (
    "vanilla",
    "dapo",
    "decoupled_clip",
    "gspo",
    "turn",
    "gspo_turn",
    "a2tgpo",
    "s_ppo",
    "st_ppo",
    "s_grpo",
)

#: The loss aggregation modes (§5.7). ``token-sum`` exists under the ``verl`` convention only.
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

#: Aggregation conventions: ``turnwise`` (turnwise-model's, spec §5.7) and ``verl`` (verl 0.9.1's
#: ``core_algos.agg_loss``). Both compute ``seq-mean-token-sum-norm`` as ``seq-mean-token-sum / K``
#: (Dr.GRPO's 1/G; turnwise-model's had no 1/B before review E, R1); only ``verl`` has
#: ``token-sum`` (``Σ m·l`` times the data-parallel size).
AGG_CONVENTIONS = ("turnwise", "verl")

# name -> (ratio level, default (ε_low, ε_high))
_KINDS: Dict[str, Tuple[str, Tuple[float, float]]] = {
    "vanilla": ("token", (0.2, 0.2)),
    "dapo": ("token", (0.2, 0.28)),
    "gspo": ("sequence", (3e-4, 4e-4)),
    "turn": ("turn", (0.2, 0.2)),
    "gspo_turn": ("turn", (3e-3, 4e-3)),
    "a2tgpo": ("turn", (3e-3, 4e-3)),
    "s_ppo": ("token", (0.2, 0.2)),
    "st_ppo": ("turn", (0.2, 0.2)),
    "s_grpo": ("token", (0.2, 0.2)),
}
_FORCED_AGG = {"gspo": "seq-mean-token-mean", "gspo_turn": "seq-mean-token-mean"}
_CLIP_BIAS_DEFAULT = {
    "rule": "downweight",
    "ratio": "token",
    "norm_scope": "minibatch",
    "norm_space": "token",
    "tau": 1e-8,
    "max_scale": None,
}
_CLIP_BIAS_CHOICES = {
    "rule": ("downweight", "inverse_norm"),
    "ratio": ("token", "loss"),
    "norm_scope": ("minibatch", "per_sample"),
    "norm_space": ("token",),
}


class PolicyLossOutput(NamedTuple):
    """Result of :func:`policy_loss`."""

    #: Scalar loss (differentiable w.r.t. ``logp``), clipping-bias weights/scale included.
    loss: torch.Tensor
    #: ``[B, L]`` per-token losses before aggregation and scaling (differentiable).
    per_token_loss: torch.Tensor
    #: ``[B, L]`` the ratio that was clipped (token or turn/sequence ratio), detached.
    ratio: torch.Tensor
    #: Diagnostics named as turnwise logs them (``actor/pg_clipfrac``, ``actor/ppo_kl``,
    #: ``actor/clip_bias_scale``, …), as Python floats.
    metrics: Dict[str, float]


# ----------------------------------------------------------------------------- helpers


def _err(loss: str, msg: str) -> ValueError:
    return ValueError(f"{loss}: {msg}")


def _check(loss: str, name: str, t: Any, shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """A tensor input, checked for shape and NaN/inf."""
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError) as e:
            raise _err(loss, f"`{name}` is not a tensor: {e}") from None
    if shape is None:
        if t.dim() != 2:
            raise _err(loss, f"`{name}` has shape {list(t.shape)}, expected a 2-D tensor [B, L]")
    elif tuple(t.shape) != shape:
        raise _err(loss, f"`{name}` has shape {list(t.shape)}, expected {list(shape)}")
    if t.is_floating_point():
        bad = ~torch.isfinite(t.detach())
        n = int(bad.sum())
        if n:
            raise _err(
                loss,
                f"`{name}` contains {n} non-finite value(s) (NaN or inf) out of {t.numel()}",
            )
    return t


def _min(x: torch.Tensor, y: Union[torch.Tensor, float]) -> torch.Tensor:
    # torch.minimum/maximum split the gradient evenly on ties, as candle's do.
    if not isinstance(y, torch.Tensor):
        y = torch.tensor(y, dtype=x.dtype, device=x.device)
    return torch.minimum(x, y)


def _max(x: torch.Tensor, y: Union[torch.Tensor, float]) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        y = torch.tensor(y, dtype=x.dtype, device=x.device)
    return torch.maximum(x, y)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    den = float(mask.sum())
    return float((x * mask).sum()) / den if den > 0 else 0.0


# ----------------------------------------------------------------------------- turns


def turn_segments(
    loss_mask: torch.Tensor, turn_id: Optional[torch.Tensor] = None, loss: str = "turn_segments"
) -> Tuple[torch.Tensor, int]:
    """Turn segmentation of the loss tokens (spec §1.2).

    Returns ``(segment, n)``: ``segment`` ``[B, L]`` (long) numbers every turn of the batch
    ``0..n`` (``-1`` on non-loss tokens). With ``turn_id`` a turn is the loss tokens of a row
    sharing one id (an injected observation inside a turn does not split it); without it, a
    maximal run of ``loss_mask > 0``. Loss tokens need non-negative integer turn ids.
    """
    m = loss_mask.detach() > 0
    b, l = m.shape
    if turn_id is None:
        prev = torch.cat([torch.zeros(b, 1, dtype=torch.bool, device=m.device), m[:, :-1]], 1)
        key = torch.cumsum((m & ~prev).long(), 1) - 1
    else:
        tid = turn_id.detach()
        bad = m & ((tid < 0) | (tid != torch.floor(tid.double()).to(tid.dtype)))
        if bool(bad.any()):
            i, t = (int(v) for v in bad.nonzero()[0])
            raise _err(
                loss,
                f"loss token ({i}, {t}) has turn_id {tid[i, t].item()}; loss tokens need a "
                "non-negative integer turn id",
            )
        key = tid.long()
    key = torch.where(m, key, torch.zeros_like(key))
    width = int(key.max()) + 1 if key.numel() else 1
    rows = torch.arange(b, device=m.device).unsqueeze(1).expand(b, l)
    flat = rows * width + key
    seg = torch.full((b, l), -1, dtype=torch.long, device=m.device)
    if bool(m.any()):
        uniq, inv = torch.unique(flat[m], return_inverse=True)
        seg[m] = inv
        return seg, int(uniq.numel())
    return seg, 0


def _sequence_segments(loss_mask: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """One segment per non-empty row (GSPO's sequence ratio, §5.3): ``(segment, n)`` as
    :func:`turn_segments` returns them."""
    m = loss_mask.detach() > 0
    nonempty = m.any(1)
    row_seg = torch.cumsum(nonempty.long(), 0) - 1
    seg = torch.where(m, row_seg.unsqueeze(1).expand(m.shape), torch.full_like(row_seg, -1).unsqueeze(1).expand(m.shape))
    return seg, int(nonempty.sum())


def _segment_log_ratio(
    logp: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    n: int,
    pooling: str,
) -> torch.Tensor:
    """Per-token ``log s_k`` of each token's segment (differentiable, plain form)."""
    idx = torch.where(seg >= 0, seg, torch.full_like(seg, n)).flatten()
    logr = ((logp - old) * mask).flatten()
    sums = torch.zeros(n + 1, dtype=logp.dtype, device=logp.device).index_add(0, idx, logr)
    if pooling == "mean":
        counts = torch.bincount(idx, minlength=n + 1).to(logp.dtype)
        counts[n] = 1.0
        per_seg = sums / counts
    elif pooling == "sum":
        per_seg = sums
    else:
        raise ValueError(f"`pooling` must be 'mean' or 'sum', got {pooling!r}")
    return per_seg[idx].reshape(logp.shape)


def turn_ratio(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_id: Optional[torch.Tensor] = None,
    *,
    pooling: str = "mean",
    form: str = "plain",
) -> torch.Tensor:
    """Turn-level importance ratio ``s_{i,t}`` of every token's turn (spec §5.4), ``[B, L]``.

    ``pooling="mean"``: ``log s_k = (1/|y_k|) Σ_{t∈k} logr_t`` (geometric mean of the token
    ratios, ST-PPO eq. 3 / AT2PO); ``pooling="sum"``: ``log s_k = Σ_{t∈k} logr_t`` (product of the
    token ratios). ``form="plain"`` uses ``s_k`` directly (the gradient is spread over the
    turn); ``form="stop_gradient"`` is ``exp(logp − sg[logp] + sg[log s_k])`` (value ``s_k``,
    ``∂/∂logp_t = s_k``, GSPO/AT2PO code). Clamped at ≤ 10 in log space; non-loss tokens get 1.
    """
    name = "turn_ratio"
    logp = _check(name, "logp", logp)
    shape = tuple(logp.shape)
    old = _check(name, "old_logp", old_logp, shape).detach().to(logp.dtype)
    mask = _check(name, "loss_mask", loss_mask, shape).detach().to(logp.dtype)
    tid = None if turn_id is None else _check(name, "turn_id", turn_id, shape)
    seg, n = turn_segments(mask, tid, name)
    return _segment_ratio(logp, old, mask, seg, n, form, pooling)


def _segment_ratio(
    logp: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    n: int,
    form: str,
    pooling: str,
) -> torch.Tensor:
    log_s = _segment_log_ratio(logp, old, mask, seg, n, pooling)
    if form == "stop_gradient":
        log_s = logp - logp.detach() + log_s.detach()
    elif form != "plain":
        raise ValueError(f"`ratio_form` must be 'plain' or 'stop_gradient', got {form!r}")
    return torch.exp(_min(log_s, 10.0))


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, log_ratio_clamp: float = 20.0) -> torch.Tensor:
    """Token ratio ``w = exp(clamp(logp − old_logp, ±log_ratio_clamp))`` (spec §5.1)."""
    c = float(log_ratio_clamp)
    return torch.exp(_min(_max(logp - old_logp.detach().to(logp.dtype), -c), c))


def adaptive_clip_scale(normalized_info_gain: torch.Tensor, beta: float = 0.3) -> torch.Tensor:
    """A2TGPO clip scale ``c = 1 + β(2σ(îg) − 1)`` (spec §5.5 eq. 10), detached."""
    return 1.0 + beta * torch.tanh(normalized_info_gain.detach() / 2.0)


def adaptive_clip_bounds(
    clip_scale: Union[torch.Tensor, float], clip_low: float = 3e-3, clip_high: float = 4e-3
) -> Tuple[Any, Any]:
    """A2TGPO clip bounds ``[1 − c·ε_low, 1 + c·ε_high]`` (spec §5.5 eq. 11)."""
    return 1.0 - clip_scale * clip_low, 1.0 + clip_scale * clip_high


# ----------------------------------------------------------------------------- aggregation


def _row_weights(
    mask: torch.Tensor,
    mode: str,
    norm_constant: Optional[float],
    denominators: Optional[Tuple[float, float]],
    loss: str,
    convention: str = "turnwise",
    dp_size: int = 1,
) -> list:
    """The per-sequence weights ``W_i`` of §5.7 (Python floats, f64 as turnwise-model), under
    ``convention`` (:data:`AGG_CONVENTIONS`); ``dp_size`` scales ``token-sum`` (verl)."""
    if convention not in AGG_CONVENTIONS:
        raise ValueError(f"unknown agg_convention {convention!r}; known: {', '.join(AGG_CONVENTIONS)}")
    rows = mask.detach().to(torch.float64)
    width = rows.shape[1]
    row_tokens = [float(v) for v in rows.sum(1)]
    local_tokens = sum(row_tokens)
    local_seqs = float(sum(1 for n in row_tokens if n > 0.0))
    tokens, seqs = (local_tokens, local_seqs) if denominators is None else denominators

    def safe(d: float) -> float:
        return d if d > 0.0 else 1.0

    if mode == "token-mean":
        return [1.0 / safe(tokens)] * len(row_tokens)
    if mode == "token-sum":
        if convention != "verl":
            raise ValueError(
                f"{loss}: loss_agg_mode token-sum is verl 0.9.1's mode (agg_convention='verl'); "
                "turnwise-model has no token-sum"
            )
        return [float(dp_size)] * len(row_tokens)
    if mode == "seq-mean-token-sum":
        return [1.0 / safe(seqs)] * len(row_tokens)
    if mode == "seq-mean-token-mean":
        return [1.0 / ((n + 1e-8) * safe(seqs)) if n > 0.0 else 0.0 for n in row_tokens]
    if mode == "seq-mean-token-sum-norm":
        k = float(width) if norm_constant is None else float(norm_constant)
        if not (k > 0.0 and math.isfinite(k)):
            raise ValueError(
                f"invalid loss config: seq-mean-token-sum-norm needs a positive finite constant K, got {k}"
            )
        # Dr.GRPO's (1/G) Σ_i Σ_t l / K, as verl 0.9.1's agg_loss and turnwise-model compute it:
        # seq-mean-token-sum (Σ_i Σ_t m·l / sequences), then / K.
        return [1.0 / (safe(seqs) * k)] * len(row_tokens)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(AGG_MODES)}")


def _weighted_sum(loss_mat: torch.Tensor, mask: torch.Tensor, weights: list) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64, device=loss_mat.device).to(loss_mat.dtype)
    return (loss_mat * mask.detach().to(loss_mat.dtype) * w.unsqueeze(1)).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_constant: Optional[float] = None,
    denominators: Optional[Tuple[float, float]] = None,
    agg_convention: str = "turnwise",
    dp_size: int = 1,
) -> torch.Tensor:
    """Aggregates per-token losses ``[B, L]`` under ``loss_mask`` (spec §5.7)::

        token-mean:               Σ m·l / Σ m  (over the whole mini-batch)
        seq-mean-token-sum:       mean over non-empty rows of Σ_t m·l
        seq-mean-token-mean:      mean over non-empty rows of Σ_t m·l / (Σ_t m + 1e-8)
        seq-mean-token-sum-norm:  mean over non-empty rows of Σ_t m·l, / K  (Dr.GRPO;
                                  K = norm_constant, default L)
        token-sum:                Σ m·l · dp_size  (verl convention only)

    ``denominators = (tokens, sequences)`` are mini-batch totals when ``loss_mat`` is one
    micro-batch (summing the micro-batch losses then gives the mini-batch loss).
    ``agg_convention``: ``"turnwise"`` (turnwise-model's) or ``"verl"`` (verl 0.9.1's
    ``core_algos.agg_loss``; see :data:`AGG_CONVENTIONS`).
    """
    name = "agg_loss"
    loss_mat = _check(name, "loss_mat", loss_mat)
    mask = _check(name, "loss_mask", loss_mask, tuple(loss_mat.shape))
    weights = _row_weights(mask, mode, norm_constant, denominators, name, agg_convention, dp_size)
    return _weighted_sum(loss_mat, mask, weights)


# ----------------------------------------------------------------------------- clip bias


def _clip_bias_config(cfg: Any) -> Dict[str, Any]:
    if cfg is True:
        cfg = {}
    if not isinstance(cfg, dict):
        raise ValueError(f"`clip_bias` must be a dict of settings, True or None, got {cfg!r}")
    unknown = set(cfg) - set(_CLIP_BIAS_DEFAULT)
    if unknown:
        raise ValueError(
            f"`clip_bias` has unknown setting(s) {sorted(unknown)}; known: {sorted(_CLIP_BIAS_DEFAULT)}"
        )
    out = dict(_CLIP_BIAS_DEFAULT)
    out.update(cfg)
    for k, choices in _CLIP_BIAS_CHOICES.items():
        if out[k] not in choices:
            extra = " (the grad space needs the model parameters: turnwise-model only)" if k == "norm_space" else ""
            raise ValueError(f"`clip_bias.{k}` must be one of {list(choices)}, got {out[k]!r}{extra}")
    tau = out["tau"]
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0.0):
        raise ValueError(f"invalid loss config: clip_bias.tau must be finite and ≥ 0, got {tau}")
    m = out["max_scale"]
    if m is not None and not (math.isfinite(m) and m > 0.0):
        raise ValueError(f"invalid loss config: clip_bias.max_scale must be finite and > 0, got {m}")
    if out["rule"] == "downweight":
        for key in ("norm_scope", "norm_space", "max_scale", "tau"):
            if out[key] != _CLIP_BIAS_DEFAULT[key]:
                raise ValueError(
                    f"invalid loss config: clip_bias.{key} applies to rule = \"inverse_norm\" only; "
                    "rule = \"downweight\" weights each sample by 1 − ‖C_i‖/‖G_i‖"
                )
    return out


def _scale_of(cfg: Dict[str, Any], norm: float) -> float:
    s = 1.0 if norm < cfg["tau"] else 1.0 / norm
    return s if cfg["max_scale"] is None else min(s, cfg["max_scale"])


def clip_bias(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    lo: Union[torch.Tensor, float],
    hi: Union[torch.Tensor, float],
    **settings: Any,
) -> Dict[str, Any]:
    """The clipping-bias correction (spec §5.6) from detached values.

    Clipped set ``B^c = {t : (Â_t > 0 ∧ w_t > hi_t) ∨ (Â_t < 0 ∧ w_t < lo_t)}``; components
    ``c_{i,t} = (1/B)(1/|y_i|)·1[t∈B^c]·w_t·Â_t``. Returns ``components`` ``[B, L]``, ``norm``
    ``‖C‖₂``, ``scale`` (``inverse_norm``, minibatch scope: ``1/‖C‖₂``, 1 below ``tau``, capped at
    ``max_scale``), ``sample_scales`` (per-sample scope), ``sample_errors`` ``ρ_i = ‖C_i‖/‖G_i‖``,
    ``sample_weights`` ``1 − ρ_i`` (the ``downweight`` rule) and ``n_clipped``. ``settings``:
    ``rule``, ``ratio``, ``norm_scope``, ``tau``, ``max_scale`` as in turnwise-model.
    """
    cfg = _clip_bias_config(settings)
    w = ratio.detach().to(torch.float64)
    a = advantages.detach().to(torch.float64)
    m = loss_mask.detach().to(torch.float64)
    lo_t = torch.as_tensor(lo, dtype=torch.float64, device=w.device)
    hi_t = torch.as_tensor(hi, dtype=torch.float64, device=w.device)
    return _clip_bias_stats(w, a, m, lo_t.expand_as(w), hi_t.expand_as(w), cfg)


def _clip_bias_stats(
    w: torch.Tensor, a: torch.Tensor, m: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, cfg: Dict[str, Any]
) -> Dict[str, Any]:
    row_tokens = m.sum(1)
    n_seq = float(max(int((row_tokens > 0).sum()), 1))
    loss_tok = (m > 0) & (row_tokens > 0).unsqueeze(1)
    wa = w * a
    clipped = loss_tok & (((a > 0) & (w > hi)) | ((a < 0) & (w < lo)))
    zero = torch.zeros_like(wa)
    all_sq = torch.where(loss_tok, wa * wa, zero).sum(1)
    clipped_sq = torch.where(clipped, wa * wa, zero).sum(1)
    safe_all = torch.where(all_sq > 0, all_sq, torch.ones_like(all_sq))
    errors = torch.where(
        all_sq > 0, torch.clamp(torch.sqrt(clipped_sq / safe_all), max=1.0), torch.zeros_like(all_sq)
    )
    safe_rows = torch.where(row_tokens > 0, row_tokens, torch.ones_like(row_tokens))
    sample = torch.where(clipped, wa / safe_rows.unsqueeze(1), zero)
    components = sample / n_seq
    norm = float(torch.sqrt((components * components).sum()))
    if cfg["norm_scope"] == "minibatch":
        scale, sample_scales = _scale_of(cfg, norm), [1.0] * w.shape[0]
    else:
        scale = 1.0
        sample_scales = [_scale_of(cfg, float(torch.sqrt((r * r).sum()))) for r in sample]
    errs = [float(e) for e in errors]
    return {
        "components": components,
        "norm": norm,
        "scale": scale,
        "sample_scales": sample_scales,
        "sample_errors": errs,
        "sample_weights": [1.0 - e for e in errs],
        # G_i != 0: the row has a gradient for its weight to scale (turnwise-model's sample_signal).
        "sample_signal": [bool(v > 0) for v in all_sq],
        "n_clipped": int(clipped.sum()),
    }


# ----------------------------------------------------------------------------- the loss


def _resolve(
    kind: str,
    clip_ratio: Optional[float],
    clip_ratio_low: Optional[float],
    clip_ratio_high: Optional[float],
    clip_ratio_c: Optional[float],
    loss_agg_mode: Optional[str],
    ratio_form: Optional[str],
    clip_bias_cfg: Any,
    log_ratio_clamp: float,
) -> Dict[str, Any]:
    level, (d_low, d_high) = _KINDS[kind]
    low = clip_ratio_low if clip_ratio_low is not None else clip_ratio if clip_ratio is not None else d_low
    high = clip_ratio_high if clip_ratio_high is not None else clip_ratio if clip_ratio is not None else d_high
    if not (math.isfinite(low) and 0.0 <= low < 1.0):
        raise ValueError(f"invalid loss config: {kind}: clip_ratio_low must be in [0, 1), got {low}")
    if not (math.isfinite(high) and high >= 0.0):
        raise ValueError(f"invalid loss config: {kind}: clip_ratio_high must be finite and ≥ 0, got {high}")
    dual = clip_ratio_c if level == "token" else None
    if dual is not None and not (math.isfinite(dual) and dual > 1.0):
        raise ValueError(f"invalid loss config: {kind}: clip_ratio_c must be finite and > 1, got {dual}")
    forced = _FORCED_AGG.get(kind)
    if loss_agg_mode is not None and loss_agg_mode not in AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(AGG_MODES)}"
        )
    if forced is not None and loss_agg_mode is not None and loss_agg_mode != forced:
        raise ValueError(
            f"invalid loss config: {kind} forces loss_agg_mode {forced} (reference code), but "
            f"{loss_agg_mode} was configured"
        )
    agg = forced or loss_agg_mode or ("token-mean" if level == "token" else "seq-mean-token-mean")
    if not (math.isfinite(log_ratio_clamp) and log_ratio_clamp > 0.0):
        raise ValueError(f"invalid loss config: log_ratio_clamp must be > 0, got {log_ratio_clamp}")
    if ratio_form is None:
        ratio_form = "plain" if kind in ("turn", "st_ppo") else "stop_gradient"
    if ratio_form not in ("plain", "stop_gradient"):
        raise ValueError(f"`ratio_form` must be 'plain' or 'stop_gradient', got {ratio_form!r}")
    if clip_bias_cfg is None or clip_bias_cfg is False:
        cb = _clip_bias_config({}) if kind in ("s_ppo", "st_ppo", "s_grpo") else None
    else:
        cb = _clip_bias_config(clip_bias_cfg)
    return {
        "level": level,
        "clip_low": float(low),
        "clip_high": float(high),
        "clip_ratio_c": dual,
        "agg": agg,
        "ratio_form": ratio_form,
        "clip_bias": cb,
    }


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    policy_loss: str = "vanilla",
    turn_id: Optional[torch.Tensor] = None,
    clip_scale: Optional[torch.Tensor] = None,
    clip_ratio: Optional[float] = None,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = 3.0,
    loss_agg_mode: Optional[str] = None,
    loss_scale_factor: Optional[float] = None,
    ratio_form: Optional[str] = None,
    clip_bias: Optional[Union[Dict[str, Any], bool]] = None,
    log_ratio_clamp: float = 20.0,
    turn_pooling: str = "mean",
    denominators: Optional[Tuple[float, float]] = None,
    clip_bias_scale: Optional[float] = None,
    agg_convention: str = "turnwise",
    dp_size: int = 1,
) -> PolicyLossOutput:
    """The policy loss named ``policy_loss`` (see the module table), as turnwise-model computes
    it (settings named as its ``PolicyLossConfig``)::

        l1 = −A·r ;  l2 = −A·clip(r, lo, hi) ;  l_clip = max(l1, l2)
        dual clip (token losses): loss_t = min(l_clip, −A·c) if A < 0 else l_clip
        loss = scale · Σ_{i,t} W_i·s_i·m_{i,t}·loss_t

    with ``W_i`` the aggregation weights (§5.7) and ``s_i``/``scale`` the clipping-bias
    correction (§5.6; on for ``s_ppo``, ``st_ppo``, ``s_grpo``, or with ``clip_bias={...}``).

    - ``turn_id``: explicit turns (else mask runs); ``clip_scale`` ``[B, L]``: A2TGPO's
      per-token ``c`` (required by ``a2tgpo``; spread a per-turn ``c`` with
      ``turnwise.turn_values_to_tokens(turn_id, c, fill=1.0)``).
    - ``clip_ratio`` (both sides), ``clip_ratio_low``/``clip_ratio_high`` (ε_low, ε_high),
      ``clip_ratio_c`` (dual clip, ``None`` = off; token losses only), ``loss_agg_mode``,
      ``loss_scale_factor`` (K of seq-mean-token-sum-norm), ``ratio_form``
      (``"plain"``/``"stop_gradient"``), ``log_ratio_clamp`` (20).
    - ``turn_pooling``: ``"mean"`` (turnwise-model) or ``"sum"`` for turn/sequence ratios.
    - ``clip_bias``: ``{"rule": "downweight" | "inverse_norm", "ratio": "token" | "loss",
      "norm_scope": "minibatch" | "per_sample", "tau": 1e-8, "max_scale": None}``.
    - ``denominators = (tokens, sequences)``: mini-batch totals for a micro-batch;
      ``clip_bias_scale``: a precomputed mini-batch ``inverse_norm`` scale.
    - ``agg_convention``: ``"turnwise"`` (turnwise-model's §5.7) or ``"verl"`` (verl 0.9.1's
      ``agg_loss``: ``token-sum`` is allowed, times ``dp_size``); see :data:`AGG_CONVENTIONS`.
    """
    kind = "dapo" if policy_loss == "decoupled_clip" else policy_loss
    if kind not in _KINDS:
        raise ValueError(
            f"unknown policy loss {policy_loss!r}; known policy losses: {', '.join(POLICY_LOSS_NAMES)}"
        )
    name = kind
    r = _resolve(
        kind,
        clip_ratio,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        ratio_form,
        clip_bias,
        float(log_ratio_clamp),
    )

    # --- Inputs: shapes, NaN/inf, constants detached and cast to logp's dtype.
    logp = _check(name, "logp", logp)
    shape = tuple(logp.shape)
    dtype = logp.dtype
    old_in = _check(name, "old_logp", old_logp, shape)
    adv_in = _check(name, "advantages", advantages, shape)
    mask_in = _check(name, "loss_mask", loss_mask, shape)
    tid = None if turn_id is None else _check(name, "turn_id", turn_id, shape)
    old = old_in.detach().to(dtype)
    adv = adv_in.detach().to(dtype)
    mask = mask_in.detach().to(dtype)
    logr64 = logp.detach().to(torch.float64) - old_in.detach().to(torch.float64)
    adv64 = adv_in.detach().to(torch.float64)
    mask64 = mask_in.detach().to(torch.float64)
    seg, n_turns = turn_segments(mask_in, tid, name)

    # --- Ratio r: token (§5.1), sequence (§5.3) or turn (§5.4).
    c = float(log_ratio_clamp)
    if r["level"] == "token":
        ratio = torch.exp(_min(_max(logp - old, -c), c))
    elif r["level"] == "sequence":
        seq, n_seq = _sequence_segments(mask_in)
        ratio = _segment_ratio(logp, old, mask, seq, n_seq, r["ratio_form"], turn_pooling)
    else:
        ratio = _segment_ratio(logp, old, mask, seg, n_turns, r["ratio_form"], turn_pooling)

    # --- Clip bounds [lo, hi]: constants, or A2TGPO's [1 − c·ε_low, 1 + c·ε_high] (§5.5).
    if kind == "a2tgpo":
        if clip_scale is None:
            raise _err(
                name,
                "missing input `clip_scale` (A2TGPO needs the per-token adaptive clip scale "
                "c = 1 + β(2σ(îg) − 1))",
            )
        cs = _check(name, "clip_scale", clip_scale, shape)
        if bool((cs < 0).any()):
            raise _err(name, "invalid input: clip_scale must be ≥ 0")
        cs = cs.detach().to(dtype)
        lo = cs * (-r["clip_low"]) + 1.0
        hi = cs * r["clip_high"] + 1.0
    else:
        ones = torch.ones_like(mask)
        lo = ones * 0.0 + (1.0 - r["clip_low"])
        hi = ones * 0.0 + (1.0 + r["clip_high"])

    # --- PPO clip (§5.1).
    neg_adv = -adv
    l1 = neg_adv * ratio
    l2 = neg_adv * _min(_max(ratio, lo), hi)
    l_clip = torch.maximum(l1, l2)

    # --- Dual clip: for A < 0, loss_t = min(l_clip, −A·c) (token losses only).
    l3 = None
    if r["clip_ratio_c"] is not None:
        l3 = neg_adv * r["clip_ratio_c"]
        loss_mat = torch.where(adv < 0.0, torch.minimum(l_clip, l3), l_clip)
    else:
        loss_mat = l_clip

    # --- Diagnostics (§7) on detached values.
    ratio_d = ratio.detach().to(torch.float64)
    lo_d, hi_d = lo.detach().to(torch.float64), hi.detach().to(torch.float64)
    l1_d, l2_d, lc_d = (x.detach().to(torch.float64) for x in (l1, l2, l_clip))
    metrics: Dict[str, float] = {
        "actor/pg_clipfrac": _masked_mean((l2_d > l1_d).double(), mask64),
        "actor/pg_clipfrac_high": _masked_mean(((adv64 > 0) & (ratio_d > hi_d)).double(), mask64),
        "actor/pg_clipfrac_low": _masked_mean(((adv64 < 0) & (ratio_d < lo_d)).double(), mask64),
        "actor/pg_clipfrac_lower": 0.0
        if l3 is None
        else _masked_mean(((lc_d > l3.detach().to(torch.float64)) & (adv64 < 0)).double(), mask64),
        "actor/ppo_kl": _masked_mean(-torch.clamp(logr64, -c, c), mask64),
        "actor/num_turns": float(n_turns),
        "actor/turn_rule_explicit": 1.0 if tid is not None else 0.0,
    }

    # --- Clipping-bias correction (§5.6): from the token ratio (Alg. 1) or the clipped one.
    cb_cfg = r["clip_bias"] if r["clip_bias"] is not None else dict(_CLIP_BIAS_DEFAULT)
    if cb_cfg["ratio"] == "token" and r["level"] != "token":
        tr = torch.exp(torch.clamp(logr64, -c, c))
        cb = _clip_bias_stats(
            tr,
            adv64,
            mask64,
            torch.full_like(tr, 1.0 - r["clip_low"]),
            torch.full_like(tr, 1.0 + r["clip_high"]),
            cb_cfg,
        )
    else:
        cb = _clip_bias_stats(ratio_d, adv64, mask64, lo_d, hi_d, cb_cfg)

    # --- Aggregate (§5.7) with the per-sequence weights, times the clip-bias scale.
    weights = _row_weights(mask_in, r["agg"], loss_scale_factor, denominators, name, agg_convention, dp_size)
    row_tokens = [float(v) for v in mask64.sum(1)]
    scale, reported = 1.0, 1.0
    weight_sum, share_sum = 0.0, 0.0
    rule = None if r["clip_bias"] is None else r["clip_bias"]["rule"]
    if rule == "downweight":
        # The rows carry the weights and nothing else is scaled (§5.6: the mix of the samples'
        # gradients survives AdamW, a step-size factor does not). The reported mean weight s̄ is
        # taken over rows with a non-zero surrogate, so zero-advantage rows do not dilute it.
        for i, (s, has) in enumerate(zip(cb["sample_weights"], cb["sample_signal"])):
            if has:
                share = weights[i] * row_tokens[i]
                share_sum += share
                weight_sum += share * s
            weights[i] *= s
        reported = weight_sum / share_sum if share_sum > 0.0 else 1.0
    elif rule == "inverse_norm" and r["clip_bias"]["norm_scope"] == "minibatch":
        scale = cb["scale"] if clip_bias_scale is None else float(clip_bias_scale)
        if not math.isfinite(scale):
            raise _err(name, f"`clip_bias_scale` is not finite ({scale})")
        reported = scale
    elif rule == "inverse_norm":
        for i, s in enumerate(cb["sample_scales"]):
            weights[i] *= s
        reported = sum(cb["sample_scales"]) / max(len(cb["sample_scales"]), 1)
    loss = _weighted_sum(loss_mat, mask, weights) * scale
    pg_loss = float(loss.detach())
    if not math.isfinite(pg_loss):
        raise _err(name, "tensor `loss` contains 1 non-finite value(s) (NaN or inf) out of 1")
    metrics.update(
        {
            "actor/pg_loss": pg_loss,
            "actor/clip_bias_norm": cb["norm"],
            "actor/clip_bias_scale": reported,
            "actor/clip_bias_num_clipped": float(cb["n_clipped"]),
            "actor/clip_bias_weight_sum": weight_sum,
            "actor/clip_bias_share_sum": share_sum,
        }
    )
    return PolicyLossOutput(loss, loss_mat, ratio.detach(), metrics)


def turn_ppo_loss(logp: Any, old_logp: Any, advantages: Any, loss_mask: Any, **kw: Any) -> PolicyLossOutput:
    """Turn-PPO / ST-PPO eq. 3 without the correction: plain turn ratio, ε = 0.2
    (``policy_loss(..., policy_loss="turn")``)."""
    return policy_loss(logp, old_logp, advantages, loss_mask, policy_loss="turn", **kw)


def st_ppo_loss(logp: Any, old_logp: Any, advantages: Any, loss_mask: Any, **kw: Any) -> PolicyLossOutput:
    """ST-PPO: plain turn ratio plus the clipping-bias correction (``downweight`` by default)."""
    return policy_loss(logp, old_logp, advantages, loss_mask, policy_loss="st_ppo", **kw)


def gspo_turn_loss(logp: Any, old_logp: Any, advantages: Any, loss_mask: Any, **kw: Any) -> PolicyLossOutput:
    """AT2PO's turn-GSPO: stop-gradient turn ratio, ε = (3e-3, 4e-3), seq-mean-token-mean."""
    return policy_loss(logp, old_logp, advantages, loss_mask, policy_loss="gspo_turn", **kw)


def a2tgpo_loss(
    logp: Any, old_logp: Any, advantages: Any, loss_mask: Any, clip_scale: Any, **kw: Any
) -> PolicyLossOutput:
    """A2TGPO: turn ratio with the adaptive per-turn bounds ``[1 − c·ε_low, 1 + c·ε_high]``."""
    return policy_loss(
        logp, old_logp, advantages, loss_mask, policy_loss="a2tgpo", clip_scale=clip_scale, **kw
    )
