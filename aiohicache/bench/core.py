"""The core benchmark, three sections side by side in one run (``aiohicache bench core``):

1. CPU page copy (gather/scatter) as a ratio to one contiguous copy of the same bytes;
2. event-loop lag while load-back and write-through run flat out through a real `HiCache`;
3. the ``fetch -> commit`` overhead of a request whose whole prompt is on the device.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio
import numpy as np
import numpy.typing as npt
import torch

from .. import __version__
from ..api import HiCache
from ..config import HiCacheConfig, KVSpec
from ._core_copy import CopyRow, bench_copy
from ._core_format import format_copy, format_hits, format_lag, format_machine, format_report
from ._core_lag import LagResult, bench_loop_lag, prompt, serve
from ._core_sizes import FULL, QUICK, CoreSizes

LoopFactory = Callable[[], asyncio.AbstractEventLoop]

__all__ = ("FULL", "QUICK", "CopyRow", "CoreReport", "CoreSizes", "HitOverhead", "LagResult",
           "format_report", "run_core")

Tokens = list[int] | npt.NDArray[np.int64]


# ---------------------------------------------------------------------- 3. all-L1 hit overhead


@dataclass(frozen=True, slots=True)
class HitOverhead:
    """Section 3: wall time of ``fetch -> commit(nothing new) -> exit`` per request, in µs."""

    prompt_tokens: int
    tokens_as: Literal["list", "ndarray"]
    """What the caller passes: a list of ints (as tokenizers return) or an int64 array."""
    requests: int
    mean_us: float
    p50_us: float
    p99_us: float
    commit_p50_us: float
    """The ``commit`` part alone."""


async def bench_hits(sizes: CoreSizes) -> list[HitOverhead]:
    """Section 3, one row per prompt length and token type. Cancellation: the cache closes."""
    return [await _bench_hit(n, kind, sizes) for n in sizes.hit_prompt_tokens
            for kind in ("list", "ndarray")]


async def _bench_hit(prompt_tokens: int, kind: Literal["list", "ndarray"],
                     sizes: CoreSizes) -> HitOverhead:
    # The all-hit path moves no KV, so a tiny spec keeps the pools small without changing it.
    spec = KVSpec.mha(num_layers=sizes.num_layers, num_kv_heads=1, head_dim=8, dtype="bf16")
    num_pages = -(-prompt_tokens // 16)
    config = HiCacheConfig(spec=spec, page_size=16, device_pages=num_pages,
                           host_pages=num_pages)
    listed = prompt(1, num_pages * 16)  # whole pages: a partial page is never a hit
    tokens: Tokens = listed if kind == "list" else np.array(listed, dtype=np.int64)
    async with HiCache(config) as cache:
        await serve(cache, listed)
        await cache.drain()  # the write-through; later hits start none
        for _ in range(max(10, sizes.hit_requests // 10)):  # warm-up
            await _timed_hit(cache, tokens)
        times = np.array([await _timed_hit(cache, tokens) for _ in range(sizes.hit_requests)])
    total_us, commit_us = times[:, 0] * 1e6, times[:, 1] * 1e6
    p50, p99 = np.percentile(total_us, [50, 99])
    return HitOverhead(prompt_tokens=len(tokens), tokens_as=kind, requests=len(total_us),
                       mean_us=float(total_us.mean()), p50_us=float(p50), p99_us=float(p99),
                       commit_p50_us=float(np.median(commit_us)))


_NO_SLOTS = torch.empty(0, dtype=torch.int64)


async def _timed_hit(cache: HiCache, tokens: Tokens) -> tuple[float, float]:
    """(total, commit) seconds of one all-L1 request."""
    start = time.perf_counter()
    async with cache.fetch(tokens) as hit:
        if hit.num_device_hit_tokens != len(tokens):
            raise RuntimeError(f"bench setup: expected an all-L1 hit, got {hit!r}")
        before = time.perf_counter()
        await hit.commit(tokens, _NO_SLOTS)
        commit = time.perf_counter() - before
    return time.perf_counter() - start, commit


@dataclass(frozen=True, slots=True)
class CoreReport:
    """Everything one run measured (`dataclasses.asdict` gives the JSON form)."""

    machine: dict[str, str | int]
    sizes: CoreSizes
    copy: list[CopyRow]
    loop: LagResult
    hits: list[HitOverhead]


def run_core(sizes: CoreSizes = FULL, *, loop_factory: LoopFactory | None = None,
             echo: Callable[[str], None] | None = None) -> CoreReport:
    """Run the three sections; `echo` gets each section's table as soon as it is measured.

    All three run on one event loop made by `loop_factory` (asyncio's default when None);
    section 1 is synchronous and runs before anything else is on the loop.
    """
    def show(text: str) -> None:
        if echo is not None:
            echo(text)

    return anyio.run(_sections, sizes, show, backend="asyncio",
                     backend_options={"loop_factory": loop_factory})


async def _sections(sizes: CoreSizes, show: Callable[[str], None]) -> CoreReport:
    """Cancellation: the section running stops as its docstring says; nothing is reported."""
    machine = machine_info(asyncio.get_running_loop())
    show(format_machine(machine, sizes))
    copy = bench_copy(sizes)
    show(format_copy(copy, sizes))
    loop = await bench_loop_lag(sizes)
    show(format_lag(loop, sizes))
    hits = await bench_hits(sizes)
    show(format_hits(hits))
    return CoreReport(machine=machine, sizes=sizes, copy=copy, loop=loop, hits=hits)


def machine_info(loop: asyncio.AbstractEventLoop) -> dict[str, str | int]:
    """Versions, CPU, load and the event loop's class, printed above the tables."""
    return {"aiohicache": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count() or 0, "load_avg_1min": f"{os.getloadavg()[0]:.2f}",
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "numpy": np.__version__,
            "loop": f"{type(loop).__module__}.{type(loop).__name__}"}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
