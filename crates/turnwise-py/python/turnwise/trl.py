"""TRL integration: GRPO training with turnwise's turn-level advantages and policy losses on a
multi-turn search agent (Search-R1 protocol).

Tested with ``trl==1.16.0`` (``transformers`` 5.x); ``scripts/trl-check.sh`` pins it. The
pieces plug into TRL's own extension points rather than copying its training loop:

- :class:`SearchR1Rollout` is a TRL ``rollout_func``: it generates with the policy (the HF model
  of the trainer, no vLLM needed), stops each turn at ``</search>`` or ``</answer>``, sends the
  turn's queries to a Search-R1 retrieval server in one ``POST /retrieve`` (``turnwise
  serve-retriever``, or Search-R1's own server), appends ``<information>…</information>`` and
  goes on until an answer, ``max_turns`` or ``max_completion_length``. It returns TRL's
  ``env_mask`` (1 = model token, 0 = observation token), so TRL masks the observations out of
  the loss, and the per-turn observations (``observations``), which reward functions receive.
- :class:`TurnwiseGRPOTrainer` is a ``GRPOTrainer`` whose advantages come from
  :func:`turnwise.estimate` (any registered estimator, per token, turn ids from
  :func:`turnwise.turn_ids_from_mask` on the loss mask) and whose loss is
  :func:`turnwise.losses.policy_loss` (turn-level ratio, adaptive clip, clipping-bias
  correction, ...). TRL's sampler, reward functions, optimizer, accelerate and logging are kept.

Example::

    from trl import GRPOConfig
    from turnwise.trl import SearchR1Rollout, TurnwiseGRPOTrainer, search_r1_em_reward

    trainer = TurnwiseGRPOTrainer(
        model=model, processing_class=tokenizer,
        reward_funcs=[search_r1_em_reward],          # reads the dataset's `golds` column
        args=GRPOConfig(output_dir="out", num_generations=4, max_completion_length=256),
        train_dataset=dataset,                       # columns: prompt, golds
        rollout_func=SearchR1Rollout("http://127.0.0.1:8000/retrieve", max_turns=4),
        estimator="grpo", policy_loss="st_ppo",
    )
    trainer.train()

Turn-level inputs of estimators that need them (``mt_grpo``'s ``turn_rewards``, ``a2tgpo``'s and
``igpo``'s ``info_gain``) come from ``turn_inputs(trainer, inputs, turn_id, outcome)``; the
default, :func:`retrieval_turn_inputs`, scores each search turn by whether a gold answer appears
in its ``<information>`` (the R_retrieval rule of turn-level-rewards.md, spec §2.4) — a proxy for
the information gain, not IGPO's log-probability gain.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from trl import GRPOTrainer

from . import losses as _losses
from .advantage import estimate
from .retrieval import RetrieverClient, format_information
from .rewards import normalize_answer, score
from .turns import turn_ids_from_mask, turn_values_to_tokens

__all__ = [
    "RetrieverClient",
    "format_information",
    "SearchR1Rollout",
    "TurnwiseGRPOTrainer",
    "search_r1_em_reward",
    "retrieval_hits",
    "retrieval_turn_inputs",
]

#: TRL version this module was written and tested against.
TESTED_TRL_VERSION = "1.16.0"


# ----------------------------------------------------------------------------- rollout


class _TagStop(StoppingCriteria):
    """Stops a row once its generated text contains one of ``stops`` (per-row bool)."""

    def __init__(self, tokenizer: Any, start: int, stops: Sequence[str], eos: Sequence[int]):
        self.tokenizer, self.start, self.stops, self.eos = tokenizer, start, tuple(stops), set(eos)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = []
        for row in input_ids[:, self.start :].tolist():
            text = self.tokenizer.decode(row, skip_special_tokens=False)
            done.append(any(s in text for s in self.stops) or any(t in self.eos for t in row))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class SearchR1Rollout:
    """A TRL ``rollout_func`` for the Search-R1 agent loop (see the module docstring).

    Each turn the model writes ``<think>…</think><search>query</search>`` (or ``<answer>…``); the
    turn is cut right after the first ``</search>``/``</answer>``, the queries of all rows go to
    the retriever in one request, and ``\\n\\n<information>{docs}</information>\\n\\n`` is appended
    as observation tokens (``env_mask`` 0). A turn with neither tag (EOS, or the per-turn token
    budget) ends the rollout, as do ``max_turns`` model turns; a search in the last allowed turn
    gets no observation. Returned extra fields: ``env_mask``, ``observations`` (per rollout, the
    ``<information>`` text of each search turn) and ``num_turns``.
    """

    def __init__(
        self,
        retriever: Any,
        max_turns: int = 4,
        max_tokens_per_turn: int = 128,
        topk: int = 3,
        stops: Sequence[str] = ("</search>", "</answer>"),
    ):
        self.retriever = retriever if isinstance(retriever, RetrieverClient) else RetrieverClient(retriever, topk)
        self.max_turns = max_turns
        self.max_tokens_per_turn = max_tokens_per_turn
        self.stops = tuple(stops)

    # The trainer passes the per-process prompts (already repeated num_generations times by
    # TRL's sampler) and itself.
    def __call__(self, prompts: List[Any], trainer: Any) -> Dict[str, Any]:
        tok = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        device = trainer.accelerator.device
        max_len = trainer.max_completion_length or 10**9
        eos_ids = [i for i in (getattr(trainer, "eos_token_ids", None) or [tok.eos_token_id]) if i is not None]
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]

        prompt_ids = []
        for p in prompts:
            if isinstance(p, list):  # conversational
                text = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                prompt_ids.append(tok(text, add_special_tokens=False)["input_ids"])
            else:
                prompt_ids.append(tok(p)["input_ids"])
        n = len(prompts)
        completion = [[] for _ in range(n)]
        logprobs: List[List[float]] = [[] for _ in range(n)]
        env_mask: List[List[int]] = [[] for _ in range(n)]
        observations: List[List[str]] = [[] for _ in range(n)]
        num_turns = [0] * n
        active = list(range(n))

        was_training = model.training
        model.eval()
        try:
            for turn in range(self.max_turns):
                if not active:
                    break
                budget = {i: min(self.max_tokens_per_turn, max_len - len(completion[i])) for i in active}
                active = [i for i in active if budget[i] > 0]
                if not active:
                    break
                ctx = [prompt_ids[i] + completion[i] for i in active]
                width = max(len(c) for c in ctx)
                ids = torch.full((len(ctx), width), pad_id, dtype=torch.long)
                att = torch.zeros((len(ctx), width), dtype=torch.long)
                for r, c in enumerate(ctx):  # left padding
                    ids[r, width - len(c) :] = torch.tensor(c)
                    att[r, width - len(c) :] = 1
                gen_kwargs: Dict[str, Any] = dict(
                    do_sample=True,
                    temperature=trainer.temperature,
                    top_p=trainer.top_p,
                    max_new_tokens=max(budget[i] for i in active),
                    pad_token_id=pad_id,
                    eos_token_id=eos_ids,
                    output_scores=True,
                    return_dict_in_generate=True,
                    stopping_criteria=StoppingCriteriaList([_TagStop(tok, width, self.stops, eos_ids)]),
                )
                if trainer.top_k:
                    gen_kwargs["top_k"] = trainer.top_k
                with torch.no_grad():
                    out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), **gen_kwargs)
                new = out.sequences[:, width:].tolist()
                # log-probs of the sampled tokens under the (temperature/top-p processed) sampling
                # distribution
                step_lp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
                queries, searchers = [], []
                still = []
                for r, i in enumerate(active):
                    toks = self._cut(tok, new[r][: budget[i]], eos_ids)
                    lps = [float(step_lp[r, t, v]) for t, v in enumerate(toks)]
                    completion[i] += toks
                    logprobs[i] += lps
                    env_mask[i] += [1] * len(toks)
                    num_turns[i] += 1
                    text = tok.decode(toks, skip_special_tokens=True)
                    ended_eos = bool(toks) and toks[-1] in eos_ids
                    kind = _action_kind(text)
                    if kind == "search" and not ended_eos and turn + 1 < self.max_turns:
                        queries.append(_search_query(text))
                        searchers.append(i)
                results = self.retriever.retrieve(queries) if queries else []
                for i, docs in zip(searchers, results):
                    info = format_information(docs)
                    obs = tok(f"\n\n<information>{info}</information>\n\n", add_special_tokens=False)["input_ids"]
                    room = max_len - len(completion[i])
                    obs = obs[:room]
                    completion[i] += obs
                    logprobs[i] += [0.0] * len(obs)
                    env_mask[i] += [0] * len(obs)
                    observations[i].append(info)
                    if len(completion[i]) < max_len:
                        still.append(i)
                active = still
        finally:
            if was_training:
                model.train()

        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion,
            "logprobs": logprobs,
            "env_mask": env_mask,
            "observations": observations,
            "num_turns": num_turns,
        }

    def _cut(self, tok: Any, toks: List[int], eos_ids: Sequence[int]) -> List[int]:
        """The turn's tokens up to the first stop tag or EOS (inclusive)."""
        for t, v in enumerate(toks):
            if v in eos_ids:
                return toks[: t + 1]
        text = tok.decode(toks, skip_special_tokens=False)
        if not any(s in text for s in self.stops):
            return toks
        for t in range(1, len(toks) + 1):
            if any(s in tok.decode(toks[:t], skip_special_tokens=False) for s in self.stops):
                return toks[:t]
        return toks


