"""Correct-or-miss under misuse and races: each case here once served wrong KV, leaked a pin
or hung. Every one must now be a miss, a clear error, or a wait for the bytes to land.

KV is written by `fill_kv` (derived from token ids, layers and k/v) and every hit is compared
bit-exactly with what was computed for its tokens (`assert_kv`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from aiohicache import (
    ClosedError,
    ConfigError,
    FetchContext,
    HiCache,
    InvariantError,
    PageError,
    WorkerError,
)
from aiohicache.memory import PageIds
from tests.conftest import fill_kv, make_cache, make_config, make_tokens, prefill, until
from tests.test_cancellation import (
    SEQS,
    SETTLE_LIMIT,
    GatedEngine,
    assert_clean,
    assert_kv,
    evict_all,
    gated_cache,
    host_only,
    launch,
)

PS = 4  # page size of make_config


def pages_of(slots: torch.Tensor) -> set[int]:
    return {int(s) // PS for s in slots}


# ------------------------------------------------------------------------ commit over a load

async def test_commit_over_a_prefix_another_request_is_loading_waits_for_that_load() -> None:
    """A fetches S+X with nothing cached. Meanwhile S is computed by C, written through,
    evicted to the host, and B's fetch of S starts loading it back. When A commits S+X, its
    own pages for S are duplicates of the LOADING node: A's prefix now reads that load's
    pages, so `ready`/`layer_ready` must wait for it, then serve exactly S's KV."""
    s, x = make_tokens(8, seed=1), make_tokens(4, seed=2)
    async with gated_cache() as (cache, engine):
        async with cache.fetch(s + x) as a:
            assert a.num_cached_tokens == 0
            await host_only(cache, s)  # C computed S; it was written through, then evicted
            engine.loads.clear()
            async with cache.fetch(s) as b:
                assert b.num_host_hit_tokens == len(s)  # B's load-back of S is in flight
                slots = await a.allocate(len(s + x))
                fill_kv(cache, slots, s + x)
                await a.commit(s + x, slots)
                assert a.num_cached_tokens == len(s + x)
                waits = [asyncio.ensure_future(a.ready()),
                         asyncio.ensure_future(a.layer_ready(0))]
                await anyio.wait_all_tasks_blocked()
                assert not any(w.done() for w in waits), "ready() before S's load landed"
                engine.loads.set()
                await asyncio.gather(*waits)
                assert_kv(cache, a, s + x)
                assert_kv(cache, b, s)
        await assert_clean(cache)


# ------------------------------------------------------------------------ leases and pages

async def test_allocate_after_the_partial_page_was_freed_starts_a_fresh_page() -> None:
    """`hit.allocate` must not continue a partial page the context no longer leases: after
    `cache.free` of it, the page may be leased to someone else."""
    cache = make_cache()
    async with cache:
        async with cache.fetch(make_tokens(6)) as hit:
            first = await hit.allocate(2)  # half a page: the next allocate would continue it
            cache.free(first)
            others = await cache.allocate(cache.device_pool.num_slots)  # the freed page too
            cache.free(others[-PS:])  # leave exactly one free page
            second = await hit.allocate(2)
            assert not pages_of(second) & pages_of(others[:-PS]), "slots in another's page"
            cache.free(others[:-PS])
            fill_kv(cache, second, [1, 2])
            cache.check_invariants()
        await assert_clean(cache)


async def test_commit_refuses_slots_leased_by_another_context() -> None:
    cache = make_cache()
    async with cache:
        tokens = make_tokens(8)
        async with cache.fetch(tokens) as a, cache.fetch(tokens) as b:
            theirs = await b.allocate(8)
            with pytest.raises(PageError, match="another request"):
                await a.commit(tokens, theirs)
            cache.check_invariants()
        await assert_clean(cache)


