"""Tensor parallelism inside one event loop (`TPGroup.local`): the consensus rules, fast.

The same code runs as with gloo (tests/tp/test_tp.py covers real processes); only the
transport of the all-reduce differs. Each test drives every rank with the same calls, as a TP
scheduler does, and checks that the ranks end in the same state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from aiohicache import CapacityError, ConfigError, HiCache, PageError
from aiohicache.controller import page_format
from aiohicache.distributed import TPGroup
from aiohicache.errors import DivergenceError, RankTimeoutError
from aiohicache.storage import MemoryBackend
from aiohicache.storage.faults import FaultyBackend

from ..conftest import SPEC_MLA, fill_kv, make_config, make_tokens
from ..test_cancellation import assert_kv

RankFn = Callable[[int, HiCache], Awaitable[Any]]


def tp_caches(size: int, *, timeout: float = 10.0, **overrides: Any) -> list[HiCache]:
    groups = TPGroup.local(size, timeout=timeout)
    return [HiCache(make_config(tp_rank=r, tp_size=size, tp_timeout=timeout, **overrides),
                    tp_group=groups[r]) for r in range(size)]


@contextlib.asynccontextmanager
async def opened(caches: list[HiCache]) -> AsyncIterator[list[HiCache]]:
    for cache in caches:
        await cache.__aenter__()
    try:
        yield caches
    finally:
        await asyncio.gather(*(c.aclose() for c in caches))


async def on_ranks(caches: list[HiCache], fn: RankFn) -> list[Any]:
    return await asyncio.gather(*(fn(r, c) for r, c in enumerate(caches)))


def assert_same(caches: list[HiCache]) -> None:
    for cache in caches:
        cache.check_invariants()
    prints = {c.tree.fingerprint(pages=True) for c in caches}
    assert len(prints) == 1, "ranks differ"
    core = {(s.requests, s.device_hit_tokens, s.host_hit_tokens, s.device_pages_used,
             s.host_pages_used, s.device_pages_leased) for s in (c.stats() for c in caches)}
    assert len(core) == 1


async def serve(cache: HiCache, tokens: list[int]) -> int:
    """One request as a scheduler runs it: fetch, compute the rest, commit."""
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        cached = hit.num_cached_tokens
        if len(tokens) > cached:
            slots = await hit.allocate(len(tokens) - cached)
            fill_kv(cache, slots, tokens[cached:])
            await hit.commit(tokens, slots)
        return cached


# ------------------------------------------------------------------------------ configuration

def test_tp_size_above_one_needs_a_group() -> None:
    with pytest.raises(ConfigError, match="tp_group"):
        HiCache(make_config(tp_rank=0, tp_size=2))


def test_group_must_match_the_configured_rank() -> None:
    groups = TPGroup.local(2)
    with pytest.raises(ConfigError, match="tp_group: is rank 1 of 2"):
        HiCache(make_config(tp_rank=0, tp_size=2), tp_group=groups[1])
    with pytest.raises(ConfigError, match="must be a TPGroup"):
        HiCache(make_config(tp_rank=0, tp_size=2), tp_group=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value", [("tp_timeout", 0), ("tp_timeout", -1.0),
                                         ("tp_tick_interval", -0.1)])
def test_bad_tp_settings_are_config_errors(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        make_config(**{field: value})


async def test_single_rank_group_is_a_no_op() -> None:
    group = TPGroup.single()
    values = np.arange(5, dtype=np.int64)
    assert (await group.all_reduce_min(values) == values).all()
    async with HiCache(make_config(), tp_group=group) as cache:
        assert cache._tp is None  # the plain single-process path
        assert await serve(cache, make_tokens(16)) == 0
        assert await serve(cache, make_tokens(16)) == 16


# ------------------------------------------------------------------------------ agreement

@pytest.mark.parametrize("size", [2, 3])
async def test_ranks_make_identical_decisions_tick_by_tick(size: int) -> None:
    caches = tp_caches(size, device_pages=12, host_pages=16)
    seen: list[list[str]] = [[] for _ in caches]

    async def rank(r: int, cache: HiCache) -> list[int]:
        async with cache:
            assert cache._tp is not None
            cache._tp.on_tick.append(lambda t: seen[r].append(cache.tree.fingerprint(pages=True)))
            hits = [await serve(cache, make_tokens(20 + 4 * (i % 4), seed=i % 3))
                    for i in range(30)]
            await cache.drain()
            stats = cache.stats()
            assert stats.pending_loads == stats.pending_writes == 0
            return hits

    results = await on_ranks(caches, rank)
    assert all(r == results[0] for r in results)
    assert sum(results[0]) > 0
    assert all(s == seen[0] for s in seen) and len(seen[0]) > 10
    s = caches[0].stats()
    assert s.host_hit_tokens > 0 and s.device_evicted_pages > 0  # all paths ran
    assert s.tp is not None and s.tp["ticks"] == len(seen[0])


async def test_capacity_errors_are_the_same_on_every_rank() -> None:
    caches = tp_caches(2, device_pages=4)

    async def rank(r: int, cache: HiCache) -> str:
        async with cache:
            with pytest.raises(CapacityError):
                await cache.allocate(5 * 4)  # more than the pool holds
            slots = await cache.allocate(16)
            with pytest.raises(CapacityError, match="cannot allocate"):
                await cache.allocate(4)  # every page leased
            cache.free(slots)
            await cache.allocate(4)
            return cache.tree.fingerprint(pages=True)

    a, b = await on_ranks(caches, rank)
    assert a == b


async def test_calls_that_differ_by_rank_raise_divergence_error() -> None:
    caches = tp_caches(2, timeout=2.0)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache:
            await serve(cache, make_tokens(16, seed=1))
            with pytest.raises(DivergenceError, match="not the same sequence"):
                await serve(cache, make_tokens(16, seed=2 + r))  # same shape, other tokens
                await serve(cache, make_tokens(8, seed=9))
            assert cache.stats().health == "failed"

    await on_ranks(caches, rank)


async def test_a_rank_that_stops_calling_times_the_others_out() -> None:
    caches = tp_caches(2, timeout=0.5)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache:
            await serve(cache, make_tokens(8))
            if r == 1:
                await asyncio.sleep(1.5)  # alive, but never makes the next call
                return
            with pytest.raises(RankTimeoutError, match="consensus tick"):
                await serve(cache, make_tokens(8, seed=2))
            with pytest.raises(RankTimeoutError):  # and it stays failed, visibly
                await serve(cache, make_tokens(8, seed=3))
            assert cache.stats().health == "failed"

    await on_ranks(caches, rank)


# ------------------------------------------------------------------------------ misuse
# With TP a call's effects wait for the next tick; `free` must still take effect at once for
# the calls after it on the same rank, as it does without TP.

async def test_commit_after_free_of_its_slots_is_refused_on_every_rank() -> None:
    """It once inserted the freed pages into the tree (the free ran first at the tick), and
    the next request to allocate them overwrote the cached prefix."""
    caches = tp_caches(2, device_pages=8)
    tokens, other = make_tokens(8), make_tokens(8, seed=3)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(8)
            fill_kv(cache, slots, tokens)
            cache.free(slots)
            with pytest.raises(PageError, match="freed"):
                await hit.commit(tokens, slots)
        assert await serve(cache, other) == 0  # allocates the freed pages
        assert await serve(cache, tokens) == 0  # the refused commit cached nothing
        async with cache.fetch(tokens) as hit:
            assert hit.num_cached_tokens == 8
            assert_kv(cache, hit, tokens)

    async with opened(caches):
        await on_ranks(caches, rank)
        assert_same(caches)


async def test_allocate_after_free_of_the_partial_page_starts_a_fresh_page() -> None:
    """`hit.allocate` once continued a partial page whose free was still waiting for its
    tick: the page then went back to the pool while the context wrote into it."""
    caches = tp_caches(2, device_pages=4)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache.fetch(make_tokens(6)) as hit:
            first = await hit.allocate(2)  # half a page
            cache.free(first)
            second = await hit.allocate(2)
            others = await cache.allocate(cache.device_pool.num_slots - 4)  # the rest
            assert not {int(s) // 4 for s in second} & {int(s) // 4 for s in others}
            cache.free(others)
        await serve(cache, make_tokens(4, seed=9))  # a tick: the frees run

    async with opened(caches):
        await on_ranks(caches, rank)
        assert_same(caches)
        assert all(c.stats().device_pages_leased == 0 for c in caches)


async def test_a_second_free_before_the_tick_is_a_double_free() -> None:
    caches = tp_caches(2)

    async def rank(r: int, cache: HiCache) -> None:
        slots = await cache.allocate(8)
        cache.free(slots)
        with pytest.raises(PageError, match="double free"):
            cache.free(slots)
        with pytest.raises(PageError, match="double free"):
            cache.free(slots[4:])
        await serve(cache, make_tokens(4, seed=9))  # a tick: the first free runs, once

    async with opened(caches):
        await on_ranks(caches, rank)
        assert_same(caches)
        assert all(c.stats().device_pages_leased == 0 for c in caches)


# ------------------------------------------------------------------------------ cancellation

async def cancel_on_every_rank(caches: list[HiCache], start: RankFn,
                               *, after: float = 0.0) -> None:
    """Start the same call on every rank, cancel it at the same point, then let it settle."""
    async def rank(r: int, cache: HiCache) -> None:
        task = asyncio.ensure_future(start(r, cache))
        await asyncio.sleep(after)
        assert not task.done(), "the call finished before it could be cancelled"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await serve(cache, make_tokens(8, seed=77))  # the cache keeps working
        await cache.drain()

    await on_ranks(caches, rank)
    assert_same(caches)
    for cache in caches:
        assert cache.stats().device_pages_leased == 0


async def test_cancel_a_queued_fetch() -> None:
    caches = tp_caches(2)
    async with opened(caches):
        async def enter(r: int, cache: HiCache) -> None:
            async with cache.fetch(make_tokens(16)):
                await asyncio.sleep(10)
        await cancel_on_every_rank(caches, enter)
        assert all(not c._pins for c in caches)


async def test_cancel_an_allocate_in_flight() -> None:
    caches = tp_caches(2)
    async with opened(caches):
        await cancel_on_every_rank(caches, lambda r, c: c.allocate(8))


async def test_cancel_a_commit_in_flight() -> None:
    caches = tp_caches(2)
    async with opened(caches):
        async def commit(r: int, cache: HiCache) -> None:
            tokens = make_tokens(12)
            async with cache.fetch(tokens) as hit:
                slots = await hit.allocate(12)
                fill_kv(cache, slots, tokens)
                await hit.commit(tokens, slots)
        await cancel_on_every_rank(caches, commit, after=0.0)


async def test_cancel_a_fetch_waiting_for_its_prefetch() -> None:
    """MLA pages in L3 are shared by all ranks (and TP sizes): fill L3 from a 1-rank cache,
    then make both TP ranks wait for a slow prefetch and cancel them while they wait."""
    cfg: dict[str, Any] = {"spec": SPEC_MLA, "prefetch_threshold": 4, "backup_threshold": 1}
    store = MemoryBackend(page_format(make_config(**cfg)))
    tokens = make_tokens(32, seed=5)
    async with HiCache(make_config(storage=store, **cfg)) as filler:
        await serve(filler, tokens)
        await serve(filler, tokens)  # a hit: write-through, then backup
        await filler.drain()
    assert filler.stats().storage is not None and filler.stats().storage["backed_up_pages"] > 0
    slow = FaultyBackend(store, seed=0, latency=(0.3, 0.3))
    caches = tp_caches(2, storage=slow, prefetch_policy="wait_complete", **cfg)
    async with opened(caches):
        async def enter(r: int, cache: HiCache) -> None:
            async with cache.fetch(tokens):
                pass
        await cancel_on_every_rank(caches, enter, after=0.1)
        hits = await on_ranks(caches, lambda r, c: serve(c, tokens))
        assert hits[0] == hits[1] == 32  # the prefetch went on and serves later requests
        assert caches[0].stats().storage["prefetched_pages"] == 8  # type: ignore[index]


async def test_close_is_agreed_and_leaves_nothing_running() -> None:
    caches = tp_caches(2)

    async def rank(r: int, cache: HiCache) -> None:
        await cache.__aenter__()
        await serve(cache, make_tokens(40))
        await cache.aclose()
        assert cache._tp is not None and cache._tp.finished.done()

    await on_ranks(caches, rank)
    assert caches[0]._tp.ticks == caches[1]._tp.ticks  # type: ignore[union-attr]
