"""How the cache uses its L3 store: prefetch into L2, backup to L3, under races and faults.

Every hit is verified with `KVChecker` (KV that depends on the token, its position and the
whole prefix, so a page served for another prefix or offset is caught), whichever tier it
came from; several caches over one store compute the same KV for the same tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiohicache import HiCache
from aiohicache.controller import page_format
from aiohicache.storage.faults import FaultyBackend
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import make_config, make_tokens, until
from tests.kvcheck import KVChecker

L3: dict[str, Any] = {"prefetch_policy": "wait_complete", "prefetch_threshold": 8,
                      "device_pages": 32, "host_pages": 64}


async def serve(cache: HiCache, tokens: Sequence[int]) -> tuple[int, int]:
    """One request for whole pages of `tokens`: fetch, verify every cached token's KV,
    compute and commit the rest. Returns (cached tokens, of them from L3)."""
    assert len(tokens) % 4 == 0
    kv = KVChecker(cache)
    async with cache.fetch(tokens) as hit:
        await kv.verify_prefix(hit, tokens)
        cached, from_l3 = hit.num_cached_tokens, hit.num_storage_hit_tokens
        if len(tokens) > cached:
            slots = await hit.allocate(len(tokens) - cached)
            kv.fill(slots, tokens, cached)
            await hit.commit(tokens, slots)
            await kv.verify_after_commit(hit, tokens)
    return cached, from_l3


def shared_memory_store() -> MemoryBackend:
    return MemoryBackend(page_format(make_config(**L3)))


async def store_in_l3(backend: Any, tokens: Sequence[int]) -> None:
    """Another instance computes `tokens` and backs them up to the shared store."""
    async with HiCache(make_config(storage=backend, **L3)) as writer:
        await serve(writer, tokens)
        await writer.drain()
        assert writer.stats().storage["backed_up_pages"] == len(tokens) // 4  # type: ignore[index]


# ------------------------------------------------------------------------------ findings

async def test_pages_reaching_backup_threshold_hits_after_their_write_through_are_backed_up(
        ) -> None:
    """`backup_threshold` is "hits a node needs before its settled host copy is backed up".
    Backups were queued only when a write-through settled: a node written through at its
    first hit (write_through, threshold 1) never reached L3 with backup_threshold=2, however
    often it was hit afterwards, so that setting silently turned L3 backups off."""
    backend = shared_memory_store()
    tokens = make_tokens(16, seed=11)
    async with HiCache(make_config(storage=backend, backup_threshold=2, **L3)) as cache:
        for _ in range(4):  # four hits on the same prefix
            await serve(cache, tokens)
            await cache.drain()
        st = cache.stats().storage
        assert st is not None and st["backed_up_pages"] == 4, st
    async with HiCache(make_config(storage=backend, **L3)) as fresh:  # reads only L3
        assert await serve(fresh, tokens) == (16, 16)
        await fresh.drain()
        fresh.check_invariants()
    await backend.aclose()


async def test_a_fetch_joining_a_prefetch_of_another_continuation_still_gets_its_own_pages(
        ) -> None:
    """Two requests share a system prompt and differ after it (the usual serving shape). The
    first one's prefetch is in flight when the second is fetched; L3 holds the second's
    whole prompt. Prefetches were shared by their *first* page, so the second joined the
    first's prefetch, which reads only the system prompt, and missed its own pages in L3."""
    backend = shared_memory_store()
    system = make_tokens(16, seed=1)
    first, second = system + make_tokens(16, seed=2), system + make_tokens(16, seed=3)
    await store_in_l3(backend, second)  # L3: the system prompt and the second's question
    slow = FaultyBackend(backend, seed=0, latency=(0.15, 0.15))
    async with HiCache(make_config(storage=slow, **L3)) as cache:
        tier = cache.storage
        assert tier is not None
        one = asyncio.ensure_future(serve(cache, first))
        await until(lambda: bool(tier._inflight))  # its prefetch waits on the slow store
        two = asyncio.ensure_future(serve(cache, second))
        assert await one == (16, 16)  # the system prompt came from L3
        cached, from_l3 = await two
        assert cached == 32, "the second request's pages in L3 were not fetched"
        assert from_l3 >= 16  # its question at least (the prompt may count as the first's)
        await cache.drain()
        cache.check_invariants()
    await backend.aclose()


