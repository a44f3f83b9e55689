"""The L3 tier inside the cache: prefetch, backup, persistence, correct-or-miss, breaker."""

from __future__ import annotations

import asyncio
import shutil
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch

from aiohicache import HiCache
from aiohicache.controller import _l3_parts, page_format
from aiohicache.controller._l3_parts import _MissCache
from aiohicache.storage.faults import FaultyBackend
from aiohicache.storage.file import FileBackend
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import make_config, make_tokens, prefill, read_kv, until
from tests.storage.redis_server import redis_server, redis_url  # noqa: F401  (fixtures)
from tests.storage.segment_hooks import corrupt_last_record, swap_keys

L3 = {"prefetch_policy": "wait_complete", "prefetch_threshold": 8, "device_pages": 16,
      "host_pages": 32}


async def fill_l3(cache: HiCache, tokens: list[int]) -> torch.Tensor:
    """Compute `tokens` in `cache` and wait until write-through and backup settled."""
    kv = await prefill(cache, tokens)
    await cache.drain()
    return kv


async def fetch_kv(cache: HiCache, tokens: list[int]) -> tuple[torch.Tensor, int]:
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        return read_kv(cache, hit.device_indices), hit.num_storage_hit_tokens


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_a_new_cache_over_the_same_directory_serves_old_pages_bit_identically(
        tmp_path: Path, layout: str) -> None:
    cfg = make_config(storage=f"file://{tmp_path}", host_layout=layout, **L3)
    tokens = make_tokens(24)
    async with HiCache(cfg) as first:
        original = await fill_l3(first, tokens)
        assert first.stats().storage["backed_up_pages"] == 6  # type: ignore[index]
    async with HiCache(cfg) as second:
        kv, from_l3 = await fetch_kv(second, tokens)
        assert from_l3 == 24 and torch.equal(kv, original)
        s = second.stats()
        assert s.storage_hit_tokens == 24 and s.hit_ratio == 1.0
        await second.drain()
        second.check_invariants()


