"""A Redis Cluster node that hangs (SIGSTOP: its connections stay open, nothing answers, no
replica takes over) costs one `socket_timeout`, not one per call: after its first timeout it
is skipped for `node_cooldown` seconds (its pages are misses at once, its writes refused),
then one call probes it and its answer ends the skipping. Each test damages its own cluster
of 3 primaries (about 2 s to start); every hit of a cache is checked by `KVOracle`.

(Before, every call that touched the hung node waited the full `socket_timeout` before its
pages counted as misses, and as the other nodes answered, the cache's breaker never opened:
under ``wait_complete`` every prefill took the timeout, under ``timeout`` each waited its
prefetch timeout.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import cluster as redis_cluster

from aiohicache import HiCache
from aiohicache._redis_server import RedisServer
from aiohicache.errors import ConfigError
from aiohicache.storage import _redis as redis_module
from aiohicache.storage.errors import StorageReadError
from aiohicache.storage.factory import backend_from_url, check_url
from aiohicache.storage.redis import RedisClusterBackend
from aiohicache.testing import KVOracle, small_config, storage_format
from tests.conftest import make_tokens

from .conftest import FMT, make_keys, make_page
from .conftest import page_views as pages
from .conftest import read_pages as read
from .test_cluster_pressure_review import READER, own_cluster, page_slots, slot_owners, store

TIMEOUT = 1.5
"""The backends' `socket_timeout` here (the default is 5 s)."""
PROMPT = TIMEOUT / 3
"""What "at once" means: well under one timeout."""


def hung_node_first(monkeypatch: pytest.MonkeyPatch, victim: RedisServer) -> None:
    """Have redis-py ask `victim` first whenever it reads the slot map (it shuffles the nodes
    it knows: the worst order, every time)."""
    def shuffle(nodes: list[Any]) -> None:
        nodes.sort(key=lambda node: node.port != victim.port)

    monkeypatch.setattr(redis_cluster.random, "shuffle", shuffle)


async def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = await call()
    return result, time.monotonic() - start


def served_by(backend: RedisClusterBackend, keys: list[str], port: int) -> list[bool]:
    """Whether each key's slot is the node's on `port`, as `backend`'s slot map says."""
    client: Any = backend._client
    return [client.get_node_from_key(backend.key_prefix + key).port == port for key in keys]


