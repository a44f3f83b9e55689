"""What backends check and keep: argument validation, an LRU byte budget, runs of a batch on
threads."""

from __future__ import annotations

import operator
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any, Protocol, TypeVar

from .._concurrency import LoopBridge, Promise, finish_then_cancel
from .._validate import check_int
from ..errors import ConfigError
from ._native import first_overlap
from .base import HEADER_SIZE, PageFormat

__all__ = ("KEY_PATTERN", "LruBudget", "Run", "RunQueue", "check_buffers", "check_keys",
           "object_size")

T = TypeVar("T")

KEY_PATTERN = re.compile(r"[0-9a-f]{16,128}")
"""A valid key, whole: 16 to 128 lowercase hex characters (safe as a file name)."""


def check_keys(keys: Sequence[str]) -> None:
    """Raise `ConfigError` naming the first key that is not 16-128 lowercase hex characters.

    NOTE: a batch is checked whole, at C level: its lengths, then its characters joined as
    bytes with the hex digits deleted (a regex over the joined keys cost the loop about
    0.4 µs a key; a match per key, more); only a batch that fails is looked at key by key.
    """
    try:
        lengths = set(map(len, keys))
        joined = "".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):  # a key that is not a str, or not ASCII
        lengths, joined = {0}, b"-"
    if (not keys or (min(lengths) >= 16 and max(lengths) <= 128)) and not joined.translate(
            None, _HEX_DIGITS):
        return
    for key in keys:
        if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
            raise ConfigError(f"storage key: must be 16-128 lowercase hex characters, "
                              f"got {key!r}")


_HEX_DIGITS = b"0123456789abcdef"
_READONLY = operator.attrgetter("readonly")


def check_buffers(fmt: PageFormat, keys: Sequence[str], buffers: Sequence[memoryview], *,
                  to_fill: bool = False) -> list[memoryview]:
    """Byte views of `buffers`, after checking there is one of `fmt.payload_bytes` per key
    (and, `to_fill`: buffers the call writes into, that each is writable and no two of them
    overlap)."""
    check_keys(keys)
    if len(buffers) != len(keys):
        raise ConfigError(f"buffers: got {len(buffers)} for {len(keys)} keys")
    try:
        views = [buf.cast("B") if type(buf) is memoryview else memoryview(buf).cast("B")
                 for buf in buffers]
    except TypeError:  # not a buffer, or not C-contiguous: name the first such one
        raise ConfigError(f"buffers[{_first_unviewable(buffers)}]: must be a C-contiguous "
                          f"buffer (a bytearray, memoryview or contiguous array)") from None
    if views and set(map(len, views)) != {fmt.payload_bytes}:  # NOTE: C-level, per buffer
        bad = next(view for view in views if len(view) != fmt.payload_bytes)
        raise ConfigError(f"buffers: each must be {fmt.payload_bytes} bytes "
                          f"(the page format), got {len(bad)}")
    if to_fill and any(map(_READONLY, views)):  # else the I/O fails as if the disk did
        bad_i = next(i for i, view in enumerate(views) if view.readonly)
        raise ConfigError(f"buffers[{bad_i}]: is read-only; get_into needs writable buffers")
    # NOTE: two keys filling one buffer would both be reported filled, the buffer holding
    # only the second's page: a wrong-KV hit for the first
    if to_fill and (pair := first_overlap(views)) is not None:
        raise ConfigError(f"buffers: {pair[0]} and {pair[1]} overlap (each key needs a "
                          f"buffer of its own)")
    return views


def _first_unviewable(buffers: Sequence[object]) -> int:
    for i, buf in enumerate(buffers):
        try:
            memoryview(buf).cast("B")  # type: ignore[arg-type]
        except TypeError:
            return i
    return -1


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
        sizes, last = self.sizes, self.sizes.move_to_end  # NOTE: inlined: a call per key
        for key in reversed(keys):
            if key in sizes:
                last(key)

    def make_oldest(self, keys: Sequence[str]) -> None:
        """Rank `keys` (present ones) least recently used, the first of them the oldest."""
        for key in reversed(keys):
            if key in self.sizes:
                self.sizes.move_to_end(key, last=False)

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


