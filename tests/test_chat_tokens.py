"""ChatTokens: a chat's ids built by appending the template's pieces decode to the text
the chat template renders, with what it writes between turns (ChatML's newline after
``<|im_end|>``), after a stop at the end-of-turn token and after a length stop."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed")

from chat_tokenizer import chatml_tokenizer  # noqa: E402

from shmvec.integrations.chat_tokens import ChatTokens  # noqa: E402


def test_appended_ids_decode_to_the_rendered_chat():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    tokenizer = chatml_tokenizer()
    chat = ChatTokens(tokenizer)
    assert chat.closing == "<|im_end|>\n"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = chat.initial(messages)
    for _ in range(6):
        said = f"I say {rng.randint(1, 9)}"
        generated = tokenizer.encode(said, add_special_tokens=False)
        if rng.random() < 0.7:
            generated.append(tokenizer.eos_token_id)  # a stop at the end of the turn
        answer = {"role": "user", "content": f"No. Try {rng.choice(['higher', 'lower'])}."}
        ids += generated + chat.after_turn(generated, answer)
        messages += [{"role": "assistant", "content": chat.decode(generated)}, answer]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered, seed


def test_the_newline_after_the_end_of_turn_token_is_appended():
    tokenizer = chatml_tokenizer()
    chat = ChatTokens(tokenizer)
    stopped = tokenizer.encode("I say 5", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert chat.closing_left(stopped) == "\n"
    assert chat.closing_left(stopped[:-1]) == "<|im_end|>\n"  # a length stop
    appended = tokenizer.decode(chat.after_turn(stopped, {"role": "user", "content": "No."}))
    assert appended == "\n<|im_start|>user\nNo.<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = chatml_tokenizer()
    # Shows only the last assistant turn: earlier ones vanish when one is added.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatTokens(tokenizer)
