"""The file store on disk: append-only segment files and their journals (blocking I/O only).

Layout of a store directory::

    <id>.seg       page objects (64-byte header + payload, see base.py) back to back, as
                   one writer appended them; that writer holds an exclusive ``flock`` on it
                   while it may still append (a lock-free segment is sealed, or its writer died)
    <id>.log       the journal of that writer: fixed-size entries, each binding a key to a
                   record (segment id, offset, length) or deleting it, stamped with a time
    <id>.seg.tmp   a segment being created (renamed to .seg once locked)

The journals are the index: the entry with the latest stamp wins for each key, wherever it
was written, so any process can bind, re-bind or delete any key by appending to its own
journal. Nothing here is trusted for correctness: every record is verified by `decode_page`
under the key it is read for, so a torn record, a torn or forged entry, or an entry pointing
at another key's record is a miss, never wrong KV. An entry is written only after its record
(and, with fsync, after the record is durable), so a crash mid-write leaves an unreferenced
tail, never a served torn page.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np
import xxhash

from .base import HEADER_SIZE, PageFormat, decode_page, encode_header

__all__ = ("DELETE", "ENTRY_SIZE", "PUT", "Appender", "Entry", "JournalScan", "Outcome",
           "SegmentMaps", "compact", "read_journals", "read_log", "read_run", "remove_orphans",
           "segment_path", "write_run")

PUT: Final = 1
DELETE: Final = 2

_ENTRY = struct.Struct("<4sBBHQQIIQ128s")
_CHECK = struct.Struct("<Q")
ENTRY_SIZE: Final = _ENTRY.size + _CHECK.size
"""Bytes of one journal entry (176): fields, then an xxh3-64 of the fields."""
_MAGIC: Final = b"AHJ1"
_SEGMENT = re.compile(r"([0-9a-f]{16})\.(seg|log)")
_TEMP = re.compile(r"[0-9a-f]{16}\.seg\.tmp")


class Entry(NamedTuple):
    """One journal entry: `key` is bound to a record (PUT) or unbound (DELETE, whose
    location names the record it killed)."""

    key: str
    kind: int
    seg_id: int
    offset: int
    length: int
    stamp: int
    """Nanoseconds since the epoch; the latest stamp for a key wins."""

    def pack(self) -> bytes:
        fields = _ENTRY.pack(_MAGIC, self.kind, len(self.key), 0, self.seg_id, self.offset,
                             self.length, 0, self.stamp, self.key.encode("ascii"))
        return fields + _CHECK.pack(xxhash.xxh3_64_intdigest(fields))


def unpack_entries(data: bytes | memoryview) -> list[Entry]:
    """The valid entries of `data`, a journal's bytes (a partial last entry is ignored, so is
    any entry whose check fails: a torn write, a flipped bit)."""
    out: list[Entry] = []
    view = memoryview(data)
    for pos in range(0, len(view) - ENTRY_SIZE + 1, ENTRY_SIZE):
        fields = view[pos:pos + _ENTRY.size]
        (check,) = _CHECK.unpack_from(view, pos + _ENTRY.size)
        if xxhash.xxh3_64_intdigest(fields) != check:
            continue
        magic, kind, key_len, _, seg_id, offset, length, _, stamp, key = _ENTRY.unpack(fields)
        if magic == _MAGIC and kind in (PUT, DELETE) and 16 <= key_len <= 128:
            out.append(Entry(key[:key_len].decode("ascii", "replace"), kind, seg_id, offset,
                             length, stamp))
    return out


def segment_path(root: str, seg_id: int, suffix: str = "seg") -> str:
    return os.path.join(root, f"{seg_id:016x}.{suffix}")


# ---------------------------------------------------------------------------- writing

@dataclass(slots=True, eq=False)
class _Active:
    """A segment this instance appends to: its locked fd, its journal, the bytes reserved."""

    seg_id: int
    seg_fd: int
    log_fd: int
    end: int = 0
    pending: int = 0
    """Writes reserved in it and not yet journaled (it closes when sealed and none remain)."""
    sealed: bool = False
    logged: bool = False


class Appender:
    """This instance's active segment; I/O threads reserve ranges of it and journal them.

    Thread-safe: `reserve`, `release` and `log` take a lock only to move offsets and roll
    segments (a few system calls, when a segment fills); the data is written outside it, by
    each thread into its own reserved range.
    """

    def __init__(self, root: str, *, segment_bytes: int, fsync: bool) -> None:
        self.root = root
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._active: _Active | None = None
        self.created: set[int] = set()
        """Every segment this appender made (its journals need not be read back)."""

    def created_ids(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self.created)

    @property
    def active_id(self) -> int | None:
        active = self._active
        return None if active is None else active.seg_id

    def reserve(self, nbytes: int) -> tuple[_Active, int]:
        """A range of `nbytes` in the active segment (rolled first if it is full, or if its
        file was removed); pair it with `release`."""
        with self._lock:
            active = self._current()
            if active.end and active.end + nbytes > self.segment_bytes:
                active = self._roll(active)
            offset = active.end
            active.end += nbytes
            active.pending += 1
            return active, offset

    def release(self, segment: _Active, entries: Sequence[Entry]) -> None:
        """Journal `entries` (records written into `segment`), then end the reservation."""
        try:
            if entries:
                self._append(segment, entries)
        finally:
            with self._lock:
                segment.pending -= 1
                if segment.sealed and not segment.pending:
                    _close_segment(segment)

    def log(self, entries: Sequence[Entry]) -> None:
        """Journal entries that write no record (deletes, touches, moves)."""
        if not entries:
            return
        segment, _ = self.reserve(0)
        self.release(segment, entries)

    def close(self) -> None:
        """Seal the active segment (it then is lock-free: compactable); an unused one is
        removed."""
        with self._lock:
            active, self._active = self._active, None
            if active is not None:
                active.sealed = True
                if not active.pending:
                    _close_segment(active, remove_if_unused=True, root=self.root)

    def _current(self) -> _Active:
        active = self._active
        if active is None or os.fstat(active.seg_fd).st_nlink == 0:  # first, or removed
            active = self._roll(active)
        return active

    def _roll(self, old: _Active | None) -> _Active:
        new = _create_segment(self.root)
        self.created.add(new.seg_id)
        if old is not None:
            old.sealed = True
            if not old.pending:
                _close_segment(old)
        self._active = new
        return new

    def _append(self, segment: _Active, entries: Sequence[Entry]) -> None:
        data = b"".join(entry.pack() for entry in entries)
        written = os.write(segment.log_fd, data)  # O_APPEND: one write lands whole at the end
        if written != len(data):
            raise OSError(errno.EIO, f"journal write was short ({written} of {len(data)})")
        segment.logged = True
        if self.fsync:
            os.fsync(segment.log_fd)


def _create_segment(root: str) -> _Active:
    """A new locked segment and its journal; the directory is (re)made if missing.

    NOTE: the segment is created under a temp name and locked before it is renamed, so a
    scanner never sees an unlocked segment without a journal that is not an orphan.
    """
    seg_id = secrets.randbits(63)
    tmp = segment_path(root, seg_id, "seg.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:
        os.makedirs(root, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, segment_path(root, seg_id))
        log_fd = os.open(segment_path(root, seg_id, "log"),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return _Active(seg_id, fd, log_fd)


def _close_segment(segment: _Active, *, remove_if_unused: bool = False,
                   root: str = "") -> None:
    if remove_if_unused and not segment.end and not segment.logged:
        for suffix in ("log", "seg"):
            with contextlib.suppress(OSError):
                os.unlink(segment_path(root, segment.seg_id, suffix))
    os.close(segment.log_fd)
    os.close(segment.seg_fd)  # releases the lock: the segment is sealed


def write_run(appender: Appender, fmt: PageFormat, keys: Sequence[str],
              payloads: Sequence[memoryview], stamps: Sequence[int],
              deletes: Sequence[Entry]) -> list[Entry]:
    """Append one object per key as one write, then journal `deletes` and the new records.

    Returns:
        The PUT entry of each key, in order.

    Raises:
        OSError: nothing of the run was journaled (its records, if any landed, are dead).
    """
    size = _object_size(fmt)
    headers = [encode_header(fmt, key, payload) for key, payload in zip(keys, payloads,
                                                                            strict=True)]
    segment, offset = appender.reserve(size * len(keys))
    entries: list[Entry] = []
    try:
        if keys:
            iov = [part for pair in zip(headers, payloads, strict=True) for part in pair]
            _pwritev_all(segment.seg_fd, iov, offset)
            if appender.fsync:
                os.fdatasync(segment.seg_fd)
        entries = [Entry(key, PUT, segment.seg_id, offset + i * size, size, stamp)
                   for i, (key, stamp) in enumerate(zip(keys, stamps, strict=True))]
    finally:
        appender.release(segment, [*deletes, *entries])
    return entries


def _pwritev_all(fd: int, iov: list[bytes | memoryview], offset: int) -> None:
    total = sum(len(part) for part in iov)
    done = os.pwritev(fd, iov, offset)
    if done == total:
        return
    flat = memoryview(b"".join(bytes(part) for part in iov))  # a short write: rare, slow path
    while done < total:
        done += os.pwrite(fd, flat[done:], offset + done)


def _object_size(fmt: PageFormat) -> int:
    return HEADER_SIZE + fmt.payload_bytes


# ---------------------------------------------------------------------------- reading

class Outcome:
    """What reading one key did (module-level constants, compared by identity)."""

    FILLED: Final = "filled"
    MISSING: Final = "missing"
    """Its segment is gone (compacted, or the store removed)."""
    CORRUPT: Final = "corrupt"
    """Rejected by `decode_page`: damaged, torn, of another format, or another key's."""


