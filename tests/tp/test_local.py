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

from aiohicache import (
    CapacityError,
    ClosedError,
    ConfigError,
    FetchContext,
    HiCache,
    PageError,
    WorkerError,
)
from aiohicache.controller import page_format
from aiohicache.distributed import TPGroup
from aiohicache.errors import DivergenceError, RankTimeoutError
from aiohicache.memory import PageIds
from aiohicache.storage import MemoryBackend
from aiohicache.storage.faults import FaultyBackend

from ..conftest import SPEC_MLA, fill_kv, make_config, make_tokens, until
from ..test_cancellation import SETTLE_LIMIT, GatedEngine, assert_kv

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


def caches_differing_in(size: int, **per_rank: list[Any]) -> list[HiCache]:
    groups = TPGroup.local(size, timeout=2.0)
    return [HiCache(make_config(tp_rank=r, tp_size=size, tp_timeout=2.0,
                                **{k: v[r] for k, v in per_rank.items()}), tp_group=groups[r])
            for r in range(size)]


@pytest.mark.parametrize("per_rank,group", [
    ({"eviction": ["lru", "arc"]}, "policies"),
    ({"write_policy": ["write_through", "write_back"]}, "policies"),
    ({"storage": ["memory://", None]}, "storage"),
    ({"prefetch_threshold": [256, 64], "storage": ["memory://", "memory://"]},
     "storage"),
    ({"page_size": [4, 8]}, "pages and capacities"),
])
async def test_ranks_configured_differently_stop_at_the_first_call_naming_what_differs(
        per_rank: dict[str, list[Any]], group: str) -> None:
    """A policy acts only when it evicts, and storage only on a miss: the ranks would agree
    for a while, then drift apart (or wait for each other forever) far from the cause."""
    caches = caches_differing_in(2, **per_rank)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache:
            with pytest.raises(DivergenceError, match=f"configs differ in {group}"):
                await serve(cache, make_tokens(16))
            assert cache.stats().health == "failed"

    await on_ranks(caches, rank)


async def test_ranks_may_differ_in_their_device_and_storage_location(tmp_path: Any) -> None:
    caches = caches_differing_in(2, storage=[f"file://{tmp_path}/a", f"file://{tmp_path}/b"],
                                 transfer_ctas=[4, 2], tp_tick_interval=[0.002, 0.001])
    async with opened(caches):
        assert await on_ranks(caches, lambda r, c: serve(c, make_tokens(16))) == [0, 0]
        assert await on_ranks(caches, lambda r, c: serve(c, make_tokens(16))) == [16, 16]


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


async def test_an_allocate_run_after_its_context_was_left_leases_nothing() -> None:
    """Another task left the context before the tick ran its `allocate`: the pages that
    tick leased were not among the leases the exit had taken, so they stayed leased for
    good, on every rank."""
    caches = tp_caches(2)

    async def rank(r: int, cache: HiCache) -> object:
        hit = cache.fetch(make_tokens(4, seed=9))
        await hit.__aenter__()
        allocating = asyncio.ensure_future(hit.allocate(8))
        await asyncio.sleep(0)  # its op is in the log
        await hit.__aexit__(None, None, None)  # the release follows it
        (outcome,) = await asyncio.gather(allocating, return_exceptions=True)
        await serve(cache, make_tokens(8, seed=77))  # a tick: the release runs
        return outcome

    async with opened(caches):
        outcomes = await on_ranks(caches, rank)
        assert_same(caches)
        assert all(c.stats().device_pages_leased == 0 for c in caches)
        assert all(isinstance(o, ClosedError) for o in outcomes), outcomes


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


async def test_a_commit_cancelled_then_left_commits_on_every_rank() -> None:
    """A timeout cancels `commit`, then the request leaves its context: on rank 0 the
    cancellation lands just after the tick that ran the commit, on rank 1 just before it,
    so rank 1 left the context before its tick. The commit then checked the context's pin,
    which leaving drops at once: rank 1 refused the commit rank 0 made, and they diverged."""
    caches = tp_caches(2)
    tokens = make_tokens(12)
    async with opened(caches):
        hits = [cache.fetch(tokens) for cache in caches]
        await on_ranks(caches, lambda r, c: hits[r].__aenter__())
        release, all_held = hold_ticks(caches)  # from the tick after the next one
        slots = await on_ranks(caches, lambda r, c: hits[r].allocate(12))
        for cache, got in zip(caches, slots, strict=True):
            fill_kv(cache, got, tokens)
        await until(all_held)
        commits = [asyncio.ensure_future(hit.commit(tokens, got))
                   for hit, got in zip(hits, slots, strict=True)]
        await until(lambda: all(len(c._tp._log) == 1 for c in caches))  # type: ignore[union-attr]
        commits[1].cancel()  # before its tick (it returns once the tick has run it) ...
        await asyncio.sleep(0)
        await hits[1].__aexit__(None, None, None)  # ... and left before it, by another task
        caches[0]._tp.on_tick.append(lambda _: commits[0].cancel())  # type: ignore[union-attr]
        release.set()  # rank 0: cancelled just after the tick that ran its commit
        for commit in commits:
            with pytest.raises(asyncio.CancelledError):
                await commit
        await hits[0].__aexit__(None, None, None)
        cached = await on_ranks(caches, lambda r, c: serve(c, tokens))
        assert cached == [12, 12]  # committed on every rank
        assert_same(caches)
        assert all(c.stats().device_pages_leased == 0 for c in caches)


MLA_L3: dict[str, Any] = {"spec": SPEC_MLA, "prefetch_threshold": 4, "backup_threshold": 1}


