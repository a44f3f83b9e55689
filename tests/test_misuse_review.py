"""Review: misuse that users of async serving frameworks commit with the public API.

A cache belongs to the event loop that opened it (its workers run there): used from another
loop (asyncio.run twice; a session-scoped fixture's cache in a test's own loop) or another
thread, a call must raise a clear error, never half-work, hang or race the loop. Found:

- a fetch or allocate on another loop ran, unchecked: a load or write-back it queued waits
  for workers that never run there (a hit's `ready()` hung for ever);
- `aclose()` of a cache whose loop ended without closing it (asyncio.run returned) waited
  its full drain minute for copies nobody would settle;
- `cache.events()` from another loop moved every stream's flushes onto that loop; once it
  ended, every commit on the cache's own loop failed (`RuntimeError: Event loop is closed`)
  and leaked its pages (`check_invariants` failed);
- `cache.free(slots)` from a framework's thread changed the leases under the running loop;
- a fetch context entered by hand and dropped kept its pin and leases for the cache's life,
  silently (`check_invariants` blamed the cache).
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest

from aiohicache import HiCache, HiCacheError
from tests.conftest import make_cache, make_config, make_tokens
from tests.kvcheck import KVChecker
from tests.test_cancellation import GatedEngine

PS = 4


def _loop_error() -> Any:
    """The error a call from another loop or thread must raise (`LoopError`)."""
    return pytest.raises(HiCacheError, match="another event loop")


async def _prefill(cache: HiCache, kv: KVChecker, tokens: list[int]) -> None:
    async with cache.fetch(tokens) as hit:
        slots = await hit.allocate(len(tokens) - hit.num_cached_tokens)
        kv.fill(slots, tokens, hit.num_cached_tokens)
        await hit.commit(tokens, slots)


def _assert_clean(cache: HiCache) -> None:
    cache.check_invariants()
    assert cache.stats().device_pages_leased == 0
    assert not cache._pins


def test_a_cache_used_in_a_second_asyncio_run_raises_loop_error() -> None:
    """asyncio.run(open), then asyncio.run(work): the workers died with the first loop. A
    fetch on the second loop ran unchecked (a host hit's load then waited for ever); it must
    be refused, naming the problem, and the cache must still close, from that second loop."""
    cache = make_cache(write_policy="write_through")
    kv = KVChecker(cache)
    tokens = make_tokens(2 * PS, seed=1)

    async def first() -> None:
        await cache.__aenter__()
        await _prefill(cache, kv, tokens)
        await cache.drain()
    asyncio.run(first())

    async def second() -> None:
        with _loop_error():
            async with cache.fetch(tokens):
                pass
        with _loop_error():
            await cache.allocate(PS)
        await cache.aclose()  # the first loop is gone: closing from here must work
    asyncio.run(asyncio.wait_for(second(), 10))
    assert cache._state == "closed"
    _assert_clean(cache)


def test_a_cache_of_an_idle_loop_used_from_another_loop_raises_loop_error() -> None:
    """pytest-asyncio's session-scoped cache used by a function-scoped test loop: the
    cache's loop is alive but not running, so nothing it queues would ever progress."""
    session = asyncio.new_event_loop()
    try:
        cache = make_cache()
        kv = KVChecker(cache)
        tokens = make_tokens(2 * PS, seed=2)
        session.run_until_complete(cache.__aenter__())
        session.run_until_complete(_prefill(cache, kv, tokens))

        async def test_body() -> None:
            with _loop_error():
                async with cache.fetch(tokens):
                    pass
            with _loop_error():
                cache.events()
        asyncio.run(asyncio.wait_for(test_body(), 10))
        session.run_until_complete(cache.aclose())
        _assert_clean(cache)
    finally:
        session.close()


@pytest.mark.timeout(120)
def test_closing_after_the_opening_loop_ended_does_not_wait_for_dead_copies() -> None:
    """asyncio.run returned with a write-back still queued or in flight: its completion
    can never reach the closed loop, and `aclose()` (on a new loop) waited 60 s for it."""
    engine = GatedEngine()
    cache = HiCache(make_config(write_policy="write_through"), engine=engine)
    engine.attach(cache)
    kv = KVChecker(cache)

    async def first() -> None:
        await cache.__aenter__()
        engine.writes.clear()  # the write-through stays in flight past the loop's end
        await _prefill(cache, kv, make_tokens(2 * PS, seed=3))
    asyncio.run(first())
    engine.open_gates()
    assert cache.stats().pending_writes > 0

    async def close() -> float:
        start = time.monotonic()
        await cache.aclose()
        return time.monotonic() - start
    took = asyncio.run(close())
    assert cache._state == "closed"
    assert took < 5, f"aclose took {took:.0f} s waiting for copies of a dead loop"


async def test_subscribing_from_another_loop_is_refused_and_never_breaks_commits() -> None:
    """A thread that subscribed on its own loop took over the flushes of every stream; once
    its loop ended, each commit on the cache's loop raised and leaked its pages."""
    async with make_cache() as cache:
        kv = KVChecker(cache)
        stream = cache.events()
        batches: list[object] = []

        async def read() -> None:
            async for batch in stream:
                batches.append(batch)
        reader = asyncio.ensure_future(read())

        async def subscribe() -> None:
            cache.events()
        with _loop_error():
            await asyncio.to_thread(asyncio.run, subscribe())
        await _prefill(cache, kv, make_tokens(2 * PS, seed=4))  # raised RuntimeError
        _assert_clean(cache)
        await asyncio.sleep(0.01)
        assert batches, "the cache's own subscriber got no batch"
        reader.cancel()


async def test_a_stream_read_from_another_loop_raises_loop_error() -> None:
    """A stream subscribed on the cache's loop and read on a thread's own loop waited on an
    event set from the cache's thread, which does not run that loop (not thread-safe)."""
    async with make_cache() as cache:
        stream = cache.events()

        async def read() -> None:
            await asyncio.wait_for(anext(stream), 2.0)  # (it waited for ever)
        with _loop_error():
            await asyncio.to_thread(asyncio.run, read())
        await _prefill(cache, KVChecker(cache), make_tokens(2 * PS, seed=5))
        assert await anext(stream)  # still readable on the cache's loop
        _assert_clean(cache)


async def test_free_from_another_thread_while_the_loop_runs_raises_loop_error() -> None:
    """A sync framework thread freeing slots raced the loop's leases and allocator."""
    async with make_cache() as cache:
        slots = await cache.allocate(2 * PS)
        with _loop_error():
            await asyncio.to_thread(cache.free, slots)
        assert cache.stats().device_pages_leased == 2  # untouched: still the caller's
        cache.free(slots)
        _assert_clean(cache)


async def test_a_fetch_from_a_thread_with_its_own_asyncio_run_raises_loop_error() -> None:
    """A sync handler thread calling ``asyncio.run(...)`` on the open cache."""
    async with make_cache() as cache:
        kv = KVChecker(cache)
        tokens = make_tokens(2 * PS, seed=5)
        await _prefill(cache, kv, tokens)

        async def in_thread() -> None:
            async with cache.fetch(tokens):
                pass
        with _loop_error():
            await asyncio.to_thread(asyncio.run, in_thread())
        _assert_clean(cache)
        async with cache.fetch(tokens) as hit:  # still served right on its own loop
            assert hit.num_cached_tokens == 2 * PS
            await kv.verify_prefix(hit, tokens)


async def test_a_context_entered_by_hand_and_dropped_warns_and_releases() -> None:
    """`__aenter__` without `__aexit__` (a handler that crashed between them, an exit stack
    misused): the pin and the leases were kept for the cache's life, with no warning."""
    async with make_cache(device_pages=4) as cache:
        kv = KVChecker(cache)
        ctx = cache.fetch(make_tokens(2 * PS, seed=6))
        await ctx.__aenter__()
        await ctx.allocate(2 * PS)
        with pytest.warns(ResourceWarning, match="never exited"):
            del ctx
            gc.collect()
        await asyncio.sleep(0)  # released on the loop's next turn
        _assert_clean(cache)
        await _prefill(cache, kv, make_tokens(4 * PS, seed=7))  # the whole device again


def test_health_is_failed_once_the_opening_loop_ended_without_closing() -> None:
    """asyncio.run returned with the cache open: nothing can be served any more (every call
    is a `LoopError`), so a monitor reading `stats()` from anywhere must see "failed". It
    read "ok". Closing it from another loop then leaves it closed, not failed."""
    cache = make_cache()

    async def first() -> None:
        await cache.__aenter__()
        await _prefill(cache, KVChecker(cache), make_tokens(2 * PS, seed=2))
        assert cache.stats().health == "ok"
    asyncio.run(first())
    assert cache.stats().health == "failed"
    asyncio.run(asyncio.wait_for(cache.aclose(), 10))
    assert cache._state == "closed"
