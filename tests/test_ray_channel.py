"""The cluster channel's frames (shmvec/ray/channel.py): every message type comes back
as it was sent, whole, in order, however the bytes are cut on their way; nothing needs Ray."""

from __future__ import annotations

import selectors
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

import numpy as np
import pytest

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
    size, kind = HEADER.unpack_from(frame)
    assert size == len(frame) - HEADER.size
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


def test_messages_arrive_whole_and_in_order_however_the_bytes_are_cut(pair):
    """Frames sent in pieces cut anywhere (a header in two, a 5.6 MB observation over many
    reads) come out whole once their last byte is in, read as the driver reads them (a
    selector, then one ``recv``); several frames in one read come out together."""
    client, server = pair
    seed = 20261202
    rng = np.random.default_rng(seed)
    sent = [
        rows(2, np.full((2, 350_000), i, np.float64))
        if i % 7 == 3
        else rows(1 + i % 4, ("t",) * (1 + i % 4))
        for i in range(40)
    ]
    data = np.frombuffer(frames(sent), np.uint8)
    pieces = np.split(data, np.sort(rng.choice(len(data), size=60, replace=False)))
    sender = threading.Thread(target=lambda: [client.sock.sendall(p.tobytes()) for p in pieces])
    sender.start()
    got: list = []
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        while len(got) < len(sent) and selector.select(timeout=30):
            got += server.receive(block=False)
    sender.join()
    assert len(got) == len(sent), f"seed {seed}"
    for a, b in zip(got, sent):
        assert_rows_equal(a, b)


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
