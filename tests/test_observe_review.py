"""What users observe: `stats()`, the Prometheus exposition, its histograms (a review).

Each test states a rule the counters must keep; they failed before the fix beside them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from aiohicache import HiCache
from aiohicache.metrics import render
from aiohicache.storage import MemoryBackend, PageFormat
from aiohicache.testing import KVOracle, small_config, storage_format, with_storage
from tests.conftest import make_config, make_tokens, prefill
from tests.test_cancellation import GatedEngine


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition (parsed as a scraper does), keyed by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


class GatedStore(MemoryBackend):
    """The in-memory store, but reads (``get_into``) and writes (``set_from``) wait on their
    gate first, so a test can hold one genuinely in flight. Gates start open."""

    def __init__(self, fmt: PageFormat) -> None:
        super().__init__(fmt)
        self.reads, self.writes = asyncio.Event(), asyncio.Event()
        self.reads.set()
        self.writes.set()
        self.reading = asyncio.Event()
        """Set once a read waits at (or has passed) its gate."""

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        self.reading.set()
        await self.reads.wait()
        return await super().get_into(keys, buffers)

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        await self.writes.wait()
        return await super().set_from(keys, buffers)


# ---------------------------------------------------------------------- transfer histograms

async def test_a_merged_copys_duration_is_counted_once_in_the_seconds_histogram() -> None:
    """Write-throughs queued together go out as one copy (`merged_writes`), observed per job
    (the histograms' count is `writes`, as `loaded_bytes`/`written_bytes` are per job). Each
    job observed the whole copy's duration, so `_sum` of seconds was N times the time spent
    copying, and bytes/second read from the histograms (`rate(_bytes_sum) /
    rate(_seconds_sum)`) fell by the merge factor exactly when the cache is busy. The jobs'
    seconds must add up to the copies' durations."""
    engine = GatedEngine()
    cache = HiCache(make_config(), engine=engine)
    engine.attach(cache)
    async with cache:
        await asyncio.gather(*(prefill(cache, make_tokens(8, seed=s)) for s in range(4)))
        await cache.drain()
        s = cache.stats()
        got = samples(render(cache))
    assert s.writes == 4 and s.merged_writes > 0  # some copies carried several jobs
    assert len(engine.write_handles) == s.writes - s.merged_writes

    def v(name: str) -> float:
        return got[(f"aiohicache_kv_store_{name}", (("tier", "L2"),))]

    assert v("bytes_count") == v("seconds_count") == s.writes
    assert v("bytes_sum") == s.written_bytes
    copying = sum(h.seconds for h in engine.write_handles)
    assert abs(v("seconds_sum") - copying) < 1e-9 * max(1.0, copying)


# ---------------------------------------------------------------------- per-tier hit tokens

async def test_pages_found_in_l2_are_not_counted_as_l3_hits_when_joining_a_prefetch() -> None:
    """A fetch that joins another's prefetch in flight (same prefix, the other prompt longer)
    may already have some of its pages in L2 (written through meanwhile). Those are L2 hits;
    only the pages after them came from L3. They were counted from the joined prefetch's
    start instead: 32 L3 tokens claimed where 24 came from L3 (more than the fetch had past
    its own L2 match), and 8 L2 tokens where 16 were in L2."""
    cfg = small_config(prefetch_policy="wait_complete", prefetch_threshold=20,
                       backup_threshold=1)
    store = GatedStore(storage_format(cfg))
    prompt = list(range(1000, 1048))  # 12 pages
    async with HiCache(with_storage(cfg, store)) as cache:
        kv = KVOracle(cache)
        await kv.prefill(prompt)
        await cache.drain()  # backed up: L3 holds all 12 pages
        cache.tree.evict_device(cache.device_pool.num_pages)
        cache.tree.evict_host(cache.host_pool.num_pages)
        store.reads.clear()
        long = asyncio.create_task(kv.prefill(prompt))  # prefetches pages 0..11, held
        await store.reading.wait()
        await kv.prefill(prompt[:16])  # too short to prefetch: computed, written through
        await cache.controller.drain()
        cache.tree.evict_device(cache.device_pool.num_pages)  # pages 0..3: in L2 only

        async def fetch() -> tuple[int, int, int, int]:
            async with cache.fetch(prompt[:40]) as hit:  # 4 pages in L2, joins for 4..9
                await kv.check_hit(hit, prompt[:40])
                return (hit.num_cached_tokens, hit.num_device_hit_tokens,
                        hit.num_host_hit_tokens, hit.num_storage_hit_tokens)

        before = cache.stats()
        joined = asyncio.create_task(fetch())
        for _ in range(20):
            await asyncio.sleep(0)  # it matches, joins the prefetch and waits for it
        store.reads.set()
        assert await long == 48
        cached, device, host, storage = await joined
        after = cache.stats()
    assert cached == 40 and device == 0  # it did wait for the joined prefetch
    assert after.storage["prefetches"] == 1  # type: ignore[index]
    assert (host, storage) == (16, 24)
    # the long fetch: 16 tokens from L2 (the short one's), 32 from L3
    assert after.host_hit_tokens - before.host_hit_tokens == 16 + 16
    assert after.storage_hit_tokens - before.storage_hit_tokens == 32 + 24


# ---------------------------------------------------------------------- L3 counters

async def test_backups_a_close_cancels_are_not_counted_as_pages_l3_failed_to_store() -> None:
    """`aclose` cancels L3 backups still queued or in flight (docs: drain first to have them
    stored). The store refused nothing: `backup_failed_pages` ("pages L3 refused",
    `aiohicache_storage_backup_failed_pages_total`) must not grow on every shutdown, or an
    alert on it fires at each restart. They counted as failed; they are skipped."""
    cfg = make_config(backup_threshold=1)
    store = GatedStore(storage_format(cfg))
    store.writes.clear()  # every backup stays in flight until the close cancels it
    cache = HiCache(with_storage(cfg, store))
    async with cache:
        await prefill(cache, make_tokens(12))
        await cache.controller.drain()  # written through: its 3 pages' backup is in flight
        for _ in range(5):
            await asyncio.sleep(0)
    s = cache.stats().storage
    assert s is not None
    assert s.backed_up_pages == 0 and s.errors == 0
    assert s.backup_failed_pages == 0
    assert s.backups_skipped == 3
