"""End-to-end tests of turnwise.trl (TurnwiseGRPOTrainer + SearchR1Rollout) on CPU, with a
tiny model and tokenizer built by conftest.py and a Search-R1 retrieval server (turnwise's own
`serve-retriever` when the binary is there). Skipped when trl is not installed unless
TURNWISE_TRL_REQUIRED=1 (scripts/trl-check.sh sets it)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

if os.environ.get("TURNWISE_TRL_REQUIRED") != "1":
    pytest.importorskip("trl")
    pytest.importorskip("transformers")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import turnwise as tw  # noqa: E402
from turnwise import losses  # noqa: E402
from turnwise.trl import (  # noqa: E402
    RetrieverClient,
    SearchR1Rollout,
    TurnwiseGRPOTrainer,
    retrieval_turn_inputs,
    search_r1_em_reward,
)

QUESTIONS = [
    # (prompt, gold, the query the warm start learned): conftest.py's QUESTIONS
    ("question : what is the capital of france ?", "paris", "capital of france"),
    ("question : what is the capital of germany ?", "berlin", "capital of germany"),
    ("question : what is the capital of italy ?", "rome", "capital of italy"),
    ("question : what is the capital of spain ?", "madrid", "capital of spain"),
]

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _dataset():
    return Dataset.from_list([{"prompt": q, "golds": [g]} for q, g, _ in QUESTIONS])


def _trainer(tmp_path, tiny_policy, retriever, *, steps=2, num_iterations=1, beta=0.0, **kw):
    model, tok, _ = tiny_policy
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=96,
        max_steps=steps,
        num_iterations=num_iterations,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        beta=beta,
        temperature=1.0,
        seed=0,
        dataloader_num_workers=0,
    )
    return TurnwiseGRPOTrainer(
        model=model if isinstance(model, str) else copy.deepcopy(model),
        processing_class=tok,
        reward_funcs=[search_r1_em_reward],
        args=args,
        train_dataset=_dataset(),
        rollout_func=SearchR1Rollout(retriever[0], max_turns=3, max_tokens_per_turn=24, topk=2),
        record_batches=True,
        **kw,
    )


def _record_loss_inputs(trainer):
    seen = []
    orig = trainer.turnwise_loss

    def wrapped(model, inputs):
        seen.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
        return orig(model, inputs)

    trainer.turnwise_loss = wrapped
    return seen


def test_retriever_protocol(retriever):
    url, kind = retriever
    print(f"retrieval server: {kind} at {url}")
    res = RetrieverClient(url, topk=2).retrieve(["capital of france", "capital of italy"])
    assert len(res) == 2 and all(len(r) == 2 for r in res)
    assert "paris" in res[0][0]["document"]["contents"]
    assert "rome" in res[1][0]["document"]["contents"]
    assert isinstance(res[0][0]["score"], float)


def test_warm_start_rollouts_are_multi_turn(tiny_policy, retriever, tmp_path):
    """The rollout loop: search → <information> (env_mask 0) → answer, tags where they belong."""
    trainer = _trainer(tmp_path, tiny_policy, retriever)
    _, tok, _ = tiny_policy
    out = trainer.rollout_func([q for q, _, _ in QUESTIONS] * 2, trainer)
    assert len(out["completion_ids"]) == 8
    multi = 0
    for ids, mask, lps, obs in zip(out["completion_ids"], out["env_mask"], out["logprobs"], out["observations"]):
        assert len(ids) == len(mask) == len(lps) <= 96
        tool = [t for t, m in zip(ids, mask) if m == 0]
        model_toks = [t for t, m in zip(ids, mask) if m == 1]
        if tool:
            multi += 1
            text = tok.decode(tool)
            assert text.strip().startswith("<information>") and "</information>" in text
            assert "<information>" not in tok.decode(model_toks)
            assert len(obs) >= 1
        assert all(lp <= 0.0 for lp in lps)
    assert multi >= 4, "the warm-started policy should search in most rollouts"


def test_train_advantages_are_turnwise(tiny_policy, retriever, tmp_path):
    """A few GRPO steps; the advantages TRL trains on equal a direct tw.estimate on the
    recorded batch, the turns are the runs of model tokens, tool tokens carry no loss."""
    trainer = _trainer(tmp_path, tiny_policy, retriever, steps=3, estimator="grpo", policy_loss="st_ppo")
    seen = _record_loss_inputs(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "training changed no weight"
    assert len(trainer.turnwise_batches) == 3 and len(seen) == 3
    multi_turn = 0
    for batch in trainer.turnwise_batches:
        turn_id = batch["turn_id"]
        np.testing.assert_array_equal(turn_id, tw.turn_ids_from_mask(batch["loss_mask"].numpy()))
        multi_turn += int((turn_id.max(axis=1) >= 1).sum())
        direct = tw.estimate("grpo", batch["outcome"], batch["group"], turn_id)
        np.testing.assert_allclose(batch["advantages"].numpy(), np.asarray(direct.tokens, dtype=np.float32))
        assert np.all(batch["advantages"].numpy()[turn_id < 0] == 0.0)
    assert multi_turn > 0, "no multi-turn rollout in training"
    # what the loss saw (shuffled micro-batches) are rows of the recorded batches
    for inputs in seen:
        for r in range(inputs["completion_ids"].shape[0]):
            found = False
            for batch in trainer.turnwise_batches:
                ids = batch["completion_ids"]
                w = min(ids.shape[1], inputs["completion_ids"].shape[1])
                hit = (ids[:, :w] == inputs["completion_ids"][r, :w]).all(dim=1).nonzero()
                for j in hit.flatten().tolist():
                    if torch.equal(batch["advantages"][j, :w], inputs["advantages"][r, :w]):
                        found = True
            assert found, "a trained row's advantages are not turnwise's"
    logs = [h for h in trainer.state.log_history if "turnwise/num_turns" in h]
    assert logs and all(np.isfinite(h["loss"]) for h in logs)


def test_outcome_is_em_of_completions(tiny_policy, retriever, tmp_path):
    trainer = _trainer(tmp_path, tiny_policy, retriever, steps=1)
    trainer.train()
    _, tok, _ = tiny_policy
    batch = trainer.turnwise_batches[0]
    gold_of = {q: g for q, g, _ in QUESTIONS}
    prompts = batch["prompts"]
    # one prompt per group of num_generations=4 rollouts
    assert len(prompts) == 4 and len(set(prompts)) == 1 and prompts[0] in gold_of
    texts = tok.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    em = [tw.score("search_r1_em", t, golds=[gold_of[p]])["score"] for t, p in zip(texts, prompts)]
    np.testing.assert_array_equal(batch["outcome"], np.array(em, dtype=np.float64))


@pytest.mark.parametrize("estimator,policy_loss", [("mt_grpo", "turn"), ("a2tgpo", "a2tgpo")])
def test_turn_level_estimators(tiny_policy, retriever, tmp_path, estimator, policy_loss):
    trainer = _trainer(tmp_path, tiny_policy, retriever, steps=1, estimator=estimator, policy_loss=policy_loss)
    seen = _record_loss_inputs(trainer)
    trainer.train()
    batch = trainer.turnwise_batches[0]
    assert set(batch["extra"]) == ({"turn_rewards"} if estimator == "mt_grpo" else {"info_gain"})
    direct = tw.estimate(estimator, batch["outcome"], batch["group"], batch["turn_id"], **batch["extra"])
    np.testing.assert_allclose(batch["advantages"].numpy(), np.asarray(direct.tokens, dtype=np.float32))
    if policy_loss == "a2tgpo":
        assert "clip_scale" in seen[0]


def _grad(model, fn):
    model.zero_grad()
    fn().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def test_turn_level_part_changes_the_gradient(tiny_policy, retriever, tmp_path):
    """Off-policy (num_iterations=2: TRL's second pass reuses the rollouts with their old
    log-probs), the turn-level ratio gives another gradient than the plain token ratio with
    everything else equal; and the trainer's loss is turnwise.losses.policy_loss exactly."""
    trainer = _trainer(
        tmp_path, tiny_policy, retriever, steps=2, num_iterations=2, estimator="grpo", policy_loss="turn",
        policy_loss_settings={"loss_agg_mode": "token-mean", "clip_ratio": 0.2},
    )
    seen = _record_loss_inputs(trainer)
    trainer.train()
    inputs = seen[-1]
    assert inputs.get("old_per_token_logps") is not None, "second iteration should carry old log-probs"
    model = trainer.model
    model.train()

    def loss_with(name, settings):
        def f():
            trainer.policy_loss_name, trainer.policy_loss_settings = name, settings
            return trainer.turnwise_loss(model, inputs).loss
        return f

    common = {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}
    g_turn = _grad(model, loss_with("turn", common))
    g_token = _grad(model, loss_with("vanilla", {**common, "clip_ratio_c": None}))
    assert torch.isfinite(g_turn).all() and g_turn.abs().sum() > 0
    assert not torch.allclose(g_turn, g_token, rtol=1e-4, atol=1e-9), "turn-level ratio did not change the gradient"

    # a perturbed behaviour policy (ratios far from 1, clipping active): the turn-level losses
    # (turn ratio, ST-PPO's clipping-bias correction) all differ from the token loss
    gen = torch.Generator().manual_seed(0)
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    noisy = dict(inputs)
    noisy["old_per_token_logps"] = inputs["old_per_token_logps"] + 0.3 * torch.randn(
        inputs["old_per_token_logps"].shape, generator=gen
    ) * mask
    inputs_backup = inputs

    def on(batch, name, settings):
        def f():
            trainer.policy_loss_name, trainer.policy_loss_settings = name, settings
            return trainer.turnwise_loss(model, batch).loss
        return f

    g_tok = _grad(model, on(noisy, "vanilla", {**common, "clip_ratio_c": None}))
    for name in ("turn", "st_ppo"):
        g = _grad(model, on(noisy, name, common))
        assert not torch.allclose(g, g_tok, rtol=1e-3, atol=1e-8), f"{name} gave the token gradient"

    # the trainer's loss is turnwise's policy loss (divided by the accumulation steps)
    trainer.policy_loss_name, trainer.policy_loss_settings = "st_ppo", {}
    trainer.model.train()
    trl_loss = trainer._compute_loss(model, inputs_backup)
    logp = trainer._tw_last_logp
    direct = losses.policy_loss(
        logp, inputs_backup["old_per_token_logps"], inputs_backup["advantages"],
        inputs_backup["completion_mask"] * inputs_backup["tool_mask"], policy_loss="st_ppo",
        turn_id=inputs_backup["turn_id"],
    ).loss / trainer.current_gradient_accumulation_steps
    torch.testing.assert_close(trl_loss, direct)


