"""Token ids kept turn by turn, the next turn's prompt built from ids (never from re-rendered
text), and what a trainer takes from trajectories and groups.

A multi-turn chat sampled from a server is trained on the tokens the model produced. Decoding
a turn's tokens and rendering the chat again does not give them back (byte-level BPE merges
across the boundary, templates that drop or add whitespace), so each turn's prompt here is the
previous turn's prompt and completion ids followed by the ids of what the chat template adds
for the new observation (its *delta*, :class:`ChatTokens`: the part of the assistant turn's
closing the completion lacks, such as the newline after ChatML's ``<|im_end|>``, then the new
messages and the generation prompt; :func:`turn_prompt` builds each turn's prompt so), and
each turn records:

- ``prompt_ids``: the ids the completion was sampled from, as sent;
- ``completion_ids``, ``logprobs``: as the server returned them, one log-probability per id;
- ``versions``: the policy version that produced each completion id;
- ``env_start``: where this turn's new (env) ids begin in ``prompt_ids``.

:func:`trajectory_sample` and :func:`batch_samples` turn trajectories and groups into what a
trainer consumes: the first prompt, the concatenated completion ids of every later turn
(model and env tokens), a mask with 1 for model tokens and 0 for env tokens, per-token
log-probabilities and versions, rewards and group ids. :func:`stop_completion` says where a
request's stop fields end a completion and the text vLLM gives for it (:class:`StopRule`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Stand for message contents in the probe chat: text no template alters.
_PROBE_USER = "shmvec-probe-question-7f3a"
_PROBE_REPLY = "shmvec-probe-reply-7f3a"
#: Text beside the template's own that the core encoder must encode as the tokenizer does.
_PROBE_TEXT = " Grüße,  wörld!\t12345 ¿x?\n\n "


@dataclass
class TurnTokens:
    """One sampled turn, token by token (the extra a server policy keeps beside its action).

    Attributes:
        prompt_ids: the prompt sent, as token ids.
        completion_ids: the sampled ids, as the server returned them (a stop token it
            generated included).
        logprobs: the log-probability of each completion id under the sampling weights.
        versions: the policy version that produced each completion id.
        env_start: ``prompt_ids[env_start:]`` are the ids this turn added after the previous
            turn's prompt and completion (the whole prompt on the first turn).
        messages: the chat messages this turn added (the opening messages on the first turn).
        finish_reason: the server's (``"stop"``, ``"length"``).
        drift: whether rendering the chat again as text and tokenizing it would have given
            other prompt ids (None: not compared).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    env_start: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = ""
    drift: bool | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"a turn needs one logprob and one version per completion id: {n} ids, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )
        if not 0 <= self.env_start <= len(self.prompt_ids):
            raise ValueError(
                f"env_start={self.env_start} is outside the prompt of {len(self.prompt_ids)} ids"
            )

    @property
    def env_ids(self) -> list[int]:
        """The ids this turn added to the context before sampling."""
        return self.prompt_ids[self.env_start :]

    @property
    def context_ids(self) -> list[int]:
        """The prompt's ids, then the completion's (what the next turn's prompt starts with)."""
        return self.prompt_ids + self.completion_ids


def next_prompt_ids(previous: TurnTokens, delta_ids: Sequence[int]) -> list[int]:
    """The next turn's prompt: ``previous``'s prompt and completion ids, then ``delta_ids``."""
    return [*previous.prompt_ids, *previous.completion_ids, *delta_ids]


