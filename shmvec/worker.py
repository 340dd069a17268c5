"""The worker process: owns a contiguous block of envs and serves commands.

Data flow: the worker waits for work on its mode's wire (``SyncWire``: the step
barrier's next command; ``AsyncWire``: its doorbell, then any barrier command
and every env that has a command), does it for its envs through one
``_worker_loop.Block`` and reports. A sync round ends in ``Block.finish_round``:
write this worker's line, arrive, and only *then* send the message (infos,
errors, pickled values), so that a large message can never block a worker the
main process is still waiting for. An async env's result is a ring row it
claims and publishes. Payloads that are not arrays (reset seeds, ``call``
arguments) come on the worker's pipe before their command.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from shmvec import _core, _worker_loop
from shmvec.codecs import TEXT_BYTES, make_codec
from shmvec.concurrent_envs import ConcurrentEnvs
from shmvec.errors import StepDeadlineExceeded, add_note
from shmvec.layout import make_layout
from shmvec.outbox import Outbox
from shmvec.protocol import (
    AUTORESET_SAME_STEP,
    BY_VALUE_BIT,
    CALL,
    CLOSE,
    REGION_MASK,
    REGION_SHIFT,
    RESET,
    SET_ATTR,
    SLOT_MASK,
    STEP,
    WATCHDOG_NS,
)
from shmvec.spin import Spin
from shmvec.wires import AsyncWire, EnvRecovery, RoundRecovery, SyncWire, recovery_plan


@dataclass
class WorkerSpec:
    """Everything a worker needs; pickled (with cloudpickle) under spawn."""

    index: int
    first_env: int
    env_fns: Any  # list of callables, or their cloudpickle bytes
    num_envs: int
    num_workers: int
    num_slots: int  # ring slots
    batch_size: int  # rows per ring slot: num_envs in sync mode
    observation_space: Any
    action_space: Any
    observation_mode: str
    shared_memory: bool
    autoreset_mode: int
    spin: Spin  # how the worker's waits for work spin
    main_pid: int
    # PR_SET_PDEATHSIG fires when the *thread* that forked us exits: only
    # safe when that is the main thread. The watchdog covers the rest.
    use_death_signal: bool
    on_env_error: str = "raise"  # or "reset": see Worker.truncated_reset
    # A replacement for a dead worker starts at the round it died in, and
    # first does Worker.recover(recovery_plan(recover)).
    generation: int = 0
    # Sync mode: (command kind, the round's arg: ring slot and observation
    # region), see RoundRecovery. Async mode: ("async", plan), see EnvRecovery.
    recover: tuple | None = None
    info_schema: dict | None = None  # the dead worker's info columns, kept
    # Envs stepped at once at most (shmvec.concurrent_envs); None: up to the block.
    env_concurrency: int | None = None
    # Step on one CPU (_worker_cpu) alone: shmvec.spin.default_pinning.
    pin_cpu: bool = False
    # Lease regions in the segment (shmvec.layout.lease_regions; async mode: one
    # more per ring slot).
    obs_regions: int = 0
    # Inline UTF-8 bytes of each UnboundedText row (shmvec.codecs.Utf8TextCodec).
    text_bytes: int = TEXT_BYTES
    # Seconds one env's step or reset may take before it is ended as truncated
    # and the env replaced (Worker.deadline_result); None: no deadline. Only
    # honoured in a worker process (the main process's signals are the user's).
    step_deadline: float | None = None


class SegmentFd:
    """An fd that survives pickling into a spawn/forkserver child.

    multiprocessing's ``DupFd`` passes the fd next to the pickled process
    object, the way it passes Connection objects; under fork the int is
    simply inherited.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach_fd, (reduction.DupFd(self.fd),))


def _detach_fd(dup) -> SegmentFd:
    return SegmentFd(dup.detach())


def _safe_exception(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc} (unpicklable exception)")


def _send(pipe, message: dict) -> None:
    """Sends ``message``; one that cannot be pickled becomes an error for its envs."""
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an unpicklable info, obs or call result
        error = RuntimeError(f"a result cannot be sent to the main process: {exc!r}")
        rows = [row for row, _ in message.get("infos", ())] or [-1]
        replacement = {"errors": [(row, error, traceback.format_exc()) for row in rows]}
        if "row" in message:  # async mode: the main process reads it for that ring row
            replacement["row"] = message["row"]
        data = pickle.dumps(replacement)
    pipe.send_bytes(data)


