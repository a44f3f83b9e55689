"""Appending to the file store: this instance's active segments, runs of pages, compaction.

Blocking I/O only (called on I/O threads). The layout and why it is crash-safe: `_journal`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import struct
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ClosedError
from . import _native
from ._journal import ENTRY_SIZE, PUT, TOUCH, Entry, read_log_since, segment_path
from .base import HEADER_SIZE, PageFormat, encode_header, key_id, pack_header

__all__ = ("Appender", "Locked", "compact", "lock_segment", "write_run")

Locked = tuple[list[Entry], list[Entry]]
"""A locked victim's journal: every entry, and those its compactor had not read."""


@dataclass(slots=True, eq=False)
class _Lane:
    """A segment this instance appends to: its locked fd, its journal, its end."""

    seg_id: int
    seg_fd: int
    log_fd: int
    end: int = 0
    busy: bool = False
    """A thread is appending to it (between `Appender.reserve` and `Appender.release`)."""
    sealed: bool = False
    """No more appends: closed once it is not busy."""
    logged: bool = False
    log_bytes: int = 0
    """Bytes of whole entries in its journal (what a failed append is cut back to)."""
    touch_bytes: int = 0
    """Bytes of touch entries in its journal."""


class Appender:
    """This instance's active segments ("lanes"); each I/O thread appends to one of its own.

    NOTE: buffered writes to one file are serialised by the kernel (the inode lock), so I/O
    threads sharing one active segment took turns; a thread that writes takes an idle lane (a
    segment no other thread appends to meanwhile, made if none is idle), so writes run in
    parallel. There are at most as many lanes as threads that ever wrote at once.

    Thread-safe: `reserve` and `release` take a lock only to pick a lane and roll segments (a
    few system calls when a segment fills); the data is written outside it.
    """

    def __init__(self, root: str, *, segment_bytes: int, fsync: bool) -> None:
        self.root = root
        self.segment_bytes = segment_bytes
        self.touch_limit = max(segment_bytes // 16, 1 << 20)
        """A lane whose journal holds this many bytes of touches is rolled. NOTE: a
        read-mostly store journals touches and few records, so its active segment never
        filled and its journal grew without end (176 bytes a page read)."""
        self.fsync = fsync
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self.created: set[int] = set()
        """Every segment this appender made (its journals need not be read back)."""
        self._emptied: list[int] = []
        """Segments rolled holding journal entries and no record (see `take_emptied`)."""
        self._held: Counter[int] = Counter()
        """Segment id -> runs written (or copied) into it that the loop has not bound yet
        (see `unhold`)."""
        self.closed = False
        """`shut` ran: no lane is made or handed out again."""

    def created_ids(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self.created)

    def take_emptied(self) -> list[int]:
        """The segments sealed since the last call that hold no record, only a journal
        (touches, deletes): garbage for the compactor once their entries are carried."""
        with self._lock:
            emptied, self._emptied = self._emptied, []
            return emptied

    def active_ids(self) -> frozenset[int]:
        """The segments this instance may still append to, or holding records it has not
        bound yet (never compacted by it)."""
        with self._lock:
            return frozenset(lane.seg_id for lane in self._lanes).union(self._held)

    def unhold(self, seg_ids: Iterable[int]) -> None:
        """The loop bound the records of a run `reserve`d with `hold` into each segment of
        `seg_ids` (one per run), or gave them up.

        NOTE: a lane can be rolled (sealed) by another thread between a run's journal append
        and the loop binding its entries; compacted from the index meanwhile, the segment
        went with records the index did not know of yet (pages lost, found by a stress).
        """
        with self._lock:
            self._held.subtract(seg_ids)
            self._held = +self._held  # NOTE: drops the counts at zero

    def reserve(self, nbytes: int, *, hold: bool = False) -> tuple[_Lane, int]:
        """An idle lane with room for `nbytes` (rolled first if it is full, or if its file was
        removed) and the offset reserved in it; only the caller appends to it until
        `release`. `hold`: the segment is not compacted here until `unhold`."""
        with self._lock:
            if self.closed:  # NOTE: a lane made now was never closed (its fds, its lock)
                raise ClosedError(f"storage: the file store under {self.root} is closed")
            lane = next((lane for lane in self._lanes if not lane.busy), None)
            if lane is None or os.fstat(lane.seg_fd).st_nlink == 0 or (
                    lane.end and lane.end + nbytes > self.segment_bytes) or \
                    lane.touch_bytes >= self.touch_limit:
                lane = self._roll(lane)
            lane.busy = True
            offset = lane.end
            lane.end += nbytes
            if hold:
                self._held[lane.seg_id] += 1
            return lane, offset

    def release(self, lane: _Lane, entries: Sequence[Entry]) -> None:
        """Journal `entries` (records written into `lane`), then give the lane back."""
        try:
            if entries:
                self._append(lane, entries)
        except BaseException:
            with self._lock:  # NOTE: no more appends after a failed one (see _append)
                lane.sealed = True
                if lane in self._lanes:
                    self._lanes.remove(lane)
            raise
        finally:
            with self._lock:
                lane.busy = False
                if lane.sealed:
                    _close_segment(lane)

    def log(self, entries: Sequence[Entry]) -> None:
        """Journal entries that write no record (deletes, touches, moves)."""
        if not entries:
            return
        lane, _ = self.reserve(0)
        # NOTE: touches only: a compaction carries the deletes that still win, which then
        # must not roll the lane again (the next compaction would carry them again)
        lane.touch_bytes += ENTRY_SIZE * sum(entry.kind == TOUCH for entry in entries)
        self.release(lane, entries)  # the lane is ours until then

    def shut(self) -> None:
        """`close` for good: no lane is handed out (nor made) after it. NOTE: a run still
        queued when the store closed made a lane after `close`, never closed (its files
        open, its segment locked for the life of the process)."""
        with self._lock:
            self.closed = True
        self.close()

    def close(self) -> None:
        """Seal every lane (each then is lock-free: compactable); an unused one is removed."""
        with self._lock:
            lanes, self._lanes = self._lanes, []
            for lane in lanes:
                lane.sealed = True
                if not lane.busy:
                    _close_segment(lane, remove_if_unused=True, root=self.root)

    def _roll(self, old: _Lane | None) -> _Lane:
        new = _create_segment(self.root)
        self.created.add(new.seg_id)
        if old is not None:
            old.sealed = True
            self._lanes.remove(old)
            if not old.end and old.logged and os.fstat(old.seg_fd).st_nlink:  # not removed
                self._emptied.append(old.seg_id)
            _close_segment(old)  # idle: nobody appends to it
        self._lanes.append(new)
        return new

    def _append(self, lane: _Lane, entries: Sequence[Entry]) -> None:
        data = b"".join(entry.pack() for entry in entries)
        written = os.write(lane.log_fd, data)  # O_APPEND: one write lands whole at the end
        if written != len(data):
            # NOTE: a disk that filled up mid-write leaves part of an entry: every entry
            # after it would sit off the entry grid, unreadable. Cut it back (the entries
            # of this call are not journaled, as the caller is told); the lane is sealed
            # either way, so nothing is appended after a part that stays.
            with contextlib.suppress(OSError):
                os.ftruncate(lane.log_fd, lane.log_bytes)
            raise OSError(errno.ENOSPC, f"journal write was short ({written} of {len(data)} "
                          "bytes)")
        lane.log_bytes += written
        lane.logged = True
        if self.fsync:
            os.fsync(lane.log_fd)


def _create_segment(root: str) -> _Lane:
    """A new locked segment and its journal; the directory is (re)made if missing.

    NOTE: the segment is created under a temp name and locked before it is renamed, so a
    scanner never sees an unlocked segment without a journal that is not an orphan. Another
    instance starting up may take the temp file for a dead writer's and remove it before
    the lock is taken: then another is made.
    """
    for _ in range(_CREATE_TRIES):
        lane = _try_create_segment(root)
        if lane is not None:
            return lane
    raise OSError(errno.EAGAIN, f"cannot create a segment under {root}: removed as an orphan "
                  f"while being made, {_CREATE_TRIES} times")


_CREATE_TRIES = 3


def _try_create_segment(root: str) -> _Lane | None:
    seg_id = secrets.randbits(63)
    tmp = segment_path(root, seg_id, "seg.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:
        os.makedirs(root, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits out a scanner's probe of the lock
        if os.fstat(fd).st_nlink == 0:  # removed as an orphan before it was locked
            os.close(fd)
            return None
        try:
            os.rename(tmp, segment_path(root, seg_id))
        except FileNotFoundError:  # removed by a scanner that probed before the lock
            os.close(fd)
            return None
        log_fd = os.open(segment_path(root, seg_id, "log"),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return _Lane(seg_id, fd, log_fd)


def _close_segment(lane: _Lane, *, remove_if_unused: bool = False, root: str = "") -> None:
    if remove_if_unused and not lane.end and not lane.logged:
        for suffix in ("log", "seg"):
            with contextlib.suppress(OSError):
                os.unlink(segment_path(root, lane.seg_id, suffix))
    os.close(lane.log_fd)
    os.close(lane.seg_fd)  # releases the lock: the segment is sealed


def write_run(appender: Appender, fmt: PageFormat, keys: Sequence[str],
              payloads: Sequence[memoryview], stamps: Sequence[int],
              deletes: Sequence[Entry]) -> list[Entry]:
    """Append one object per key as one write, then journal `deletes` and the new records.

    Returns:
        The PUT entry of each key, in order; their segment is held (`Appender.unhold`
        once they are bound).

    Raises:
        OSError: nothing of the run was journaled (its records, if any landed, are dead).
    """
    size = HEADER_SIZE + fmt.payload_bytes
    # NOTE: the headers are made before a lane is taken, so no other thread waits for a
    # lane while this one hashes
    headers = encode_headers(fmt, keys, payloads)
    lane, offset = appender.reserve(size * len(keys), hold=bool(keys))
    entries: list[Entry] = []
    try:
        try:
            if keys:
                iov = [part for pair in zip(headers, payloads, strict=True) for part in pair]
                _pwritev_all(lane.seg_fd, iov, offset)
                if appender.fsync:
                    os.fdatasync(lane.seg_fd)
            origin = (lane.seg_id & 0xFFFFFFFF) or 1
            entries = [Entry(key, PUT, lane.seg_id, offset + i * size, size, stamp, origin)
                       for i, (key, stamp) in enumerate(zip(keys, stamps, strict=True))]
        finally:
            appender.release(lane, [*deletes, *entries])
    except BaseException:
        if keys:  # nothing to bind
            appender.unhold([lane.seg_id])
        raise
    return entries


def encode_headers(fmt: PageFormat, keys: Sequence[str],
                   payloads: Sequence[memoryview]) -> list[bytes]:
    """`encode_header` of each payload under its key; the payloads hashed in one native call
    with the GIL let go where the native module is usable (xxhash's own binding holds the
    GIL for payloads up to 64 KiB: the I/O threads then took turns hashing)."""
    if _native.CHECKSUMS is None or not keys:
        return [encode_header(fmt, key, payload)
                for key, payload in zip(keys, payloads, strict=True)]
    kids = [key_id(key) for key in keys]
    values = struct.unpack(f"<{len(keys)}Q", _native.CHECKSUMS(b"".join(kids), payloads))
    return [pack_header(fmt, value, kid) for value, kid in zip(values, kids, strict=True)]


def _pwritev_all(fd: int, iov: list[bytes | memoryview], offset: int) -> None:
    total = sum(len(part) for part in iov)
    done = os.pwritev(fd, iov, offset)
    if done == total:
        return
    flat = memoryview(b"".join(bytes(part) for part in iov))  # a short write: rare, slow path
    while done < total:
        done += os.pwrite(fd, flat[done:], offset + done)


def lock_segment(root: str, seg_id: int, known: int) -> tuple[int, Locked] | None:
    """Lock a sealed segment for compaction: its open fd (holding the lock; the caller
    closes it) and its journal, read under the lock (its writer is done with both): every
    entry, and those past byte `known` (what the caller has not read).

    Returns None if the segment is gone (removed by another process's compaction, even
    between the open and the lock) or another process holds its lock (it is compacting it,
    or still writing it).
    """
    try:
        fd = os.open(segment_path(root, seg_id), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink == 0:  # compacted and removed after our open
            os.close(fd)
            return None
        return fd, read_log_since(root, seg_id, known)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise


def compact(appender: Appender, fd: int, victim: int, moves: Sequence[Entry],
            keep: Sequence[Entry]) -> tuple[list[Entry], list[int]]:
    """Copy the live records `moves` (all in segment `victim`, open and locked as `fd`) into
    an active segment, journal them and `keep` (the victim journal's winning entries that
    point elsewhere), then remove the victim's journal and segment.

    Returns:
        The new entries of `moves` (same keys and stamps, new places), and the segments
        held for them (`Appender.unhold` once they are re-pointed).
    """
    held: list[int] = []
    try:
        moved = _copy_records(appender, fd, moves, held)
        appender.log(keep)
        for suffix in ("log", "seg"):  # the journal first: a segment alone is an orphan
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(appender.root, victim, suffix))
    except BaseException:
        appender.unhold(held)  # nothing will be re-pointed
        raise
    return moved, held


def _copy_records(appender: Appender, fd: int, moves: Sequence[Entry],
                  held: list[int]) -> list[Entry]:
    moved: list[Entry] = []
    chunk = 32
    for lo in range(0, len(moves), chunk):
        group = moves[lo:lo + chunk]
        blobs = [os.pread(fd, entry.length, entry.offset) for entry in group]
        lane, offset = appender.reserve(sum(len(blob) for blob in blobs), hold=True)
        held.append(lane.seg_id)
        entries: list[Entry] = []
        try:
            _pwritev_all(lane.seg_fd, list(blobs), offset)
            if appender.fsync:  # the copies are durable before the victim goes
                os.fdatasync(lane.seg_fd)
            for entry, blob in zip(group, blobs, strict=True):
                entries.append(entry._replace(seg_id=lane.seg_id, offset=offset,
                                              length=len(blob), moves=entry.moves + 1))
                offset += len(blob)
        finally:
            appender.release(lane, entries)
        moved += entries
    return moved