def _action_kind(text: str) -> str:
    a = text.find("</answer>")
    s = text.find("</search>")
    if s >= 0 and (a < 0 or s < a) and "<search>" in text[:s]:
        return "search"
    if a >= 0:
        return "answer"
    return "none"


def _search_query(text: str) -> str:
    end = text.find("</search>")
    start = text.rfind("<search>", 0, end)
    return text[start + len("<search>") : end].strip()


# ----------------------------------------------------------------------------- rewards


def _golds(value: Any) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(g) for g in value]


def _completion_text(c: Any) -> str:
    if isinstance(c, str):
        return c
    return "".join(m.get("content", "") for m in c if isinstance(m, dict))


def search_r1_em_reward(completions: List[Any], golds: List[Any], **kwargs: Any) -> List[float]:
    """TRL reward function: turnwise's ``search_r1_em`` (Search-R1 EM of the last
    ``<answer>``, spec §2.1) against the dataset's ``golds`` column (a string or a list)."""
    return [
        float(score("search_r1_em", _completion_text(c), golds=_golds(g))["score"])
        for c, g in zip(completions, golds)
    ]


def retrieval_hits(observations: Sequence[str], golds: Sequence[str]) -> List[float]:
    """Per search turn: 1.0 if a gold answer (Search-R1 normalized) is a substring of that
    turn's retrieved documents (normalized), else 0.0."""
    gs = [normalize_answer(g) for g in golds if normalize_answer(g)]
    return [1.0 if any(g in normalize_answer(o) for g in gs) else 0.0 for o in observations]


