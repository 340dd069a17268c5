"""Which multiprocessing start method workers get.

A process that has initialized CUDA cannot be forked safely: the child
inherits the driver's state, and the first CUDA call in it (a tensor or
stream freed by the garbage collector, an at-exit hook) aborts it with
"CUDA error: initialization error" (SIGABRT). PPO loops create envs, and
restart workers, after CUDA is in use, so with ``context=None`` shmvec
starts workers with ``forkserver`` there: the server is a fresh interpreter,
and every worker forked from it is free of CUDA. The env_fns then travel
pickled (cloudpickle), as with ``spawn``.

Forked workers start through ``ForkContext``, not multiprocessing's own fork
context: from Python 3.13 on, a forked child of multiprocessing first drops
the ``atexit`` callbacks it inherited (``atexit._clear()``), and whatever only
such a callback kept alive is destroyed in the child. An object whose teardown
needs its parent's threads then crashes the worker before it starts: Ray's
``cluster_utils.Cluster`` leaves each of its nodes (and the node's gRPC client
of the GCS) held by an ``atexit`` callback, and the client's destructor shuts
down a gRPC completion queue whose poller lives in the parent (SIGSEGV in
``pollset_shutdown``). shmvec's children keep the inherited callbacks, never
running them, as forked children did up to Python 3.12, and run their own.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.popen_fork
import multiprocessing.util
import os
import sys
from typing import Any

logger = logging.getLogger("shmvec")

# multiprocessing's own helpers for its fork Popen (typeshed lists neither).
_util: Any = multiprocessing.util

#: Used instead of the default fork once CUDA is initialized here.
CUDA_SAFE_METHOD = "forkserver"


def cuda_initialized() -> bool:
    """True if this process has initialized CUDA through torch (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support, a half-imported torch
        return False


def worker_context(context: str | None) -> multiprocessing.context.BaseContext:
    """The context to start workers with: ``context`` if given, else Python's
    default, unless that is fork and CUDA is initialized (then ``forkserver``).
    Fork is shmvec's ``FORK`` (see the module's docstring).

    An explicit ``context="fork"`` is honoured, with a warning, since a forked
    worker may abort once CUDA is initialized.
    """
    if context is None:
        default = multiprocessing.get_start_method(allow_none=True) or _platform_default()
        if default == "fork" and cuda_initialized():
            logger.info("CUDA is initialized in this process: workers use %s", CUDA_SAFE_METHOD)
            return multiprocessing.get_context(CUDA_SAFE_METHOD)
    elif context == "fork" and cuda_initialized():
        logger.warning(
            "context='fork' after CUDA was initialized: a worker may abort (SIGABRT) if "
            "anything in it touches CUDA; use context='forkserver' or 'spawn' (or None)"
        )
    ctx = multiprocessing.get_context(context)
    return FORK if ctx.get_start_method() == "fork" else ctx


def _platform_default() -> str:
    # The first is the platform's default; get_context() would fix it for good.
    return multiprocessing.get_all_start_methods()[0]


class _ForkPopen(multiprocessing.popen_fork.Popen):
    """multiprocessing's fork Popen, except that the child keeps the ``atexit``
    callbacks it inherited: it neither drops them (their objects' teardown
    would run in the child) nor runs them; it runs those registered in it."""

    def _launch(self, process_obj: Any) -> None:
        code = 1
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                # Registered before any of the child's own, so run after them and
                # before the inherited ones, which it never reaches.
                atexit.register(lambda: os._exit(code))
                atexit.register(_util._exit_function)
                os.close(parent_r)
                os.close(parent_w)
                code = process_obj._bootstrap(parent_sentinel=child_r)
            finally:
                atexit._run_exitfuncs()
                os._exit(code)
        else:
            os.close(child_w)
            os.close(child_r)
            self.finalizer = _util.Finalize(self, _util.close_fds, (parent_r, parent_w))
            self.sentinel = parent_r


class _ForkProcess(multiprocessing.context.ForkProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _ForkPopen:
        return _ForkPopen(process_obj)


class ForkContext(multiprocessing.context.ForkContext):
    """The fork start method, with children that keep their inherited ``atexit``
    callbacks (see the module's docstring)."""

    Process = _ForkProcess


#: What workers are forked with.
FORK = ForkContext()
