"""Steps the installed shmvec against gymnasium's SyncVectorEnv and records the arrays, so
that two builds (a zig-built manylinux wheel and a gcc build, say) can be compared bit for
bit.

    python dev/stepping_record.py record OUT.npz     # checks against SyncVectorEnv, writes
    python dev/stepping_record.py compare A.npz B.npz

``record`` runs each case below with fixed seeds and actions, in sync mode, for both
``ShmVectorEnv`` and ``SyncVectorEnv``; it fails unless every observation, reward,
termination and truncation is bit-identical between the two, and writes shmvec's arrays to
OUT.npz. ``compare`` fails unless two records hold the same arrays, bit for bit. It prints
where shmvec was imported from, so that a record says which build it is of.
"""

from __future__ import annotations

import argparse
import sys

import gymnasium as gym
import numpy as np

#: name: (env id, num_envs, num_workers, steps). Float dynamics (Pendulum, Acrobot's RK4)
#: and integer actions (CartPole), each with autoresets within the steps.
CASES = {
    "cartpole": ("CartPole-v1", 8, 2, 300),
    "pendulum": ("Pendulum-v1", 6, 2, 250),
    "acrobot": ("Acrobot-v1", 4, 2, 600),
}
FIELDS = ("obs", "reward", "terminated", "truncated")


def run_case(make_vec, env_id: str, num_envs: int, steps: int, seed: int) -> dict[str, np.ndarray]:
    """Steps one vector env from ``reset(seed=seed)`` on seeded actions; stacks the results."""
    envs = make_vec([lambda: gym.make(env_id)] * num_envs)
    try:
        envs.action_space.seed(seed)
        obs, _ = envs.reset(seed=seed)
        out: dict[str, list] = {name: [] for name in FIELDS}
        out["obs"].append(np.array(obs))
        for _ in range(steps):
            obs, reward, terminated, truncated, _ = envs.step(envs.action_space.sample())
            for name, value in zip(FIELDS, (obs, reward, terminated, truncated)):
                out[name].append(np.array(value))
    finally:
        envs.close()
    return {name: np.stack(values) for name, values in out.items()}


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (NaNs and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def record(path: str) -> int:
    import shmvec

    print(f"shmvec {shmvec.__version__} from {shmvec.__file__}")
    arrays: dict[str, np.ndarray] = {}
    failed = []
    for case, (env_id, num_envs, workers, steps) in CASES.items():
        got = run_case(
            lambda fns, w=workers: shmvec.ShmVectorEnv(fns, num_workers=w),
            env_id,
            num_envs,
            steps,
            seed=12345,
        )
        want = run_case(gym.vector.SyncVectorEnv, env_id, num_envs, steps, seed=12345)
        differing = [name for name in FIELDS if not bit_equal(got[name], want[name])]
        failed += [f"{case}/{name}" for name in differing]
        arrays.update({f"{case}/{name}": got[name] for name in FIELDS})
        print(f"{case}: {steps} steps x {num_envs} envs, {'differs' if differing else 'identical'}")
    np.savez(path, **arrays)
    if failed:
        print(f"differs from SyncVectorEnv: {', '.join(failed)}")
        return 1
    print(f"bit-identical to SyncVectorEnv; written to {path}")
    return 0


def compare(path_a: str, path_b: str) -> int:
    a, b = np.load(path_a), np.load(path_b)
    keys = sorted(set(a.files) | set(b.files))
    differing = [k for k in keys if k not in a or k not in b or not bit_equal(a[k], b[k])]
    if differing:
        print(f"{path_a} and {path_b} differ: {', '.join(differing)}")
        return 1
    print(f"{path_a} and {path_b}: {len(keys)} arrays, bit-identical")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("out")
    both = sub.add_parser("compare")
    both.add_argument("a")
    both.add_argument("b")
    args = parser.parse_args(argv)
    return record(args.out) if args.command == "record" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
