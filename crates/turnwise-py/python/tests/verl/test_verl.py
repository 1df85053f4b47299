"""turnwise inside verl's own registries, on verl's own batches (the released ``verl`` package;
scripts/verl-check.sh installs ``verl==0.9.1`` in its own virtual env).

Skipped where verl is not installed, unless TURNWISE_VERL_REQUIRED=1 (scripts/verl-check.sh
sets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

if os.environ.get("TURNWISE_VERL_REQUIRED") != "1":
    pytest.importorskip("verl")

import torch  # noqa: E402

import turnwise  # noqa: E402
import turnwise.verl as tv  # noqa: E402
from turnwise import losses as L  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

F64 = torch.float64


# ----------------------------------------------------------------------------- a batch


class Batch:
    """A multi-turn verl batch built from known parts: per row a list of agent turns, each
    (model tokens, observation tokens after it); the final turn has no observation."""

    def __init__(self, seed: int = 0, b: int = 8, groups: int = 2, width: int = 16):
        rng = np.random.default_rng(seed)
        self.b, self.width = b, width
        self.uid = np.array([f"q{i % groups}" for i in range(b)], dtype=object)
        self.mask = np.zeros((b, width), dtype=np.int64)
        self.turn_id = np.full((b, width), -1, dtype=np.int64)
        self.num_turns = rng.integers(1, 4, size=b)
        self.num_turns[0], self.num_turns[1] = 3, 1  # every shape at least once
        self.outcome = rng.integers(0, 2, size=b).astype(np.float64)
        self.info_gain = [rng.uniform(-0.3, 0.5, size=n - 1) for n in self.num_turns]
        self.turn_rewards = [rng.uniform(0.0, 1.0, size=n) for n in self.num_turns]
        self.last_tokens: list = []
        for i in range(b):
            pos, ends = 0, []
            for t in range(int(self.num_turns[i])):
                n_model = int(rng.integers(2, 4))
                self.mask[i, pos : pos + n_model] = 1
                self.turn_id[i, pos : pos + n_model] = t
                pos += n_model
                ends.append(pos - 1)
                if t < self.num_turns[i] - 1:
                    pos += int(rng.integers(1, 3))
            self.last_tokens.append(ends)

    def rewards(self, kind: str) -> torch.Tensor:
        """verl's ``token_level_rewards`` for an estimator family: outcome only; information
        gain + outcome; or one reward per turn (the final one included)."""
        r = np.zeros((self.b, self.width))
        for i, ends in enumerate(self.last_tokens):
            if kind == "turn_rewards":
                for t, e in enumerate(ends):
                    r[i, e] = self.turn_rewards[i][t]
                continue
            r[i, ends[-1]] = self.outcome[i]
            if kind == "info_gain":
                for t, e in enumerate(ends[:-1]):
                    r[i, e] = self.info_gain[i][t]
        return torch.tensor(r, dtype=torch.float32)

    def data(self, kind: str, record: bool = True) -> DataProto:
        """verl's batch; with ``kind="info_gain"`` and ``record``, also records the IG as
        TurnwiseRayPPOTrainer does after its probes (the IG estimators refuse rewards without)."""
        rewards = self.rewards(kind)
        if kind == "info_gain" and record:
            tv.record_info_gain(rewards, [(i, e) for i, ends in enumerate(self.last_tokens) for e in ends[:-1]])
        return DataProto.from_dict(
            tensors={
                "token_level_rewards": rewards,
                "response_mask": torch.tensor(self.mask, dtype=torch.int64),
            },
            non_tensors={"uid": self.uid.copy()},
        )

    def group(self) -> np.ndarray:
        ids: dict = {}
        return np.array([ids.setdefault(u, len(ids)) for u in self.uid])


ESTIMATOR_CASES = [
    ("turnwise_grpo", "outcome"),
    ("turnwise_dr_grpo", "outcome"),
    ("turnwise_rloo", "outcome"),
    ("turnwise_mt_grpo", "turn_rewards"),
    ("turnwise_igpo", "info_gain"),
    ("turnwise_a2tgpo", "info_gain"),
]


def direct(name: str, bt: Batch):
    """The same estimator called directly on the construction's inputs (not on verl's
    token rewards): explicit turn ids, outcomes, per-turn values."""
    g = bt.group()
    if name in ("grpo", "dr_grpo", "rloo"):
        return turnwise.estimate(name, bt.outcome, g, bt.turn_id)
    if name == "mt_grpo":
        return turnwise.estimate(name, np.zeros(bt.b), g, bt.turn_id, turn_rewards=[list(x) for x in bt.turn_rewards])
    ig = [list(x) if len(x) else [0.0] for x in bt.info_gain]
    return turnwise.estimate(name, bt.outcome, g, bt.turn_id, info_gain=ig)


# ----------------------------------------------------------------------------- registries


def test_import_verl_alone_registers_turnwise():
    """verl loads the wheel's `verl.plugins` entry point on `import verl`: a fresh process that
    never imports turnwise finds every name in verl's registries."""
    code = (
        "import json, verl\n"
        "from verl.trainer.ppo import core_algos as c\n"
        "print(json.dumps([sorted(k for k in c.ADV_ESTIMATOR_REGISTRY if k.startswith('turnwise')),"
        " sorted(k for k in c.POLICY_LOSS_REGISTRY if k.startswith('turnwise'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    est, losses = json.loads(out.stdout.strip().splitlines()[-1])
    assert est == sorted(tv.ADVANTAGE_ESTIMATORS)
    assert losses == sorted(tv.POLICY_LOSSES)
    assert core_algos.get_adv_estimator_fn("turnwise_a2tgpo") is not None
    assert core_algos.get_policy_loss_fn("turnwise_st_ppo") is not None


def test_register_is_idempotent():
    first = tv.register()
    assert tv.register() == first
    assert set(first) == set(tv.ADVANTAGE_ESTIMATORS) | set(tv.POLICY_LOSSES)


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("verl_name,kind", ESTIMATOR_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compute_advantage_returns_turnwise_values(verl_name, kind, seed):
    """verl's own compute_advantage on a DataProto with `algorithm.adv_estimator = verl_name`
    returns, on every model token, what turnwise's estimator gives on the batch's parts."""
    bt = Batch(seed)
    out = compute_advantage(bt.data(kind), adv_estimator=verl_name, config=AlgoConfig(adv_estimator=verl_name))
    adv = out.batch["advantages"].double().numpy()
    want = np.asarray(direct(tv.ADVANTAGE_ESTIMATORS[verl_name], bt).tokens)
    m = bt.mask.astype(bool)
    assert np.abs(adv[m] - want[m]).max() < 1e-6
    assert torch.equal(out.batch["returns"], out.batch["advantages"])
    if verl_name != "turnwise_a2tgpo":
        assert np.all(adv[~m] == 0.0)


def test_a2tgpo_clip_scale_rides_on_observation_tokens():
    bt = Batch(3)
    out = compute_advantage(bt.data("info_gain"), adv_estimator="turnwise_a2tgpo", config=AlgoConfig())
    d = direct("a2tgpo", bt)
    cs = np.asarray(d.clip_scale)
    adv = out.batch["advantages"]
    for i, ends in enumerate(bt.last_tokens):
        for t, e in enumerate(ends[:-1]):
            assert bt.mask[i, e + 1] == 0
            # tagged: CLIP_SCALE_TAG + c, in verl's float32 (half an ulp at 256 is 1.5e-5)
            assert abs(float(adv[i, e + 1]) - tv.CLIP_SCALE_TAG - cs[i, t]) < 1.6e-5
    back = tv.clip_scale_from_advantages(adv, torch.tensor(bt.mask)).numpy()
    want = np.asarray(turnwise.turn_values_to_tokens(bt.turn_id, cs, fill=1.0))
    m = bt.mask.astype(bool)
    assert np.abs(back[m] - want[m]).max() < 1.6e-5
    assert np.ptp(cs[cs != 1.0]) > 0  # the scales differ between turns


def test_turnwise_grpo_equals_verls_grpo():
    """An independent reference: verl's built-in grpo (and its norm_adv_by_std_in_grpo=False
    form) equals turnwise_grpo on the same DataProto."""
    for norm in (True, False):
        bt = Batch(4)
        ours = compute_advantage(
            bt.data("outcome"), "turnwise_grpo", norm_adv_by_std_in_grpo=norm,
            config=AlgoConfig(norm_adv_by_std_in_grpo=norm),
        )
        theirs = compute_advantage(
            bt.data("outcome"), "grpo", norm_adv_by_std_in_grpo=norm, config=AlgoConfig(norm_adv_by_std_in_grpo=norm)
        )
        m = torch.tensor(bt.mask, dtype=torch.bool)
        diff = (ours.batch["advantages"] - theirs.batch["advantages"])[m].abs().max()
        assert float(diff) < 1e-5, (norm, float(diff))


def test_gamma_comes_from_verls_algorithm_config():
    bt = Batch(5)
    a = compute_advantage(bt.data("info_gain"), "turnwise_igpo", config=AlgoConfig(gamma=1.0)).batch["advantages"]
    b = compute_advantage(bt.data("info_gain"), "turnwise_igpo", config=AlgoConfig(gamma=0.5)).batch["advantages"]
    want = turnwise.estimate(
        "igpo", bt.outcome, bt.group(), bt.turn_id, info_gain=[list(x) if len(x) else [0.0] for x in bt.info_gain], gamma=0.5
    ).tokens
    m = bt.mask.astype(bool)
    assert np.abs(b.double().numpy()[m] - np.asarray(want)[m]).max() < 1e-6
    assert float((a - b).abs().max()) > 1e-3


def test_settings_from_the_environment(monkeypatch):
    bt = Batch(6)
    base = compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig()).batch["advantages"]
    monkeypatch.setenv(tv.SETTINGS_ENV, json.dumps({"turnwise_a2tgpo": {"variance_rescaling": False}}))
    off = compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig()).batch["advantages"]
    want = turnwise.estimate(
        "a2tgpo", bt.outcome, bt.group(), bt.turn_id,
        info_gain=[list(x) if len(x) else [0.0] for x in bt.info_gain], variance_rescaling=False,
    ).tokens
    m = bt.mask.astype(bool)
    assert np.abs(off.double().numpy()[m] - np.asarray(want)[m]).max() < 1e-6
    assert float((base - off).abs().max()) > 1e-4
    monkeypatch.setenv(tv.SETTINGS_ENV, json.dumps({"turnwise_a2tgpo": {"no_such_setting": 1}}))
    with pytest.raises(ValueError, match="no_such_setting"):
        compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig())
    monkeypatch.setenv(tv.SETTINGS_ENV, "{not json")
    with pytest.raises(ValueError, match=tv.SETTINGS_ENV):
        compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig())


