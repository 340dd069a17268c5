"""The smoke test of an installed shmvec: steps ShmVectorEnv against gymnasium's
SyncVectorEnv and prints where shmvec was imported from (and, for the rebuild test
of tests/test_packaging.py, the markers a rebuilt module carries)."""

import gymnasium as gym
import numpy as np

import shmvec
from shmvec import _core, _worker_loop


def make():
    return gym.make("CartPole-v1")


if __name__ == "__main__":
    envs = shmvec.ShmVectorEnv([make] * 4, num_workers=2)
    ref = gym.vector.SyncVectorEnv([make] * 4)
    obs, _ = envs.reset(seed=7)
    ref_obs, _ = ref.reset(seed=7)
    np.testing.assert_array_equal(obs, ref_obs)
    for _ in range(50):
        actions = envs.action_space.sample()
        got, want = envs.step(actions), ref.step(actions)
        for a, b in zip(got[:4], want[:4]):
            np.testing.assert_array_equal(a, b)
    envs.close()
    ref.close()
    print("SHMVEC", shmvec.__version__, shmvec.__file__)
    print("CORE", _core.__file__)
    print("LOOP", _worker_loop.__file__)
    markers = getattr(_core, "_rebuild_marker", None), getattr(_worker_loop, "REBUILD_MARKER", None)
    print("MARKER", *markers)
