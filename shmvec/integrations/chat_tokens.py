"""Token ids of a multi-turn chat built by appending, never by re-rendering it.

A trainer must train on the very ids the model generated: decoding a turn and
tokenizing the whole chat again changes ids at BPE boundaries (drift), and a
builder that joins turns by hand loses what the chat template writes between
them (the newline after ChatML's ``<|im_end|>``). ``ChatTokens`` renders the
template once on a probe chat to learn two pieces of text, and from then on only
appends ids:

- the closing of an assistant turn (ChatML: ``<|im_end|>\\n``): after the model's
  own ids, whatever part of it the model did not generate (ChatML: ``\\n`` after
  the ``<|im_end|>`` that stopped generation; all of it after a length stop);
- one new message and the generation prompt, rendered alone
  (``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``).

The ids are those of ``tokenizer.encode`` of each appended piece; decoded, the
whole sequence is the text the template renders for the chat. Works with any
Hugging Face tokenizer whose chat template renders a chat as the concatenation of
its messages (ChatML, Llama 3, Mistral's and most others); a template that
rewrites earlier turns when one is added is refused at construction.
"""

from __future__ import annotations

from typing import Any

#: Stands in for message contents in the probe chats: text no template alters.
_MARK = "shmvec-probe-content-7f3a"


class ChatTokens:
    """The appended pieces of one tokenizer's chat template, as token ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        chat_template_kwargs: passed to each ``apply_chat_template`` call.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        probe = [{"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK}]
        self._base = self.render(probe, generation_prompt=False)
        #: What the template writes after an assistant turn's content.
        self.closing = self._base[self._base.rindex(_MARK) + len(_MARK) :]
        self._probe = probe
        self._check_append_only()
        specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
        # A stop the model generates ends at a special token (``<|im_end|>``), so the
        # closing's part that a generation may already hold ends at one too.
        self._generated_closings = [
            self.closing[:k]
            for k in range(len(self.closing), 0, -1)
            if any(s and self.closing[:k].endswith(s) for s in specials)
        ]

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs
        )
        if not isinstance(text, str):  # pragma: no cover - tokenize=False returns text
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` without special tokens (the model's words alone)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def initial(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's ids: ``messages`` rendered, with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def message_text(self, message: dict[str, Any]) -> str:
        """The text the template appends for ``message`` after an assistant turn,
        with the generation prompt after it."""
        full = self.render([*self._probe, message], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(
                "the chat template renders earlier turns differently once a message is added; "
                "token ids cannot be appended turn by turn with it"
            )
        return full[len(self._base) :]

    def closing_left(self, generated_ids: list[int]) -> str:
        """The part of the assistant turn's closing that ``generated_ids`` lack."""
        text = self.tokenizer.decode(generated_ids, skip_special_tokens=False)
        for done in self._generated_closings:
            if text.endswith(done):
                return self.closing[len(done) :]
        return self.closing

    def after_turn(self, generated_ids: list[int], message: dict[str, Any]) -> list[int]:
        """The ids to append after the model's ``generated_ids``: the rest of its
        turn's closing, then ``message`` and the generation prompt."""
        return self.encode(self.closing_left(generated_ids) + self.message_text(message))

    def _check_append_only(self) -> None:
        self.message_text({"role": "user", "content": _MARK})
