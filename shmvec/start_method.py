"""Which multiprocessing start method workers get.

A process that has initialized CUDA cannot be forked safely: the child
inherits the driver's state, and the first CUDA call in it (a tensor or
stream freed by the garbage collector, an at-exit hook) aborts it with
"CUDA error: initialization error" (SIGABRT). PPO loops create envs, and
restart workers, after CUDA is in use, so with ``context=None`` shmvec
starts workers with ``forkserver`` there: the server is a fresh interpreter,
and every worker forked from it is free of CUDA. The env_fns then travel
pickled (cloudpickle), as with ``spawn``.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys

logger = logging.getLogger("shmvec")

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
    return multiprocessing.get_context(context)


def _platform_default() -> str:
    # The first is the platform's default; get_context() would fix it for good.
    return multiprocessing.get_all_start_methods()[0]
