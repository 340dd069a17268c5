"""What :class:`~shmvec.rollouts.server.ServerPolicy` sends and what it accepts back: the body
of each ``/v1/completions`` request, with the stop rule its fields make (:class:`RequestBody`),
and the checks that the server is the policy's, serving its model with its tokenizer
(:class:`ServerCheck`).

Everything here runs on the policy's event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shmvec.rollouts.server_client import CONSTRAINED_FIELDS, Piece, Sampling, ServerSetupError
from shmvec.rollouts.tokens import ChatTokens, StopRule, stop_completion

#: Replies whose text is compared with the ids decoded by the policy's tokenizer, to find a
#: tokenizer that is not the server's (ids decode to other text).
TOKENIZER_CHECKS = 16


@dataclass(frozen=True)
class RequestBody:
    """The body of a request for ``model``'s completion under ``sampling`` (token ids in, token
    ids and log-probabilities out), and ``stops``, where the server ends it
    (:meth:`of` builds both)."""

    model: str
    sampling: Sampling
    stops: StopRule

    @classmethod
    def of(
        cls, model: str, sampling: Sampling, eos_ids: Iterable[int], interrupt: bool
    ) -> RequestBody:
        """The body of ``sampling``'s requests, whose stop tokens include ``eos_ids`` (unless
        ``ignore_eos``).

        Raises:
            ValueError: guided decoding fields (``CONSTRAINED_FIELDS``) with ``interrupt``: a
                request continued after an interruption would start the constraint again.
        """
        constrained = sorted(set(sampling.extra) & CONSTRAINED_FIELDS)
        if interrupt and constrained:
            raise ValueError(
                f"Sampling.extra {constrained} with interrupt=True: a request continued after "
                "an interruption would start the constraint again; use interrupt=False"
            )
        return cls(model, sampling, StopRule.of(sampling.extra, eos_ids))

    def __call__(
        self, prompt: list[int], max_tokens: int, stream: bool, generated: int = 0
    ) -> dict[str, Any]:
        """The request body; ``generated``: the completion's ids already in ``prompt`` (a
        continued request's ``min_tokens`` counts them)."""
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "logprobs": 0,
            "stream": stream,
            "return_token_ids": True,
            **s.extra,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if generated and "min_tokens" in body:
            body["min_tokens"] = max(int(body["min_tokens"]) - generated, 0)
        return body


class ServerCheck:
    """Whether the server at ``base_url`` is the policy's: OpenAI-compatible, serving ``model``,
    with the tokenizer of ``chat`` (its ``/tokenize`` of a probe text where it has one, every
    reply's ids inside the tokenizer's ``vocab`` ids, and the first ``TOKENIZER_CHECKS``
    replies' texts equal to their ids decoded under ``stops``); each check raises
    ``ServerSetupError`` naming what differs."""

    def __init__(
        self, base_url: str, model: str, chat: ChatTokens, vocab: int, stops: StopRule
    ) -> None:
        self.base_url, self.model, self.chat = base_url, model, chat
        self.vocab, self.stops = vocab, stops
        self.text_checks = 0  # replies whose text was compared

    async def served(self, client: Any) -> int | None:
        """Checks that the server serves the model; returns its ``max_model_len`` if it says."""
        try:
            models = await client.models.list()
            served = {m.id: m for m in models.data}
        except (ValueError, TypeError, AttributeError, KeyError) as error:
            raise ServerSetupError(
                f"{self.base_url} is not an OpenAI-compatible server: GET /models answered "
                f"{error!r:.200}"
            ) from error
        if self.model not in served:
            raise ServerSetupError(
                f"the server at {self.base_url} does not serve model {self.model!r}; it serves "
                f"{sorted(served)}"
            )
        length = getattr(served[self.model], "max_model_len", None)
        return int(length) if isinstance(length, int) else None

    async def tokenizer(self, client: Any) -> None:
        """Compares the server's tokenization of a probe text with the policy tokenizer's,
        where the server has vLLM's ``/tokenize``."""
        import openai

        probe = self.chat.closing + "shmvec probe: héllo, 42 + 7 = 49!"
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        try:
            answer = await client.post(
                f"{root}/tokenize",
                cast_to=object,
                body={"model": self.model, "prompt": probe, "add_special_tokens": False},
            )
        except openai.APIStatusError as error:
            if error.status_code in (404, 405):
                return  # not vLLM: the replies' ids are checked instead
            raise
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        ours = self.chat.encode(probe)
        if theirs is not None and list(theirs) != ours:
            raise ServerSetupError(
                f"the tokenizer does not match the server's: {probe!r} is {ours} here and "
                f"{theirs} on the server"
            )

    def ids(self, ids: list[int]) -> None:
        """Checks that a reply's ``ids`` are the tokenizer's."""
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise ServerSetupError(
                f"the server returned token ids {bad[:5]} outside the tokenizer's "
                f"{self.vocab} ids: the tokenizer does not match the server's model"
            )

    def reply(self, piece: Piece) -> None:
        """Checks a whole reply's ids, and (for the first ``TOKENIZER_CHECKS``) its text."""
        self.ids(piece.ids)
        if piece.text is None or self.text_checks >= TOKENIZER_CHECKS:
            return
        self.text_checks += 1
        ours = stop_completion(self.chat, piece.ids, self.stops).text.replace("\ufffd", "")
        theirs = piece.text.replace("\ufffd", "")
        if ours != theirs and not (
            # another server may cut its text elsewhere at a stop: a prefix of the ids' text
            piece.finish_reason == "stop"
            and self.chat.reply_text(piece.ids, self.stops.skip_special_tokens)
            .replace("\ufffd", "")
            .startswith(theirs)
        ):
            raise ServerSetupError(
                f"the server's text {piece.text!r:.80} is not its ids decoded by the "
                f"tokenizer ({ours!r:.80}): the tokenizer does not match the server's model"
            )