async def mla_store(tokens: list[int]) -> MemoryBackend:
    """An L3 store holding `tokens`' MLA pages, shared by all ranks (and TP sizes): filled
    from a 1-rank cache."""
    store = MemoryBackend(page_format(make_config(**MLA_L3)))
    async with HiCache(make_config(storage=store, **MLA_L3)) as filler:
        await serve(filler, tokens)
        await serve(filler, tokens)  # a hit: write-through, then backup
        await filler.drain()
    assert filler.stats().storage is not None and filler.stats().storage["backed_up_pages"] > 0
    return store


async def test_cancel_a_fetch_waiting_for_its_prefetch() -> None:
    """Both TP ranks wait for a slow prefetch and are cancelled while they wait."""
    tokens = make_tokens(32, seed=5)
    slow = FaultyBackend(await mla_store(tokens), seed=0, latency=(0.3, 0.3))
    caches = tp_caches(2, storage=slow, prefetch_policy="wait_complete", **MLA_L3)
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


# ------------------------------------------------------------------------------ failures

class LoadsFail(GatedEngine):
    """Every load fails once its gate opens."""

    def _run(self, src: PageIds, dst: PageIds, handle: Any, to_device: bool) -> None:
        if not to_device:
            super()._run(src, dst, handle, to_device)
            return
        self.loads.wait()
        handle.bridge.call_soon(handle._finish, OSError("load failed"))


def hold_ticks(caches: list[HiCache]) -> tuple[asyncio.Event, Callable[[], bool]]:
    """Hold every rank's ticker before its next wait for news (an idle ticker already
    waiting: after its next tick) until the returned event is set; the callable says
    whether all of them are held."""
    release, held = asyncio.Event(), [False] * len(caches)
    for r, cache in enumerate(caches):
        consensus = cache._tp
        assert consensus is not None

        async def wait(busy: bool, r: int = r, news: Any = consensus._wait_for_news) -> None:
            held[r] = True
            await release.wait()
            await news(busy)
        consensus._wait_for_news = wait  # type: ignore[method-assign]
    return release, lambda: all(held)


async def test_a_copy_failed_on_one_rank_stops_every_rank_at_the_same_tick() -> None:
    """Rank 0's load fails, rank 1's lands. The tick that settled them recorded the failure
    on rank 0 only (a settle records it), and ran the next fetch there too: rank 0 refused
    it while rank 1 served it; the ranks only agreed on the failure one tick later."""
    groups = TPGroup.local(2, timeout=10.0)
    engines = [LoadsFail(), GatedEngine()]
    caches = [HiCache(make_config(tp_rank=r, tp_size=2, tp_timeout=10.0), engine=engines[r],
                      tp_group=groups[r]) for r in range(2)]
    for engine, cache in zip(engines, caches, strict=True):
        engine.attach(cache)
    loaded = make_tokens(8, seed=1)

    async def host_only(r: int, cache: HiCache) -> None:
        await serve(cache, loaded)
        await cache.drain()
        cache.free(await cache.allocate(cache.device_pool.num_slots))  # evicts to the host

    async with opened(caches):
        await on_ranks(caches, host_only)
        for engine in engines:
            engine.loads.clear()
        hits = [cache.fetch(loaded) for cache in caches]
        await on_ranks(caches, lambda r, c: hits[r].__aenter__())  # the loads are in flight
        release, all_held = hold_ticks(caches)
        await until(all_held)
        for engine in engines:
            engine.loads.set()
        await until(lambda: all(e.load_handles[0].done() for e in engines))
        fetches = [asyncio.ensure_future(c.fetch(make_tokens(8, seed=2)).__aenter__())
                   for c in caches]
        await until(lambda: all(len(c._tp._log) == 1 for c in caches))  # type: ignore[union-attr]
        release.set()  # one tick settles both loads and runs both fetches
        got = await asyncio.gather(*fetches, return_exceptions=True)
        for hit in [*hits, *(g for g in got if isinstance(g, FetchContext))]:
            await hit.__aexit__(None, None, None)
        assert [type(g) for g in got] == [WorkerError, WorkerError]


async def test_drain_returns_after_the_consensus_failed_with_l3_io_in_flight() -> None:
    """Prefetches and backups wait for the tick to agree on their results; once the tick
    has stopped (here: the ranks diverged) none ever comes, so `drain()` waited for ever."""
    tokens = make_tokens(32, seed=5)
    slow = FaultyBackend(await mla_store(tokens), seed=0, latency=(0.3, 0.3))
    caches = tp_caches(2, timeout=2.0, storage=slow, prefetch_policy="best_effort", **MLA_L3)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache.fetch(tokens) as hit:  # best effort: its prefetch goes on
            assert hit.num_cached_tokens == 0
        with pytest.raises(DivergenceError):
            await serve(cache, make_tokens(16, seed=2 + r))
        async with asyncio.timeout(SETTLE_LIMIT):
            await cache.drain()
        cache.check_invariants()

    async with opened(caches):
        await on_ranks(caches, rank)


async def test_prompts_of_the_same_bytes_in_other_dtypes_differ_by_rank() -> None:
    """Ids are kept as int32 where they fit: 32 small ids on one rank and 16 ids past int32
    on the other are the same bytes, and still two prompts the ranks disagree on."""
    small = np.arange(1, 33, dtype=np.int64)
    wide = (small[0::2] + (small[1::2] << 32)).tolist()  # each id >= 2**32: kept as int64
    caches = tp_caches(2, timeout=2.0)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache:
            async with cache.fetch(small.tolist() if r == 0 else wide) as hit:
                await hit.ready()
            with pytest.raises(DivergenceError, match="not the same sequence"):
                await serve(cache, make_tokens(16, seed=1))
                await serve(cache, make_tokens(8, seed=9))

    await on_ranks(caches, rank)
