"""The loop's side of one run of pages of the file store: plan, then take the result.

A batch is split into runs (`FileBackend._runs`); `RunQueue` starts each run when an I/O
thread is free (`start`: look up or reserve, on the loop), makes its blocking call on that
thread (`_reader.read_run`, `_appender.write_run`) and hands the result back (`finish` /
`fail`, on the loop). Per-key results land in the batch's shared lists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, cast

from . import _appender, _reader
from ._common import object_size
from ._journal import Entry
from ._reader import Outcome

if TYPE_CHECKING:
    from ._file import FileBackend

__all__ = ("ReadBatch", "ReadRun", "WriteRun")

logger = logging.getLogger("aiohicache.storage.file")


@dataclass(slots=True)
class ReadBatch:
    """One `get_into`: its keys and buffers, and what its runs found."""

    keys: Sequence[str]
    views: list[memoryview]
    filled: list[bool]
    failed: list[BaseException] = field(default_factory=list)
    rejected: list[Entry] = field(default_factory=list)
    """Delete entries of objects that failed their check (journaled after the batch)."""
    moved: list[int] | None = field(default_factory=list)
    """Pages whose segment was gone (compacted meanwhile): read again after a refresh.
    None on the second try."""


class ReadRun:
    """Read a run of pages into their buffers and check them."""

    __slots__ = ("batch", "entries", "found", "run", "run_keys", "store")

    def __init__(self, store: FileBackend, batch: ReadBatch, run: range) -> None:
        self.store, self.batch, self.run = store, batch, run
        self.found: list[int] = []
        self.entries: list[Entry] = []
        self.run_keys: Sequence[str] = ()

    def start(self) -> Callable[[], list[str | OSError]] | None:
        keys, store = self.batch.keys, self.store
        run_keys = keys[self.run.start:self.run.stop]
        looked = list(map(store._index.entries.get, run_keys))
        if None in looked:  # some absent: read the others
            self.found = [i for i, entry in zip(self.run, looked, strict=True) if entry]
            store._stats.misses += len(self.run) - len(self.found)
            run_keys = [keys[i] for i in self.found]
            looked = [entry for entry in looked if entry is not None]
        else:  # NOTE: the common case is kept to slices and C-level maps (the loop's share)
            self.found = list(self.run)
        if not self.found:
            return None
        self.run_keys, self.entries = run_keys, cast("list[Entry]", looked)
        views = self.batch.views
        return partial(_reader.read_run, store._files, store.fmt, run_keys, self.entries,
                       [views[i] for i in self.found])

    def finish(self, outcomes: list[str | OSError]) -> None:
        filled = self.batch.filled
        if outcomes.count(Outcome.FILLED) == len(self.found):
            for i in self.found:
                filled[i] = True
            hits = self.run_keys
        else:
            hits = self._sort(outcomes)
        store = self.store
        touched = store._touched  # the budget's order is touched once per batch, whole
        now = time.time_ns()  # the touch's stamp: a delete made after this read still wins
        for key in reversed(hits):  # last read last; a batch's first page the most recent
            touched.pop(key, None)
            touched[key] = now
        store._stats.pages_read += len(hits)
        store._stats.bytes_read += len(hits) * store.fmt.payload_bytes

    def fail(self, exc: BaseException) -> None:
        self.batch.failed.append(exc)

    def _sort(self, outcomes: list[str | OSError]) -> list[str]:
        """Act on outcomes that are not all filled; the keys filled."""
        batch, hits = self.batch, []
        for i, entry, outcome in zip(self.found, self.entries, outcomes, strict=True):
            if outcome is Outcome.FILLED:
                batch.filled[i] = True
                hits.append(entry.key)
            elif isinstance(outcome, OSError):
                batch.failed.append(outcome)
            elif outcome is Outcome.MISSING and batch.moved is not None:
                batch.moved.append(i)  # its segment is gone: compacted, or the store removed
            else:
                self._count_miss(entry, outcome)
        return hits

    def _count_miss(self, entry: Entry, outcome: str) -> None:
        index, stats = self.store._index, self.store._stats
        # NOTE: gone from a segment this instance is compacting: moved, not lost
        moving = outcome is Outcome.MISSING and entry.seg_id in index.compacting
        if index.entries.get(entry.key) == entry and not moving:
            index.unbind(entry.key)
            if outcome is Outcome.CORRUPT:
                self.batch.rejected.append(index.tombstone(entry, now=False))
        if outcome is Outcome.MISSING:
            stats.misses += 1
        else:
            stats.corrupt += 1
            logger.debug("storage: rejected and deleted the object of %s", entry.key)


class WriteRun:
    """Append a run of pages, then bind them in the index."""

    __slots__ = ("failed", "keys", "planned", "run", "stamps", "store", "stored", "views")

    def __init__(self, store: FileBackend, run: range, keys: Sequence[str],
                 views: list[memoryview], stamps: list[int], stored: list[bool],
                 failed: list[BaseException]) -> None:
        self.store, self.run, self.keys, self.views = store, run, keys, views
        self.stamps, self.stored, self.failed = stamps, stored, failed
        self.planned: list[int] = []

    def start(self) -> Callable[[], list[Entry]] | None:
        """Reserve the budget now (not when the batch began: a run not started reserves
        nothing, so a cancelled batch leaves the budget as it was)."""
        store, keys = self.store, self.keys
        self.planned, deletes = store._plan_writes(self.run, keys, object_size(store.fmt))
        if not self.planned and not deletes:
            return None
        return partial(_appender.write_run, store._appender, store.fmt,
                       [keys[i] for i in self.planned], [self.views[i] for i in self.planned],
                       [self.stamps[i] for i in self.planned], deletes)

    def finish(self, entries: list[Entry]) -> None:
        store = self.store
        self._release()
        for i, entry in zip(self.planned, entries, strict=True):
            store._index.bind_written(entry)  # stored, if maybe already overwritten or deleted
            self.stored[i] = True
        if entries:  # bound: its segment may be compacted here now
            store._appender.unhold([entries[0].seg_id])
        store._stats.pages_written += len(entries)
        store._stats.bytes_written += len(entries) * store.fmt.payload_bytes

    def fail(self, exc: BaseException) -> None:
        """Nothing of the run was journaled: the old records, if any, are still live."""
        self._release()
        self.failed.extend([exc] * max(1, len(self.planned)))
        index, budget = self.store._index, self.store._budget
        for i in self.planned:
            old = index.entries.get(self.keys[i])
            if old is not None and self.keys[i] not in budget:
                budget.add(self.keys[i], old.length)

    def _release(self) -> None:
        self.store._budget.release(object_size(self.store.fmt) * len(self.planned))
