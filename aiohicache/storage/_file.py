"""A `StorageBackend` over a local (or shared) directory: append-only segments and journals.

Page objects are appended to segment files, many pages per write, and bound to their keys by
journal entries written after them (`_journal` has the layout and why it is crash-safe). The
journals are the truth: an in-memory index (`_file_index`), least recently used first, is
built from them when an instance starts, follows what other processes append, and enforces
the byte budget. Dead records (overwritten, deleted, evicted) are reclaimed by compaction,
which copies a segment's live records into an active segment and removes it.

NOTE: one file per page cost a file create per page (about 200 µs), which capped small pages
at 0.12 of a sequential write; a run of pages here is one ``pwritev`` and one journal append.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Final, Self, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._concurrency import finish_then_cancel
from .._validate import check_int, check_number
from ..errors import ClosedError, ConfigError
from . import _appender, _reader
from ._common import RunQueue, check_buffers, check_keys, object_size
from ._file_index import STEP, SegmentIndex
from ._file_runs import ReadBatch, ReadRun, WriteRun
from ._file_upkeep import _TOUCH_FLUSH, _FileUpkeep
from ._journal import Entry
from .base import BackendStats, PageFormat
from .errors import StorageError, StorageReadError, StorageWriteError

__all__ = ("FileBackend",)

logger = logging.getLogger("aiohicache.storage.file")

T = TypeVar("T")

_RUN_PAGES: Final = 64
_CORES: Final = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
    os.cpu_count() or 1)
_MOVED_TRIES: Final = 3
"""Looks at the journals a read makes for pages whose segment it found gone. NOTE: one was
not enough under constant compaction: the segment a page was moved to was compacted too
before the second read, which then took the page for lost (a stress found it)."""
_MAX_OBJECT: Final = (1 << 32) - 1
"""Bytes of the largest page object (header + payload) a journal entry can name."""
_RUN_BYTES: Final = 8 << 20
"""About the bytes of one run. NOTE: 8 MiB, not 4: 1 MiB pages then go 7 to a run, not 3,
and cost 250-280 µs of CPU per page read instead of 290-370 (4 interleaved runs of 256 MiB)."""


class FileBackend(_FileUpkeep):
    """Page objects in segment files under `root_dir`, within an optional byte budget.

    Args:
        root_dir: the directory (created if missing). Instances in any process may share it;
            each serves what the others wrote (found when a key it lacks is asked for) and
            enforces its budget over the pages it knows.
        fmt: the page format every object is written and checked with.
        capacity_bytes: budget for live objects (header + payload); a write that would pass
            it first evicts the least recently read or written pages (the first page of a
            batch counts as the most recent: a prefix chain is evicted from its tail). None:
            unbounded. The disk holds more until compaction: at most about
            ``capacity_bytes / (1 - compact_dead_fraction)`` plus a segment per I/O thread.
        fsync: make each run durable (the segment, then its journal) before it counts as
            stored; without it a power loss may lose recent pages (never tear one: a torn
            record fails its checksum and is a miss).
        max_concurrency: I/O threads, and runs of pages in flight at once over all batches.
        segment_bytes: a segment is sealed and a new one started past this size.
        compact_dead_fraction: a sealed segment is compacted once this fraction of it is dead.
        refresh_interval: seconds between looks at other processes' journals (made when a
            key is asked for that the index lacks).

    No call blocks the event loop: file I/O, scans and compaction run on the backend's own
    threads. Nothing is ever unpickled: objects are raw bytes checked by `decode_page`. Use
    ``async with`` or call `aclose`.
    """

    def __init__(self, root_dir: str | os.PathLike[str], fmt: PageFormat, *,
                 capacity_bytes: int | None = None, fsync: bool = False,
                 max_concurrency: int = 4, segment_bytes: int = 128 << 20,
                 compact_dead_fraction: float = 0.5, refresh_interval: float = 0.05) -> None:
        try:
            self.root_dir = os.path.abspath(os.fspath(root_dir))
        except TypeError:
            raise ConfigError(f"root_dir: must be a path, got {root_dir!r}") from None
        if object_size(fmt) > _MAX_OBJECT:  # a journal entry's length is 32 bits
            raise ConfigError(f"fmt: a page object of {object_size(fmt)} bytes is more than "
                              f"the file store's {_MAX_OBJECT} (payload_bytes too large)")
        self.fmt = fmt
        self.fsync = fsync
        self.segment_bytes = check_int("segment_bytes", segment_bytes, low=1)
        self.compact_dead_fraction = check_number("compact_dead_fraction",
                                                  compact_dead_fraction, low=0.0, high=1.0)
        self.refresh_interval = check_number("refresh_interval", refresh_interval, low=0.0)
        self._files = _reader.SegmentFiles(self.root_dir)
        self._index = SegmentIndex(capacity_bytes, on_drop=self._files.drop)
        self._budget = self._index.budget
        self._queue = RunQueue(max_concurrency)
        self._appender = _appender.Appender(self.root_dir, segment_bytes=segment_bytes,
                                            fsync=fsync)
        self._busy: dict[int, float] = {}
        self._touched: dict[str, int] = {}
        """Keys read since the last journaled touch -> when (ns), in the order of reads."""
        self._last_refresh = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._stats = BackendStats()
        self._start_lock = anyio.Lock()
        self._merging = anyio.Lock()
        """Held while the journals are read and merged, and while a compaction is planned."""
        self._started = False
        self._closed = False

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:  # NOTE: else `async with` left the I/O thread running
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        cap = self._budget.capacity_bytes
        return (f"<FileBackend {self.root_dir!r} [{len(self._budget)} objects, "
                f"{self._budget.used_bytes} bytes of {'unbounded' if cap is None else cap}]>")

    def __del__(self) -> None:
        # Don't try to be creative here: the loop and the executor may be gone already.
        if getattr(self, "_executor", None) is not None and not self._closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)

    # ---------------------------------------------------------------------------- the protocol

    async def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present (stops at the first absent).

        Keys in the index count at once; if one is missing, the other processes' journals
        are read first (at most every `refresh_interval`). A page removed behind this
        instance's back still counts until `get_into` misses it.

        Cancellation: a look at the journals in flight completes first (and counts).
        """
        check_keys(keys)
        await self._start()
        self._stats.exists_calls += 1
        await self._refresh_for(keys)
        num = 0
        while num < len(keys) and keys[num] in self._index:
            num += 1
        return num

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's verified payload into its buffer; True where it was filled.

        Records are read straight into the buffers (on the I/O threads) and checked there:
        a buffer not reported filled may hold a rejected record's bytes. An absent key's
        buffer is not written. A rejected object (bad header, size or checksum, or another
        key's, or cut off by a segment truncated by hand) is a miss, counts in
        `stats().corrupt`, and is deleted (unbound in a journal).

        Raises:
            StorageReadError: a segment could not be read; the buffers of the other pages
                may have been filled.

        Cancellation: runs of pages not started are skipped; runs in flight (at most
        `max_concurrency`, each a few MiB) complete, then the cancellation propagates;
        only pages reported filled are usable. No buffer is written after the call has
        ended.
        """
        views = check_buffers(self.fmt, keys, buffers, to_fill=True)
        await self._start()
        await self._refresh_for(keys)
        batch = ReadBatch(keys, views, [False] * len(keys))
        try:
            await self._read(batch)
            todo, last = list(range(len(keys))), batch
            for tries_left in range(_MOVED_TRIES - 1, -1, -1):
                if not last.moved:
                    break
                # compacted meanwhile (here or by another process): look, then read again
                await self._refresh(force=True)
                todo = [todo[i] for i in last.moved]
                last = ReadBatch([keys[i] for i in todo], [views[i] for i in todo],
                                 [False] * len(todo), rejected=batch.rejected,
                                 moved=[] if tries_left else None)
                await self._read(last)
                for i, ok in zip(todo, last.filled, strict=True):
                    batch.filled[i] = ok
            return batch.filled
        finally:
            if batch.rejected or len(self._touched) >= _TOUCH_FLUSH:  # else nothing to do
                await finish_then_cancel(self._journal_reads(batch.rejected))

    async def _read(self, batch: ReadBatch) -> None:
        runs = [ReadRun(self, batch, run) for run in self._runs(len(batch.keys), _CORES)]
        await self._batch(batch.keys, batch.filled, runs, batch.failed, StorageReadError,
                          "read")

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store each buffer under its key (header + payload); True where it was stored.

        False where one object cannot fit the budget at all. Buffers are read on the I/O
        threads: leave them unchanged until the call returns. A segment that is mostly dead
        after the call is compacted before it returns.

        Raises:
            StorageWriteError: a run could not be written; the other runs were stored.

        Cancellation: runs of pages in flight complete (each object whole or absent, and the
        buffers no longer read), runs not started are skipped, then the cancellation
        propagates.
        """
        views = check_buffers(self.fmt, keys, buffers)
        if len(set(keys)) < len(keys):  # NOTE: C-level; rare, so the set only
            return await self._set_once(keys, views)
        await self._start()
        # the first page the newest: after a restart, too, a chain is evicted from its tail
        first = self._index.stamps(len(keys))
        stamps = list(range(first + len(keys) - 1, first - 1, -1))
        stored = [False] * len(keys)
        failed: list[BaseException] = []
        runs = [WriteRun(self, run, keys, views, stamps, stored, failed)
                for run in self._runs(len(keys))]
        await self._batch(keys, stored, runs, failed, StorageWriteError, "write")
        await finish_then_cancel(self._maybe_compact())
        return stored

    async def _set_once(self, keys: Sequence[str], views: list[memoryview]) -> list[bool]:
        """`set_from` of a batch naming a key twice: its last buffer is stored, as a dict
        (and Redis) would. NOTE: written as given, the journals (latest stamp wins, the first
        page the newest) would serve the first buffer, and this instance the last."""
        last = {key: i for i, key in enumerate(keys)}
        stored = await self.set_from(list(last), [views[i] for i in last.values()])
        by_key = dict(zip(last, stored, strict=True))
        return [by_key[key] for key in keys]

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys` (a delete entry each, in this instance's journal); return how many
        existed.

        Cancellation: the deletes are journaled, then the cancellation propagates.
        """
        check_keys(keys)
        await self._start()
        await self._refresh_for(keys)
        try:
            entries = await finish_then_cancel(self._remove_and_log(keys))
        except OSError as exc:
            self._stats.errors += 1
            raise StorageWriteError(f"storage: deleting from {self.root_dir}: {exc}") from exc
        self._stats.pages_deleted += len(entries)
        await finish_then_cancel(self._maybe_compact())
        return len(entries)

    async def _remove_and_log(self, keys: Sequence[str]) -> list[Entry]:
        """Unbind `keys`, `STEP` a turn of the loop, then journal their delete entries;
        those entries.

        NOTE: in steps: 19k keys unbound at once held the loop 36-48 ms. A write or delete
        of one of them made meanwhile is ordered by its stamp, as in the journals.

        Cancellation: the caller's `finish_then_cancel` lets it end (keys unbound and not
        journaled would come back at the next start).
        """
        unique, entries = list(dict.fromkeys(keys)), []
        for lo in range(0, len(unique), STEP):
            if lo:
                await anyio.lowlevel.checkpoint()
            entries += self._index.remove(unique[lo:lo + STEP])
        await self._in_thread(self._appender.log, entries)
        return entries

    def stats(self) -> BackendStats:
        """A copy of the counters, with `capacity_bytes` (the budget; None: unbounded) and
        `used_bytes` (live objects, as indexed). `extra`: ``objects``, ``used_bytes``,
        ``max_bytes`` (the budget, 0 if unbounded), ``segments``, ``segment_bytes`` (on disk,
        dead records included), ``compactions``, ``torn_entries`` (entries dropped at start
        for records past their segment's end) and ``orphans_removed``."""
        budget, sizes = self._budget, self._index.sizes
        extra = {**self._stats.extra, "objects": len(budget), "used_bytes": budget.used_bytes,
                 "max_bytes": budget.capacity_bytes or 0, "segments": len(sizes),
                 "segment_bytes": sum(sizes.values())}
        return replace(self._stats, extra=extra, capacity_bytes=budget.capacity_bytes,
                       used_bytes=budget.used_bytes)

    async def aclose(self) -> None:
        """Journal the recency of pages read, seal the active segments and stop the I/O
        threads, after the operations in flight (idempotent).

        Cancellation: every step runs first (the threads stopped, the files closed), then
        the cancellation propagates.
        """
        if self._closed:
            return
        # NOTE: run to its end as a whole: cancelled between two steps, the close skipped the
        # rest (the threads ran on, the segment files stayed open). Not an anyio shield: it
        # does not stop ``Task.cancel`` (a cancelled server task), which still skipped them.
        await finish_then_cancel(self._close())

    async def _close(self) -> None:
        try:
            await self._seal()
        finally:
            self._closed = True
            try:
                if self._executor is not None:
                    await anyio.to_thread.run_sync(self._executor.shutdown)
            finally:
                self._files.close()

    async def _seal(self) -> None:
        """Journal the touches and seal the lanes (the store may be gone: then nothing)."""
        if self._executor is None or not self._started:
            return
        try:
            try:
                await self._flush_touches(force=True)
            finally:  # NOTE: touches that cannot be journaled (a full disk) left every lane open
                await self._in_thread(self._appender.shut)
        except OSError as exc:  # the store went away: nothing more to keep
            logger.debug("storage: closing %s: %s", self.root_dir, exc)

    # ---------------------------------------------------------------------------- runs of pages

    async def _batch(self, keys: Sequence[str], done: list[bool],
                     runs: list[ReadRun] | list[WriteRun], failed: list[BaseException],
                     error: type[StorageError], verb: str) -> None:
        """Run `runs` on the I/O threads (their per-key results land in `done`, errors in
        `failed`); the errors raised after every run has ended.

        Cancellation: runs not started are skipped; started runs end first.
        """
        assert self._executor is not None
        try:
            await self._queue.run(self._executor, runs)
        finally:
            self._budget.touch_batch([k for k, ok in zip(keys, done, strict=True) if ok])
        self._raise_failed(failed, error, verb)

    def _runs(self, num: int, cores: int | None = None) -> list[range]:
        """Split a batch into runs of pages, one I/O-thread job each.

        NOTE: a job per page costs the loop a task, a future and a thread wake-up, as much
        as reading a small page; a run of pages pays that once, and is one system call.
        Runs are about `_RUN_BYTES` and at most `_RUN_PAGES` (the latency of a cancel), and
        a batch gets as many runs as there are threads, or `cores` if fewer. Reads pass the
        cores: they are CPU work (copy and check) and a run waiting for a core only adds a
        wake-up (2 cores, 128 pages of 64 KiB: 2.9 ms a call in 4 runs of 32 over 4
        threads, the third and fourth starting when a core freed up; 2.3-2.5 ms in 2 runs
        of 64). Writes do not: each run takes its own lane, and 4 lanes wrote 64 KiB pages
        at 34-37 µs a page where 2 took 32-60.
        """
        width = min(self._queue.limit, cores or self._queue.limit)
        per = min(-(-num // width), _RUN_PAGES, max(1, _RUN_BYTES // object_size(self.fmt)))
        per = max(1, per)
        return [range(lo, min(lo + per, num)) for lo in range(0, num, per)]

    def _plan_writes(self, run: range, keys: Sequence[str], size: int
                     ) -> tuple[list[int], list[Entry]]:
        """Reserve budget for each page of `run`: the pages to write, and the delete entries
        of what that evicted (and of old records of pages that cannot fit at all)."""
        planned: list[int] = []
        deletes: list[Entry] = []
        # NOTE: an overwrite keeps serving the old record until the new one is bound; only
        # its bytes leave the budget now (they are replaced, not added to), all of the
        # run's first, so none is evicted to make room for another page of the run
        for i in run:
            self._budget.pop(keys[i])
        for i in run:
            evicted = self._budget.reserve(size)
            if evicted is None:  # it cannot fit at all: not stored (nor is the old one)
                deletes += self._index.remove([keys[i]])
                continue
            planned.append(i)
            gone = self._index.remove(evicted, evicted=True)
            deletes += gone
            self._stats.evicted_pages += len(gone)
        return planned, deletes

    def _raise_failed(self, failed: list[BaseException], error: type[StorageError],
                      what: str) -> None:
        if self._closed:
            raise ClosedError("storage: the FileBackend was closed during the call")
        if failed:
            self._stats.errors += len(failed)
            raise error(f"storage: {len(failed)} page(s) failed to {what} under "
                        f"{self.root_dir}: {failed[0]}") from failed[0]
