"""The native span reader (`_spanread.c`) reads and rejects exactly what the Python reader
does: every case below runs `read_run` both ways over the same damaged segment and the
outcomes, and every filled buffer, must match (and be the page written, or a miss)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from aiohicache.storage import _native, _reader
from aiohicache.storage._journal import PUT, Entry, segment_path
from aiohicache.storage._reader import Outcome, SegmentFiles, read_run
from aiohicache.storage.base import HEADER_SIZE, PageFormat, encode_header

from .conftest import FMT, make_keys, make_page

OTHER = PageFormat.make(namespace="conformance", spec_fingerprint="other", page_size=4,
                        payload_bytes=FMT.payload_bytes)
SIZE = HEADER_SIZE + FMT.payload_bytes

needs_native = pytest.mark.skipif(
    _native.SPAN_READER is None and os.environ.get("AIOHICACHE_REQUIRE_NATIVE") != "1",
    reason="the native span reader is not built here (CI requires it)")


def write_segment(root: Path, keys: list[str], damage: dict[int, str]) -> list[Entry]:
    """One segment holding a record per key, record i damaged the way ``damage[i]`` says."""
    blob = bytearray()
    for i, key in enumerate(keys):
        kind = damage.get(i)
        fmt = OTHER if kind == "format" else FMT
        owner = keys[(i + 1) % len(keys)] if kind == "other key" else key
        record = bytearray(encode_header(fmt, owner, make_page(owner)) + make_page(owner))
        if kind == "header byte":
            record[random.randrange(HEADER_SIZE)] ^= 0x01
        elif kind == "payload byte":
            record[HEADER_SIZE + random.randrange(FMT.payload_bytes)] ^= 0x80
        blob += record
    Path(segment_path(str(root), 7)).write_bytes(blob)
    return [Entry(key, PUT, 7, i * SIZE, SIZE, i + 1) for i, key in enumerate(keys)]


def read_both(root: Path, keys: list[str], entries: list[Entry],
              monkeypatch: pytest.MonkeyPatch) -> tuple[list[object], list[bytearray]]:
    """`read_run` natively, then in Python; the outcomes and buffers of both, which agree."""
    results = []
    for reader in (_native.SPAN_READER, None):
        monkeypatch.setattr(_native, "SPAN_READER", reader)
        buffers = [bytearray(FMT.payload_bytes) for _ in keys]
        files = SegmentFiles(str(root))
        try:
            outcomes = read_run(files, FMT, keys, entries, [memoryview(b) for b in buffers])
        finally:
            files.close()
        results.append((outcomes, buffers))
    (native, native_bufs), (python, python_bufs) = results
    assert list(map(_plain, native)) == list(map(_plain, python))
    for outcome, got, again in zip(native, native_bufs, python_bufs, strict=True):
        if outcome is Outcome.FILLED:
            assert got == again
    return native, native_bufs


def _plain(outcome: object) -> object:
    return (type(outcome), outcome.errno) if isinstance(outcome, OSError) else outcome


@needs_native
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("chunk", [
    HEADER_SIZE + 1, SIZE // 3, SIZE - 1,  # a record read in pieces
    SIZE, 3 * SIZE + 5, 256 << 10,  # one record per call, three, the whole span
])
def test_native_and_python_readers_agree_on_every_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, chunk: int) -> None:
    random.seed(seed)
    monkeypatch.setattr(_reader, "_CHUNK_BYTES", chunk)
    keys = make_keys(random.randint(1, 40))
    kinds = ["header byte", "payload byte", "other key", "format"]
    damage = {i: random.choice(kinds) for i in range(len(keys)) if random.random() < 0.3}
    entries = write_segment(tmp_path, keys, damage)
    cut = random.choice([None, random.randrange(len(keys) * SIZE)])
    if cut is not None:
        os.truncate(segment_path(str(tmp_path), 7), cut)
    outcomes, buffers = read_both(tmp_path, keys, entries, monkeypatch)
    for i, (key, outcome) in enumerate(zip(keys, outcomes, strict=True)):
        whole = cut is None or (i + 1) * SIZE <= cut
        assert (outcome is Outcome.FILLED) == (whole and i not in damage), (i, damage.get(i))
        if outcome is Outcome.FILLED:
            assert buffers[i] == make_page(key)


@needs_native
def test_a_failed_read_is_an_os_error_for_every_page_not_filled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(3)
    entries = write_segment(tmp_path, keys, {})
    directory = os.open(tmp_path, os.O_RDONLY)  # preadv: EISDIR
    monkeypatch.setattr(SegmentFiles, "open", lambda self, seg_id: os.dup(directory))
    try:
        outcomes, _ = read_both(tmp_path, keys, entries, monkeypatch)
    finally:
        os.close(directory)
    assert all(isinstance(o, IsADirectoryError) for o in outcomes)


@needs_native
def test_bad_buffers_raise_and_are_let_go(tmp_path: Path) -> None:
    reader = _native.SPAN_READER
    assert reader is not None
    fd = os.open(tmp_path, os.O_RDONLY)
    prefix, ids = b"\0" * 48, b"\0" * 16
    good = bytearray(64)
    try:
        with pytest.raises(ValueError, match="buffer 1 holds 63 bytes, not 64"):
            reader.read_checked(fd, 0, 64, 4096, prefix, ids,
                                [memoryview(good), memoryview(bytearray(63))], bytearray(2))
        with pytest.raises(BufferError):  # read-only
            reader.read_checked(fd, 0, 64, 4096, prefix, ids,
                                [memoryview(good), memoryview(bytes(64))], bytearray(2))
        with pytest.raises(ValueError, match="key ids or outcomes"):
            reader.read_checked(fd, 0, 64, 4096, prefix, ids, [memoryview(good)], bytearray(2))
        with pytest.raises(ValueError, match="bad prefix or sizes"):  # a chunk below a header
            reader.read_checked(fd, 0, 64, HEADER_SIZE, prefix, ids, [memoryview(good)] * 2,
                                bytearray(2))
    finally:
        os.close(fd)
    good.extend(b"x")  # no buffer export left behind: it can be resized


def test_the_native_reader_is_there_where_ci_requires_it() -> None:
    if os.environ.get("AIOHICACHE_REQUIRE_NATIVE") == "1":
        assert _native.SPAN_READER is not None, "the native span reader was not built"


def test_aiohicache_native_0_reads_in_python() -> None:
    code = "from aiohicache.storage import _native; print(_native.SPAN_READER)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AIOHICACHE_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"


@needs_native
def test_a_hash_that_disagrees_with_xxhash_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _native._xxh3_addresses() is not None
    monkeypatch.setattr(_native, "checksum", lambda data, seed: 0)
    assert _native._xxh3_addresses() is None
