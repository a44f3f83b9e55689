"""Adversarial review of the single-rank core (api, _request, _context, controller, tree):
misuse, interleavings and cancellations the other suites do not reach. Each failing case
here is a confirmed bug; see the test names for the behaviour required."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

from aiohicache import ClosedError, ConfigError, CpuTransferEngine, HiCache, TransferHandle
from aiohicache.memory import PageIds
from aiohicache.testing import KVOracle
from aiohicache.transfer._geometry import layer_spans
from tests.conftest import make_cache, make_config, make_tokens
from tests.test_cancellation import GatedEngine, gated_cache

PS = 4


async def _context_with_a_partial_page_and_a_full_device(
        cache: HiCache, engine: GatedEngine) -> tuple[Any, list[int]]:
    """Fill the device with unpinned KV nobody has on the host (write_back: an allocate
    then stages it and waits for the write-back), and open a context whose last commit
    ended mid-page (its partial page leased, 2 of 4 slots used)."""
    kv = KVOracle(cache)
    for seed in range(1, cache.config.device_pages):
        await kv.prefill(make_tokens(PS, seed=seed))
    tokens = make_tokens(2, seed=99)
    ctx = cache.fetch(tokens)
    await ctx.__aenter__()
    slots = await ctx.allocate(2)
    kv.fill(slots, tokens)
    await ctx.commit(tokens, slots)
    assert cache.device_pool.allocator.num_free == 0
    engine.writes.clear()  # write-backs stay in flight: a new page waits for them
    return ctx, tokens


async def test_allocates_of_one_context_waiting_together_never_hand_out_a_slot_twice() -> None:
    """`allocate` took the free rest of the partial page only once its new pages were
    leased: an allocate of the same context (another task of the request) running while it
    waited for write-backs was handed the same slots."""
    async with gated_cache(write_policy="write_back", device_pages=4, host_pages=16) \
            as (cache, engine):
        ctx, _ = await _context_with_a_partial_page_and_a_full_device(cache, engine)
        first = asyncio.ensure_future(ctx.allocate(5))  # rest of the page + a new page
        await asyncio.sleep(0.01)
        assert not first.done(), "the allocate should wait for the staged write-back"
        second = asyncio.ensure_future(ctx.allocate(1))  # another task of the request
        await asyncio.sleep(0.01)
        engine.writes.set()
        got, other = await asyncio.wait_for(asyncio.gather(first, second), 2)
        overlap = set(got.tolist()) & set(other.tolist())
        assert not overlap, f"slots {sorted(overlap)} handed out by two allocates"
        await ctx.__aexit__(None, None, None)


async def test_a_cancelled_allocate_does_not_give_back_slots_a_later_allocate_took() -> None:
    """A cancelled allocate restored the partial page as it was before it started, giving
    back slots another allocate of the context had taken meanwhile: handed out twice."""
    async with gated_cache(write_policy="write_back", device_pages=4, host_pages=16) \
            as (cache, engine):
        ctx, _ = await _context_with_a_partial_page_and_a_full_device(cache, engine)
        first = asyncio.ensure_future(ctx.allocate(5))
        await asyncio.sleep(0.01)
        assert not first.done()
        second = asyncio.ensure_future(ctx.allocate(1))
        await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        engine.writes.set()
        taken = await asyncio.wait_for(second, 2)
        third = await asyncio.wait_for(ctx.allocate(1), 2)
        overlap = set(third.tolist()) & set(taken.tolist())
        assert not overlap, f"slot {sorted(overlap)} handed out twice after a cancellation"
        await ctx.__aexit__(None, None, None)


async def test_a_close_racing_the_open_makes_the_open_raise_closed_error_not_cancelled() -> None:
    """A server's shutdown may close the cache while its startup task still opens it: the
    opener was not cancelled, so it must not see a CancelledError (asyncio would then end
    its task as cancelled, and a task group would swallow the failure)."""
    cache = make_cache()
    opening = asyncio.ensure_future(cache.__aenter__())
    await asyncio.sleep(0)  # the open waits for the workers to start
    await cache.aclose()
    with pytest.raises(ClosedError):
        await opening
    assert cache._state == "closed"


async def test_editing_the_tokens_a_context_shows_never_serves_kv_under_other_tokens() -> None:
    """`hit.tokens` is the array the context checks commits against: edited in place, a
    commit of the edited tokens was accepted and inserted the cached prefix's pages (KV of
    the fetched tokens) under the edited ones: two nodes own those pages and a fetch of the
    edited tokens is served the other prefix's KV. An edit must be refused (read-only) or
    the commit must be."""
    cache = make_cache()
    async with cache:
        kv = KVOracle(cache)
        prompt = make_tokens(2 * PS, seed=1)
        await kv.prefill(prompt)
        async with cache.fetch([*prompt, 5, 6]) as hit:
            assert hit.num_cached_tokens == 2 * PS
            with contextlib.suppress(ValueError):  # "assignment destination is read-only"
                hit.tokens[0] = 999
            edited = hit.tokens.tolist()
            slots = await hit.allocate(2)
            kv.fill(slots, edited, 2 * PS)
            with contextlib.suppress(ConfigError):
                await hit.commit(edited, slots)
        await cache.drain()
        cache.check_invariants()
        other = [999, *prompt[1:], 5, 6]
        async with cache.fetch(other) as hit:
            await kv.check_hit(hit, other)


class PausedAfterLayerZero(CpuTransferEngine):
    """The CPU engine on its threads; a load stops after its first layer until `resume`."""

    def __init__(self, cache: HiCache) -> None:
        super().__init__(cache.device_pool, cache.host_pool, inline_bytes=0)
        self.resume = threading.Event()
        self.resume.set()

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        if not to_device:
            super()._run(src, dst, handle, to_device)
            return
        copy = self._layers(src, dst, True)
        for lo, hi in layer_spans(self.device_pool.spec.num_layers, to_device=True):
            copy(lo, hi, True)
            handle.bridge.call_soon(handle._layer_done, lo)
            if lo == 0:
                self.resume.wait(5)
        handle.bridge.call_soon(handle._finish, None)


async def test_a_load_left_between_layers_keeps_its_pages_from_a_request_reusing_the_slots(
        ) -> None:
    """Covered nowhere else: the requester of a load leaves after layer 0 while a second
    request waits on the same load; the leaver's leased slots go to a third request, which
    writes into them; the loading pages themselves cannot be handed out, and the second
    request reads exactly the KV of the prefix, every layer."""
    engine: list[PausedAfterLayerZero] = []

    def make(device: Any, host: Any) -> PausedAfterLayerZero:
        engine.append(PausedAfterLayerZero(cache))
        return engine[0]
    cache = HiCache(make_config(device_pages=4, host_pages=16), engine=make)
    async with cache:
        kv = KVOracle(cache)
        prompt = make_tokens(2 * PS, seed=3)
        await kv.prefill(prompt)
        await cache.drain()
        cache.free(await cache.allocate(cache.device_pool.num_slots))  # prompt: host only
        assert cache.stats().device_pages_used == 0
        engine[0].resume.clear()
        first = cache.fetch(prompt)
        await first.__aenter__()
        assert first.num_cached_tokens == 2 * PS
        await first.layer_ready(0)
        mine = await first.allocate(PS)
        longer = [*prompt, 7, 8]
        async with cache.fetch(longer) as second:
            assert second.num_cached_tokens == 2 * PS
            await first.__aexit__(None, None, None)  # leaves between layers
            taken = await cache.allocate(2 * PS)  # the free page and the one just freed
            assert set((taken // PS).tolist()) >= set((mine // PS).tolist())
            kv.fill(taken, make_tokens(2 * PS, seed=4))  # another request's KV
            engine[0].resume.set()
            for layer in range(cache.config.spec.num_layers):
                await second.layer_ready(layer)
            await kv.check_hit(second, longer)
            cache.free(taken)
        await cache.drain()
        cache.check_invariants()
        assert await kv.prefill(prompt) == 2 * PS


def test_an_eviction_tuple_of_one_name_is_a_config_error() -> None:
    """``eviction=("lru",)`` passed the config's check (1 or 2 names) and then crashed the
    cache's construction with a bare ValueError (the tree unpacks a pair)."""
    with pytest.raises(ConfigError, match="eviction"):
        HiCache(make_config(eviction=("lru",)))


