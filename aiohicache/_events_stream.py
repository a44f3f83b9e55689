"""KV event records and one subscriber's bounded stream (`aiohicache.events` re-exports them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol, Self

import anyio
import anyio.lowlevel

from ._concurrency import current_loop
from .errors import LoopError

__all__ = ("AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "EventStream",
           "KVEvent", "Medium")

Medium = Literal["device", "host", "storage"]


class _Publisher(Protocol):
    """What a stream needs from the hub that feeds it."""

    def flush(self) -> None: ...

    def unsubscribe(self, stream: EventStream) -> None: ...


class _Pending(Protocol):
    """A first batch still being computed (the snapshot): a step at a time, or all at once."""

    def step(self) -> EventBatch | None: ...

    def finish(self) -> EventBatch: ...


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages (blocks) now held by `medium`, in prefix order."""

    block_hashes: list[bytes]
    """Page keys (16-byte chained digests, the L3 keys; docs/storage.md)."""
    parent_block_hash: bytes | None
    """Key of the page before the first one; None at the start of a sequence."""
    token_ids: list[int]
    """The tokens of those pages (``len(block_hashes) * block_size``)."""
    block_size: int
    medium: Medium
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages `medium` no longer holds."""

    block_hashes: list[bytes]
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The cache closed: it holds nothing in any medium (its L3 pages stay, untracked)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one turn of the event loop, in the order the tiers changed."""

    seq: int
    """0, 1, 2, ... per cache; a gap means this subscriber dropped batches, or the tiers
    changed while no stream subscribed (unseen by any)."""
    ts: float
    """Wall-clock time (`time.time()`) the batch was sealed."""
    events: list[KVEvent]


class EventStream:
    """One subscriber's bounded queue of batches; an async iterator and context manager.

    Leaving the block (or `aclose`) unsubscribes, after sealing the changes made until then
    into a last batch; dropping the last reference unsubscribes too (that batch lost). Full
    (`max_batches` unread): new batches are dropped and counted in `dropped`.

    NOTE: a deque and an `anyio.Event`, not a memory object stream: the hub must drop the
    newest batch and count it when a reader lags (``send_nowait`` would do that), but a
    stream dropped without `aclose` must also unsubscribe quietly through the hub's weak
    set, and an unclosed memory object stream warns when collected.
    """

    __slots__ = ("__weakref__", "_closed", "_hub", "_loop", "_max", "_queue", "_waiter",
                 "dropped")

    def __init__(self, hub: _Publisher, max_batches: int) -> None:
        self._hub = hub
        self._loop = current_loop()  # the cache's (`HiCache.events` checks it)
        self._max = max_batches
        self._queue: deque[EventBatch | _Pending] = deque()
        self._waiter: anyio.Event | None = None
        self._closed = False
        self.dropped = 0

    def _offer(self, batch: EventBatch | _Pending) -> None:
        if len(self._queue) >= self._max:
            self.dropped += 1
            return
        self._queue.append(batch)
        self._wake()

    def _wake(self) -> None:
        # NOTE: one event shared by every reader waiting now, replaced once set: a reader
        # that made its own replaced the one an earlier reader waited on, which then hung
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def _end(self) -> None:
        self._closed = True
        self._wake()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EventBatch:
        """The next batch; ends once the cache closed (after its last batch) or `aclose`.

        A snapshot is computed here, a step at a time, yielding to the loop between steps.

        Cancellation: only the wait stops; no batch is lost (a snapshot keeps its progress).

        Raises:
            LoopError: read on another loop than the one that subscribed (the cache's): its
                wake-up would be set from a thread that does not run that loop.
        """
        if self._loop is not None and current_loop() is not self._loop:
            raise LoopError("an event stream was read on another event loop than the "
                            "cache's, where it was subscribed: read it there")
        while True:
            while not self._queue:
                if self._closed:
                    raise StopAsyncIteration
                if self._waiter is None:
                    self._waiter = anyio.Event()
                await self._waiter.wait()
            head = self._queue[0]
            if isinstance(head, EventBatch):
                self._queue.popleft()
                return head
            if (batch := head.step()) is not None:
                self._queue.popleft()
                return batch
            await anyio.lowlevel.checkpoint()  # NOTE: the head may be gone after (get_nowait)

    def get_nowait(self) -> EventBatch | None:
        """The next queued batch, or None. A snapshot not computed yet is finished here, at
        once (O(tokens the tiers hold) on the caller's thread; iterate to spread it out)."""
        if not self._queue:
            return None
        head = self._queue.popleft()
        return head if isinstance(head, EventBatch) else head.finish()

    async def aclose(self) -> None:
        """Unsubscribe; the changes made until now still arrive, then the stream ends.
        Idempotent.

        Cancellation: never suspends, so it always completes.
        """
        if not self._closed:
            self._hub.flush()  # the open batch: this turn's changes, not sealed yet
        self._hub.unsubscribe(self)
        self._end()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