def test_default_turn_inputs_shapes():
    class T:
        estimator = "mt_grpo"
        golds_column = "golds"

    turn_id = np.array([[0, 0, -1, -1, 1, 1], [0, 0, 0, -1, -1, -1]])
    inputs = [
        {"observations": ["Doc 1(Title: France) paris is the capital"], "golds": ["Paris"]},
        {"observations": [], "golds": ["Rome"]},
    ]
    out = retrieval_turn_inputs(T(), inputs, turn_id, np.array([1.0, 0.0]))
    np.testing.assert_array_equal(out["turn_rewards"], [[1.0, 1.0], [0.0, 0.0]])
    T.estimator = "a2tgpo"
    out = retrieval_turn_inputs(T(), inputs, turn_id, np.array([1.0, 0.0]))
    np.testing.assert_array_equal(out["info_gain"], [[1.0], [0.0]])
    T.estimator = "grpo"
    assert retrieval_turn_inputs(T(), inputs, turn_id, np.array([1.0, 0.0])) == {}


def test_kl_term_with_reference_model(tiny_policy, retriever, tmp_path):
    """beta > 0: TRL loads the reference model from the policy's path and the trainer adds the
    k3 KL term to turnwise's loss (zero at the first step: the policy is the reference)."""
    model, tok, _ = tiny_policy
    path = tmp_path / "policy"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    trainer = _trainer(tmp_path, (str(path), tok, None), retriever, steps=1, beta=0.04)
    seen = _record_loss_inputs(trainer)
    trainer.train()
    assert "ref_per_token_logps" in seen[0]
    kl = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert kl and all(np.isfinite(kl)) and abs(kl[0]) < 1e-5
