"""The cache under trio: the core speaks only anyio, so without CUDA and Redis it runs there too.

These tests run `trio.run` directly (not the asyncio test loop): concurrent requests with
verified KV through L1, L2 and L3, cancellation in the middle of a fetch, and close. What does
not run under trio, and why, is listed in docs/architecture.md ("Concurrency").
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from aiohicache import CacheStats, HiCache
from tests.conftest import make_config, make_tokens
from tests.kvcheck import KVChecker

trio = pytest.importorskip("trio")

SHARED = make_tokens(8, seed=99)
"""A system prompt every request starts with (two pages)."""
PROMPTS = [SHARED + make_tokens(8 + 4 * (s % 3), seed=s) for s in range(12)]


async def serve(cache: HiCache, kv: KVChecker, tokens: list[int]) -> None:
    """One request: verify every cached token, compute the rest, commit, verify again."""
    async with cache.fetch(tokens) as hit:
        await kv.verify_prefix(hit, tokens)
        new = len(tokens) - hit.num_cached_tokens
        if new:
            slots = await hit.allocate(new)
            kv.fill(slots, tokens, hit.num_cached_tokens)
            await hit.commit(tokens, slots)
            await kv.verify_after_commit(hit, tokens)


async def rounds_of_requests(storage: str | None, num_rounds: int = 3,
                             host_pages: int = 32) -> CacheStats:
    """Rounds of concurrent requests on a cache too small for them all: pages move between
    every tier, and every hit is checked. Four requests run at once, as a server's batch
    would bound them (all twelve at once could pin more pages than the device pool has)."""
    config = make_config(device_pages=24, host_pages=host_pages, storage=storage,
                         prefetch_policy="wait_complete", prefetch_threshold=4)
    batch = anyio.CapacityLimiter(4)

    async def in_batch(cache: HiCache, kv: KVChecker, tokens: list[int]) -> None:
        async with batch:
            await serve(cache, kv, tokens)

    async with HiCache(config) as cache:
        kv = KVChecker(cache)
        for _ in range(num_rounds):
            async with anyio.create_task_group() as tg:
                for tokens in PROMPTS:
                    tg.start_soon(in_batch, cache, kv, tokens)
            # NOTE: copies land before the next round, so which pages each tier holds then
            # does not depend on the machine's speed (one slow run once had no L2 hit).
            await cache.drain()
        cache.check_invariants()
        return cache.stats()


def test_concurrent_requests_under_trio_read_only_their_own_kv() -> None:
    # NOTE: L2 holds every page (38), L1 not (24): L2 serves part of each later round however
    # trio orders the tasks (it shuffles them). With 32 host pages L2 hits ranged 16-112 tokens
    # over 40 runs and one run in a loaded CI had none.
    stats = trio.run(rounds_of_requests, None, 3, 48)
    assert stats.requests == 3 * len(PROMPTS)
    assert stats.device_hit_tokens > 0 and stats.host_hit_tokens > 0
    assert stats.health == "ok"


@pytest.mark.parametrize("store", ["memory", "file"])
def test_l3_under_trio_serves_the_right_kv(store: str, tmp_path: Path) -> None:
    url = "memory://" if store == "memory" else f"file://{tmp_path}"
    stats = trio.run(rounds_of_requests, url)
    assert stats.storage is not None and stats.storage.backed_up_pages > 0
    assert stats.storage.errors == 0 and stats.health == "ok"


def test_a_fetch_cancelled_under_trio_leaves_the_cache_consistent() -> None:
    async def main() -> None:
        async with HiCache(make_config(device_pages=24, host_pages=32)) as cache:
            kv = KVChecker(cache)
            for tokens in PROMPTS:
                await serve(cache, kv, tokens)
            # Cancel requests at every point a fetch can wait: most are cancelled mid-flight.
            for delay in (0, 1e-5, 1e-4, 1e-3):
                with trio.move_on_after(delay):
                    async with anyio.create_task_group() as tg:
                        for tokens in PROMPTS[:4]:
                            tg.start_soon(serve, cache, kv, tokens)
            await cache.drain()
            cache.check_invariants()
            for tokens in PROMPTS:  # what survived is still right
                await serve(cache, kv, tokens)
            cache.check_invariants()

    trio.run(main)


def test_close_under_trio_stops_every_task_it_started() -> None:
    async def main() -> None:
        cache = HiCache(make_config())
        await cache.__aenter__()
        await serve(cache, KVChecker(cache), PROMPTS[0])
        with trio.CancelScope() as scope:
            scope.cancel()
            await cache.aclose()  # runs to the end, then the cancellation is seen
        assert "closed" in repr(cache)

    trio.run(main)  # trio fails the run if a system task were still running or had failed
