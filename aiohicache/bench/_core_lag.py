"""Section 2 of ``bench core``: event-loop lag while load-back and write-through run flat
out through a real `HiCache`, beside the floor of two plain copy threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch

from .._lagprobe import GcPauses, LagSummary, LoopLagProbe, quiet_runtime
from ..api import CacheStats, FetchContext, HiCache
from ..config import HiCacheConfig
from ..errors import CapacityError
from ._core_sizes import GB, MIB, CoreSizes, spec_of


@dataclass(frozen=True, slots=True)
class LagResult:
    """Section 2: loop lag while readers load back and writers write through, and what moved."""

    lag: LagSummary
    floor: LagSummary
    """The same probe while two threads do plain contiguous copies and the loop idles: what
    the machine alone costs (CPU and GIL hand-offs), without the cache."""
    seconds: float
    """From the first request to the last copy settled."""
    loop_busy: float
    """CPU time of the loop thread / `seconds`."""
    gc_collections: int
    gc_max_ms: float
    loaded_bytes: int
    written_bytes: int
    gbps: float
    """(loaded + written bytes) / seconds."""
    requests: int
    device_hit_tokens: int
    host_hit_tokens: int
    miss_tokens: int
    capacity_waits: int
    """Allocations that found every device page pinned or in flight and waited for a copy."""


class _Traffic:
    """Readers cycle through `old` prompts, which are kept larger than the device so each
    revisit is an L1 miss and an L2 hit (a load-back); writers insert new prompts, which write
    through on commit. Every request awaits its layers one by one, as a forward pass would.
    """

    def __init__(self, cache: HiCache, sizes: CoreSizes) -> None:
        self.cache = cache
        self.sizes = sizes
        prompt_pages = sizes.prompt_tokens // cache.config.page_size
        # 1.5x the device (so LRU revisits always miss L1) but at most half the host.
        num_old = min(3 * sizes.device_pages // (2 * prompt_pages),
                      sizes.host_pages // (2 * prompt_pages))
        self.old = [prompt(seed, sizes.prompt_tokens) for seed in range(num_old)]
        self._next_old = 0
        self._next_new = num_old
        self.capacity_waits = 0

    async def populate(self) -> None:
        """Insert the old prompts, let them reach the host, and push them off the device.
        Their allocation waits are set-up, not counted in `capacity_waits`."""
        for tokens in self.old:
            await serve(self.cache, tokens)
        await _evict_device(self.cache)

    async def run(self, deadline: float) -> None:
        """Run readers and writers until `deadline` (perf_counter).

        Cancellation: cancels every reader and writer; their fetch contexts unpin.
        """
        async with anyio.create_task_group() as tg:
            for _ in range(self.sizes.readers):
                tg.start_soon(self._worker, self._old_prompt, deadline)
            for _ in range(self.sizes.writers):
                tg.start_soon(self._worker, self._new_prompt, deadline)

    async def _worker(self, next_prompt: Callable[[], list[int]], deadline: float) -> None:
        while time.perf_counter() < deadline:
            self.capacity_waits += await serve(self.cache, next_prompt())

    def _old_prompt(self) -> list[int]:
        tokens = self.old[self._next_old % len(self.old)]
        self._next_old += 1
        return tokens

    def _new_prompt(self) -> list[int]:
        self._next_new += 1
        return prompt(self._next_new, self.sizes.prompt_tokens)


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids that share no page with any other seed's."""
    return list(range(seed * 1_000_003, seed * 1_000_003 + num_tokens))


async def serve(cache: HiCache, tokens: list[int]) -> int:
    """One request as a server runs it: fetch, read layer by layer, compute and commit the
    rest (no KV is computed here: the bench measures the cache, not a model).

    Returns how often allocation had to wait for in-flight copies.

    Cancellation: the fetch context unpins; a write-through already queued goes on.
    """
    async with cache.fetch(tokens) as hit:
        for layer in range(cache.config.spec.num_layers):
            await hit.layer_ready(layer)
        new = len(tokens) - hit.num_cached_tokens
        if not new:
            return 0
        slots, waits = await _allocate(cache, hit, new)
        await hit.commit(tokens, slots)
        return waits


