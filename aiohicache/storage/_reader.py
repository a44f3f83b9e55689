"""Reading the file store: open segments, and verified reads of records (blocking I/O only).

A span of adjacent records is read with ``preadv`` straight into the callers' buffers (the
headers into a small buffer of the thread's), a chunk of about `_CHUNK_BYTES` at a time,
and each payload is checked while the chunk is still in the CPU's cache. The kernel copies
once, from the page cache into the buffer: no map to fault in, no staging copy. Where the
native module is usable (`_native.SPAN_READER`, ``_spanread.c``) a whole span is read and
checked in one call with the GIL let go; else the same reads run here, in Python.

A page is reported filled only if its header and checksum match; a buffer not reported
filled may hold the bytes of a rejected record (callers use only filled buffers).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Final

from . import _native
from ._journal import Entry, segment_path
from .base import (
    HEADER_SIZE,
    PageFormat,
    checksum,
    checksum_stream,
    expected_checksum,
    fixed_header,
    key_id,
)

__all__ = ("Outcome", "SegmentFiles", "read_run")


class Outcome:
    """What reading one key did (module-level constants, compared by identity)."""

    FILLED: Final = "filled"
    MISSING: Final = "missing"
    """Its segment is gone (compacted, or the store removed)."""
    CORRUPT: Final = "corrupt"
    """Rejected: damaged, torn, of another format, or another key's (or past the end of its
    segment: a file truncated behind the store's back)."""


