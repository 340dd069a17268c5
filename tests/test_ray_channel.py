"""The cluster channel's frames (shmvec/ray/channel.py) and the driver's reader of them
(``_core.FrameReader``): every message type comes back as it was sent, whole, in order,
however the bytes are cut on their way; the reader wakes its waiter once the rows it
waits for are in, at once for anything else; nothing needs Ray."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

import numpy as np
import pytest

from shmvec._core import FrameReader
from shmvec.ray.channel import (
    HEADER,
    AgentFailure,
    Channel,
    Reset,
    Rows,
    Step,
    accept,
    decode,
    encode,
)


def rows(n: int, obs: object, infos: list[dict] | None = None) -> Rows:
    rng = np.random.default_rng(n)
    batch = (obs, rng.normal(size=n), rng.random(n) < 0.5, rng.random(n) < 0.5,
             {"env_id": rng.permutation(n * 3)[:n]})  # fmt: skip
    return Rows(batch, infos)


def round_trip(message: object) -> object:
    """``message`` encoded as a frame and decoded again; the header's size checked."""
    frame = encode(message)
    size, kind, rows = HEADER.unpack_from(frame)
    assert size == len(frame) - HEADER.size
    if isinstance(message, Rows):  # the rows a driver's FrameReader counts
        assert rows == len(message.batch[4]["env_id"])
    else:
        assert rows == (len(message.env_ids) if isinstance(message, Step) else 0)
    return decode(kind, frame[HEADER.size :])


def frames(messages: list) -> bytes:
    return b"".join(encode(m) for m in messages)


def assert_rows_equal(got: Rows, sent: Rows) -> None:
    """Same rows: observations of the same type and values, the columns with their
    dtypes, every array writable and contiguous (a user may write into them)."""
    obs, sent_obs = got.batch[0], sent.batch[0]
    if isinstance(sent_obs, np.ndarray):
        assert obs.dtype == sent_obs.dtype and np.array_equal(obs, sent_obs)
    elif not isinstance(sent_obs, dict):
        assert obs == sent_obs
    columns = (*got.batch[1:4], got.batch[4]["env_id"])
    for column, sent_column, dtype in zip(
        columns,
        (*sent.batch[1:4], sent.batch[4]["env_id"]),
        (np.float64, np.bool_, np.bool_, np.int64),
    ):
        assert column.dtype == dtype and np.array_equal(column, sent_column)
        assert column.flags.writeable and column.flags.c_contiguous
    assert got.row_infos == sent.row_infos


@pytest.mark.parametrize(
    "obs",
    [
        np.arange(12, dtype=np.float32).reshape(3, 2, 2),
        ("a text", "", "another one"),
        {"pos": np.zeros((3, 2), np.uint8), "name": ("x", "y", "z")},
    ],
    ids=["box", "text", "dict"],
)
def test_rows_round_trip(obs):
    sent = rows(3, obs, [{}, {"score": 1}, {"tool": "calc", "t": 0.5}])
    got = round_trip(sent)
    assert_rows_equal(got, sent)
    if isinstance(obs, dict):
        assert (
            np.array_equal(got.batch[0]["pos"], obs["pos"]) and got.batch[0]["name"] == obs["name"]
        )


def test_steps_resets_and_failures_round_trip():
    for actions in (np.array([[0.5, -1.0], [2.0, 3.0]], np.float32), ["say 1", "say 2"]):
        got = round_trip(Step(actions, np.array([4, 1])))
        assert np.array_equal(got.actions, actions) and got.env_ids.tolist() == [4, 1]
        assert got.env_ids.dtype == np.int64
    got = round_trip(Reset([None, 7], {"level": 2}, np.array([0, 1])))
    assert got.seeds == [None, 7] and got.options == {"level": 2}
    failure = round_trip(AgentFailure(ValueError("bad")))
    assert isinstance(failure.error, ValueError) and str(failure.error) == "bad"


@pytest.fixture
def pair():
    """Two connected channels over loopback TCP, authenticated as the cluster's are."""
    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 32)
    accepted: list = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()))
    thread.start()
    client = Channel(Client(listener.address, authkey=b"k" * 32))
    thread.join()
    server = Channel(accepted[0])
    yield client, server
    client.close()
    server.close()
    listener.close()


def read_all(reader: FrameReader, count: int, timeout_s: float = 30) -> tuple[list, list]:
    """``count`` frames (fewer if ``timeout_s`` runs out) and the slots that ended."""
    frames: list = []
    ended: list = []
    deadline = time.monotonic() + timeout_s
    while len(frames) < count and time.monotonic() < deadline:
        got, gone = reader.wait(1_000_000, int(0.2e9))
        frames += got
        ended += gone
    return frames, ended


@pytest.fixture
def reader():
    reader = FrameReader()
    yield reader
    reader.close()


def test_messages_arrive_whole_and_in_order_however_the_bytes_are_cut(reader):
    """Three channels' frames, sent at once in pieces cut anywhere (a header in two, a
    5.6 MB observation over many reads), come out of the driver's reader whole once their
    last byte is in, each channel's in the order sent; each names its channel."""
    seed = 20261202
    rng = np.random.default_rng(seed)
    pairs = [socket.socketpair() for _ in range(3)]
    sent = {}
    senders = []
    for slot, (ours, theirs) in enumerate(pairs):
        reader.add(ours.fileno(), slot)
        sent[slot] = [
            rows(2, np.full((2, 350_000), i, np.float64))
            if i % 7 == 3
            else rows(1 + i % 4, ("t",) * (1 + i % 4))
            for i in range(slot * 5, slot * 5 + 30)
        ]
        data = np.frombuffer(frames(sent[slot]), np.uint8)
        pieces = np.split(data, np.sort(rng.choice(len(data), size=60, replace=False)))
        senders.append(threading.Thread(
            target=lambda sock=theirs, pieces=pieces: [sock.sendall(p.tobytes()) for p in pieces]
        ))  # fmt: skip
    for sender in senders:
        sender.start()
    got, ended = read_all(reader, sum(len(m) for m in sent.values()))
    for sender in senders:
        sender.join()
    assert not ended, f"seed {seed}"
    for slot, messages in sent.items():
        mine = [decode(kind, payload) for k, kind, payload in got if k == slot]
        assert len(mine) == len(messages), f"seed {seed}"
        for a, b in zip(mine, messages):
            assert_rows_equal(a, b)
    for ours, theirs in pairs:
        ours.close()
        theirs.close()