async def _allocate(cache: HiCache, hit: FetchContext, num_tokens: int) -> tuple[torch.Tensor, int]:
    """`hit.allocate`, retried after each settled copy while copies are in flight.

    Cancellation: nothing is leased.
    """
    waits = 0
    while True:
        try:
            return await hit.allocate(num_tokens), waits
        except CapacityError:
            # NOTE: in write-through mode allocate() does not wait for WRITING nodes (it only
            # waits for write-backs), so under a burst of commits the device can be all pinned
            # or in flight for a moment. Wait for the next copy to settle, then retry.
            if cache.controller.idle:
                raise
            waits += 1
            await cache.controller.wait_settled()


async def _evict_device(cache: HiCache) -> None:
    """Push every unpinned page off the device (to host-only) by leasing the whole pool."""
    await cache.drain()
    slots = await cache.allocate(cache.device_pool.num_slots)
    cache.free(slots)


async def bench_loop_lag(sizes: CoreSizes) -> LagResult:
    """Section 2 (see `_Traffic`), then the floor (see `LagResult.floor`).

    NOTE: both run under `quiet_runtime` (heap frozen after warm-up, GIL switch interval
    0.5 ms, no automatic full collection), as a long-running server sets itself up after
    start-up: otherwise a full collection walks every object torch and numpy created at
    import (about 70 ms here), and worker threads keep the GIL up to 5 ms per hand-off.

    Cancellation: the traffic stops, the cache closes (shielded) and the heap is unfrozen.
    """
    config = HiCacheConfig(spec=spec_of(sizes.num_layers), page_size=16,
                           device_pages=sizes.device_pages, host_pages=sizes.host_pages,
                           write_policy="write_through")
    async with HiCache(config) as cache:
        traffic = _Traffic(cache, sizes)
        await traffic.populate()
        before = cache.stats()
        with quiet_runtime():
            run = await _measure(cache, traffic, sizes.lag_seconds)
        after = cache.stats()
        cache.check_invariants()  # the bench doubles as a soak test of the core
    with quiet_runtime():  # the floor under the same settings
        floor = await _lag_floor(sizes.lag_seconds / 3)
    return _lag_result(run, floor, before, after, traffic.capacity_waits)


@dataclass(frozen=True, slots=True)
class _Run:
    lag: LagSummary
    seconds: float
    loop_cpu: float
    gc: GcPauses


async def _measure(cache: HiCache, traffic: _Traffic, seconds: float) -> _Run:
    with GcPauses() as pauses:
        async with LoopLagProbe() as probe:
            start, cpu = time.perf_counter(), time.thread_time()
            await traffic.run(start + seconds)
            await cache.drain()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - start
    return _Run(lag=probe.summary(), seconds=wall, loop_cpu=cpu, gc=pauses)


def _lag_result(run: _Run, floor: LagSummary, before: CacheStats, after: CacheStats,
                capacity_waits: int) -> LagResult:
    loaded = after.loaded_bytes - before.loaded_bytes
    written = after.written_bytes - before.written_bytes
    return LagResult(
        lag=run.lag, floor=floor, seconds=run.seconds, loop_busy=run.loop_cpu / run.seconds,
        gc_collections=run.gc.count, gc_max_ms=run.gc.max_ms, loaded_bytes=loaded,
        written_bytes=written, gbps=(loaded + written) / run.seconds / GB,
        requests=after.requests - before.requests,
        device_hit_tokens=after.device_hit_tokens - before.device_hit_tokens,
        host_hit_tokens=after.host_hit_tokens - before.host_hit_tokens,
        miss_tokens=after.miss_tokens - before.miss_tokens, capacity_waits=capacity_waits)


async def _lag_floor(seconds: float) -> LagSummary:
    """Loop lag while two threads (like the CPU engine's load and write streams) copy 16 MiB
    buffers flat out, GIL released, and the loop does nothing else.

    Cancellation: the threads are told to stop; each ends after its current copy.
    """
    stop = threading.Event()

    def copy_until_stopped() -> None:
        src = torch.ones(16 * MIB, dtype=torch.uint8)
        dst = torch.empty_like(src)
        while not stop.is_set():
            dst.copy_(src)

    async with LoopLagProbe() as probe, anyio.create_task_group() as tg:
        for _ in range(2):
            # The threads cannot be abandoned (anyio waits for them), and they end on `stop`.
            tg.start_soon(anyio.to_thread.run_sync, copy_until_stopped)
        try:
            await anyio.sleep(seconds)
        finally:
            stop.set()
    return probe.summary()
