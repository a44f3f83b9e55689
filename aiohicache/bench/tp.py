"""What the TP consensus tick costs a scheduler step, side by side in one run.

For each TP size, that many processes join a gloo group on this machine. Every rank then
measures, in the same process and run:

- the bare collective: `TPGroup.all_reduce_min` of one tick vector (thread hop included);
- a scheduler step on a TP cache: a batch of fetches that all hit L1 (`async with fetch`),
  entered together and then left, which is one or two ticks;
- the same steps on a single-rank cache (no consensus at all).

The overhead per step is the difference of the last two. Rank 0's numbers are printed; the
ranks wait for each other, so they see the same step times.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import time
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

__all__ = ("TPBenchResult", "bench_tp", "format_tp")


@dataclass(frozen=True, slots=True)
class TPBenchResult:
    ranks: int
    steps: int
    batch: int
    allreduce_us: float
    step_us_tp: float
    step_us_single: float
    ticks_per_step: float

    @property
    def overhead_us(self) -> float:
        return self.step_us_tp - self.step_us_single


def bench_tp(ranks: list[int], *, steps: int = 300, batch: int = 8) -> list[TPBenchResult]:
    """Run the benchmark for each TP size in `ranks` (each in fresh processes)."""
    return [_run_size(n, steps, batch) for n in ranks]


def _run_size(size: int, steps: int, batch: int) -> TPBenchResult:
    ctx = mp.get_context("spawn")
    queue: Any = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, steps, batch, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    by_rank = {r["rank"]: r for r in results}
    if "error" in by_rank[0]:
        raise RuntimeError(by_rank[0]["error"])
    return TPBenchResult(**by_rank[0]["result"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, size: int, port: int, steps: int, batch: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=120))
    try:
        result = anyio.run(_measure, rank, size, steps, batch, backend="asyncio")
        queue.put({"rank": rank, "result": result})
    except Exception as exc:  # reported to the parent, which raises it
        queue.put({"rank": rank, "error": repr(exc)})


async def _measure(rank: int, size: int, steps: int, batch: int) -> dict[str, Any]:
    from ..api import HiCache
    from ..config import HiCacheConfig, KVSpec
    from ..controller._consensus import _Layout
    from ..distributed import TPGroup

    group = TPGroup.new(timeout=120)
    vector = np.zeros(_Layout.SIZE, dtype=np.int64)
    for _ in range(50):
        await group.all_reduce_min(vector)
    start = time.perf_counter()
    for _ in range(steps):
        await group.all_reduce_min(vector)
    allreduce_us = (time.perf_counter() - start) / steps * 1e6

    spec = KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16")
    prompts = [np.arange(i * 1000, i * 1000 + 256, dtype=np.int64) for i in range(batch)]

    def config(tp: bool) -> HiCacheConfig:
        return HiCacheConfig(spec=spec, page_size=16, device_pages=batch * 32, host_pages=0,
                             tp_rank=rank if tp else 0, tp_size=size if tp else 1)

    async with HiCache(config(True), tp_group=group) as cache:
        await _steps(cache, prompts, 20)  # fill L1
        assert cache._tp is not None
        ticks = cache._tp.ticks
        step_us_tp = await _steps(cache, prompts, steps)
        ticks_per_step = (cache._tp.ticks - ticks) / steps
    async with HiCache(config(False)) as cache:
        await _steps(cache, prompts, 20)
        step_us_single = await _steps(cache, prompts, steps)
    group.close()
    return {"ranks": size, "steps": steps, "batch": batch, "allreduce_us": allreduce_us,
            "step_us_tp": step_us_tp, "step_us_single": step_us_single,
            "ticks_per_step": ticks_per_step}


async def _steps(cache: Any, prompts: list[np.ndarray], steps: int) -> float:
    """Scheduler steps: enter a fetch per prompt (committing misses), then leave them all."""
    start = time.perf_counter()
    for _ in range(steps):
        contexts = [cache.fetch(p) for p in prompts]
        async with anyio.create_task_group() as tg:  # entered together, as a batch would
            for ctx in contexts:
                tg.start_soon(ctx.__aenter__)
        for ctx, tokens in zip(contexts, prompts, strict=True):
            if ctx.num_cached_tokens < len(tokens):
                slots = await ctx.allocate(len(tokens) - ctx.num_cached_tokens)
                await ctx.commit(tokens, slots)
        for ctx in contexts:
            await ctx.__aexit__(None, None, None)
    return (time.perf_counter() - start) / steps * 1e6


def format_tp(results: list[TPBenchResult]) -> str:
    lines = ["TP consensus tick overhead (gloo on this machine; one scheduler step = "
             f"{results[0].batch} L1-hit fetches entered together, then left)",
             "ranks  all-reduce µs  step µs (TP)  step µs (1 rank)  overhead µs/step  ticks/step"]
    for r in results:
        lines.append(f"{r.ranks:5d}  {r.allreduce_us:13.1f}  {r.step_us_tp:12.1f}  "
                     f"{r.step_us_single:16.1f}  {r.overhead_us:15.1f}  {r.ticks_per_step:10.2f}")
    return "\n".join(lines)