class ChatTokens:
    """A tokenizer's chat template turned into ids turn by turn, by appending only.

    The template is rendered once on a probe chat to learn what it writes after an assistant
    reply's content (:attr:`closing`; ChatML: ``<|im_end|>\\n``). From then on:

    - ``first_prompt(messages)`` renders the opening messages with the generation prompt;
    - ``delta(messages, completion_ids)`` gives the ids that follow a completion when
      ``messages`` are added: the part of the closing the completion lacks
      (:meth:`closing_left`; ChatML: the ``\\n`` after the ``<|im_end|>`` that stopped
      generation, all of it after a length stop), then the new messages and the generation
      prompt, exactly as the template renders them after that reply;
    - ``rerender(turns, messages)`` renders a whole chat as text and tokenizes it, for
      counting drift.

    Works with any template that renders a chat as the concatenation of its messages
    (ChatML, Llama 3, Mistral's and most others).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (``apply_chat_template``,
            ``encode``, ``decode``).
        chat_template_kwargs: passed to every ``apply_chat_template`` call (such as
            ``{"enable_thinking": False}``).

    Raises:
        ValueError: the tokenizer has no chat template, or its template is not append-only
            (rendering a chat with more messages changes the text of the earlier ones).
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat template")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_REPLY},
        ]
        self._base = self._render(self._probe, False)
        specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", []) if t]
        self._core = _core_encoder(tokenizer, [self._base, _PROBE_TEXT.join(["", *specials, ""])])
        at = self._base.rfind(_PROBE_REPLY)
        if at < 0:
            raise ValueError("the chat template does not render an assistant reply's content")
        #: What the template writes after an assistant reply's content.
        self.closing: str = self._base[at + len(_PROBE_REPLY) :]
        #: The tokenizer's end-of-sequence ids (where a generation stops).
        self.stop_ids = frozenset(_stop_ids(tokenizer))
        # The leading parts of the closing that a generation may hold at its end: those that
        # end at a special token (ChatML: ``<|im_end|>``), longest first, as ids.
        self._generated_closings = [
            (k, self.encode(self.closing[:k]))
            for k in range(len(self.closing), 0, -1)
            if any(self.closing[:k].endswith(s) for s in specials)
        ]
        self._messages_text([{"role": "user", "content": _PROBE_USER}])  # append-only?

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.chat_template_kwargs,
        )
        if not isinstance(text, str):
            raise ValueError("the tokenizer's apply_chat_template(tokenize=False) gave no text")
        return text

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without the tokenizer's added special tokens."""
        if self._core is not None:
            return self._core(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The opening messages rendered with the generation prompt, as ids."""
        _check_messages(messages)
        return self.encode(self._render(messages, True))

    def closing_left(self, completion_ids: Sequence[int]) -> str:
        """The part of :attr:`closing` that ``completion_ids`` lack at their end."""
        tail = list(completion_ids)
        for length, ids in self._generated_closings:
            if ids and tail[-len(ids) :] == ids:
                return self.closing[length:]
        return self.closing

    def delta(self, messages: list[dict[str, Any]], completion_ids: Sequence[int]) -> list[int]:
        """The ids that follow ``completion_ids`` when ``messages`` are added to the chat."""
        _check_messages(messages)
        return self.encode(self.closing_left(completion_ids) + self._messages_text(messages))

    def _messages_text(self, messages: list[dict[str, Any]]) -> str:
        """What the template writes for ``messages`` after an assistant reply's closing,
        with the generation prompt."""
        grown = self._render([*self._probe, *messages], True)
        if not grown.startswith(self._base):
            raise ValueError(
                "the chat template is not append-only (it renders earlier turns differently "
                "once a message is added): a turn's prompt cannot be the previous prompt and "
                "completion plus a delta"
            )
        return grown[len(self._base) :]

    def reply_text(self, completion_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """A completion as the text an assistant message would hold (special tokens
        removed, unless ``skip_special_tokens`` is False)."""
        return str(
            self.tokenizer.decode(list(completion_ids), skip_special_tokens=skip_special_tokens)
        )

    def rerender(self, turns: Sequence[TurnTokens], messages: list[dict[str, Any]]) -> list[int]:
        """The prompt a text-only client would send after ``turns`` when ``messages`` come:
        every message and every decoded reply rendered again and tokenized."""
        chat: list[dict[str, Any]] = []
        for turn in turns:
            chat += turn.messages
            chat.append({"role": "assistant", "content": self.reply_text(turn.completion_ids)})
        return self.encode(self._render([*chat, *messages], True))


def _core_encoder(tokenizer: Any, probes: Sequence[str]) -> Callable[[str], list[int]] | None:
    """The ``encode`` of the Rust tokenizer under a Hugging Face fast tokenizer
    (``backend_tokenizer``), where nothing is set on it that the Python wrapper would undo
    (truncation, padding) and it gives the wrapper's ids for every probe; else None.

    The wrapper's ``encode`` goes through a batch call that lets go of the GIL and waits to
    take it back: on a rollout layer's event loop, with the layer's other threads running,
    each turn's encoding cost 212-239 µs of CPU and 290-323 µs of the loop's time against
    166-182 and 176-194 µs this way (``dev/turn_trace.py`` against ``dev/fake_llm_server.py``,
    256 envs, the tiny model's tokenizer, 2 alternated rounds of 20 s; 2-vCPU VM, 2026-11-28).
    """
    core = getattr(tokenizer, "backend_tokenizer", None)
    if core is None or getattr(core, "truncation", None) or getattr(core, "padding", None):
        return None

    def encode(text: str) -> list[int]:
        ids: list[int] = core.encode(text, add_special_tokens=False).ids  # a new list each call
        return ids

    for text in probes:
        if encode(text) != list(tokenizer.encode(text, add_special_tokens=False)):
            return None
    return encode


@dataclass(frozen=True)
class StopRule:
    """Where a server ends a completion, and the text it gives for it, as vLLM decides both
    from a request's ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
    ``include_stop_str_in_output`` and ``skip_special_tokens``.

    A stop token (one of ``token_ids``: the tokenizer's end of sequence unless
    ``ignore_eos``, and ``stop_token_ids``) ends the completion with it, its text left out;
    a stop string ends it at the token that completes the string, the text cut before the
    string. Neither counts within the first ``min_tokens`` ids. With ``include`` the text
    keeps the stop token's or string's text.
    """

    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()
    include: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, extra: Mapping[str, Any], eos_ids: Iterable[int]) -> StopRule:
        """The rule of a request body's fields ``extra`` (``Sampling.extra``, checked)."""
        stop = extra.get("stop") or ()
        ids = set(extra.get("stop_token_ids") or ())
        if not extra.get("ignore_eos", False):
            ids |= set(eos_ids)
        return cls(
            strings=(stop,) if isinstance(stop, str) else tuple(stop),
            token_ids=frozenset(ids),
            include=bool(extra.get("include_stop_str_in_output", False)),
            min_tokens=int(extra.get("min_tokens") or 0),
            skip_special_tokens=bool(extra.get("skip_special_tokens", True)),
        )


@dataclass(frozen=True)
class Stopped:
    """A completion under a :class:`StopRule`: its first ``kept`` ids are the completion,
    ``text`` is their text as the server gives it, ``stopped`` whether a stop token or string
    ended it."""

    kept: int
    text: str
    stopped: bool


def stop_completion(chat: ChatTokens, ids: Sequence[int], rule: StopRule) -> Stopped:
    """Where ``rule`` ends the completion ``ids`` and what its text is.

    For one request's reply this is where the server stopped (a no-op on its ids) and the
    text it sent; for a completion grown over several requests (interrupted, or a stream
    that broke) it also finds a stop the server could not see, a stop string across two
    requests."""
    decode = functools.partial(chat.reply_text, skip_special_tokens=rule.skip_special_tokens)
    kept, by_token = len(ids), False
    for k in range(rule.min_tokens, len(ids)):  # vLLM's sampler masks stop ids before
        if ids[k] in rule.token_ids:
            kept, by_token = k + 1, True
            break
    text_ids = list(ids[: kept - 1] if by_token and not rule.include else ids[:kept])
    text = decode(text_ids)
    if rule.strings:
        floor = len(decode(list(ids[: rule.min_tokens]))) if rule.min_tokens else 0
        match = _first_stop_string(text, rule.strings, floor)
        if match is not None:
            stop, start = match
            ends = functools.partial(_holds, decode, text_ids, stop, max(floor - len(stop) + 1, 0))
            n = len(text_ids)
            if n > 1 and ends(n - 1):  # the string ends before the last id: find the id
                lo, hi = 1, n - 1  # the first prefix that holds it
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if ends(mid) else (mid + 1, hi)
                n = lo
            return Stopped(n, text[: start + len(stop) if rule.include else start], True)
    return Stopped(kept, text, by_token)


def _first_stop_string(text: str, strings: Sequence[str], floor: int) -> tuple[str, int] | None:
    """The stop string that ends first in ``text`` after ``floor`` characters (ties: the
    first listed), and where it starts; None if none does."""
    best: tuple[str, int] | None = None
    for stop in strings:
        at = text.find(stop, max(floor - len(stop) + 1, 0))
        if at >= 0 and (best is None or at + len(stop) < best[1] + len(best[0])):
            best = (stop, at)
    return best


def _holds(decode: Callable[[list[int]], str], ids: list[int], stop: str, lo: int, k: int) -> bool:
    return decode(ids[:k]).find(stop, lo) >= 0


def context_full(prompt_ids: Sequence[int], context: int | None) -> str | None:
    """Why ``prompt_ids`` leave no room for a completion in a model's context of ``context``
    ids (a ``Trajectory.reason``); None where they do, or where the context is unknown."""
    if context is None or len(prompt_ids) < context:
        return None
    return (
        f"context_length: a prompt of {len(prompt_ids)} ids fills the model's context of {context}"
    )


def turn_prompt(
    chat: ChatTokens, turns: Sequence[Any], messages: list[dict[str, Any]]
) -> tuple[list[int], int]:
    """The next turn's ``(prompt_ids, env_start)`` after ``turns`` (a trajectory's
    :class:`TurnTokens` so far) when ``messages`` come.

    The first turn renders ``messages`` with the generation prompt; every later turn is the
    previous turn's prompt and completion ids followed by the chat template's delta for
    ``messages`` (:meth:`ChatTokens.delta`), whose ids begin at ``env_start``.

    Raises:
        ValueError: the previous turn kept something else than ``TurnTokens``.
    """
    if not turns:
        return chat.first_prompt(messages), 0
    previous = turns[-1]
    if not isinstance(previous, TurnTokens):
        raise ValueError(
            f"the trajectory's last extra is {type(previous).__name__}, not TurnTokens: one "
            "token policy must choose every action of its trajectories"
        )
    delta = chat.delta(messages, previous.completion_ids)
    return next_prompt_ids(previous, delta), len(previous.context_ids)


def _stop_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a turn needs a non-empty list of chat messages, got {messages!r}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"a chat message is a dict with 'role' and 'content', got {m!r}")


@dataclass
class TokenSample:
    """One trajectory as a trainer consumes it.

    ``completion_ids`` concatenates every turn's completion and, between them, the env ids
    of the next turn; ``mask[i]`` is 1 for a model id and 0 for an env id; ``logprobs[i]``
    and ``versions[i]`` are the sampling log-probability and policy version of a model id
    (0.0 and -1 for env ids). ``prompt_ids + completion_ids`` is the last turn's prompt
    and completion, id for id. ``status`` is how the trajectory ended (a
    :class:`~shmvec.rollouts.Status` value: ``"terminated"``, ``"truncated"``,
    ``"max_steps"``, ``"policy_ended"``), for a trainer that masks cut-off trajectories.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    turn_rewards: list[float]
    group_id: int
    index: int
    status: str


def trajectory_sample(trajectory: Any) -> TokenSample:
    """The :class:`TokenSample` of a finished trajectory whose extras are :class:`TurnTokens`.

    Raises:
        ValueError: a turn's extra is not a ``TurnTokens``, or a turn's prompt does not start
            with the previous turn's prompt and completion.
    """
    turns = list(trajectory.extras)
    for t, turn in enumerate(turns):
        if not isinstance(turn, TurnTokens):
            raise ValueError(
                f"step {t} of trajectory (group {trajectory.group_id}, index "
                f"{trajectory.index}) kept {type(turn).__name__}, not TurnTokens"
            )
    prompt: list[int] = turns[0].prompt_ids if turns else []
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for t, turn in enumerate(turns):
        if t:
            previous = turns[t - 1]
            if turn.env_start != len(previous.prompt_ids) + len(previous.completion_ids) or (
                turn.prompt_ids[: turn.env_start] != previous.context_ids
            ):
                raise ValueError(
                    f"turn {t}'s prompt does not start with turn {t - 1}'s prompt and completion"
                )
            env = turn.env_ids
            ids += env
            mask += [0] * len(env)
            logprobs += [0.0] * len(env)
            versions += [-1] * len(env)
        ids += turn.completion_ids
        mask += [1] * len(turn.completion_ids)
        logprobs += turn.logprobs
        versions += turn.versions
    return TokenSample(
        prompt_ids=list(prompt),
        completion_ids=ids,
        mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=float(sum(trajectory.rewards)),
        turn_rewards=[float(r) for r in trajectory.rewards],
        group_id=int(trajectory.group_id),
        index=int(trajectory.index),
        status=trajectory.status.value,
    )


@dataclass
class TokenBatch:
    """Groups as a trainer consumes them: one entry per kept trajectory, the trajectories
    of a group contiguous (``group_ids`` tells them apart)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    mask: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    rewards: list[float]
    group_ids: list[int]
    statuses: list[str]

    def __len__(self) -> int:
        return len(self.rewards)


def batch_samples(groups: Iterable[Any]) -> TokenBatch:
    """The :class:`TokenBatch` of complete groups (their kept trajectories, in order)."""
    samples = [trajectory_sample(t) for g in groups for t in g.trajectories]
    return TokenBatch(
        prompt_ids=[s.prompt_ids for s in samples],
        completion_ids=[s.completion_ids for s in samples],
        mask=[s.mask for s in samples],
        logprobs=[s.logprobs for s in samples],
        versions=[s.versions for s in samples],
        rewards=[s.reward for s in samples],
        group_ids=[s.group_id for s in samples],
        statuses=[s.status for s in samples],
    )


__all__ = [
    "ChatTokens",
    "StopRule",
    "Stopped",
    "TokenBatch",
    "TokenSample",
    "TurnTokens",
    "batch_samples",
    "context_full",
    "next_prompt_ids",
    "stop_completion",
    "trajectory_sample",
    "turn_prompt",
]
