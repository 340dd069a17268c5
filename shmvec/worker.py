"""The worker process: owns a contiguous block of envs and serves commands.

Data flow of one round: the main process posts a command on the step barrier
(payloads that are not arrays, such as reset seeds or ``call`` arguments, are
sent on the worker's pipe first); the worker does it for each of its envs,
writes results into the ring slot the command names, sets its message flag if
it has anything that is not a column (infos, errors, pickled values), arrives
at the barrier, and only *then* sends that message, so that a large message
can never block a worker that the main process is still waiting for.
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
from collections import deque
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from shmvec import _core, _worker_loop
from shmvec.concurrent_envs import ConcurrentEnvs
from shmvec.errors import add_note
from shmvec.layout import SegmentLayout, WordBytes, make_codec
from shmvec.protocol import (
    AUTORESET_SAME_STEP,
    BY_VALUE_BIT,
    CALL,
    CLOSE,
    ENV_RESET,
    REGION_MASK,
    REGION_SHIFT,
    RESET,
    SET_ATTR,
    SLOT_MASK,
    STEP,
    WATCHDOG_NS,
)


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
    spin_ns: int
    main_pid: int
    # PR_SET_PDEATHSIG fires when the *thread* that forked us exits: only
    # safe when that is the main thread. The watchdog covers the rest.
    use_death_signal: bool
    on_env_error: str = "raise"  # or "reset": see Worker.truncated_reset
    # A replacement for a dead worker starts at the round it died in, and
    # first does Worker.recover(*recover) for that round.
    generation: int = 0
    # Sync mode: (command kind, the round's arg: ring slot and observation
    # region). Async mode: ("async", plan), see Worker.recover_async.
    recover: tuple | None = None
    info_schema: dict | None = None  # the dead worker's info columns, kept
    # Envs stepped at once at most (shmvec.concurrent_envs); None: up to the block.
    env_concurrency: int | None = None
    # Step on one CPU (_worker_cpu) alone: shmvec.spin.default_pinning.
    pin_cpu: bool = False
    # Lease regions in the segment (shmvec.layout.lease_regions; async mode: one
    # more per ring slot).
    obs_regions: int = 0


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


def _main_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        worker = Worker(spec, segment, pipe, _make_envs(spec))
    except BaseException as exc:  # noqa: BLE001 - reported to the main process
        pipe.send_bytes(
            pickle.dumps({"startup_error": (_safe_exception(exc), traceback.format_exc())})
        )
        return
    ready = {"ready": os.getpid()}
    if spec.recover is not None and spec.recover[0] == "async":
        worker.recover_async(spec.recover[1])
    elif spec.recover is not None:
        ready["recovered"] = worker.recover(*spec.recover)
    _send(pipe, ready)
    try:
        if spec.batch_size < spec.num_envs:
            worker.serve_async()
        else:
            worker.serve()
    finally:
        pipe.close()


def _make_envs(spec: WorkerSpec) -> list:
    env_fns = spec.env_fns
    if isinstance(env_fns, bytes):
        env_fns = cloudpickle.loads(env_fns)
    envs = []
    for offset, env_fn in enumerate(env_fns):
        row = spec.first_env + offset
        try:
            env = env_fn()
            check_env(env, row)
            _check_spaces(spec, env, row)
        except BaseException as exc:
            add_note(exc, f"(while creating env {row} in shmvec worker {spec.index})")
            for made in envs:
                made.close()
            raise
        envs.append(env)
    return envs


def _worker_cpu(index: int) -> int:
    """The CPU for worker ``index``'s env threads (and the worker itself when
    pinned): one per worker, round robin over the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[index % len(cpus)]


