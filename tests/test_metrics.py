"""Prometheus metrics: the collector's exposition, parsed back with prometheus-client."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiohicache import ConfigError, HiCache
from aiohicache.controller import page_format
from aiohicache.metrics import CacheCollector, render
from aiohicache.storage.faults import FaultyBackend
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import make_cache, make_config, make_tokens, prefill

L3 = {"prefetch_policy": "wait_complete", "prefetch_threshold": 8, "device_pages": 16,
      "host_pages": 32}


def samples(text: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text.decode())}


async def evict_all(cache: HiCache) -> None:
    await cache.drain()
    slots = await cache.allocate(cache.device_pool.num_slots)
    cache.free(slots)


async def test_exposition_counts_hits_per_tier_transfers_evictions_and_pools() -> None:
    async with make_cache(device_pages=8, host_pages=16) as cache:
        registry = CollectorRegistry()
        registry.register(CacheCollector(cache, labels={"rank": "0"}))
        tokens = make_tokens(12)
        await prefill(cache, tokens)          # miss, write-through to L2
        await prefill(cache, tokens)          # L1 hit
        await evict_all(cache)
        await prefill(cache, tokens)          # L2 hit, loaded back
        await cache.drain()
        text = generate_latest(registry)
        got = samples(text)
        s = cache.stats()

    def v(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"rank": "0", **labels}.items())))]

    assert v("aiohicache_requests_total") == s.requests == 3
    assert v("aiohicache_prompt_tokens_total") == 36
    assert v("aiohicache_hit_tokens_total", tier="L1") == 12
    assert v("aiohicache_hit_tokens_total", tier="L2") == 12
    assert v("aiohicache_hit_tokens_total", tier="L3") == 0
    assert v("aiohicache_miss_tokens_total") == 12
    assert v("aiohicache_evicted_pages_total", tier="L1") == s.device_evicted_pages == 3
    assert v("aiohicache_kv_load_bytes_count", tier="L2") == s.loads == 1
    assert v("aiohicache_kv_load_bytes_sum", tier="L2") == s.loaded_bytes
    assert v("aiohicache_kv_store_bytes_count", tier="L2") == s.writes
    assert v("aiohicache_kv_store_seconds_count", tier="L2") == s.writes
    assert v("aiohicache_kv_store_seconds_bucket", tier="L2", le="+Inf") == s.writes
    assert v("aiohicache_kv_load_seconds_sum", tier="L2") > 0
    assert v("aiohicache_pages", tier="L1", state="used") == s.device_pages_used
    assert v("aiohicache_pages", tier="L2", state="free") == s.host_pages_free
    assert v("aiohicache_health", state="ok") == 1
    assert v("aiohicache_health", state="failed") == 0
    assert v("aiohicache_worker_restarts_total") == 0
    types = families(text)
    assert types["aiohicache_hit_tokens"] == "counter"
    assert types["aiohicache_kv_load_seconds"] == "histogram"
    assert types["aiohicache_pages"] == "gauge"
    assert not any("ratio" in name or "rate" in name for name in types)


async def test_buckets_are_cumulative_and_end_at_the_count() -> None:
    async with make_cache() as cache:
        for seed in range(3):
            await prefill(cache, make_tokens(8, seed=seed))
        await cache.drain()
        got = samples(render(cache))
    buckets = sorted(((float(dict(labels)["le"]), value) for (name, labels), value in got.items()
                      if name == "aiohicache_kv_store_bytes_bucket"), key=lambda b: b[0])
    counts = [value for _, value in buckets]
    assert counts == sorted(counts) and counts[-1] == got[
        ("aiohicache_kv_store_bytes_count", (("tier", "L2"),))] == 3


async def test_l3_errors_and_the_breaker_are_exposed_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg0 = make_config(**L3)
    broken = FaultyBackend(MemoryBackend(page_format(cfg0)), seed=1, error_rate=1.0)
    cfg = make_config(storage=broken, storage_failures_to_open=2, storage_cooldown=60.0, **L3)
    with caplog.at_level(logging.INFO, logger="aiohicache"):
        async with HiCache(cfg) as cache:
            for seed in range(4):
                await prefill(cache, make_tokens(16, seed=seed))
            await cache.drain()
            got = samples(render(cache))
    assert got[("aiohicache_storage_errors_total", ())] >= 2
    assert got[("aiohicache_storage_breaker_state", (("state", "open"),))] == 1
    assert got[("aiohicache_storage_breaker_state", (("state", "closed"),))] == 0
    assert got[("aiohicache_storage_breaker_opened_total", ())] == 1
    assert got[("aiohicache_health", (("state", "degraded"),))] == 1
    assert ("aiohicache_kv_store_bytes_count", (("tier", "L3"),)) in got
    opened = [r for r in caplog.records if getattr(r, "event", None) == "breaker_open"]
    assert len(opened) == 1 and opened[0].levelno == logging.WARNING
    assert opened[0].tier == "L3"  # type: ignore[attr-defined]
    failed = [r for r in caplog.records if getattr(r, "op", None) in ("backup", "prefetch")]
    assert failed and all(r.levelno == logging.WARNING for r in failed)


async def test_l3_hits_and_byte_histograms_after_a_prefetch(tmp_path: object) -> None:
    async with HiCache(make_config(storage="memory://", backup_threshold=1, **L3)) as cache:
        tokens = make_tokens(16)
        await prefill(cache, tokens)
        await cache.drain()
        await cache.drain()
        cache.tree.evict_device(cache.device_pool.num_pages)
        cache.tree.evict_host(cache.host_pool.num_pages)
        await prefill(cache, tokens)
        got = samples(render(cache))
        s = cache.stats()
    assert got[("aiohicache_hit_tokens_total", (("tier", "L3"),))] == s.storage_hit_tokens > 0
    assert got[("aiohicache_kv_load_bytes_count", (("tier", "L3"),))] == 1
    assert got[("aiohicache_kv_store_bytes_sum", (("tier", "L3"),))] > 0
    assert got[("aiohicache_storage_prefetched_pages_total", ())] == 4


async def test_l3_store_bytes_count_only_the_pages_the_store_took() -> None:
    """A store refuses an object larger than its whole budget (a miss later, nothing
    lost); the byte histogram is what moved into L3, as the load side's is what arrived."""
    cfg0 = make_config(**L3)
    page = cfg0.page_bytes
    store = MemoryBackend(page_format(cfg0), capacity_bytes=page)  # < page + header
    async with HiCache(make_config(storage=store, backup_threshold=1, **L3)) as cache:
        await prefill(cache, make_tokens(16))  # 4 pages offered in one backup
        await cache.drain()
        got = samples(render(cache))
        held = store.stats().used_bytes
    assert held == 0
    assert got[("aiohicache_kv_store_bytes_count", (("tier", "L3"),))] >= 1
    assert got[("aiohicache_kv_store_bytes_sum", (("tier", "L3"),))] == 0


