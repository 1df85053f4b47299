"""Information-gain turn rewards through verl's own log-prob path: TurnwiseRayPPOTrainer's
probes go through verl 0.9.1's ``RayPPOTrainer._compute_old_log_prob`` (DataProto → padding-free
TensorDict → the actor worker group's ``compute_log_prob`` → back), with the worker group
replaced by an in-process tiny Llama, and the IG they produce is compared with a direct
computation on the same model. Then verl's compute_advantage with ``turnwise_a2tgpo`` runs on
the rewards the trainer wrote.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("TURNWISE_VERL_REQUIRED") != "1":
    pytest.importorskip("verl")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import turnwise  # noqa: E402
from turnwise.verl import info_gain as ig_mod  # noqa: E402
from turnwise.verl.trainer import TurnwiseRayPPOTrainer, ground_truth_answer  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

VOCAB = 48
PAD = 0


class CharTokenizer:
    """A deterministic stand-in for the policy's tokenizer (one id per character)."""

    pad_token_id = PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        return [5 + (ord(c) % (VOCAB - 5)) for c in text]


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.6,  # peaked enough that the answer's probability moves with the context
    )
    return LlamaForCausalLM(cfg).double().eval()


def token_log_probs(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """log p(ids[j+1] | ids[:j+1]) at j (0 at the last position), as verl's actor returns."""
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
    lp = torch.log_softmax(logits, dim=-1)
    out = torch.zeros(ids.shape[0], dtype=torch.float64)
    out[:-1] = lp[:-1].gather(1, ids[1:, None])[:, 0]
    return out


class WorkerGroup:
    """verl's actor worker group, in process: ``compute_log_prob`` takes verl's padding-free
    TensorDict (nested ``input_ids``/``position_ids``) and returns nested ``log_probs`` and
    ``entropy`` plus ``metrics``, as verl's engine workers do."""

    def __init__(self, model, world_size: int = 2):
        self.model, self.world_size, self.calls, self.rows = model, world_size, 0, []

    def compute_log_prob(self, td):
        ids, pos = td["input_ids"], td["position_ids"]
        assert len(ids) % self.world_size == 0, "verl dispatches equal shards to the ranks"
        lps, ents = [], []
        for row_ids, row_pos in zip(ids.unbind(), pos.unbind()):
            lp = token_log_probs(self.model, row_ids, row_pos)
            lps.append(lp)
            ents.append(torch.zeros_like(lp))
        self.calls += 1
        self.rows.append(len(lps))
        return tu.get_tensordict(
            {
                "log_probs": torch.nested.as_nested_tensor(lps, layout=torch.jagged),
                "entropy": torch.nested.as_nested_tensor(ents, layout=torch.jagged),
            },
            non_tensor_dict={"metrics": {"mfu": 0.0}},
        )


class Rollouts:
    """A multi-turn verl batch: left-padded prompts, responses of agent turns separated by
    observation tokens (response_mask 0), an outcome score on the last response token."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.b, self.p, self.r = 6, 6, 18
        self.turns = [3, 2, 1, 3, 2, 2]
        self.answers = ["paris", "rome", "oslo", None, "bern", "lima"]
        self.outcome = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
        prompts = torch.full((self.b, self.p), PAD)
        responses = torch.full((self.b, self.r), PAD)
        attn = torch.zeros((self.b, self.p + self.r), dtype=torch.long)
        rmask = torch.zeros((self.b, self.r), dtype=torch.long)
        self.turn_id = np.full((self.b, self.r), -1)
        self.starts, self.ends, self.lengths = [], [], []
        for i in range(self.b):
            n_prompt = int(rng.integers(3, self.p + 1))
            prompts[i, self.p - n_prompt :] = torch.tensor(rng.integers(5, VOCAB, size=n_prompt))
            attn[i, self.p - n_prompt : self.p] = 1
            pos, starts, ends = 0, [], []
            for t in range(self.turns[i]):
                n = int(rng.integers(2, 4))
                rmask[i, pos : pos + n] = 1
                self.turn_id[i, pos : pos + n] = t
                starts.append(pos)
                pos += n
                ends.append(pos - 1)
                if t < self.turns[i] - 1:
                    pos += int(rng.integers(1, 4))
            responses[i, :pos] = torch.tensor(rng.integers(5, VOCAB, size=pos))
            attn[i, self.p : self.p + pos] = 1
            self.starts.append(starts)
            self.ends.append(ends)
            self.lengths.append(pos)
        scores = torch.zeros((self.b, self.r))
        for i in range(self.b):
            scores[i, self.lengths[i] - 1] = self.outcome[i]
        self.prompts, self.responses, self.attn, self.rmask, self.scores = prompts, responses, attn, rmask, scores

    def data(self) -> DataProto:
        position = torch.clamp(torch.cumsum(self.attn, dim=1) - 1, min=0)
        gt = [{"style": "rule", "ground_truth": {"target": [a]}} if a else {"style": "rule"} for a in self.answers]
        return DataProto.from_dict(
            tensors={
                "prompts": self.prompts,
                "responses": self.responses,
                "input_ids": torch.cat([self.prompts, self.responses], dim=1),
                "attention_mask": self.attn,
                "position_ids": position,
                "response_mask": self.rmask,
                "rm_scores": self.scores.clone(),
            },
            non_tensors={
                "uid": np.array(["a", "a", "b", "b", "b", "a"], dtype=object),
                "reward_model": np.array(gt, dtype=object),
            },
        )


def direct_info_gain(model, ro: Rollouts, tok: CharTokenizer) -> list:
    """IGPO's definition on the same model, one forward pass per probe."""
    pre = tok.encode(ig_mod.IGPO_PROBE_PREFIX)
    suf = tok.encode(ig_mod.IGPO_PROBE_SUFFIX)
    out = []
    for i in range(ro.b):
        if ro.answers[i] is None or ro.turns[i] < 2:
            out.append([0.0] * max(ro.turns[i] - 1, 0))
            continue
        ans = tok.encode(ro.answers[i])
        prompt = ro.prompts[i][ro.attn[i, : ro.p].bool()].tolist()
        p = []
        for t in range(ro.turns[i]):
            ctx = prompt + ro.responses[i, : ro.starts[i][t]].tolist()
            seq = torch.tensor(ctx + pre + ans + suf)
            lp = token_log_probs(model, seq, torch.arange(len(seq)))
            lo = len(ctx) + len(pre)
            p.append(float(torch.exp(lp[lo - 1 : lo - 1 + len(ans)].mean())))
        out.append([p[t + 1] - p[t] for t in range(ro.turns[i] - 1)])
    return out


def trainer(model, estimator: str = "turnwise_a2tgpo") -> TurnwiseRayPPOTrainer:
    tr = object.__new__(TurnwiseRayPPOTrainer)
    tr.config = OmegaConf.create(
        {"algorithm": {"adv_estimator": estimator}, "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": False}}}
    )
    tr.actor_rollout_wg = WorkerGroup(model)
    tr.tokenizer = CharTokenizer()
    return tr