class Worker:
    """Serves commands for one block of envs until CLOSE or the main's death."""

    def __init__(self, spec: WorkerSpec, segment, pipe, envs: list) -> None:
        self.spec = spec
        self.segment = segment
        self.pipe = pipe
        self.envs = envs
        self.layout = make_layout(spec)
        self.barrier = _worker_loop.WorkerBarrier(
            segment.address + self.layout.barrier_offset, spec.num_workers
        )
        buffer = memoryview(segment)
        self.flag = self.layout.worker_words(buffer)[spec.index : spec.index + 1]
        self.busy_ns = self.layout.worker_busy_ns(buffer)[spec.index : spec.index + 1]
        line = slice(spec.index, spec.index + 1)
        self.current_env = self.layout.worker_current_env(buffer)[line]
        self.finished = self.layout.worker_finished_generation(buffer)[line]
        self.obs_codec = make_codec(spec.observation_space, spec.shared_memory)
        self.action_codec = make_codec(spec.action_space)
        self.stepper = _worker_loop.Stepper(self.action_codec, self.obs_codec, spec.autoreset_mode)
        self.action_views = self.layout.action_views(buffer)
        self.slots = [self.layout.slot_views(buffer, k) for k in range(self.layout.num_slots)]
        self.regions = [
            self.layout.region_views(buffer, r) for r in range(len(self.layout.region_offsets))
        ]
        async_regions = self.regions if spec.batch_size < spec.num_envs else None
        table = self.layout.slot_regions(buffer)
        self.slot_columns = [
            _worker_loop.SlotColumns(views, k, table, async_regions)
            for k, views in enumerate(self.slots)
        ]
        # info key -> column, shared by all slots (a replacement keeps its predecessor's)
        self.info_schema: dict = dict(spec.info_schema or {})
        self.info_columns = [
            _worker_loop.InfoColumns(self.info_schema, s.info_codes, s.info_cells)
            for s in self.slots
        ]
        self.autoreset = np.zeros(len(envs), dtype=np.uint8)
        self.rows = range(spec.first_env, spec.first_env + len(envs))
        self.inbox: dict[str, list] = {}  # main's messages read ahead of their turn
        self.generation = spec.generation
        self.on_error = self.truncated_reset if spec.on_env_error == "reset" else None
        if spec.batch_size < spec.num_envs:
            self.doorbell = _worker_loop.WorkerDoorbell(
                segment.address + self.layout.doorbell_offsets[spec.index]
            )
            self.ring = _worker_loop.WorkerRing(
                segment.address + self.layout.ring_offset, self.layout.num_slots, spec.batch_size
            )
            self.commands = self.layout.env_commands(buffer)[self.rows.start : self.rows.stop]
            self.reset_args: dict = {}
            self.restarted = np.zeros(len(envs), dtype=np.uint8)  # see recover_async
            self.env_started = self.layout.worker_env_started_ns(buffer)[
                spec.index : spec.index + 1
            ]
        # Envs that wait are stepped several at once (shmvec/concurrent_envs.py);
        # hooked in at step(), poll_async() and the spin of the command waits.
        self.concurrency = ConcurrentEnvs(
            len(envs),
            spec.first_env,
            spec.env_concurrency,
            self.current_env,
            self.env_started if spec.batch_size < spec.num_envs else None,
            self.layout.worker_env_threads(buffer)[line],
            # Placing threads is for worker processes: the main's are the user's.
            _worker_cpu(spec.index) if os.getpid() != spec.main_pid else None,
            pin=spec.pin_cpu,
        )
        # Plain sync step rounds run in Cython (pickled observations need _message's dict)
        self.serial_rounds = None
        if spec.batch_size == spec.num_envs and not self.obs_codec.pickled:
            self.serial_rounds = _worker_loop.SerialRounds(
                self.barrier, self.stepper, self.envs, spec.first_env, self.action_views,
                self.slot_columns, self.regions, self.info_columns, self.autoreset, self.flag,
                self.current_env, self.finished, self.busy_ns, self.on_error, self._message,
                lambda message: _send(self.pipe, message),
            )  # fmt: skip

    def serve(self) -> None:
        """Sync mode: one barrier round per command; plain step rounds in
        ``serial_rounds`` for as long as the envs step serially (hook:
        concurrent_envs says for how many rounds)."""
        while True:
            spin_ns = self.concurrency.spin_ns(self.spec.spin_ns)  # hook: concurrent_envs
            serial = self.concurrency.serial_rounds() if self.serial_rounds is not None else 0
            if serial:
                self.generation, ran, command = self.serial_rounds.serve(
                    self.generation, spin_ns, WATCHDOG_NS, serial
                )
                self.concurrency.ran_serial(ran)
                if command is None and ran == serial:
                    continue  # a probe round is due: the Python loop runs it
            else:
                command = self.barrier.wait_command(self.generation, spin_ns, WATCHDOG_NS)
            if command is None:
                self._check_main()
                continue
            if not self._run_command(command):
                return

    def serve_async(self) -> None:
        """Async mode: run envs as their commands arrive; barrier commands too."""
        rings = 0
        while True:
            spin_ns = self.concurrency.spin_ns(self.spec.spin_ns)  # hook: concurrent_envs
            seen = self.doorbell.wait(rings, spin_ns, WATCHDOG_NS)
            if seen is None:
                self._check_main()
                continue
            rings = seen
            if not self.poll_async():
                return

    def poll_sync(self) -> bool:
        """Runs the barrier command just posted; False once the worker must exit."""
        return self._run_command(self.barrier.wait_command(self.generation, 0, 0))

    def poll_async(self) -> bool:
        """Runs a barrier command if one was posted, then every env that has a
        command; False once the worker must exit."""
        if self.barrier.generation_now() != self.generation:
            self.concurrency.drain()  # hook: no env thread runs during call/set_attr/close
            if not self.poll_sync():
                return False
        started = time.perf_counter_ns()
        # hook: _worker_loop.step_pending, or concurrent_envs' threaded stand-in
        self.concurrency.pending_function()(
            self.stepper,
            self.ring,
            self.envs,
            self.rows.start,
            self.commands,
            self._take_reset_args,
            self.action_views,
            self.slot_columns,
            self.info_columns,
            self.autoreset,
            lambda message: _send(self.pipe, message),
            self.current_env,
            self.on_error,
            self.restarted,
            self.restart_result,
            self.env_started,
        )
        self.busy_ns[0] += time.perf_counter_ns() - started
        return True

    def _take_reset_args(self, env_id: int) -> tuple:
        """(seed, options) of env_id's reset; the main sent them before the command."""
        while env_id not in self.reset_args:
            self.reset_args.update(self._recv("reset"))
        return self.reset_args.pop(env_id)

    def _check_main(self) -> None:
        if not _main_alive(self.spec.main_pid):
            os._exit(0)

    def _run_command(self, command: tuple) -> bool:
        """Runs one barrier command; False once the worker must exit."""
        started = time.perf_counter_ns()
        self.generation, kind, arg = command
        if kind == STEP:
            message = self.step(arg)
        elif kind == RESET:
            message = self.reset(arg, self._recv("reset"))
        elif kind == CALL:
            message = self.call(*self._recv("call"))
        elif kind == SET_ATTR:
            message = self.set_attr(*self._recv("set_attr"))
        elif kind == CLOSE:
            self.close()
            self.barrier.arrive()
            return False
        else:
            message = {"errors": [(-1, RuntimeError(f"unknown command {kind}"), "")]}
        if message:
            self.flag[0] = 1
        self.current_env[0] = 0
        # Every write to this worker's line before arrive(): the main process
        # reads it right after, and a later write would pull the line back.
        # (_worker_loop.SerialRounds.serve ends a plain step round the same way.)
        self.busy_ns[0] += time.perf_counter_ns() - started
        self.finished[0] = self.generation
        self.barrier.arrive(bool(message))
        if message:
            _send(self.pipe, message)
        return True

    def _recv(self, tag: str):
        """The next payload the main process sent with ``tag``."""
        if self.inbox.get(tag):
            return self.inbox[tag].pop(0)
        while True:
            got, payload = pickle.loads(self.pipe.recv_bytes())
            if got == tag:
                return payload
            self.inbox.setdefault(got, []).append(payload)

    def _obs_target(self, arg: int):
        """Where observations of the sync round of ``arg`` (slot and region, see
        protocol.REGION_SHIFT) go: columns, or a dict to pickle."""
        if self.obs_codec.pickled:
            return {}
        region = (arg >> REGION_SHIFT) & REGION_MASK
        return self.regions[region - 1] if region else self.slots[arg & SLOT_MASK].obs

    def step(self, arg: int) -> dict:
        slot = arg & SLOT_MASK
        by_value = bool(arg & BY_VALUE_BIT)  # per-env actions come pickled this round
        self.stepper.actions_by_value = by_value
        action_views = self.action_views
        if by_value:
            action_views = [None] * self.spec.num_envs
            action_views[self.rows.start : self.rows.stop] = self._recv("actions")
        obs_target = self._obs_target(arg)
        # hook: _worker_loop.step_envs, or concurrent_envs' threaded stand-in
        infos, errors, announced = self.concurrency.step_function()(
            self.stepper,
            self.envs,
            self.spec.first_env,
            action_views,
            obs_target,
            self.slot_columns[slot],
            self.autoreset,
            self.info_columns[slot],
            self.current_env,
            self.on_error,
        )
        return self._message(infos, errors, obs_target, announced)

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

    def restart_result(self, i: int, command: int) -> tuple:
        """The result env ``i`` reports for its first command after a restart (async
        mode): a reset as asked, or a truncated episode, both with
        ``info["worker_restarted"]``."""
        why = {"worker_restarted": True}
        if command == ENV_RESET:
            seed, options = self._take_reset_args(self.rows.start + i)
            return _worker_loop.reset_result(self.envs[i], seed, options, why)
        return self.truncated_reset(i, why)

    def recover_async(self, plan: dict) -> None:
        """A replacement's first job in async mode. ``plan`` maps each env of the
        block whose result died with the old worker to ``(how, slot, row,
        command)``: ``"claim"`` a new row, fill the ``"hole"`` (slot, row) the old
        worker claimed but never published, or ``"rewrite"`` a published row whose
        message was lost. Every other env reports ``restart_result`` for its
        next command (``restarted``)."""
        for env_id, (how, slot, row, command) in plan.items():
            i = env_id - self.rows.start
            result = self.restart_result(i, command)
            if how == "claim":
                slot, row = self.ring.claim()
            views = self.slots[slot]
            obs_target = {} if self.obs_codec.pickled else self.slot_columns[slot].obs_columns()
            self.stepper.write_row(obs_target, views, row, result)
            views.info_codes[row] = 0
            views.env_ids[row], views.messages[row] = env_id, 1
            self.autoreset[i] = 1 if result[3] else 0
            if how != "rewrite":
                self.ring.publish(slot)
            message = {"row": (slot, row), "infos": [(row, result[4])]}
            if self.obs_codec.pickled:
                message["obs"] = obs_target
            _send(self.pipe, message)
        for i, env_id in enumerate(self.rows):
            self.restarted[i] = env_id not in plan

    def recover(self, kind: int, arg: int) -> dict:
        """A replacement worker's first job: its envs are new, so reset them. In a
        STEP round each reports a truncated episode (``truncated_reset``), in a
        RESET round the reset asked for (the main process sends it again); both
        with ``info["worker_restarted"]``. ``arg``: the round's."""
        obs_target = self._obs_target(arg)
        views = self.slots[arg & SLOT_MASK]
        views.info_codes[self.rows.start : self.rows.stop] = 0
        why = {"worker_restarted": True}
        infos, errors = [], []
        if kind == RESET:  # the reset asked for, of every env (all are new)
            seeds, options, mask = self._recv("reset")
            if mask is not None:
                seeds = [s if m else None for s, m in zip(seeds, mask)]
                options = [o if m else None for o, m in zip(options, mask)]
        for i, row in enumerate(self.rows):
            try:
                if kind == STEP:
                    result = self.truncated_reset(i, why)
                    self.autoreset[i] = 1
                elif kind == RESET:
                    result = _worker_loop.reset_result(self.envs[i], seeds[i], options[i], why)
                else:
                    self.envs[i].reset()
                    continue
                self.stepper.write_row(obs_target, views, row, result)
                infos.append((row, result[4]))
            except Exception as exc:  # noqa: BLE001 - re-raised in the main process
                errors.append((row, exc, traceback.format_exc()))
        if kind not in (STEP, RESET):
            return self._message([], errors, {})
        return self._message(infos, errors, obs_target)

    def _message(self, infos, errors, obs_target, announced=()) -> dict:
        message = {}
        if announced:
            message["info_columns"] = announced
        if infos:
            message["infos"] = infos
        if errors:
            message["errors"] = [(row, _safe_exception(e), tb) for row, e, tb in errors]
        if self.obs_codec.pickled:
            message["obs"] = obs_target
        return message

    def reset(self, arg: int, payload) -> dict:
        seeds, options, mask = payload  # per env of the block
        obs_target = self._obs_target(arg)
        # Reset infos are pickled (resets are rare): clear this block's columns.
        self.slots[arg & SLOT_MASK].info_codes[self.rows.start : self.rows.stop] = 0
        infos, errors = [], []

        def reset_env(i: int) -> tuple:
            try:
                result = _worker_loop.reset_result(self.envs[i], seeds[i], options[i])
                self.obs_codec.write(obs_target, self.rows[i], result[0])
                self.autoreset[i] = 0
                return result[4], None
            except Exception as exc:  # noqa: BLE001 - re-raised in the main process
                return None, (exc, traceback.format_exc())

        todo = [i for i in range(len(self.envs)) if mask is None or mask[i]]
        # hook: concurrent_envs resets waiting envs in threads too; results by row
        for i, (info, error) in zip(todo, self.concurrency.map_envs(reset_env, todo)):
            if error is not None:
                errors.append((self.rows[i], *error))
            elif info:
                infos.append((self.rows[i], info))
        return self._message(infos, errors, obs_target)

    def call(self, name: str, args: tuple, kwargs: dict) -> dict:
        results, errors = [], []
        for env, row in zip(self.envs, self.rows):
            self.current_env[0] = row + 1
            try:
                value = env.get_wrapper_attr(name)
                results.append(value(*args, **kwargs) if callable(value) else value)
            except Exception as exc:  # noqa: BLE001
                results.append(None)
                errors.append((row, exc, traceback.format_exc()))
        return {"results": results, **self._message([], errors, {})}

    def set_attr(self, name: str, values: list) -> dict:
        errors = []
        for env, row, value in zip(self.envs, self.rows, values):
            self.current_env[0] = row + 1
            try:
                env.set_wrapper_attr(name, value)
            except Exception as exc:  # noqa: BLE001
                errors.append((row, exc, traceback.format_exc()))
        return self._message([], errors, {}) or {"results": None}

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                traceback.print_exc(file=sys.stderr)


