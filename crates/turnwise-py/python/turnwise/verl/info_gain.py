"""Information-gain turn rewards for verl (IGPO, A2TGPO; spec §4), computed with verl's own
log-prob workers as IGPO's verl code does.

After each turn's observation the policy is asked how likely the ground-truth answer now is:
``p_{i,t} = exp(mean_j log π(a_j | prompt, response[:start of turn t], probe prefix, a_<j))``,
``p_{i,0}`` from the prompt alone, and ``ig_{i,t} = p_{i,t+1} − p_{i,t}`` for each process turn
``t < T_i − 1``. A probe is the rollout's own token ids up to the start of a turn (token in,
token out: nothing is re-tokenized) followed by ``prefix ++ answer ++ suffix`` as the probe's
response; only the answer tokens are scored. All probes of a batch go through one call of
``compute_log_prob`` with θ_old, which is what the rollout used (weights do not change within
a rollout phase), so the probes equal IGPO's per-step ones.

``compute_log_prob`` takes a verl :class:`~verl.DataProto` of probes (``prompts``,
``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``) and
returns ``[N, R]`` log-probs of the probe response tokens: in verl's trainer
:class:`turnwise.verl.trainer.TurnwiseRayPPOTrainer` passes its own
``RayPPOTrainer._compute_old_log_prob`` (the actor worker group's ``compute_log_prob``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..turns import turn_ids_from_mask

__all__ = [
    "IGPO_PROBE_PREFIX",
    "IGPO_PROBE_SUFFIX",
    "Probes",
    "build_probes",
    "info_gain",
    "place_info_gain",
]

#: IGPO's pseudo-response around the ground truth (spec §4; its chat template's end token
#: follows the suffix in IGPO's code and is left to the caller's suffix here).
IGPO_PROBE_PREFIX = "\nNow there's enough information to answer\n</think>\n<answer>\n"
IGPO_PROBE_SUFFIX = "\n</answer>"


class Probes:
    """The probe batch of :func:`build_probes`: ``data`` (a verl ``DataProto``), and per probe
    its rollout ``row``, turn ``turn`` (the probe sees the context up to the start of that turn)
    and the answer's token span ``[lo, hi)`` in the probe response."""

    def __init__(self, data: Any, row: List[int], turn: List[int], span: List[Tuple[int, int]], num_turns: np.ndarray):
        self.data, self.row, self.turn, self.span, self.num_turns = data, row, turn, span, num_turns

    def __len__(self) -> int:
        return len(self.row)


