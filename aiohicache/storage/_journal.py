"""The file store's on-disk layout and its journals: the index as written (blocking I/O only).

Layout of a store directory::

    <id>.seg       page objects (64-byte header + payload, see base.py) back to back, as
                   one writer appended them; that writer holds an exclusive ``flock`` on it
                   while it may still append (a lock-free segment is sealed, or its writer died)
    <id>.log       the journal of that segment's writer: fixed-size entries, each binding a key
                   to a record (segment id, offset, length), deleting it, or noting a read of
                   it (recency only), stamped with a time
    <id>.seg.tmp   a segment being created (renamed to .seg once locked)

The journals are the index: the entry with the latest stamp wins for each key, wherever it
was written, so any process can bind, re-bind or delete any key by appending to a journal of
its own. Nothing here is trusted for correctness: every record is verified by `decode_page`
under the key it is read for, so a torn record, a torn or forged entry, or an entry pointing
at another key's record is a miss, never wrong KV. An entry is written only after its record
(and, with fsync, after the record is durable), so a crash mid-write leaves an unreferenced
tail, never a served torn page.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Final, NamedTuple

import xxhash

__all__ = ("DELETE", "ENTRY_SIZE", "PUT", "TOUCH", "Entry", "JournalScan", "is_locked",
           "read_journals", "read_log_since", "remove_orphans", "segment_path",
           "unpack_entries")

PUT: Final = 1
DELETE: Final = 2
TOUCH: Final = 3
"""A read of the record named, at the stamp: recency only. It moves the key in the LRU
order if the key is still bound to that record, and never binds, re-binds or outranks."""

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
    origin: int = 0
    """A PUT's write: the low 32 bits of the segment it was first written into (kept when a
    compaction moves it; 0: written by an older version). Breaks ties of stamps, and tells
    a write moved from another write stamped alike."""
    moves: int = 0
    """A PUT's compactions: 0 where it was written, one more at each move (kept in the
    entry's spare field; 0 from an older version). Of two entries of one write (same stamp
    and origin), the one moved more names the record's latest place. NOTE: the tie went to
    whichever journal the directory listed last: an instance that read a write and its move
    in one look (starting while another instance compacted) bound the key into the victim,
    missed it once the victim was removed, and compacted the move away."""

    def pack(self) -> bytes:
        fields = _ENTRY.pack(_MAGIC, self.kind, len(self.key), min(self.moves, 0xFFFF),
                             self.seg_id, self.offset, self.length, self.origin, self.stamp,
                             self.key.encode("ascii"))
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
        magic, kind, key_len, moves, seg_id, offset, length, origin, stamp, key = \
            _ENTRY.unpack(fields)
        if magic == _MAGIC and kind in (PUT, DELETE, TOUCH) and 16 <= key_len <= 128:
            out.append(Entry(key[:key_len].decode("ascii", "replace"), kind, seg_id, offset,
                             length, stamp, origin, moves))
    return out


def segment_path(root: str, seg_id: int, suffix: str = "seg") -> str:
    return os.path.join(root, f"{seg_id:016x}.{suffix}")


@dataclass(slots=True)
class JournalScan:
    """What `read_journals` found: new entries per journal and the segments present."""

    entries: list[tuple[int, list[Entry]]] = field(default_factory=list)
    """(journal id, its entries past what was read before), oldest journal content first."""
    read_to: dict[int, int] = field(default_factory=dict)
    """Journal id -> bytes read so far (whole entries only)."""
    segments: dict[int, int] = field(default_factory=dict)
    """Segment id -> file size, for every segment present."""

    def in_stamp_order(self) -> list[Entry]:
        """Every entry found, oldest stamp first (so applying them in order, the last wins)."""
        return sorted((e for _, batch in self.entries for e in batch),
                      key=lambda e: (e.stamp, e.origin, e.moves))


def read_journals(root: str, read_to: dict[int, int],
                  skip: frozenset[int] = frozenset()) -> JournalScan:
    """Every journal's entries past `read_to` (journal id -> bytes read before; a journal
    not in it is read whole), but those in `skip` (this instance's own), and the size of
    every segment.

    Raises:
        OSError: the directory cannot be listed (a missing one is made).
    """
    os.makedirs(root, exist_ok=True)
    scan, known = JournalScan(), dict(read_to)
    for _ in range(_PASSES):
        logs = _read_pass(root, known, skip, scan)
        # NOTE: sized after the journals are read: an entry is written after its record, so
        # every record an entry read names lies inside its segment's size now (sized first,
        # a record landing meanwhile looked torn, and its entry, already read past, was lost)
        scan.segments = {}
        _list(root, scan.segments)
        # NOTE: a segment whose journal this pass listed, gone now, was compacted meanwhile:
        # its moves went to a journal read before they were appended, or to a new one, so
        # its keys were dropped until a later look (at a start, older versions bound). Read
        # on (entries already read are not read again) until no segment went meanwhile.
        if all(log_id in scan.segments for log_id in logs):
            break
    return scan


_PASSES = 4
"""Reads of the journals a look makes at most while compactions remove segments under it."""


def _read_pass(root: str, known: dict[int, int], skip: frozenset[int],
               scan: JournalScan) -> list[int]:
    """Read every journal under `root` past `known` into `scan` (advancing `known`); the
    journal ids listed."""
    logs = _list(root)
    scan.read_to = {}
    for log_id in logs:
        start = known.get(log_id, 0)
        if log_id in skip:
            scan.read_to[log_id] = start
            continue
        data = _read_from(segment_path(root, log_id, "log"), start)
        if data is None:
            continue  # removed meanwhile
        whole = len(data) - len(data) % ENTRY_SIZE
        scan.read_to[log_id] = known[log_id] = start + whole
        if whole:
            scan.entries.append((log_id, unpack_entries(memoryview(data)[:whole])))
    return logs


def _list(root: str, segments: dict[int, int] | None = None) -> list[int]:
    """The journal ids under `root`; fills `segments`, if given, with each segment's
    size."""
    logs: list[int] = []
    with os.scandir(root) as entries:
        for entry in entries:
            match = _SEGMENT.fullmatch(entry.name)
            if match is None:
                continue
            seg_id = int(match.group(1), 16)
            if match.group(2) == "log":
                logs.append(seg_id)
            elif segments is not None:
                with contextlib.suppress(FileNotFoundError):
                    segments[seg_id] = entry.stat().st_size
    return logs


def read_log_since(root: str, log_id: int, start: int) -> tuple[list[Entry], list[Entry]]:
    """The valid entries of one journal (none if it is gone), and those of them past byte
    `start` (what a reader that read up to `start` has not seen)."""
    data = _read_from(segment_path(root, log_id, "log"), 0) or b""
    whole = len(data) - len(data) % ENTRY_SIZE
    start = min(max(start, 0), whole) // ENTRY_SIZE * ENTRY_SIZE
    view = memoryview(data)
    return unpack_entries(view[:whole]), unpack_entries(view[start:whole])


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
    removed = sum(map(partial(_remove_if_orphan, root), set(segments) - set(journals)))
    with os.scandir(root) as entries:
        for entry in entries:
            if _TEMP.fullmatch(entry.name) and not is_locked(entry.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def _remove_if_orphan(root: str, seg_id: int) -> bool:
    """Remove segment `seg_id` if nobody holds its lock and it has no journal, checked
    under a lock of our own; True if removed.

    NOTE: the journals are listed before the segments, so a segment made and sealed in
    between (its writer's lock gone) is listed without one: its journal exists now. It was
    taken for an orphan and removed, with the pages journaled in it (found by a stress).
    A segment gets its journal while its maker holds the lock, so locked and checked, the
    answer holds until we let go.
    """
    path = segment_path(root, seg_id)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.exists(segment_path(root, seg_id, "log")) or os.fstat(fd).st_nlink == 0:
            return False
        os.unlink(path)
        return True
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        os.close(fd)
