"""Turn structure helpers: turn ids from a response mask, per-turn values onto tokens,
turn-reward placement (§3.3) and the A2TGPO clip scale (§5.5)."""

import numpy as np
import pytest

import turnwise as tw

torch = pytest.importorskip("torch")


def test_turn_ids_from_mask_runs():
    assert tw.turn_ids_from_mask([1, 1, 0, 0, 1, 1, 0]).tolist() == [0, 0, -1, -1, 1, 1, -1]
    m = np.array([[0, 1, 1, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    got = tw.turn_ids_from_mask(m)
    assert got.dtype == np.int64
    assert got.tolist() == [
        [-1, 0, 0, -1, 1, -1, 2],
        [0, 0, 0, 0, -1, -1, -1],
        [-1] * 7,
    ]


def test_turn_ids_from_mask_dtypes():
    m = [[1, 0, 1]]
    want = [[0, -1, 1]]
    assert tw.turn_ids_from_mask(np.array(m, dtype=bool)).tolist() == want
    assert tw.turn_ids_from_mask(np.array(m, dtype=np.float32)).tolist() == want
    t = tw.turn_ids_from_mask(torch.tensor(m))
    assert isinstance(t, torch.Tensor) and t.tolist() == want
    t = tw.turn_ids_from_mask(torch.tensor(m, dtype=torch.bool))
    assert t.tolist() == want


def test_turn_ids_from_mask_rejects_non_binary():
    with pytest.raises(ValueError, match=r"`mask`: must hold 0 and 1 only, found 2 at index \[0, 1\]"):
        tw.turn_ids_from_mask([[1, 2, 0]])
    with pytest.raises(ValueError, match="mask"):
        tw.turn_ids_from_mask([[1.0, 0.5]])
    with pytest.raises(ValueError, match="mask"):
        tw.turn_ids_from_mask(np.zeros((2, 2, 2), dtype=np.int64))


def test_turn_values_to_tokens():
    tid = [0, 0, -1, 1, 1, -1, 2]
    got = tw.turn_values_to_tokens(tid, [0.5, -1.0, 2.0])
    np.testing.assert_array_equal(got, [0.5, 0.5, 0.0, -1.0, -1.0, 0.0, 2.0])
    got = tw.turn_values_to_tokens([tid, [0, -1, -1, -1, -1, -1, -1]], [[0.5, -1.0, 2.0], [3.0, np.nan, np.nan]], fill=1.0)
    np.testing.assert_array_equal(got[1], [3.0] + [1.0] * 6)
    t = tw.turn_values_to_tokens(torch.tensor([tid]), torch.tensor([[0.5, -1.0, 2.0]]))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float64


def test_turn_values_to_tokens_round_trip_with_mask():
    mask = np.array([[1, 1, 0, 1, 0, 1, 1]])
    tid = tw.turn_ids_from_mask(mask)
    vals = tw.turn_values_to_tokens(tid, [[10.0, 20.0, 30.0]])
    np.testing.assert_array_equal(vals, [[10, 10, 0, 20, 0, 30, 30]])


def test_turn_values_to_tokens_errors():
    with pytest.raises(ValueError, match="`per_turn` has shape \\[1, 2\\], expected at least 3 columns"):
        tw.turn_values_to_tokens([[0, 1, 2]], [[1.0, 2.0]])
    with pytest.raises(ValueError, match="per_turn"):
        tw.turn_values_to_tokens([[0, 1]], [[1.0, np.nan]])
    with pytest.raises(ValueError, match="`per_turn` has shape"):
        tw.turn_values_to_tokens([[0, 1]], [[1.0, 2.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="one row"):
        tw.turn_values_to_tokens([0, 1], [[1.0, 2.0]])
    with pytest.raises(ValueError, match="turn_id"):
        tw.turn_values_to_tokens([0, -3], [1.0])


def test_place_turn_rewards_spec_vector():
    # §3.3 layout [a1 a2 | o o | a3 a4]: turn reward 0.2 on a2, outcome 1.0 on a4.
    got = tw.place_turn_rewards([0, 0, -1, -1, 1, 1], [0.2, 0.0], 1.0)
    np.testing.assert_allclose(got, [0, 0.2, 0, 0, 0, 1.0])
    batch = tw.place_turn_rewards(
        [[0, 0, -1, -1, 1, 1], [0, 1, -1, -1, -1, -1]],
        [[0.2, 0.0], [0.5, 0.25]],
        [1.0, -1.0],
    )
    np.testing.assert_allclose(batch[1], [0.5, 0.25 - 1.0, 0, 0, 0, 0])
    t = tw.place_turn_rewards(torch.tensor([0, 1]), torch.tensor([0.5, 0.5]), torch.tensor(2.0))
    assert isinstance(t, torch.Tensor) and t.tolist() == [0.5, 2.5]


def test_place_turn_rewards_errors():
    with pytest.raises(ValueError, match="turn 1 has a turn reward but no agent token"):
        tw.place_turn_rewards([0, 0, 2], [0.1, 0.2, 0.3], 1.0)
    with pytest.raises(ValueError, match="turn_rewards"):
        tw.place_turn_rewards([0, 1], [0.1, np.nan], 1.0)
    with pytest.raises(ValueError, match="outcome"):
        tw.place_turn_rewards([0, 1], [0.1, 0.2], np.inf)
    with pytest.raises(ValueError, match="`turn_rewards` has shape"):
        tw.place_turn_rewards([0, 1], [0.1], 1.0)
    with pytest.raises(ValueError, match="outcome"):
        tw.place_turn_rewards([[0, 1]], [[0.1, 0.2]], [1.0, 2.0])


def test_a2tgpo_clip_scale_spec_vectors():
    np.testing.assert_allclose(tw.a2tgpo_clip_scale([-2.0, 0.0, 2.0]), [0.771522, 1.0, 1.228478], atol=1e-6)
    t = tw.a2tgpo_clip_scale(torch.tensor([[0.980569, 0.999992]]))
    assert isinstance(t, torch.Tensor)
    np.testing.assert_allclose(t.numpy(), [[1.136333, 1.138634]], atol=1e-6)
    with pytest.raises(ValueError, match="normalized_info_gain"):
        tw.a2tgpo_clip_scale([np.nan])