async def test_a_registry_can_be_scraped_before_the_cache_opens() -> None:
    cache = make_cache()
    got = samples(render(cache))
    assert got[("aiohicache_requests_total", ())] == 0
    assert ("aiohicache_kv_load_bytes_count", (("tier", "L2"),)) not in got


async def test_several_caches_share_a_registry_with_each_family_once() -> None:
    """TP ranks in one process: one registry, each cache told apart by a label. Two
    `CacheCollector`s registered side by side print every family twice, which scrapers
    reject (the OpenMetrics parser: "Clashing name"); `MultiCacheCollector` merges them."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    from aiohicache.metrics import MultiCacheCollector

    async with make_cache() as rank0, make_cache() as rank1:
        await prefill(rank0, make_tokens(8))
        await prefill(rank1, make_tokens(16))
        registry = CollectorRegistry()
        registry.register(MultiCacheCollector([CacheCollector(rank0, labels={"rank": "0"}),
                                               CacheCollector(rank1, labels={"rank": "1"})]))
        text = generate_latest(registry)
        parsed = list(parse_openmetrics(openmetrics(registry).decode()))
    got = samples(text)
    assert text.decode().count("# TYPE aiohicache_requests_total counter") == 1
    assert len({f.name for f in parsed}) == len(parsed)
    assert got[("aiohicache_prompt_tokens_total", (("rank", "0"),))] == 8
    assert got[("aiohicache_prompt_tokens_total", (("rank", "1"),))] == 16


def test_merged_collectors_must_tell_their_caches_apart() -> None:
    from aiohicache.metrics import MultiCacheCollector

    a, b = make_cache(), make_cache()
    with pytest.raises(ConfigError, match="^labels: .*tell"):
        MultiCacheCollector([CacheCollector(a, labels={"rank": "0"}),
                             CacheCollector(b, labels={"rank": "0"})])
    with pytest.raises(ConfigError, match="^labels: .*same label names"):
        MultiCacheCollector([CacheCollector(a, labels={"rank": "0"}),
                             CacheCollector(b, labels={"node": "1"})])


@pytest.mark.parametrize("name", ["tier", "state", "direction", "le", "quantile", "bad-name",
                                  "0rank", "__reserved", ""])
def test_labels_that_would_break_the_exposition_are_refused(name: str) -> None:
    """A label the collector adds itself (``tier="x",tier="L1"``: duplicate names), ``le``
    on a histogram (its bucket bound), or a name Prometheus cannot parse: a scraper rejects
    the whole exposition, so the collector refuses it when made."""
    with pytest.raises(ConfigError, match="^labels: "):
        CacheCollector(make_cache(), labels={name: "x"})
