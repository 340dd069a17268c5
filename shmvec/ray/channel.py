"""The direct channel between a ClusterVectorEnv's driver and one node agent: a TCP
connection (``multiprocessing.connection``, HMAC-authenticated with a key the driver
makes) that the agent opens and whose address it returns through Ray. Commands go one
way, rows the other, each a pickled message of the types below; Ray stays for
placement, lifetime and calls that are not on the hot path.

Why not Ray calls: on one simulated node a Ray actor call costs the driver ~770 us of CPU
a message and a streaming generator ~400 us, this channel ~37 us (``dev/ray_channels.py``,
docs/benchmarks/data/2026-12-02-2vcpu-ray-channels.txt).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

__all__ = ["AgentFailure", "Reset", "Rows", "Step", "no_delay"]


def no_delay(conn: Connection) -> Connection:
    """Sets ``TCP_NODELAY`` on ``conn``'s socket: each message leaves at once. (With
    Nagle's algorithm a small message waits for the peer's delayed ACK, ~40 ms: the
    per-env latency of a 5 ms step rose from 18 to 43 ms p50 without this.)"""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()
    return conn


@dataclass
class Reset:
    """Driver to agent: reset envs ``env_ids`` (the agent's own), ``seeds[i]`` and
    ``options[i]`` (or ``options`` for all) for env ``env_ids[i]``."""

    seeds: list
    options: Any
    env_ids: np.ndarray


@dataclass
class Step:
    """Driver to agent: ``actions[i]`` for env ``env_ids[i]``."""

    actions: Any
    env_ids: np.ndarray


@dataclass
class Rows:
    """Agent to driver: ``(obs, rewards, terminations, truncations, infos)`` with
    ``infos["env_id"]`` the agent's own ids, and each row's info as its env returned it
    (None when no row has one)."""

    batch: tuple
    row_infos: list[dict] | None


@dataclass
class AgentFailure:
    """Agent to driver: a command failed in the agent (the driver raises ``error``)."""

    error: BaseException
