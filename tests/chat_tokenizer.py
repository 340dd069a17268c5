"""A tiny byte-level BPE tokenizer with a ChatML chat template, trained at test time
with ``tokenizers`` (nothing from a model hub)."""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Guess my number, 1 to 9. No. Try higher. No. Try lower. Yes, 7!",
    "I say 5. I think it is 3. Maybe 8? My guess is 2, or 9, or 4, 6, 1.",
    "You are a player of guessing games. Answer with one number.",
    "system user assistant\n the a an of to in is it that",
]


def chatml_tokenizer():
    """A ``PreTrainedTokenizerFast``: byte-level BPE over ``CORPUS``, ChatML specials,
    ``<|im_end|>`` as its end-of-turn (eos) token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer
