"""Reaching around a `FileBackend` into its directory: what an operator, a bug or another
process could do to the segments and journals (sync: tiny files, run on a thread or at rest).

A journal entry binds a key to a record wherever it is written, so "rename" and "copy" here
are entries that point one key at another key's record (or at a copy of it), exactly what a
misdirected index update or a careless tool would do; the backend must reject such a record.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from aiohicache.storage import _appender, _journal
from aiohicache.storage._journal import DELETE, PUT, Entry

__all__ = ("append_entries", "append_record", "corrupt_record", "corrupt_last_record",
           "latest_entries", "swap_keys")


def append_entries(root: str | Path, entries: Iterable[Entry]) -> None:
    """Journal `entries` as another writer would (a segment and journal of its own)."""
    appender = _appender.Appender(os.fspath(root), segment_bytes=1 << 30, fsync=False)
    try:
        appender.log(list(entries))
    finally:
        appender.close()


def append_record(root: str | Path, key: str, blob: bytes, stamp: int) -> None:
    """Store `blob` as the record of `key`, bypassing encoding (a forged or foreign object)."""
    appender = _appender.Appender(os.fspath(root), segment_bytes=1 << 30, fsync=False)
    try:
        segment, offset = appender.reserve(len(blob))
        entry = Entry(key, PUT, segment.seg_id, offset, len(blob), stamp)
        try:
            os.pwrite(segment.seg_fd, blob, offset)
        finally:
            appender.release(segment, [entry])
    finally:
        appender.close()


def latest_entries(root: str | Path) -> dict[str, Entry]:
    """The winning entry of every key, as a new instance would load them."""
    scan = _journal.read_journals(os.fspath(root), {})
    out: dict[str, Entry] = {}
    for entry in scan.in_stamp_order():  # ties of stamps as the store breaks them
        out[entry.key] = entry
    return {k: e for k, e in out.items() if e.kind == PUT}


def corrupt_record(root: str | Path, entry: Entry) -> None:
    """Flip every bit of the last byte of `entry`'s record, in place."""
    path = _journal.segment_path(os.fspath(root), entry.seg_id)
    with open(path, "r+b") as f:
        f.seek(entry.offset + entry.length - 1)
        byte = f.read(1)
        f.seek(entry.offset + entry.length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def corrupt_last_record(root: str | Path) -> str:
    """Corrupt the record written last (of the latest entries); return its key."""
    entry = max(latest_entries(root).values(), key=lambda e: e.stamp)
    corrupt_record(root, entry)
    return entry.key


def swap_keys(root: str | Path, pairs: Iterable[tuple[str, str]]) -> None:
    """Point each pair's keys at each other's records (a swapped index, at rest)."""
    latest = latest_entries(root)
    stamp = time.time_ns()
    entries: list[Entry] = []
    for a, b in pairs:
        entries.append(latest[b]._replace(key=a, stamp=stamp))
        entries.append(latest[a]._replace(key=b, stamp=stamp))
    append_entries(root, entries)


def rename_entries(src: Entry, dst: str, stamp: int) -> list[Entry]:
    """The entries that move `src`'s record to `dst`: dst bound to it, src deleted."""
    return [src._replace(key=dst, stamp=stamp), src._replace(kind=DELETE, stamp=stamp)]
