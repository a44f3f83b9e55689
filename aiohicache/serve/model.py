"""The model a server runs: the tiny random Llama, or a local checkpoint (never a download)."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .. import ConfigError
from ..hf import tiny_llama
from .engine import ByteTokenizer, Tokenizer

__all__ = ("load_model",)


def load_model(path: str | None = None, *, seed: int = 0) -> tuple[PreTrainedModel, Tokenizer,
                                                                    str]:
    """``(model, tokenizer, name)``: `path`'s checkpoint, or `tiny_llama` (seeded) if None.

    A checkpoint is read from local files only (``local_files_only``: nothing is fetched
    from a hub), in float32 on the CPU; its tokenizer if it has one, else bytes.

    Raises:
        ConfigError: `path` is not a loadable local checkpoint.
    """
    if path is None:
        model = tiny_llama(seed=seed)
        return model, ByteTokenizer(model.config.vocab_size), "tiny-llama"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model: cannot load a local checkpoint from {path!r}: {exc}") \
            from None
    model.train(False)
    return model, _tokenizer(path, model), os.path.basename(os.path.normpath(path))


def _tokenizer(path: str, model: PreTrainedModel) -> Tokenizer:
    try:
        tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return ByteTokenizer(max(256, int(model.config.vocab_size)))
    return tok  # type: ignore[no-any-return]
