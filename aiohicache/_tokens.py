"""Token ids as the cache keeps them: a fresh 1-D int32 array (int64 if an id does not fit
in int32), checked at the door."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .errors import ConfigError
from .radix._results import Keys, narrow

__all__ = ("TokenInput", "Tokens", "as_tokens")

Tokens = Keys
"""A request's token ids: int32 where every id fits, else int64."""

TokenInput = Sequence[int] | torch.Tensor | np.ndarray


def as_tokens(tokens: TokenInput) -> Tokens:
    """Token ids as a fresh 1-D array (a copy: the caller may reuse its buffer): int32 when
    every id fits, else int64.

    Ids must fit in int64: a uint64 id of 2**63 or more would wrap to a negative id and
    match KV committed for another token, so it is refused rather than converted.

    NOTE: int32 because the radix tree keeps int32 keys while its ids fit (half the bytes
    to compare, copy and fault in); handed int64, it converts them at every query, which
    cost more than the halved bytes saved (`bench tree`, docs/performance.md). The copy made
    here anyway is the conversion.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex \
                or tokens.dtype == torch.bool:
            raise ConfigError("tokens: must be a 1-D integer tensor")
        if tokens.layout != torch.strided or tokens.is_meta:  # no ids to copy out
            raise ConfigError(f"tokens: must be a dense tensor with data, got a "
                              f"{tokens.layout} tensor on {tokens.device}")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence | np.ndarray):
        raise ConfigError(f"tokens: must be a sequence of ints, got {type(tokens).__name__}")
    else:
        try:
            arr = np.array(tokens)
        except (ValueError, TypeError) as exc:  # ragged nesting, or ids numpy cannot hold
            raise ConfigError(f"tokens: must be a 1-D sequence of int token ids ({exc})") \
                from None
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError("tokens: must be a 1-D sequence of int token ids (each in int64 "
                          "range)")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _MAX_TOKEN:
        raise ConfigError(f"tokens: token id {int(arr.max())} does not fit in int64 "
                          f"(max {_MAX_TOKEN})")
    if arr.dtype == np.int32:
        return arr.copy()
    wide = arr.astype(np.int64, copy=False)
    keys = narrow(wide)  # (a new array)
    if keys is not None:
        return keys
    return wide.copy() if wide is arr else wide


_MAX_TOKEN = int(np.iinfo(np.int64).max)
