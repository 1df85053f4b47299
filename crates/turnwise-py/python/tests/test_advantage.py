"""Advantage estimators against the numeric vectors of docs/algorithms.md §3 (computed by
hand / by the reference code there), numpy and torch inputs, and the error cases."""

import json

import numpy as np
import pytest

import turnwise as tw

torch = pytest.importorskip("torch")


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), atol=tol, rtol=0)


# --------------------------------------------------------------------------- §3.1


def test_grpo_spec_vectors():
    close(tw.grpo([1, 0, 0, 1]).turns[:, 0], [0.866024, -0.866024, -0.866024, 0.866024])
    close(tw.grpo([1, 0, 0, 1], std="population").turns[:, 0], [0.999998, -0.999998, -0.999998, 0.999998])
    close(tw.grpo([1, 1, 1, 1]).turns[:, 0], [0, 0, 0, 0])
    close(tw.grpo([0.7]).turns[:, 0], [0.7])
    close(tw.grpo([1, -1, 0, 0]).turns[:, 0], [1.224743, -1.224743, 0, 0])
    close(tw.grpo([1, 0, 0, 1], epsilon=1e-4).turns[:, 0], [0.865875, -0.865875, -0.865875, 0.865875])
    close(tw.dr_grpo([1, 0, 0, 1]).turns[:, 0], [0.5, -0.5, -0.5, 0.5])
    close(tw.rloo([1, 0, 0, 1]).turns[:, 0], [0.666667, -0.666667, -0.666667, 0.666667])


def test_grpo_groups_and_token_broadcast():
    # Two prompt groups; tokens of every agent turn get the rollout's advantage, tool tokens 0.
    turn_id = [[0, 0, -1, 1, 1], [0, -1, -1, 1, -1], [0, 0, 0, -1, -1], [0, 1, 1, 1, 1]]
    out = tw.grpo([1.0, 0.0, 2.0, 2.0], group=[0, 0, 1, 1], turn_id=turn_id)
    a = 0.5 / (0.5**0.5 + 1e-6)  # (1 − 0.5)/(std_u([1, 0]) + ε)
    close(out.tokens[0], [a, a, 0, a, a])
    close(out.tokens[1], [-a, 0, 0, -a, 0])
    close(out.tokens[2:], 0.0)
    assert out.tokens.dtype == np.float64 and out.tokens.shape == (4, 5)
    assert out.num_turns.tolist() == [2, 2, 1, 2]
    close(out.turns[2], [0, 0])  # one turn, 0-padded


def test_torch_in_torch_out():
    outcome = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float32)
    turn_id = torch.tensor([[0, 0, -1, 1]] * 4)
    out = tw.grpo(outcome, turn_id=turn_id)
    assert isinstance(out.tokens, torch.Tensor) and out.tokens.dtype == torch.float64
    close(out.tokens[:, 0].numpy(), [0.866024, -0.866024, -0.866024, 0.866024])
    assert out.tokens[0, 2].item() == 0.0
    # numpy in → numpy out
    assert isinstance(tw.grpo(np.array([1.0, 0.0])).turns, np.ndarray)


def test_lengths_cut_padding():
    turn_id = [[0, 0, -1, 1, 1, 1], [0, -1, 1, -1, -1, -1]]
    out = tw.grpo([1.0, 0.0], turn_id=turn_id, lengths=[6, 3])
    assert out.num_turns.tolist() == [2, 2]
    close(out.tokens[1, 3:], 0.0)


# --------------------------------------------------------------------------- §3.2


def test_mt_grpo_k_turn_vector():
    r = [[0.2, 0.5, 1.0], [0.2, 0.0, 0.0], [0.0, 0.5, 1.0]]
    out = tw.mt_grpo(r)
    close(
        out.turns,
        [
            [1.732043, 1.154698, 0.577349],
            [-1.73205, -2.309395, -1.154699],
            [7e-06, 1.154698, 0.577349],
        ],
        tol=2e-6,
    )


# --------------------------------------------------------------------------- §3.3


GAE_TID = [[0, 0, -1, -1, 1, 1]]
GAE_VALUES = [[0.5, 0.6, 0.9, 0.9, 0.7, 0.8]]
GAE_REWARDS = [[0, 0.2, 0, 0, 0, 1.0]]


def test_gae_spec_vectors():
    o = tw.gae(GAE_TID, GAE_VALUES, token_rewards=GAE_REWARDS, whiten=False)
    close(o.tokens, [[0.7, 0.6, 0.3, 0.3, 0.3, 0.2]])
    close(o.returns, [[1.2, 1.2, 1.2, 1.2, 1.0, 1.0]])
    o = tw.gae(GAE_TID, GAE_VALUES, token_rewards=GAE_REWARDS, whiten=False, skip_observations=False)
    close(o.tokens, [[0.7, 0.6, 0.1, 0.1, 0.3, 0.2]])
    o = tw.gae(GAE_TID, GAE_VALUES, token_rewards=GAE_REWARDS, whiten=False, gamma=0.9, lam=0.95)
    close(o.tokens, [[0.376276, 0.393305, 0.191, 0.191, 0.191, 0.2]])
    o = tw.gae(GAE_TID, GAE_VALUES, token_rewards=GAE_REWARDS)
    close(o.tokens, [[1.05021, 0.630126, -0.630126, -0.630126, -0.630126, -1.05021]])


