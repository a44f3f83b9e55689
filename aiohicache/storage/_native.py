"""The native span reader (`_spanread`, built from ``_spanread.c``), if it can be used here.

`SPAN_READER` is None where the extension was not built (no compiler at install time, or
a checkout run without installing), where ``AIOHICACHE_NATIVE=0`` turns it off, or where
xxhash's XXH3 functions cannot be found or do not give `base.checksum`'s values; the file
store then reads in Python (same results, the GIL held for more of each page).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, cast

import numpy as np

from .._native import load_extension
from .base import checksum

__all__ = ("CHECKSUMS", "SPAN_READER", "SpanReader", "first_overlap")

logger = logging.getLogger("aiohicache.storage.file")

_XXH3: Final = ("XXH3_64bits_withSeed", "XXH3_createState", "XXH3_freeState",
                "XXH3_64bits_reset_withSeed", "XXH3_64bits_update", "XXH3_64bits_digest")
"""What `_spanread.bind` takes, in its order: xxhash's public XXH3-64 API."""


@dataclass(frozen=True, slots=True)
class SpanReader:
    """The extension's `read_checked` (its hash functions bound)."""

    call: Callable[..., None]

    def read_checked(self, fd: int, offset: int, payload: int, chunk: int, prefix: bytes,
                     key_ids: bytes, dests: Sequence[memoryview], filled: bytearray) -> None:
        """Read ``len(dests)`` adjacent records from `offset` of `fd` into `dests`, about
        `chunk` bytes per ``preadv`` (a record larger than that, a chunk at a time);
        ``filled[i]`` becomes 1 where record i's header starts with `prefix`, holds
        ``key_ids[8 i: 8 i + 8]`` and its payload's checksum.

        Blocking, with the GIL released throughout. A file that ends early stops the span
        (the rest stay 0). Raises OSError if a read fails (`filled` holds what was checked).
        """
        self.call(fd, offset, payload, chunk, prefix, key_ids, dests, filled)


def first_overlap(views: Sequence[memoryview]) -> tuple[int, int] | None:
    """The first two of `views` (byte views; ``i < j``) whose bytes overlap, or None."""
    if _first_overlap is not None:
        return _first_overlap(views)
    starts = [(_address(view), i) for i, view in enumerate(views) if len(view)]
    extents = sorted((start, start + len(views[i]), i) for start, i in starts)
    widest: tuple[int, int, int] | None = None
    for start, end, i in extents:
        if widest is not None and start < widest[1]:
            return min(i, widest[2]), max(i, widest[2])
        if widest is None or end > widest[1]:
            widest = (start, end, i)
    return None


def _address(view: memoryview) -> int:
    # NOTE: ctypes takes 0.8 µs where numpy takes 4.8, but only from a writable buffer
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # read-only
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _load() -> SpanReader | None:
    if (module := _MODULE) is None:
        return None
    addresses = _xxh3_addresses()
    if addresses is None:
        return None
    module.bind(*addresses)
    return SpanReader(module.read_checked)


def _xxh3_addresses() -> list[int] | None:
    """The addresses of `_XXH3` in xxhash's extension (public symbols there), if they give
    `checksum`'s values, whole and piece by piece (the same functions, the ABI assumed)."""
    try:
        library = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        symbols = [getattr(library, name) for name in _XXH3]
    except (ImportError, OSError, AttributeError, TypeError) as exc:
        logger.info("storage: xxhash's XXH3 functions not found (%s); the file store "
                    "reads in Python", exc)
        return None
    addresses = [ctypes.cast(symbol, ctypes.c_void_p).value or 0 for symbol in symbols]
    if 0 in addresses or not _agrees(addresses):
        logger.warning("storage: xxhash's XXH3 functions disagree with its binding; "
                       "reading in Python")
        return None
    return addresses


def _agrees(addresses: list[int]) -> bool:
    u64, ptr, size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
    oneshot = ctypes.CFUNCTYPE(u64, ctypes.c_char_p, size, u64)(addresses[0])
    create = ctypes.CFUNCTYPE(ptr)(addresses[1])
    free = ctypes.CFUNCTYPE(ctypes.c_int, ptr)(addresses[2])
    reset = ctypes.CFUNCTYPE(ctypes.c_int, ptr, u64)(addresses[3])
    update = ctypes.CFUNCTYPE(ctypes.c_int, ptr, ctypes.c_char_p, size)(addresses[4])
    digest = ctypes.CFUNCTYPE(u64, ptr)(addresses[5])
    state = create()
    if not state:
        return False
    try:
        for size_, seed in ((0, 0), (5, 7), (240, 1 << 63), (4099, 12345)):
            data = bytes(range(256)) * (size_ // 256) + bytes(range(size_ % 256))
            reset(state, seed)
            for lo in range(0, size_, 1000):
                update(state, data[lo:lo + 1000], len(data[lo:lo + 1000]))
            want = checksum(data, seed)
            if oneshot(data, size_, seed) != want or digest(state) != want:
                return False
    finally:
        free(state)
    return True


def _load_overlap() -> Callable[[Sequence[memoryview]], tuple[int, int] | None] | None:
    return None if _MODULE is None else cast(Callable[..., tuple[int, int] | None],
                                             _MODULE.first_overlap)


def _load_checksums() -> Callable[[bytes, Sequence[memoryview]], bytes] | None:
    if SPAN_READER is None or _MODULE is None:  # not usable, or the hash not bound
        return None
    return cast(Callable[[bytes, Sequence[memoryview]], bytes], _MODULE.checksums)


_MODULE: Final = load_extension(
    "aiohicache.storage._spanread", logger=logger,
    fallback="the file store reads in Python (slower for small pages: docs/storage.md)")
SPAN_READER: Final = _load()
CHECKSUMS: Final = _load_checksums()
"""``CHECKSUMS(key_ids, payloads)``: each payload's `checksum` (seeded with its 8-byte key
id), as little-endian u64s, the GIL released while hashing; None where not usable."""
_first_overlap: Final = _load_overlap()
