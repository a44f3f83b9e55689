"""A `StorageBackend` over a local (or shared) directory: one file per page object.

Files live at ``root/ab/cd/abcd...`` (`fanout` levels of two hex characters). A write goes to
``<key>.<random>.tmp`` in the same directory and is renamed over the key (``os.replace``), so
a reader sees a whole object or none; temp names never match a key, so they are never served.
The directory is the truth: an in-memory index of object sizes, least recently used first,
enforces the byte budget and is rebuilt from the directory when an instance starts. No
directory is assumed to exist: a write re-makes what was removed (see `_Store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import re
import secrets
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import BinaryIO, Final, Self, TypeVar

import numpy as np

from .._concurrency import finish_then_cancel
from ..errors import ClosedError, ConfigError
from ._common import KEY_PATTERN, BatchRunner, LruBudget, check_buffers, check_keys, object_size
from .base import BackendStats, PageFormat, decode_page, encode_header
from .errors import StorageError, StorageReadError, StorageWriteError

_RunStep = Callable[[range, Sequence[str], list[memoryview], list[bool], list[BaseException]],
                    Awaitable[None]]

__all__ = ("FileBackend",)

logger = logging.getLogger(__name__)

T = TypeVar("T")

STALE_TEMP_S: Final = 600.0
"""Temp files older than this at startup belong to a crashed writer and are removed (younger
ones may be another live process's write in progress)."""

_RUN_PAGES: Final = 32
_RUN_BYTES: Final = 4 << 20
_TEMP = re.compile(r"[0-9a-f]{16,128}\.[0-9a-f]{12}\.tmp")
_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")


class FileBackend:
    """Page objects as files under `root_dir`, within an optional byte budget.

    Args:
        root_dir: the directory (created if missing). Instances in any process may share it;
            each serves what the others wrote, but counts only its own budget.
        fmt: the page format every object is written and checked with.
        capacity_bytes: budget for stored objects (header + payload, not file-system blocks);
            a write that would pass it first deletes the least recently read or written
            objects (the first page of a batch counts as the most recent: a prefix chain is
            evicted from its tail). None: unbounded.
        fanout: directory levels of two hex characters each, 0-4 (2: 65,536 directories).
            Every instance over one directory must use the same value.
        fsync: make each object durable (fsync the file and its directory) before it counts
            as stored; without it a power loss may lose recent pages (never tear them).
        max_concurrency: I/O threads, and runs of pages in flight at once over all batches.
            Raise it for storage with high latency (network file systems, cold disks); on
            page-cache-speed storage, threads past the cores only add event-loop lag.

    No call blocks the event loop: file I/O, directory scans and deletes run on the
    backend's own threads. Nothing is ever unpickled: objects are raw bytes checked by
    `decode_page`. Use ``async with`` or call `aclose`.
    """

    def __init__(self, root_dir: str | os.PathLike[str], fmt: PageFormat, *,
                 capacity_bytes: int | None = None, fanout: int = 2, fsync: bool = False,
                 max_concurrency: int = 4) -> None:
        if isinstance(fanout, bool) or not isinstance(fanout, int) or not 0 <= fanout <= 4:
            raise ConfigError(f"fanout: must be an int in 0..4, got {fanout!r}")
        try:
            self.root_dir = os.path.abspath(os.fspath(root_dir))
        except TypeError:
            raise ConfigError(f"root_dir: must be a path, got {root_dir!r}") from None
        self.fmt = fmt
        self.fanout = fanout
        self.fsync = fsync
        self._budget = LruBudget(capacity_bytes)
        self._runner = BatchRunner(max_concurrency)
        self._executor: ThreadPoolExecutor | None = None
        self._staging: list[bytearray] = []
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

        Keys in the index count at once; the first one it lacks, and those after it, are
        looked for on disk (another instance may have written them) and adopted. A file
        deleted behind this instance's back still counts until `get_into` misses it.

        Cancellation: a look on disk in flight completes first (its finds are adopted).
        """
        check_keys(keys)
        await self._start()
        self._stats.exists_calls += 1
        num = 0
        while num < len(keys) and keys[num] in self._budget:
            num += 1
        if num == len(keys):
            return num
        rest = [self._path(key) for key in keys[num:]]
        sizes = await finish_then_cancel(self._in_thread(_leading_sizes, rest))
        for key, size in zip(keys[num:], sizes, strict=False):
            self._budget.add(key, size)
        return num + len(sizes)

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's verified payload into its buffer; True where it was filled.

        Each file is read into a staging buffer and checked there; only a verified payload
        is copied into the caller's buffer (on the I/O thread), so a missed buffer is never
        written. A rejected object (bad header, size or checksum) is a miss, counts in
        `stats().corrupt`, and is deleted.

        Raises:
            StorageReadError: a file could not be read (not a missing one); the buffers of
                the other pages may have been filled.

        Cancellation: runs of pages not started are skipped; runs in flight (at most
        `max_concurrency`, each a few MiB) complete, each page filling its buffer whole or
        not at all, then the cancellation propagates. No buffer is written after the call
        has ended.
        """
        return await self._batch(keys, buffers, self._read_run, StorageReadError, "read")

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store each buffer under its key (header + payload); True where it was stored.

        False where one object cannot fit the budget at all. Buffers are read on the I/O
        threads: leave them unchanged until the call returns.

        Raises:
            StorageWriteError: a file could not be written; the other pages were stored.

        Cancellation: runs of pages in flight complete (each object whole or absent, and
        the buffers no longer read), runs not started are skipped, then the cancellation
        propagates.
        """
        return await self._batch(keys, buffers, self._write_run, StorageWriteError, "write")

    async def _batch(self, keys: Sequence[str], buffers: Sequence[memoryview], step: _RunStep,
                     error: type[StorageError], verb: str) -> list[bool]:
        """Run `step` over runs of pages concurrently; per-key results; I/O errors raised
        after every run has finished."""
        views = check_buffers(self.fmt, keys, buffers)
        await self._start()
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
        """Remove `keys`; return how many existed.

        Cancellation: the deletes complete, then the cancellation propagates.
        """
        check_keys(keys)
        await self._start()
        for key in keys:
            self._budget.pop(key)
        paths = [self._path(key) for key in keys]
        try:
            found = await finish_then_cancel(self._in_thread(_unlink_all, paths))
        except OSError as exc:
            self._stats.errors += 1
            raise StorageWriteError(f"storage: deleting from {self.root_dir}: {exc}") from exc
        self._stats.pages_deleted += found
        return found

    def stats(self) -> BackendStats:
        """A copy of the counters (`extra`: ``objects``, ``used_bytes`` as indexed, and
        ``temps_removed`` at startup)."""
        extra = {**self._stats.extra, "objects": len(self._budget),
                 "used_bytes": self._budget.used_bytes}
        return replace(self._stats, extra=extra)

    async def aclose(self) -> None:
        """Stop the I/O threads, after the operations in flight (idempotent).

        Cancellation: the threads are stopped first, then the cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            loop = asyncio.get_running_loop()
            await finish_then_cancel(loop.run_in_executor(None, self._executor.shutdown))

    # ---------------------------------------------------------------------------- runs of pages

    def _runs(self, num: int) -> list[range]:
        """Split a batch into runs of pages, one I/O-thread job each.

        NOTE: a job per page costs the loop a task, a future and a thread wake-up, as much
        as reading a small page; a run of pages pays that once. Runs are about
        `_RUN_BYTES` and at most `_RUN_PAGES` (the latency of a cancel), and a batch gets
        at least as many runs as there are threads.
        """
        per = min(-(-num // self._runner.limit), _RUN_PAGES,
                  max(1, _RUN_BYTES // object_size(self.fmt)))
        per = max(1, per)
        return [range(lo, min(lo + per, num)) for lo in range(0, num, per)]

    async def _read_run(self, run: range, keys: Sequence[str], views: list[memoryview],
                        filled: list[bool], failed: list[BaseException]) -> None:
        # NOTE: staging buffers are reused (a fresh one costs a page fault per 4 KiB): at
        # most `max_concurrency` exist, as only that many runs are in flight.
        staging = self._staging.pop() if self._staging else bytearray(object_size(self.fmt) + 1)
        try:
            outcomes = await self._in_thread(_load_run, [keys[i] for i in run],
                                             [self._path(keys[i]) for i in run], self.fmt,
                                             staging, [views[i] for i in run])
        finally:
            self._staging.append(staging)
        for i, outcome in zip(run, outcomes, strict=True):
            if isinstance(outcome, OSError):
                failed.append(outcome)
            else:
                filled[i] = self._count_read(keys[i], outcome)

    def _count_read(self, key: str, outcome: _Outcome) -> bool:
        if outcome is not _Outcome.FILLED:
            self._budget.pop(key)
            if outcome is _Outcome.MISSING:
                self._stats.misses += 1
            else:
                self._stats.corrupt += 1
                logger.debug("storage: rejected and deleted the object of %s", key)
            return False
        if key in self._budget:
            self._budget.touch(key)
        else:
            self._budget.add(key, object_size(self.fmt))
        self._stats.pages_read += 1
        self._stats.bytes_read += self.fmt.payload_bytes
        return True

    async def _write_run(self, run: range, keys: Sequence[str], views: list[memoryview],
                         stored: list[bool], failed: list[BaseException]) -> None:
        size = object_size(self.fmt)
        planned: list[int] = []
        victims: list[str] = []
        for i in run:
            self._budget.pop(keys[i])  # an overwrite: the old object is replaced whole
            evicted = self._budget.reserve(size)
            if evicted is not None:  # else it cannot fit at all: not stored
                planned.append(i)
                victims += evicted
        self._stats.evicted_pages += len(victims)
        jobs = [_Store(key=keys[i], path=self._path(keys[i]), fmt=self.fmt,
                       payload=views[i], fsync=self.fsync) for i in planned]
        try:
            errors = await self._in_thread(_store_run, [self._path(v) for v in victims], jobs)
        finally:
            self._budget.release(size * len(planned))
        for i, error in zip(planned, errors, strict=True):
            if error is not None:
                failed.append(error)
                continue
            self._budget.add(keys[i], size)
            stored[i] = True
            self._stats.pages_written += 1
            self._stats.bytes_written += self.fmt.payload_bytes

    # ---------------------------------------------------------------------------- plumbing

    def _path(self, key: str) -> str:
        parts = [key[2 * level:2 * level + 2] for level in range(self.fanout)]
        return os.path.join(self.root_dir, *parts, key)

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed or self._executor is None:
            raise ClosedError("storage: the FileBackend is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args))

    async def _start(self) -> None:
        """Build the index from the directory, once, on an I/O thread.

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
            found = await self._in_thread(_scan_dir, self.root_dir, self.fanout, time.time())
        except OSError as exc:
            raise StorageError(f"storage: cannot open the file store {self.root_dir}: "
                               f"{exc}") from exc
        for _, key, size in sorted(found.objects):
            self._budget.add(key, size)
        victims = self._budget.trim()
        if victims:
            await self._in_thread(_unlink_all, [self._path(key) for key in victims])
        self._stats.evicted_pages += len(victims)
        self._stats.extra["temps_removed"] = found.temps_removed
        logger.info("storage: %s holds %d objects (%d bytes); removed %d stale temp files",
                    self.root_dir, len(self._budget), self._budget.used_bytes,
                    found.temps_removed)

    def _raise_failed(self, failed: list[BaseException], error: type[StorageError],
                      what: str) -> None:
        if self._closed:
            raise ClosedError("storage: the FileBackend was closed during the call")
        if failed:
            self._stats.errors += len(failed)
            raise error(f"storage: {len(failed)} page(s) failed to {what} under "
                        f"{self.root_dir}: {failed[0]}") from failed[0]


# -------------------------------------------------------------- on the I/O threads (blocking)

@dataclass(slots=True, kw_only=True)
class _Store:
    """Write `key`'s object atomically: temp file in the target directory, then `os.replace`.

    NOTE: no directory is assumed to exist, not even one this backend made: the store may
    be removed while it runs (an operator's ``rm -rf``, a shared directory cleaned by
    another host). The temp file is opened first, and only if its directory is missing are
    the directories (re)made, so an existing directory costs no extra system call.
    """

    key: str
    path: str
    fmt: PageFormat
    payload: memoryview
    fsync: bool

    def run(self) -> None:
        header = encode_header(self.fmt, self.key, self.payload)
        tmp = f"{self.path}.{secrets.token_hex(6)}.tmp"
        try:
            with _create(tmp) as f:
                f.write(header)
                f.write(self.payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(os.path.dirname(self.path))


def _create(path: str) -> BinaryIO:
    """A new file at `path`, opened for writing; its directories are made if missing."""
    try:
        return open(path, "xb")
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "xb")


def _store_run(evict: list[str], jobs: list[_Store]) -> list[OSError | None]:
    """Delete the evicted objects, then store each job's object; an error per job or None."""
    _unlink_all(evict)
    errors: list[OSError | None] = []
    for job in jobs:
        try:
            job.run()
            errors.append(None)
        except OSError as exc:
            errors.append(exc)
    return errors


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Outcome(enum.Enum):
    FILLED = "filled"
    MISSING = "missing"
    CORRUPT = "corrupt"
    """Rejected by `decode_page` (damaged, or another key's file copied or renamed over
    it), and deleted."""


def _load_run(keys: list[str], paths: list[str], fmt: PageFormat, staging: bytearray,
              dests: list[memoryview]) -> list[_Outcome | OSError]:
    """`_load` each key's path into its destination, one after another; an error per page."""
    outcomes: list[_Outcome | OSError] = []
    for key, path, dest in zip(keys, paths, dests, strict=True):
        try:
            outcomes.append(_load(key, path, fmt, staging, dest))
        except OSError as exc:
            outcomes.append(exc)
    return outcomes


def _load(key: str, path: str, fmt: PageFormat, staging: bytearray,
          dest: memoryview) -> _Outcome:
    """Read `key`'s object at `path` into `staging` (one byte longer than an object, so a
    longer file shows), verify it is `key`'s, and copy its payload into `dest` only if it is
    good."""
    view = memoryview(staging)
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while got < len(view) and (n := f.readinto(view[got:])):
                got += n
    except FileNotFoundError:
        return _Outcome.MISSING
    payload = decode_page(fmt, key, view[:got])
    if payload is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return _Outcome.CORRUPT
    # numpy copies without the GIL (a memoryview slice assignment holds it: loop lag)
    np.frombuffer(dest, np.uint8)[:] = np.frombuffer(payload, np.uint8)
    with contextlib.suppress(OSError):
        os.utime(path)  # the file's mtime is its last access: LRU order survives a restart
    return _Outcome.FILLED


def _leading_sizes(paths: Sequence[str]) -> list[int]:
    """Object sizes of the leading `paths` that exist (stops at the first missing)."""
    sizes = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except FileNotFoundError:
            break
    return sizes


def _unlink_all(paths: Sequence[str]) -> int:
    """Delete `paths`; return how many existed."""
    found = 0
    for path in paths:
        try:
            os.unlink(path)
            found += 1
        except FileNotFoundError:
            pass
    return found


@dataclass(slots=True)
class _Found:
    objects: list[tuple[float, str, int]] = field(default_factory=list)
    """(mtime, key, size) of every object in its right place."""
    temps_removed: int = 0


def _scan_dir(root: str, fanout: int, now: float) -> _Found:
    """Every object under `root`; removes temp files older than `STALE_TEMP_S`."""
    os.makedirs(root, exist_ok=True)
    found = _Found()
    _scan_level(root, "", fanout, now, found)
    return found


def _scan_level(directory: str, prefix: str, depth: int, now: float, found: _Found) -> None:
    # NOTE: only the fan-out tree is walked, and a key counts only in the directory its
    # name maps to: a file elsewhere would never be looked up, so it must not be budgeted.
    with os.scandir(directory) as entries:
        for entry in entries:
            if depth and _FANOUT_DIR.fullmatch(entry.name) and entry.is_dir(
                    follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    _scan_level(entry.path, prefix + entry.name, depth - 1, now, found)
            elif not depth and entry.is_file(follow_symlinks=False):
                _scan_file(entry, prefix, now, found)


def _scan_file(entry: os.DirEntry[str], prefix: str, now: float, found: _Found) -> None:
    name = entry.name
    try:
        st = entry.stat(follow_symlinks=False)
        if _TEMP.fullmatch(name):
            if now - st.st_mtime > STALE_TEMP_S:
                os.unlink(entry.path)
                found.temps_removed += 1
        elif name.startswith(prefix) and KEY_PATTERN.fullmatch(name):
            found.objects.append((st.st_mtime, name, st.st_size))
    except FileNotFoundError:
        pass  # another instance removed it meanwhile
