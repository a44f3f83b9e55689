"""The upkeep half of `FileBackend`: the index built from the journals and kept in step
with other processes, the recency of reads journaled, compaction, and the I/O threads.

`_FileUpkeep` is a base class of `FileBackend` only (the state it uses is made in
`FileBackend.__init__`); it is apart so each half reads on its own: `_file` serves the
protocol, this keeps the store sound underneath.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import Final, TypeVar

import anyio
import anyio.lowlevel

from .._concurrency import finish_then_cancel, run_in_thread
from ..errors import ClosedError
from . import _appender, _journal, _reader
from ._common import LruBudget, RunQueue
from ._file_index import SegmentIndex
from ._journal import TOUCH, Entry
from .base import BackendStats
from .errors import StorageError

__all__ = ()

logger = logging.getLogger("aiohicache.storage.file")

T = TypeVar("T")

_TOUCH_FLUSH: Final = 4096
"""Keys read since the last journaled touch that make the next call journal them."""
_MERGE_CHUNK: Final = 256
"""Journal entries merged between two checkpoints (about 0.7 ms of the loop; 1,024 took 8-15 ms
on this shared 2-core VM)."""
_BUSY_S: Final = 10.0
"""A segment another process holds locked is not tried for compaction again this long."""


class _FileUpkeep:
    root_dir: str
    compact_dead_fraction: float
    refresh_interval: float
    _index: SegmentIndex
    _files: _reader.SegmentFiles
    _budget: LruBudget
    _queue: RunQueue
    _appender: _appender.Appender
    _busy: dict[int, float]
    _touched: dict[str, int]
    _last_refresh: float
    _executor: ThreadPoolExecutor | None
    _stats: BackendStats
    _start_lock: anyio.Lock
    _merging: anyio.Lock
    _started: bool
    _closed: bool

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
                self._queue.limit, thread_name_prefix="aiohicache-file")
            await finish_then_cancel(self._scan())

    async def _scan(self) -> None:
        try:
            # NOTE: built on the I/O thread, then adopted: loading a million entries held
            # the loop 3.3 s (every caller awaits the start, so nothing else uses the index)
            index = SegmentIndex(self._budget.capacity_bytes, on_drop=self._files.drop)
            orphans, torn, deletes = await self._in_thread(_scan_dir, self.root_dir, index)
            self._index, self._budget = index, index.budget  # nothing used the old one yet
            self._stats.extra["torn_entries"] = torn
            await self._in_thread(self._appender.log, deletes)
        except OSError as exc:
            raise StorageError(f"storage: cannot open the file store {self.root_dir}: "
                               f"{exc}") from exc
        self._stats.evicted_pages += len(deletes)
        self._stats.extra["orphans_removed"] = orphans
        # NOTE: here, in the scan's task: a caller cancelled meanwhile never got to mark it,
        # and the next call scanned again (the start's evictions journaled twice)
        self._started = True
        logger.info("storage: %s holds %d objects (%d bytes) in %d segments; removed %d "
                    "orphans", self.root_dir, len(self._budget), self._budget.used_bytes,
                    len(self._index.sizes), orphans)

    async def _refresh_for(self, keys: Sequence[str]) -> None:
        """Look at the other processes' journals if a key of `keys` is not indexed."""
        if not all(map(self._index.entries.__contains__, keys)):  # NOTE: C-level, per key
            await self._refresh()

    async def _refresh(self, *, force: bool = False) -> None:
        """Read what other processes journaled since the last look (at most every
        `refresh_interval`, unless `force`)."""
        if not force and self._merging.locked():
            # NOTE: a look under way: wait for its merge, which may hold what the caller
            # asks for (a delete that went on unmerged deleted nothing, and the merge then
            # bound the other process's record), even within `refresh_interval` of its start
            async with self._merging:
                return
        if not force and time.monotonic() - self._last_refresh < self.refresh_interval:
            return
        async with self._merging:
            self._last_refresh = time.monotonic()
            before = set(self._index.sizes)  # a segment made during the scan is not gone
            try:
                scan, order = await finish_then_cancel(self._in_thread(
                    _read_since, self.root_dir, dict(self._index.read_to),
                    self._appender.created_ids()))
            except OSError as exc:
                logger.debug("storage: reading the journals under %s: %s", self.root_dir, exc)
                return
            await finish_then_cancel(self._merge(scan, before, order))

    async def _merge(self, scan: _journal.JournalScan, before: set[int],
                     order: list[Entry]) -> None:
        """Merge `scan` (its entries `order`ed by stamp) a chunk at a time, letting the loop
        run between chunks (another process may have journaled 100k entries since the last
        look: 270 ms of the loop at once). The caller holds `_merging`, so no compaction is
        planned from a half-merged index.

        Cancellation: the caller's `finish_then_cancel` lets it end (entries left out would
        be lost: the journals' read positions already moved past them).
        """
        index = self._index
        gone = index.merge_segments(scan, before, order[-1].stamp if order else 0)
        apply = index.apply
        try:
            for lo in range(0, len(order), _MERGE_CHUNK):
                if lo:
                    await anyio.lowlevel.checkpoint()
                for entry in order[lo:lo + _MERGE_CHUNK]:
                    apply(entry)
        finally:  # NOTE: else their keys stayed bound into removed files for good
            for seg_id in gone:
                index.drop_segment(seg_id)

    # ---------------------------------------------------------------------------- compaction

    async def _maybe_compact(self, *, empty_only: bool = False) -> None:
        """Compact the sealed segment with the most dead bytes, if it is dead enough (or,
        `empty_only`, one that holds only a journal).

        Cancellation: the compaction in flight completes, then the cancellation propagates.
        """
        emptied = self._index.add_emptied(self._appender.take_emptied())
        if not self._index.may_compact or (empty_only and not emptied):
            return
        self._index.may_compact = empty_only  # NOTE: a dead record still wants a look
        active, now = self._appender.active_ids(), time.monotonic()
        victim = self._index.pick_victim(
            lambda seg_id: seg_id in active or now - self._busy.get(seg_id, -_BUSY_S) < _BUSY_S,
            self.compact_dead_fraction, empty_only=empty_only)
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
        if self._index.emptied:  # NOTE: one a call; no record dies to call for the next
            self._index.may_compact = True

    async def _compact(self, victim: int) -> list[Entry] | None:
        """Move `victim`'s live records to an active segment and remove it; None if another
        process holds it.

        The plan and the re-pointing hold `_merging` and let the loop run every `STEP`
        records (a segment of 32k records held it 50 ms at once); the copy runs on an I/O
        thread without it.

        Cancellation: the caller's `finish_then_cancel` lets it end (records moved and not
        re-pointed would be lost with the victim).
        """
        index = self._index
        # NOTE: planned from a whole merge only (`_merge` lets the loop run mid-way)
        async with self._merging:
            # NOTE: this instance's own journals are never read back: it knows them whole
            known = 1 << 62 if victim in self._appender.created_ids() else \
                index.read_to.get(victim, 0)
            locked = await self._in_thread(_appender.lock_segment, self.root_dir, victim,
                                           known)
            if locked is None:
                return None
            fd, (log, unseen) = locked
            index.compacting.add(victim)
            try:
                moves, keep = await _stepped(index.plan_steps(victim, log, unseen))
            except BaseException:
                index.compacting.discard(victim)
                os.close(fd)
                raise
        try:
            try:
                moves, moved, held = await self._in_thread(_compact_in_file_order,
                                                           self._appender, fd, victim, moves,
                                                           keep)
            finally:
                os.close(fd)  # NOTE: after the thread ended (the caller waits for it)
            # NOTE: a look that began meanwhile must not drop the victim's keys: it stays
            # in `compacting` until they are re-pointed
            async with self._merging:
                await _stepped(index.repoint_steps(victim, moves, moved))
        finally:
            index.compacting.discard(victim)
        self._appender.unhold(held)
        self._stats.extra["compactions"] = self._stats.extra.get("compactions", 0) + 1
        logger.debug("storage: compacted segment %016x (%d live records moved)", victim,
                     len(moved))
        return moved


    # ---------------------------------------------------------------------------- reads

    async def _journal_reads(self, rejected: list[Entry]) -> None:
        """Journal the deletes of rejected objects, and the touches once enough piled up."""
        try:
            if rejected:
                await self._in_thread(self._appender.log, rejected)
            await self._flush_touches(force=False)
            await self._maybe_compact(empty_only=True)  # a lane rolled for its touches
        except (OSError, ClosedError, RuntimeError) as exc:
            logger.debug("storage: journaling reads under %s: %s", self.root_dir, exc)

    async def _flush_touches(self, *, force: bool) -> None:
        """Journal the recency of the pages read (a touch entry each, stamped when read),
        so a restart keeps the LRU order; a few KiB per thousand pages read.

        NOTE: a touch only orders: it never re-binds a key, so neither a delete or
        overwrite made after the read (here or by another instance) nor a compaction's
        move of the record can be undone by it."""
        if not self._touched or (not force and len(self._touched) < _TOUCH_FLUSH):
            return
        touched, self._touched = self._touched, {}
        # NOTE: in the order of their last read, not looked up in the LRU order: walking
        # that order from its recent end, past the pages written since, stalled the loop
        # for 4-5 ms per flush in the default replay. (A page written after its last read
        # ranks by that read here: after a restart it may be evicted a little earlier.)
        read = list(map(self._index.entries.get, touched))
        # NOTE: the entries are made and packed on the I/O thread: the loop's share of a
        # read page is a lookup here
        await self._in_thread(_log_touches, self._appender, read, list(touched.values()))


    # ---------------------------------------------------------------------------- plumbing

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on one of the store's I/O threads.

        Cancellation: `fn` runs to its end; the caller gets the cancellation at once (callers
        that must not return before it ends wrap this in `finish_then_cancel`).
        """
        if self._closed or self._executor is None:
            raise ClosedError("storage: the FileBackend is closed")
        # NOTE: the store's own threads, not anyio.to_thread (10-14% slower at 64 KiB and
        # 8 MiB reads, docs/storage.md), through the package's one thread bridge
        return await run_in_thread(self._executor, fn, *args)


async def _stepped(steps: Generator[None, None, T]) -> T:
    """Run `steps`, letting the loop run between two; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        await anyio.lowlevel.checkpoint()


