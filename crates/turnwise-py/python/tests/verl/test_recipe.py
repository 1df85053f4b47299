"""The verl recipe (examples/verl): its data rows, its search tool loaded by verl's own
function-tool loader and called against `turnwise serve-retriever`, its reward, and its
overrides composed with verl's own hydra config. (The training run itself needs GPUs and a
rollout engine; docs/scaling.md says so.)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("TURNWISE_VERL_REQUIRED") != "1":
    pytest.importorskip("verl")

import pandas as pd  # noqa: E402

from turnwise.verl import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # noqa: E402
from turnwise.verl.data import DATA_SOURCE, verl_rows, write_parquet  # noqa: E402

REPO = Path(__file__).resolve().parents[5]
EXAMPLES = REPO / "examples" / "verl"


def _binary() -> Path:
    env = os.environ.get("TURNWISE_BIN")
    if env:
        return Path(env)
    for p in (REPO / "target" / "debug" / "turnwise", REPO / "target" / "release" / "turnwise"):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    pytest.fail("no turnwise binary: build it (cargo build) or set TURNWISE_BIN")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """`turnwise data world` + `index` + `serve-retriever`, as examples/verl/search_r1.sh runs
    them: `(world dir, retrieve URL)`."""
    binary = _binary()
    d = tmp_path_factory.mktemp("verl-world")
    subprocess.run([str(binary), "-q", "data", "world", "--out", str(d / "world")], check=True)
    subprocess.run(
        [str(binary), "-q", "index", "--corpus", str(d / "world" / "corpus.jsonl"), "--out", str(d / "index")], check=True
    )
    port = _free_port()
    proc = subprocess.Popen(
        [str(binary), "-q", "serve-retriever", "--index", str(d / "index"), "--addr", f"127.0.0.1:{port}", "--topk", "3"]
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("retrieval server did not start") from None
                time.sleep(0.2)
        yield d / "world", base + "/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _questions(world_dir: Path, split: str) -> list:
    return [json.loads(line) for line in (world_dir / f"{split}.jsonl").read_text().splitlines() if line.strip()]


def test_data_rows_carry_the_ground_truths(world, tmp_path):
    world_dir, _ = world
    qs = _questions(world_dir, "train")
    n = write_parquet(str(world_dir / "train.jsonl"), str(tmp_path / "train.parquet"))
    df = pd.read_parquet(tmp_path / "train.parquet")
    assert n == len(qs) == len(df)
    row = df.iloc[3]
    assert row["data_source"] == DATA_SOURCE
    assert row["agent_name"] == "tool_agent"
    assert list(row["reward_model"]["ground_truth"]["target"]) == qs[3]["golden_answers"]
    prompt = list(row["prompt"])
    assert prompt[0]["role"] == "user" and qs[3]["question"] in prompt[0]["content"]
    from turnwise.verl.trainer import ground_truth_answer

    assert ground_truth_answer(row["reward_model"]) == qs[3]["golden_answers"][0]


def test_data_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["a"]}\n{"question": "no answers"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing `golden_answers`"):
        verl_rows(str(bad))


def test_search_tool_through_verls_loader_queries_turnwise(world, monkeypatch):
    world_dir, url = world
    monkeypatch.setenv("TURNWISE_RETRIEVER_URL", url)
    from verl.tools.function_tool import load_function_tools_from_path

    tools = {t.name: t for t in load_function_tools_from_path(str(EXAMPLES / "search_tool.py"))}
    tool = tools["search"]
    schema = tool.tool_schema.model_dump()
    assert "query" in schema["function"]["parameters"]["properties"]
    q = _questions(world_dir, "train")[0]
    subject = q["metadata"]["subject"]
    out = asyncio.run(tool.call({"query": subject}))
    text = out if isinstance(out, str) else json.dumps(out, default=str)
    assert text.startswith("Doc 1(Title: ") and subject in text
    from turnwise.retrieval import RetrieverClient, format_information

    assert text == format_information(RetrieverClient(url, topk=3).retrieve([subject])[0])


def test_reward_is_em_of_the_last_answer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("turnwise_verl_reward", EXAMPLES / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    gt = {"target": ["Normuntha Works", "Normuntha"]}
    assert mod.compute_score(DATA_SOURCE, "<think>x</think><answer> normuntha </answer>", gt) == 1.0
    assert mod.compute_score(DATA_SOURCE, "<answer>Taltal</answer> then <answer>Normuntha Works</answer>", gt) == 1.0
    assert mod.compute_score(DATA_SOURCE, "<answer>Taltal</answer>", gt) == 0.0
    assert mod.compute_score(DATA_SOURCE, "no answer at all", gt) == 0.0
    assert mod.compute_score(DATA_SOURCE, "<answer>x</answer>", ["x"]) == 1.0


def _overrides(tmp: Path) -> list:
    out = []
    for line in (EXAMPLES / "search_r1_a2tgpo.overrides").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        out.append(line.replace("{DATA}", str(tmp)).replace("{MODEL}", "/models/policy").replace("{EXAMPLES}", str(EXAMPLES)))
    return out


def test_recipe_overrides_compose_with_verls_config(tmp_path):
    """Every override names a key of verl 0.9.1's ppo_trainer config (hydra refuses unknown
    keys), the actor section builds verl's ActorConfig, and the names it selects are
    registered."""
    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = str(Path(main_ppo.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=_overrides(tmp_path))
    assert cfg.trainer.use_v1 is False
    assert cfg.algorithm.adv_estimator == "turnwise_a2tgpo" in ADVANTAGE_ESTIMATORS
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    assert loss_mode == "turnwise_a2tgpo" and loss_mode in POLICY_LOSSES
    assert core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator) is not None
    assert core_algos.get_policy_loss_fn(loss_mode) is not None
    assert cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path == str(EXAMPLES / "search_tool.py")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.003, 0.004)
    assert actor.loss_agg_mode == "seq-mean-token-mean"
    # A2TGPO App. B.4: 64 prompts x 16 rollouts, mini-batch 8 prompts -> 8 optimizer steps a
    # batch (verl counts ppo_mini_batch_size in prompts and multiplies it by rollout.n).
    assert cfg.actor_rollout_ref.rollout.n == 16
    assert cfg.data.train_batch_size == 64
    assert cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    from turnwise.verl.trainer import check_config

    check_config(cfg)  # no KL-in-reward, no bypass mode


def test_recipe_script_parses():
    subprocess.run(["bash", "-n", str(EXAMPLES / "search_r1.sh")], check=True)
    out = subprocess.run(["bash", str(EXAMPLES / "search_r1.sh")], capture_output=True, text=True)
    assert out.returncode == 2 and "Search-R1-style" in out.stdout
