"""The native span reader (`_spanread`, built from ``_spanread.c``), if it can be used here.

`SPAN_READER` is None where the extension was not built (no compiler at install time, or
a checkout run without installing), where ``AIOHICACHE_NATIVE=0`` turns it off, or where
xxhash's ``XXH3_64bits_withSeed`` cannot be found or does not give `base.checksum`'s values;
the file store then reads in Python (same results, more of the GIL held per page).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from .base import checksum

__all__ = ("SPAN_READER", "SpanReader")

logger = logging.getLogger("aiohicache.storage.file")


@dataclass(frozen=True, slots=True)
class SpanReader:
    """The extension's `read_checked`, with the checksum function bound."""

    call: Callable[..., None]
    hash_address: int

    def read_checked(self, fd: int, offset: int, payload: int, per_call: int, prefix: bytes,
                     key_ids: bytes, dests: Sequence[memoryview], filled: bytearray) -> None:
        """Read ``len(dests)`` adjacent records from `offset` of `fd` into `dests`, `per_call`
        records per ``preadv``; ``filled[i]`` becomes 1 where record i's header starts with
        `prefix`, holds ``key_ids[8 i: 8 i + 8]`` and its payload's checksum.

        Blocking, with the GIL released throughout. A file that ends early stops the span
        (the rest stay 0). Raises OSError if a read fails (`filled` holds what was checked).
        """
        self.call(fd, offset, payload, per_call, prefix, key_ids, dests, filled,
                  self.hash_address)


def _load() -> SpanReader | None:
    if os.environ.get("AIOHICACHE_NATIVE", "1") == "0":
        return None
    try:
        from ._spanread import read_checked
    except ImportError:
        logger.debug("storage: the native span reader is not built; reading in Python")
        return None
    address = _hash_address()
    if address is None:
        return None
    return SpanReader(read_checked, address)


def _hash_address() -> int | None:
    """The address of xxhash's ``XXH3_64bits_withSeed`` (public in its extension), if it
    gives `checksum`'s values (the same function, with the ABI assumed)."""
    try:
        extension = importlib.import_module("xxhash._xxhash").__file__
        symbol = ctypes.CDLL(extension).XXH3_64bits_withSeed
    except (ImportError, OSError, AttributeError, TypeError) as exc:
        logger.debug("storage: xxhash's XXH3_64bits_withSeed not found (%s)", exc)
        return None
    fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64)
    address = ctypes.cast(symbol, ctypes.c_void_p).value
    if address is None:
        return None
    probe = fn(address)
    for size, seed in ((0, 0), (5, 7), (240, 1 << 63), (4099, 12345)):
        data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
        if probe(data, size, seed) != checksum(data, seed):
            logger.warning("storage: xxhash's XXH3_64bits_withSeed disagrees with "
                           "xxh3_64_intdigest; reading in Python")
            return None
    return address


SPAN_READER: Final = _load()
