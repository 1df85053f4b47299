"""A guess-the-number environment written with openenv-core's server API, for turnwise's tests.

    python3 guess_env.py PORT [LOG]

serves it on 127.0.0.1:PORT with uvicorn (OpenEnv's HTTP routes and the /ws session, up to 64
sessions at once). With LOG, every observation it sends is appended to that file as a JSON line
({"kind": "reset" | "step", "seed", "message", "prompt", "reward", "done"}), so a test can check
that what the agent read is exactly what the server sent.

The number of game `seed` is (7 * seed + 3) mod 10; the player has three tries. A right guess
earns 1.0 and ends the game, any other guess -0.125.
"""

import json
import sys
import threading

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_TRIES = 3
LOG = sys.argv[2] if len(sys.argv) > 2 else None
_LOCK = threading.Lock()


def log(record):
    if LOG:
        with _LOCK, open(LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


class GuessAction(Action):
    message: str = Field(..., description="The player's guess")


class GuessObservation(Observation):
    prompt: str = Field(default="", description="What the player reads")
    tries_left: int = Field(default=0, description="Guesses left")


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.seed = 0
        self.target = 0
        self.tries = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.seed = seed or 0
        self.target = (7 * self.seed + 3) % 10
        self.tries = 0
        self._state = State(episode_id=episode_id or f"guess-{self.seed}", step_count=0)
        prompt = f"Game {self.seed}: guess my number from 0 to 9 — you have {MAX_TRIES} tries."
        log({"kind": "reset", "seed": self.seed, "prompt": prompt})
        return GuessObservation(prompt=prompt, tries_left=MAX_TRIES, done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        self.tries += 1
        self._state.step_count += 1
        digits = [c for c in action.message if c.isdigit()]
        done = self.tries >= MAX_TRIES
        reward = -0.125
        if not digits:
            prompt = "I read no number in «that»; say one digit."
        else:
            guess = int(digits[0])
            if guess == self.target:
                prompt, reward, done = f"Yes! {guess} is my number.", 1.0, True
            elif guess < self.target:
                prompt = f"{guess} is too low."
            else:
                prompt = f"{guess} is too high."
        log(
            {
                "kind": "step",
                "seed": self.seed,
                "message": action.message,
                "prompt": prompt,
                "reward": reward,
                "done": done,
            }
        )
        return GuessObservation(
            prompt=prompt, tries_left=MAX_TRIES - self.tries, done=done, reward=reward
        )

    @property
    def state(self):
        return self._state


app = create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
