"""Cost of text observations and actions (shmvec.UnboundedText): steps/s of an
env that observes and answers ``chars`` characters, through UnboundedText
(inline UTF-8 rows, or spilled ones) against the same env through a pickled
space. Prints one CSV line per case.

    python dev/text_cost.py [--seconds 3] [--envs 8] [--workers 2]
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces

import shmvec


class AnyText(spaces.Space):
    """A space shmvec cannot give columns to: its values are pickled per step."""

    def __init__(self) -> None:
        super().__init__(None, None)

    def contains(self, x) -> bool:
        return isinstance(x, str)

    def sample(self, mask=None, probability=None) -> str:
        return ""

    def __eq__(self, other) -> bool:
        return isinstance(other, AnyText)

    def __hash__(self) -> int:
        return hash(AnyText)


class EchoEnv(gym.Env):
    """Observes ``chars`` characters (2-byte UTF-8 half of them), whatever the action."""

    def __init__(self, chars: int, pickled: bool) -> None:
        space = AnyText() if pickled else shmvec.UnboundedText()
        self.observation_space = self.action_space = space
        self.text = ("aé" * chars)[:chars]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.text, {}

    def step(self, action):
        return self.text, float(len(action)), False, False, {}


def run(chars: int, pickled: bool, text_bytes: int, args) -> float:
    fns = [lambda: EchoEnv(chars, pickled)] * args.envs
    envs = shmvec.ShmVectorEnv(fns, num_workers=args.workers, text_bytes=text_bytes)
    actions = tuple(("bé" * chars)[:chars] for _ in range(args.envs))
    envs.reset(seed=0)
    for _ in range(50):
        envs.step(actions)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        envs.step(actions)
        steps += args.envs
    rate = steps / (time.perf_counter() - started)
    envs.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print("case,chars,utf8_bytes,text_bytes,steps_per_s")
    cases = [
        ("unbounded-inline", 200, False, 4096),
        ("pickled-space", 200, True, 4096),
        ("unbounded-inline", 13_600, False, 32768),
        ("unbounded-spilled", 13_600, False, 4096),
        ("pickled-space", 13_600, True, 4096),
    ]
    for name, chars, pickled, text_bytes in cases:
        nbytes = len(("aé" * chars)[:chars].encode())
        rate = run(chars, pickled, text_bytes, args)
        print(f"{name},{chars},{nbytes},{text_bytes},{rate:.0f}", flush=True)


if __name__ == "__main__":
    np.random.seed(0)
    main()
