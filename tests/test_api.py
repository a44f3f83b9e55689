"""The public API end to end: fetch / allocate / commit across tiers, policies and bad input."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from aiohicache import (
    CapacityError,
    ClosedError,
    ConfigError,
    CpuTransferEngine,
    HiCache,
    PageError,
    TransferError,
    WorkerError,
)
from aiohicache.memory import PageIds
from aiohicache.transfer import TransferHandle
from tests.conftest import SPEC_MLA, fill_kv, make_cache, make_config, make_tokens, prefill, read_kv


async def evict_all(cache: HiCache) -> None:
    """Push everything unpinned off the device by leasing the whole pool, then free it."""
    await cache.drain()
    slots = await cache.allocate(cache.device_pool.num_slots)
    cache.free(slots)


async def test_miss_then_device_hit() -> None:
    async with make_cache() as cache:
        tokens = make_tokens(10)
        await prefill(cache, tokens)
        async with cache.fetch(tokens) as hit:
            assert hit.num_cached_tokens == 8  # two whole pages of 4; the tail is recomputed
            assert hit.num_device_hit_tokens == 8 and hit.num_host_hit_tokens == 0
            assert hit.device_indices.dtype == torch.int64 and len(hit.device_indices) == 8
        s = cache.stats()
        assert (s.requests, s.prompt_tokens, s.device_hit_tokens, s.miss_tokens) == (2, 20, 8, 12)
        cache.check_invariants()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
async def test_write_through_then_eviction_then_fetch_returns_identical_kv(
        layout: str, page_size: int, mla: bool) -> None:
    extra = {"spec": SPEC_MLA} if mla else {}
    cfg = {"page_size": page_size, "device_pages": 8, "host_pages": 16, "host_layout": layout}
    async with make_cache(**cfg, **extra) as cache:
        tokens = make_tokens(3 * page_size)
        original = await prefill(cache, tokens)
        await evict_all(cache)
        assert cache.stats().device_pages_used == 0
        async with cache.fetch(tokens) as hit:
            assert hit.num_host_hit_tokens == 3 * page_size
            for layer in range(cache.config.spec.num_layers):
                await hit.layer_ready(layer)
            assert torch.equal(read_kv(cache, hit.device_indices).view(torch.uint8),
                               original.view(torch.uint8))
        await cache.drain()
        cache.check_invariants()


async def test_write_through_selective_waits_for_the_second_hit() -> None:
    async with make_cache(write_policy="write_through_selective") as cache:
        tokens = make_tokens(8)
        await prefill(cache, tokens)
        await cache.drain()
        assert cache.stats().writes == 0
        async with cache.fetch(tokens):
            pass
        await cache.drain()
        assert cache.stats().writes == 1 and cache.stats().host_pages_used == 2


async def test_write_back_copies_to_host_only_on_eviction() -> None:
    async with make_cache(write_policy="write_back", device_pages=4) as cache:
        tokens = make_tokens(16)
        original = await prefill(cache, tokens)
        await cache.drain()
        assert cache.stats().writes == 0
        slots = await cache.allocate(16)  # needs the whole device: waits for the write-back
        assert cache.stats().writes == 1 and cache.stats().host_pages_used == 4
        cache.free(slots)
        async with cache.fetch(tokens) as hit:
            await hit.ready()
            assert hit.num_host_hit_tokens == 16
            assert torch.equal(read_kv(cache, hit.device_indices), original)
        await cache.drain()
        cache.check_invariants()


async def test_concurrent_fetches_of_one_host_prefix_share_one_load() -> None:
    async with make_cache() as cache:
        tokens = make_tokens(16)
        original = await prefill(cache, tokens)
        await evict_all(cache)
        loads_before = cache.stats().loads

        async def reader() -> torch.Tensor:
            async with cache.fetch(tokens) as hit:
                await hit.ready()
                return read_kv(cache, hit.device_indices)

        results = await asyncio.gather(*(reader() for _ in range(20)))
        await cache.drain()
        assert all(torch.equal(r, original) for r in results)
        s = cache.stats()
        assert s.loads - loads_before == 1
        assert s.host_hit_tokens == 20 * 16
        cache.check_invariants()


async def test_hundreds_of_concurrent_requests_on_overlapping_prefixes_get_correct_kv() -> None:
    rng = random.Random(7)
    systems = [make_tokens(12, seed=s) for s in range(4)]
    requests = [systems[rng.randrange(4)] + make_tokens(rng.randrange(1, 10), seed=100 + i % 40)
                for i in range(300)]
    computing = asyncio.Semaphore(4)  # a scheduler bounds the batch that allocates new KV
    async with make_cache(device_pages=64, host_pages=128) as cache:

        async def serve(tokens: list[int]) -> None:
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
            async with cache.fetch(tokens) as hit, computing:
                await hit.ready()
                n = hit.num_cached_tokens
                if n:
                    got = read_kv(cache, hit.device_indices)
                    ref = make_expected(cache, tokens[:n])
                    assert torch.equal(got, ref), "served KV differs from what was computed"
                if len(tokens) == n:
                    return
                slots = await hit.allocate(len(tokens) - n)
                fill_kv(cache, slots, tokens[n:])
                await hit.commit(tokens, slots)

        await asyncio.gather(*(serve(t) for t in requests))
        await cache.drain()
        cache.check_invariants()
        s = cache.stats()
        assert s.requests == 300 and s.device_hit_tokens + s.host_hit_tokens > 0
        assert s.device_pages_leased == 0


def make_expected(cache: HiCache, tokens: list[int]) -> torch.Tensor:
    """The KV that `fill_kv` writes for `tokens`, computed in a scratch pool."""
    scratch = HiCache(cache.config)
    slots = torch.arange(len(tokens))
    fill_kv(scratch, slots, tokens)
    return read_kv(scratch, slots)


async def test_commit_of_a_partial_page_keeps_it_leased_until_a_later_commit() -> None:
    async with make_cache() as cache:
        tokens = make_tokens(14)
        async with cache.fetch(tokens[:6]) as hit:
            slots = await hit.allocate(6)
            fill_kv(cache, slots, tokens[:6])
            await hit.commit(tokens[:6], slots)
            assert hit.num_cached_tokens == 4
            assert cache.stats().device_pages_leased == 1  # the page holding tokens 4, 5
            more = await hit.allocate(8)  # continues in the partial page first
            assert more[:2].tolist() == [int(slots[4]) + 2, int(slots[4]) + 3]
            fill_kv(cache, more, tokens[6:])
            await hit.commit(tokens, torch.cat([slots[4:], more]))
            assert hit.num_cached_tokens == 12
            assert cache.stats().device_pages_leased == 1  # tokens 12, 13
        assert cache.stats().device_pages_leased == 0
        async with cache.fetch(tokens) as hit:
            assert hit.num_cached_tokens == 12
            assert torch.equal(read_kv(cache, hit.device_indices),
                               make_expected(cache, tokens[:12]))
        cache.check_invariants()


async def test_two_requests_computing_the_same_prefix_keep_one_copy() -> None:
    async with make_cache() as cache:
        tokens = make_tokens(8)
        async with cache.fetch(tokens) as a, cache.fetch(tokens) as b:
            sa, sb = await a.allocate(8), await b.allocate(8)
            fill_kv(cache, sa, tokens)
            fill_kv(cache, sb, tokens)
            await a.commit(tokens, sa)
            await b.commit(tokens, sb)
            assert torch.equal(b.device_indices, a.device_indices)
        await cache.drain()
        assert cache.stats().device_pages_used == 2
        cache.check_invariants()


async def test_load_back_is_partial_when_the_device_is_short() -> None:
    async with make_cache(device_pages=4, host_pages=16) as cache:
        tokens = make_tokens(16)
        original = await prefill(cache, tokens)
        await evict_all(cache)
        async with cache.fetch(make_tokens(4, seed=9)) as other:  # pin one page elsewhere
            slots = await other.allocate(4)
            async with cache.fetch(tokens) as hit:
                await hit.ready()
                assert hit.num_cached_tokens == 12
                assert torch.equal(read_kv(cache, hit.device_indices), original[:, :12])
            cache.free(slots)
        await cache.drain()
        cache.check_invariants()


async def test_load_back_threshold_recomputes_short_tails() -> None:
    async with make_cache(load_back_threshold=9) as cache:
        tokens = make_tokens(8)
        await prefill(cache, tokens)
        await evict_all(cache)
        async with cache.fetch(tokens) as hit:
            assert hit.num_cached_tokens == 0


async def test_allocate_beyond_capacity_raises_capacity_error() -> None:
    async with make_cache(device_pages=4) as cache:
        with pytest.raises(CapacityError):
            await cache.allocate(17)
        async with cache.fetch(make_tokens(8)) as hit:
            held = await hit.allocate(8)
            fill_kv(cache, held, make_tokens(8))
            await hit.commit(make_tokens(8), held)
            with pytest.raises(CapacityError):  # the committed prefix is pinned by `hit`
                await cache.allocate(9)
        cache.check_invariants()


@pytest.mark.parametrize("bad", [[], "abc", [1.5, 2.0], torch.tensor([1.0, 2.0]),
                                 np.zeros((2, 2), dtype=np.int64), [True, False]])
async def test_bad_tokens_raise_config_error(bad: object) -> None:
    async with make_cache() as cache:
        with pytest.raises(ConfigError, match="^tokens:"):
            async with cache.fetch(bad):  # type: ignore[arg-type]
                pass
        cache.check_invariants()


@pytest.mark.parametrize("tokens", [torch.arange(8), np.arange(8, dtype=np.int32), range(8)])
async def test_tokens_may_be_tensors_arrays_or_sequences(tokens: object) -> None:
    async with make_cache() as cache:
        await prefill(cache, list(range(8)))
        async with cache.fetch(tokens) as hit:  # type: ignore[arg-type]
            assert hit.num_cached_tokens == 8


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
async def test_allocate_needs_a_positive_int(n: object) -> None:
    async with make_cache() as cache:
        with pytest.raises(ConfigError, match="^num_tokens:"):
            await cache.allocate(n)  # type: ignore[arg-type]


async def test_commit_rejects_slots_that_do_not_fit() -> None:
    async with make_cache() as cache:
        tokens = make_tokens(8)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(8)
            with pytest.raises(ConfigError, match="^slots:"):
                await hit.commit(tokens, slots[:7])
            with pytest.raises(ConfigError, match="^slots:"):
                await hit.commit(tokens, slots.float())
            with pytest.raises(ConfigError, match="^slots:"):
                await hit.commit(tokens, slots.flip(0))
            with pytest.raises(ConfigError, match="^tokens:"):
                await hit.commit(make_tokens(8, seed=1)[:2], slots[:2])
            foreign = torch.arange(8, 16) + (int(slots[-1]) + 1) % 64
            with pytest.raises((PageError, ConfigError)):
                await hit.commit(tokens, foreign)
            await hit.commit(tokens, slots)
            with pytest.raises(PageError):
                cache.free(slots)  # committed slots belong to the cache now
        cache.check_invariants()


async def test_free_rejects_double_free() -> None:
    async with make_cache() as cache:
        slots = await cache.allocate(8)
        cache.free(slots)
        with pytest.raises(PageError):
            cache.free(slots)
        cache.check_invariants()


async def test_layer_out_of_range_is_a_config_error() -> None:
    async with make_cache() as cache, cache.fetch(make_tokens(4)) as hit:
        with pytest.raises(ConfigError, match="^layer:"):
            await hit.layer_ready(3)


async def test_use_after_close_raises_closed_error() -> None:
    cache = make_cache()
    async with cache, cache.fetch(make_tokens(4)) as hit:
        pass
    await cache.aclose()  # idempotent
    with pytest.raises(ClosedError):
        async with cache.fetch(make_tokens(4)):
            pass
    with pytest.raises(ClosedError):
        await cache.allocate(1)
    with pytest.raises(ClosedError):
        await hit.commit(make_tokens(4), torch.empty(0, dtype=torch.int64))
    with pytest.raises(ClosedError):
        async with cache:
            pass


async def test_a_context_left_open_across_close_still_unpins() -> None:
    cache = make_cache()
    async with cache:
        await prefill(cache, make_tokens(8))
        ctx = cache.fetch(make_tokens(8))
        await ctx.__aenter__()
    await ctx.__aexit__(None, None, None)
    cache.check_invariants()


async def test_stats_report_transfers_and_occupancy() -> None:
    async with make_cache() as cache:
        await prefill(cache, make_tokens(8))
        await cache.drain()
        s = cache.stats()
        page_bytes = cache.config.page_bytes
        assert (s.writes, s.written_bytes) == (1, 2 * page_bytes)
        assert (s.device_pages_used, s.host_pages_used, s.num_nodes) == (2, 2, 1)
        assert s.health == "ok" and s.pending_loads == s.pending_writes == 0
        assert s.hit_ratio == 0.0


class FailingLoads(CpuTransferEngine):
    """A CPU engine whose host->device copies fail, as a broken link would."""

    def load(self, host_pages: PageIds, device_pages: PageIds) -> TransferHandle:
        handle = TransferHandle(num_layers=self.device_pool.spec.num_layers, nbytes=0)
        asyncio.get_running_loop().call_soon(handle._finish, OSError("link down"))
        return handle


async def test_a_failed_load_is_never_served_and_the_cache_reports_failure() -> None:
    cfg = make_config()
    cache = HiCache(cfg)
    engine = FailingLoads(cache.device_pool, cache.host_pool)
    cache = HiCache(cfg, engine=engine)
    engine.device_pool, engine.host_pool = cache.device_pool, cache.host_pool
    async with cache:
        tokens = make_tokens(8)
        await prefill(cache, tokens)
        await evict_all(cache)
        async with cache.fetch(tokens) as hit:
            with pytest.raises(TransferError, match="link down"):
                await hit.layer_ready(0)
        await asyncio.sleep(0)
        assert cache.stats().health == "failed"
        with pytest.raises(WorkerError):
            async with cache.fetch(tokens):
                pass


async def test_a_cache_without_host_tier_keeps_only_device_pages() -> None:
    async with make_cache(host_pages=0, device_pages=4) as cache:
        await prefill(cache, make_tokens(16))
        await prefill(cache, make_tokens(8, seed=1))
        await cache.drain()
        s = cache.stats()
        assert (s.writes, s.host_pages_used, s.device_pages_used) == (0, 0, 4)
        async with cache.fetch(make_tokens(16)) as hit:
            assert hit.num_cached_tokens == 8  # two pages of the first prompt survived
        cache.check_invariants()


async def test_slots_modified_in_place_after_allocate_are_validated_again() -> None:
    async with make_cache() as cache:
        tokens = make_tokens(8)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(8)
            slots[0] = slots[1]  # the caller scribbled on the tensor it was given
            with pytest.raises(ConfigError, match="^slots:"):
                await hit.commit(tokens, slots)
        cache.check_invariants()
