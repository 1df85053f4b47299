"""The torch policy losses (turnwise.losses) against turnwise-model: loss values and autograd
input gradients on the Rust-computed fixture (tests/loss_fixture.rs), plus the spec vectors
of docs/algorithms.md §5 and the error cases."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from turnwise import losses as L  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "losses.json"
CASES = json.loads(FIXTURE.read_text())["cases"]
TOL = 1e-6

# metrics both sides compute (turnwise-model also logs turn_kl_entropy and others)
METRICS = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_high",
    "actor/pg_clipfrac_low",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/clip_bias_norm",
    "actor/clip_bias_scale",
    "actor/clip_bias_num_clipped",
    "actor/num_turns",
]


def t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def run_case(case):
    inp = case["inputs"]
    logp = t(inp["logp"], grad=True)
    kw = dict(case["config"])
    if "turn_id" in inp:
        kw["turn_id"] = t(inp["turn_id"])
    if "clip_scale" in inp:
        kw["clip_scale"] = t(inp["clip_scale"])
    if case["denominators"] is not None:
        kw["denominators"] = tuple(case["denominators"])
    if case["clip_bias_scale"] is not None:
        kw["clip_bias_scale"] = case["clip_bias_scale"]
    out = L.policy_loss(logp, t(inp["old_logp"]), t(inp["advantages"]), t(inp["loss_mask"]), **kw)
    out.loss.backward()
    grad = logp.grad if logp.grad is not None else torch.zeros_like(logp)
    return out, grad


def test_fixture_is_large_enough():
    names = {c["config"]["policy_loss"] for c in CASES}
    assert names == {"vanilla", "dapo", "decoupled_clip", "gspo", "turn", "gspo_turn", "a2tgpo", "s_ppo", "st_ppo", "s_grpo"}
    assert len(CASES) >= 50


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_loss_and_gradient_match_turnwise_model(case):
    out, grad = run_case(case)
    assert abs(out.loss.item() - case["loss"]) < TOL, (out.loss.item(), case["loss"])
    np.testing.assert_allclose(grad.numpy(), np.array(case["grad"]), atol=TOL, rtol=0)
    for k in METRICS:
        assert abs(out.metrics[k] - case["metrics"][k]) < TOL, (k, out.metrics[k], case["metrics"][k])


def test_fixture_max_differences_are_tiny():
    worst_loss = worst_grad = 0.0
    for case in CASES:
        out, grad = run_case(case)
        worst_loss = max(worst_loss, abs(out.loss.item() - case["loss"]))
        worst_grad = max(worst_grad, float(np.max(np.abs(grad.numpy() - np.array(case["grad"])))))
    # f64 on both sides: only summation order differs.
    assert worst_loss < 1e-12 and worst_grad < 1e-12, (worst_loss, worst_grad)


# --------------------------------------------------------------------------- §5 vectors

MASK = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
LOGR = [0.10, -0.05, 0.02, 0.0, 0.0, 0.01, 0.00]


def spec_traj():
    old = [-1.0] * 7
    logp = [r - 1.0 for r in LOGR]
    return t([logp], True), t([old]), t([[0.5] * 7]), t([MASK])


def one(a, w, name, **kw):
    lp = t([[math.log(w)]], True)
    return L.policy_loss(lp, t([[0.0]]), t([[a]]), t([[1.0]]), policy_loss=name, **kw)


def test_spec_5_1_token_clip_and_dual_clip():
    assert one(-1.0, 4.0, "vanilla").loss.item() == pytest.approx(3.0)
    assert one(-1.0, 4.0, "vanilla").metrics["actor/pg_clipfrac_lower"] == 1.0
    assert one(-1.0, 1.5, "vanilla").loss.item() == pytest.approx(1.5)
    assert one(1.0, 1.5, "vanilla").loss.item() == pytest.approx(-1.2)
    assert one(-1.0, 4.0, "vanilla", clip_ratio_c=None).loss.item() == pytest.approx(4.0)
    lp, old, adv, m = spec_traj()
    o = L.policy_loss(lp, old, adv, m)
    per = o.per_token_loss.detach()[0][torch.tensor(MASK) > 0]
    np.testing.assert_allclose(per.numpy(), [-0.552585, -0.475615, -0.510101, -0.505025, -0.5], atol=1e-6)
    assert o.loss.item() == pytest.approx(-0.508665, abs=1e-6)


def test_spec_5_2_dapo():
    assert one(1.0, 1.25, "dapo").loss.item() == pytest.approx(-1.25)
    assert one(1.0, 1.25, "decoupled_clip").loss.item() == pytest.approx(-1.25)
    assert one(1.0, 1.25, "vanilla").loss.item() == pytest.approx(-1.2)


def test_spec_5_3_gspo_ratio():
    lp, old, adv, m = spec_traj()
    o = L.policy_loss(lp, old, adv, m, policy_loss="gspo")
    assert o.ratio[0, 0].item() == pytest.approx(1.016129, abs=1e-6)


def test_spec_5_4_turn_ratios_and_gspo_turn():
    lp, old, adv, m = spec_traj()
    r = L.turn_ratio(lp, old, m)
    assert r[0, 0].item() == pytest.approx(1.023608, abs=1e-6)
    assert r[0, 5].item() == pytest.approx(1.005013, abs=1e-6)
    assert r[0, 3].item() == 1.0  # tool token
    o = L.gspo_turn_loss(lp, old, adv, m)
    assert o.loss.item() == pytest.approx(-0.502, abs=1e-6)


def test_spec_5_4_plain_vs_stop_gradient_gradients():
    old = t([[-1.0, -2.0, -0.5]])
    adv = t([[1.0, 0.2, -0.4]])
    m = t([[1.0, 1.0, 1.0]])
    for form, want in [
        ("plain", [-0.271148] * 3),
        ("stop_gradient", [-1.016806, -0.203361, 0.406723]),
    ]:
        lp = t([[-0.9, -2.1, -0.45]], True)
        o = L.turn_ppo_loss(lp, old, adv, m, ratio_form=form, clip_ratio=0.5, loss_agg_mode="seq-mean-token-sum")
        o.loss.backward()
        np.testing.assert_allclose(lp.grad.numpy()[0], want, atol=1e-6)
        assert o.ratio[0, 0].item() == pytest.approx(1.016806, abs=1e-6)


def test_sum_pooling_is_the_product_of_token_ratios():
    lp, old, adv, m = spec_traj()
    s = L.turn_ratio(lp, old, m, pooling="sum")
    assert s[0, 0].item() == pytest.approx(math.exp(0.10 - 0.05 + 0.02))
    assert s[0, 6].item() == pytest.approx(math.exp(0.01))
    mean = L.turn_ratio(lp, old, m, pooling="mean")
    assert math.log(s[0, 0].item()) == pytest.approx(3 * math.log(mean[0, 0].item()))
    # plain form: ∂ Σ_t s_k / ∂logp_t = |y_k| s_k for sum pooling (each token's ratio is s_k).
    s.sum().backward()
    assert lp.grad[0, 0].item() == pytest.approx(3 * math.exp(0.07))
    # through the loss: sum-pooled turn PPO clips more (ratio further from 1)
    o_sum = L.policy_loss(*spec_traj(), policy_loss="turn", turn_pooling="sum", clip_ratio=0.05)
    assert o_sum.metrics["actor/pg_clipfrac"] > 0
    with pytest.raises(ValueError, match="pooling"):
        L.turn_ratio(lp, old, m, pooling="max")


def test_turn_ratio_with_explicit_turn_ids_joins_a_split_turn():
    lp, old, adv, m = spec_traj()
    tid = t([[0, 0, 0, -1, -1, 0, 0]])
    r = L.turn_ratio(lp, old, m, tid)
    assert r[0, 0].item() == pytest.approx(math.exp(sum(LOGR) / 5))
    seg, n = L.turn_segments(m, tid)
    assert n == 1 and seg.tolist() == [[0, 0, 0, -1, -1, 0, 0]]
    seg, n = L.turn_segments(m)
    assert n == 2


def test_spec_5_5_a2tgpo_adaptive_clip():
    lp, old, adv, m = spec_traj()
    c1 = t([[1.0] * 7])
    assert L.a2tgpo_loss(lp, old, adv, m, c1).loss.item() == pytest.approx(-0.502, abs=1e-6)
    c2 = t([[1.0, 1.0, 1.0, 1.0, 1.0, 1.228478, 1.228478]])
    want = (3.0 * -0.502 + 2.0 * (-0.5 * 1.004914)) / 5.0
    assert L.a2tgpo_loss(lp, old, adv, m, c2).loss.item() == pytest.approx(want, abs=1e-6)
    c = L.adaptive_clip_scale(torch.tensor([-2.0, 0.0, 2.0], dtype=torch.float64))
    np.testing.assert_allclose(c.numpy(), [0.771522, 1.0, 1.228478], atol=1e-6)
    lo, hi = L.adaptive_clip_bounds(c)
    np.testing.assert_allclose(lo.numpy(), [0.997685, 0.997, 0.996315], atol=1e-6)
    np.testing.assert_allclose(hi.numpy(), [1.003086, 1.004, 1.004914], atol=1e-6)


def test_spec_5_6_clip_bias_rules():
    old = t([[0.0] * 7])
    lp = t([[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05]], True)
    adv = t([[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]])
    m = t([MASK])
    base = L.policy_loss(lp, old, adv, m).loss.item()
    for name in ["s_ppo", "s_grpo"]:
        o = L.policy_loss(lp, old, adv, m, policy_loss=name)
        assert o.metrics["actor/clip_bias_scale"] == pytest.approx(0.338783, abs=1e-6)
        assert o.loss.item() == pytest.approx(0.338783 * base, abs=1e-6)
        o = L.policy_loss(lp, old, adv, m, policy_loss=name, clip_bias={"rule": "inverse_norm"})
        assert o.metrics["actor/clip_bias_norm"] == pytest.approx(0.301426, abs=1e-6)
        assert o.metrics["actor/clip_bias_scale"] == pytest.approx(3.317559, abs=1e-6)
        assert o.metrics["actor/clip_bias_num_clipped"] == 2
    w = torch.exp(lp.detach())
    cb = L.clip_bias(w, adv, m, 0.8, 1.2)
    np.testing.assert_allclose(
        cb["components"].numpy()[0], [0.269972, 0, 0, 0, 0, -0.134064, 0], atol=1e-6
    )
    assert cb["sample_weights"][0] == pytest.approx(0.338783, abs=1e-6)
    # on-policy: nothing clipped, weight 1
    o = L.policy_loss(old.clone().requires_grad_(True), old, adv, m, policy_loss="s_ppo")
    assert o.metrics["actor/clip_bias_scale"] == 1.0 and o.metrics["actor/clip_bias_num_clipped"] == 0


def test_zero_advantage_rows_do_not_dilute_the_mean_clip_bias_weight():
    # Row 0 is the spec's clipped sample (weight 0.338783); row 1 has advantages 0 everywhere
    # (an uninformative GRPO group): its weight is 1 and it has no gradient to weight, so the
    # reported s̄ is row 0's alone, as turnwise-model's (policy.rs,
    # zero_advantage_rows_do_not_dilute_the_mean_weight).
    old = t([[0.0] * 7] * 2)
    lp = t([[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05]] * 2, True)
    adv = t([[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0], [0.0] * 7])
    m = t([MASK] * 2)
    for name in ["s_ppo", "s_grpo"]:
        o = L.policy_loss(lp, old, adv, m, policy_loss=name)
        assert o.metrics["actor/clip_bias_scale"] == pytest.approx(0.338783, abs=1e-6)


def test_st_ppo_takes_its_clipping_error_from_token_ratios():
    old = t([[0.0] * 7])
    lp = t([[0.3, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0]], True)
    adv = t([[1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    m = t([MASK])
    o = L.st_ppo_loss(lp, old, adv, m)
    w0, w1 = math.exp(0.3), math.exp(-0.3)
    rho = w0 / math.sqrt(w0 * w0 + w1 * w1 + 3.0)
    assert o.metrics["actor/clip_bias_scale"] == pytest.approx(1.0 - rho)
    plain = L.turn_ppo_loss(lp, old, adv, m).loss.item()
    assert o.loss.item() == pytest.approx((1.0 - rho) * plain)
    o = L.st_ppo_loss(lp, old, adv, m, clip_bias={"ratio": "loss"})
    assert o.metrics["actor/clip_bias_scale"] == 1.0


def test_spec_5_7_aggregation_modes():
    loss = t([[1.0, 1.0, 1.0, 9.0], [4.0, 7.0, 7.0, 7.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for mode, want in [
        ("token-mean", 1.75),
        ("seq-mean-token-sum", 3.5),
        ("seq-mean-token-mean", 2.5),
        # Dr.GRPO: Σ m·l = 7 over 2 sequences, K = the mask width 4
        ("seq-mean-token-sum-norm", 0.875),
    ]:
        assert L.agg_loss(loss, mask, mode).item() == pytest.approx(want, abs=1e-6)
    assert L.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=4.0).item() == pytest.approx(0.875)
    assert L.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=7.0).item() == pytest.approx(0.5)
    # a fully masked row is excluded from the seq-mean denominators
    loss3 = torch.cat([loss, t([[5.0] * 4])])
    mask3 = torch.cat([mask, t([[0.0] * 4])])
    assert L.agg_loss(loss3, mask3, "seq-mean-token-mean").item() == pytest.approx(2.5, abs=1e-6)
    assert L.agg_loss(t([[3.0] * 4]), t([[0.0] * 4]), "seq-mean-token-mean").item() == 0.0
    # micro-batches with mini-batch denominators sum to the mini-batch loss
    full = L.agg_loss(loss, mask, "token-mean").item()
    parts = sum(
        L.agg_loss(loss[i : i + 1], mask[i : i + 1], "token-mean", denominators=(4.0, 2.0)).item()
        for i in range(2)
    )
    assert parts == pytest.approx(full)


def test_float32_inputs():
    lp, old, adv, m = spec_traj()
    o = L.policy_loss(lp.detach().float().requires_grad_(True), old.float(), adv, m.float())
    assert o.loss.dtype == torch.float32
    assert o.loss.item() == pytest.approx(-0.508665, abs=1e-5)


# --------------------------------------------------------------------------- errors


def test_errors_name_what_is_wrong():
    lp, old, adv, m = spec_traj()
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        L.policy_loss(lp, old, adv, m, policy_loss="ppo2")
    with pytest.raises(ValueError, match="gspo forces loss_agg_mode seq-mean-token-mean"):
        L.policy_loss(lp, old, adv, m, policy_loss="gspo", loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="missing input `clip_scale`"):
        L.policy_loss(lp, old, adv, m, policy_loss="a2tgpo")
    with pytest.raises(ValueError, match="vanilla: `old_logp` contains 1 non-finite"):
        L.policy_loss(lp, t([[-1.0, math.nan, -1, -1, -1, -1, -1]]), adv, m)
    with pytest.raises(ValueError, match="`advantages` has shape \\[1, 3\\], expected \\[1, 7\\]"):
        L.policy_loss(lp, old, t([[0.0] * 3]), m)
    with pytest.raises(ValueError, match="loss token \\(0, 0\\) has turn_id -1"):
        L.policy_loss(lp, old, adv, m, policy_loss="turn", turn_id=t([[-1.0] * 7]))
    with pytest.raises(ValueError, match="clip_ratio_c must be finite and > 1"):
        L.policy_loss(lp, old, adv, m, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        L.policy_loss(lp, old, adv, m, loss_agg_mode="seq-mean")
    with pytest.raises(ValueError, match="clip_bias.max_scale applies to rule"):
        L.policy_loss(lp, old, adv, m, policy_loss="s_ppo", clip_bias={"max_scale": 2.0})
    with pytest.raises(ValueError, match="norm_space"):
        L.policy_loss(lp, old, adv, m, policy_loss="s_ppo", clip_bias={"rule": "inverse_norm", "norm_space": "grad"})
    with pytest.raises(ValueError, match="unknown setting"):
        L.policy_loss(lp, old, adv, m, clip_bias={"rules": "x"})
    with pytest.raises(ValueError, match="clip_scale must be ≥ 0"):
        L.a2tgpo_loss(lp, old, adv, m, t([[-1.0] * 7]))
    with pytest.raises(ValueError, match="`logp` has shape \\[7\\], expected a 2-D tensor"):
        L.policy_loss(lp[0], old, adv, m)