def retrieval_turn_inputs(
    trainer: "TurnwiseGRPOTrainer", inputs: List[Dict[str, Any]], turn_id: np.ndarray, outcome: np.ndarray
) -> Dict[str, Any]:
    """Default turn-level estimator inputs from the rollout's ``observations`` and the dataset's
    gold answers (``trainer.golds_column``): ``turn_rewards`` ``[B, T]`` = the retrieval hit of
    each search turn, and the outcome on the final turn (MT-GRPO's R_{i,k}); ``info_gain``
    ``[B, T-1]`` = the retrieval hit of each process turn (A2TGPO/IGPO; a proxy for IG)."""
    name = trainer.estimator
    if name not in ("mt_grpo", "mt_grpo_code", "a2tgpo", "igpo"):
        return {}
    num_turns = (turn_id.max(axis=1) + 1).clip(min=0)
    t_max = max(int(num_turns.max()), 1)
    hits = np.zeros((len(inputs), t_max), dtype=np.float64)
    for i, x in enumerate(inputs):
        h = retrieval_hits(x.get("observations") or [], _golds(x.get(trainer.golds_column)))
        k = int(num_turns[i])
        # observations of turns whose tokens survived (truncation may drop the last ones)
        for t, v in enumerate(h[: max(k - 1, 0)]):
            hits[i, t] = v
        if k > 0:
            hits[i, k - 1] = outcome[i]
    if name in ("mt_grpo", "mt_grpo_code"):
        return {"turn_rewards": hits}
    ig = hits[:, : max(t_max - 1, 1)].copy()
    for i in range(len(inputs)):  # the final turn's slot holds the outcome: not an IG
        k = int(num_turns[i])
        if 0 < k <= ig.shape[1]:
            ig[i, k - 1] = 0.0
    return {"info_gain": ig}