def test_the_reader_waits_for_the_rows_asked_for(reader):
    """Frames of fewer rows than asked for are held until the timeout (the waiter is not
    woken per message); once the rows are in, the wait ends with every frame in."""
    ours, theirs = socket.socketpair()
    reader.add(ours.fileno(), 7)
    for n in (1, 2):
        theirs.sendall(encode(rows(n, ("o",) * n)))
    began = time.monotonic()
    got, ended = reader.wait(5, int(0.3e9))
    assert time.monotonic() - began >= 0.25  # 3 rows of 5: it waited out its timeout
    assert [(k, len(decode(kind, p).batch[1])) for k, kind, p in got] == [(7, 1), (7, 2)]
    assert ended == []
    sender = threading.Timer(0.1, lambda: theirs.sendall(frames([rows(2, ("a", "b"))] * 3)))
    sender.start()
    began = time.monotonic()
    got, _ = reader.wait(5, int(60e9))
    sender.join()
    assert time.monotonic() - began < 30  # 6 rows came: it did not wait for its 60 s
    assert sum(len(decode(kind, p).batch[1]) for _, kind, p in got) == 6
    ours.close()
    theirs.close()


def test_a_failure_or_a_channel_s_end_wakes_the_waiter_at_once(reader):
    """A frame that is not a rows frame (an agent's failure) ends a wait for rows at
    once; so does a channel's end, reported after the frames sent before it."""
    ours, theirs = socket.socketpair()
    reader.add(ours.fileno(), 0)
    threading.Timer(0.1, lambda: theirs.sendall(encode(AgentFailure(ValueError("bad"))))).start()
    began = time.monotonic()
    got, _ = reader.wait(1000, int(60e9))
    assert time.monotonic() - began < 30
    assert isinstance(decode(got[0][1], got[0][2]), AgentFailure)
    theirs.sendall(encode(rows(1, ("last",))))
    threading.Timer(0.1, theirs.close).start()
    got, ended = read_all(reader, 1)
    while not ended:
        more, ended = reader.wait(1000, int(60e9))
        got += more
    assert ended == [0] and decode(got[0][1], got[0][2]).batch[0] == ("last",)
    ours.close()


def test_a_removed_channel_s_frames_are_dropped_and_its_slot_can_be_read_again(reader):
    first, peer = socket.socketpair()
    reader.add(first.fileno(), 3)
    with pytest.raises(ValueError, match="read already"):
        reader.add(first.fileno(), 3)
    peer.sendall(frames([rows(1, ("old",))] * 4))
    time.sleep(0.2)  # the reader takes them in
    reader.remove(3)
    first.close()
    peer.close()
    assert reader.wait(1, int(0.2e9)) == ([], [])  # neither its frames nor its end
    second, peer = socket.socketpair()
    reader.add(second.fileno(), 3)
    peer.sendall(encode(rows(1, ("new",))))
    got, _ = read_all(reader, 1)
    assert [decode(kind, p).batch[0] for _, kind, p in got] == [("new",)]
    second.close()
    peer.close()
    reader.close()
    with pytest.raises(RuntimeError, match="closed"):
        reader.wait(1, 0)


def test_receive_blocks_for_a_whole_message_and_raises_eof_when_the_peer_closes(pair):
    client, server = pair
    frame = encode(Step(np.array([1]), np.array([0])))
    client.sock.sendall(frame[:3])
    timer = threading.Timer(0.1, lambda: client.sock.sendall(frame[3:]))
    timer.start()
    (message,) = server.receive()  # waits out the partial header
    timer.join()
    assert message.env_ids.tolist() == [0]
    client.send(Step(np.array([2]), np.array([1])))
    client.close()
    assert server.receive()[0].env_ids.tolist() == [1]  # what was sent before the close
    with pytest.raises(EOFError):
        server.receive()


def test_accept_turns_strangers_away_and_takes_the_driver():
    """A connection with the wrong key, or one dropped mid-handshake, does not stop the
    agent's listener from taking the driver's connection next; a closed one takes none."""
    key = b"k" * 32
    listener = Listener(("127.0.0.1", 0), authkey=key)
    closed = threading.Event()
    accepted: list = []
    thread = threading.Thread(target=lambda: accepted.append(accept(listener, closed)), daemon=True)
    thread.start()
    with pytest.raises(AuthenticationError):
        Client(listener.address, authkey=b"x" * 32)
    socket.create_connection(listener.address).close()
    driver = Channel(Client(listener.address, authkey=key))
    thread.join(timeout=30)
    agent = accepted[0]
    assert isinstance(agent, Channel)
    driver.send(Step(np.array([3]), np.array([1])))
    assert agent.receive()[0].env_ids.tolist() == [1]
    driver.close()
    agent.close()

    listener.close()  # the agent closed before the driver came
    assert accept(listener, closed) is None