async def test_another_process_reads_what_this_one_stored(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import asyncio, torch
        from aiohicache import HiCache
        from tests.conftest import make_config, make_tokens, prefill
        async def main():
            cfg = make_config(storage="file://{tmp_path}", prefetch_policy="wait_complete",
                              prefetch_threshold=8, device_pages=16, host_pages=32)
            async with HiCache(cfg) as cache:
                kv = await prefill(cache, make_tokens(24))
                await cache.drain()
                torch.save(kv, "{tmp_path}/kv.pt")
        asyncio.run(main())
    """)
    await anyio.run_process([sys.executable, "-c", script], check=True,
                            cwd=Path(__file__).parents[2])
    original = await anyio.to_thread.run_sync(torch.load, tmp_path / "kv.pt")
    async with HiCache(make_config(storage=f"file://{tmp_path}", **L3)) as cache:
        kv, from_l3 = await fetch_kv(cache, make_tokens(24))
        assert from_l3 == 24 and torch.equal(kv, original)


async def test_redis_l3_round_trip(redis_url: str) -> None:  # noqa: F811  (the fixture)
    cfg = make_config(storage=redis_url, **L3)
    async with HiCache(cfg) as first:
        original = await fill_l3(first, make_tokens(16))
    async with HiCache(cfg) as second:
        kv, from_l3 = await fetch_kv(second, make_tokens(16))
        assert from_l3 == 16 and torch.equal(kv, original)


async def test_concurrent_fetches_share_one_prefetch() -> None:
    backend = MemoryBackend(page_format(make_config(**L3)))
    cfg = make_config(storage=backend, **L3)  # a backend object stays the caller's to close
    async with HiCache(cfg) as writer:
        original = await fill_l3(writer, make_tokens(16))
    async with HiCache(cfg) as reader:
        results = await asyncio.gather(*(fetch_kv(reader, make_tokens(16)) for _ in range(10)))
        assert all(torch.equal(kv, original) for kv, _ in results)
        assert reader.stats().storage["prefetches"] == 1  # type: ignore[index]
        await reader.drain()
        reader.check_invariants()
    await backend.aclose()


async def test_a_prefix_l3_lacks_is_not_asked_again_within_the_ttl() -> None:
    cfg = make_config(storage="memory://", **L3)
    async with HiCache(cfg) as cache:
        for _ in range(2):
            async with cache.fetch(make_tokens(16, seed=5)) as hit:
                assert hit.num_cached_tokens == 0
        st = cache.stats().storage
        assert st is not None and st["prefetch_misses"] == 1 and st["negative_hits"] == 1


async def test_the_negative_cache_is_bounded_and_forgets_expired_prefixes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(storage="memory://", storage_miss_ttl=5.0, storage_miss_max_entries=8,
                      **L3)
    async with HiCache(cfg) as cache:
        tier, clock = cache.storage, [100.0]
        assert tier is not None
        monkeypatch.setattr(tier, "_now", lambda: clock[0])

        async def miss(seed: int) -> tuple[object, object]:
            async with cache.fetch(make_tokens(16, seed=seed)) as hit:
                assert hit.num_cached_tokens == 0
            st = cache.stats().storage
            assert st is not None
            return st["prefetch_misses"], st["negative_hits"]

        for seed in range(20):  # 20 distinct prefixes L3 lacks
            assert await miss(seed) == (seed + 1, 0)
        assert len(tier._misses) == 8
        assert await miss(19) == (20, 1)  # among the newest 8: not asked again
        assert await miss(0) == (21, 1)   # the oldest were forgotten: asked again
        clock[0] += 5.0  # every entry expires ...
        assert await miss(19) == (22, 1)  # ... so L3 is asked again
        assert len(tier._misses) == 1  # and the next miss pruned the expired ones


def spy_on_copies(monkeypatch: pytest.MonkeyPatch,
                  block: threading.Event | None = None) -> dict[str, list[int]]:
    """Record the thread of every layer_first gather and scatter (names -> thread ids); with
    `block`, each copy first waits for it to be set."""
    seen: dict[str, list[int]] = {"gather": [], "scatter": []}

    def spy(copy: Callable[..., None], calls: list[int]) -> Callable[..., None]:
        def run(*args: object) -> None:
            calls.append(threading.get_ident())
            if block is not None:
                assert block.wait(5), "the test never released the copy"
            copy(*args)
            calls.append(0)  # done
        return run

    for name, calls in seen.items():
        monkeypatch.setattr(_l3_parts, f"_{name}", spy(getattr(_l3_parts, f"_{name}"), calls))
    return seen


async def test_layer_first_pages_are_gathered_and_scattered_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy_on_copies(monkeypatch)
    cfg0 = make_config(host_layout="layer_first", **L3)
    backend = MemoryBackend(page_format(cfg0))
    cfg = make_config(storage=backend, host_layout="layer_first", **L3)
    async with HiCache(cfg) as first:
        original = await fill_l3(first, make_tokens(24))
    async with HiCache(cfg) as second:
        kv, from_l3 = await fetch_kv(second, make_tokens(24))
        assert from_l3 == 24 and torch.equal(kv, original)
    await backend.aclose()
    loop_thread = threading.get_ident()
    for name, calls in seen.items():
        threads = set(calls) - {0}
        assert threads and loop_thread not in threads, f"{name} ran on the loop's thread"


@pytest.mark.parametrize("copy", ["gather", "scatter"])
async def test_closing_mid_copy_waits_for_the_copy_before_releasing_its_pages(
        monkeypatch: pytest.MonkeyPatch, copy: str) -> None:
    backend = MemoryBackend(page_format(make_config(host_layout="layer_first", **L3)))
    cfg = make_config(storage=backend, host_layout="layer_first", **L3)
    if copy == "scatter":  # L3 has the pages; the fetch below starts a prefetch, no wait
        async with HiCache(cfg) as first:
            await fill_l3(first, make_tokens(24))
        cfg = make_config(storage=backend, host_layout="layer_first",
                          **{**L3, "prefetch_policy": "best_effort"})
    release = threading.Event()
    seen = spy_on_copies(monkeypatch, release)
    cache = HiCache(cfg)
    await cache.__aenter__()
    tier = cache.storage
    assert tier is not None
    try:
        await prefill(cache, make_tokens(24))  # queues a backup (gather), prefetch (scatter)
        await until(lambda: bool(seen[copy]))
        closing = asyncio.ensure_future(cache.aclose())  # cancels the backup or prefetch
        await anyio.wait_all_tasks_blocked()  # the close waits for the copy's thread
        assert not closing.done(), "closed while a copy still used the host pages"
        held = tier._backing_up if copy == "gather" else tier.reserved_host
        assert held, "pages unpinned or freed while a copy still used them"
    finally:
        release.set()
    await closing
    assert seen[copy][-1] == 0  # the copy ran to its end
    assert not tier._backing_up and not tier.reserved_host
    await backend.aclose()


def test_a_negative_entry_lives_ttl_seconds_and_one_from_the_future_is_expired() -> None:
    misses = _MissCache(ttl=5.0, max_entries=4)
    misses.add(b"k", 100.0)
    assert misses.hit(b"k", 104.9) and not misses.hit(b"k", 105.0)
    assert not misses.hit(b"k", 99.0)  # TP's agreed wall clock stepped back: not trusted


async def test_a_corrupt_page_is_a_miss_and_never_served(tmp_path: Path) -> None:
    cfg = make_config(storage=f"file://{tmp_path}", **L3)
    tokens = make_tokens(24)
    async with HiCache(cfg) as first:
        original = await fill_l3(first, tokens)
    await anyio.to_thread.run_sync(corrupt_last_record, tmp_path)
    async with HiCache(cfg) as second:
        kv, from_l3 = await fetch_kv(second, tokens)
        assert from_l3 < 24  # the chain stops at the corrupt page
        assert torch.equal(kv, original[:, :from_l3])
        await second.drain()
        second.check_invariants()


async def test_pages_swapped_on_disk_are_a_miss_never_the_other_prefixs_kv(
        tmp_path: Path) -> None:
    cfg = make_config(storage=f"file://{tmp_path}", **L3)
    a, b = make_tokens(16, seed=1), make_tokens(16, seed=2)
    async with HiCache(cfg) as first:
        kv_a, kv_b = await fill_l3(first, a), await fill_l3(first, b)
        tier = first.storage
        assert tier is not None and isinstance(tier.backend, FileBackend)
        keys_a, keys_b = ([key.hex() for key in tier.keys(np.asarray(t), [])]
                          for t in (a, b))
    # the index swapped on disk (the file store's journals), as a careless tool might
    await anyio.to_thread.run_sync(swap_keys, tmp_path, list(zip(keys_a, keys_b, strict=True)))
    async with HiCache(cfg) as second:
        for tokens, kv in ((a, kv_a), (b, kv_b)):
            got, from_l3 = await fetch_kv(second, tokens)
            assert from_l3 == 0 and got.shape[1] == 0, "served the other prefix's KV"
            assert torch.equal(await prefill(second, tokens), kv)  # recomputed
        st = second.stats().storage
        assert st is not None and st["corrupt"] == 8  # every page read was the other's
        await second.drain()
        second.check_invariants()


async def test_backups_go_on_after_the_store_directory_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    async with FileBackend(root, page_format(make_config(**L3))) as backend:
        cfg = make_config(storage=backend, **L3)
        async with HiCache(cfg) as first:
            await fill_l3(first, make_tokens(16, seed=1))
            await anyio.to_thread.run_sync(shutil.rmtree, root)
            original = await fill_l3(first, make_tokens(16, seed=2))
            st = first.stats().storage
            assert st is not None and (st["backed_up_pages"], st["errors"]) == (8, 0)
        async with HiCache(cfg) as second:
            kv, from_l3 = await fetch_kv(second, make_tokens(16, seed=2))
            assert from_l3 == 16 and torch.equal(kv, original)


async def test_a_failing_backend_trips_the_breaker_and_l1_l2_keep_serving() -> None:
    cfg0 = make_config(**L3)
    broken = FaultyBackend(MemoryBackend(page_format(cfg0)), seed=1, error_rate=1.0)
    cfg = make_config(storage=broken, storage_failures_to_open=2, storage_cooldown=60.0, **L3)
    async with HiCache(cfg) as cache:
        for seed in range(4):
            await prefill(cache, make_tokens(16, seed=seed))
        await cache.drain()
        s = cache.stats()
        assert s.health == "degraded" and s.storage is not None
        assert s.storage["breaker"] == "open" and s.storage["errors"] >= 2
        kv, _ = await fetch_kv(cache, make_tokens(16, seed=3))  # still an L1 hit
        assert kv.shape[1] == 16
        cache.check_invariants()


def remembering(*, failures_to_open: int, cooldown: float) -> tuple[FaultyBackend, Any]:
    """A fault-injected (for now healthy) L3 and a config that remembers its misses 600 s."""
    faulty = FaultyBackend(MemoryBackend(page_format(make_config(**L3))), seed=0)
    return faulty, make_config(storage=faulty, storage_failures_to_open=failures_to_open,
                               storage_cooldown=cooldown, storage_miss_ttl=600.0, **L3)


async def miss(cache: HiCache, seed: int) -> None:
    async with cache.fetch(make_tokens(16, seed=seed)) as hit:
        assert hit.num_cached_tokens == 0


async def test_a_prefix_l3_lacked_asks_nothing_and_leaves_the_breaker_probing() -> None:
    """A negative-cache hit once counted as a success: it closed a half-open breaker whose
    backend was still down."""
    faulty, cfg = remembering(failures_to_open=1, cooldown=0.05)
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        await miss(cache, 1)  # L3 lacks it: remembered
        faulty.error_rate = 1.0  # the backend goes down
        await miss(cache, 2)
        assert tier.breaker.state == "open"
        await asyncio.sleep(0.06)
        assert tier.breaker.state == "half_open"
        calls = faulty.inner.stats().exists_calls
        await miss(cache, 1)  # remembered: nothing is asked
        assert faulty.inner.stats().exists_calls == calls
        assert tier.breaker.state == "half_open"
        await miss(cache, 3)  # the probe: it fails
        assert tier.breaker.state == "open" and tier.breaker.times_opened == 2


async def test_prefixes_l3_lacked_do_not_reset_the_count_of_failures() -> None:
    faulty, cfg = remembering(failures_to_open=3, cooldown=60.0)
    async with HiCache(cfg) as cache:
        tier = cache.storage
        assert tier is not None
        await miss(cache, 1)
        faulty.error_rate = 1.0
        for seed in range(2, 5):  # three failures in a row, a remembered miss after each
            await miss(cache, seed)
            await miss(cache, 1)
        assert tier.breaker.state == "open"
        assert cache.stats().storage["negative_hits"] >= 3  # type: ignore[index]


async def test_cancelling_a_fetch_waiting_for_its_prefetch_leaves_the_cache_consistent(
        ) -> None:
    backend = MemoryBackend(page_format(make_config(**L3)))
    async with HiCache(make_config(storage=backend, **L3)) as first:
        original = await fill_l3(first, make_tokens(24))
    slow = FaultyBackend(backend, seed=0, latency=(0.2, 0.2))
    async with HiCache(make_config(storage=slow, **L3)) as second:
        task = asyncio.ensure_future(fetch_kv(second, make_tokens(24)))
        await anyio.wait_all_tasks_blocked()  # the fetch waits for the slow backend
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await second.drain()  # the prefetch still completes and is inserted
        second.check_invariants()
        kv, _ = await fetch_kv(second, make_tokens(24))
        assert torch.equal(kv, original)
    await backend.aclose()


async def test_a_backup_clears_the_negative_cache_entry_of_its_pages() -> None:
    cfg = make_config(storage="memory://", **L3)
    tokens = make_tokens(16, seed=7)
    async with HiCache(cfg) as cache:
        await fill_l3(cache, tokens)  # L3 missed once (negative entry), then backed them up
        await evict_everywhere_but_l3(cache)
        _, from_l3 = await fetch_kv(cache, tokens)
        assert from_l3 == 16


async def evict_everywhere_but_l3(cache: HiCache) -> None:
    """Push everything out of L1 and L2 (L3 keeps it)."""
    await cache.drain()
    cache.tree.evict_device(cache.device_pool.num_pages)
    cache.tree.evict_host(cache.host_pool.num_pages)
    cache.check_invariants()


async def test_the_stores_byte_budget_and_use_show_in_the_caches_stats(tmp_path: Path) -> None:
    """A store sized by its URL (``?max_bytes=``) reports its budget and what it holds
    through `HiCache.stats()`, so an operator sees how full L3 is."""
    async with HiCache(make_config(storage=f"file://{tmp_path}?max_bytes=1MiB", **L3)) as cache:
        await fill_l3(cache, make_tokens(24))
        st = cache.stats().storage
        assert st is not None and st.capacity_bytes == 1 << 20
        stored = st.backed_up_pages * cache.config.page_bytes
        assert st.used_bytes is not None and st.used_bytes >= stored > 0


@pytest.fixture
def hash_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat 16 tokens as a long prompt, whose L3 keys are hashed on a worker thread."""
    monkeypatch.setattr(_l3_parts, "OFFLOAD_HASH_TOKENS", 16)


@pytest.mark.usefixtures("hash_off_the_loop")
async def test_keys_hashed_off_the_loop_are_the_keys_hashed_on_it(tmp_path: Path) -> None:
    """A long prompt's keys come from a worker thread; the pages they name are the same ones
    a short prompt's keys (hashed on the loop) name, so each cache serves the other's."""
    tokens = make_tokens(24)
    async with HiCache(make_config(storage=f"file://{tmp_path}", **L3)) as first:
        async with first.fetch(tokens) as hit:
            assert hit._req.hashed is not None  # hashed on the thread
            tier = first.storage
            assert tier is not None and hit._req.hashed == tier.keys(tokens, [])
        original = await fill_l3(first, tokens)
    async with HiCache(make_config(storage=f"file://{tmp_path}", **L3)) as second:
        kv, from_l3 = await fetch_kv(second, tokens)
        assert from_l3 == 24 and torch.equal(kv, original)
        decoded = [*tokens, *make_tokens(8, seed=3)]  # decode past the hashed pages
        await prefill(second, decoded)
        await second.drain()
        second.check_invariants()


@pytest.mark.usefixtures("hash_off_the_loop")
async def test_a_fetch_cancelled_while_its_keys_are_hashed_pins_nothing(tmp_path: Path) -> None:
    async with HiCache(make_config(storage=f"file://{tmp_path}", **L3)) as cache:
        with anyio.move_on_after(0):  # cancelled at its first wait: the hashing thread
            async with cache.fetch(make_tokens(24)):
                pytest.fail("entered a fetch that was cancelled")
        cache.check_invariants()
        assert not cache._pins
        await fill_l3(cache, make_tokens(24))  # and the cache goes on
        cache.check_invariants()