@pytest.mark.parametrize("write_policy", ["write_back", "write_through_selective"])
async def test_l3_pages_after_a_prefix_held_only_on_the_device_are_served(
        write_policy: str) -> None:
    """With write_back (or a write-through threshold above one hit) a computed prefix lives
    on the device only. A fetch extending it asked L3 for the following pages, read them
    into host pages, then could not insert them (a host-only node needs its prefix on the
    host) and threw them away: every such prefetch was a wasted read and wait, counted in
    `prefetches` although it inserted nothing, and the L3 pages were never served."""
    backend = shared_memory_store()
    system = make_tokens(16, seed=4)
    prompt = system + make_tokens(16, seed=5)
    # (it remembers no miss: L3 lacked the system prompt when it computed it)
    cfg = make_config(storage=backend, write_policy=write_policy, storage_miss_ttl=0.0, **L3)
    async with HiCache(cfg) as cache:
        assert await serve(cache, system) == (0, 0)  # computed here: on the device only
        await cache.drain()
        await store_in_l3(backend, prompt)  # another instance stores the whole prompt
        read_before = backend.stats().pages_read
        cached, from_l3 = await serve(cache, prompt)
        st = cache.stats().storage
        assert st is not None
        read = backend.stats().pages_read - read_before
        assert st["prefetches"] == 0 or st["prefetched_pages"] > 0, (
            f"a prefetch that inserted nothing counted as a prefetch ({read} pages read)")
        assert (cached, from_l3) == (32, 16), "L3's pages after the device prefix were lost"
        await cache.drain()
        cache.check_invariants()
    await backend.aclose()


async def test_a_backup_refused_while_the_breaker_was_open_is_sent_after_it_closes() -> None:
    """The store fails while a prefix is written through, so the breaker opens and its
    backup is bypassed. Backups were queued only when a node's write settled or its hits
    reached `backup_threshold` exactly, so once the store recovered that prefix never
    reached L3, however often it was hit: other instances recomputed it for ever."""
    backend = shared_memory_store()
    faulty = FaultyBackend(backend, seed=0, error_rate=1.0)
    prompt = make_tokens(16, seed=60)
    cfg = make_config(storage=faulty, storage_failures_to_open=1, storage_cooldown=0.05, **L3)
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        assert await serve(cache, prompt) == (0, 0)  # its prefetch fails: the breaker opens
        await cache.drain()
        assert tier.counters.bypassed >= 1 and tier.counters.backed_up_pages == 0
        faulty.error_rate = 0.0  # the store is back
        await anyio.sleep(0.1)  # past the cooldown
        for _ in range(2):
            assert await serve(cache, prompt) == (16, 0)
            await cache.drain()
        assert tier.counters.backed_up_pages == 4, "the bypassed backup was never sent"
        cache.check_invariants()
    async with HiCache(make_config(storage=backend, **L3)) as fresh:
        assert await serve(fresh, prompt) == (16, 16)
        await fresh.drain()
    await backend.aclose()


async def test_a_failed_backup_is_sent_again_as_hits_double_not_on_every_hit() -> None:
    """A backup the store failed is tried again when the node's hits have doubled since the
    last try (a popular prefix reaches L3 after a transient fault), not on every hit (a
    store that keeps failing is not hammered once per request)."""
    backend = shared_memory_store()
    faulty = FaultyBackend(backend, seed=0)
    prompt = make_tokens(16, seed=61)
    cfg = make_config(storage=faulty, storage_failures_to_open=100, **L3)
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        await store_nothing_first(cache, faulty, prompt)  # hit 1: its backup failed
        tries = []
        for _ in range(7):  # hits 2..8
            before = tier.counters.backup_failed_pages
            assert await serve(cache, prompt) == (16, 0)
            await cache.drain()
            tries.append(tier.counters.backup_failed_pages > before)
        assert tries == [True, False, True, False, False, False, True]  # hits 2, 4, 8
        faulty.error_rate = 0.0
        for _ in range(8):  # hits 9..16: the try at 16 succeeds
            await serve(cache, prompt)
            await cache.drain()
        assert tier.counters.backed_up_pages == 4
        cache.check_invariants()
    await backend.aclose()