class FailsToClose(CpuTransferEngine):
    """The CPU engine, whose `aclose` fails once its threads are stopped (a custom engine
    or a driver error at shutdown)."""

    async def aclose(self) -> None:
        await super().aclose()
        raise RuntimeError("the engine failed to close")


async def test_a_failing_engine_close_still_closes_the_cache_and_ends_its_event_streams(
        ) -> None:
    """`aclose` stopped at the first step that raised: the cache stayed "closing" for good,
    the host pool stayed registered (pinned, with CUDA), the storage tier and TP group
    stayed open, and every `events()` subscriber waited for ever."""
    cache = HiCache(make_config(), engine=lambda device, host: FailsToClose(device, host))
    await cache.__aenter__()
    stream = cache.events()
    await KVOracle(cache).prefill(make_tokens(2 * PS, seed=5))
    with pytest.raises(RuntimeError, match="failed to close"):
        await cache.aclose()
    assert cache._state == "closed"

    async def consume() -> None:
        async for _ in stream:
            pass
    await asyncio.wait_for(consume(), 2)


async def test_an_event_stream_of_a_cache_closed_without_being_opened_ends() -> None:
    """`events()` may be subscribed before the cache opens (to miss no event); if the open
    never happens (startup failed, the cache is only closed), the stream must still end
    ("the stream ends after the cache closes"): it waited for ever."""
    cache = make_cache()
    stream = cache.events()
    await cache.aclose()

    async def consume() -> None:
        async for _ in stream:
            pass
    await asyncio.wait_for(consume(), 2)