# ----------------------------------------------------------------------------- trainer


class TurnwiseGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with turnwise's advantages and policy loss (see the module docstring).

    Extra arguments (all keyword):

    - ``estimator`` (``"grpo"``): a name of :data:`turnwise.ESTIMATORS`; ``estimator_settings``:
      its settings (``{"epsilon": 1e-6, "std": "sample"}``, …, as :func:`turnwise.estimate`).
      The outcome is TRL's weighted sum of the reward functions (unscorable rows: 0); groups are
      TRL's ``num_generations`` consecutive rollouts of one prompt.
    - ``policy_loss`` (``"st_ppo"``): a name of :data:`turnwise.losses.POLICY_LOSS_NAMES`;
      ``policy_loss_settings``: keyword arguments of :func:`turnwise.losses.policy_loss`
      (``clip_ratio_low``, ``loss_agg_mode``, ``clip_bias``, ``turn_pooling``, …). ``a2tgpo``
      takes its per-token clip scale from the ``a2tgpo`` estimator's ``clip_scale``.
    - ``turn_inputs(trainer, inputs, turn_id, outcome) -> dict``: extra :func:`turnwise.estimate`
      inputs (default :func:`retrieval_turn_inputs`); ``golds_column`` (``"golds"``).
    - ``retriever_url``/``rollout_settings``: build a :class:`SearchR1Rollout` when no
      ``rollout_func`` is given.
    - ``record_batches`` (``False``): keep every generation batch's ``outcome``, ``group``,
      ``prompts``, ``outcome``, ``group``, ``turn_id``, estimator inputs (``extra``), ``advantages``,
      ``completion_ids`` and ``loss_mask`` in ``self.turnwise_batches`` (tests, debugging).

    TRL's KL term (``beta``) is added to turnwise's loss as a token-mean k3 penalty; TRL's
    ``loss_type``, ``epsilon*``, ``importance_sampling_level`` and vLLM importance-sampling
    correction are not used. Multi-process training needs each process's generation batch to hold
    whole groups (a multiple of ``num_generations``).
    """

    def __init__(
        self,
        *args: Any,
        estimator: str = "grpo",
        estimator_settings: Optional[Dict[str, Any]] = None,
        policy_loss: str = "st_ppo",
        policy_loss_settings: Optional[Dict[str, Any]] = None,
        turn_inputs: Optional[Callable[..., Dict[str, Any]]] = None,
        golds_column: str = "golds",
        retriever_url: Optional[str] = None,
        rollout_settings: Optional[Dict[str, Any]] = None,
        record_batches: bool = False,
        **kwargs: Any,
    ):
        if policy_loss not in _losses.POLICY_LOSS_NAMES:
            raise ValueError(f"policy_loss: unknown {policy_loss!r}; one of {_losses.POLICY_LOSS_NAMES}")
        if policy_loss == "a2tgpo" and estimator != "a2tgpo":
            raise ValueError("policy_loss='a2tgpo' needs estimator='a2tgpo' (its clip scale)")
        if kwargs.get("rollout_func") is None and retriever_url is not None:
            kwargs["rollout_func"] = SearchR1Rollout(retriever_url, **(rollout_settings or {}))
        super().__init__(*args, **kwargs)
        self.estimator = estimator
        self.estimator_settings = dict(estimator_settings or {})
        self.policy_loss_name = policy_loss
        self.policy_loss_settings = dict(policy_loss_settings or {})
        self.turn_inputs = turn_inputs or retrieval_turn_inputs
        self.golds_column = golds_column
        self.record_batches = record_batches
        self.turnwise_batches: List[Dict[str, Any]] = []
        self._tw_rewards_per_func: Optional[torch.Tensor] = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[override]
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._tw_rewards_per_func = rewards  # gathered over processes, [B_global, n_funcs]
        return rewards

    def _generate_and_score_completions(self, inputs):  # type: ignore[override]
        out = super()._generate_and_score_completions(inputs)
        device = out["completion_ids"].device
        mode = "train" if self.model.training else "eval"
        g = self.num_generations if mode == "train" else self.num_generations_eval
        b = out["completion_ids"].shape[0]
        if self.accelerator.num_processes > 1 and b % g:
            raise ValueError(
                f"TurnwiseGRPOTrainer: each process's generation batch ({b}) must hold whole groups "
                f"of num_generations={g}"
            )
        # the outcome: TRL's weighted reward sum, this process's rows
        rpf = self._tw_rewards_per_func
        weights = self.reward_weights.to(rpf.device).unsqueeze(0)
        unscorable = torch.isnan(rpf).all(dim=1)
        total = (rpf * weights).nansum(dim=1)
        total[unscorable] = 0.0
        start = self.accelerator.process_index * b
        outcome = total[start : start + b].double().cpu().numpy()
        group = (np.arange(start, start + b) // g).astype(np.int64)

        mask = out["completion_mask"]
        if out.get("tool_mask") is not None:
            mask = mask * out["tool_mask"]
        turn_id = turn_ids_from_mask(mask.cpu().numpy())
        extra = self.turn_inputs(self, inputs, turn_id, outcome)
        adv = estimate(self.estimator, outcome, group, turn_id, **extra, **self.estimator_settings)
        out["advantages"] = torch.as_tensor(np.asarray(adv.tokens), dtype=torch.float32, device=device)
        out["turn_id"] = torch.as_tensor(turn_id, device=device)
        if self.policy_loss_name == "a2tgpo":
            c = turn_values_to_tokens(turn_id, adv.clip_scale, fill=1.0)
            out["clip_scale"] = torch.as_tensor(np.asarray(c), dtype=torch.float32, device=device)
        num_turns = np.asarray(adv.num_turns, dtype=np.float64)
        self._metrics[mode]["turnwise/num_turns"].append(float(num_turns.mean()))
        self._metrics[mode]["turnwise/advantage_abs_mean"].append(
            float(np.abs(np.asarray(adv.tokens))[turn_id >= 0].mean()) if (turn_id >= 0).any() else 0.0
        )
        if self.record_batches:
            self.turnwise_batches.append(
                {
                    "prompts": [x.get("prompt") for x in inputs],
                    "outcome": outcome,
                    "group": group,
                    "turn_id": turn_id,
                    "extra": extra,
                    "advantages": out["advantages"].detach().cpu().clone(),
                    "completion_ids": out["completion_ids"].detach().cpu().clone(),
                    "loss_mask": mask.detach().cpu().clone(),
                }
            )
        return out

    def turnwise_loss(self, model: Any, inputs: Dict[str, Any]) -> "_losses.PolicyLossOutput":
        """turnwise's policy loss on one (micro-)batch of TRL inputs, before the
        gradient-accumulation scaling and the KL term."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logp, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        self._tw_last_logp, self._tw_last_entropies = logp, entropies
        mask = completion_mask if inputs.get("tool_mask") is None else completion_mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        return _losses.policy_loss(
            logp,
            old,
            inputs["advantages"],
            mask,
            policy_loss=self.policy_loss_name,
            turn_id=inputs.get("turn_id"),
            clip_scale=inputs.get("clip_scale"),
            **self.policy_loss_settings,
        )

    def _compute_loss(self, model, inputs):  # type: ignore[override]
        mode = "train" if self.model.training else "eval"
        out = self.turnwise_loss(model, inputs)
        loss = out.loss
        logp, entropies = self._tw_last_logp, self._tw_last_entropies
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        den = mask.sum().clamp(min=1.0)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            loss = loss + self.beta * (kl * mask).sum() / den
            self._metrics[mode]["kl"].append(float((kl.detach() * mask).sum() / den))
        if mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        self._metrics[mode]["entropy"].append(float((entropies.detach() * mask).sum() / den))
        self._metrics[mode]["policy_loss"].append(float(out.loss.detach()))
        for k, v in out.metrics.items():
            self._metrics[mode][k].append(float(v))
        return loss