async def test_a_hung_node_is_skipped_after_its_first_timeout_then_served_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One primary of three hangs: the first call that touches it waits its timeout; then,
    for `node_cooldown`, every read, `exists` and write returns at once, its pages missed
    (read), `exists` stopping at its first page, its writes refused, the other nodes'
    pages served and stored, each skip counted. Neither re-reading the slot map (the hung
    node asked first) nor the look at ``maxmemory`` (made by every write here) waits for
    it. Once it answers again, the first call after the cool-down serves every page."""
    monkeypatch.setattr(redis_module, "_INFO_INTERVAL_S", 0.0)
    keys = make_keys(60, seed=1)
    with own_cluster(replicas=0) as cluster:
        victim = cluster.nodes[2]
        hung_node_first(monkeypatch, victim)
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT,
                                       node_cooldown=2.5) as backend:
            assert await backend.set_from(keys, pages(keys)) == [True] * 60
            lost = served_by(backend, keys, victim.port)
            right = [None if gone else make_page(k) for k, gone in zip(keys, lost, strict=True)]
            victim.pause()
            try:
                got, took = await timed(lambda: read(backend, keys))
                assert got == right and took >= TIMEOUT * 0.9  # the one timeout
                opened = time.monotonic()
                for _ in range(3):
                    await asyncio.sleep(0.3)  # past the slot map's re-read (every 0.25 s)
                    got, took = await timed(lambda: read(backend, keys))
                    assert got == right and took < PROMPT, took
                    found, took = await timed(lambda: backend.exists(keys))
                    assert found == lost.index(True) and took < PROMPT, took
                    stored, took = await timed(lambda: backend.set_from(keys, pages(keys)))
                    assert stored == [not gone for gone in lost] and took < PROMPT, took
                extra = backend.stats().extra
                assert extra["nodes_skipped"] >= 9 and extra["node_failures"] >= 10
            finally:
                victim.resume()
            cluster.wait_ok(cluster.nodes)
            await asyncio.sleep(opened + 2.6 - time.monotonic())  # the rest of the cool-down
            assert await read(backend, keys) == [make_page(k) for k in keys]
            assert await backend.set_from(keys, pages(keys)) == [True] * 60


@pytest.mark.parametrize("policy", ["wait_complete",
                                    pytest.param("timeout", marks=pytest.mark.slow)])
async def test_a_cache_serves_the_other_nodes_pages_at_once_while_one_node_hangs(
        policy: str) -> None:
    """A cache over a cluster with one primary hung: after the one prefill that waited for
    its timeout, each prefill returns at once with every page before the prompt's first
    page on the hung node served (each hit right), the breaker closed and health ok; once
    the node answers again, the cache serves its pages after the cool-down."""
    warm, *batch = [make_tokens(160, seed=1000 + i) for i in range(8)]
    with own_cluster(replicas=0) as cluster:
        await store(cluster.url(), [warm, *batch])
        victim = cluster.nodes[1]
        owners = slot_owners(cluster)
        fields: dict[str, Any] = {**READER, "prefetch_policy": policy}
        backend = RedisClusterBackend(cluster.url(), storage_format(small_config(**fields)),
                                      socket_timeout=TIMEOUT, node_cooldown=2.0)
        try:
            async with HiCache(small_config(storage=backend, **fields)) as cache:
                kv = KVOracle(cache)
                served = [next((i for i, s in enumerate(page_slots(cache, t))
                                if owners[s] == victim.port), 40) for t in batch]
                assert await kv.prefill(warm) == 160  # a cache that was serving
                victim.pause()
                try:
                    hits, took = await timed(lambda: kv.prefill(batch[0]))
                    assert took >= TIMEOUT * 0.9  # the one timeout (within the prefetch's)
                    assert hits == 4 * served[0] or policy == "timeout"
                    for tokens, n in zip(batch[1:5], served[1:5], strict=True):
                        hits, took = await timed(lambda t=tokens: kv.prefill(t))
                        assert hits == 4 * n and took < PROMPT, took
                finally:
                    victim.resume()
                assert sum(served[:5]) > 0 and kv.hits_checked > 0
                st = cache.stats().storage
                assert st is not None and (st.errors, st.breaker) == (0, "closed")
                assert cache.stats().health == "ok"
                cluster.wait_ok(cluster.nodes)
                await asyncio.sleep(2.0)  # the cool-down
                assert [await kv.prefill(t) for t in batch[5:]] == [160, 160]
        finally:
            await backend.aclose()


async def test_with_every_node_hung_calls_raise_at_once_and_the_cache_breaker_opens() -> None:
    """Every primary hung: the first call waits its timeout and raises (every node failed),
    the next ones raise at once (every node skipped: the whole store is down), so the
    cache's breaker opens after `storage_failures_to_open` prefills, not that many
    timeouts; once the nodes answer, the cache serves L3 again."""
    warm, *batch = [make_tokens(160, seed=1100 + i) for i in range(7)]
    keys = make_keys(30, seed=2)
    with own_cluster(replicas=0) as cluster:
        await store(cluster.url(), [warm, *batch])
        fields: dict[str, Any] = {**READER, "storage_failures_to_open": 3,
                                  "storage_cooldown": 1.0}
        backend = RedisClusterBackend(cluster.url(), storage_format(small_config(**fields)),
                                      socket_timeout=TIMEOUT, node_cooldown=1.0)
        try:
            async with HiCache(small_config(storage=backend, **fields)) as cache:
                kv = KVOracle(cache)
                assert await kv.prefill(warm) == 160  # a cache that was serving
                for server in cluster.nodes:
                    server.pause()
                try:
                    hits, took = await timed(lambda: kv.prefill(batch[0]))
                    assert hits == 0 and took >= TIMEOUT * 0.9
                    for tokens in batch[1:4]:
                        hits, took = await timed(lambda t=tokens: kv.prefill(t))
                        assert hits == 0 and took < PROMPT, took
                    st = cache.stats().storage
                    assert st is not None and (st.errors, st.breaker) == (3, "open")
                    with pytest.raises(StorageReadError, match="timed out"):
                        await backend.exists(keys)
                finally:
                    for server in cluster.nodes:
                        server.resume()
                cluster.wait_ok(cluster.nodes)
                await asyncio.sleep(1.0)  # both cool-downs
                assert [await kv.prefill(t) for t in batch[4:]] == [160, 160]
                st = cache.stats().storage
                assert st is not None and st.breaker == "closed"
        finally:
            await backend.aclose()


async def test_a_probe_cancelled_lets_the_next_call_probe() -> None:
    """The call that probes a hung node after the cool-down is cancelled (its caller gave
    up): the node is not left skipped for good; once it answers, the next call probes it
    and its pages are served."""
    keys = make_keys(30, seed=3)
    with own_cluster(replicas=0) as cluster:
        victim = cluster.nodes[0]
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT,
                                       node_cooldown=0.5) as backend:
            assert await backend.set_from(keys, pages(keys)) == [True] * 30
            assert any(served_by(backend, keys, victim.port))
            victim.pause()
            try:
                await read(backend, keys)  # its timeout: skipped from now on
                await asyncio.sleep(0.6)
                probe = asyncio.ensure_future(read(backend, keys))
                await asyncio.sleep(0.2)
                assert not probe.done()  # waiting for the hung node
                probe.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await probe
            finally:
                victim.resume()
            cluster.wait_ok(cluster.nodes)
            assert await read(backend, keys) == [make_page(k) for k in keys]


async def test_a_failover_is_seen_by_calls_that_come_more_often_than_the_map_is_read() -> None:
    """A primary killed (its replica takes over in about two node timeouts) under reads
    that come every 0.1 s: the slot map is read again (at most every 0.25 s) and the
    replica's slots are served within seconds. (The 0.25 s counted from the last failure,
    which each call renewed: the map was never read again, and a backend that only read
    missed the node's pages for good; writes hid it, the look at ``maxmemory`` they make
    every 10 s having the client read the map again.)"""
    keys = make_keys(60, seed=4)
    with own_cluster(replicas=1) as cluster:
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT) as backend:
            assert await backend.set_from(keys, pages(keys)) == [True] * 60
            await asyncio.sleep(0.3)  # replicated by now
            cluster.primaries()[1].kill()
            killed_at = time.monotonic()
            while (got := await read(backend, keys)) != [make_page(k) for k in keys]:
                assert all(p in (None, make_page(k)) for k, p in zip(keys, got, strict=True))
                assert time.monotonic() - killed_at < 10, "the failover was never seen"
                await asyncio.sleep(0.1)


async def test_node_cooldown_is_a_keyword_or_a_cluster_url_option() -> None:
    """`node_cooldown` (seconds >= 0, default 10) is a keyword of the backend or a query
    option of a cluster URL (the other options still go to redis-py); given both ways, or
    not a number of seconds, it is a `ConfigError` (`check_url` says so too)."""
    url = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
    made = [backend_from_url(url, FMT), backend_from_url(f"{url}?node_cooldown=2.5", FMT),
            backend_from_url(f"{url}?socket_keepalive=true&node_cooldown=0", FMT),
            backend_from_url(url, FMT, node_cooldown=1)]
    try:
        assert [b._circuits.cooldown for b in made] == [10.0, 2.5, 0.0, 1.0]  # type: ignore[attr-defined]
    finally:
        for backend in made:
            await backend.aclose()
    for bad in ("node_cooldown=-1", "node_cooldown=soon", "node_cooldown=nan",
                "node_cooldown=1&node_cooldown=2", "node_cooldown=1&bogus=1"):
        with pytest.raises(ConfigError, match="node_cooldown|bogus"):
            check_url(f"{url}?{bad}")
        with pytest.raises(ConfigError, match="node_cooldown|bogus"):
            backend_from_url(f"{url}?{bad}", FMT)
    with pytest.raises(ConfigError, match="node_cooldown"):
        backend_from_url(f"{url}?node_cooldown=1", FMT, node_cooldown=1)
    with pytest.raises(ConfigError, match="node_cooldown"):
        RedisClusterBackend(url, FMT, node_cooldown=-1.0)