class SegmentMaps:
    """Read-only maps of segments, shared by the I/O threads that read records.

    NOTE: a record is checked and copied straight out of the page cache through a map: one
    copy, as a ``read`` makes, instead of a read into a staging buffer and a second copy out
    of it (which halved large-page reads). A missed buffer is still never written: only a
    verified payload is copied. A segment is only appended to, never truncated, and a map
    covers no more than its file's size when mapped (a record past it is remapped, or torn:
    a miss); a file truncated by hand while mapped would fault (SIGBUS), so nothing here
    truncates. At most `limit` segments stay mapped (least recently used dropped); a
    removed segment (compacted, or the store removed) is dropped when a read finds it gone,
    so its disk space is not held.
    """

    def __init__(self, root: str, limit: int = 64) -> None:
        self.root = root
        self.limit = limit
        self._lock = threading.Lock()
        self._maps: OrderedDict[int, _Map] = OrderedDict()

    def get(self, seg_id: int, end: int, *, check: bool) -> _Map | None:
        """A map of segment `seg_id` covering at least ``[0, end)`` if the file holds it
        (else as much as it holds); None if the segment is gone. With `check`, a map kept
        from before is first checked to still name a linked file (one ``fstat``).

        NOTE: the lock is held over these few system calls (never over reads of the data),
        so no thread can close an fd another is about to ``fstat`` (a reused fd number
        would name another file).
        """
        with self._lock:
            held = self._maps.get(seg_id)
            if held is None:
                return self._open(seg_id)
            self._maps.move_to_end(seg_id)
            if check or len(held.view) < end:
                st = os.fstat(held.fd)
                if st.st_nlink == 0:
                    self._drop(seg_id)
                    return None
                if len(held.view) < end and st.st_size > len(held.view):
                    held = self._remap(seg_id, held.fd)
            return held

    def drop(self, seg_id: int) -> None:
        """Forget segment `seg_id`'s map (unmapped once no read uses it)."""
        with self._lock:
            self._drop(seg_id)

    def close(self) -> None:
        with self._lock:
            for seg_id in list(self._maps):
                self._drop(seg_id)

    def _drop(self, seg_id: int) -> None:
        held = self._maps.pop(seg_id, None)
        if held is not None:
            os.close(held.fd)

    def _open(self, seg_id: int) -> _Map | None:
        try:
            fd = os.open(segment_path(self.root, seg_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_nlink == 0:  # removed while we opened it
                os.close(fd)
                return None
            return self._remap(seg_id, fd)
        except BaseException:
            os.close(fd)
            raise

    def _remap(self, seg_id: int, fd: int) -> _Map:
        """Map the whole file `fd` as segment `seg_id` (the map it replaces is unmapped when
        the reads still using it drop their views)."""
        size = os.fstat(fd).st_size
        # an empty file cannot be mapped: nothing in it can be read anyway
        data: mmap.mmap | bytes = (mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                             prot=mmap.PROT_READ) if size else b"")
        view = memoryview(data)
        held = _Map(fd, view, np.frombuffer(view, np.uint8).ctypes.data if size else 0)
        self._maps[seg_id] = held
        self._maps.move_to_end(seg_id)
        while len(self._maps) > self.limit:
            os.close(self._maps.popitem(last=False)[1].fd)
        return held


@dataclass(slots=True, frozen=True)
class _Map:
    fd: int
    view: memoryview
    address: int
    """Where the map starts in memory (0 for an empty file)."""

    def resident(self, lo: int, hi: int) -> bool:
        """Whether bytes ``[lo, hi)`` of the segment are all in the page cache (``mincore``),
        so reading them through the map does no disk I/O."""
        if hi > len(self.view) or not self.address:
            return False
        first = lo - lo % _PAGE
        pages = -(-(hi - first) // _PAGE)
        vec = ctypes.create_string_buffer(pages)
        if _mincore(self.address + first, hi - first, vec) != 0:
            return False
        return vec.raw.find(0) < 0


def _load_mincore() -> Callable[[int, int, ctypes.Array[ctypes.c_char]], int]:
    fn = ctypes.CDLL(None, use_errno=True).mincore
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    fn.restype = ctypes.c_int
    return fn


_mincore = _load_mincore()
_PAGE: Final = mmap.PAGESIZE
_local = threading.local()


def read_run(maps: SegmentMaps, fmt: PageFormat, keys: Sequence[str],
             entries: Sequence[Entry], dests: Sequence[memoryview]) -> list[str | OSError]:
    """Verify each key's record and copy its payload into its destination only if it is
    good.

    Records adjacent in a segment and all in the page cache are checked and copied where they
    lie, through the segment's map (one copy, as a ``read`` makes). Others are read with
    ``preadv`` into a staging buffer first: a disk error then is an `OSError` (through a map,
    it would be a SIGBUS), and the kernel's read-ahead serves the rest of the run.

    Returns:
        An `Outcome` constant per key, or the `OSError` reading it raised.
    """
    size = _object_size(fmt)
    outcomes: list[str | OSError] = [Outcome.CORRUPT] * len(keys)
    maps_seen: dict[int, _Map | None] = {}
    for span in _spans(entries, size):
        first, last = entries[span[0]], entries[span[-1]]
        if first.length != size:
            continue  # not one object: rejected unread (CORRUPT)
        lo, hi = first.offset, last.offset + size
        seen = first.seg_id in maps_seen
        held = maps_seen.get(first.seg_id)
        try:
            if not seen or (held is not None and len(held.view) < hi):
                held = maps_seen[first.seg_id] = maps.get(first.seg_id, hi, check=not seen)
            if held is None:
                for i in span:
                    outcomes[i] = Outcome.MISSING
                continue
            if held.resident(lo, hi):
                for i in span:
                    offset = entries[i].offset
                    outcomes[i] = _verified_copy(fmt, keys[i], held.view[offset:offset + size],
                                                 dests[i])
            else:
                staging = _staging(size)
                for i in span:
                    got = os.preadv(held.fd, [staging], entries[i].offset)
                    outcomes[i] = _verified_copy(fmt, keys[i], staging[:got], dests[i])
        except (OSError, ValueError) as exc:  # ValueError: mmap refused the file
            error = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
            for i in span:
                if outcomes[i] is Outcome.CORRUPT:
                    outcomes[i] = error
    return outcomes


def _spans(entries: Sequence[Entry], size: int) -> list[list[int]]:
    """Indices of `entries` grouped into runs of whole, adjacent records of one segment.

    An entry whose length is not one object is its own span (it is rejected unread).
    """
    spans: list[list[int]] = []
    prev: Entry | None = None
    for i, entry in enumerate(entries):
        if (prev is not None and entry.length == size and prev.length == size
                and entry.seg_id == prev.seg_id and entry.offset == prev.offset + size):
            spans[-1].append(i)
        else:
            spans.append([i])
        prev = entry
    return spans


def _staging(size: int) -> memoryview:
    """This thread's staging buffer for one record (reused: a fresh one faults per 4 KiB)."""
    buf: memoryview | None = getattr(_local, "staging", None)
    if buf is None or len(buf) != size:
        buf = _local.staging = memoryview(bytearray(size))
    return buf


def _verified_copy(fmt: PageFormat, key: str, record: memoryview, dest: memoryview) -> str:
    payload = decode_page(fmt, key, record)
    if payload is None:
        return Outcome.CORRUPT
    # numpy copies without the GIL (a memoryview slice assignment holds it: loop lag)
    np.frombuffer(dest, np.uint8)[:] = np.frombuffer(payload, np.uint8)
    return Outcome.FILLED


# ---------------------------------------------------------------------------- the index

@dataclass(slots=True)
class JournalScan:
    """What `read_journals` found: new entries per journal and the segments present."""

    entries: list[tuple[int, list[Entry]]] = field(default_factory=list)
    """(journal id, its entries past what was read before), oldest journal content first."""
    read_to: dict[int, int] = field(default_factory=dict)
    """Journal id -> bytes read so far (whole entries only)."""
    segments: dict[int, int] = field(default_factory=dict)
    """Segment id -> file size, for every segment present."""


def read_journals(root: str, read_to: dict[int, int],
                  skip: frozenset[int] = frozenset()) -> JournalScan:
    """Every journal's entries past `read_to` (journal id -> bytes read before; a journal
    not in it is read whole), but those in `skip` (this instance's own), and the size of
    every segment.

    Raises:
        OSError: the directory cannot be listed (a missing one is made).
    """
    os.makedirs(root, exist_ok=True)
    scan = JournalScan()
    logs: list[int] = []
    with os.scandir(root) as entries:
        for entry in entries:
            match = _SEGMENT.fullmatch(entry.name)
            if match is None:
                continue
            seg_id = int(match.group(1), 16)
            if match.group(2) == "log":
                logs.append(seg_id)
            else:
                with contextlib.suppress(FileNotFoundError):
                    scan.segments[seg_id] = entry.stat().st_size
    for log_id in logs:
        if log_id in skip:
            scan.read_to[log_id] = read_to.get(log_id, 0)
            continue
        start = read_to.get(log_id, 0)
        data = _read_from(segment_path(root, log_id, "log"), start)
        if data is None:
            continue  # removed meanwhile
        whole = len(data) - len(data) % ENTRY_SIZE
        scan.read_to[log_id] = start + whole
        if whole:
            scan.entries.append((log_id, unpack_entries(memoryview(data)[:whole])))
    return scan


def read_log(root: str, log_id: int) -> list[Entry]:
    """The valid entries of one journal (none if it is gone)."""
    data = _read_from(segment_path(root, log_id, "log"), 0)
    if data is None:
        return []
    return unpack_entries(memoryview(data)[:len(data) - len(data) % ENTRY_SIZE])


def _read_from(path: str, start: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read()
    except FileNotFoundError:
        return None


def is_locked(path: str) -> bool:
    """Whether some open file holds a lock on `path` (its writer is alive); False if absent."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_orphans(root: str, segments: Iterable[int], journals: Iterable[int]) -> int:
    """Remove lock-free segments without a journal and lock-free temp segments (a writer
    that died creating one, or a compaction that died removing one); return how many."""
    removed = 0
    for seg_id in set(segments) - set(journals):
        path = segment_path(root, seg_id)
        if not is_locked(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    with os.scandir(root) as entries:
        for entry in entries:
            if _TEMP.fullmatch(entry.name) and not is_locked(entry.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


# ---------------------------------------------------------------------------- compaction

def compact(appender: Appender, victim: int, moves: Sequence[Entry],
            keep: Sequence[Entry]) -> list[Entry] | None:
    """Copy the live records `moves` (all in segment `victim`) into the active segment,
    journal them and `keep` (the victim journal's winning entries that point elsewhere), then
    remove the victim's journal and segment.

    Returns:
        The new entries of `moves` (same keys and stamps, new places), or None if another
        process holds the victim's lock (it is compacting it, or still writing it).
    """
    root = appender.root
    try:
        fd = os.open(segment_path(root, victim), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        moved = _copy_records(appender, fd, moves)
        appender.log(keep)
        for suffix in ("log", "seg"):  # the journal first: a segment alone is an orphan
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(root, victim, suffix))
        return moved
    finally:
        os.close(fd)


def _copy_records(appender: Appender, fd: int, moves: Sequence[Entry]) -> list[Entry]:
    moved: list[Entry] = []
    chunk = 32
    for lo in range(0, len(moves), chunk):
        group = moves[lo:lo + chunk]
        blobs = [os.pread(fd, entry.length, entry.offset) for entry in group]
        segment, offset = appender.reserve(sum(len(blob) for blob in blobs))
        entries: list[Entry] = []
        try:
            _pwritev_all(segment.seg_fd, list(blobs), offset)
            if appender.fsync:  # the copies are durable before the victim goes
                os.fdatasync(segment.seg_fd)
            for entry, blob in zip(group, blobs, strict=True):
                entries.append(entry._replace(seg_id=segment.seg_id, offset=offset,
                                              length=len(blob)))
                offset += len(blob)
        finally:
            appender.release(segment, entries)
        moved += entries
    return moved