def _compact_in_file_order(appender: _appender.Appender, fd: int, victim: int,
                           moves: list[Entry], keep: list[Entry]
                           ) -> tuple[list[Entry], list[Entry], list[int]]:
    """`_appender.compact` of `moves` in file order (sorted here, on an I/O thread: 32k
    records took 10-20 ms); the sorted moves, the moved entries and the segments held."""
    moves = sorted(moves, key=attrgetter("offset"))
    moved, held = _appender.compact(appender, fd, victim, moves, keep)
    return moves, moved, held


def _log_touches(appender: _appender.Appender, read: list[Entry | None],
                 times: list[int]) -> None:
    """Journal a touch of each record of `read` (None: no longer bound) at its read time, in
    order (on an I/O thread)."""
    appender.log([Entry(e.key, TOUCH, e.seg_id, e.offset, e.length, at)
                  for e, at in zip(read, times, strict=True) if e is not None])


def _read_since(root: str, read_to: dict[int, int], skip: frozenset[int]
                ) -> tuple[_journal.JournalScan, list[Entry]]:
    """What the other journals appended since `read_to`, and its entries in stamp order
    (sorted here, on an I/O thread, not on the loop)."""
    scan = _journal.read_journals(root, read_to, skip)
    return scan, scan.in_stamp_order()


def _scan_dir(root: str, index: SegmentIndex) -> tuple[int, int, list[Entry]]:
    """Every journal and segment under `root`, after removing orphans, loaded into `index`
    (a fresh one no other thread sees) and trimmed to its budget (on an I/O thread).

    Returns:
        The orphans removed, the torn entries dropped, and the delete entries of
        the pages evicted to fit the budget (to journal).
    """
    scan = _journal.read_journals(root, {})
    orphans = _journal.remove_orphans(root, scan.segments, scan.read_to)
    if orphans:
        scan = _journal.read_journals(root, {})
    torn = index.load(scan)
    # NOTE: a lane holding only a journal (a reader's touches, deletes), or nothing, is
    # garbage once its writer closed or died; only its maker ever compacted one, so those
    # of closed or killed instances stayed for good, a pair of files and up to a lane's
    # touches per instance that ever ran (a review). Lock-free now: sealed for good.
    index.add_emptied([seg_id for seg_id, size in scan.segments.items() if not size and
                       not _journal.is_locked(_journal.segment_path(root, seg_id))])
    return orphans, torn, index.remove(index.budget.trim(), evicted=True)