class SegmentFiles:
    """Read-only descriptors of segments, shared by the I/O threads that read records.

    NOTE: a reader gets its own duplicate of a descriptor (`open`) and closes it when done:
    a descriptor dropped here (segment compacted, or more than `limit` open) is then never
    closed under a read in flight, whose fd number the kernel could hand to another file.
    """

    def __init__(self, root: str, limit: int = 64) -> None:
        self.root = root
        self.limit = limit
        self._lock = threading.Lock()
        self._fds: OrderedDict[int, int] = OrderedDict()

    def open(self, seg_id: int) -> int | None:
        """A new descriptor of segment `seg_id` (the caller closes it), or None if the
        segment is gone (its file unlinked)."""
        with self._lock:
            fd = self._fds.get(seg_id)
            if fd is None:
                fd = self._open(seg_id)
                if fd is None:
                    return None
            elif os.fstat(fd).st_nlink == 0:  # removed since it was opened
                self._drop(seg_id)
                return None
            self._fds.move_to_end(seg_id)
            return os.dup(fd)

    def drop(self, seg_id: int) -> None:
        """Close segment `seg_id`'s descriptor (reads holding a duplicate go on)."""
        with self._lock:
            self._drop(seg_id)

    def close(self) -> None:
        with self._lock:
            for seg_id in list(self._fds):
                self._drop(seg_id)

    def _drop(self, seg_id: int) -> None:
        fd = self._fds.pop(seg_id, None)
        if fd is not None:
            os.close(fd)

    def _open(self, seg_id: int) -> int | None:
        try:
            fd = os.open(segment_path(self.root, seg_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_nlink == 0:  # removed while we opened it
                os.close(fd)
                return None
        except BaseException:
            os.close(fd)
            raise
        self._fds[seg_id] = fd
        while len(self._fds) > self.limit:
            os.close(self._fds.popitem(last=False)[1])
        return fd


def read_run(files: SegmentFiles, fmt: PageFormat, keys: Sequence[str],
             entries: Sequence[Entry], dests: Sequence[memoryview]) -> list[str | OSError]:
    """Read each key's record into its destination and check it, a span of adjacent records
    of one segment at a time.

    Returns:
        An `Outcome` constant per key (`FILLED` only for a verified payload), or the
        `OSError` reading it raised.
    """
    reader = _RunReader(fmt, keys, entries, dests)
    fds: dict[int, int | None] = {}
    try:
        for span in _spans(entries, reader.size):
            seg_id = entries[span[0]].seg_id
            if seg_id not in fds:
                fds[seg_id] = files.open(seg_id)
            reader.read(fds[seg_id], span)
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    return reader.outcomes


class _RunReader:
    """One `read_run`: the outcome of each key."""

    def __init__(self, fmt: PageFormat, keys: Sequence[str], entries: Sequence[Entry],
                 dests: Sequence[memoryview]) -> None:
        self.fmt, self.keys, self.entries, self.dests = fmt, keys, entries, dests
        self.size = HEADER_SIZE + fmt.payload_bytes
        self.outcomes: list[str | OSError] = [Outcome.CORRUPT] * len(keys)

    def read(self, fd: int | None, span: list[int]) -> None:
        """Read one span from `fd` (None: its segment is gone)."""
        if fd is None:
            for i in span:
                self.outcomes[i] = Outcome.MISSING
            return
        if self.entries[span[0]].length != self.size:
            return  # not one object: rejected unread (CORRUPT)
        try:
            if _native.SPAN_READER is not None:
                self._read_native(_native.SPAN_READER, fd, span)
            elif self.size <= _CHUNK_BYTES:
                per = _per_call(self.size)
                for lo in range(0, len(span), per):
                    if not self._read_whole(fd, span[lo:lo + per]):
                        break  # short: the file ends here
            else:
                for i in span:
                    self._read_pieces(fd, i)
        except OSError as exc:
            for i in span:
                if self.outcomes[i] is Outcome.CORRUPT:
                    self.outcomes[i] = exc

    def _read_native(self, reader: _native.SpanReader, fd: int, span: list[int]) -> None:
        """`_read_whole` or `_read_pieces` over the whole span in one native call (the GIL
        let go)."""
        filled = bytearray(len(span))
        try:
            reader.read_checked(fd, self.entries[span[0]].offset, self.fmt.payload_bytes,
                                _CHUNK_BYTES, fixed_header(self.fmt),
                                b"".join([key_id(self.keys[i]) for i in span]),
                                [self.dests[i] for i in span], filled)
        finally:
            for i, ok in zip(span, filled, strict=True):
                if ok:
                    self.outcomes[i] = Outcome.FILLED

    def _read_whole(self, fd: int, chunk: list[int]) -> bool:
        """Records that each fit a chunk, read with one call; False if the file ended."""
        headers = _headers(len(chunk))
        iov: list[memoryview] = []
        for n, i in enumerate(chunk):
            iov += (headers[n], self.dests[i])
        got = _preadv_full(fd, iov, self.entries[chunk[0]].offset)
        for n, i in enumerate(chunk):
            if got < (n + 1) * self.size:
                return False  # cut off: a miss (the outcome stays CORRUPT)
            expected = expected_checksum(self.fmt, self.keys[i], headers[n])
            if expected is not None and checksum(self.dests[i], expected[1]) == expected[0]:
                self.outcomes[i] = Outcome.FILLED
        return True

    def _read_pieces(self, fd: int, i: int) -> None:
        """A record larger than a chunk, read and checked a chunk at a time."""
        header, dest = _headers(1)[0], self.dests[i]
        offset = self.entries[i].offset
        first = dest[:_CHUNK_BYTES - HEADER_SIZE]
        if _preadv_full(fd, [header, first], offset) < HEADER_SIZE + len(first):
            return
        expected = expected_checksum(self.fmt, self.keys[i], header)
        if expected is None:
            return
        stream = checksum_stream(expected[1])
        stream.update(first)
        for lo, piece in _pieces(dest, len(first)):
            if _preadv_full(fd, [piece], offset + HEADER_SIZE + lo) < len(piece):
                return
            stream.update(piece)
        if stream.intdigest() == expected[0]:
            self.outcomes[i] = Outcome.FILLED


def _preadv_full(fd: int, buffers: list[memoryview], offset: int) -> int:
    """``os.preadv`` until every buffer is full or the file ends (a read of 0 bytes): a
    short read that is not the end (a network file system) is read on. The bytes read."""
    want = sum(map(len, buffers))
    total = os.preadv(fd, buffers, offset)
    while 0 < total < want:  # NOTE: the rare case; a local file reads whole or to its end
        skip = total
        rest = []
        for buf in buffers:
            if skip >= len(buf):
                skip -= len(buf)
            else:
                rest.append(buf[skip:])
                skip = 0
        got = os.preadv(fd, rest, offset + total)
        if got == 0:
            break
        total += got
    return total


def _per_call(size: int) -> int:
    """Records of `size` bytes read per ``preadv`` (each fits a chunk)."""
    return min(_CHUNK_BYTES // size, _MAX_IOV // 2)


def _pieces(dest: memoryview, start: int) -> Iterator[tuple[int, memoryview]]:
    for lo in range(start, len(dest), _CHUNK_BYTES):
        yield lo, dest[lo:lo + _CHUNK_BYTES]


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


_local = threading.local()


def _headers(num: int) -> list[memoryview]:
    """`num` header-sized views of this thread's header buffer (reused across reads)."""
    held: list[memoryview] | None = getattr(_local, "headers", None)
    if held is None or len(held) < num:
        buf = memoryview(bytearray(HEADER_SIZE * max(num, _IOV_RECORDS)))
        held = _local.headers = [buf[k:k + HEADER_SIZE] for k in range(0, len(buf), HEADER_SIZE)]
    return held[:num]


_CHUNK_BYTES: Final = 256 << 10
"""Bytes read per call before their records are checked.

NOTE: the checksum of a payload the kernel has just copied reads it from the CPU's cache;
over a read of many MiB it would read it back from memory (64 KiB pages, one thread: 2 vs
5 µs per page). A chunk fits well within the L2 cache of one core (1 MiB here: 256 KiB
chunks read 64 KiB pages at 16.8-17.6 µs per page, 512 KiB at 19.6-24.3, interleaved).
"""

_IOV_RECORDS: Final = 64
"""Headers per thread buffer at first (more if a chunk of small records needs them)."""

_MAX_IOV: Final = os.sysconf("SC_IOV_MAX") if os.sysconf("SC_IOV_MAX") > 0 else 1024
"""Buffers one ``preadv`` takes (1024 on Linux; POSIX guarantees 16): two per record."""
