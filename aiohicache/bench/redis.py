"""``bench redis``: `RedisBackend` next to a raw redis-py pipeline of the same pages, one run.

1. write and read GB/s of the backend (header, xxh3 checksum, copy into the caller's
   buffers) and of plain SET / GET pipelines of the bare payloads, as a ratio;
2. event-loop lag while pages are backed up (and restored) flat out, both ways.

It starts its own ``redis-server`` on a free loopback port (redis-server must be installed).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import redis
from redis.asyncio import Redis

from .._lagprobe import LagSummary, LoopLagProbe
from .._redis_server import RedisServer
from ..storage.base import PageFormat
from ..storage.redis import RedisBackend

__all__ = ("FULL", "QUICK", "LagRow", "RedisSizes", "SpeedRow", "run_redis_bench")

_GB = 1e9
_KIB = 1 << 10
_TARGET_RATIO = 0.7


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisSizes:
    """How much work each section does: `FULL` for numbers, `QUICK` for smoke tests."""

    page_bytes: tuple[int, ...] = (64 << 10, 1 << 20)
    """Payload bytes per page (64 KiB: 16 tokens of a small model; 1 MiB: a large page)."""
    batch: int = 128
    """Pages per call (and per raw pipeline): SGLang's L3 batch."""
    reps: int = 7
    """Section 1: timed runs per case, each paired with the raw pipeline back to back."""
    lag_seconds: float = 2.0
    """Section 2: how long each line runs (the idle floor: half as long)."""
    tasks: int = 2
    """Section 2: concurrent tasks, each sending whole batches back to back."""


FULL = RedisSizes()
QUICK = RedisSizes(page_bytes=(64 << 10,), batch=32, reps=2, lag_seconds=0.2)


@dataclass(frozen=True, slots=True)
class SpeedRow:
    """One case of section 1."""

    page_bytes: int
    op: str
    """``write`` (set_from vs pipelined SET) or ``read`` (get_into vs pipelined GET)."""
    gbps: float
    """Payload bytes over the median time of the backend's call."""
    raw_gbps: float
    """Payload bytes over the median time of the raw pipeline paired with it."""
    ratio: float
    """Median over runs of (raw time / backend time), each pair run back to back."""
    runs: int


@dataclass(frozen=True, slots=True)
class LagRow:
    """One line of section 2: loop lag while `tasks` tasks move batches flat out."""

    name: str
    lag: LagSummary
    gbps: float | None
    """Payload bytes moved per second (None for the idle floor)."""


def run_redis_bench(quick: bool) -> str:
    """Run both sections on a private redis-server; return the report as text."""
    sizes = QUICK if quick else FULL
    with RedisServer() as server:
        # redis-py is asyncio-only: this bench runs on asyncio
        rows, lags = anyio.run(_run, server.url(), sizes, backend="asyncio")
    return _format(sizes, rows, lags)


async def _run(url: str, sizes: RedisSizes) -> tuple[list[SpeedRow], list[LagRow]]:
    """Cancellation: the clients close."""
    rows: list[SpeedRow] = []
    for page_bytes in sizes.page_bytes:
        async with _Pair(url, page_bytes, sizes.batch) as pair:
            rows += await pair.speed(sizes.reps)
    async with _Pair(url, max(sizes.page_bytes), sizes.batch) as pair:
        lags = await pair.lag(sizes.lag_seconds, sizes.tasks)
    return rows, lags


Op = Callable[[int], Coroutine[Any, Any, None]]
"""One batch; the argument picks the batch's keys (one set per concurrent task)."""


