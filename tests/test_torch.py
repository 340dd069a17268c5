"""The torch bridge: the CPU path everywhere, the CUDA path where a GPU is present."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmvec  # noqa: E402
from shmvec.torch import SMALL_RESULT_BYTES, TorchVectorEnv  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cartpoles(n=4, **kwargs):
    return shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * n, num_workers=2, **kwargs)


def dict_envs(n=4):
    def make():
        return gym.wrappers.TransformObservation(
            gym.make("CartPole-v1"),
            lambda o: {"pos": o[:2], "flag": np.int64(o[0] > 0)},
            gym.spaces.Dict(
                pos=gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), flag=gym.spaces.Discrete(2)
            ),
        )

    return shmvec.ShmVectorEnv([make] * n, num_workers=2)


def test_cpu_tensors_equal_numpy_results():
    envs = TorchVectorEnv(cartpoles())
    reference = cartpoles()
    obs, _ = envs.reset(seed=3)
    expected, _ = reference.reset(seed=3)
    assert isinstance(obs, torch.Tensor) and np.array_equal(obs.numpy(), expected)
    for t in range(60):
        actions = torch.tensor([t % 2, 1, 0, 1])
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        want = reference.step(actions.numpy())
        assert np.array_equal(obs.numpy(), want[0])
        assert rewards.dtype == torch.float32 and np.array_equal(rewards.numpy(), want[1])
        assert terminations.dtype == torch.bool
        assert np.array_equal(terminations.numpy(), want[2])
        assert np.array_equal(truncations.numpy(), want[3])
    envs.close()
    reference.close()


def test_cpu_tensors_are_views_of_the_ring_with_copy_false():
    envs = TorchVectorEnv(cartpoles(copy=False))
    obs, _ = envs.reset(seed=0)
    shm = envs.shm
    handoff = shm.handoff()
    ring_obs = handoff.slot_views(handoff.last_slot).obs[0]
    assert obs.data_ptr() == ring_obs.ctypes.data  # zero-copy
    kept = obs.clone()
    obs2, *_ = envs.step(torch.zeros(4, dtype=torch.int64))
    assert torch.equal(obs, kept)  # still valid one step later (ring_depth=2)
    assert obs2.data_ptr() != obs.data_ptr()
    envs.close()


def test_dict_observations_and_numpy_actions():
    envs = TorchVectorEnv(dict_envs())
    obs, _ = envs.reset(seed=1)
    assert set(obs) == {"pos", "flag"} and obs["flag"].dtype == torch.int64
    obs, rewards, *_ = envs.step(np.ones(4, dtype=np.int64))
    assert tuple(obs["pos"].shape) == (4, 2) and tuple(rewards.shape) == (4,)
    envs.close()


def test_bad_tensor_actions_are_refused_before_the_workers():
    envs = TorchVectorEnv(cartpoles())
    envs.reset(seed=0)
    with pytest.raises(ValueError, match="shape"):
        envs.step(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="cannot be cast"):
        envs.step(torch.zeros(4, dtype=torch.float32))
    obs, *_ = envs.step(torch.zeros(4, dtype=torch.int64))  # still usable
    assert tuple(obs.shape) == (4, 4)
    envs.close()


def test_async_send_recv_with_tensors():
    envs = TorchVectorEnv(cartpoles(n=6, batch_size=3))
    envs.shm.async_reset(seed=0)
    obs, rewards, terminations, truncations, infos = envs.recv()
    for _ in range(20):
        envs.send(torch.ones(3, dtype=torch.int64), torch.as_tensor(infos["env_id"]))
        obs, rewards, terminations, truncations, infos = envs.recv()
        assert tuple(obs.shape) == (3, 4) and len(infos["env_id"]) == 3
    envs.close()


def test_async_partial_recv_with_tensors():
    envs = TorchVectorEnv(cartpoles(n=6, batch_size=4))
    envs.shm.async_reset(seed=0)
    ids = [envs.recv()[4]["env_id"], envs.recv(partial=True)[4]["env_id"]]
    assert sorted(np.concatenate(ids).tolist()) == list(range(6))
    envs.send(torch.ones(2, dtype=torch.int64), torch.as_tensor([1, 4]))
    obs, rewards, terminations, truncations, infos = envs.recv(partial=True)
    assert tuple(obs.shape) == (2, 4) and tuple(rewards.shape) == (2,)
    assert tuple(terminations.shape) == tuple(truncations.shape) == (2,)
    assert sorted(infos["env_id"].tolist()) == [1, 4]
    envs.close()


def test_refuses_other_vector_envs():
    with pytest.raises(TypeError, match="needs a ShmVectorEnv"):
        TorchVectorEnv(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")]))


@needs_cuda
@pytest.mark.parametrize("small_result_bytes", [SMALL_RESULT_BYTES, 0], ids=["blocking", "span"])
def test_cuda_results_equal_numpy_results_and_slots_wait_for_copies(small_result_bytes):
    """Both CUDA paths: a small result's blocking copies, and (with the size
    bound at 0) the span copy whose event a slot's reuse waits for."""
    torch.cuda.init()  # CUDA initialized before the env forks its workers
    envs = TorchVectorEnv(cartpoles(n=8), device="cuda", small_result_bytes=small_result_bytes)
    reference = cartpoles(n=8)
    obs, _ = envs.reset(seed=5)
    expected, _ = reference.reset(seed=5)
    assert obs.is_cuda and np.array_equal(obs.cpu().numpy(), expected)
    assert torch.from_numpy(envs.shm._action_views[0]).is_pinned()
    kept = []
    for t in range(200):
        actions = torch.full((8,), t % 2, dtype=torch.int64, device="cuda")
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        want = reference.step(np.full(8, t % 2))
        kept.append((obs, want[0]))
        assert np.array_equal(rewards.cpu().numpy(), want[1])
        assert np.array_equal(terminations.cpu().numpy(), want[2])
    # Device tensors own their memory: none was overwritten by later steps.
    for got, want in kept:
        assert np.array_equal(got.cpu().numpy(), want)
    envs.close()
    reference.close()