def _watch_main(pid: int) -> None:
    """Exits this worker as soon as the main process ends, even mid-step.

    A pidfd becomes readable when the process exits (zombie or not); the
    death signal alone misses forkserver children (their parent is the
    forkserver) and envs built from a non-main thread.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        return  # no pidfds (old kernel/Python): the waits' watchdog remains

    def wait_then_exit() -> None:
        select.select([pidfd], [], [])
        os._exit(0)

    threading.Thread(target=wait_then_exit, name="shmvec-watchdog", daemon=True).start()


def _exit_if_main_gone(pid: int) -> None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        os._exit(0)
    except PermissionError:
        pass  # a process we may not signal: alive


def check_env(env, row: int) -> None:
    """A TypeError naming env_fns[row] if what it returned is not an env (by its
    shape: gymnasium itself does not insist on ``gymnasium.Env``)."""
    missing = [
        name for name in ("reset", "step", "observation_space", "action_space")
        if not hasattr(env, name)
    ]  # fmt: skip
    if missing:
        raise TypeError(
            f"env_fns[{row}] returned {type(env).__name__!r}, not an env: it has no "
            f"{', '.join(missing)}"
        )


def _check_spaces(spec: WorkerSpec, env, row: int) -> None:
    from gymnasium.spaces.utils import is_space_dtype_shape_equiv

    if spec.observation_mode == "same":
        if env.observation_space != spec.observation_space:
            raise RuntimeError(
                f"ShmVectorEnv(..., observation_mode='same') however some of the sub-environments "
                f"observation spaces are not equivalent. env {row} has "
                f"{env.observation_space}, env 0 has {spec.observation_space}. If this is "
                f"intentional, use `observation_mode='different'` instead."
            )
    elif not is_space_dtype_shape_equiv(env.observation_space, spec.observation_space):
        raise RuntimeError(
            f"ShmVectorEnv(..., observation_mode='different' or custom space) however the "
            f"sub-environment's observation spaces do not share a common shape and dtype: env "
            f"{row} has {env.observation_space}, expected {spec.observation_space}."
        )
    if env.action_space != spec.action_space:
        raise RuntimeError(
            f"Some environments have an action space different from `{spec.action_space}`: "
            f"env {row} has {env.action_space}. In order to batch actions, the action spaces "
            f"from all environments must be equal."
        )


def worker_main(spec: WorkerSpec, segment_fd: SegmentFd, pipe) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's
    if spec.use_death_signal:
        try:
            _core.set_parent_death_signal(signal.SIGKILL)
        except OSError:
            pass  # the watchdogs still notice
    _watch_main(spec.main_pid)
    try:
        segment = _core.Segment.attach(segment_fd.fd)
        os.close(segment_fd.fd)
        worker = Worker(spec, segment, pipe, make_envs(spec))
    except BaseException as exc:  # noqa: BLE001 - reported to the main process
        pipe.send_bytes(
            pickle.dumps({"startup_error": (_safe_exception(exc), traceback.format_exc())})
        )
        return
    ready: dict[str, Any] = {"ready": os.getpid()}
    plan = recovery_plan(spec.recover)
    if plan is not None:
        recovered = worker.recover(plan)
        if recovered is not None:
            ready["recovered"] = recovered
    _send(pipe, ready)
    try:
        worker.serve()
    finally:
        worker.outbox.close()
        pipe.close()


def load_env_fns(spec: WorkerSpec) -> list:
    """The block's env_fns (unpickled under spawn)."""
    env_fns = spec.env_fns
    return cloudpickle.loads(env_fns) if isinstance(env_fns, bytes) else list(env_fns)


def make_env(spec: WorkerSpec, env_fn, row: int):
    """``env_fn()``, checked to be an env whose spaces match the vector env's."""
    try:
        env = env_fn()
        check_env(env, row)
        _check_spaces(spec, env, row)
    except BaseException as exc:
        add_note(exc, f"(while creating env {row} in shmvec worker {spec.index})")
        raise
    return env


def make_envs(spec: WorkerSpec) -> list:
    envs: list = []
    for offset, env_fn in enumerate(load_env_fns(spec)):
        try:
            envs.append(make_env(spec, env_fn, spec.first_env + offset))
        except BaseException:
            for made in envs:
                made.close()
            raise
    return envs


