"""A tiny chat model made on the spot: a byte-level BPE tokenizer with ChatML and a randomly
initialized Llama, saved as a Hugging Face folder that an inference server (vLLM) can serve.

Nothing is downloaded: the tokenizer is trained with ``tokenizers`` on text generated from
the seed, the weights are drawn with ``torch`` from the seed, and the same seed gives the
same files. The model writes random bytes, which is what a test of token bookkeeping needs:
decoding its tokens and encoding the text again often gives other tokens.

    >>> from shmvec.testing.tiny_llm import tiny_llm  # doctest: +SKIP
    >>> path = tiny_llm()  # built once, then found in the cache  # doctest: +SKIP

Needs ``torch``, ``transformers`` and ``tokenizers`` (``pip install "shmvec[server]"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

#: ChatML: each message is ``<|im_start|>{role}\n{content}<|im_end|>\n``; the generation
#: prompt is ``<|im_start|>assistant\n``; the model ends its turn with ``<|im_end|>``.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Bump when what ``build_tiny_llm`` writes changes, so that old caches are not reused.
FORMAT = 1

_WORDS = (
    "the a frozen lake hole goal start left right up down move step you are at row column "
    "reward tool call answer guess number higher lower correct wrong think try again "
    "observation action agent env game turn done 0 1 2 3 4 5 6 7 8 9 ."
).split()


@dataclass(frozen=True)
class TinyLLMSpec:
    """What a tiny model is made of (its cache key, with ``FORMAT``).

    Attributes:
        seed: draws the training text and the weights.
        vocab_size: the BPE trainer's target (256 bytes, the specials, then merges).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads: the Llama.
        max_positions: the longest sequence the model takes.
    """

    seed: int = 0
    vocab_size: int = 320
    hidden_size: int = 256  # 4 heads of 64: vLLM's CPU attention needs a head size it supports
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 4096

    def key(self) -> str:
        text = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$SHMVEC_TINY_LLM_CACHE``, else ``<tmp>/shmvec-tiny-llm``."""
    root = os.environ.get("SHMVEC_TINY_LLM_CACHE")
    return Path(root) if root else Path(tempfile.gettempdir()) / "shmvec-tiny-llm"


def tiny_llm(spec: TinyLLMSpec | None = None, cache_dir: str | Path | None = None) -> Path:
    """The folder of the tiny model ``spec`` (default ``TinyLLMSpec()``), built on first
    use under ``cache_dir`` (default ``default_cache_dir()``); safe to call from
    several processes at once (each builds aside, the first rename wins)."""
    spec = spec or TinyLLMSpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / f"tiny-llm-{spec.key()}"
    if (path / "config.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build_tiny_llm(staging, spec)
        try:
            staging.rename(path)
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def build_tiny_llm(directory: str | Path, spec: TinyLLMSpec | None = None) -> Path:
    """Writes the tokenizer, the chat template and random Llama weights of ``spec`` into
    ``directory`` (created if missing) and returns it."""
    spec = spec or TinyLLMSpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(str(directory))
    _save_model(directory, spec, tokenizer)
    return directory


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    """Chat-like lines from a fixed word list, drawn from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        role = rng.choice(("user", "assistant", "system"))
        out.append(f"<|im_start|>{role}\n{words}<|im_end|>\n")
    return out


def _train_tokenizer(spec: TinyLLMSpec):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _save_model(directory: Path, spec: TinyLLMSpec, tokenizer) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=bos,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos).save_pretrained(
        str(directory)
    )
