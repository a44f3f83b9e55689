"""The native span reader (`_spanread.c`) reads and rejects exactly what the Python reader
does: every case below runs `read_run` both ways over the same damaged segment and the
outcomes, and every filled buffer, must match (and be the page written, or a miss)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from aiohicache.storage import _native, _reader
from aiohicache.storage._appender import encode_headers
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


def read_into_new_buffers(root: Path, fmt: PageFormat, keys: list[str],
                          entries: list[Entry]) -> tuple[list[object], list[bytearray]]:
    """`read_run` of `entries` under `root` into fresh buffers: its outcomes and the buffers."""
    buffers = [bytearray(fmt.payload_bytes) for _ in keys]
    files = SegmentFiles(str(root))
    try:
        outcomes = read_run(files, fmt, keys, entries, [memoryview(b) for b in buffers])
    finally:
        files.close()
    return list(outcomes), buffers


def read_both(root: Path, keys: list[str], entries: list[Entry],
              monkeypatch: pytest.MonkeyPatch) -> tuple[list[object], list[bytearray]]:
    """`read_run` natively, then in Python; the outcomes and buffers of both, which agree."""
    results = []
    for reader in (_native.SPAN_READER, None):
        monkeypatch.setattr(_native, "SPAN_READER", reader)
        results.append(read_into_new_buffers(root, FMT, keys, entries))
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


@pytest.mark.parametrize("chunk", [SIZE // 3, 256 << 10])
def test_short_reads_before_the_end_are_read_on_in_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(_native, "SPAN_READER", None)
    monkeypatch.setattr(_reader, "_CHUNK_BYTES", chunk)
    keys = make_keys(9)
    entries = write_segment(tmp_path, keys, {})
    real = os.preadv

    def at_most_1000_bytes(fd: int, buffers: list[memoryview], offset: int) -> int:
        cut, left = [], 1000
        for buf in buffers:
            if left == 0:
                break
            cut.append(buf[:left])
            left -= len(cut[-1])
        return real(fd, cut, offset)

    monkeypatch.setattr(_reader.os, "preadv", at_most_1000_bytes)
    outcomes, buffers = read_into_new_buffers(tmp_path, FMT, keys, entries)
    assert outcomes == [Outcome.FILLED] * 9
    assert buffers == [make_page(k) for k in keys]


_SHORT_READS = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/uio.h>

/* preadv that reads at most 1000 bytes a call, as a network file system may */
static int cut(const struct iovec *iov, int n, struct iovec *out) {
    size_t left = 1000;
    int k = 0;
    for (; k < n && k < 64 && left > 0; k++) {
        out[k] = iov[k];
        if (out[k].iov_len > left) out[k].iov_len = left;
        left -= out[k].iov_len;
    }
    return k;
}
ssize_t preadv(int fd, const struct iovec *iov, int n, off_t at) {
    static ssize_t (*real)(int, const struct iovec *, int, off_t);
    struct iovec out[64];
    if (!real) real = dlsym(RTLD_NEXT, "preadv");
    return real(fd, out, cut(iov, n, out), at);
}
ssize_t preadv64(int, const struct iovec *, int, off_t) __attribute__((alias("preadv")));
ssize_t preadv2(int fd, const struct iovec *iov, int n, off_t at, int flags) {
    static ssize_t (*real)(int, const struct iovec *, int, off_t, int);
    struct iovec out[64];
    if (!real) real = dlsym(RTLD_NEXT, "preadv2");
    return real(fd, out, cut(iov, n, out), at, flags);
}
ssize_t preadv64v2(int, const struct iovec *, int, off_t, int)
    __attribute__((alias("preadv2")));
"""

_READ_BACK = """
import asyncio, hashlib, sys
from aiohicache.storage import FileBackend, PageFormat, _native
async def main(payload):
    fmt = PageFormat.make(namespace="t", spec_fingerprint="t", page_size=1,
                          payload_bytes=payload)
    keys = [hashlib.blake2b(bytes([i]), digest_size=16).hexdigest() for i in range(20)]
    pages = [hashlib.shake_128(k.encode()).digest(payload) for k in keys]
    async with FileBackend(sys.argv[1] + f"/{payload}", fmt) as store:
        assert await store.set_from(keys, [memoryview(p) for p in pages]) == [True] * 20
        buffers = [bytearray(payload) for _ in keys]
        filled = await store.get_into(keys, [memoryview(b) for b in buffers])
        assert filled == [True] * 20 and buffers == pages, filled
for payload in (512, 300_000):  # several records a call; a record in pieces
    asyncio.run(main(payload))
print("native" if _native.SPAN_READER else "python")
"""


@pytest.mark.skipif(shutil.which("gcc") is None and os.environ.get("AIOHICACHE_REQUIRE_NATIVE")
                    != "1", reason="no C compiler for the preadv shim")