def test_ground_truth_answer_forms():
    assert ground_truth_answer({"ground_truth": {"target": ["a", "b"]}}) == "a"
    assert ground_truth_answer({"ground_truth": ["x"]}) == "x"
    assert ground_truth_answer({"ground_truth": "y"}) == "y"
    assert ground_truth_answer({"style": "rule"}) is None
    assert ground_truth_answer(None) is None


def test_probes_through_verls_log_prob_path_equal_direct_info_gain():
    model = tiny_model()
    ro = Rollouts()
    tr = trainer(model)
    batch = ro.data()
    old, _ = tr._compute_old_log_prob(batch)
    # verl's own old_log_probs of the batch, through the same stub: the path is verl's.
    for i in range(ro.b):
        seq = batch.batch["input_ids"][i][ro.attn[i].bool()]
        lp = token_log_probs(model, seq, torch.arange(len(seq)))
        n_p = int(ro.attn[i, : ro.p].sum())
        want = lp[n_p - 1 : n_p - 1 + ro.lengths[i]]
        assert float((old.batch["old_log_probs"][i, : ro.lengths[i]].double() - want).abs().max()) < 1e-5
    # One call for the batch, one for every probe (padded to the 2 ranks).
    n_probes = sum(t for t, a in zip(ro.turns, ro.answers) if a and t >= 2)
    assert tr.actor_rollout_wg.calls == 2
    assert tr.actor_rollout_wg.rows[1] == n_probes + n_probes % 2
    want = direct_info_gain(model, ro, tr.tokenizer)
    scores = batch.batch["rm_scores"]
    for i in range(ro.b):
        for t in range(ro.turns[i] - 1):
            got = float(scores[i, ro.ends[i][t]])
            assert abs(got - want[i][t]) < 1e-6, (i, t, got, want[i][t])
        assert float(scores[i, ro.lengths[i] - 1]) == ro.outcome[i]
    assert max(abs(x) for row in want for x in row) > 1e-3  # a real signal, not zeros
    assert tr._turnwise_ig_metrics["turnwise/ig/probes"] == n_probes
    assert tr._turnwise_ig_metrics["turnwise/ig/rollouts_without_answer"] == 1

    # verl's compute_advantage on the rewards the trainer wrote = A2TGPO on the direct IG.
    data = DataProto.from_dict(
        tensors={"token_level_rewards": scores.clone(), "response_mask": ro.rmask},
        non_tensors={"uid": batch.non_tensor_batch["uid"]},
    )
    adv = compute_advantage(data, "turnwise_a2tgpo", config=AlgoConfig()).batch["advantages"]
    group = np.array([0, 0, 1, 1, 1, 0])
    ig = [row if row else [0.0] for row in want]
    ref = np.asarray(turnwise.estimate("a2tgpo", ro.outcome, group, ro.turn_id, info_gain=ig).tokens)
    m = ro.rmask.bool().numpy()
    assert np.abs(adv.double().numpy()[m] - ref[m]).max() < 1e-4