async def test_a_fetch_whose_prefix_grew_joins_the_prefetch_already_reading_its_pages(
        ) -> None:
    """A prefetch of a whole prompt is in flight when part of the prompt gets computed
    (another request: its system prompt); the prompt's next fetch asks L3 from further on,
    for pages the prefetch in flight already reads up to the same last page. It started a
    second prefetch and read those pages twice (a prefetch was joined only when it went
    past our last page)."""
    backend = shared_memory_store()
    system = make_tokens(16, seed=62)
    prompt = system + make_tokens(16, seed=63)
    await store_in_l3(backend, prompt)
    slow = FaultyBackend(backend, seed=0, latency=(0.3, 0.3))
    cfg = make_config(storage=slow, **{**L3, "prefetch_policy": "best_effort"})
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        async with cache.fetch(prompt) as hit:  # plans the prompt's prefetch, leaves
            assert hit.num_cached_tokens == 0
        assert len(tier._inflight) == 1
        await serve(cache, system)  # computed here, written through to L2
        await until(lambda: all(n.on_host for n in cache.tree.iter_nodes()))
        read_before = backend.stats().pages_read
        async with cache.fetch(prompt) as hit:
            assert hit.num_cached_tokens >= 16
            assert len(tier._inflight) == 1, "a second prefetch of the same pages"
        await cache.drain()
        assert backend.stats().pages_read - read_before == 8  # the first prefetch's pages
        assert await serve(cache, prompt) == (32, 0)
        cache.check_invariants()
    await backend.aclose()


async def test_a_prefetch_keeps_the_host_copy_of_the_prefix_it_extends() -> None:
    """A fetch matches a system prompt held on both tiers and prefetches its question from L3.
    Meanwhile another request evicts the prompt's last page from the device, so it is on the
    host only, and the prefetch's own host reservation then evicted that copy: the question's
    pages were read from L3 and thrown away (nothing to join), and the prompt's page was
    lost. The prefetch now keeps the host copies of the whole prefix it extends."""
    backend = shared_memory_store()
    system = make_tokens(16, seed=64)
    prompt = system + make_tokens(16, seed=65)
    await store_in_l3(backend, prompt)
    slow = FaultyBackend(backend, seed=0, latency=(0.3, 0.3))
    cfg = make_config(storage=slow, **{**L3, "device_pages": 8, "host_pages": 12,
                                       "prefetch_host_fraction": 1.0, "storage_miss_ttl": 0.0})
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        assert await serve(cache, system) == (16, 16)  # on the device and the host
        await cache.drain()
        read_before = backend.stats().pages_read
        other = asyncio.ensure_future(serve(cache, make_tokens(20, seed=66)))  # 5 pages
        await until(lambda: len(tier._inflight) == 1)  # its prefetch asks first
        ours = asyncio.ensure_future(serve(cache, prompt))
        await until(lambda: len(tier._inflight) == 2)
        assert await other == (0, 0)  # computed: the prompt's last page left the device
        cached, from_l3 = await ours
        await cache.drain()
        # Which of the other's write-through and our reservation takes host pages first is
        # the loop's choice: we get the question (or the leading pages of it the host has
        # room for) from L3 after the whole kept prompt, or no room to read any (and the
        # prompt's pages may then leave as any unpinned ones: how many is timing). Never a
        # read thrown away.
        read = backend.stats().pages_read - read_before
        assert read * 4 == from_l3, f"{read} pages read from L3, {from_l3} tokens served"
        assert cached == 16 + from_l3 or not read, (cached, read)
        cache.check_invariants()
    await backend.aclose()


async def test_a_prefetch_reads_the_leading_pages_the_host_has_room_for() -> None:
    """L3 holds a prompt of 8 pages; the host pool has room for 2, the rest held by pages
    the device also holds (never evicted from the host alone). The reservation was all or
    nothing, so every such prefetch was turned away and the prompt computed whole; now
    the leading pages that fit are read and served."""
    backend = shared_memory_store()
    prompt = make_tokens(32, seed=67)
    await store_in_l3(backend, prompt)
    cfg = make_config(storage=backend, **{**L3, "host_pages": 8, "prefetch_host_fraction": 1.0})
    async with HiCache(cfg) as cache:
        await serve(cache, make_tokens(24, seed=68))  # 6 pages on both tiers
        await cache.drain()
        assert cache.host_pool.allocator.num_free == 2
        assert await serve(cache, prompt) == (8, 8)
        await cache.drain()
        cache.check_invariants()
    await backend.aclose()


async def store_nothing_first(cache: HiCache, faulty: FaultyBackend,
                              prompt: Sequence[int]) -> None:
    """Compute `prompt` in `cache` with its L3 store failing every call, then leave the store
    failing (the breaker stays closed: it opens after many failures)."""
    faulty.error_rate = 1.0
    assert await serve(cache, prompt) == (0, 0)
    await cache.drain()
    st = cache.stats().storage
    assert st is not None and st["backup_failed_pages"] == 4 and st["breaker"] == "closed"