def _close_quietly(env, deadline: bool) -> None:
    """Closes an env that may be broken, under the deadline when ``deadline``
    (a close that hangs must not hold up the block); whatever it raises is
    printed, not reported."""
    try:
        if deadline:
            _worker_loop.arm_step_deadline()
        try:
            env.close()
        finally:
            if deadline:
                _worker_loop.disarm_step_deadline()
    except (Exception, StepDeadlineExceeded):  # noqa: BLE001 - best effort
        traceback.print_exc(file=sys.stderr)


def _worker_cpu(index: int) -> int:
    """The CPU for worker ``index``'s env threads (and the worker itself when
    pinned): one per worker, round robin over the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[index % len(cpus)]


class Worker:
    """Serves commands for one block of envs until CLOSE or the main's death.

    The commands themselves (step, reset, call, set_attr, close) are the same
    in both modes; what differs, how work arrives and how a replacement
    recovers, is the wire's (``SyncWire``, ``AsyncWire``).
    """

    def __init__(self, spec: WorkerSpec, segment, pipe, envs: list) -> None:
        self.spec = spec
        self.pipe = pipe
        # Sends never block the worker: main reads a batch's messages only once
        # the batch is full (shmvec/outbox.py).
        self.outbox = Outbox(pipe)
        self.envs = envs
        layout = make_layout(spec)
        buffer = memoryview(segment)
        line = slice(spec.index, spec.index + 1)
        self.obs_codec = make_codec(spec.observation_space, spec.shared_memory, spec.text_bytes)
        stepper = _worker_loop.Stepper(
            make_codec(spec.action_space, True, spec.text_bytes),
            self.obs_codec,
            spec.autoreset_mode,
        )
        stepper.take_spill = self.take_spill
        self.spilled_actions: dict[int, dict] = {}  # env id -> its action's spilled text
        barrier = _worker_loop.WorkerBarrier(
            segment.address + layout.barrier_offset, spec.num_workers
        )
        self.block = block = _worker_loop.Block(stepper, envs, spec.first_env, barrier)
        self.rows = range(spec.first_env, spec.first_env + len(envs))
        block.generation = spec.generation
        block.flag = layout.worker_words(buffer)[line]
        block.current_env = self.current_env = layout.worker_current_env(buffer)[line]
        block.finished = layout.worker_finished_generation(buffer)[line]
        block.busy_ns = self.busy_ns = layout.worker_busy_ns(buffer)[line]
        block.action_views = self.action_views = layout.action_views(buffer)
        self.slot_views = [layout.slot_views(buffer, k) for k in range(layout.num_slots)]
        self.regions = [layout.region_views(buffer, r) for r in range(len(layout.region_offsets))]
        block.regions = self.regions
        async_mode = spec.batch_size < spec.num_envs
        table = layout.slot_regions(buffer)
        block.slots = [
            _worker_loop.SlotColumns(views, k, table, self.regions if async_mode else None)
            for k, views in enumerate(self.slot_views)
        ]
        # info key -> column, shared by all slots (a replacement keeps its predecessor's)
        self.info_schema: dict = dict(spec.info_schema or {})
        block.info_columns = [
            _worker_loop.InfoColumns(self.info_schema, s.info_codes, s.info_cells)
            for s in self.slot_views
        ]
        block.autoreset = self.autoreset = np.zeros(len(envs), dtype=np.uint8)
        block.on_error = self.truncated_reset if spec.on_env_error == "reset" else None
        block.send = self.send
        block.build_message = self.message
        self.inbox: dict[str, list] = {}  # main's messages read ahead of their turn
        self.wire: SyncWire | AsyncWire
        if async_mode:
            block.env_started = layout.worker_env_started_ns(buffer)[line]
            self.wire = AsyncWire(self, segment.address, layout, buffer)
        else:
            self.wire = SyncWire(self)
        # Envs that wait are stepped several at once (shmvec/concurrent_envs.py);
        # hooked in at step(), the async wire's work() and before each wait.
        self.concurrency = ConcurrentEnvs(
            block,
            spec.env_concurrency,
            layout.worker_env_threads(buffer)[line],
            # Placing threads is for worker processes: the main's are the user's.
            _worker_cpu(spec.index) if os.getpid() != spec.main_pid else None,
            pin=spec.pin_cpu,
        )
        self.concurrency.spin(spec.spin).apply(self.wire.waiter)
        self._env_fns: list | None = None  # loaded at the first deadline
        self.step_deadline = spec.step_deadline if os.getpid() != spec.main_pid else None
        if self.step_deadline is not None:
            self._watch_deadline(self.step_deadline)

    def _watch_deadline(self, seconds: float) -> None:
        """``step_deadline``: a serial loop is interrupted by SIGALRM inside the
        env (the worker's main thread steps it); env threads are watched by the
        main thread instead (``ConcurrentEnvs.check_deadlines``), since a signal
        reaches only the main thread."""
        self.block.on_deadline = self.deadline_reset
        if self.concurrency.threads > 1:
            self.concurrency.watch_deadline(seconds, self.deadline_result)
            return
        signal.signal(signal.SIGALRM, _worker_loop.on_step_deadline)
        _worker_loop.set_step_deadline(seconds)
        self.block.deadline = True

    def serve(self) -> None:
        """Waits for work and does it, until CLOSE (or the main's death)."""
        wire, concurrency = self.wire, self.concurrency
        while True:
            concurrency.before_wait()  # hook: concurrent_envs
            if not wire.wait_for_work(WATCHDOG_NS):
                _exit_if_main_gone(self.spec.main_pid)
            elif not wire.work():
                return

    def recover(self, plan: RoundRecovery | EnvRecovery) -> dict | None:
        """A replacement's first job, before it says it is ready: its envs are
        new. Returns the message for its predecessor's round (sync mode)."""
        return self.wire.recover(plan)

    def send(self, message: dict) -> None:
        _send(self.outbox, message)

    def run_command(self, command: tuple) -> bool:
        """Runs one barrier command; False once the worker must exit."""
        started = time.perf_counter_ns()
        self.block.generation, kind, arg = command
        if kind == STEP:
            message = self.step(arg)
        elif kind == RESET:
            message = self.reset(arg, self.recv("reset"))
        elif kind == CALL:
            message = self.call(*self.recv("call"))
        elif kind == SET_ATTR:
            message = self.set_attr(*self.recv("set_attr"))
        elif kind == CLOSE:
            self.close()
            self.block.barrier.arrive()
            return False
        else:
            message = {"errors": [(-1, RuntimeError(f"unknown command {kind}"), "")]}
        self.block.finish_round(message, started)
        return True

    def recv(self, tag: str):
        """The next payload the main process sent with ``tag``."""
        if self.inbox.get(tag):
            return self.inbox[tag].pop(0)
        while True:
            got, payload = pickle.loads(self.pipe.recv_bytes())
            if got == tag:
                return payload
            self.inbox.setdefault(got, []).append(payload)

    def take_spill(self, env_id: int) -> dict:
        """The spilled text of env ``env_id``'s action (``{path: text}``), which
        main sent on the pipe before the env's command (or just after a sync
        round's)."""
        spilled = self.spilled_actions
        while env_id not in spilled:
            spilled.update(self.recv("spills"))
        return spilled.pop(env_id)

    def obs_target(self, arg: int):
        """Where observations of the sync round of ``arg`` (slot and region, see
        protocol.REGION_SHIFT) go: columns, or a dict to pickle."""
        if self.obs_codec.pickled:
            return {}
        region = (arg >> REGION_SHIFT) & REGION_MASK
        return self.regions[region - 1] if region else self.slot_views[arg & SLOT_MASK].obs

    def step(self, arg: int) -> dict:
        by_value = bool(arg & BY_VALUE_BIT)  # per-env actions come pickled this round
        self.block.stepper.actions_by_value = by_value
        action_views: list[Any] = self.action_views
        if by_value:
            action_views = [None] * self.spec.num_envs
            action_views[self.rows.start : self.rows.stop] = self.recv("actions")
        obs_target = self.obs_target(arg)
        # hook: Block.step_block, or concurrent_envs' threaded stand-in
        infos, errors, announced, spills = self.concurrency.step(
            self.block, action_views, obs_target, arg & SLOT_MASK
        )
        return self.message(infos, errors, obs_target, announced, spills)

    def deadline_reset(self, i: int) -> tuple:
        """Env ``i`` ran past ``step_deadline`` in the serial loop: its env
        object is closed (under the deadline too) and replaced; the step's result."""
        return self.deadline_result(i, close_old=True)

    def deadline_result(self, i: int, close_old: bool) -> tuple:
        """Env ``i`` ran past ``step_deadline``: it may have been interrupted
        anywhere, so it is replaced by a new env from its env_fn, reset, and its
        step reports the truncated end of its episode with
        ``info["step_deadline"]`` (``truncated_reset``). ``close_old``: close the
        interrupted env here (an env thread still inside it closes it itself)."""
        if self._env_fns is None:
            self._env_fns = load_env_fns(self.spec)
        old = self.envs[i]
        self.envs[i] = make_env(self.spec, self._env_fns[i], self.rows[i])
        if close_old:
            _close_quietly(old, self.block.deadline)
        return self.truncated_reset(i, {"step_deadline": self.step_deadline})

    def truncated_reset(self, i: int, why: dict | BaseException) -> tuple:
        """Env ``i`` lost its state (it raised, or its worker died): reset it and
        report the step as the truncated end of its episode, with ``why`` in the
        info. The fresh observation stands in for the final one, which is lost
        (SAME_STEP's ``final_obs`` too); NEXT_STEP resets once more next step.
        Returns a result as ``Stepper.advance`` does."""
        if isinstance(why, BaseException):
            why = {"env_error": f"{type(why).__name__}: {why}"}
        obs, info = self.envs[i].reset()
        info = {**info, **why}
        merged = [info]
        if self.spec.autoreset_mode == AUTORESET_SAME_STEP:
            merged = [{"final_obs": obs, "final_info": info}, info]
        return obs, 0.0, False, True, merged

    def message(self, infos, errors, obs_target, announced=(), spills=()) -> dict:
        """A round's message: empty when it has nothing to send. ``spills``:
        ``(row, {path: text})`` of observations whose text spilled."""
        message = {}
        if announced:
            message["info_columns"] = announced
        if spills:
            message["spills"] = spills
        if infos:
            message["infos"] = infos
        if errors:
            message["errors"] = [(row, _safe_exception(e), tb) for row, e, tb in errors]
        if self.obs_codec.pickled:
            message["obs"] = obs_target
        return message

    def reset(self, arg: int, payload) -> dict:
        seeds, options, mask = payload  # per env of the block
        obs_target = self.obs_target(arg)
        # Reset infos are pickled (resets are rare): clear this block's columns.
        self.slot_views[arg & SLOT_MASK].info_codes[self.rows.start : self.rows.stop] = 0
        infos, errors, spills = [], [], []

        def reset_env(i: int) -> tuple:
            try:
                result = self._reset_one(i, seeds[i], options[i])
                spill = self.obs_codec.write(obs_target, self.rows[i], result[0])
                self.autoreset[i] = 0
                return result[4], spill, None
            except Exception as exc:  # noqa: BLE001 - re-raised in the main process
                return None, None, (exc, traceback.format_exc())

        todo = [i for i in range(len(self.envs)) if mask is None or mask[i]]
        # hook: concurrent_envs resets waiting envs in threads too; results by row
        for i, (info, spill, error) in zip(todo, self.concurrency.map_envs(reset_env, todo)):
            if error is not None:
                errors.append((self.rows[i], *error))
                continue
            if info:
                infos.append((self.rows[i], info))
            if spill:
                spills.append((self.rows[i], spill))
        return self.message(infos, errors, obs_target, (), spills)

    def _reset_one(self, i: int, seed, options) -> tuple:
        """Sync mode: env ``i``'s reset, under the deadline in a serial loop; past
        it, a new env's plain reset with ``info["step_deadline"]``."""
        if not self.block.deadline:
            return _worker_loop.reset_result(self.envs[i], seed, options)
        try:
            _worker_loop.arm_step_deadline()
            try:
                return _worker_loop.reset_result(self.envs[i], seed, options)
            finally:
                _worker_loop.disarm_step_deadline()
        except StepDeadlineExceeded:
            obs, _, _, _, merged = self.deadline_reset(i)
            return obs, 0.0, False, False, merged[-1:]

    def call(self, name: str, args: tuple, kwargs: dict) -> dict:
        results, errors = [], []
        for env, row in zip(self.envs, self.rows):
            self.block.enter_env(row)
            try:
                value = env.get_wrapper_attr(name)
                results.append(value(*args, **kwargs) if callable(value) else value)
            except Exception as exc:  # noqa: BLE001
                results.append(None)
                errors.append((row, exc, traceback.format_exc()))
        return {"results": results, **self.message([], errors, {})}

    def set_attr(self, name: str, values: list) -> dict:
        errors = []
        for env, row, value in zip(self.envs, self.rows, values):
            self.block.enter_env(row)
            try:
                env.set_wrapper_attr(name, value)
            except Exception as exc:  # noqa: BLE001
                errors.append((row, exc, traceback.format_exc()))
        return self.message([], errors, {}) or {"results": None}

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                traceback.print_exc(file=sys.stderr)
