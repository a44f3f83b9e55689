"""Reading the file store: segment maps, and verified copies of records (blocking I/O only).

Records in the page cache are checked and copied where they lie, through a read-only map of
their segment (one copy, as a ``read`` makes); others are read with one ``preadv`` per span
of adjacent records into a staging buffer first, so a disk error is an `OSError`, never a
SIGBUS through the map. Only a verified payload is copied into the caller's buffer: a missed
buffer is never written.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from ._journal import Entry, segment_path
from .base import HEADER_SIZE, PageFormat, decode_page

__all__ = ("Outcome", "SegmentMaps", "read_run")


class Outcome:
    """What reading one key did (module-level constants, compared by identity)."""

    FILLED: Final = "filled"
    MISSING: Final = "missing"
    """Its segment is gone (compacted, or the store removed)."""
    CORRUPT: Final = "corrupt"
    """Rejected by `decode_page`: damaged, torn, of another format, or another key's (or
    past the end of its segment: a file truncated behind the store's back)."""


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

    def holds(self, hi: int) -> bool:
        """Whether the file still holds ``[0, hi)``, checked just before the map is read.

        NOTE: a map read past its file's end faults (SIGBUS kills the process). The store
        never truncates a segment, but a person or a tool may: a record past the end is then
        read with ``preadv`` (short: a counted miss) instead of through the map.
        """
        return hi <= len(self.view) and os.fstat(self.fd).st_size >= hi


class SegmentMaps:
    """Read-only maps of segments, shared by the I/O threads that read records.

    NOTE: a record is checked and copied straight out of the page cache through a map: one
    copy, as a ``read`` makes, instead of a read into a staging buffer and a second copy out
    of it (which halved large-page reads). A map covers no more than its file's size when
    mapped (a record past it is remapped, or torn: a miss). At most `limit` segments stay
    mapped (least recently used dropped); a removed segment (compacted, or the store
    removed) is dropped when a read finds it gone, so its disk space is not held.
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
    good, a span of adjacent records of one segment at a time.

    Returns:
        An `Outcome` constant per key, or the `OSError` reading it raised.
    """
    return _RunReader(maps, fmt, keys, entries, dests).read()


class _RunReader:
    """One `read_run`: the outcome of each key, the maps it has looked at."""

    def __init__(self, maps: SegmentMaps, fmt: PageFormat, keys: Sequence[str],
                 entries: Sequence[Entry], dests: Sequence[memoryview]) -> None:
        self.maps, self.fmt, self.keys, self.entries, self.dests = (maps, fmt, keys, entries,
                                                                     dests)
        self.size = HEADER_SIZE + fmt.payload_bytes
        self.outcomes: list[str | OSError] = [Outcome.CORRUPT] * len(keys)
        self.seen: dict[int, _Map | None] = {}

    def read(self) -> list[str | OSError]:
        for span in _spans(self.entries, self.size):
            if self.entries[span[0]].length != self.size:
                continue  # not one object: rejected unread (CORRUPT)
            try:
                self._read_span(span)
            except (OSError, ValueError) as exc:  # ValueError: mmap refused the file
                error = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
                for i in span:
                    if self.outcomes[i] is Outcome.CORRUPT:
                        self.outcomes[i] = error
        return self.outcomes

    def _read_span(self, span: list[int]) -> None:
        first = self.entries[span[0]]
        lo, hi = first.offset, self.entries[span[-1]].offset + self.size
        held = self._map(first.seg_id, hi)
        if held is None:
            for i in span:
                self.outcomes[i] = Outcome.MISSING
            return
        if held.resident(lo, hi) and held.holds(hi):
            source = held.view[lo:hi]
        else:  # one read for the span; short past the end of the file: those are misses
            source = _staging(hi - lo)
            source = source[:os.preadv(held.fd, [source], lo)]
        for i in span:
            start = self.entries[i].offset - lo
            self.outcomes[i] = _verified_copy(self.fmt, self.keys[i],
                                              source[start:start + self.size], self.dests[i])

    def _map(self, seg_id: int, hi: int) -> _Map | None:
        """The segment's map, checked to be linked on its first use in this run."""
        first_use = seg_id not in self.seen
        held = self.seen.get(seg_id)
        if first_use or (held is not None and len(held.view) < hi):
            held = self.seen[seg_id] = self.maps.get(seg_id, hi, check=first_use)
        return held


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


def _staging(nbytes: int) -> memoryview:
    """This thread's staging buffer, at least `nbytes` (reused: a fresh one faults per 4 KiB)."""
    buf: memoryview | None = getattr(_local, "staging", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.staging = memoryview(bytearray(nbytes))
    return buf[:nbytes]


def _verified_copy(fmt: PageFormat, key: str, record: memoryview, dest: memoryview) -> str:
    payload = decode_page(fmt, key, record)
    if payload is None:
        return Outcome.CORRUPT
    if len(payload) <= _COPY_WITH_GIL:
        dest[:] = payload
    else:  # numpy copies without the GIL: a long copy holding it would stall the loop
        np.frombuffer(dest, np.uint8)[:] = np.frombuffer(payload, np.uint8)
    return Outcome.FILLED


_COPY_WITH_GIL: Final = 256 << 10
"""Payloads up to this size are copied holding the GIL (tens of µs at most).

NOTE: each time an I/O thread lets go of the GIL it must win it back from the loop and the
other I/O threads; at 64 KiB a copy is shorter than that hand-off. Holding the GIL for it:
64 KiB reads, 4 threads, 16 interleaved runs each, 34 vs 42 µs of CPU per page, 1.77 vs
1.63 GB/s (medians).
"""
