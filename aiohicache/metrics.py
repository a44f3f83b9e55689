"""Prometheus metrics of a `HiCache`: a collector to register in your own registry.

    from prometheus_client import CollectorRegistry, generate_latest
    from aiohicache.metrics import CacheCollector

    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    text = generate_latest(registry)

Several caches in one registry (TP ranks of one process) go through one `MultiCacheCollector`,
each with labels that tell it apart: collectors registered side by side would print each
family once per cache, which scrapers reject, so registering the second raises.

Every value is read from the cache when the registry is scraped (nothing is counted twice and
the cache keeps no Prometheus objects). Needs the ``metrics`` extra (``prometheus-client``).
docs/observability.md lists every metric.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from ._histogram import Histogram, TransferHistograms
from .errors import ConfigError

if TYPE_CHECKING:
    from ._stats import CacheStats
    from .api import HiCache

__all__ = ("CacheCollector", "MultiCacheCollector", "render")

PREFIX = "aiohicache"
HEALTH_STATES = ("ok", "degraded", "failed")
BREAKER_STATES = ("closed", "open", "half_open")
_OWN_LABELS = ("tier", "state", "direction", "le", "quantile")
"""Label names the collector sets itself, or that histograms and summaries reserve."""
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# (metric suffix, CacheStats.storage key, help)
_STORAGE_COUNTERS = (
    ("storage_prefetches", "prefetches", "Prefetches from L3 that inserted pages."),
    ("storage_prefetched_pages", "prefetched_pages", "Pages prefetched from L3 into L2."),
    ("storage_prefetch_misses", "prefetch_misses", "Prefetches L3 had too few pages for."),
    ("storage_negative_hits", "negative_hits", "Prefetches skipped by the negative cache."),
    ("storage_backed_up_pages", "backed_up_pages", "Pages written to L3."),
    ("storage_backup_failed_pages", "backup_failed_pages", "Pages L3 failed to store."),
    ("storage_backups_skipped", "backups_skipped",
     "Pages of backups a close cancelled before L3 took them."),
    ("storage_errors", "errors", "L3 operations that failed (each one a miss)."),
    ("storage_corrupt_pages", "corrupt", "L3 objects rejected by their checksum or key."),
    ("storage_bypassed", "bypassed", "L3 operations skipped while the breaker was open."),
)


class CacheCollector(Collector):
    """Collects one cache's metrics at scrape time (see docs/observability.md).

    Args:
        cache: the cache (open or not; before opening, transfer metrics read zero).
        labels: constant labels added to every sample, e.g. ``{"rank": "0"}`` when several
            caches (TP ranks) share a registry through `MultiCacheCollector`.

    Raises:
        ConfigError: a label name Prometheus cannot parse, reserved (``__*``), or one the
            collector sets itself (``tier``, ``state``, ``direction``, ``le``, ``quantile``).
    """

    def __init__(self, cache: HiCache, *, labels: Mapping[str, str] | None = None) -> None:
        self.cache = cache
        self._names = [_check_label(name) for name in labels or {}]
        self._values = [str(v) for v in (labels or {}).values()]

    @property
    def labels(self) -> dict[str, str]:
        """The constant labels of every sample."""
        return dict(zip(self._names, self._values, strict=True))

    def describe(self) -> list[Metric]:
        """The families a scrape would print now (their values are not what matters).

        NOTE: an empty list told the registry no names, so a second collector of the same
        families (a cache per TP rank, each registered alone) was accepted and every scrape
        printed each family twice, which scrapers reject; with the names, `register` raises.
        """
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        s = self.cache.stats()
        yield from self._requests(s)
        yield from self._transfers()
        yield from self._pools(s)
        yield from self._storage(s)
        yield self._state_set("health", "1 for the cache's current health, else 0.",
                              HEALTH_STATES, s.health)

    # ------------------------------------------------------------------ families

    def _family(self, kind: type[Metric], name: str, doc: str, labels: tuple[str, ...] = (),
                unit: str = "") -> Metric:
        return kind(f"{PREFIX}_{name}", doc, labels=[*self._names, *labels],  # type: ignore[call-arg]
                    unit=unit)

    def _add(self, family: Metric, value: float, *labels: str) -> Metric:
        family.add_metric([*self._values, *labels], value)  # type: ignore[attr-defined]
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        return self._add(self._family(CounterMetricFamily, name, doc), value)

    def _state_set(self, name: str, doc: str, states: tuple[str, ...], current: str) -> Metric:
        family = self._family(GaugeMetricFamily, name, doc, ("state",))
        for state in states:
            self._add(family, int(state == current), state)
        return family

    def _requests(self, s: CacheStats) -> Iterator[Metric]:
        yield self._counter("requests", "Fetches (requests) the cache served.", s.requests)
        yield self._counter("prompt_tokens", "Prompt tokens of those fetches.", s.prompt_tokens)
        hits = self._family(CounterMetricFamily, "hit_tokens",
                            "Prompt tokens served from a tier (L1 device, L2 host, L3 storage).",
                            ("tier",))
        for tier, n in (("L1", s.device_hit_tokens), ("L2", s.host_hit_tokens),
                        ("L3", s.storage_hit_tokens)):
            self._add(hits, n, tier)
        yield hits
        yield self._counter("miss_tokens", "Prompt tokens the engine had to compute.",
                            s.miss_tokens)
        evicted = self._family(CounterMetricFamily, "evicted_pages",
                               "Pages evicted from a tier.", ("tier",))
        self._add(evicted, s.device_evicted_pages, "L1")
        self._add(evicted, s.host_evicted_pages, "L2")
        if s.storage is not None and s.storage.evicted_pages is not None:
            self._add(evicted, s.storage.evicted_pages, "L3")  # not known (Redis): absent
        yield evicted
        yield self._counter("worker_restarts", "Transfer workers restarted after a crash.",
                            s.worker_restarts)

    def _transfers(self) -> Iterator[Metric]:
        core = self.cache._core
        per_tier: list[tuple[str, TransferHistograms]] = []
        if core.controller is not None:
            per_tier.append(("L2", core.controller.counters.histograms))
        if core.storage is not None:
            per_tier.append(("L3", core.storage.histograms))
        for direction, what in (("load", "towards the device (L2 -> L1, L3 -> L2)"),
                                ("store", "away from the device (L1 -> L2, L2 -> L3)")):
            for quantity in ("bytes", "seconds"):
                family = self._family(
                    HistogramMetricFamily, f"kv_{direction}_{quantity}",
                    f"{quantity.capitalize()} of each copy {what}, by the tier copied "
                    "from or to.", ("tier",))
                for tier, hists in per_tier:
                    h: Histogram = getattr(hists, f"{direction}_{quantity}")
                    family.add_metric([*self._values, tier],  # type: ignore[attr-defined]
                                      buckets=h.cumulative(), sum_value=h.sum)
                yield family
        if core.controller is not None:
            c = core.controller.counters
            merged = self._family(CounterMetricFamily, "merged_transfers",
                                  "Copies that rode along in another's (L1 <-> L2).",
                                  ("direction",))
            self._add(merged, c.load_merges, "load")
            self._add(merged, c.write_merges, "store")
            yield merged
        if core.tp is not None:
            tick = self._family(SummaryMetricFamily, "tp_tick_seconds",
                                "Time the tensor-parallel consensus tick spent in its "
                                "collective.")
            tick.add_metric(self._values,  # type: ignore[attr-defined]
                            count_value=core.tp.ticks, sum_value=core.tp.tick_seconds)
            yield tick

    def _pools(self, s: CacheStats) -> Iterator[Metric]:
        pages = self._family(GaugeMetricFamily, "pages",
                             "Pages of a tier's pool by state (used includes leased).",
                             ("tier", "state"))
        for tier, state, n in (("L1", "used", s.device_pages_used),
                               ("L1", "free", s.device_pages_free),
                               ("L1", "leased", s.device_pages_leased),
                               ("L2", "used", s.host_pages_used),
                               ("L2", "free", s.host_pages_free)):
            self._add(pages, n, tier, state)
        yield pages
        page_bytes = self._family(GaugeMetricFamily, "page_size_bytes",
                                  "Bytes of one page of KV (all layers).")
        yield self._add(page_bytes, self.cache.config.page_bytes)
        pending = self._family(GaugeMetricFamily, "pending_transfers",
                               "Copies between L1 and L2 queued or in flight.", ("direction",))
        self._add(pending, s.pending_loads, "load")
        self._add(pending, s.pending_writes, "store")
        yield pending
        yield self._add(self._family(GaugeMetricFamily, "tree_nodes",
                                     "Nodes of the radix tree."), s.num_nodes)

    def _storage(self, s: CacheStats) -> Iterator[Metric]:
        storage, stats = self.cache._core.storage, s.storage
        if storage is None or stats is None:
            return
        for name, key, doc in _STORAGE_COUNTERS:
            yield self._counter(name, doc, float(getattr(stats, key)))
        yield self._counter("storage_breaker_opened", "Times the L3 breaker opened.",
                            storage.breaker.times_opened)
        yield self._state_set("storage_breaker_state",
                              "1 for the L3 breaker's current state, else 0.", BREAKER_STATES,
                              stats.breaker)
        for key, doc in (("capacity_bytes", "The L3 backend's byte budget."),
                         ("used_bytes", "Bytes the L3 backend holds.")):
            if (value := getattr(stats, key)) is not None:
                yield self._add(self._family(GaugeMetricFamily, f"storage_{key}", doc), value)
        if stats.server_evicted_keys is not None:
            yield self._counter("storage_server_evicted_keys",
                                "Keys the Redis server evicted, server-wide (INFO stats "
                                "evicted_keys, every client's; as last seen).",
                                stats.server_evicted_keys)


def _check_label(name: str) -> str:
    if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
        raise ConfigError(f"labels: {name!r} is not a Prometheus label name "
                          "([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)")
    if name in _OWN_LABELS:
        raise ConfigError(f"labels: {name!r} is a label the collector sets itself "
                          f"({', '.join(_OWN_LABELS)})")
    return name


class MultiCacheCollector(Collector):
    """Several caches' metrics in one registry (TP ranks of one process): each family once,
    with the samples of every cache.

        registry.register(MultiCacheCollector([CacheCollector(c, labels={"rank": str(r)})
                                               for r, c in enumerate(caches)]))

    Args:
        collectors: one per cache, all with the same label names and different values.

    Raises:
        ConfigError: the collectors' label names differ, or two have the same values (their
            samples would collide).
    """

    def __init__(self, collectors: Iterable[CacheCollector]) -> None:
        self.collectors = list(collectors)
        names = {tuple(c.labels) for c in self.collectors}
        if len(names) > 1:
            raise ConfigError(f"labels: the caches must have the same label names, got "
                              f"{sorted(names)}")
        values = [tuple(c.labels.values()) for c in self.collectors]
        if len(set(values)) < len(values):
            raise ConfigError(f"labels: two caches have the same labels {values}: give each "
                              "values that tell it apart")

    def describe(self) -> list[Metric]:
        return list(self.collect())  # as CacheCollector's: a duplicate registration raises

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if (first := families.get(family.name)) is None:
                    families[family.name] = family
                else:
                    first.samples.extend(family.samples)
        yield from families.values()


def render(cache: HiCache, *, labels: Mapping[str, str] | None = None) -> bytes:
    """The Prometheus text exposition of `cache` alone."""
    from prometheus_client import CollectorRegistry, generate_latest

    # NOTE: the collector as the registry: `generate_latest` only collects, and registering
    # it would collect once more (`describe`) on every scrape of `aiohicache serve`
    return generate_latest(cast(CollectorRegistry, CacheCollector(cache, labels=labels)))
