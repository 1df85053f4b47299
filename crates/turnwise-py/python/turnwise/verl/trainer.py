"""verl's PPO trainer with IGPO's information-gain probes (``turnwise_igpo``,
``turnwise_a2tgpo``), and its entry point::

    python -m turnwise.verl.trainer trainer.use_v1=false algorithm.adv_estimator=turnwise_a2tgpo ...

The estimators and losses need no trainer of their own (verl's ``main_ppo`` finds them through
the plugin entry point), except ``turnwise_igpo`` and ``turnwise_a2tgpo``: their information
gain asks the actor for the ground truth's log-probs after every turn, which only this trainer
does, and under ``main_ppo`` those two estimators refuse to run (see :mod:`turnwise.verl`). :class:`TurnwiseRayPPOTrainer` is verl's
``RayPPOTrainer`` (``trainer.use_v1=false``) with one override: right after verl computes the
batch's ``old_log_probs``, it builds the probes (:mod:`turnwise.verl.info_gain`), runs them
through the same ``_compute_old_log_prob`` (the actor worker group's ``compute_log_prob``,
θ_old) and adds each process turn's IG to the reward verl extracted for the batch
(``rm_scores``), on the turn's last model token, and records them
(:func:`turnwise.verl.record_info_gain`) for the estimator, which refuses rewards without them.
Before the actor update it checks that the rewards verl trained on hold those IGs, and that
they were computed at all this step (``algorithm.rollout_correction.bypass_mode`` skips
``_compute_old_log_prob``, and with it the probes: refused), so a verl change that drops them
stops the run instead of training without them. After the update it takes the IG back out of
verl's score tensors, so verl's ``critic/score/*`` and ``critic/rewards/*`` metrics show the
task reward alone, and adds ``turnwise/ig/*`` (``outcome_mean``: the task score, ``sum_mean``:
the IG a response received) to the actor's metrics. ``algorithm.use_kl_in_reward`` and
``bypass_mode`` are refused at start for these estimators.

The ground truth of a rollout is ``reward_model.ground_truth`` of verl's dataset row (a string,
a list of strings or Search-R1's ``{"target": [...]}``; the first answer is probed, as IGPO
does). Probe text: ``TURNWISE_VERL_SETTINGS``'s ``"info_gain"`` object (``prefix``, ``suffix``;
IGPO's by default).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from . import IG_ESTIMATORS, _env_settings, record_info_gain
from .info_gain import IGPO_PROBE_PREFIX, IGPO_PROBE_SUFFIX, info_gain, place_info_gain

__all__ = ["IG_ESTIMATORS", "TurnwiseRayPPOTrainer", "check_config", "ground_truth_answer", "main"]


def check_config(config: Any) -> None:
    """Refuses settings under which ``turnwise_igpo``/``turnwise_a2tgpo`` would train without
    their information gain or with KL mixed into it (raises ``ValueError`` naming the key)."""
    est = str(config.algorithm.adv_estimator)
    if est not in IG_ESTIMATORS:
        return
    if bool(config.algorithm.get("use_kl_in_reward", False)):
        raise ValueError(
            f"algorithm.use_kl_in_reward=true with algorithm.adv_estimator={est}: the KL penalty "
            "would be read as information gain; set it false and use actor_rollout_ref.actor.use_kl_loss"
        )
    rc = config.algorithm.get("rollout_correction", None)
    if rc is not None and bool(rc.get("bypass_mode", False)):
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true with algorithm.adv_estimator={est}: "
            "verl then skips _compute_old_log_prob, where the information-gain probes run"
        )


def ground_truth_answer(reward_model: Any) -> Optional[str]:
    """The first ground-truth answer of a verl dataset row's ``reward_model`` field."""
    if not isinstance(reward_model, dict):
        return None
    gt = reward_model.get("ground_truth")
    if isinstance(gt, dict):
        gt = gt.get("target")
    if isinstance(gt, (list, tuple, np.ndarray)):
        gt = gt[0] if len(gt) else None
    return None if gt is None else str(gt)