def _left_pad(rows: List[List[int]], pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def _right_pad(rows: List[List[int]], pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def build_probes(
    batch: Any,
    answer_ids: Sequence[Optional[Sequence[int]]],
    prefix_ids: Sequence[int],
    suffix_ids: Sequence[int],
    pad_token_id: int,
) -> Probes:
    """The probes of a verl batch (``batch.batch`` holds ``prompts`` ``[B, P]`` left-padded,
    ``responses`` ``[B, R]``, ``response_mask`` (multi-turn: 0 on observations) and
    ``attention_mask`` ``[B, P + R]``): one per rollout and agent turn, context = the prompt's
    tokens plus the response's tokens before that turn. ``answer_ids[i]`` is rollout ``i``'s
    ground truth, tokenized (``None`` or empty: no probes for that rollout, its IG is 0)."""
    from verl import DataProto

    prompts = batch.batch["prompts"]
    responses = batch.batch["responses"]
    attn = batch.batch["attention_mask"]
    mask = batch.batch["response_mask"]
    b, p_len = prompts.shape
    if len(answer_ids) != b:
        raise ValueError(f"answer_ids has {len(answer_ids)} entries for a batch of {b} rollouts")
    tid = np.asarray(turn_ids_from_mask(mask.detach().cpu().to(torch.int64).numpy()), dtype=np.int64)
    num_turns = tid.max(axis=1) + 1
    ctx_rows: List[List[int]] = []
    resp_rows: List[List[int]] = []
    rows: List[int] = []
    turns: List[int] = []
    spans: List[Tuple[int, int]] = []
    pre, suf = list(prefix_ids), list(suffix_ids)
    for i in range(b):
        ans = list(answer_ids[i] or [])
        if not ans or num_turns[i] < 2:
            continue
        prompt = prompts[i][attn[i, :p_len].bool()].tolist()
        if not prompt:
            raise ValueError(f"rollout {i} has an empty prompt (attention_mask is 0 on all of it)")
        resp = responses[i].tolist()
        for t in range(int(num_turns[i])):
            start = int(np.flatnonzero(tid[i] == t)[0])
            ctx_rows.append(prompt + resp[:start])
            resp_rows.append(pre + ans + suf)
            rows.append(i)
            turns.append(t)
            spans.append((len(pre), len(pre) + len(ans)))
    if not rows:
        return Probes(None, [], [], [], num_turns)
    p_ids, p_mask = _left_pad(ctx_rows, pad_token_id)
    r_ids, r_mask = _right_pad(resp_rows, pad_token_id)
    attention = torch.cat([p_mask, r_mask], dim=1)
    position = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    data = DataProto.from_dict(
        tensors={
            "prompts": p_ids,
            "responses": r_ids,
            "input_ids": torch.cat([p_ids, r_ids], dim=1),
            "attention_mask": attention,
            "position_ids": position,
            "response_mask": r_mask,
        },
        non_tensors={
            "turnwise_probe_row": np.array(rows, dtype=np.int64),
            "turnwise_probe_turn": np.array(turns, dtype=np.int64),
        },
    )
    return Probes(data, rows, turns, spans, num_turns)


def info_gain(
    batch: Any,
    answer_ids: Sequence[Optional[Sequence[int]]],
    compute_log_prob: Callable[[Any], torch.Tensor],
    *,
    prefix_ids: Sequence[int],
    suffix_ids: Sequence[int],
    pad_token_id: int,
) -> Tuple[np.ndarray, Dict[str, float]]:
    """Information gain ``[B, T_max − 1]`` of every process turn (0 beyond ``num_turns − 1``
    and for rollouts without an answer), and metrics: ``turnwise/ig/{mean,abs_mean,probes,
    rollouts_without_answer}``. ``compute_log_prob(probes.data)`` must return ``[N, R]``
    log-probs of the probe responses."""
    probes = build_probes(batch, answer_ids, prefix_ids, suffix_ids, pad_token_id)
    b = len(answer_ids)
    width = max(int(probes.num_turns.max(initial=0)) - 1, 1)
    ig = np.zeros((b, width), dtype=np.float64)
    no_answer = sum(1 for a in answer_ids if not a)
    metrics = {"turnwise/ig/probes": float(len(probes)), "turnwise/ig/rollouts_without_answer": float(no_answer)}
    if not len(probes):
        metrics.update({"turnwise/ig/mean": 0.0, "turnwise/ig/abs_mean": 0.0})
        return ig, metrics
    logp = compute_log_prob(probes.data)
    logp = logp.detach().to("cpu", torch.float64)
    if logp.shape[0] != len(probes):
        raise ValueError(f"compute_log_prob returned {logp.shape[0]} rows for {len(probes)} probes")
    p: Dict[Tuple[int, int], float] = {}
    for k, (i, t, (lo, hi)) in enumerate(zip(probes.row, probes.turn, probes.span)):
        span = logp[k, lo:hi]
        if span.numel() != hi - lo or not bool(torch.isfinite(span).all()):
            raise ValueError(
                f"probe of rollout {i}, turn {t}: answer log-probs [{lo}, {hi}) are missing or not finite"
            )
        p[(i, t)] = float(torch.exp(span.mean()))
    values = []
    for i in range(b):
        for t in range(int(probes.num_turns[i]) - 1):
            if (i, t + 1) in p:
                ig[i, t] = p[(i, t + 1)] - p[(i, t)]
                values.append(ig[i, t])
    arr = np.asarray(values) if values else np.zeros(1)
    metrics.update({"turnwise/ig/mean": float(arr.mean()), "turnwise/ig/abs_mean": float(np.abs(arr).mean())})
    return ig, metrics


def place_info_gain(token_scores: torch.Tensor, response_mask: torch.Tensor, ig: np.ndarray) -> List[Tuple[int, int]]:
    """Adds ``ig[i, t]`` to ``token_scores`` (in place) on the last model token of each process
    turn ``t``, where :func:`turnwise.verl.split_turn_rewards` reads it back as that turn's
    reward. Returns the ``(row, position)`` pairs written."""
    tid = np.asarray(turn_ids_from_mask(response_mask.detach().cpu().to(torch.int64).numpy()), dtype=np.int64)
    num_turns = tid.max(axis=1) + 1
    written = []
    for i in range(tid.shape[0]):
        for t in range(int(num_turns[i]) - 1):
            if t >= ig.shape[1]:
                break
            end = int(np.flatnonzero(tid[i] == t)[-1])
            token_scores[i, end] += float(ig[i, t])
            written.append((i, end))
    return written