@pytest.mark.parametrize("native", ["1", "0"])
def test_short_reads_before_the_end_are_read_on(tmp_path: Path, native: str) -> None:
    if native == "1" and _native.SPAN_READER is None:
        pytest.skip("the native span reader is not built here")
    (tmp_path / "shim.c").write_text(_SHORT_READS)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "shim.so"),
                    str(tmp_path / "shim.c"), "-ldl"], check=True)
    env = {**os.environ, "LD_PRELOAD": str(tmp_path / "shim.so"), "AIOHICACHE_NATIVE": native}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_READ_BACK), str(tmp_path)],
                         env=env, cwd=Path(__file__).parents[2], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("native" if native == "1" else "python")


@needs_native
def test_a_span_of_more_records_than_one_call_takes(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = PageFormat.make(namespace="conformance", spec_fingerprint="tiny", page_size=1,
                           payload_bytes=8)
    keys = make_keys(1500)  # 3,000 buffers: one span, more than IOV_MAX (1,024) a call
    blob = b"".join(encode_header(tiny, k, k[:8].encode()) + k[:8].encode() for k in keys)
    Path(segment_path(str(tmp_path), 7)).write_bytes(blob)
    entries = [Entry(k, PUT, 7, i * (HEADER_SIZE + 8), HEADER_SIZE + 8, 1)
               for i, k in enumerate(keys)]
    for reader in (_native.SPAN_READER, None):
        monkeypatch.setattr(_native, "SPAN_READER", reader)
        outcomes, buffers = read_into_new_buffers(tmp_path, tiny, keys, entries)
        assert outcomes == [Outcome.FILLED] * 1500
        assert buffers == [k[:8].encode() for k in keys]


@needs_native
def test_a_page_of_zero_bytes_reads_the_same_both_ways(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    empty = PageFormat.make(namespace="conformance", spec_fingerprint="empty", page_size=1,
                            payload_bytes=0)
    keys = make_keys(3)
    Path(segment_path(str(tmp_path), 7)).write_bytes(
        b"".join(encode_header(empty, k, b"") for k in keys))
    entries = [Entry(k, PUT, 7, i * HEADER_SIZE, HEADER_SIZE, 1) for i, k in enumerate(keys)]
    for reader in (_native.SPAN_READER, None):
        monkeypatch.setattr(_native, "SPAN_READER", reader)
        outcomes, _ = read_into_new_buffers(tmp_path, empty, keys, entries)
        assert outcomes == [Outcome.FILLED] * 3


@needs_native
def test_the_hash_functions_are_bound_once() -> None:
    from aiohicache.storage import _spanread  # type: ignore[attr-defined]

    with pytest.raises(RuntimeError, match="already bound"):
        _spanread.bind(1, 1, 1, 1, 1, 1)


@pytest.mark.parametrize("seed", range(20))
def test_overlapping_buffers_are_found_the_same_both_ways(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rng = random.Random(seed)
    block = memoryview(bytearray(4096) if seed % 2 else bytes(4096))  # read-only too
    views = []
    for _ in range(rng.randint(0, 12)):
        lo = rng.randrange(4096)
        views.append(block[lo:lo + rng.randint(0, 300)])
    found = _native.first_overlap(views)
    monkeypatch.setattr(_native, "_first_overlap", None)  # the pure-Python way
    assert _native.first_overlap(views) == found
    pairs = [(i, j) for j in range(len(views)) for i in range(j)
             if _extent(block, views[i]) & _extent(block, views[j])]
    assert (found is None) == (not pairs)
    if found is not None:
        assert found in pairs


def _extent(block: memoryview, view: memoryview) -> set[int]:
    start = np.frombuffer(view, np.uint8).ctypes.data - np.frombuffer(block, np.uint8).ctypes.data
    return set(range(start, start + len(view)))


@needs_native
@pytest.mark.parametrize("payload_bytes", [0, 1, 240, 4096, 65536, 300_001])
def test_headers_hashed_in_one_native_call_are_encode_headers(
        monkeypatch: pytest.MonkeyPatch, payload_bytes: int) -> None:
    fmt = PageFormat.make(namespace="conformance", spec_fingerprint="h", page_size=1,
                          payload_bytes=payload_bytes)
    keys = make_keys(5)
    rng = random.Random(payload_bytes)
    payloads = [memoryview(rng.randbytes(payload_bytes)) for _ in keys]
    payloads[1] = memoryview(bytearray(payloads[1]))  # writable or not
    native = encode_headers(fmt, keys, payloads)
    monkeypatch.setattr(_native, "CHECKSUMS", None)
    assert native == encode_headers(fmt, keys, payloads)
    assert native == [encode_header(fmt, k, p) for k, p in zip(keys, payloads, strict=True)]


@needs_native
def test_checksums_refuse_key_ids_that_do_not_match() -> None:
    checksums = _native.CHECKSUMS
    assert checksums is not None
    with pytest.raises(ValueError, match="key ids do not match"):
        checksums(b"\0" * 8, [memoryview(b"a"), memoryview(b"b")])
    assert checksums(b"", []) == b""
