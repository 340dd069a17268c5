"""What each candidate data path of a cluster vector env costs the driver per message.

One actor on a simulated node (``ray.cluster_utils.Cluster``) sends ``--messages``
messages of ``--rows`` rows (a float64 observation of ``--obs`` values, a reward, two
flags and an env id per row) to the driver, one at a time, as each is asked for (the
pattern of results that arrive as envs finish). Measured: the driver's CPU per message
(``time.process_time``, Ray's driver threads included) and the round trip, for

- ``actor-call``: one ``ready.remote()`` call per message, ``ray.wait`` + ``ray.get``
  (what ``ClusterVectorEnv`` does);
- ``generator``: a Ray streaming generator (``num_returns="streaming"``) that yields the
  messages; the driver iterates its references;
- ``channel``: a ``multiprocessing.connection`` TCP connection that the actor opens and
  whose address it returns through Ray; pickled messages, no Ray on the path.

    python dev/ray_channels.py --messages 2000 --rows 4
"""

from __future__ import annotations

import argparse
import platform
import threading
import time
from multiprocessing.connection import Client, Listener

import numpy as np
import ray
from ray import cluster_utils

AUTHKEY = b"shmvec-channel-bench"


def message(rows: int, obs: int, i: int) -> tuple:
    return (
        np.full((rows, obs), float(i)), np.zeros(rows), np.zeros(rows, bool),
        np.zeros(rows, bool), {"env_id": np.arange(rows)},
    )  # fmt: skip


@ray.remote(num_cpus=1, max_concurrency=4)
class Source:
    def __init__(self, rows: int, obs: int) -> None:
        self.rows, self.obs, self.i = rows, obs, 0
        self.listener: Listener | None = None

    def ready(self) -> tuple:
        self.i += 1
        return message(self.rows, self.obs, self.i)

    def stream(self, n: int):
        for i in range(n):
            yield message(self.rows, self.obs, i)

    def open_channel(self) -> tuple:
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
        threading.Thread(target=self._serve, daemon=True).start()
        return self.listener.address

    def _serve(self) -> None:
        assert self.listener is not None
        conn = self.listener.accept()
        i = 0
        while True:
            try:
                conn.recv_bytes()  # the driver asks (an action batch in the real thing)
            except EOFError:
                return
            i += 1
            conn.send(message(self.rows, self.obs, i))


def actor_call(source, n: int) -> tuple[float, float]:
    ref = source.ready.remote()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        done, _ = ray.wait([ref], num_returns=1)
        ray.get(done[0])
        ref = source.ready.remote()
    ray.get(ref)
    return time.process_time() - cpu0, time.perf_counter() - t0


def generator(source, n: int) -> tuple[float, float]:
    stream = source.stream.remote(n)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for ref in stream:
        ray.get(ref)
    return time.process_time() - cpu0, time.perf_counter() - t0


def channel(source, n: int) -> tuple[float, float]:
    conn = Client(tuple(ray.get(source.open_channel.remote())), authkey=AUTHKEY)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        conn.send_bytes(b"next")
        conn.recv()
    out = time.process_time() - cpu0, time.perf_counter() - t0
    conn.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--obs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 << 20}
    )
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        source = Source.remote(args.rows, args.obs)
        ray.get(source.ready.remote())
        paths = {"actor-call": actor_call, "generator": generator, "channel": channel}
        print(
            f"# python dev/ray_channels.py --messages {args.messages} --rows {args.rows} "
            f"--obs {args.obs} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
        )
        print(
            f"# {platform.node()} {platform.machine()}, Python {platform.python_version()}, "
            f"ray {ray.__version__}; one simulated node; alternated, {args.repeats} rounds"
        )
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                runs[name].append(fn(source, args.messages))
        print(f"{'path':12} {'driver CPU us/msg':>18} {'round trip us':>14}")
        for name, results in runs.items():
            cpu = np.median([c for c, _ in results]) / args.messages * 1e6
            wall = np.median([w for _, w in results]) / args.messages * 1e6
            print(f"{name:12} {cpu:18.1f} {wall:14.1f}")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
