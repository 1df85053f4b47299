"""Drives `turnwise serve-env` with openenv-core's own client (GenericEnvClient over the /ws
session) and its `validate` check, for crates/turnwise/tests/openenv.rs.

    python3 drive_serve_env.py SPEC_JSON

SPEC_JSON holds a served search world ({"url", "question", "prompt", "answer", "search"}: a test
question, its prompt, a turn answering it and a turn searching) and a served FrozenLake
({"url", "question", "moves"}: test map 0's rules and board and the solver's moves). Prints one
line per check; exits non-zero on the first failure.
"""

import json
import sys

import requests
from openenv.cli._validation import validate_running_environment
from openenv.core import GenericEnvClient


def check(ok, what):
    if not ok:
        raise SystemExit(f"FAILED: {what}")


spec = json.loads(sys.argv[1])
search, game = spec["search"], spec["game"]

for url in (search["url"], game["url"]):
    report = validate_running_environment(url)
    failed = [c for c in report["criteria"] if not c["passed"]]
    check(report["passed"], f"openenv validate {url}: {failed}")
    schema = requests.get(f"{url}/schema", timeout=10).json()
    check(schema["action"]["required"] == ["message"], f"action schema {schema['action']}")
print("validate passed")

with GenericEnvClient(base_url=search["url"]).sync() as env:
    # An answer turn: the question at the reset, EM 1 and the end at the step.
    r = env.reset(split="test", index=0)
    obs = r.observation
    check(obs["text"] == search["question"], f"question {obs['text']!r}")
    check(obs["prompt"] == search["prompt"], f"prompt {obs['prompt']!r}")
    check(obs["split"] == "test" and obs["index"] == 0, f"episode {obs}")
    check(r.reward is None and r.done is False, f"reset reward/done {r}")
    r = env.step({"message": search["answer"]})
    check(r.done is True and r.reward == 1.0 and r.observation["won"] is True, f"answer {r}")
    state = env.state()
    check(state["step_count"] == 1 and state["split"] == "test", f"state {state}")
    # A search turn in a new episode of the same session: passages in the format's block.
    r = env.reset(split="test", seed=0)
    check(r.observation["text"] == search["question"], "seed 0 is index 0")
    r = env.step({"message": search["search"]})
    text = r.observation["text"]
    check(r.done is False and r.reward == 0.0, f"search {r}")
    check(text.startswith("\n\n<information>Doc 1(Title:") and text.endswith("</information>\n\n"), text)
    # An unknown message type is an error the client raises.
    try:
        env.step({"text": "no message field"})
        check(False, "a step without `message` was accepted")
    except RuntimeError as e:
        check("VALIDATION_ERROR" in str(e), str(e))
print("search episodes ok")

# The stateless HTTP reset, as OpenEnv 0.3 serves it.
r = requests.post(f"{game['url']}/reset", json={"split": "test", "index": 0}, timeout=10).json()
check(r["observation"]["text"] == game["question"] and r["done"] is False, f"HTTP reset {r}")

with GenericEnvClient(base_url=game["url"]).sync() as env:
    r = env.reset(split="test", index=0)
    check(r.observation["text"] == game["question"], "map 0")
    rewards = []
    for k, move in enumerate(game["moves"]):
        r = env.step({"message": move})
        rewards.append(r.reward)
        last = k == len(game["moves"]) - 1
        check(r.done is last, f"move {k}: done {r.done}")
        check(r.observation["valid_action"] is True, f"move {k}: {r.observation}")
        if not last:
            check(r.observation["text"].startswith("\nboard: "), r.observation["text"])
    check(rewards[-1] == 1.0 and r.observation["won"] is True, f"rewards {rewards}")
print("game episode ok")
