"""Prometheus metrics against the truth (a review): what a scrape shows must be what
`stats()` and the tiers did, and a registry must refuse an exposition scrapers reject.

Each test states a rule; they failed before the fix beside them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiohicache import HiCache
from aiohicache._stats import StorageStats
from aiohicache.metrics import CacheCollector, MultiCacheCollector, render
from aiohicache.testing import storage_format, with_storage
from tests.conftest import make_cache, make_config, make_tokens, prefill
from tests.test_observe_review import GatedStore

DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


# ---------------------------------------------------------------------- L3 counters exposed

async def test_every_l3_counter_of_stats_is_exposed_and_documented() -> None:
    """Every counter `stats().storage` keeps is a Prometheus counter with the same value,
    listed in docs/observability.md. `backups_skipped` (pages of backups a close cancelled
    before L3 took them: what a shutdown left out of L3) was in `stats()` only: a scrape,
    the only view a running server gives, never showed the pages it lost at each restart."""
    cfg = make_config(backup_threshold=1)
    store = GatedStore(storage_format(cfg))
    store.writes.clear()  # the backup stays in flight until the close cancels it
    cache = HiCache(with_storage(cfg, store))
    async with cache:
        await prefill(cache, make_tokens(12))
        await cache.controller.drain()
        for _ in range(5):
            await asyncio.sleep(0)
    s = cache.stats().storage
    assert s is not None and s.backups_skipped == 3  # the pages that never reached L3
    got = samples(render(cache))
    exposed = {name for name, _ in got}
    documented = set(re.findall(r"`(aiohicache_storage_\w+)`", DOCS.read_text()))
    counters = [f.name for f in dataclasses.fields(StorageStats)
                if f.type == "int" and f.name not in ("capacity_bytes", "used_bytes")]
    for field in counters:
        names = [n for n in exposed if n.startswith("aiohicache_storage_")
                 and n.endswith("_total") and field.replace("corrupt", "corrupt_pages")
                 == n.removeprefix("aiohicache_storage_").removesuffix("_total")]
        assert names, f"stats().storage.{field} is not exposed"
        assert got[(names[0], ())] == getattr(s, field), field
        assert names[0] in documented, f"{names[0]} is not in docs/observability.md"


# ---------------------------------------------------------------------- registry collisions

async def test_a_second_collector_of_the_same_families_is_refused_when_registered() -> None:
    """Two `CacheCollector`s in one registry (a TP rank each, as the first snippet of the
    docs, once per cache) print every family twice: the OpenMetrics parser rejects the whole
    page ("Clashing name") and Prometheus's text parser drops or mixes them. The registry
    catches duplicated names when it is told the names (`describe`); the collectors told it
    none, so the mistake surfaced only at scrape time, in the scraper. Registering the
    second must raise (use `MultiCacheCollector`); one collector, or a `MultiCacheCollector`
    of both, registers and scrapes as before."""
    async with make_cache() as rank0, make_cache() as rank1:
        await prefill(rank0, make_tokens(8))
        registry = CollectorRegistry()
        registry.register(CacheCollector(rank0, labels={"rank": "0"}))
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            registry.register(CacheCollector(rank1, labels={"rank": "1"}))
        assert samples(generate_latest(registry))[
            ("aiohicache_prompt_tokens_total", (("rank", "0"),))] == 8

        merged = CollectorRegistry()
        merged.register(MultiCacheCollector([CacheCollector(rank0, labels={"rank": "0"}),
                                             CacheCollector(rank1, labels={"rank": "1"})]))
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            merged.register(CacheCollector(rank1, labels={"rank": "1"}))
        got = samples(generate_latest(merged))
    assert got[("aiohicache_prompt_tokens_total", (("rank", "1"),))] == 0


def test_describing_a_collector_before_the_cache_opens_reads_nothing_it_cannot() -> None:
    """`describe` (run by `register`) works on a cache not opened yet, as scraping does."""
    cache = make_cache(storage="memory://")
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    assert samples(generate_latest(registry))[("aiohicache_requests_total", ())] == 0
