"""EngineOptions: how ``build_engine`` runs one vector env's workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """The ShmVectorEnv constructor options the engine's parts read.

    Example:
        >>> EngineOptions(copy=True, context=None).restart_on_death
        False
    """

    #: Return copies (True) or views of the ring.
    copy: bool = True
    #: multiprocessing start method (None: shmvec.start_method's default).
    context: str | None = None
    #: Whether worker processes are daemonic.
    daemon: bool = True
    #: Worker 0 runs in the main process (``InProcessWorker``).
    step_in_main: bool = False
    #: No worker process at all (``num_workers=0``): the segment needs no fd.
    in_process: bool = False
    #: Seconds a worker may take for one step or reset (None: no limit).
    env_timeout: float | None = None
    #: ``on_worker_death="restart"``: a dead worker is replaced.
    restart_on_death: bool = False
