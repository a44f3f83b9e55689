"""L3 evictions end to end: users size L3 from `stats().storage` and ``/metrics``.

A store with a byte budget of its own (``file://``, ``memory://``) counts the pages it
evicts; the cache reports them as ``stats().storage.evicted_pages`` and
``aiohicache_evicted_pages_total{tier="L3"}``, equal to the pages that really left the store.
Redis evicts server-side (``maxmemory-policy``) and says nothing of which keys: the cache
reports no L3 eviction count there (absent, never a 0 that reads as "none"), and the server's
own ``evicted_keys`` (INFO stats: server-wide, every database and client) goes out as a
separate, clearly named value. Real stores only: files in a temporary directory, a
redis-server of the test's own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from aiohicache import HiCache
from aiohicache._redis_server import RedisServer
from aiohicache.metrics import render
from aiohicache.testing import KVOracle, small_config
from tests.conftest import make_tokens
from tests.test_metrics import samples

from .storage.redis_server import started

L3: dict[str, Any] = {"prefetch_policy": "wait_complete", "prefetch_threshold": 4,
                      "device_pages": 64, "host_pages": 256}
PAGE_OBJECT = 64 + 768
"""Bytes of one stored page of `small_config` (header + payload)."""
DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def prompts(n: int, length: int = 160, *, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens sharing a 32-token system prompt."""
    return [make_tokens(32, seed=seed) + make_tokens(length - 32, seed=seed + 1 + i)
            for i in range(n)]


def page_keys(cache: HiCache, batch: list[list[int]]) -> list[str]:
    """The distinct L3 keys of every full page of `batch`, in first-seen order."""
    tier = cache.storage
    assert tier is not None
    keys: dict[str, None] = {}
    for tokens in batch:
        for key in tier.keys(np.asarray(tokens, dtype=np.int64), []):
            keys[key.hex()] = None
    return list(keys)


def metric_rows() -> dict[str, str]:
    """docs/observability.md's metrics table: each family's row, by name."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        if m := re.match(r"\| `(aiohicache_\w+)` \|", line):
            rows[m.group(1)] = line
    return rows


# ------------------------------------------------------------------------ budgeted stores

@pytest.mark.parametrize("scheme", ["file", "memory"])
async def test_a_budgeted_store_reports_the_pages_it_evicted(scheme: str,
                                                             tmp_path: Path) -> None:
    """A file or memory store with a byte budget of 60 pages, given 328: the pages it
    evicted are `stats().storage.evicted_pages` and the L3 sample of
    ``aiohicache_evicted_pages_total``, exactly the backed-up pages no longer in the store
    (asked one by one). (Both counted them in their `BackendStats`; neither the cache's
    stats nor ``/metrics`` showed them, so L3 could not be sized from the metrics.)"""
    budget = 60 * PAGE_OBJECT
    url = (f"file://{tmp_path}?max_bytes={budget}" if scheme == "file"
           else f"memory://?max_bytes={budget}")
    batch = prompts(10)
    async with HiCache(small_config(storage=url, **L3)) as cache:
        kv = KVOracle(cache)
        for tokens in batch:
            await kv.prefill(tokens)
        await cache.drain()
        backend = cache.storage.backend  # type: ignore[union-attr]
        keys = page_keys(cache, batch)
        present = sum([await backend.exists([key]) for key in keys])
        st = cache.stats().storage
        got = samples(render(cache))
    assert st is not None
    assert st.backed_up_pages == len(keys) == 8 + 10 * 32 and st.backup_failed_pages == 0
    assert 0 < present <= 60
    assert st.evicted_pages == len(keys) - present
    assert got[("aiohicache_evicted_pages_total", (("tier", "L3"),))] == st.evicted_pages


async def test_a_store_that_evicted_nothing_reports_zero_not_unknown(tmp_path: Path) -> None:
    """A budget that holds everything: 0 evicted pages, reported as 0 (known), in the stats
    and as the L3 sample."""
    url = f"file://{tmp_path}?max_bytes={1 << 20}"
    async with HiCache(small_config(storage=url, **L3)) as cache:
        await KVOracle(cache).prefill(prompts(1)[0])
        await cache.drain()
        st = cache.stats().storage
        got = samples(render(cache))
    assert st is not None and st.backed_up_pages == 40
    assert st.evicted_pages == 0
    assert got[("aiohicache_evicted_pages_total", (("tier", "L3"),))] == 0


def test_the_docs_name_l3_evictions() -> None:
    """docs/observability.md's table says the eviction counter has an L3 sample (and which
    stores have one), and lists the Redis server's own evicted keys as server-wide."""
    rows = metric_rows()
    evicted = rows["aiohicache_evicted_pages_total"]
    assert "L3" in evicted and "Redis" in evicted
    server = rows["aiohicache_storage_server_evicted_keys_total"]
    assert "| counter |" in server and "server-wide" in server and "evicted_keys" in server