class RunQueue:
    """Runs the runs of batches on a thread pool, at most `limit` in flight over all of them.

    Each run is started (`Run.start`, on the loop: plan, reserve) only when a slot frees,
    its blocking call goes to the pool, and its result is taken (`Run.finish` / `Run.fail`,
    on the loop) in a callback that starts the next run. Batches waiting for a slot take
    turns, a run each.

    NOTE: the limit is shared, as a run reserves what it needs (a write, its budget) when it
    starts: runs queued in the pool for other batches would hold reservations they cannot
    use yet. And there is no task, limiter or cancel scope per run: for small pages those
    cost the loop more than the read itself (64 KiB pages, 32 per call: about 400 µs of loop
    time per call with a task group and a limiter).
    """

    def __init__(self, limit: int) -> None:
        self.limit = check_int("max_concurrency", limit, low=1)
        self._in_flight = 0
        self._waiting: deque[_Batch] = deque()
        """Batches with runs not started yet, in turn order."""

    async def run(self, executor: Executor, runs: Iterable[Run[Any]]) -> None:
        """Run every run of `runs`, in order, as slots free.

        Raises:
            Whatever a `start`, `finish` or `fail` raised (a bug), once the batch's runs in
            flight have ended.

        Cancellation: runs not started are skipped; each started run completes (its call
        and its `finish` or `fail`), then the cancellation propagates.
        """
        batch = _Batch(self, executor, iter(runs))
        self._waiting.append(batch)
        self._pump()
        try:
            await batch.ended.wait()
        except BaseException:
            self._stop(batch)
            await finish_then_cancel(batch.ended.wait())
            raise
        if batch.errors:
            raise batch.errors[0]

    def _pump(self) -> None:
        """Start runs while slots are free, a run from each waiting batch in turn."""
        while self._waiting and self._in_flight < self.limit:
            batch = self._waiting.popleft()
            run = next(batch.pending, None)
            if run is None:
                batch.exhausted = True
                batch.end_if_done()
                continue
            if batch.start(run):
                self._in_flight += 1
            if batch.stopping:
                batch.end_if_done()
            else:
                self._waiting.append(batch)

    def _stop(self, batch: _Batch) -> None:
        """Start no more runs of `batch`; it ends when its runs in flight have."""
        batch.stopping = True
        if batch in self._waiting:
            self._waiting.remove(batch)
        batch.end_if_done()

    def _settled(self, batch: _Batch, run: Run[Any], future: Future[Any]) -> None:
        self._in_flight -= 1
        batch.settle(run, future)
        if batch.stopping:
            self._stop(batch)
        batch.end_if_done()
        self._pump()


class Run(Protocol[T]):
    """One run of a batch: loop work before and after a blocking call."""

    def start(self) -> Callable[[], T] | None:
        """On the loop: plan the run; the blocking call to make, or None (nothing to do)."""
        ...

    def finish(self, result: T) -> None:
        """On the loop: take the call's result."""
        ...

    def fail(self, exc: BaseException) -> None:
        """On the loop: the call raised `exc` (or the pool refused it: closed)."""
        ...


class _Batch:
    """The state of one `RunQueue.run`."""

    def __init__(self, queue: RunQueue, executor: Executor, pending: Iterator[Run[Any]]) -> None:
        self.queue, self.executor, self.pending = queue, executor, pending
        self.in_flight = 0
        self.exhausted = False
        self.stopping = False
        """No more runs start: cancelled, or a run's `start`/`finish`/`fail` raised."""
        self.ended: Promise[None] = Promise()
        self.errors: list[BaseException] = []
        self._bridge = LoopBridge()

    def start(self, run: Run[Any]) -> bool:
        """Start `run`: True if its call went to the pool."""
        call = self._guarded(run.start)
        if call is None:
            return False
        try:
            future = self.executor.submit(call)
        except RuntimeError as exc:  # the pool was shut down
            self._guarded(run.fail, exc)
            return False
        self.in_flight += 1
        future.add_done_callback(partial(self._bridge.call_soon, self.queue._settled, self,
                                         run))
        return True

    def settle(self, run: Run[Any], future: Future[Any]) -> None:
        self.in_flight -= 1
        if future.cancelled():  # the pool was shut down with its queue cancelled
            self._guarded(run.fail, RuntimeError("the run was cancelled by its pool"))
        elif (exc := future.exception()) is None:
            self._guarded(run.finish, future.result())
        else:
            self._guarded(run.fail, exc)

    def end_if_done(self) -> None:
        if (self.exhausted or self.stopping) and not self.in_flight and not self.ended.done():
            self.ended.set_result(None)

    def _guarded(self, fn: Callable[..., T], *args: object) -> T | None:
        """`fn(*args)`; a bug in it is kept for `run` to raise, and stops the batch."""
        try:
            return fn(*args)
        except Exception as exc:  # raised by `run`, after the runs in flight end
            self.errors.append(exc)
            self.stopping = True
            return None
