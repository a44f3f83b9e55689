"""A `StorageBackend` over a local (or shared) directory: append-only segments and journals.

Page objects are appended to segment files, many pages per write, and bound to their keys by
journal entries written after them (`_segments` has the layout and why it is crash-safe). The
journals are the truth: an in-memory index, least recently used first, is built from them
when an instance starts, follows what other processes append, and enforces the byte budget.
Dead records (overwritten, deleted, evicted) are reclaimed by compaction, which copies a
segment's live records into the active segment and removes it.

NOTE: one file per page cost a file create per page (about 200 µs), which capped small pages
at 0.12 of a sequential write; a run of pages here is one ``pwritev`` and one journal append.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Final, Self, TypeVar

from .._concurrency import finish_then_cancel
from ..errors import ClosedError, ConfigError
from . import _segments as seg
from ._common import BatchRunner, LruBudget, check_buffers, check_keys, object_size
from ._segments import DELETE, PUT, Entry, Outcome
from .base import BackendStats, PageFormat
from .errors import StorageError, StorageReadError, StorageWriteError

_RunStep = Callable[[range, Sequence[str], list[memoryview], list[bool], list[BaseException]],
                    Awaitable[None]]

__all__ = ("FileBackend",)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RUN_PAGES: Final = 32
_RUN_BYTES: Final = 4 << 20
_TOUCH_FLUSH: Final = 4096
"""Keys read since the last journaled touch that make the next call journal them."""
_DELETED_MEMORY: Final = 1 << 16
"""Delete stamps remembered, so an older entry read later does not bring a key back."""
_BUSY_S: Final = 10.0
"""A segment another process holds locked is not tried for compaction again this long."""


class FileBackend:
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
            ``capacity_bytes / (1 - compact_dead_fraction)`` plus a segment.
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
        _check_number("segment_bytes", segment_bytes, low=1, integer=True)
        _check_number("compact_dead_fraction", compact_dead_fraction, low=0.0, high=1.0)
        _check_number("refresh_interval", refresh_interval, low=0.0)
        self.fmt = fmt
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.compact_dead_fraction = compact_dead_fraction
        self.refresh_interval = refresh_interval
        self._budget = LruBudget(capacity_bytes)
        self._runner = BatchRunner(max_concurrency)
        self._appender = seg.Appender(self.root_dir, segment_bytes=segment_bytes, fsync=fsync)
        self._index: dict[str, Entry] = {}
        """The live PUT entry of every key known."""
        self._deleted: OrderedDict[str, int] = OrderedDict()
        self._live: dict[int, int] = {}
        """Segment id -> bytes of its records that are live."""
        self._sizes: dict[int, int] = {}
        """Segment id -> bytes in it (as scanned, or as appended by this instance)."""
        self._read_to: dict[int, int] = {}
        self._busy: dict[int, float] = {}
        self._touched: dict[str, None] = {}
        self._last_refresh = 0.0
        self._last_stamp = 0
        self._may_compact = False
        self._executor: ThreadPoolExecutor | None = None
        self._maps = seg.SegmentMaps(self.root_dir)
        self._stats = BackendStats()
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False

    async def __aenter__(self) -> Self:
        await self._start()
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
        if not all(key in self._index for key in keys):
            await self._refresh()
        num = 0
        while num < len(keys) and keys[num] in self._index:
            num += 1
        return num

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's verified payload into its buffer; True where it was filled.

        Records in the page cache are checked where they lie (segments are mapped
        read-only), others read into a staging buffer first; only a verified payload is
        copied into the caller's buffer (on an I/O thread), so a missed buffer is never
        written. A rejected object (bad header, size or checksum, or another key's) is a
        miss, counts in `stats().corrupt`, and is deleted (unbound in a journal).

        Raises:
            StorageReadError: a segment could not be read; the buffers of the other pages
                may have been filled.

        Cancellation: runs of pages not started are skipped; runs in flight (at most
        `max_concurrency`, each a few MiB) complete, each page filling its buffer whole or
        not at all, then the cancellation propagates. No buffer is written after the call
        has ended.
        """
        views = check_buffers(self.fmt, keys, buffers)
        await self._start()
        if not all(key in self._index for key in keys):
            await self._refresh()
        rejected: list[Entry] = []
        moved: list[int] = []
        try:
            step = partial(self._read_run, rejected=rejected, moved=moved)
            filled = await self._batch(keys, views, step, StorageReadError, "read")
            if moved:  # compacted meanwhile (here or by another process): read it again
                await self._refresh(force=True)
                step = partial(self._read_run, rejected=rejected, moved=None)
                again = await self._batch([keys[i] for i in moved], [views[i] for i in moved],
                                          step, StorageReadError, "read")
                for i, ok in zip(moved, again, strict=True):
                    filled[i] = ok
            return filled
        finally:
            await finish_then_cancel(self._journal_reads(rejected))

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
        await self._start()
        # the first page the newest: after a restart, too, a chain is evicted from its tail
        stamps = [self._stamp() for _ in keys][::-1]
        step = partial(self._write_run, stamps=stamps)
        stored = await self._batch(keys, views, step, StorageWriteError, "write")
        await finish_then_cancel(self._maybe_compact())
        return stored

    async def _batch(self, keys: Sequence[str], views: list[memoryview], step: _RunStep,
                     error: type[StorageError], verb: str) -> list[bool]:
        """Run `step` over runs of pages concurrently; per-key results; I/O errors raised
        after every run has finished."""
        done = [False] * len(keys)
        failed: list[BaseException] = []

        async def one(run: range) -> None:
            try:
                await step(run, keys, views, done, failed)
            except (RuntimeError, ClosedError) as exc:  # the executor was shut down
                failed.append(exc)

        await self._runner.run(self._runs(len(keys)), one)
        self._budget.touch_batch([key for key, ok in zip(keys, done, strict=True) if ok])
        self._raise_failed(failed, error, verb)
        return done

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys` (a delete entry each, in this instance's journal); return how many
        existed.

        Cancellation: the deletes are journaled, then the cancellation propagates.
        """
        check_keys(keys)
        await self._start()
        if not all(key in self._index for key in keys):
            await self._refresh()
        entries = [self._tombstone(old) for key in dict.fromkeys(keys)
                   if (old := self._unbind(key)) is not None]
        try:
            await finish_then_cancel(self._in_thread(self._appender.log, entries))
        except OSError as exc:
            self._stats.errors += 1
            raise StorageWriteError(f"storage: deleting from {self.root_dir}: {exc}") from exc
        self._stats.pages_deleted += len(entries)
        await finish_then_cancel(self._maybe_compact())
        return len(entries)

    def stats(self) -> BackendStats:
        """A copy of the counters. `extra`: ``objects``, ``used_bytes`` (live, as indexed),
        ``max_bytes`` (the budget, 0 if unbounded), ``segments``, ``segment_bytes`` (on disk,
        dead records included), ``compactions``, ``torn_entries`` (entries dropped at start
        for records past their segment's end) and ``orphans_removed``."""
        extra = {**self._stats.extra, "objects": len(self._budget),
                 "used_bytes": self._budget.used_bytes,
                 "max_bytes": self._budget.capacity_bytes or 0,
                 "segments": len(self._sizes), "segment_bytes": sum(self._sizes.values())}
        return replace(self._stats, extra=extra)

    async def aclose(self) -> None:
        """Journal the recency of pages read, seal the active segment and stop the I/O
        threads, after the operations in flight (idempotent).

        Cancellation: the threads are stopped first, then the cancellation propagates.
        """
        if self._closed:
            return
        if self._executor is not None and self._started:
            try:
                await finish_then_cancel(self._flush_touches(force=True))
                await finish_then_cancel(self._in_thread(self._appender.close))
            except OSError as exc:  # the store went away: nothing more to keep
                logger.debug("storage: closing %s: %s", self.root_dir, exc)
        self._closed = True
        try:
            if self._executor is not None:
                loop = asyncio.get_running_loop()
                await finish_then_cancel(loop.run_in_executor(None, self._executor.shutdown))
        finally:
            self._maps.close()

    # ---------------------------------------------------------------------------- runs of pages

    def _runs(self, num: int) -> list[range]:
        """Split a batch into runs of pages, one I/O-thread job each.

        NOTE: a job per page costs the loop a task, a future and a thread wake-up, as much
        as reading a small page; a run of pages pays that once, and is one system call.
        Runs are about `_RUN_BYTES` and at most `_RUN_PAGES` (the latency of a cancel), and
        a batch gets at least as many runs as there are threads.
        """
        per = min(-(-num // self._runner.limit), _RUN_PAGES,
                  max(1, _RUN_BYTES // object_size(self.fmt)))
        per = max(1, per)
        return [range(lo, min(lo + per, num)) for lo in range(0, num, per)]

    async def _read_run(self, run: range, keys: Sequence[str], views: list[memoryview],
                        filled: list[bool], failed: list[BaseException], *,
                        rejected: list[Entry], moved: list[int] | None) -> None:
        found = [i for i in run if keys[i] in self._index]
        self._stats.misses += len(run) - len(found)
        if not found:
            return
        entries = [self._index[keys[i]] for i in found]
        outcomes = await self._in_thread(seg.read_run, self._maps, self.fmt,
                                         [keys[i] for i in found], entries,
                                         [views[i] for i in found])
        for i, entry, outcome in zip(found, entries, outcomes, strict=True):
            if isinstance(outcome, OSError):
                failed.append(outcome)
            elif outcome is Outcome.MISSING and moved is not None:
                moved.append(i)  # its segment is gone: compacted, or the store removed
            else:
                filled[i] = self._count_read(entry, outcome, rejected)

    def _count_read(self, entry: Entry, outcome: str, rejected: list[Entry]) -> bool:
        if outcome is Outcome.FILLED:
            self._budget.touch(entry.key)
            self._touched[entry.key] = None
            self._stats.pages_read += 1
            self._stats.bytes_read += self.fmt.payload_bytes
            return True
        if self._index.get(entry.key) == entry:  # else it was rewritten or moved meanwhile
            self._unbind(entry.key)
            if outcome is Outcome.CORRUPT:
                rejected.append(self._tombstone(entry))
        if outcome is Outcome.MISSING:
            self._stats.misses += 1
        else:
            self._stats.corrupt += 1
            logger.debug("storage: rejected and deleted the object of %s", entry.key)
        return False

    async def _journal_reads(self, rejected: list[Entry]) -> None:
        """Journal the deletes of rejected objects, and the touches once enough piled up."""
        try:
            if rejected:
                await self._in_thread(self._appender.log, rejected)
            await self._flush_touches(force=False)
        except (OSError, ClosedError, RuntimeError) as exc:
            logger.debug("storage: journaling reads under %s: %s", self.root_dir, exc)

    async def _flush_touches(self, *, force: bool) -> None:
        """Journal the recency of the pages read (re-bound with a new stamp), so a restart
        keeps the LRU order; a few KiB per thousand pages read."""
        if not self._touched or (not force and len(self._touched) < _TOUCH_FLUSH):
            return
        keys, self._touched = list(self._touched), {}
        # oldest first, as the budget orders them: stamps then keep that order
        order = [key for key in self._budget.sizes if key in self._index]
        wanted = set(keys)
        entries = [self._index[key]._replace(stamp=self._stamp()) for key in order
                   if key in wanted]
        await self._in_thread(self._appender.log, entries)
        for entry in entries:
            current = self._index.get(entry.key)
            if current is not None and current[:5] == entry[:5]:  # still that record
                self._index[entry.key] = entry

    async def _write_run(self, run: range, keys: Sequence[str], views: list[memoryview],
                         stored: list[bool], failed: list[BaseException], *,
                         stamps: list[int]) -> None:
        size = object_size(self.fmt)
        planned: list[int] = []
        deletes: list[Entry] = []
        for i in run:
            # NOTE: an overwrite keeps serving the old record until the new one is bound;
            # only its bytes leave the budget now (they are replaced, not added to).
            self._budget.pop(keys[i])
            evicted = self._budget.reserve(size)
            if evicted is None:  # it cannot fit at all: not stored (nor is the old one)
                if (old := self._unbind(keys[i])) is not None:
                    deletes.append(self._tombstone(old))
                continue
            planned.append(i)
            gone = [old for victim in evicted if (old := self._unbind(victim)) is not None]
            deletes += [self._tombstone(old) for old in gone]
            self._stats.evicted_pages += len(gone)
        try:
            entries = await self._in_thread(seg.write_run, self._appender, self.fmt,
                                            [keys[i] for i in planned],
                                            [views[i] for i in planned],
                                            [stamps[i] for i in planned], deletes)
        except OSError as exc:
            failed += [exc] * max(1, len(planned))
            for i in planned:  # the old records, if any, are still live
                if (old := self._index.get(keys[i])) is not None and keys[i] not in self._budget:
                    self._budget.add(keys[i], old.length)
            return
        finally:
            self._budget.release(size * len(planned))
        for i, entry in zip(planned, entries, strict=True):
            self._bind(entry)
            stored[i] = True
        self._stats.pages_written += len(entries)
        self._stats.bytes_written += len(entries) * self.fmt.payload_bytes

    # ---------------------------------------------------------------------------- the index

    def _bind(self, entry: Entry) -> None:
        """Make `entry` the key's live record (the most recently used)."""
        self._unbind(entry.key)
        self._index[entry.key] = entry
        self._live[entry.seg_id] = self._live.get(entry.seg_id, 0) + entry.length
        end = entry.offset + entry.length
        if self._sizes.get(entry.seg_id, 0) < end:
            self._sizes[entry.seg_id] = end
        self._budget.add(entry.key, entry.length)

    def _unbind(self, key: str) -> Entry | None:
        """Forget `key`'s record (it becomes dead space); the entry it had, if any."""
        old = self._index.pop(key, None)
        self._budget.pop(key)
        if old is not None:
            self._live[old.seg_id] -= old.length
            self._may_compact = True
        return old

    def _tombstone(self, old: Entry) -> Entry:
        """The delete entry that kills `old`'s record, and remember it was deleted."""
        stamp = max(self._stamp(), old.stamp + 1)
        self._deleted[old.key] = stamp
        self._deleted.move_to_end(old.key)
        while len(self._deleted) > _DELETED_MEMORY:
            self._deleted.popitem(last=False)
        return Entry(old.key, DELETE, old.seg_id, old.offset, old.length, stamp)

    def _apply(self, entry: Entry) -> bool:
        """Merge one entry read from a journal: the latest stamp wins. True if it changed
        the index."""
        current = self._index.get(entry.key)
        if current is not None and current.stamp > entry.stamp:
            return False
        if entry.kind == PUT:
            if current is None and self._deleted.get(entry.key, -1) >= entry.stamp:
                return False
            if entry.seg_id not in self._sizes:
                return False  # its segment is gone
            self._bind(entry)
            return True
        self._deleted[entry.key] = max(entry.stamp, self._deleted.get(entry.key, -1))
        return self._unbind(entry.key) is not None

    def _stamp(self) -> int:
        """Now, in ns since the epoch, later than any stamp this instance gave before."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    # ---------------------------------------------------------------------------- journals

    async def _start(self) -> None:
        """Build the index from the journals, once, on an I/O thread.

        Cancellation: a scan in flight completes (and counts), then the cancellation
        propagates.
        """
        if self._closed:
            raise ClosedError("storage: the FileBackend is closed")
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
            self._executor = self._executor or ThreadPoolExecutor(
                self._runner.limit, thread_name_prefix="aiohicache-file")
            await finish_then_cancel(self._scan())
            self._started = True

    async def _scan(self) -> None:
        try:
            scan, orphans = await self._in_thread(_scan_dir, self.root_dir)
            self._load(scan)
            victims = self._budget.trim()
            deletes = [self._tombstone(old) for key in victims
                       if (old := self._unbind(key)) is not None]
            await self._in_thread(self._appender.log, deletes)
        except OSError as exc:
            raise StorageError(f"storage: cannot open the file store {self.root_dir}: "
                               f"{exc}") from exc
        self._stats.evicted_pages += len(deletes)
        self._stats.extra["orphans_removed"] = orphans
        logger.info("storage: %s holds %d objects (%d bytes) in %d segments; removed %d "
                    "orphans", self.root_dir, len(self._budget), self._budget.used_bytes,
                    len(self._sizes), orphans)

    def _load(self, scan: seg.JournalScan) -> None:
        """Build the index from a full scan: entries in stamp order, so the last one wins
        and the budget's LRU order is the order of last use."""
        self._sizes = dict(scan.segments)
        self._read_to = dict(scan.read_to)
        entries = sorted((e for _, batch in scan.entries for e in batch),
                         key=lambda e: e.stamp)
        torn = 0
        for entry in entries:
            if entry.kind == PUT and entry.offset + entry.length > scan.segments.get(
                    entry.seg_id, -1):
                torn += entry.seg_id in scan.segments
                continue  # its segment is gone, or the record never landed whole
            self._apply(entry)
        self._stats.extra["torn_entries"] = torn

    async def _refresh(self, *, force: bool = False) -> None:
        """Read what other processes journaled since the last look (at most every
        `refresh_interval`, unless `force`)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < self.refresh_interval:
            return
        self._last_refresh = now
        before = set(self._sizes)  # a segment made during the scan is not gone
        try:
            scan = await finish_then_cancel(self._in_thread(
                seg.read_journals, self.root_dir, dict(self._read_to),
                self._appender.created_ids()))
        except OSError as exc:
            logger.debug("storage: reading the journals under %s: %s", self.root_dir, exc)
            return
        gone = before - set(scan.segments)
        for seg_id, size in scan.segments.items():
            self._sizes[seg_id] = max(size, self._sizes.get(seg_id, 0))
        for seg_id in gone:  # compacted by another process, or removed
            self._drop_segment(seg_id)
        self._read_to = scan.read_to
        for entry in sorted((e for _, batch in scan.entries for e in batch),
                            key=lambda e: e.stamp):
            self._apply(entry)

    def _drop_segment(self, seg_id: int) -> None:
        self._maps.drop(seg_id)
        for key in [k for k, e in self._index.items() if e.seg_id == seg_id]:
            self._unbind(key)
        self._sizes.pop(seg_id, None)
        self._live.pop(seg_id, None)
        self._read_to.pop(seg_id, None)

    # ---------------------------------------------------------------------------- compaction

    async def _maybe_compact(self) -> None:
        """Compact the sealed segment with the most dead bytes, if it is dead enough.

        Cancellation: the compaction in flight completes, then the cancellation propagates.
        """
        if not self._may_compact:
            return
        self._may_compact = False
        victim = self._pick_victim()
        if victim is None:
            return
        try:
            moved = await self._compact(victim)
        except OSError as exc:
            self._stats.errors += 1
            logger.warning("storage: compacting segment %016x under %s: %s", victim,
                           self.root_dir, exc)
            return
        if moved is None:
            self._busy[victim] = time.monotonic()

    def _pick_victim(self) -> int | None:
        active = self._appender.active_id
        now = time.monotonic()
        best, most = None, 0
        for seg_id, size in self._sizes.items():
            dead = size - self._live.get(seg_id, 0)
            if (seg_id == active or now - self._busy.get(seg_id, -_BUSY_S) < _BUSY_S
                    or dead <= 0 or dead < self.compact_dead_fraction * size):
                continue
            if dead > most:
                best, most = seg_id, dead
        return best

    async def _compact(self, victim: int) -> list[Entry] | None:
        log = await self._in_thread(seg.read_log, self.root_dir, victim)
        moves = sorted((e for e in self._index.values() if e.seg_id == victim),
                       key=lambda e: e.offset)
        keep = [e for e in log if e.seg_id != victim and e.seg_id in self._sizes and (
            self._index.get(e.key) == e if e.kind == PUT
            else self._deleted.get(e.key) == e.stamp)]
        moved = await self._in_thread(seg.compact, self._appender, victim, moves, keep)
        if moved is None:
            return None
        for old, new in zip(moves, moved, strict=True):
            if self._index.get(old.key) == old:  # same key, LRU place and size: re-point it
                self._index[old.key] = new
                self._live[victim] -= old.length
                self._live[new.seg_id] = self._live.get(new.seg_id, 0) + new.length
                self._sizes[new.seg_id] = max(self._sizes.get(new.seg_id, 0),
                                              new.offset + new.length)
        self._drop_segment(victim)
        self._stats.extra["compactions"] = self._stats.extra.get("compactions", 0) + 1
        logger.debug("storage: compacted segment %016x (%d live records moved)", victim,
                     len(moved))
        return moved

    # ---------------------------------------------------------------------------- plumbing

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed or self._executor is None:
            raise ClosedError("storage: the FileBackend is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args))

    def _raise_failed(self, failed: list[BaseException], error: type[StorageError],
                      what: str) -> None:
        if self._closed:
            raise ClosedError("storage: the FileBackend was closed during the call")
        if failed:
            self._stats.errors += len(failed)
            raise error(f"storage: {len(failed)} page(s) failed to {what} under "
                        f"{self.root_dir}: {failed[0]}") from failed[0]


def _scan_dir(root: str) -> tuple[seg.JournalScan, int]:
    """Every journal and segment under `root`, after removing orphans (on an I/O thread)."""
    scan = seg.read_journals(root, {})
    orphans = seg.remove_orphans(root, scan.segments, scan.read_to)
    if orphans:
        scan = seg.read_journals(root, {})
    return scan, orphans


def _check_number(name: str, value: object, *, low: float, high: float | None = None,
                  integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (
            low <= value and (high is None or value <= high)):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"{name}: must be {'an int' if integer else 'a number'} {bound}, "
                          f"got {value!r}")