def test_other_estimators_send_no_probes():
    model = tiny_model()
    tr = trainer(model, estimator="turnwise_grpo")
    batch = Rollouts().data()
    before = batch.batch["rm_scores"].clone()
    tr._compute_old_log_prob(batch)
    assert tr.actor_rollout_wg.calls == 1
    assert torch.equal(batch.batch["rm_scores"], before)


def test_update_actor_refuses_rewards_without_the_information_gain(monkeypatch):
    model = tiny_model()
    tr = trainer(model)
    batch = Rollouts().data()
    original = batch.batch["rm_scores"].clone()
    tr._compute_old_log_prob(batch)
    updated = []
    monkeypatch.setattr(RayPPOTrainer, "_update_actor", lambda self, b: updated.append(b) or "ok")
    batch.batch["token_level_scores"] = original
    with pytest.raises(RuntimeError, match="lost the information gain"):
        tr._update_actor(batch)
    assert not updated
    batch.batch["token_level_scores"] = batch.batch["rm_scores"]
    assert tr._update_actor(batch) == "ok"
    assert len(updated) == 1


def test_probe_errors_name_the_problem():
    ro = Rollouts()
    with pytest.raises(ValueError, match="answer_ids has 2 entries for a batch of 6"):
        ig_mod.build_probes(ro.data(), [[1], [2]], [3], [4], PAD)
    with pytest.raises(ValueError, match="compute_log_prob returned"):
        ig_mod.info_gain(
            ro.data(), [[7, 8]] * ro.b, lambda probes: torch.zeros(1, 8), prefix_ids=[3], suffix_ids=[4], pad_token_id=PAD
        )
    with pytest.raises(ValueError, match="not finite"):
        ig_mod.info_gain(
            ro.data(), [[7, 8]] * ro.b, lambda probes: torch.full((len(probes), 8), float("nan")),
            prefix_ids=[3], suffix_ids=[4], pad_token_id=PAD,
        )


def stock_trainer(model) -> RayPPOTrainer:
    tr = object.__new__(RayPPOTrainer)
    tr.config = OmegaConf.create(
        {"algorithm": {"adv_estimator": "turnwise_a2tgpo"}, "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": False}}}
    )
    tr.actor_rollout_wg = WorkerGroup(model)
    tr.tokenizer = CharTokenizer()
    return tr