# ------------------------------------------------------------------------------ Redis

@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own (its INFO counts this test's keys only)."""
    srv = started(RedisServer())
    try:
        yield srv
    finally:
        srv.stop()


async def test_redis_reports_no_l3_eviction_count_and_the_servers_evicted_keys(
        server: RedisServer) -> None:
    """Redis under a ``maxmemory`` smaller than what is written evicts behind the cache:
    `stats().storage.evicted_pages` is None and ``aiohicache_evicted_pages_total`` has no L3
    sample (the backend cannot know which pages left: a 0 would read as "none evicted");
    `stats().storage.server_evicted_keys` and
    ``aiohicache_storage_server_evicted_keys_total`` are the server's INFO ``evicted_keys``
    as last looked at (here after a ping), which on this private server is exactly the
    backed-up pages no longer stored."""
    url = server.url()
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.config_set("maxmemory-policy", "allkeys-lru")
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + (1 << 20))
    batch = prompts(40)
    async with HiCache(small_config(storage=url, **L3)) as cache:
        kv = KVOracle(cache)
        for tokens in batch:
            await kv.prefill(tokens)
        await cache.drain()
        backend = cache.storage.backend  # type: ignore[union-attr]
        with redis.Redis.from_url(url, socket_timeout=5) as r:
            # NOTE: no limit from here on: each command over the limit evicts more first
            # (a reply as big as KEYS' did), and the counts below must be of one moment
            r.config_set("maxmemory", 0)
            present = len(r.keys(f"{backend.key_prefix}*"))
            evicted_keys = int(r.info("stats")["evicted_keys"])
        await backend.ping()  # a fresh look at the server (writes look every 10 s)
        st = cache.stats().storage
        got = samples(render(cache))
    assert st is not None
    assert 0 < present < st.backed_up_pages  # refused writes (OOM) store no key
    assert evicted_keys == st.backed_up_pages - present
    assert st.evicted_pages is None
    assert ("aiohicache_evicted_pages_total", (("tier", "L3"),)) not in got
    assert got[("aiohicache_evicted_pages_total", (("tier", "L2"),))] >= 0  # L1/L2 stay
    assert st.server_evicted_keys == evicted_keys
    assert got[("aiohicache_storage_server_evicted_keys_total", ())] == evicted_keys


async def test_stores_without_a_server_count_print_no_server_evicted_keys(
        tmp_path: Path) -> None:
    """The server's evicted keys are Redis's alone: a file store has none to report (None,
    and no sample), rather than a 0."""
    async with HiCache(small_config(storage=f"file://{tmp_path}", **L3)) as cache:
        await KVOracle(cache).prefill(prompts(1)[0])
        await cache.drain()
        st = cache.stats().storage
        got = samples(render(cache))
    assert st is not None and st.server_evicted_keys is None
    assert not any(name.startswith("aiohicache_storage_server_evicted_keys")
                   for name, _ in got)
