"""What every backend checks and keeps: argument validation, an LRU byte budget, batching."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from .._concurrency import finish_then_cancel
from .._validate import check_int
from ..errors import ConfigError
from .base import HEADER_SIZE, PageFormat

__all__ = ("KEY_PATTERN", "BatchRunner", "LruBudget", "check_buffers", "check_keys",
           "object_size")

T = TypeVar("T")

KEY_PATTERN = re.compile(r"[0-9a-f]{16,128}")
"""A valid key, whole: 16 to 128 lowercase hex characters (safe as a file name)."""


_KEYS_PATTERN = re.compile(r"(?:[0-9a-f]{16,128}\n)*")


def check_keys(keys: Sequence[str]) -> None:
    """Raise `ConfigError` naming the first key that is not 16-128 lowercase hex characters.

    NOTE: a batch is checked with one match over its keys joined (a match per key cost the
    loop about 0.3 µs a page); only a batch that fails is looked at key by key.
    """
    try:
        joined = "\n".join(keys) + "\n" if keys else ""
    except TypeError:  # a key that is not a str
        joined = "-"
    # as many separators as keys: no key holds one, so each key matched whole
    if joined.count("\n") == len(keys) and _KEYS_PATTERN.fullmatch(joined) is not None:
        return
    for key in keys:
        if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
            raise ConfigError(f"storage key: must be 16-128 lowercase hex characters, "
                              f"got {key!r}")


def check_buffers(fmt: PageFormat, keys: Sequence[str],
                  buffers: Sequence[memoryview]) -> list[memoryview]:
    """Byte views of `buffers`, after checking there is one of `fmt.payload_bytes` per key."""
    check_keys(keys)
    if len(buffers) != len(keys):
        raise ConfigError(f"buffers: got {len(buffers)} for {len(keys)} keys")
    views = [memoryview(buf).cast("B") for buf in buffers]
    for view in views:
        if view.nbytes != fmt.payload_bytes:
            raise ConfigError(f"buffers: each must be {fmt.payload_bytes} bytes "
                              f"(the page format), got {view.nbytes}")
    return views


def object_size(fmt: PageFormat) -> int:
    """Bytes of one stored object: header and payload."""
    return HEADER_SIZE + fmt.payload_bytes


class LruBudget:
    """Object sizes by key in least-recently-used-first order, within a byte budget.

    An OrderedDict: `touch`, `add` and `pop` are O(1); `reserve` evicts from the front.
    Bytes of writes in flight are reserved up front, so concurrent writers never overshoot.
    Sync and I/O-free: callers mutate it on the loop, then do the I/O it planned.
    """

    def __init__(self, capacity_bytes: int | None) -> None:
        self.capacity_bytes = None if capacity_bytes is None else check_int(
            "capacity_bytes", capacity_bytes, low=1)
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        """Bytes of the objects in `sizes`."""
        self.reserved_bytes = 0
        """Bytes of writes in flight (not yet in `sizes`)."""

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def touch(self, key: str) -> None:
        """Mark `key` as just used, if present."""
        if key in self.sizes:
            self.sizes.move_to_end(key)

    def touch_batch(self, keys: Sequence[str]) -> None:
        """Mark a batch as just used, its first key the most recent.

        A batch is a run of a prefix chain, and a chain is useless past its first missing
        page: so its tail is evicted first, whatever order its pages completed in.
        """
        for key in reversed(keys):
            self.touch(key)

    def add(self, key: str, size: int) -> None:
        """Record `key` (replacing any old size) as the most recently used object."""
        self.pop(key)
        self.sizes[key] = size
        self.used_bytes += size

    def pop(self, key: str) -> int | None:
        """Forget `key`; its size, or None if it was absent."""
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
        return size

    def reserve(self, size: int) -> list[str] | None:
        """Reserve `size` bytes, evicting least recently used objects as needed.

        Returns:
            The evicted keys (already forgotten: delete their objects), or None if `size`
            cannot fit even with every object evicted (nothing is evicted then).
        """
        cap = self.capacity_bytes
        if cap is not None and size + self.reserved_bytes > cap:
            return None
        self.reserved_bytes += size
        return self.trim()

    def trim(self) -> list[str]:
        """Evict least recently used objects until the budget holds; return their keys."""
        cap = self.capacity_bytes
        victims: list[str] = []
        while cap is not None and self.sizes and self.used_bytes + self.reserved_bytes > cap:
            key, old = self.sizes.popitem(last=False)
            self.used_bytes -= old
            victims.append(key)
        return victims

    def release(self, size: int) -> None:
        """End a reservation of `size` bytes (its write finished or failed)."""
        self.reserved_bytes -= size


class BatchRunner:
    """Runs the per-object operations of batches, at most `limit` at a time in all.

    A batch gets one worker task per slot it can use (at most `limit`), each pulling objects
    in order, so a batch of any size makes few tasks and batches share the slots fairly.
    """

    def __init__(self, limit: int) -> None:
        self.limit = check_int("max_concurrency", limit, low=1)
        self._slots = anyio.CapacityLimiter(self.limit)

    async def run(self, items: Sequence[T], op: Callable[[T], Awaitable[None]]) -> None:
        """Run `op` on every item.

        Cancellation: items not started are skipped; each started `op` runs to completion
        (its effects are whole), then the cancellation propagates.
        """
        pending = iter(items)

        async def worker() -> None:
            for item in pending:
                async with self._slots:
                    await finish_then_cancel(op(item))

        async with anyio.create_task_group() as tg:
            for _ in range(min(len(items), self.limit)):
                tg.start_soon(worker)
