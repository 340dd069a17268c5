"""The C++ core through ``shmvec._core``: Segment, futexes, StepBarrier, atomics.

Child processes are real processes (multiprocessing, fork by default) that
map the same memfd as the test process.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import numpy as np
import pytest

from shmvec import _core
from shmvec.worker import SegmentFd

pytestmark = pytest.mark.timeout(60)

FORK = multiprocessing.get_context("fork")
SEC = 1_000_000_000  # ns

# Word offsets used by the tests, after the 64-byte header, one cache line each.
W0 = 64
W1 = 128
W2 = 192
BARRIER = 256  # StepBarrier words (6 cache lines)
DATA = 1024  # per-worker counters and scratch


def run_child(ctx, target, *args, timeout: float = 20.0):
    """Runs ``target(conn, *args)`` in a child and returns what it sends back."""
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_child_entry, args=(target, child, *args))
    process.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise AssertionError(f"child {target.__name__} sent nothing in {timeout}s")
        kind, value = parent.recv()
    finally:
        process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join()
    if kind == "error":
        raise AssertionError(f"child {target.__name__} failed:\n{value}")
    return value


def _child_entry(target, conn, *args):
    import traceback

    try:
        conn.send(("ok", target(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# ------------------------------------------------------------------ Segment


def test_create_is_zero_filled_and_has_header():
    seg = _core.Segment.create(8192)
    assert seg.size == 8192
    assert seg.fd >= 0
    assert seg.address != 0
    assert seg.creator_pid == os.getpid()
    view = np.frombuffer(memoryview(seg), dtype=np.uint8)
    assert view.shape == (8192,)
    assert not view[64:].any(), "the segment after the header must be zero-filled"
    # The header starts with kSegmentMagic (csrc/segment.h), then version 2.
    assert view[:8].view("<u8")[0] == 0x3130564D48534D
    assert view[8:12].view("<u4")[0] == 2


@pytest.mark.parametrize("size", [0, 1, 63])
def test_create_smaller_than_header_is_rejected(size):
    with pytest.raises(ValueError, match="smaller than its header"):
        _core.Segment.create(size)


def test_buffer_is_writable_and_close_fd_keeps_mapping():
    seg = _core.Segment.create(4096)
    view = np.frombuffer(memoryview(seg), dtype=np.uint8)
    view[100:104] = [1, 2, 3, 4]
    seg.close_fd()
    assert seg.fd == -1
    seg.close_fd()  # idempotent
    assert list(view[100:104]) == [1, 2, 3, 4]
    view[200] = 7
    assert memoryview(seg)[200] == 7


def _attach_and_exchange(fd_holder, expected_pid):
    fd = fd_holder.fd if isinstance(fd_holder, SegmentFd) else fd_holder
    seg = _core.Segment.attach(fd)
    assert seg.fd == -1, "an attached segment does not own the fd"
    view = np.frombuffer(memoryview(seg), dtype=np.uint8)
    seen = bytes(view[DATA : DATA + 5])
    view[DATA + 100 : DATA + 105] = np.frombuffer(b"child", dtype=np.uint8)
    return seg.size, seg.creator_pid, seen, expected_pid


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_attach_in_child_sees_parent_writes_and_back(context):
    ctx = multiprocessing.get_context(context)
    seg = _core.Segment.create(3 * 4096)
    view = np.frombuffer(memoryview(seg), dtype=np.uint8)
    view[DATA : DATA + 5] = np.frombuffer(b"hello", dtype=np.uint8)
    fd_arg = seg.fd if context == "fork" else SegmentFd(seg.fd)
    size, creator, seen, _ = run_child(ctx, _attach_and_exchange, fd_arg, os.getpid())
    assert size == 3 * 4096
    assert creator == os.getpid()
    assert seen == b"hello"
    assert bytes(view[DATA + 100 : DATA + 105]) == b"child"


def _memfd_with(content: bytes, size: int) -> int:
    fd = os.memfd_create("not-shmvec")
    os.ftruncate(fd, size)
    os.pwrite(fd, content, 0)
    return fd


def _attach_error(fd):
    try:
        _core.Segment.attach(fd)
    except Exception as exc:  # noqa: BLE001 - the type and text are the result
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize(
    "make_fd",
    [
        pytest.param(lambda: _memfd_with(b"\xff" * 64, 4096), id="memfd-garbage"),
        pytest.param(lambda: _memfd_with(b"", 4096), id="memfd-zeros"),
        pytest.param(lambda: _memfd_with(b"MSHV01\x00\x00", 4096), id="memfd-magic-only"),
    ],
)
def test_attach_rejects_foreign_memfd(make_fd):
    fd = make_fd()
    try:
        with pytest.raises(RuntimeError, match="is not a shmvec segment"):
            _core.Segment.attach(fd)
        # Also from a child process, as a worker would.
        kind, message = run_child(FORK, _attach_error, fd)
        assert kind == "RuntimeError"
        assert "is not a shmvec segment" in message
    finally:
        os.close(fd)


def test_attach_rejects_regular_temp_file():
    with tempfile.TemporaryFile() as f:
        f.write(b"\0" * 4096)
        f.flush()
        with pytest.raises(RuntimeError, match="is not a shmvec segment"):
            _core.Segment.attach(f.fileno())


def test_attach_rejects_too_small_file():
    with tempfile.TemporaryFile() as f:
        f.write(b"MSHV01")
        f.flush()
        with pytest.raises(RuntimeError, match="too small"):
            _core.Segment.attach(f.fileno())


def test_attach_rejects_wrong_version_and_wrong_size():
    seg = _core.Segment.create(4096)
    header = bytes(memoryview(seg)[:64])
    # Same header, but the file is bigger than the header says.
    fd = _memfd_with(header, 8192)
    try:
        with pytest.raises(RuntimeError, match="is not a shmvec segment"):
            _core.Segment.attach(fd)
    finally:
        os.close(fd)
    # Same size, other version (bytes 8..11).
    bad = bytearray(header)
    bad[8] ^= 0xFF
    fd = _memfd_with(bytes(bad), 4096)
    try:
        with pytest.raises(RuntimeError, match="is not a shmvec segment"):
            _core.Segment.attach(fd)
    finally:
        os.close(fd)
    # The untouched copy is accepted (the test above is not vacuous).
    fd = _memfd_with(header, 4096)
    try:
        other = _core.Segment.attach(fd)
        assert other.size == 4096 and other.creator_pid == os.getpid()
    finally:
        os.close(fd)


def test_attach_bad_fd_raises():
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    # pybind11 turns std::system_error into RuntimeError.
    with pytest.raises((OSError, RuntimeError), match="Bad file descriptor"):
        _core.Segment.attach(r)


# ------------------------------------------------------------------ futexes


def test_word_offsets_are_checked():
    seg = _core.Segment.create(4096)
    with pytest.raises(ValueError, match="aligned word"):
        _core.atomic_load(seg, W0 + 1)
    with pytest.raises(ValueError, match="aligned word"):
        _core.futex_wait(seg, 4096, 0, 0)
    with pytest.raises(ValueError, match="aligned word"):
        _core.futex_wake(seg, 4094, 1)
    _core.atomic_store(seg, 4092, 5)  # the last word is fine
    assert _core.atomic_load(seg, 4092) == 5


def test_futex_wait_value_changed_and_timed_out():
    seg = _core.Segment.create(4096)
    _core.atomic_store(seg, W0, 7)
    assert _core.futex_wait(seg, W0, 6, SEC) == "value_changed"
    assert _core.futex_wait(seg, W0, 7, 20_000_000) == "timed_out"
    assert _core.futex_wait(seg, W0, 7, 0) == "timed_out"
    assert _core.futex_wake(seg, W0, 10) == 0, "nobody waits"


def _wait_on_word(fd, offset, expected, timeout_ns):
    seg = _core.Segment.attach(fd)
    _core.atomic_fetch_add(seg, W2, 1)  # "I am about to wait"
    result = _core.futex_wait(seg, offset, expected, timeout_ns)
    return result, _core.atomic_load(seg, offset)


def _wait_until(predicate, timeout=10.0):
    deadline = _core.monotonic_ns() + int(timeout * SEC)
    while not predicate():
        if _core.monotonic_ns() > deadline:
            raise AssertionError("condition not reached")
        os.sched_yield()


@pytest.mark.parametrize("waiters", [1, 3])
def test_futex_wake_across_processes(waiters):
    """Children sleep on a word; the parent stores a new value and wakes them.

    futex_wake reports how many it woke; exactly that many children must
    report "woken", the others (too late to sleep) "value_changed"; none may
    time out, and all see the new value.
    """
    seg = _core.Segment.create(4096)
    pool = []
    for _ in range(waiters):
        parent, child = FORK.Pipe()
        p = FORK.Process(target=_child_entry, args=(_wait_on_word, child, seg.fd, W0, 0, 20 * SEC))
        p.start()
        child.close()
        pool.append((p, parent))
    _wait_until(lambda: _core.atomic_load(seg, W2) == waiters)
    # Give the children time to enter the kernel; correctness does not depend on it.
    _core.futex_wait(seg, W1, 0, 200_000_000)
    _core.atomic_store(seg, W0, 1)
    woken = _core.futex_wake(seg, W0, 1 << 30)
    results = []
    for p, parent in pool:
        assert parent.poll(20), "a waiter was not woken"
        kind, value = parent.recv()
        assert kind == "ok", value
        results.append(value)
        p.join(5)
        assert p.exitcode == 0
    assert all(seen == 1 for _, seen in results)
    kinds = [r for r, _ in results]
    assert "timed_out" not in kinds
    assert set(kinds) <= {"woken", "value_changed"}
    assert kinds.count("woken") == woken


def test_futex_wait_in_child_times_out():
    seg = _core.Segment.create(4096)
    result, seen = run_child(FORK, _wait_on_word, seg.fd, W0, 0, 50_000_000)
    assert result == "timed_out"
    assert seen == 0


def test_futex_wait_in_child_value_changed():
    seg = _core.Segment.create(4096)
    _core.atomic_store(seg, W0, 3)
    result, seen = run_child(FORK, _wait_on_word, seg.fd, W0, 2, 10 * SEC)
    assert (result, seen) == ("value_changed", 3)


# ------------------------------------------------------------------ atomics


def _add_many(fd, offset, count):
    seg = _core.Segment.attach(fd)
    return [_core.atomic_fetch_add(seg, offset, 1) for _ in range(count)]


def test_atomic_fetch_add_from_many_processes():
    """Each process adds 1 many times; every previous value is seen once."""
    seg = _core.Segment.create(4096)
    procs, per = 4, 3000
    pool = multiprocessing.get_context("fork").Pool(procs)
    try:
        results = pool.starmap(_add_many, [(seg.fd, W1, per)] * procs)
    finally:
        pool.close()
        pool.join()
    assert _core.atomic_load(seg, W1) == procs * per
    seen = sorted(v for r in results for v in r)
    assert seen == list(range(procs * per))


def test_atomic_fetch_add_wraps_at_32_bits():
    seg = _core.Segment.create(4096)
    _core.atomic_store(seg, W0, 2**32 - 1)
    assert _core.atomic_fetch_add(seg, W0, 2) == 2**32 - 1
    assert _core.atomic_load(seg, W0) == 1


# ------------------------------------------------------------------ barrier

STOP = 99


def _barrier_worker(fd, index, num_workers, spin_ns):
    """Serves rounds until STOP: increments its own counter, adds to the shared
    one, records the round's arg, checks it sees every other worker's previous
    round, then arrives."""
    seg = _core.Segment.attach(fd)
    barrier = _core.StepBarrier(seg, BARRIER, num_workers)
    barrier.set_spin(spin_ns, False)
    counters = np.frombuffer(memoryview(seg), dtype=np.uint32, count=64, offset=DATA)
    last_args = np.frombuffer(memoryview(seg), dtype=np.uint32, count=64, offset=DATA + 512)
    generation = 0
    rounds = 0
    stale = 0
    while True:
        command = barrier.wait_command(generation, 10 * SEC)
        if command is None:
            return ("timed out waiting for a command", rounds)
        generation, kind, arg = command
        if kind == STOP:
            barrier.arrive()
            return ("stopped", rounds, stale)
        # Every worker finished round arg-1 before the main posted round arg.
        stale += int(np.count_nonzero(counters[:num_workers] < arg))
        counters[index] += 1
        last_args[index] = arg
        _core.atomic_fetch_add(seg, W0, 1)
        rounds += 1
        barrier.arrive()


@pytest.mark.parametrize("num_workers,spin_ns", [(1, 0), (3, 0), (4, 0), (3, 20_000)])
def test_step_barrier_rounds_under_contention(num_workers, spin_ns):
    rounds = 1500
    seg = _core.Segment.create(8192)
    barrier = _core.StepBarrier(seg, BARRIER, num_workers)
    barrier.set_spin(spin_ns, False)
    counters = np.frombuffer(memoryview(seg), dtype=np.uint32, count=64, offset=DATA)
    last_args = np.frombuffer(memoryview(seg), dtype=np.uint32, count=64, offset=DATA + 512)
    pool = []
    for index in range(num_workers):
        parent, child = FORK.Pipe()
        p = FORK.Process(
            target=_child_entry,
            args=(_barrier_worker, child, seg.fd, index, num_workers, spin_ns),
        )
        p.start()
        child.close()
        pool.append((p, parent))
    try:
        for r in range(rounds):
            barrier.post(1, r)
            assert barrier.wait_done(10 * SEC), f"round {r} did not complete"
            assert barrier.arrived() == num_workers
            # wait_done returned only after every worker's writes of this round.
            assert (counters[:num_workers] == r + 1).all(), (r, counters[:num_workers])
            assert (last_args[:num_workers] == r).all(), (r, last_args[:num_workers])
            assert _core.atomic_load(seg, W0) == (r + 1) * num_workers
        barrier.post(STOP, 0)
        assert barrier.wait_done(10 * SEC)
        for _, parent in pool:
            assert parent.poll(20)
            kind, value = parent.recv()
            assert kind == "ok", value
            assert value == ("stopped", rounds, 0)
    finally:
        for p, _ in pool:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()


def _late_worker(fd, index, num_workers):
    """Worker 0 arrives at once; worker 1 only after the main sets W1."""
    seg = _core.Segment.attach(fd)
    barrier = _core.StepBarrier(seg, BARRIER, num_workers)
    command = barrier.wait_command(0, 10 * SEC)
    if command is None:
        return "no command"
    if index == 1:
        while _core.atomic_load(seg, W1) == 0:
            if _core.futex_wait(seg, W1, 0, 10 * SEC) == "timed_out":
                return "never released"
    counters = np.frombuffer(memoryview(seg), dtype=np.uint32, count=64, offset=DATA)
    counters[index] = 1
    barrier.arrive()
    return "arrived"


def test_wait_done_times_out_until_the_last_worker_arrives():
    seg = _core.Segment.create(8192)
    barrier = _core.StepBarrier(seg, BARRIER, 2)
    counters = np.frombuffer(memoryview(seg), dtype=np.uint32, count=64, offset=DATA)
    pool = []
    for index in range(2):
        parent, child = FORK.Pipe()
        p = FORK.Process(target=_child_entry, args=(_late_worker, child, seg.fd, index, 2))
        p.start()
        child.close()
        pool.append((p, parent))
    try:
        barrier.post(1, 0)
        _wait_until(lambda: barrier.arrived() == 1)
        # One worker is missing: wait_done must time out, repeatedly.
        assert barrier.wait_done(100_000_000) is False
        barrier.set_spin(5_000, False)  # spinning first changes nothing
        assert barrier.wait_done(50_000_000) is False
        assert barrier.arrived() == 1
        assert counters[1] == 0
        _core.atomic_store(seg, W1, 1)
        _core.futex_wake(seg, W1, 1)
        assert barrier.wait_done(10 * SEC) is True
        assert barrier.arrived() == 2
        assert counters[1] == 1
        for _, parent in pool:
            assert parent.poll(20)
            assert parent.recv() == ("ok", "arrived")
    finally:
        for p, _ in pool:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()


def test_wait_done_times_out_with_no_worker():
    seg = _core.Segment.create(4096)
    barrier = _core.StepBarrier(seg, BARRIER, 1)
    barrier.post(3, 4)
    assert barrier.wait_done(20_000_000) is False
    barrier.set_spin(10_000, False)
    assert barrier.wait_done(0) is False
    assert barrier.arrived() == 0


def test_wait_command_in_process():
    seg = _core.Segment.create(4096)
    barrier = _core.StepBarrier(seg, BARRIER, 1)
    assert barrier.wait_command(0, 20_000_000) is None, "no command posted yet"
    barrier.post(7, 11)
    assert barrier.wait_command(0, SEC) == (1, 7, 11)
    # The same generation again: nothing new.
    assert barrier.wait_command(1, 20_000_000) is None
    barrier.arrive()
    assert barrier.wait_done(SEC) is True
    barrier.post(8, 12)
    assert barrier.arrived() == 0, "post starts a new round"
    barrier.set_spin(1_000, True)
    assert barrier.wait_command(1, SEC) == (2, 8, 12)


def test_barrier_offset_is_checked():
    seg = _core.Segment.create(4096)
    with pytest.raises(ValueError):
        _core.StepBarrier(seg, 4096 - 64, 1)  # does not fit
    with pytest.raises(ValueError):
        _core.StepBarrier(seg, BARRIER + 4, 1)  # misaligned
    assert _core.StepBarrier.nbytes == 7 * 64


def test_barrier_counts_the_workers_with_a_message():
    seg = _core.Segment.create(4096)
    barrier = _core.StepBarrier(seg, BARRIER, 3)
    barrier.post(1, 0)
    barrier.arrive(message=True)
    barrier.arrive()
    barrier.arrive(message=True)
    assert barrier.wait_done(SEC) is True
    assert barrier.messages() == 2
    barrier.post(1, 0)
    assert barrier.messages() == 0, "post starts a new round"


# ---------------------------------------------------------- doorbell and ring

PING_OFFSET, PONG_OFFSET, RING_OFFSET = 64, 192, 320


def _ping_pong_child(rounds: int, timeout_ns: int) -> int:
    """Waits on the ping doorbell, answers on the pong one; counts timeouts."""
    segment = _core.Segment.attach(_ping_pong_child.fd)
    ping = _core.Doorbell(segment, PING_OFFSET)
    pong = _core.Doorbell(segment, PONG_OFFSET)
    seen, timeouts = 0, 0
    while seen < rounds:
        got = ping.wait(seen, timeout_ns)  # no spin (the default): every wait sleeps
        if got is None:
            timeouts += 1
            continue
        seen = got
        pong.ring()
    return timeouts


def test_doorbell_never_loses_a_wakeup_across_processes():
    """Thousands of sleep/wake hand-offs: a lost wake-up shows as a timed-out wait."""
    rounds, timeout_ns = 3000, 2_000_000_000
    segment = _core.Segment.create(4096)
    ping = _core.Doorbell(segment, PING_OFFSET)
    pong = _core.Doorbell(segment, PONG_OFFSET)
    _ping_pong_child.fd = segment.fd
    with multiprocessing.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(_ping_pong_child, (rounds, timeout_ns))
        answered, timeouts = 0, 0
        for _ in range(rounds):
            ping.ring()
            got = pong.wait(answered, timeout_ns)
            if got is None:
                timeouts += 1
                got = pong.wait(answered, -1)
            answered = got
        assert child.get(timeout=60) == 0
    assert timeouts == 0 and answered == rounds


def _publish_rows(fd: int, rows: int, num_slots: int, batch: int) -> None:
    segment = _core.Segment.attach(fd)
    ring = _core.ResultRing(segment, RING_OFFSET, num_slots, batch)
    for _ in range(rows):
        slot, _row = ring.claim()
        ring.publish(slot)


@pytest.mark.parametrize("handoff", [False, True])
def test_result_ring_fills_each_slot_exactly_once_under_contention(handoff):
    """Workers claim rows concurrently; each slot fills with batch rows and wakes
    main (also when the waker then yields its core: ``set_handoff``)."""
    num_slots, batch, workers, per_worker = 3, 4, 3, 4  # 12 rows: one lap of the ring
    segment = _core.Segment.create(4096)
    ring = _core.ResultRing(segment, RING_OFFSET, num_slots, batch)
    ring.set_handoff(handoff)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_publish_rows, args=(segment.fd, per_worker, num_slots, batch))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    for slot in range(num_slots):
        assert ring.wait_full(slot, 10_000_000_000), f"slot {slot} never filled"
        assert ring.filled(slot) == batch
        ring.release(slot)
        assert ring.filled(slot) == 0
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert ring.wait_full(0, 1_000_000) is False  # nothing more was published