# ------------------------------------------------------------------------------ checked, fine

async def test_two_caches_over_one_directory_writing_the_same_prefixes_serve_them_right(
        tmp_path: Path) -> None:
    """Two caches on one loop back up the same prefixes to one file store at the same time
    (each with its own backend on the directory); a third, fresh one reads them all from L3
    and every token's KV is the one computed for it."""
    url = f"file://{tmp_path}?segment_bytes=4096"
    prompts = [make_tokens(8, seed=20) + make_tokens(8 + 4 * i, seed=21 + i) for i in range(4)]
    async with HiCache(make_config(storage=url, **L3)) as a, \
            HiCache(make_config(storage=url, **L3)) as b:
        for prompt in prompts:
            await asyncio.gather(serve(a, prompt), serve(b, prompt))
        await asyncio.gather(a.drain(), b.drain())
        a.check_invariants()
        b.check_invariants()
    async with HiCache(make_config(storage=url, **L3)) as fresh:
        for prompt in prompts:
            cached, from_l3 = await serve(fresh, prompt)
            assert cached == len(prompt) and from_l3 > 0
        await fresh.drain()
        fresh.check_invariants()


async def test_closing_with_prefetches_and_backups_in_flight_returns_and_leaks_nothing(
        ) -> None:
    """A slow store: the cache is closed while a prefetch reads and backups write. The close
    does not wait for the store's latency to end each call, and no host page stays reserved
    or pinned by L3 work."""
    backend = shared_memory_store()
    await store_in_l3(backend, make_tokens(32, seed=30))
    slow = FaultyBackend(backend, seed=0, latency=(2.0, 2.0))
    cache = HiCache(make_config(storage=slow, **{**L3, "prefetch_policy": "best_effort"}))
    async with cache:
        await serve(cache, make_tokens(32, seed=30))  # best effort: a prefetch in flight
        await serve(cache, make_tokens(16, seed=31))  # a backup in flight after settling
        tier = cache.storage
        assert tier is not None
        await until(lambda: bool(tier._backing_up) and bool(tier._inflight))
        with anyio.fail_after(1.0):
            await cache.aclose()
    assert tier.idle and not tier.reserved_host
    assert cache.host_pool.allocator.num_used == sum(
        len(n.host_pages) for n in cache.tree.iter_nodes() if n.host_pages is not None)
    await backend.aclose()


async def test_a_store_that_fails_mid_prefetch_opens_the_breaker_and_serves_only_verified_kv(
        ) -> None:
    """The store goes down while a prefetch is in flight (planned, its calls not answered
    yet): the prefetch is a miss, the breaker opens at once, the fetch computes its KV and
    the next one is served by L1, verified, with L3 bypassed."""
    backend = shared_memory_store()
    prompt = make_tokens(32, seed=40)
    await store_in_l3(backend, prompt)
    faulty = FaultyBackend(backend, seed=0, latency=(0.05, 0.05))
    cfg = make_config(storage=faulty, storage_failures_to_open=1, storage_cooldown=60.0, **L3)
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        fetch = asyncio.ensure_future(serve(cache, prompt))
        await until(lambda: bool(tier._inflight))
        faulty.error_rate = 1.0  # every later call fails
        assert await fetch == (0, 0)
        assert tier.breaker.state == "open"
        assert await serve(cache, prompt) == (32, 0)  # L1 serves it
        await cache.drain()
        cache.check_invariants()
    await backend.aclose()


async def test_a_prefetch_with_little_host_room_serves_what_fits_and_no_error() -> None:
    """L3 holds 8 pages but `prefetch_host_fraction` of a 4-page host pool leaves room for
    one: the fetch gets that page from L3 (verified), computes the rest, and nothing
    raises a CapacityError."""
    backend = shared_memory_store()
    prompt = make_tokens(32, seed=50)
    await store_in_l3(backend, prompt)
    cfg = make_config(storage=backend, **{**L3, "host_pages": 4,
                                          "prefetch_host_fraction": 0.25})
    async with HiCache(cfg) as cache:
        cached, from_l3 = await serve(cache, prompt)
        assert (cached, from_l3) == (4, 4)  # one page from L3, verified; the rest computed
        await cache.drain()
        cache.check_invariants()
    await backend.aclose()
