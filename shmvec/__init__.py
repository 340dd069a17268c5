"""shmvec: gymnasium vector environments over shared memory and futexes.

``ShmVectorEnv`` is a drop-in replacement for ``gymnasium.vector.AsyncVectorEnv``;
``make_vec`` is ``gymnasium.make_vec`` building one; ``UnboundedText`` is the
space of text of any length (LLM-agent envs); ``AwaitableEnvs`` leases envs to
coroutines (``await env.step(action)``).
"""

import logging

from shmvec.awaitable import AwaitableEnv, AwaitableEnvs
from shmvec.errors import (
    EnvDeadlineError,
    EnvFailure,
    EnvNodeLostError,
    EnvStepError,
    EnvWorkerDiedError,
    LeaseError,
    StepDeadlineExceeded,
    WaitingEnvsWarning,
    WorkerDiedError,
)
from shmvec.registration import make_mix, make_vec
from shmvec.text import UnboundedText
from shmvec.vector_env import ShmVectorEnv

__all__ = [
    "AwaitableEnv",
    "AwaitableEnvs",
    "EnvDeadlineError",
    "EnvFailure",
    "EnvNodeLostError",
    "EnvStepError",
    "EnvWorkerDiedError",
    "LeaseError",
    "ShmVectorEnv",
    "StepDeadlineExceeded",
    "UnboundedText",
    "WaitingEnvsWarning",
    "WorkerDiedError",
    "make_mix",
    "make_vec",
]
# The one place the version is set: pyproject.toml reads it, `python -m shmvec --version` prints it.
__version__ = "0.1.0"

# Silent unless the application configures logging ("shmvec" logger: worker start and
# exit at INFO, deaths at ERROR, per-worker timing at DEBUG).
logging.getLogger("shmvec").addHandler(logging.NullHandler())
