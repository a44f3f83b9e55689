"""``bench storage``: the file backend next to a raw file of the same bytes, and key hashing.

1. `FileBackend` write and read GB/s (pages appended to segment files, a run of pages per
   ``pwritev`` plus its journal entries; reads verified and copied into the caller's
   buffers) as a ratio to one plain sequential file of the same payload bytes in the same
   directory, same fsync policy; with the event-loop lag (p99) while the backend runs;
2. page-key hashing (`chain_keys`) in tokens/s, as a ratio to one blake2b over the same
   token bytes (what hashing alone costs, without a digest per page).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np

from .._lagprobe import LoopLagProbe
from ..errors import ConfigError
from ..storage import _native
from ..storage.base import PageFormat
from ..storage.file import FileBackend
from ..storage.keys import chain_keys, namespace_root

__all__ = ("FULL", "QUICK", "HashRow", "SpeedRow", "StorageReport", "StorageSizes",
           "bench_storage", "format_report", "run_storage_bench")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]

_GB = 1e9
_KIB = 1 << 10
_MIB = 1 << 20
_TARGET_RATIO = 0.8


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageSizes:
    """How much work each section does: `FULL` for numbers, `QUICK` for smoke tests."""

    page_bytes: tuple[int, ...] = (64 * _KIB, _MIB, 8 * _MIB)
    """Payload bytes per page (64 KiB: 16 tokens of a small model; 8 MiB: 64 tokens of an
    8B model at 128 KiB/token)."""
    run_bytes: int = 256 * _MIB
    """Section 1: payload bytes each timed run moves."""
    batch: int = 128
    """Section 1: pages per backend call (SGLang's L3 batch)."""
    reps: int = 5
    """Section 1: timed runs per case, each paired with the raw file back to back."""
    max_concurrency: int = 4
    """Section 1: the backend's I/O threads (its default)."""
    in_flight: int = 1
    """Section 1: backend calls in flight at once (1: each awaited before the next; a server
    prefetching for several requests at once has more)."""
    hash_tokens: int = 1_000_000
    """Section 2: tokens hashed per run."""
    hash_page_sizes: tuple[int, ...] = (16, 64)
    hash_reps: int = 3


FULL = StorageSizes()
QUICK = StorageSizes(page_bytes=(64 * _KIB,), run_bytes=8 * _MIB, batch=32, reps=1,
                     hash_tokens=65_536, hash_reps=1)


@dataclass(frozen=True, slots=True)
class SpeedRow:
    """One case of section 1."""

    page_bytes: int
    op: str
    """``write`` (set_from vs sequential write) or ``read`` (get_into vs sequential read)."""
    gbps: float
    """Payload bytes over the median time of the backend's runs."""
    raw_gbps: float
    """Payload bytes over the median time of the raw file's runs."""
    ratio: float
    """Median over runs of (raw time / backend time), each pair run back to back."""
    loop_p99_ms: float
    """Event-loop lag: the worst of the backend's runs' p99s (an idle loop shows ~0.3 ms on
    2 cores)."""
    runs: int


@dataclass(frozen=True, slots=True)
class HashRow:
    """One page size of section 2."""

    page_size: int
    tokens_per_s: float
    baseline_tokens_per_s: float
    """One blake2b over all the token bytes at once."""
    ratio: float


@dataclass(frozen=True, slots=True)
class StorageReport:
    sizes: StorageSizes
    directory: str
    fsync: bool
    speed: list[SpeedRow]
    hashing: list[HashRow]


def run_storage_bench(quick: bool, in_flight: int = 1) -> str:
    """Run both sections in a temporary directory under /tmp; return the report as text."""
    if in_flight < 1:
        raise ConfigError(f"in_flight must be >= 1, got {in_flight}")
    sizes = dataclasses.replace(QUICK if quick else FULL, in_flight=in_flight)
    return format_report(bench_storage(sizes))


def bench_storage(sizes: StorageSizes = FULL, *, directory: str | None = None,
                  fsync: bool = False, loop_factory: LoopFactory | None = None,
                  echo: Callable[[str], None] | None = None) -> StorageReport:
    """Run both sections; `echo` gets each section's table as soon as it is measured.

    Section 1 works in a fresh temporary directory under `directory` (the system's temp
    directory when None), removed at the end; the raw file runs outside the event loop, the
    backend on a loop made by `loop_factory` (asyncio's default when None).
    """
    parent = tempfile.mkdtemp(prefix="aiohicache-bench-", dir=directory)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            speed: list[SpeedRow] = []
            for page_bytes in sizes.page_bytes:
                speed += _Case(sizes, page_bytes, Path(parent), fsync).measure(runner)
        if echo is not None:
            echo(format_speed(sizes, speed, parent, fsync))
        hashing = bench_hashing(sizes)
        if echo is not None:
            echo(format_hashing(sizes, hashing))
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return StorageReport(sizes, parent, fsync, speed, hashing)


# ---------------------------------------------------------------------------- section 1

class _Case:
    """One page size: the pages, their keys, and paired runs of the backend and raw file."""

    def __init__(self, sizes: StorageSizes, page_bytes: int, parent: Path, fsync: bool) -> None:
        self.sizes = sizes
        self.page_bytes = page_bytes
        self.parent = parent
        self.fsync = fsync
        num = max(1, sizes.run_bytes // page_bytes)
        rng = np.random.default_rng(page_bytes)
        self.pages = [memoryview(rng.bytes(page_bytes)) for _ in range(num)]
        self.buffers = [memoryview(bytearray(page_bytes)) for _ in range(num)]
        root = namespace_root(namespace="bench", spec_fingerprint="bench", page_size=16,
                              layout="page_first")
        tokens = rng.integers(0, 128_000, num * 16, dtype=np.int64)
        self.keys = [digest.hex() for digest in chain_keys(root, tokens, 16)]
        self.fmt = PageFormat.make(namespace="bench", spec_fingerprint="bench", page_size=16,
                                   payload_bytes=page_bytes)

    def measure(self, runner: asyncio.Runner) -> list[SpeedRow]:
        self._rep(runner, "warm-up", num=min(8, len(self.pages)))
        runs = np.array([self._rep(runner, f"rep-{rep}") for rep in range(self.sizes.reps)])
        # columns: raw write, backend write, backend read, raw read, lag write, lag read
        return [self._row("write", runs[:, 1], runs[:, 0], runs[:, 4]),
                self._row("read", runs[:, 2], runs[:, 3], runs[:, 5])]

    def _rep(self, runner: asyncio.Runner, name: str, num: int | None = None) -> list[float]:
        num = num or len(self.pages)
        workdir = self.parent / name
        workdir.mkdir()
        try:
            raw_file = workdir / "raw.bin"
            t_raw_w = _timed(lambda: _raw_write(raw_file, self.pages[:num], self.fsync))
            t_w, t_r, lag_w, lag_r = runner.run(self._backend(workdir / "l3", num))
            t_raw_r = _timed(lambda: _raw_read(raw_file, self.buffers[:num]))
        finally:
            shutil.rmtree(workdir)
        return [t_raw_w, t_w, t_r, t_raw_r, lag_w, lag_r]

    async def _backend(self, root: Path, num: int) -> tuple[float, float, float, float]:
        """Timed writes then reads of `num` pages through a fresh backend.

        Cancellation: the backend closes.
        """
        keys, pages, buffers = self.keys[:num], self.pages[:num], self.buffers[:num]
        async with FileBackend(root, self.fmt, fsync=self.fsync,
                               max_concurrency=self.sizes.max_concurrency) as backend:
            async def write(lo: int, hi: int) -> None:
                ok = await backend.set_from(keys[lo:hi], pages[lo:hi])
                _expect(all(ok), "set_from stored every page")

            async def read(lo: int, hi: int) -> None:
                ok = await backend.get_into(keys[lo:hi], buffers[lo:hi])
                _expect(all(ok), "get_into filled every buffer")

            t_write, lag_write = await self._timed_calls(num, write)
            t_read, lag_read = await self._timed_calls(num, read)
        _expect(buffers[-1] == pages[-1], "a page read back is the page written")
        return t_write, t_read, lag_write, lag_read

    async def _timed_calls(self, num: int,
                           call: Callable[[int, int], Awaitable[None]]) -> tuple[float, float]:
        """Seconds to make `call` on every batch of `num` pages, `in_flight` at a time (each
        of that many tasks awaits every in_flight-th batch in turn), and the loop's p99 lag.

        Cancellation: the tasks are cancelled with the caller.
        """
        spans = [(lo, min(lo + self.sizes.batch, num))
                 for lo in range(0, num, self.sizes.batch)]

        async def lane(first: int) -> None:
            for lo, hi in spans[first::self.sizes.in_flight]:
                await call(lo, hi)

        async with LoopLagProbe() as lag:
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for first in range(min(self.sizes.in_flight, len(spans))):
                    tg.start_soon(lane, first)
            seconds = time.perf_counter() - start
        return seconds, lag.summary().p99_ms

    def _row(self, op: str, t_backend: np.ndarray, t_raw: np.ndarray,
             lag: np.ndarray) -> SpeedRow:
        nbytes = len(self.pages) * self.page_bytes
        return SpeedRow(page_bytes=self.page_bytes, op=op,
                        gbps=nbytes / float(np.median(t_backend)) / _GB,
                        raw_gbps=nbytes / float(np.median(t_raw)) / _GB,
                        ratio=float(np.median(t_raw / t_backend)),
                        loop_p99_ms=float(np.max(lag)), runs=len(t_backend))


def _raw_write(path: Path, pages: list[memoryview], fsync: bool) -> None:
    with open(path, "wb") as f:
        for page in pages:
            f.write(page)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _raw_read(path: Path, buffers: list[memoryview]) -> None:
    with open(path, "rb", buffering=0) as f:
        for buf in buffers:
            _expect(f.readinto(buf) == len(buf), "the raw file reads back whole")


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"bench storage: expected that {what}")


# ---------------------------------------------------------------------------- section 2

def bench_hashing(sizes: StorageSizes) -> list[HashRow]:
    """Best of `hash_reps` runs of `chain_keys` per page size, and of the one-call baseline."""
    tokens = np.random.default_rng(0).integers(0, 128_000, sizes.hash_tokens, dtype=np.int64)
    data = tokens.tobytes()
    base = min(_timed(lambda: _blake2b_once(data)) for _ in range(sizes.hash_reps))
    rows = []
    for page_size in sizes.hash_page_sizes:
        root = namespace_root(namespace="bench", spec_fingerprint="bench",
                              page_size=page_size, layout="page_first")
        t = min(_timed(lambda: _chain(root, tokens, page_size))  # noqa: B023 -- called at once
                for _ in range(sizes.hash_reps))
        rows.append(HashRow(page_size=page_size, tokens_per_s=len(tokens) / t,
                            baseline_tokens_per_s=len(tokens) / base, ratio=base / t))
    return rows


def _blake2b_once(data: bytes) -> None:
    hashlib.blake2b(data, digest_size=16).digest()


def _chain(root: bytes, tokens: np.ndarray, page_size: int) -> None:
    chain_keys(root, tokens, page_size)


# ---------------------------------------------------------------------------- report

def format_report(report: StorageReport) -> str:
    """Both sections as plain text."""
    return "\n".join([format_speed(report.sizes, report.speed, report.directory, report.fsync),
                      format_hashing(report.sizes, report.hashing)])


def format_speed(sizes: StorageSizes, rows: list[SpeedRow], directory: str,
                 fsync: bool) -> str:
    preset = dataclasses.replace(sizes, in_flight=1)
    mode = "quick" if preset == QUICK else "full" if preset == FULL else "custom"
    policy = ("fsync on: each page (and its directory) vs the raw file once at its end"
              if fsync else "fsync off for both (writes land in the page cache)")
    return "\n".join([
        f"aiohicache bench storage ({mode}): python {platform.python_version()}, "
        f"{os.cpu_count()} cores, in {os.path.dirname(directory)}",
        "",
        "1. FileBackend vs one raw sequential file of the same payload bytes, same directory",
        f"   {policy}; reads hit the page cache for both",
        f"   reads: {_reader_name()}",
        f"   {sizes.run_bytes // _MIB} MiB per run into a fresh store, {sizes.batch} pages per "
        f"call, {sizes.in_flight} call{'s' if sizes.in_flight > 1 else ''} in flight, "
        f"{sizes.max_concurrency} I/O threads",
        f"   ratio: median over {sizes.reps} back-to-back pairs of raw time / backend time, "
        f"target >= {_TARGET_RATIO} ('<': a miss)",
        "",
        "   page KiB  op     backend GB/s  raw GB/s  ratio   loop p99 ms",
        *(_speed_line(row) for row in rows),
        "",
    ])


def _reader_name() -> str:
    if _native.SPAN_READER is not None:
        return "the native span reader (storage/_spanread.c)"
    return "in Python (the native span reader is not built, or AIOHICACHE_NATIVE=0)"


def _speed_line(row: SpeedRow) -> str:
    miss = "<" if row.ratio < _TARGET_RATIO else " "
    return (f"   {row.page_bytes // _KIB:>8}  {row.op:<5}  {row.gbps:>12.2f}  "
            f"{row.raw_gbps:>8.2f}  {row.ratio:>5.2f}{miss}  {row.loop_p99_ms:>10.2f}")


def format_hashing(sizes: StorageSizes, rows: list[HashRow]) -> str:
    return "\n".join([
        f"2. Page keys: chain_keys over {sizes.hash_tokens:,} int64 tokens (one blake2b-128 "
        "per page, chained)",
        f"   vs one blake2b over the same bytes; best of {sizes.hash_reps}",
        "",
        "   page    M tokens/s   baseline M tokens/s  ratio",
        *(f"   {row.page_size:>4}  {row.tokens_per_s / 1e6:>12.1f}  "
          f"{row.baseline_tokens_per_s / 1e6:>20.1f}  {row.ratio:>5.2f}" for row in rows),
        "",
    ])
