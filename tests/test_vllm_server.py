"""``shmvec.testing.vllm_server``'s clean-up, without vLLM: the semaphores a server's process
left behind are found, and none that a running process still maps."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from shmvec.testing.vllm_server import SHM_DIR, leaked_semaphores

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")

#: A process that makes a semaphore multiprocessing can share by name, then dies with its
#: resource tracker before either releases it: the file stays in /dev/shm, mapped by nobody.
LEAK = """
import multiprocessing, os, signal
from multiprocessing import resource_tracker
lock = multiprocessing.get_context("spawn").Lock()
resource_tracker.ensure_running()
print(lock._semlock.name, flush=True)
os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
os._exit(0)
"""


def test_a_semaphore_nobody_maps_is_found_and_one_in_use_is_not():
    before, since = set(os.listdir(SHM_DIR)), time.time()
    in_use = multiprocessing.get_context("spawn").Lock()  # mapped by this process
    name = subprocess.run(
        [sys.executable, "-c", LEAK], capture_output=True, text=True, check=True
    ).stdout.strip()
    leaked = os.path.join(SHM_DIR, "sem." + name.lstrip("/"))
    mine = os.path.join(SHM_DIR, "sem." + in_use._semlock.name.lstrip("/"))  # type: ignore[attr-defined]
    try:
        assert os.path.exists(leaked) and os.path.exists(mine)
        found = leaked_semaphores(before, since)
        assert leaked in found
        assert mine not in found
        assert not found & {os.path.join(SHM_DIR, n) for n in before}
        assert leaked not in leaked_semaphores(before | {os.path.basename(leaked)}, since)
    finally:
        if os.path.exists(leaked):
            os.unlink(leaked)
    del in_use