def test_gae_places_turn_rewards_like_the_spec():
    # turn reward 0.2 on turn 0's last token, outcome 1.0 on the last model token.
    placed = tw.gae(GAE_TID, GAE_VALUES, turn_rewards=[[0.2, 0.0]], outcome=[1.0], whiten=False)
    close(placed.tokens, [[0.7, 0.6, 0.3, 0.3, 0.3, 0.2]])


# --------------------------------------------------------------------------- §3.4 / §3.5

# The §3.5 group: IG lists r0 = [0.30, 0.20] (T=3), r1 = [0.10] (T=2),
# r2 = [0.25, −0.05, 0.10] (T=4), r3 = [] (T=1); outcomes [1, 0, 1, −1].
IG = [[0.30, 0.20], [0.10], [0.25, -0.05, 0.10], []]
OUTCOME = [1.0, 0.0, 1.0, -1.0]
NUM_TURNS = [3, 2, 4, 1]


def test_a2tgpo_worked_example():
    out = tw.a2tgpo(IG, OUTCOME, num_turns=NUM_TURNS, gamma=1.0)
    want = [
        [2.183817, 1.783341, 0.783349, 0],
        [-1.633913, -0.261116, 0, 0],
        [0.432456, 0.076248, 0.783349, 0.783349],
        [-1.305581, 0, 0, 0],
    ]
    close(out.turns, want)
    close(out.normalized_info_gain[0, :2], [0.980569, 0.999992])
    close(out.normalized_info_gain[1, :1], [-1.372797])
    close(out.normalized_info_gain[2], [0.392228, -0.999992, 0.0])
    # §5.5 clip scales of the same example (1 for the final turn and padding)
    close(out.clip_scale[0, :3], [1.136333, 1.138634, 1.0])
    close(out.clip_scale[1, :2], [0.821301, 1.0])
    close(out.clip_scale[2], [1.058091, 0.861366, 1.0, 1.0])


def test_a2tgpo_with_turn_ids_and_nan_padding():
    # info_gain padded with NaN beyond each rollout's process turns: never read.
    ig = np.full((4, 3), np.nan)
    for i, row in enumerate(IG):
        ig[i, : len(row)] = row
    turn_id = [
        [0, -1, 1, -1, 2, 2],
        [0, 0, -1, 1, -1, -1],
        [0, -1, 1, -1, 2, 3],
        [0, 0, 0, -1, -1, -1],
    ]
    out = tw.a2tgpo(ig, OUTCOME, turn_id=turn_id)
    close(out.tokens[0], [2.183817, 0, 1.783341, 0, 0.783349, 0.783349])
    close(out.tokens[3], [-1.305581] * 3 + [0] * 3)


def test_igpo_paper_vector():
    # The spec vector has no ε in the std (the default ε = 1e-6 moves it by up to 5e-6).
    out = tw.igpo(IG, OUTCOME, num_turns=NUM_TURNS, epsilon=0.0)
    close(tw.igpo(IG, OUTCOME, num_turns=NUM_TURNS).turns[0, :3], [1.740828, 1.534924, 1.516205], tol=1e-5)
    close(out.turns[0, :3], [1.740828, 1.534924, 1.516205])
    close(out.turns[1, :2], [-0.52412, -0.355653])
    close(out.turns[2], [1.010804, 0.898492, 1.347738, 1.516205])
    close(out.turns[3, :1], [-2.227512])


def test_igpo_code_form_vector():
    # A: 6 tokens, IG 0.3 ends turn 0 at idx 1, F1 1.0 at idx 5; B: 4 tokens, IG 0.1 at idx 1.
    turn_id = [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, -1, -1]]
    out = tw.igpo([[0.3], [0.1]], [1.0, 0.0], turn_id=turn_id, lengths=[6, 4], form="code")
    close(out.tokens[0], [0.6, 0.6, 0.5, 0.5, 0.5, 0.5])
    close(out.tokens[1, :4], [-0.6, -0.6, -0.5, -0.5])


# --------------------------------------------------------------------------- json form


def test_estimate_json_matches_arrays():
    batch = {
        "rollouts": [
            {"group": 0, "num_turns": 3, "turn_id": [0, -1, 1, 2], "outcome": 1.0, "info_gain": [0.3, 0.2]},
            {"group": 0, "num_turns": 2, "turn_id": [0, 1, -1, -1], "outcome": 0.0, "info_gain": [0.1]},
        ]
    }
    js = tw.estimate_json("a2tgpo", batch)
    arr = tw.a2tgpo([[0.3, 0.2], [0.1]], [1.0, 0.0], turn_id=[[0, -1, 1, 2], [0, 1, -1, -1]])
    assert js["estimator"] == "a2tgpo"
    for i in range(2):
        close(js["rollouts"][i]["tokens"], arr.tokens[i])


