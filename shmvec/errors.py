"""Exceptions of shmvec. Misuse of the vector env API raises gymnasium's own
errors (``AlreadyPendingCallError``, ``NoAsyncCallError``,
``ClosedEnvironmentError``); these cover what gymnasium has no error for."""

from __future__ import annotations


class WorkerDiedError(RuntimeError):
    """A worker process exited while the main process waited for it.

    Attributes:
        worker: the worker's index.
        env_ids: the envs it owned.
        exitcode: its exit status; negative for a signal, as in multiprocessing;
            None if another waiter of the program (``os.waitpid``) reaped it.
    """

    def __init__(self, worker: int, env_ids: range, exitcode: int | None, pid: int | None) -> None:
        import signal

        if exitcode is not None and exitcode < 0:
            try:
                how = f"killed by signal {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"killed by signal {-exitcode}"
        elif exitcode is None:  # another waiter of the program reaped it first
            how = "exited (its exit status went to another waiter)"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(
            f"shmvec worker {worker} (pid {pid}, envs {env_ids.start}..{env_ids.stop - 1}) {how}"
        )
        self.worker = worker
        self.env_ids = env_ids
        self.exitcode = exitcode
        self.pid = pid

    def __reduce__(self):
        # Pickled with its arguments (Ray and multiprocessing carry it across
        # processes), and with its notes.
        return (type(self), (self.worker, self.env_ids, self.exitcode, self.pid), self.__dict__)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where it is only stored)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


class StepDeadlineExceeded(BaseException):
    """Raised inside an env's ``step``/``reset`` that ran past ``step_deadline``.

    A ``BaseException``, as ``KeyboardInterrupt`` is, so that an env's own
    ``except Exception`` cannot swallow it and carry on past the deadline. shmvec
    catches it in the worker and reports the step as truncated with
    ``infos["step_deadline"]``; it never reaches the main process.

    Attributes:
        deadline: the deadline in seconds.
    """

    def __init__(self, deadline: float) -> None:
        super().__init__(f"env step ran past step_deadline={deadline} s")
        self.deadline = deadline

    def __reduce__(self):
        return (type(self), (self.deadline,))


class WaitingEnvsWarning(UserWarning):
    """A vector env's workers spend most of each step waiting while they step
    their envs one after another: ``env_concurrency=`` would step the envs of a
    block at once (docs/guides/waiting-envs.md)."""


class EnvFailure(RuntimeError):
    """A leased env's ``reset`` or ``step`` failed (``shmvec.awaitable``): raised in
    the coroutine that awaited it, and in no other. The env was reset by its worker
    and is usable again after ``await env.reset(...)``.

    Attributes:
        env_id: the env's index in the vector env.
        tag: its tag (``make_mix``'s ``env_tags``), or None.
        what: ``"env_error"``, ``"deadline"``, ``"worker_died"`` or ``"node_lost"``.
        detail: what the vector env reported (the env's exception, the deadline).
    """

    what = "failure"

    def __init__(self, env_id: int, tag: str | None, call: str, detail: str) -> None:
        named = f"env {env_id}" + (f" (tag {tag!r})" if tag is not None else "")
        super().__init__(f"{named}: {call} {self.happened}: {detail}")
        self.env_id, self.tag, self.call, self.detail = env_id, tag, call, detail

    happened = "failed"

    def __reduce__(self):
        return (type(self), (self.env_id, self.tag, self.call, self.detail), self.__dict__)


class EnvStepError(EnvFailure):
    """The env raised inside ``reset``/``step`` (the vector env's ``on_env_error="reset"``)."""

    what = "env_error"
    happened = "raised"


class EnvDeadlineError(EnvFailure):
    """The env's call ran past the vector env's ``step_deadline``; the env was replaced."""

    what = "deadline"
    happened = "ran past step_deadline"


class EnvWorkerDiedError(EnvFailure):
    """The env's worker process died during the call and was restarted
    (``on_worker_death="restart"``); the env was re-created."""

    what = "worker_died"
    happened = "lost its worker"


class EnvNodeLostError(EnvWorkerDiedError):
    """The env's node agent (``shmvec.ray.ClusterVectorEnv``) was lost or drained during
    the call, or before it: the env's state is gone and the env takes no more work until
    its agent is back (``lost_env_ids``); lease another env."""

    what = "node_lost"
    happened = "lost its node"


class LeaseError(RuntimeError):
    """A leased env used wrongly: after its ``async with`` block ended, from a
    coroutine that does not hold it, or with a call already in flight."""