class TurnwiseRayPPOTrainer(RayPPOTrainer):
    """verl's ``RayPPOTrainer`` plus information-gain turn rewards (see the module docstring)."""

    def _turnwise_ig_enabled(self) -> bool:
        return str(self.config.algorithm.adv_estimator) in IG_ESTIMATORS

    def _compute_old_log_prob(self, batch: Any):  # type: ignore[override]
        out = super()._compute_old_log_prob(batch)
        if self._turnwise_ig_enabled():
            self._turnwise_add_info_gain(batch)
        return out

    def _turnwise_probe_log_prob(self, probes: Any) -> torch.Tensor:
        from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto

        divisor = int(getattr(getattr(self, "actor_rollout_wg", None), "world_size", 1) or 1)
        padded, pad = pad_dataproto_to_divisor(probes, divisor)
        out, _ = RayPPOTrainer._compute_old_log_prob(self, padded)
        return unpad_dataproto(out, pad).batch["old_log_probs"]

    def _turnwise_add_info_gain(self, batch: Any) -> Dict[str, float]:
        if "rm_scores" not in batch.batch.keys():
            raise RuntimeError(
                "turnwise IG: the batch has no `rm_scores` (verl's reward tensor) when its "
                "old_log_probs are computed; this trainer was written against verl "
                "0.9.1's RayPPOTrainer.fit"
            )
        probe = dict(_env_settings().get("info_gain", {}))
        prefix = probe.get("prefix", IGPO_PROBE_PREFIX)
        suffix = probe.get("suffix", IGPO_PROBE_SUFFIX)
        tok = self.tokenizer
        enc = lambda s: tok.encode(s, add_special_tokens=False) if s else []  # noqa: E731
        rms = batch.non_tensor_batch.get("reward_model")
        if rms is None:
            raise RuntimeError("turnwise IG: the batch has no `reward_model` column (the ground truths)")
        answers = [ground_truth_answer(r) for r in rms]
        answer_ids = [enc(a) if a else None for a in answers]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ig, metrics = info_gain(
            batch,
            answer_ids,
            self._turnwise_probe_log_prob,
            prefix_ids=enc(prefix),
            suffix_ids=enc(suffix),
            pad_token_id=int(pad),
        )
        scores = batch.batch["rm_scores"]
        before = scores.detach().clone()
        written = place_info_gain(scores, batch.batch["response_mask"], ig)
        after = scores.detach().clone()
        record_info_gain(after, written)
        ig_sum = (after - before).sum(-1).double()
        metrics = dict(metrics)
        metrics["turnwise/ig/outcome_mean"] = float(before.sum(-1).double().mean())
        metrics["turnwise/ig/sum_mean"] = float(ig_sum.mean())
        self._turnwise_expected = (before, after, written)
        self._turnwise_ig_metrics = metrics
        return metrics

    def _update_actor(self, batch: Any):  # type: ignore[override]
        if not self._turnwise_ig_enabled():
            return super()._update_actor(batch)
        expected = getattr(self, "_turnwise_expected", None)
        if expected is None:
            raise RuntimeError(
                f"turnwise IG: {self.config.algorithm.adv_estimator} expected this step's information "
                "gain, but no probes ran (verl skipped _compute_old_log_prob: is "
                "algorithm.rollout_correction.bypass_mode set?)"
            )
        before, after, written = expected
        got = batch.batch["token_level_scores"]
        for i, pos in written:
            if not torch.isclose(got[i, pos], after[i, pos].to(got.dtype)):
                raise RuntimeError(
                    f"turnwise IG: the rewards verl trained on lost the information gain "
                    f"(response {i}, token {pos}: {float(got[i, pos])} != {float(after[i, pos])}); "
                    "this trainer was written against verl 0.9.1's RayPPOTrainer.fit"
                )
        self._turnwise_expected = None
        out = super()._update_actor(batch)
        # verl's critic/score and critic/rewards metrics (and rollout dumps) show the task
        # reward: take the IG back out of the score tensors, now that the update used it.
        seen = set()
        for key in ("token_level_scores", "token_level_rewards", "rm_scores"):
            if key not in batch.batch.keys():
                continue
            t = batch.batch[key]
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            for i, pos in written:
                t[i, pos] -= (after[i, pos] - before[i, pos]).to(t.dtype)
        meta = getattr(out, "meta_info", None)
        if isinstance(meta, dict) and isinstance(meta.get("metrics"), dict):
            for k, v in getattr(self, "_turnwise_ig_metrics", {}).items():
                meta["metrics"][k] = [v]
        return out


def main() -> None:
    """``python -m turnwise.verl.trainer`` + verl's hydra overrides: verl's ``main_ppo`` with
    :class:`TurnwiseRayPPOTrainer` (the legacy ``trainer.use_v1=false`` trainer)."""
    import hydra
    import ray
    from verl.trainer import main_ppo, main_ppo_v0

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")

    @ray.remote
    class TurnwiseTaskRunner(main_ppo_v0.TaskRunner.__ray_actor_class__):  # type: ignore[name-defined,misc]
        def run(self, config: Any) -> None:
            # This Ray actor's process builds turnwise's trainer where verl builds its own.
            main_ppo_v0.RayPPOTrainer = TurnwiseRayPPOTrainer
            super().run(config)

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def _main(config: Any) -> None:
        from verl.trainer.main_ppo import auto_set_device, need_critic, need_reference_policy, validate_config

        if config.trainer.use_v1 and str(config.algorithm.adv_estimator) in IG_ESTIMATORS:
            raise SystemExit(
                f"{config.algorithm.adv_estimator} needs trainer.use_v1=false: its information-gain "
                "probes run inside verl's RayPPOTrainer"
            )
        try:
            check_config(config)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        auto_set_device(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        main_ppo.run_ppo(config, task_runner_class=TurnwiseTaskRunner)

    _main()


if __name__ == "__main__":
    main()