@pytest.mark.parametrize("num_tokens", [8, 6], ids=["page-twice", "page-again-as-tail"])
async def test_commit_refuses_slots_that_name_a_page_twice(num_tokens: int) -> None:
    """Slots naming one page twice (a whole page again, or again as the partial tail) once
    put a page in the tree that the context then freed: the next request to allocate it
    overwrote the cached prefix. Now it is a `PageError` and nothing changes."""
    cache = make_cache()
    async with cache:
        tokens = make_tokens(num_tokens)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(PS)
            fill_kv(cache, slots, tokens[:PS])
            twice = torch.cat([slots, slots[:num_tokens - PS]])
            with pytest.raises(PageError, match="name a page twice"):
                await hit.commit(tokens, twice)
            assert hit.num_cached_tokens == 0
            cache.check_invariants()
        await assert_clean(cache)
        await prefill(cache, make_tokens(PS * 3, seed=5))  # takes any page freed by mistake
        async with cache.fetch(tokens) as hit:
            assert hit.num_cached_tokens == 0  # nothing of the refused commit was cached
        await prefill(cache, tokens)
        async with cache.fetch(tokens) as hit:
            assert hit.num_cached_tokens == PS * (num_tokens // PS)
            assert_kv(cache, hit, tokens)
        await assert_clean(cache)


async def test_a_failing_insert_keeps_the_slots_leased_and_frees_them_on_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases end only after `tree.insert` succeeded: a crash inside it loses no page."""
    cache = make_cache()
    async with cache:
        tokens = make_tokens(8)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(8)

            def broken(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("insert crashed")
            with monkeypatch.context() as m:
                m.setattr(cache.tree, "insert", broken)
                with pytest.raises(RuntimeError):
                    await hit.commit(tokens, slots)
            assert cache.stats().device_pages_leased == 2
            cache.check_invariants()
        await assert_clean(cache)


# ------------------------------------------------------------------------ the tokens committed

async def test_decode_appending_to_the_fetched_list_commits_the_list_as_it_is_now() -> None:
    cache = make_cache()
    async with cache:
        tokens = make_tokens(6)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(6)
            fill_kv(cache, slots, tokens)
            await hit.commit(tokens, slots)
            for _ in range(3):  # decode: append to the very list that was fetched
                tokens.append(tokens[-1] + 1)
                slot = await hit.allocate(1)
                fill_kv(cache, slot, tokens[-1:])
                await hit.commit(tokens, _after_cached(hit, slots, slot))
                slots = torch.cat([slots, slot])
        async with cache.fetch(tokens) as again:
            assert again.num_cached_tokens == 8
            assert_kv(cache, again, tokens)


def _after_cached(hit: FetchContext, slots: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The slots of every token after the context's cached prefix (the partial page's)."""
    return torch.cat([slots, new])[hit.num_cached_tokens:]


async def test_a_fetched_list_edited_in_place_is_refused_not_committed_as_it_was() -> None:
    cache = make_cache()
    async with cache:
        tokens = make_tokens(8)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(8)
            tokens[5] = 999_999  # the caller reuses its buffer before committing
            fill_kv(cache, slots, tokens)
            with pytest.raises(ConfigError, match="tokens"):
                await hit.commit(tokens, slots)
        async with cache.fetch(make_tokens(8)) as original:
            assert original.num_cached_tokens == 0, "committed the tokens as they were"
        await assert_clean(cache)


@pytest.mark.parametrize("make", [
    lambda ids: ids,
    lambda ids: np.array(ids, dtype=np.uint64),
    lambda ids: torch.from_numpy(np.array(ids, dtype=np.uint64)),
], ids=["list", "numpy-uint64", "torch-uint64"])
async def test_token_ids_beyond_int64_are_refused_not_wrapped(make: Any) -> None:
    """2**63 + i would wrap to -2**63 + i as int64 and hit KV committed for those ids."""
    cache = make_cache()
    async with cache:
        wrapped = [-(2**63) + i for i in range(8)]
        await prefill(cache, wrapped)
        with pytest.raises(ConfigError, match="int64"):
            cache.fetch(make([2**63 + i for i in range(8)]))
        await assert_clean(cache)


@pytest.mark.parametrize("tokens", [[[1, 2], [3]], [[1, 2], [3, 4]], [1.5, 2.0], ["a"]])
async def test_malformed_token_lists_are_config_errors(tokens: Any) -> None:
    cache = make_cache()
    async with cache:
        with pytest.raises(ConfigError, match="tokens"):
            cache.fetch(tokens)


# ------------------------------------------------------------------------ the context's lifetime

async def test_entering_a_context_twice_is_refused_and_leaks_no_pin() -> None:
    cache = make_cache()
    async with cache:
        await prefill(cache, make_tokens(8))
        ctx = cache.fetch(make_tokens(8))
        async with ctx:
            with pytest.raises(ClosedError, match="entered once"):
                async with ctx:
                    pass
            cache.check_invariants()
        with pytest.raises(ClosedError, match="entered once"):
            async with ctx:
                pass
        await assert_clean(cache)


async def test_a_context_holds_one_pin_and_the_check_counts_them() -> None:
    cache = make_cache()
    async with cache:
        async with cache.fetch(make_tokens(8)) as hit:
            with pytest.raises(InvariantError, match="pinned already"):
                cache._core.pins.pin(hit._req, None)
            pin, hit._req.pin = hit._req.pin, None  # as if the context forgot its pin: a leak
            with pytest.raises(InvariantError, match="outlives"):
                cache.check_invariants()
            hit._req.pin = pin
        cache.check_invariants()


@pytest.mark.parametrize("wait", ["ready", "layer_ready"])
async def test_waiting_on_a_context_after_its_block_is_a_closed_error(wait: str) -> None:
    cache = make_cache()
    async with cache:
        await prefill(cache, make_tokens(8))
        async with cache.fetch(make_tokens(8)) as hit:
            pass
        with pytest.raises(ClosedError):
            await (hit.ready() if wait == "ready" else hit.layer_ready(0))


async def test_an_allocate_finishing_after_its_context_was_left_leases_nothing() -> None:
    """`hit.allocate` waits for write-backs while another task leaves the context (a gather
    whose other branch raised): the pages it leased afterwards belonged to a context that
    was gone, so nothing ever freed them. Now it is refused and leases nothing."""
    async with gated_cache(write_policy="write_back", device_pages=4) as (cache, engine):
        for tokens in SEQS[:4]:
            await prefill(cache, tokens)  # the device is full of KV that exists nowhere else
        engine.writes.clear()
        hit = cache.fetch(make_tokens(4, seed=99))
        await hit.__aenter__()
        allocating = asyncio.ensure_future(hit.allocate(8))  # stages write-backs, waits
        await anyio.wait_all_tasks_blocked()
        await hit.__aexit__(None, None, None)
        engine.writes.set()
        (outcome,) = await asyncio.gather(allocating, return_exceptions=True)
        await assert_clean(cache)  # nothing stays leased
        assert isinstance(outcome, ClosedError), outcome


# ------------------------------------------------------------------------ hangs

async def test_a_request_cancelled_while_waiting_for_queue_room_returns_at_once() -> None:
    """With the load queue full, a fetch under a timeout must not wait for room until the
    copies ahead of it finish: its load is launched past the queue and it returns now."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, *SEQS)
        engine.loads.clear()
        contexts = []
        for tokens in SEQS:  # fill the load queue until a fetch has to wait for room
            flight = await launch(cache.fetch(tokens).__aenter__(), "asyncio.timeout")
            if not flight.task.done():
                break
            contexts.append(flight.task.result())
        else:
            pytest.fail("the load queue never filled up")
        flight.cancel()
        async with asyncio.timeout(1):  # the copies ahead are still held at the gate
            await flight.cancelled()
        engine.loads.set()
        for ctx in contexts:
            await ctx.ready()
            assert_kv(cache, ctx, list(ctx.tokens))
            await ctx.__aexit__(None, None, None)
        await assert_clean(cache)


class FailingWrites(GatedEngine):
    def _run(self, src: PageIds, dst: PageIds, handle: Any, to_device: bool) -> None:
        if to_device:
            super()._run(src, dst, handle, to_device)
            return
        handle.bridge.call_soon(handle._finish, OSError("write failed"))


async def test_allocate_waiting_for_a_failed_write_back_raises_instead_of_hanging() -> None:
    engine = FailingWrites()
    cache = HiCache(make_cache(write_policy="write_back").config, engine=engine)
    engine.attach(cache)
    async with cache:
        for seed in range(4):  # fill the device with nodes that have no host copy
            await prefill(cache, make_tokens(16, seed=seed))
        with pytest.raises(WorkerError):
            async with asyncio.timeout(2):
                await cache.allocate(cache.device_pool.num_slots)
        assert cache.stats().health == "failed"


async def test_a_crash_inside_settle_fails_the_cache_instead_of_restarting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A settle that raises half way leaves nodes LOADING for good: no restart, health
    "failed", every later call refused, and the cache still closes."""
    cache = make_cache()
    async with cache:
        tokens = make_tokens(8)
        await prefill(cache, tokens)
        await evict_all(cache)
        with monkeypatch.context() as m:
            m.setattr(cache.tree, "end_load", lambda node: (_ for _ in ()).throw(
                RuntimeError("settle crashed")))
            async with cache.fetch(tokens) as hit:
                assert hit.num_host_hit_tokens == 8
                await until(lambda: cache.stats().health == "failed")
        stats = cache.stats()
        assert stats.worker_restarts == 0
        with pytest.raises(WorkerError):
            await cache.allocate(1)
        with pytest.raises(WorkerError):
            async with cache.fetch(tokens):
                pass
    with pytest.raises(ClosedError):
        await cache.allocate(1)


def _crash(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("settle crashed")


async def test_allocate_waiting_for_write_backs_raises_when_the_settle_worker_dies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The settle worker crashing (no restart: the cache fails) woke the waiters for settles
    but not the operations waiting for news: an allocate waiting for the write-backs it had
    staged hung instead of raising."""
    cache = make_cache(write_policy="write_back")
    async with cache:
        for seed in range(4):  # fill the device with nodes that have no host copy
            await prefill(cache, make_tokens(16, seed=seed))
        monkeypatch.setattr(cache.tree, "end_write", _crash)
        with pytest.raises(WorkerError):
            async with asyncio.timeout(SETTLE_LIMIT):
                await cache.allocate(cache.device_pool.num_slots)
        assert cache.stats().health == "failed"


class WritesFailOnDemand(GatedEngine):
    """Loads wait at their gate; once `fail_writes` is set, every write fails."""

    fail_writes = False

    def _run(self, src: PageIds, dst: PageIds, handle: Any, to_device: bool) -> None:
        if to_device or not self.fail_writes:
            super()._run(src, dst, handle, to_device)
            return
        handle.bridge.call_soon(handle._finish, OSError("write failed"))


async def test_closing_a_failed_cache_launches_the_loads_still_queued() -> None:
    """A failed cache does not drain on close, and the workers stop: loads still in the
    queue were never launched, so `ready()` on them hung for ever, and so did a fetch
    waiting for room in the queue. Now the close launches them."""
    engine = WritesFailOnDemand()
    cache = HiCache(make_config(max_inflight_loads=1, max_inflight_writes=1), engine=engine)
    engine.attach(cache)
    await cache.__aenter__()
    try:
        await host_only(cache, *SEQS[:5])
        engine.loads.clear()
        flights = []
        for tokens in SEQS[:5]:  # fill the load queue until a fetch has to wait for room
            flights.append(await launch(cache.fetch(tokens).__aenter__(), "task.cancel"))
            if not flights[-1].task.done():
                break
        *entered, waiting = flights
        assert not waiting.task.done() and len(engine.load_handles) < len(entered)
        engine.fail_writes = True
        await prefill(cache, make_tokens(4, seed=50))  # its write-through fails
        await until(lambda: cache.stats().health == "failed")
    finally:
        closing = asyncio.ensure_future(cache.aclose())
        await anyio.wait_all_tasks_blocked()  # the copies in flight hold the close
        engine.open_gates()
        await closing
    async with asyncio.timeout(SETTLE_LIMIT):
        for flight in entered:
            hit = flight.task.result()
            await hit.ready()
            await hit.__aexit__(None, None, None)
        await (await waiting.task).__aexit__(None, None, None)