@needs_cuda
def test_cuda_dict_observations():
    envs = TorchVectorEnv(dict_envs(), device="cuda")
    obs, _ = envs.reset(seed=0)
    assert obs["pos"].is_cuda and obs["flag"].is_cuda
    envs.step(torch.zeros(4, dtype=torch.int64, device="cuda"))
    envs.close()


def test_tensor_actions_go_through_wrappers_in_between():
    from gymnasium.wrappers.vector import RecordEpisodeStatistics

    envs = TorchVectorEnv(RecordEpisodeStatistics(cartpoles()))
    envs.reset(seed=0)
    episodes = 0
    for _ in range(200):
        *_, terminations, truncations, infos = envs.step(torch.zeros(4, dtype=torch.int64))
        if "episode" in infos:
            episodes += int(infos["_episode"].sum())
    assert episodes > 0 and len(envs.env.return_queue) == episodes
    envs.close()


@needs_cuda
def test_envs_and_restarts_after_cuda_work_never_kill_a_worker():
    """Create, close and re-create envs, and restart a killed worker,
    in a process that has used CUDA and registered then unregistered a segment."""
    envs = TorchVectorEnv(cartpoles(n=4), device="cuda")
    envs.reset(seed=0)
    envs.step(torch.zeros(4, dtype=torch.int64, device="cuda"))
    envs.close()
    for _ in range(2):
        plain = cartpoles(n=4, on_worker_death="restart")
        reference = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
        try:
            obs, _ = plain.reset(seed=1)
            assert np.array_equal(obs, reference.reset(seed=1)[0])
            actions = np.array([1, 0, 1, 0])
            for _ in range(20):
                got, want = plain.step(actions), reference.step(actions)
                for a, b in zip(got[:4], want[:4]):
                    np.testing.assert_array_equal(a, b)
            assert plain.stats()["worker_restarts"] == 0  # no worker died by itself
            plain._pool.workers[0].kill()
            plain._pool.workers[0].join()
            plain.step(actions)  # restarted, after CUDA work: must not abort
            plain.step(actions)
            assert plain.stats()["worker_restarts"] == 1
        finally:
            plain.close()
            reference.close()


def _tuple_envs(n=4):
    def make():
        return gym.wrappers.TransformObservation(
            gym.make("CartPole-v1"),
            lambda o: (o.astype(np.float64), np.uint8(o[0] > 0)),
            gym.spaces.Tuple(
                (gym.spaces.Box(-np.inf, np.inf, (4,), np.float64), gym.spaces.Discrete(2))
            ),
        )

    return shmvec.ShmVectorEnv([make] * n, num_workers=2, copy=False)