def make_layout(spec: WorkerSpec) -> SegmentLayout:
    """The segment's layout, derived the same way in main and workers."""
    obs_codec = make_codec(spec.observation_space, spec.shared_memory)
    action_codec = make_codec(spec.action_space)
    rows = spec.batch_size
    return SegmentLayout(
        spec.num_envs,
        spec.num_workers,
        action_codec.columns(),
        obs_codec.columns(),
        spec.num_slots,
        rows,
        WordBytes(
            _core.StepBarrier.nbytes,
            _core.ResultRing.nbytes(spec.num_slots),
            _core.Doorbell.nbytes,
        ),
        obs_regions=spec.obs_regions,
    )


class LoopbackPipe:
    """One end of an in-process pipe: what is sent lands in the other end's inbox."""

    def __init__(self, inbox: deque, outbox: deque) -> None:
        self.inbox, self.outbox = inbox, outbox

    @classmethod
    def pair(cls) -> tuple[LoopbackPipe, LoopbackPipe]:
        a, b = deque(), deque()
        return cls(a, b), cls(b, a)

    def send_bytes(self, data: bytes) -> None:
        self.outbox.append(bytes(data))

    def recv_bytes(self) -> bytes:
        return self.inbox.popleft()  # the peer always sends before it asks

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self.inbox)

    def close(self) -> None:
        pass


class InProcessWorker:
    """``num_workers=0`` or ``step_in_main``: worker 0 runs in the main process,
    which steps its envs when it waits for a round (``poll``). It stands in for the
    ``multiprocessing.Process`` (``pid``, ``exitcode``, ``join``...), so the
    main process's code is the same, and a breakpoint inside ``env.step`` works.
    """

    def __init__(self, spec: WorkerSpec, segment, pipe: LoopbackPipe) -> None:
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self.worker = Worker(spec, segment, pipe, _make_envs(spec))
        pipe.send_bytes(pickle.dumps({"ready": self.pid}))

    def poll(self, async_mode: bool) -> None:
        """Does whatever the main process has asked for and not had done yet."""
        worker = self.worker
        if self.exitcode is not None:
            return
        if async_mode:
            alive = worker.poll_async()
        elif worker.barrier.generation_now() != worker.generation:
            alive = worker.poll_sync()
        else:
            return
        if not alive:
            self.exitcode = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        if self.exitcode is None:
            self.worker.close()
            self.exitcode = 0
