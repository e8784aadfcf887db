"""A tiny random Llama (head dim 64, the least vLLM's CPU attention takes) and a byte-level BPE
tokenizer, both built offline: no hub, no download. Seeded, so every build is the same model."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Final

CORPUS: Final = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different machines; the KV cache travels between them.",
    "A transfer engine writes the blocks straight into the memory of the decoder.",
    "Every message has a version, every field a meaning, every timer a bound.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-()[]{}",
]
VOCAB: Final = 1024
SPECIAL: Final = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE: Final = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def location() -> Path:
    """Where ``cached`` keeps the model: in the virtual environment (ignored by git), keyed by
    this file's text so that a change to the recipe builds a new one."""
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return Path(sys.prefix) / "pdwire-test-models" / f"tiny-llama-{key}"


def cached() -> Path:
    """The model, built once into ``location()``."""
    path = location()
    if not path.exists():
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        _build(scratch)
        try:
            scratch.rename(path)
        except OSError:  # another process built it first
            shutil.rmtree(scratch, ignore_errors=True)
        for stale in path.parent.glob("tiny-llama-*"):
            if stale != path and not stale.name.endswith(".tmp"):
                shutil.rmtree(stale, ignore_errors=True)
    return path


def _build(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True)
    _tokenizer(path)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))


# Builds the model in a process of its own (fleet.py).
if __name__ == "__main__":
    print(cached())