class _Pair:
    """The backend and a raw client on one server, with one batch of pages to move."""

    def __init__(self, url: str, page_bytes: int, batch: int) -> None:
        self.page_bytes = page_bytes
        self.batch = batch
        fmt = PageFormat.make(namespace="bench", spec_fingerprint="bench", page_size=16,
                              payload_bytes=page_bytes)
        self.backend = RedisBackend(url, fmt)
        self.raw = Redis.from_url(url)
        rng = np.random.default_rng(0)
        self.pages = [memoryview(rng.bytes(page_bytes)) for _ in range(batch)]
        self.buffers = [memoryview(bytearray(page_bytes)) for _ in range(batch)]

    async def __aenter__(self) -> _Pair:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.backend.aclose()
        await self.raw.aclose()

    def keys(self, task: int) -> list[str]:
        return [f"{task:08x}{i:024x}" for i in range(self.batch)]

    async def write(self, task: int) -> None:
        stored = await self.backend.set_from(self.keys(task), self.pages)
        _expect(all(stored), "set_from stored every page")

    async def read(self, task: int) -> None:
        filled = await self.backend.get_into(self.keys(task), self.buffers)
        _expect(all(filled), "get_into filled every buffer")

    async def raw_write(self, task: int) -> None:
        pipe = self.raw.pipeline(transaction=False)
        for key, page in zip(self.keys(task), self.pages, strict=True):
            pipe.set(f"raw:{key}", page)
        await pipe.execute()

    async def raw_read(self, task: int) -> None:
        pipe = self.raw.pipeline(transaction=False)
        for key in self.keys(task):
            pipe.get(f"raw:{key}")
        _expect(all(v is not None for v in await pipe.execute()), "GET found every page")

    async def speed(self, reps: int) -> list[SpeedRow]:
        """Section 1 for this page size. Cancellation: nothing to undo."""
        write = await self._paired(self.write, self.raw_write, reps)
        read = await self._paired(self.read, self.raw_read, reps)
        return [self._row("write", *write), self._row("read", *read)]

    async def _paired(self, op: Op, raw: Op, reps: int) -> tuple[np.ndarray, np.ndarray]:
        await raw(0)
        await op(0)  # warm-up: connections, first-touch of server memory
        times = [(await _timed(op), await _timed(raw)) for _ in range(reps)]
        pairs = np.array(times)
        return pairs[:, 0], pairs[:, 1]

    def _row(self, op: str, t_op: np.ndarray, t_raw: np.ndarray) -> SpeedRow:
        nbytes = self.batch * self.page_bytes
        return SpeedRow(page_bytes=self.page_bytes, op=op,
                        gbps=nbytes / float(np.median(t_op)) / _GB,
                        raw_gbps=nbytes / float(np.median(t_raw)) / _GB,
                        ratio=float(np.median(t_raw / t_op)), runs=len(t_op))

    async def lag(self, seconds: float, tasks: int) -> list[LagRow]:
        """Section 2. Cancellation: the tasks are cancelled."""
        cases = [("backup: set_from", self.write), ("raw SET pipeline", self.raw_write),
                 ("restore: get_into", self.read), ("raw GET pipeline", self.raw_read)]
        rows = [await self._lag_row(name, op, seconds, tasks) for name, op in cases]
        return [*rows, await _idle_row(seconds / 2)]

    async def _lag_row(self, name: str, op: Op, seconds: float, tasks: int) -> LagRow:
        async with anyio.create_task_group() as tg:  # the reads need the keys
            for task in range(tasks):
                tg.start_soon(op, task)
        deadline = time.perf_counter() + seconds
        batches = [0] * tasks

        async def flat_out(task: int) -> None:
            while time.perf_counter() < deadline:
                await op(task)
                batches[task] += 1

        async with LoopLagProbe() as probe:
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for task in range(tasks):
                    tg.start_soon(flat_out, task)
            wall = time.perf_counter() - start
        moved = sum(batches) * self.batch * self.page_bytes
        return LagRow(name=name, lag=probe.summary(), gbps=moved / wall / _GB)


async def _idle_row(seconds: float) -> LagRow:
    """The floor: the same probe while the loop has nothing else to do."""
    async with LoopLagProbe() as probe:
        await anyio.sleep(seconds)
    return LagRow(name="floor: idle loop", lag=probe.summary(), gbps=None)


async def _timed(op: Op) -> float:
    start = time.perf_counter()
    await op(0)
    return time.perf_counter() - start


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"bench redis: expected that {what}")


# ---------------------------------------------------------------------- report


def _format(sizes: RedisSizes, rows: list[SpeedRow], lags: list[LagRow]) -> str:
    mode = "quick" if sizes == QUICK else "full" if sizes == FULL else "custom"
    return "\n".join([
        f"aiohicache bench redis ({mode}): python {platform.python_version()}, redis-py "
        f"{redis.__version__}, a private redis-server on loopback",
        "",
        "1. RedisBackend vs a raw redis-py pipeline of the same payloads (no header, no",
        f"   checksum, no copy into buffers); {sizes.batch} pages per call; ratio: median "
        f"over {sizes.reps} back-to-back pairs",
        f"   of raw time / backend time; target >= {_TARGET_RATIO} ('<' marks a miss)",
        "",
        "   page KiB  op      backend GB/s  raw GB/s  ratio",
        *(_speed_line(row) for row in rows),
        "",
        f"2. Event-loop lag with {sizes.tasks} tasks moving {max(sizes.page_bytes) // _KIB} "
        f"KiB pages flat out, {sizes.lag_seconds:g} s each",
        "",
        "   (the floor is what this machine costs an idle loop: timer and scheduler noise)",
        "",
        "                        samples   p50 ms   p99 ms   max ms   GB/s",
        *(_lag_line(row) for row in lags),
        "",
    ])


def _speed_line(row: SpeedRow) -> str:
    miss = "<" if row.ratio < _TARGET_RATIO else ""
    return (f"   {row.page_bytes // _KIB:>8}  {row.op:<5}  {row.gbps:>12.2f}  "
            f"{row.raw_gbps:>8.2f}  {row.ratio:>5.2f}{miss}")


def _lag_line(row: LagRow) -> str:
    lag = row.lag
    gbps = "-" if row.gbps is None else f"{row.gbps:.2f}"
    return (f"   {row.name:<20}{lag.samples:>8}  {lag.p50_ms:>7.3f}  {lag.p99_ms:>7.3f}  "
            f"{lag.max_ms:>7.3f}  {gbps:>5}")
