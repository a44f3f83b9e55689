"""An in-process `StorageBackend`: a dict of page objects (the ``memory://`` URL, and a fake).

It stores exactly what a remote backend would (header + payload, checked on every read), so
code tested against it meets the same misses, rejections and budget evictions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Self

import anyio

from ..errors import ClosedError
from ._common import LruBudget, check_buffers, check_keys, object_size
from .base import HEADER_SIZE, BackendStats, PageFormat, decode_page, encode_header

__all__ = ("MemoryBackend",)


class MemoryBackend:
    """Page objects in a dict, least recently used first, within an optional byte budget.

    Reads and writes mark their pages used, the first page of a batch the most recent (a
    prefix chain is evicted from its tail).

    Args:
        fmt: the page format every object is written and checked with.
        capacity_bytes: budget for stored objects (header + payload); when a write would pass
            it, least recently read or written objects are evicted. None: unbounded.

    Every call completes without suspending past its first checkpoint, so a cancelled call
    has done nothing at all.
    """

    def __init__(self, fmt: PageFormat, *, capacity_bytes: int | None = None) -> None:
        self.fmt = fmt
        self._budget = LruBudget(capacity_bytes)
        self._objects: dict[str, bytearray] = {}
        self._stats = BackendStats()
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        cap = self._budget.capacity_bytes
        return (f"<MemoryBackend [{len(self._objects)} objects, {self._budget.used_bytes} "
                f"bytes of {'unbounded' if cap is None else cap}]>")

    async def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present (stops at the first absent).

        Cancellation: nothing to undo (it only reads).
        """
        self._check_open()
        check_keys(keys)
        await anyio.lowlevel.checkpoint()
        self._stats.exists_calls += 1
        for num, key in enumerate(keys):
            if key not in self._objects:
                return num
        return len(keys)

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Copy each key's verified payload into its buffer; True where it was filled.

        A rejected object (bad header, size or checksum, or another key's object) is a
        miss, counts in `stats().corrupt`, and is deleted. Cancellation: no buffer is
        written.
        """
        self._check_open()
        views = check_buffers(self.fmt, keys, buffers, to_fill=True)
        await anyio.lowlevel.checkpoint()
        hits = [self._get_one(key, view) for key, view in zip(keys, views, strict=True)]
        self._budget.touch_batch([key for key, hit in zip(keys, hits, strict=True) if hit])
        return hits

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store each buffer under its key; True where it was stored.

        False only where one object is larger than the whole budget. Cancellation: nothing
        is stored.
        """
        self._check_open()
        views = check_buffers(self.fmt, keys, buffers)
        await anyio.lowlevel.checkpoint()
        stored = [self._set_one(key, view) for key, view in zip(keys, views, strict=True)]
        self._budget.touch_batch([key for key, ok in zip(keys, stored, strict=True) if ok])
        return stored

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys`; return how many existed. Cancellation: nothing is removed."""
        self._check_open()
        check_keys(keys)
        await anyio.lowlevel.checkpoint()
        found = sum(self._forget(key) for key in keys)
        self._stats.pages_deleted += found
        return found

    def stats(self) -> BackendStats:
        """A copy of the counters, with `capacity_bytes` (the budget; None: unbounded) and
        `used_bytes` (the objects held). `extra`: ``objects``, ``used_bytes``, ``max_bytes``
        (the budget, 0 if unbounded)."""
        budget = self._budget
        extra = {"objects": len(self._objects), "used_bytes": budget.used_bytes,
                 "max_bytes": budget.capacity_bytes or 0}
        return replace(self._stats, extra=extra, capacity_bytes=budget.capacity_bytes,
                       used_bytes=budget.used_bytes)

    async def aclose(self) -> None:
        """Drop every object (idempotent)."""
        self._closed = True
        self._objects.clear()
        self._budget = LruBudget(self._budget.capacity_bytes)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("storage: the MemoryBackend is closed")

    def _get_one(self, key: str, view: memoryview) -> bool:
        blob = self._objects.get(key)
        if blob is None:
            self._stats.misses += 1
            return False
        payload = decode_page(self.fmt, key, memoryview(blob))
        if payload is None:
            self._stats.corrupt += 1
            self._forget(key)
            return False
        view[:] = payload
        self._stats.pages_read += 1
        self._stats.bytes_read += view.nbytes
        return True

    def _set_one(self, key: str, view: memoryview) -> bool:
        size = object_size(self.fmt)
        self._forget(key)
        victims = self._budget.reserve(size)
        if victims is None:
            return False
        for victim in victims:
            del self._objects[victim]
        self._stats.evicted_pages += len(victims)
        self._budget.release(size)
        blob = bytearray(size)
        blob[:HEADER_SIZE] = encode_header(self.fmt, key, view)
        blob[HEADER_SIZE:] = view
        self._objects[key] = blob
        self._budget.add(key, size)
        self._stats.pages_written += 1
        self._stats.bytes_written += view.nbytes
        return True

    def _forget(self, key: str) -> bool:
        self._budget.pop(key)
        return self._objects.pop(key, None) is not None