def test_every_registered_name_is_listed():
    names = [n for n, _ in tw.ESTIMATORS]
    assert names == [
        "grpo", "dr_grpo", "rloo", "mt_grpo", "mt_grpo_code", "gae", "igpo", "a2tgpo",
        "at2po", "tree_grpo", "gigpo", "t2po",
    ]


def test_tree_grpo_and_gigpo_run():
    out = tw.tree_grpo([1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0], [0, 0, 1, 1])
    assert out.estimator == "tree_grpo" and out.turns.shape == (4, 1)
    g = tw.gigpo([[0.0, 1.0], [0.0, 0.0]], [["s0", "s1"], ["s0", "s1"]], outcome=[1.0, 0.0])
    assert g.turns.shape == (2, 2)
    assert g.turns[0, 1] > g.turns[1, 1]


def test_gigpo_returns_the_anchor_groups_it_normalised_in():
    # Both rollouts start in state s0 and part after it: one group of two, then two singletons.
    g = tw.gigpo([[0.0, 1.0], [0.0, 0.0]], [["s0", "s1"], ["s0", "s2"]], outcome=[1.0, 0.0])
    assert g.step_group.tolist() == [[0.0, 1.0], [0.0, 2.0]]
    assert g.step_group_size.tolist() == [[2.0, 1.0], [2.0, 1.0]]
    # An estimator over whole rollouts has no step groups.
    assert tw.grpo([1.0, 0.0]).step_group is None


def test_gigpo_step_penalties_lower_only_their_own_steps_return():
    # Two rollouts through the same anchor states with the same rewards; the first is penalised
    # at its last step. After discounting (verl-agent), the step-0 returns stay equal, so the
    # step-0 anchor group gives both 0; subtracting the penalty from the reward instead lowers
    # the first rollout's step-0 return by γ·p and splits the group.
    anchors = [["s0", "s1"], ["s0", "s1"]]
    after = tw.gigpo([[0.0, 1.0], [0.0, 1.0]], anchors, step_penalties=[[0.0, 0.1], [0.0, 0.0]])
    assert after.turns[0, 0] == pytest.approx(0.0) and after.turns[1, 0] == pytest.approx(0.0)
    assert after.turns[0, 1] < after.turns[1, 1]
    before = tw.gigpo([[0.0, 0.9], [0.0, 1.0]], anchors)
    assert before.turns[0, 0] < before.turns[1, 0]


def test_at2po_tree():
    tree = {
        "group": 0,
        "nodes": [
            {"parent": None, "is_leaf": False, "entropy": 0.0, "reward": None, "span": 0},
            {"parent": 0, "is_leaf": True, "entropy": 0.5, "reward": 1.0, "span": 2},
            {"parent": 0, "is_leaf": True, "entropy": 0.7, "reward": 0.0, "span": 2},
        ],
    }
    out = tw.at2po([1.0, 0.0], [tree], tree=[0, 0], leaf=[1, 2], turn_id=[[0, 0], [0, 0]])
    assert out.trees is not None and len(out.trees[0]["values"]) == 3
    assert out.tokens[0, 0] > out.tokens[1, 0]


# --------------------------------------------------------------------------- errors


def test_unknown_estimator_and_setting():
    with pytest.raises(ValueError, match="unknown advantage estimator `ppo2`"):
        tw.estimate("ppo2", [1.0])
    with pytest.raises(ValueError, match="lambda"):
        tw.gae(GAE_TID, GAE_VALUES, token_rewards=GAE_REWARDS, **{"lambda": 0.9})


def test_nan_and_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="outcome"):
        tw.grpo([1.0, float("nan")])
    with pytest.raises(ValueError, match="`group` has shape"):
        tw.grpo([1.0, 0.0], group=[0, 0, 0])
    with pytest.raises(ValueError, match="`turn_id` has shape"):
        tw.grpo([1.0, 0.0], turn_id=[[0, 0]])
    with pytest.raises(ValueError, match="`turn_id`: value -2"):
        tw.grpo([1.0], turn_id=[[0, -2]])
    with pytest.raises(ValueError, match="`values` has shape"):
        tw.gae(GAE_TID, [[0.5, 0.6]], token_rewards=GAE_REWARDS)
    with pytest.raises(ValueError, match="`lengths`"):
        tw.grpo([1.0], turn_id=[[0, 0]], lengths=[3])
    with pytest.raises(ValueError, match="info_gain"):
        tw.a2tgpo([[0.3, np.nan]], [1.0], num_turns=[3])
    with pytest.raises(ValueError, match="`info_gain` has length 1, expected 2"):
        tw.a2tgpo([[0.3]], [1.0], num_turns=[3])
    with pytest.raises(ValueError, match="group"):
        tw.grpo([1.0], group=[-1])
    with pytest.raises(ValueError, match="settings"):
        tw.grpo([1.0], epsilon=float("nan"))
    with pytest.raises(ValueError, match="values"):
        tw.gae(GAE_TID, [[0.5, np.inf, 0.9, 0.9, 0.7, 0.8]], token_rewards=GAE_REWARDS)
    with pytest.raises(ValueError, match="batch"):
        tw.estimate_json("grpo", {"rollouts": [{"bogus": 1}]})
