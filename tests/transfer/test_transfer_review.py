"""The CPU transfer engine and the memory layer under attack (a review).

- an engine handed to `HiCache` must copy between the cache's own pools: one built on other
  pools moved the loaded KV into pools nobody reads, and the cache served whatever its own
  device pages held (another prefix's KV);
- a cancelled `CpuTransferEngine.aclose()` still stops both copy threads, as it promises.
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from aiohicache import ConfigError, CpuTransferEngine, HiCache, HiCacheConfig, KVSpec
from aiohicache.memory import DevicePool, HostPool, PageIds
from aiohicache.transfer import TransferHandle
from tests.conftest import make_config, make_tokens
from tests.kvcheck import KVChecker
from tests.test_api import evict_all

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bf16")


# --- an engine must copy between the cache's own pools ------------------------------------


def pools_like(config: HiCacheConfig) -> tuple[DevicePool, HostPool]:
    """A device and a host pool of `config`'s shape, that are not any cache's pools."""
    return (DevicePool(config.spec, num_pages=config.device_pages, page_size=config.page_size),
            HostPool(config.spec, num_pages=config.host_capacity_pages,
                     page_size=config.page_size, layout=config.host_layout))


async def serve(cache: HiCache, kv: KVChecker, tokens: list[int]) -> None:
    """Fetch `tokens`, check every cached slot holds their KV, compute and commit the rest."""
    async with cache.fetch(tokens) as hit:
        await kv.verify_prefix(hit, tokens)
        if new := len(tokens) - hit.num_cached_tokens:
            slots = await hit.allocate(new)
            kv.fill(slots, tokens, hit.num_cached_tokens)
            await hit.commit(tokens, slots)


async def reload_after_another_prefix(cache: HiCache) -> None:
    """A to the host, B through the same device pages, A loaded back and verified."""
    kv = KVChecker(cache)
    a, b = make_tokens(16, seed=1), make_tokens(16, seed=2)
    await serve(cache, kv, a)
    await evict_all(cache)
    await serve(cache, kv, b)
    await evict_all(cache)
    await serve(cache, kv, a)  # loaded back from the host: must be A's KV, or a miss


async def test_an_engine_instance_on_other_pools_is_refused_when_the_cache_opens() -> None:
    """`engine=` takes an engine; one built before the cache cannot hold the cache's pools
    (they are made by `HiCache()`). It copied between its own pools, so a load-back left the
    cache's device pages as they were and A's fetch was served B's KV (correct-or-miss)."""
    config = make_config(write_policy="write_back")
    cache = HiCache(config, engine=CpuTransferEngine(*pools_like(config)))
    with pytest.raises(ConfigError, match="engine"):
        async with cache:
            await reload_after_another_prefix(cache)


async def test_an_engine_factory_that_ignores_the_pools_it_is_given_is_refused() -> None:
    """A factory is called with the cache's pools; an engine it returns on other pools is
    refused as an instance is (it served another prefix's KV)."""
    config = make_config(write_policy="write_back")
    cache = HiCache(config, engine=lambda _d, _h: CpuTransferEngine(*pools_like(config)))
    with pytest.raises(ConfigError, match="engine"):
        async with cache:
            await reload_after_another_prefix(cache)


async def test_an_engine_attached_to_the_caches_pools_before_opening_still_works() -> None:
    """Binding an engine instance to `cache.device_pool`/`cache.host_pool` before opening
    (the pattern the test engines use) is accepted and serves the right KV."""
    config = make_config(write_policy="write_back")
    engine = CpuTransferEngine(*pools_like(config))
    cache = HiCache(config, engine=engine)
    CpuTransferEngine.__init__(engine, cache.device_pool, cache.host_pool)
    async with cache:
        await reload_after_another_prefix(cache)
        await cache.drain()
        cache.check_invariants()


# --- aclose, cancelled, still stops the copy threads ---------------------------------------


class GatedLoads(CpuTransferEngine):
    """The CPU engine, every copy on its threads; loads wait on `gate` before copying."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool, inline_bytes=0)
        self.gate = threading.Event()
        self.gate.set()

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        if to_device:
            self.gate.wait()
        super()._run(src, dst, handle, to_device)


def copy_threads(engine: CpuTransferEngine) -> list[threading.Thread]:
    """The engine's live copy threads (load and write)."""
    return [t for stream in (engine._load, engine._write)
            for t in stream.executor._threads if t.is_alive()]


async def started_engine() -> GatedLoads:
    """An engine whose load and write threads both exist (each ran one copy)."""
    engine = GatedLoads(DevicePool(SPEC, num_pages=8, page_size=4),
                        HostPool(SPEC, num_pages=8, page_size=4))
    await engine.write(np.arange(4), np.arange(4)).wait()
    await engine.load(np.arange(4), np.arange(4)).wait()
    assert len(copy_threads(engine)) == 2
    return engine


async def wait_threads_gone(engine: CpuTransferEngine) -> None:
    """Give the engine's copy threads a second each to stop; fail if one is still alive."""
    def join() -> None:
        for thread in copy_threads(engine):
            thread.join(timeout=1)
    await anyio.to_thread.run_sync(join)
    assert not copy_threads(engine), "copy threads still running after aclose"


async def test_aclose_in_a_cancelled_scope_still_stops_both_copy_threads() -> None:
    """aclose: "Cancellation: the threads are still shut down". Called where the scope is
    already cancelled (a shutdown path under a timeout), it shut nothing down and marked
    the engine closed, so a second aclose did nothing either: two threads leaked."""
    engine = await started_engine()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await engine.aclose()
    await engine.aclose()
    await wait_threads_gone(engine)


async def test_aclose_cancelled_while_a_load_is_in_flight_still_stops_the_write_thread() -> None:
    """Cancelled while it waited for the load thread's copy, aclose went no further: the
    load copy completed and its thread stopped, but the write thread was never shut down."""
    engine = await started_engine()
    engine.gate.clear()
    engine.host_pool.data.fill_(1)
    handle = engine.load(np.arange(4), np.arange(4))
    scope = anyio.CancelScope()

    async def close() -> None:
        with scope:
            await engine.aclose()
    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
        await anyio.wait_all_tasks_blocked()  # aclose waits for the load thread's copy
        scope.cancel()
        engine.gate.set()
    await handle.wait()  # the copy in flight completed
    assert bool((engine.device_pool.data[:, :, :4] == 1).all())
    await engine.aclose()
    await wait_threads_gone(engine)