def test_estimator_errors_name_the_problem():
    bt = Batch(7)
    data = bt.data("outcome")
    del data.non_tensor_batch["uid"]
    with pytest.raises(ValueError, match="uid"):
        compute_advantage(data, "turnwise_grpo", config=AlgoConfig())
    data = bt.data("outcome")
    data.batch["response_mask"][2] = 0
    with pytest.raises(ValueError, match="response 2 has no model token"):
        compute_advantage(data, "turnwise_grpo", config=AlgoConfig())
    data = bt.data("outcome")
    data.batch["token_level_rewards"][1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"token_level_rewards\[1, 0\]"):
        compute_advantage(data, "turnwise_grpo", config=AlgoConfig())


# ----------------------------------------------------------------------------- losses


def actor_config(**kw) -> FSDPActorConfig:
    base = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    base.update(kw)
    return FSDPActorConfig(**base)


def loss_inputs(bt: Batch, seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    shape = (bt.b, bt.width)
    old = -torch.rand(shape, generator=g, dtype=F64) * 2 - 0.1
    logp = (old + spread * torch.randn(shape, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(shape, generator=g, dtype=F64)
    return old, logp, adv, torch.tensor(bt.mask, dtype=torch.bool)


LOSS_CASES = [
    ("turnwise_turn", "turn", dict(clip_ratio=0.2), "seq-mean-token-mean"),
    ("turnwise_st_ppo", "st_ppo", dict(clip_ratio=0.2), "token-mean"),
    ("turnwise_s_ppo", "s_ppo", dict(clip_ratio_low=0.2, clip_ratio_high=0.28), "token-mean"),
    ("turnwise_s_grpo", "s_grpo", dict(clip_ratio=0.2), "seq-mean-token-mean"),
    ("turnwise_gspo_turn", "gspo_turn", dict(clip_ratio_low=3e-3, clip_ratio_high=4e-3), "seq-mean-token-mean"),
]


@pytest.mark.parametrize("verl_name,kind,clip,agg", LOSS_CASES)
def test_policy_loss_lookup_returns_turnwise_loss_and_gradient(verl_name, kind, clip, agg):
    """verl's get_policy_loss_fn(name) with verl's call signature and ActorConfig gives
    turnwise's loss and gradient, with the clip ratios taken from the config."""
    bt = Batch(8)
    old, logp, adv, mask = loss_inputs(bt, 1)
    cfg = actor_config(**clip)
    fn = core_algos.get_policy_loss_fn(verl_name)
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg)
    (g,) = torch.autograd.grad(loss, logp)
    lp2 = logp.detach().clone().requires_grad_(True)
    want = L.policy_loss(
        lp2, old, adv, mask.double(), policy_loss=kind, loss_agg_mode=agg,
        clip_ratio=clip.get("clip_ratio"), clip_ratio_low=clip.get("clip_ratio_low"),
        clip_ratio_high=clip.get("clip_ratio_high"), clip_ratio_c=3.0,
    )
    (g2,) = torch.autograd.grad(want.loss, lp2)
    assert abs(float(loss.detach()) - float(want.loss.detach())) < 1e-12
    assert float((g - g2).abs().max()) < 1e-12
    assert metrics["actor/pg_clipfrac"] == want.metrics["actor/pg_clipfrac"]
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("verl_name,kind,clip,agg", LOSS_CASES)
def test_micro_batches_sum_to_the_mini_batch_loss(verl_name, kind, clip, agg):
    """With verl's global_batch_info (tokens and sequences of the mini-batch), the losses of
    two micro-batches add up to the mini-batch's loss, as verl's own losses do."""
    bt = Batch(9)
    old, logp, adv, mask = loss_inputs(bt, 2)
    fn = core_algos.get_policy_loss_fn(verl_name)
    whole, _ = fn(old, logp, adv, mask, agg, actor_config(**clip))
    cfg = actor_config(**clip)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=bt.b)
    half = bt.b // 2
    parts = [fn(old[s], logp[s], adv[s], mask[s], agg, cfg)[0] for s in (slice(0, half), slice(half, None))]
    assert abs(float(parts[0] + parts[1]) - float(whole)) < 1e-10
    cfg.global_batch_info.update(dp_size=2)
    per_rank = [fn(old[s], logp[s], adv[s], mask[s], agg, cfg)[0] for s in (slice(0, half), slice(half, None))]
    # data-parallel ranks average their gradients: the mean of the rank losses is the loss
    assert abs(float(per_rank[0] + per_rank[1]) / 2 - float(whole)) < 1e-10


def test_gspo_turn_on_single_turn_rows_equals_verls_gspo():
    """An independent reference: with one turn per row, turn-GSPO is sequence-level GSPO, and
    verl's own `gspo` loss gives the same loss and gradient."""
    bt = Batch(10)
    mask = torch.zeros(bt.b, bt.width, dtype=torch.bool)
    for i in range(bt.b):
        mask[i, : 3 + i % 5] = True
    old, logp, adv, _ = loss_inputs(bt, 3, spread=0.03)
    # one advantage per sequence, as GRPO gives; on even rows its sign follows the sequence's
    # log-ratio, so that the clip binds there
    seq_logr = ((logp.detach() - old) * mask).sum(1) / mask.sum(1)
    a = adv[:, 0].abs() * torch.where(torch.arange(bt.b) % 2 == 0, seq_logr.sign(), -seq_logr.sign())
    adv = a[:, None].expand_as(adv).clone()
    cfg = actor_config(clip_ratio_low=3e-3, clip_ratio_high=4e-3, loss_agg_mode="seq-mean-token-mean")
    ours, m1 = core_algos.get_policy_loss_fn("turnwise_gspo_turn")(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    (g1,) = torch.autograd.grad(ours, logp)
    theirs, m2 = core_algos.get_policy_loss_fn("gspo")(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    (g2,) = torch.autograd.grad(theirs, logp)
    # (turnwise's token means divide by n + 1e-8 where verl's sequence ratio divides by n)
    assert abs(float(ours) - float(theirs)) < 1e-7
    assert float((g1 - g2).abs().max()) < 1e-7
    assert m1["actor/pg_clipfrac"] > 0  # the clip binds on some rows


def test_s_ppo_without_clipped_tokens_equals_verls_vanilla():
    """Nothing clipped: the correction weighs every sample 1 and S-PPO is verl's vanilla PPO."""
    bt = Batch(11)
    old, logp, adv, mask = loss_inputs(bt, 4, spread=1e-4)
    cfg = actor_config(clip_ratio=0.2)
    ours, m = core_algos.get_policy_loss_fn("turnwise_s_ppo")(old, logp, adv, mask, "token-mean", cfg)
    (g1,) = torch.autograd.grad(ours, logp)
    theirs, _ = core_algos.get_policy_loss_fn("vanilla")(old, logp, adv, mask, "token-mean", cfg)
    (g2,) = torch.autograd.grad(theirs, logp)
    assert m["actor/clip_bias_num_clipped"] == 0
    assert abs(float(ours) - float(theirs)) < 1e-12
    assert float((g1 - g2).abs().max()) < 1e-12


def test_clip_bias_downweights_the_clipped_samples_in_verl():
    """With clipped tokens, turnwise_st_ppo's gradient differs from turnwise_turn's only by
    down-weighting: each sample's gradient is scaled by 1 − ρ_i ≤ 1, and a sample with
    clipped tokens is scaled below 1."""
    bt = Batch(12)
    old, logp, adv, mask = loss_inputs(bt, 5, spread=0.5)
    cfg = actor_config(clip_ratio=0.2)
    st, m = core_algos.get_policy_loss_fn("turnwise_st_ppo")(old, logp, adv, mask, "token-mean", cfg)
    (g_st,) = torch.autograd.grad(st, logp)
    turn, _ = core_algos.get_policy_loss_fn("turnwise_turn")(old, logp, adv, mask, "token-mean", cfg)
    (g_turn,) = torch.autograd.grad(turn, logp)
    assert m["actor/clip_bias_num_clipped"] > 0
    ratios = []
    for i in range(bt.b):
        n = float(g_turn[i].norm())
        if n > 0:
            ratios.append(float(g_st[i].norm()) / n)
    assert max(ratios) <= 1.0 + 1e-12
    assert min(ratios) < 0.99


def test_a2tgpo_loss_reads_the_clip_scale_from_the_estimator():
    """turnwise_a2tgpo end to end through verl: compute_advantage writes each turn's clip
    scale, the loss reads it and equals turnwise's A2TGPO loss with that scale; advantages
    from another estimator are refused by name."""
    bt = Batch(13)
    out = compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig())
    adv = out.batch["advantages"].double()
    g = torch.Generator().manual_seed(6)
    old = -torch.rand(bt.b, bt.width, generator=g, dtype=F64) - 0.1
    logp = (old + 0.01 * torch.randn(bt.b, bt.width, generator=g, dtype=F64)).requires_grad_(True)
    mask = torch.tensor(bt.mask, dtype=torch.bool)
    cfg = actor_config(clip_ratio_low=3e-3, clip_ratio_high=4e-3)
    loss, m = core_algos.get_policy_loss_fn("turnwise_a2tgpo")(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    (g1,) = torch.autograd.grad(loss, logp)
    # c as it travels: CLIP_SCALE_TAG + c rounded to verl's float32, minus the tag
    exact = np.asarray(direct("a2tgpo", bt).clip_scale)
    carried = np.float32(tv.CLIP_SCALE_TAG + exact).astype(np.float64) - tv.CLIP_SCALE_TAG
    carried[exact == 1.0] = 1.0
    cs = turnwise.turn_values_to_tokens(bt.turn_id, carried, fill=1.0)
    lp2 = logp.detach().clone().requires_grad_(True)
    want = L.policy_loss(
        lp2, old, adv * mask, mask.double(), policy_loss="a2tgpo", clip_scale=torch.tensor(cs),
        clip_ratio_low=3e-3, clip_ratio_high=4e-3, loss_agg_mode="seq-mean-token-mean",
    )
    (g2,) = torch.autograd.grad(want.loss, lp2)
    # (c travels in verl's float32 advantages tensor)
    assert abs(float(loss.detach()) - float(want.loss.detach())) < 1e-9
    assert float((g1 - g2).abs().max()) < 1e-9
    # Constant bounds (c = 1 everywhere) clip differently: the scale reaches the loss.
    flat = L.policy_loss(
        logp.detach(), old, adv * mask, mask.double(), policy_loss="a2tgpo",
        clip_scale=torch.ones(bt.b, bt.width, dtype=F64), clip_ratio_low=3e-3, clip_ratio_high=4e-3,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert m["actor/pg_clipfrac"] > 0
    assert abs(float(flat.loss) - float(loss.detach())) > 1e-6
    other = compute_advantage(bt.data("info_gain"), "turnwise_igpo", config=AlgoConfig()).batch["advantages"]
    with pytest.raises(ValueError, match="algorithm.adv_estimator=turnwise_a2tgpo"):
        core_algos.get_policy_loss_fn("turnwise_a2tgpo")(old, logp, other.double(), mask, "token-mean", cfg)


def test_loss_errors_name_the_problem():
    bt = Batch(14)
    old, logp, adv, mask = loss_inputs(bt, 7)
    fn = core_algos.get_policy_loss_fn("turnwise_st_ppo")
    with pytest.raises(ValueError, match="rollout_correction"):
        fn(old, logp, adv, mask, "token-mean", actor_config(), rollout_is_weights=torch.ones_like(old))
    with pytest.raises(ValueError, match="ActorConfig"):
        fn(old, logp, adv, mask, "token-mean", None)
    bad = old.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="old_logp"):
        fn(bad, logp, adv, mask, "token-mean", actor_config())


# ----------------------------------------------------------------------------- issue 49 item 4


@pytest.mark.parametrize("verl_name", list(tv.IG_ESTIMATORS))
def test_ig_estimators_refuse_rewards_nobody_computed_ig_for(verl_name, monkeypatch):
    """Under verl's stock flow nothing records an information gain: turnwise_igpo/_a2tgpo stop,
    naming the trainer, instead of training with IG = 0 (issue 49, review E V2)."""
    bt = Batch(15)
    tv._IG_RECORD.clear()
    with pytest.raises(ValueError, match="TurnwiseRayPPOTrainer"):
        compute_advantage(bt.data("outcome"), verl_name, config=AlgoConfig())
    # A record is consumed by one advantage computation: the next batch needs its own.
    compute_advantage(bt.data("info_gain"), verl_name, config=AlgoConfig())
    with pytest.raises(ValueError, match="no information gain was computed"):
        compute_advantage(bt.data("info_gain", record=False), verl_name, config=AlgoConfig())
    # Rewards that lost the recorded IG are refused, naming the token.
    data = bt.data("info_gain")
    i, e = 0, bt.last_tokens[0][0]
    data.batch["token_level_rewards"][i, e] = 0.0
    with pytest.raises(ValueError, match=rf"token_level_rewards\[{i}, {e}\]"):
        compute_advantage(data, verl_name, config=AlgoConfig())
    # A reward manager that places IG itself declares it; all-zero process turns are refused.
    monkeypatch.setenv(tv.SETTINGS_ENV, json.dumps({"info_gain": {"placed_by": "reward_manager"}}))
    tv._IG_RECORD.clear()
    got = compute_advantage(bt.data("info_gain", record=False), verl_name, config=AlgoConfig()).batch["advantages"]
    want = np.asarray(direct(tv.ADVANTAGE_ESTIMATORS[verl_name], bt).tokens)
    m = bt.mask.astype(bool)
    assert np.abs(got.double().numpy()[m] - want[m]).max() < 1e-6
    with pytest.raises(ValueError, match="every process turn of the batch has reward exactly 0"):
        compute_advantage(bt.data("outcome"), verl_name, config=AlgoConfig())


@pytest.mark.parametrize("verl_name", list(tv.TURN_REWARD_ESTIMATORS))
def test_kl_in_reward_is_refused_for_turn_reward_estimators(verl_name):
    """algorithm.use_kl_in_reward would put each turn's KL into its IG / turn reward (V3)."""
    bt = Batch(16)
    kind = "turn_rewards" if verl_name == "turnwise_mt_grpo" else "info_gain"
    with pytest.raises(ValueError, match="algorithm.use_kl_in_reward"):
        compute_advantage(bt.data(kind), verl_name, config=AlgoConfig(use_kl_in_reward=True))
    tv._IG_RECORD.clear()
    # Outcome estimators sum the whole row, as verl's grpo does: KL-in-reward stays allowed.
    compute_advantage(bt.data("outcome"), "turnwise_grpo", config=AlgoConfig(use_kl_in_reward=True))


AGG_INFO = {
    "local": {},
    "global dp1": {"dp_size": 1, "batch_num_tokens": 57, "global_batch_size": 11},
    "global dp4": {"dp_size": 4, "batch_num_tokens": 230, "global_batch_size": 40},
    "global dp2 K": {"dp_size": 2, "batch_num_tokens": 120, "global_batch_size": 20, "loss_scale_factor": 64},
}
VERL_AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("info", list(AGG_INFO))
@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_aggregation_equals_verls_agg_loss(mode, info):
    """turnwise's aggregation under the verl convention equals verl 0.9.1's own
    core_algos.agg_loss in value and gradient, for every verl mode, with and without
    global_batch_info (V1: seq-mean-token-sum-norm divides by the sequence count too)."""
    bt = Batch(17)
    g = torch.Generator().manual_seed(8)
    mat = torch.randn(bt.b, bt.width, generator=g, dtype=F64, requires_grad=True)
    mask = torch.tensor(bt.mask, dtype=F64)
    mask[3] = 0.0  # a fully masked row: excluded from the sequence counts
    gi = AGG_INFO[info]
    theirs = core_algos.agg_loss(mat, mask, mode, **gi)
    (g_theirs,) = torch.autograd.grad(theirs, mat)
    # the verl path: verl_policy_loss's denominators are the global ones over dp ranks
    dp = int(gi.get("dp_size", 1))
    den = None if not gi else (gi["batch_num_tokens"] / dp, gi["global_batch_size"] / dp)
    m2 = mat.detach().clone().requires_grad_(True)
    ours = L.agg_loss(
        m2, mask, mode, norm_constant=gi.get("loss_scale_factor"), denominators=den, agg_convention="verl", dp_size=dp
    )
    (g_ours,) = torch.autograd.grad(ours, m2)
    assert abs(float(ours) - float(theirs)) < 1e-12 * max(1.0, abs(float(theirs)))
    assert float((g_ours - g_theirs).abs().max()) < 1e-12


@pytest.mark.parametrize("info", list(AGG_INFO))
@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_turnwise_loss_in_verl_equals_verls_vanilla_in_every_mode(mode, info):
    """End to end through verl's registry: with nothing clipped, turnwise_s_ppo is verl's
    vanilla PPO, and its loss and gradient equal verl's in every aggregation mode and with
    verl's global_batch_info (the global denominators, dp_size, loss_scale_factor)."""
    bt = Batch(18)
    old, logp, adv, mask = loss_inputs(bt, 9, spread=1e-4)
    cfg = actor_config(clip_ratio=0.2)
    cfg.global_batch_info.update(AGG_INFO[info])
    ours, m = core_algos.get_policy_loss_fn("turnwise_s_ppo")(old, logp, adv, mask, mode, cfg)
    (g1,) = torch.autograd.grad(ours, logp)
    theirs, _ = core_algos.get_policy_loss_fn("vanilla")(old, logp, adv, mask, mode, cfg)
    (g2,) = torch.autograd.grad(theirs, logp)
    assert m["actor/clip_bias_num_clipped"] == 0
    # (verl adds its 1e-8 to a bool mask's integer token count in float32, where it vanishes;
    # turnwise divides by n + 1e-8 in float64: 4e-9 relative on rows of 2-3 tokens)
    tol = 1e-8 if mode == "seq-mean-token-mean" else 1e-12
    assert abs(float(ours) - float(theirs)) < tol * max(1.0, abs(float(theirs)))
    assert float((g1 - g2).abs().max()) < tol


def test_turnwise_convention_has_dr_grpos_one_over_b():
    """Outside verl the Python losses stay equal to turnwise-model's, whose
    seq-mean-token-sum-norm has Dr.GRPO's 1/B as verl 0.9.1's does (review E, R1):
    Σ m·l / K / (non-empty rows); token-sum is refused there: the verl convention is opt-in."""
    bt = Batch(19)
    mat = torch.randn(bt.b, bt.width, dtype=F64)
    mask = torch.tensor(bt.mask, dtype=F64)
    rows = float((mask.sum(1) > 0).sum())
    tw = L.agg_loss(mat, mask, "seq-mean-token-sum-norm")
    assert abs(float(tw) - float((mat * mask).sum() / bt.width / rows)) < 1e-12
    verl = L.agg_loss(mat, mask, "seq-mean-token-sum-norm", agg_convention="verl")
    assert abs(float(tw) - float(verl)) < 1e-12
    with pytest.raises(ValueError, match="token-sum"):
        L.agg_loss(mat, mask, "token-sum")


@pytest.mark.parametrize("verl_name", list(tv.POLICY_LOSSES))
def test_loss_shape_errors_name_the_argument(verl_name):
    """Bad shapes answer with a ValueError naming the argument, not a numpy/torch IndexError."""
    bt = Batch(20)
    adv = compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig()).batch["advantages"].double()
    old, logp, _, mask = loss_inputs(bt, 10)
    cfg = actor_config(clip_ratio_low=3e-3, clip_ratio_high=4e-3)
    fn = core_algos.get_policy_loss_fn(verl_name)
    agg = "seq-mean-token-mean"
    with pytest.raises(ValueError, match="`advantages` has shape"):
        fn(old, logp, adv[:, :-2], mask, agg, cfg)
    with pytest.raises(ValueError, match="`advantages` has shape"):
        fn(old, logp, adv[:-1], mask, agg, cfg)
    with pytest.raises(ValueError, match="`response_mask` has shape"):
        fn(old, logp, adv, mask[:, :-1], agg, cfg)
    with pytest.raises(ValueError, match="`old_log_prob` has shape"):
        fn(old[:-1], logp, adv, mask, agg, cfg)
    with pytest.raises(ValueError, match="`log_prob` has shape"):
        fn(old[0], logp[0], adv[0], mask[0], agg, cfg)
    with pytest.raises(ValueError, match="`advantages` is a ndarray"):
        fn(old, logp, adv.numpy(), mask, agg, cfg)


def test_a2tgpo_loss_refuses_untagged_values_in_the_clip_channel():
    """verl's gae whitens every position, so observation tokens can carry any value in (0, 2):
    only the tagged CLIP_SCALE_TAG + c passes as a clip scale (V5)."""
    bt = Batch(21)
    adv = compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig()).batch["advantages"].double()
    mask = torch.tensor(bt.mask)
    tv.clip_scale_from_advantages(adv, mask)  # the estimator's own advantages pass
    untagged = adv.clone()
    obs = mask == 0
    untagged[obs] = torch.where(untagged[obs] > 100, untagged[obs] - tv.CLIP_SCALE_TAG, untagged[obs])
    with pytest.raises(ValueError, match="carries no adaptive clip scale"):
        tv.clip_scale_from_advantages(untagged, mask)
    # verl's own gae with values that put z-scores in (0, 2) on observation tokens
    g = torch.Generator().manual_seed(11)
    whitened = torch.rand(bt.b, bt.width, generator=g, dtype=F64) * 1.8 + 0.1
    with pytest.raises(ValueError, match="turnwise_a2tgpo"):
        tv.clip_scale_from_advantages(whitened, mask)


def test_a2tgpo_warns_on_verls_ppo_defaults():
    """verl's ActorConfig always supplies clip 0.2 and token-mean: turnwise_a2tgpo says so (V6)."""
    import warnings

    bt = Batch(22)
    adv = compute_advantage(bt.data("info_gain"), "turnwise_a2tgpo", config=AlgoConfig()).batch["advantages"].double()
    old, logp, _, mask = loss_inputs(bt, 12, spread=0.01)
    fn = core_algos.get_policy_loss_fn("turnwise_a2tgpo")
    tv._WARNED.clear()
    with pytest.warns(tv.TurnwiseVerlWarning) as rec:
        fn(old, logp, adv, mask, "token-mean", actor_config())
    text = " ".join(str(w.message) for w in rec)
    assert "0.2" in text and "clip_ratio_low=0.003" in text
    assert "seq-mean-token-mean" in text
    tv._WARNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.TurnwiseVerlWarning)
        fn(old, logp, adv, mask, "seq-mean-token-mean", actor_config(clip_ratio_low=3e-3, clip_ratio_high=4e-3))
    # turn-GSPO meets the same clip default (its aggregation it forces itself)
    with pytest.warns(tv.TurnwiseVerlWarning, match="turnwise_gspo_turn loss: clip_ratio_low/high"):
        core_algos.get_policy_loss_fn("turnwise_gspo_turn")(old, logp, adv, mask, "seq-mean-token-mean", actor_config())