def _assert_same_tree(tensors, arrays):
    if isinstance(arrays, dict):
        assert tensors.keys() == arrays.keys()
        for key in arrays:
            _assert_same_tree(tensors[key], arrays[key])
    elif isinstance(arrays, tuple):
        assert len(tensors) == len(arrays)
        for t, a in zip(tensors, arrays):
            _assert_same_tree(t, a)
    else:
        assert isinstance(tensors, torch.Tensor) and tensors.shape == arrays.shape
        assert tensors.dtype == torch.from_numpy(arrays[:0]).dtype
        np.testing.assert_array_equal(tensors.numpy(), arrays)


@pytest.mark.parametrize("make", [cartpoles, dict_envs, _tuple_envs], ids=["box", "dict", "tuple"])
def test_span_packer_copies_a_result_as_one_span(make):
    """The CUDA bridge's one-copy hand-off, run on the CPU: every leaf of a step's
    result is a view of one copied span, equal to what the env returned."""
    from shmvec.torch import SpanPacker

    envs = make(copy=False) if make is cartpoles else make()
    envs.copy = False
    try:
        handoff = envs.handoff()
        packer = SpanPacker(handoff.region, torch.device("cpu"), torch.float32)
        obs, _ = envs.reset(seed=0)
        span = packer.span([obs])
        assert span is not None
        (copied,) = packer.copy(span)
        _assert_same_tree(copied, obs)
        for t in range(30):
            result = list(envs.step(np.full(4, t % 2)))[:4]
            span = packer.span(result)
            start, end = span.start, span.end
            # One span holds every leaf and at most a cache line of padding each.
            leaves = list(_numpy_leaves(result))
            assert sum(a.nbytes for a in leaves) <= end - start
            assert end - start <= sum(a.nbytes + 63 for a in leaves)
            copied = packer.copy(span)
            _assert_same_tree(copied[0], result[0])
            assert copied[1].dtype == torch.float32
            np.testing.assert_array_equal(copied[1].numpy(), result[1].astype(np.float32))
            assert copied[2].dtype == torch.bool and copied[3].dtype == torch.bool
            np.testing.assert_array_equal(copied[2].numpy(), result[2])
            np.testing.assert_array_equal(copied[3].numpy(), result[3])
            # The copy owns its memory: the ring moving on does not change it.
            assert copied[1].data_ptr() != result[1].ctypes.data
    finally:
        envs.close()


def _numpy_leaves(result):
    for leaf in result:
        if isinstance(leaf, dict):
            yield from _numpy_leaves(list(leaf.values()))
        elif isinstance(leaf, tuple):
            yield from _numpy_leaves(list(leaf))
        else:
            yield leaf


def test_span_packer_async_rows_and_refusals():
    from shmvec.torch import SpanPacker

    envs = cartpoles(n=8, batch_size=4, copy=False)
    try:
        packer = SpanPacker(envs.handoff().region, torch.device("cpu"), torch.float64)
        envs.async_reset(seed=1)
        for _ in range(20):
            obs, rewards, terminations, truncations, infos = envs.recv()
            result = [obs, rewards, terminations, truncations]
            copied = packer.copy(packer.span(result))
            np.testing.assert_array_equal(copied[0].numpy(), obs)
            np.testing.assert_array_equal(copied[1].numpy(), rewards)
            envs.send(np.ones(4, dtype=np.int64), infos["env_id"])
        # A partial batch (its slot's first rows) is one span too.
        envs.recv()
        envs.recv()  # every env idle
        envs.send(np.ones(3, dtype=np.int64), [1, 4, 6])
        obs, rewards, terminations, truncations, infos = envs.recv(partial=True)
        assert sorted(infos["env_id"].tolist()) == [1, 4, 6]
        copied = packer.copy(packer.span([obs, rewards, terminations, truncations]))
        np.testing.assert_array_equal(copied[0].numpy(), obs)
        np.testing.assert_array_equal(copied[1].numpy(), rewards)
        # Arrays that are not views of the ring, or not numeric, have no span.
        assert packer.span([obs.copy()]) is None
        assert packer.span([(obs, "text")]) is None
        assert packer.span([obs[:, ::2]]) is None  # not contiguous
    finally:
        envs.close()