@pytest.mark.parametrize("estimator", ["turnwise_a2tgpo", "turnwise_igpo"])
def test_stock_verl_trainer_flow_refuses_ig_estimators(estimator):
    """verl's own RayPPOTrainer (main_ppo's) computes no information gain: its old-log-prob step
    runs, then compute_advantage with turnwise_a2tgpo/_igpo refuses, naming the trainer to use,
    where it used to train A2TGPO with IG = 0 and c = 1 (issue 49 item 4, review E V2)."""
    from turnwise import verl as tv

    tv._IG_RECORD.clear()
    model = tiny_model()
    batch = Rollouts().data()
    stock_trainer(model)._compute_old_log_prob(batch)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": batch.batch["rm_scores"].clone(), "response_mask": batch.batch["response_mask"]},
        non_tensors={"uid": batch.non_tensor_batch["uid"]},
    )
    with pytest.raises(ValueError, match=r"turnwise\.verl\.trainer"):
        compute_advantage(data, estimator, config=AlgoConfig())
    # turnwise's trainer on the same batch: IG recorded, the estimator runs, IG is non-zero.
    tr = trainer(model, estimator)
    batch = Rollouts().data()
    tr._compute_old_log_prob(batch)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": batch.batch["rm_scores"].clone(), "response_mask": batch.batch["response_mask"]},
        non_tensors={"uid": batch.non_tensor_batch["uid"]},
    )
    compute_advantage(data, estimator, config=AlgoConfig())
    assert tr._turnwise_ig_metrics["turnwise/ig/abs_mean"] > 1e-3


def test_update_actor_refuses_a_step_without_probes(monkeypatch):
    """bypass_mode skips _compute_old_log_prob and with it the probes: the update stops instead
    of training with IG = 0, and the config check names the key at start."""
    from turnwise.verl.trainer import check_config

    tr = trainer(tiny_model())
    batch = Rollouts().data()
    batch.batch["token_level_scores"] = batch.batch["rm_scores"]
    monkeypatch.setattr(RayPPOTrainer, "_update_actor", lambda self, b: "ok")
    with pytest.raises(RuntimeError, match="bypass_mode"):
        tr._update_actor(batch)
    cfg = OmegaConf.create(
        {"algorithm": {"adv_estimator": "turnwise_a2tgpo", "use_kl_in_reward": False,
                       "rollout_correction": {"bypass_mode": True}}}
    )
    with pytest.raises(ValueError, match=r"algorithm\.rollout_correction\.bypass_mode"):
        check_config(cfg)
    cfg.algorithm.rollout_correction.bypass_mode = False
    check_config(cfg)
    cfg.algorithm.use_kl_in_reward = True
    with pytest.raises(ValueError, match=r"algorithm\.use_kl_in_reward"):
        check_config(cfg)
    cfg.algorithm.adv_estimator = "turnwise_grpo"
    check_config(cfg)


def test_score_metrics_show_the_task_reward_after_the_update(monkeypatch):
    """The IG trains (the update sees it) and then leaves verl's score tensors, so verl's
    critic/score and critic/rewards metrics are the task reward; the IG and outcome are logged
    as turnwise/ig/* in the actor's metrics (review E V7)."""
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    tr = trainer(tiny_model())
    ro = Rollouts()
    batch = ro.data()
    tr._compute_old_log_prob(batch)
    batch.batch["token_level_scores"] = batch.batch["rm_scores"]
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    seen = []

    def update(self, b):
        seen.append(b.batch["token_level_rewards"].clone())
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [0.0]}})

    monkeypatch.setattr(RayPPOTrainer, "_update_actor", update)
    out = tr._update_actor(batch)
    outcome = torch.tensor(ro.outcome, dtype=torch.float32)
    assert float((seen[0].sum(-1) - outcome).abs().max()) > 1e-3  # the update trained on IG
    assert torch.equal(batch.batch["token_level_scores"].sum(-1), outcome)
    assert torch.equal(batch.batch["token_level_rewards"].sum(-1), outcome)
    m = out.meta_info["metrics"]
    assert m["turnwise/ig/outcome_mean"] == [pytest.approx(float(ro.outcome.mean()))]
    assert abs(m["turnwise/ig/sum_mean"][0]) > 1e-4
    batch.batch["advantages"] = torch.zeros_like(batch.batch["rm_scores"])
    batch.batch["returns"] = torch.zeros_like(batch.batch["rm_scores"])
    dm = compute_data_metrics(batch=batch, use_critic=False)
    assert dm["critic/score/mean"] == pytest.approx(float(ro.outcome.mean()))
