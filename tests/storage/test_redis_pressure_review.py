"""A review of the Redis L3 under real server pressure, through whole caches (L1 + L2 +
``redis://`` L3) whose every hit is checked by `KVOracle`: eviction behind the cache, writes
refused out of memory, FLUSHALL and CLIENT KILL mid-run, restarts, objects overwritten,
replies over the server's output buffer limit. Each test runs its own redis-server (they
change its configuration)."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from aiohicache import HiCache
from aiohicache._redis_server import RedisServer
from aiohicache.testing import KVOracle, small_config
from tests.conftest import make_tokens

from .redis_server import disturb, started

L3: dict[str, Any] = {"prefetch_policy": "wait_complete", "prefetch_threshold": 4,
                      "device_pages": 64, "host_pages": 256}
PAGE_OBJECT = 64 + 768
"""Bytes of one stored page of `small_config` (header + payload)."""


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own."""
    srv = started(RedisServer())
    try:
        yield srv
    finally:
        srv.stop()


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url(), socket_timeout=5)


def prompts(n: int, length: int = 160, *, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens sharing a 32-token system prompt."""
    return [make_tokens(32, seed=seed) + make_tokens(length - 32, seed=seed + 1 + i)
            for i in range(n)]


async def store(url: str, batch: list[list[int]], **overrides: Any) -> None:
    """Compute `batch` in a cache of its own and back every page up to L3."""
    async with HiCache(small_config(storage=url, **{**L3, **overrides})) as writer:
        kv = KVOracle(writer)
        for tokens in batch:
            await kv.prefill(tokens)
        await writer.drain()


# ------------------------------------------------------------------------------ findings

async def test_reads_that_fail_every_time_open_the_breaker_though_exists_answers(
        server: RedisServer) -> None:
    """A store whose reads all fail (here: each reply is over the server's output buffer
    limit for normal clients, so it closes the connection) while ``EXISTS`` answers opens
    the breaker after `storage_failures_to_open` failed prefetches, and once the reads work
    again the cache serves from L3. (The successful ``EXISTS`` that starts each prefetch
    was recorded as a success: the count of failures in a row went back to 0 before every
    read, so the breaker never opened and every fetch paid a failing read.)"""
    url = server.url()
    batch = [make_tokens(160, seed=50 + i) for i in range(6)]  # no prefix in common
    await store(url, batch)
    with raw(server) as r:
        r.config_set("client-output-buffer-limit", "normal 8kb 8kb 0")  # 40 pages: 33 KB
    cfg = small_config(storage=url, storage_failures_to_open=3, storage_cooldown=0.5,
                       backup_threshold=1000, **L3)  # a reader: it backs nothing up
    async with HiCache(cfg) as reader:
        kv = KVOracle(reader)
        for tokens in batch[:5]:
            assert await kv.prefill(tokens) == 0
        st = reader.stats().storage
        assert st is not None
        assert (st.errors, st.breaker) == (3, "open")
        assert st.bypassed == 2  # the last two fetches did not ask the failing store
        with raw(server) as r:
            r.config_set("client-output-buffer-limit", "normal 0 0 0")
        await asyncio.sleep(0.6)  # the cool-down: the next prefetch is the probe
        assert await kv.prefill(batch[5]) == len(batch[5])
        st = reader.stats().storage
        assert st is not None and st.breaker == "closed" and st.prefetched_pages == 40


async def test_a_cache_that_only_reads_reports_the_servers_maxmemory(
        server: RedisServer) -> None:
    """`stats().storage.capacity_bytes` is the server's ``maxmemory`` once the cache has
    used the store, reads only included (it was looked at only by writes: a cache that had
    not backed anything up reported no budget, as if the server had none)."""
    url = server.url()
    with raw(server) as r:
        r.config_set("maxmemory", 64 << 20)
        r.config_set("maxmemory-policy", "allkeys-lru")
    await store(url, prompts(1))
    async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as reader:
        assert await KVOracle(reader).prefill(prompts(1)[0]) == 160
        st = reader.stats().storage
        assert st is not None and st.capacity_bytes == 64 << 20 and st.used_bytes


# ------------------------------------------------------------------------------ checked, fine

@pytest.mark.slow
@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-random", "volatile-ttl"])
async def test_pages_evicted_behind_the_cache_are_misses_and_every_hit_is_right(
        server: RedisServer, policy: str) -> None:
    """With a ``maxmemory`` smaller than what is stored, the server evicts (or, with
    ``volatile-ttl`` and no TTL, refuses) some pages of many prefixes; a fresh cache serves
    each prefix's leading pages that are left, every token's KV right, and the refused
    writes are counted as failed pages, never as stored."""
    url = server.url()
    with raw(server) as r:
        r.config_set("maxmemory-policy", policy)
        r.config_set("maxmemory", 2 << 20)
    batch = prompts(30, length=152)
    async with HiCache(small_config(storage=url, **L3)) as writer:
        kv = KVOracle(writer)
        for tokens in batch:
            await kv.prefill(tokens)
        await writer.drain()
        written = writer.storage.backend.stats()  # type: ignore[union-attr]
        st = writer.stats().storage
        assert st is not None
        assert st.backup_failed_pages == written.errors
        assert st.backed_up_pages == written.pages_written
    async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as reader:
        kv = KVOracle(reader)
        for tokens in batch:
            await kv.prefill(tokens)
        assert kv.hits_checked > 0
        await reader.drain()
        reader.check_invariants()


async def test_writes_refused_out_of_memory_are_counted_and_stored_once_there_is_room(
        server: RedisServer) -> None:
    """``noeviction`` with no room left: a backup is refused (OOM), counted as failed pages,
    not as an error of the store (the breaker stays closed); what was stored before is
    served right. Once the server has room, the next backup of the prefix (its hits
    doubled) stores it. (Redis counts the pipeline's own query buffer as used memory: a
    pipeline is refused nearly whole, not a few of its pages.)"""
    url = server.url()
    first, second = (make_tokens(160, seed=70 + i) for i in range(2))
    async with HiCache(small_config(storage=url, **L3)) as writer:
        kv = KVOracle(writer)
        await kv.prefill(first)
        await writer.drain()
        with raw(server) as r:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", int(r.info("memory")["used_memory"]) // 2)
        await kv.prefill(second)
        await writer.drain()
        st = writer.stats().storage
        assert st is not None
        assert (st.backed_up_pages, st.backup_failed_pages, st.breaker) == (40, 40, "closed")
        assert writer.storage.backend.stats().errors == 40  # type: ignore[union-attr]
        async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as reader:
            assert [await KVOracle(reader).prefill(t) for t in (first, second)] == [160, 0]
        with raw(server) as r:
            r.config_set("maxmemory", 0)
        for _ in range(3):  # hits 2, 3, 4: sent again at 2 (twice the hits of the last try)
            await kv.prefill(second)
            await writer.drain()
    async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as reader:
        assert await KVOracle(reader).prefill(second) == 160


async def test_an_object_overwritten_with_other_bytes_of_its_length_is_a_miss_then_stored(
        server: RedisServer) -> None:
    """Another writer puts different bytes of the same length under a page's key: a reading
    cache misses from that page on (never serves it), the object is deleted, and its
    recomputed page goes back to L3 for the next cache."""
    url = server.url()
    tokens = prompts(1)[0]
    await store(url, [tokens])
    with raw(server) as r:
        names = sorted(r.keys("ahkv:*"))
        assert len(names) == 40
        async with HiCache(small_config(storage=url, **L3)) as probe:
            tier = probe.storage
            assert tier is not None
            keys = tier.keys(np.asarray(tokens, dtype=np.int64), [])
            prefix = tier.backend.key_prefix  # type: ignore[attr-defined]
        name = f"{prefix}{keys[20].hex()}".encode()
        blob = r.get(name)
        assert isinstance(blob, bytes)
        r.set(name, blob[:100] + bytes(b ^ 0x5A for b in blob[100:200]) + blob[200:])
        async with HiCache(small_config(storage=url, **L3)) as reader:
            assert await KVOracle(reader).prefill(tokens) == 20 * 4
            assert reader.stats().storage.corrupt == 1  # type: ignore[union-attr]
            await reader.drain()
        assert r.get(name) != blob[:100] + bytes(b ^ 0x5A for b in blob[100:200]) + blob[200:]
    async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as fresh:
        assert await KVOracle(fresh).prefill(tokens) == len(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("chaos", ["flushall", "client_kill", "maxmemory"])
async def test_chaos_on_the_server_mid_run_never_serves_wrong_kv_and_the_cache_recovers(
        server: RedisServer, chaos: str) -> None:
    """Two caches serve 120 prompts concurrently while the server is flushed (FLUSHALL,
    sync and async), has the caches' connections killed (CLIENT KILL), or gets a low
    ``maxmemory`` (noeviction) every few milliseconds: every hit is right, the invariants
    hold, and afterwards caches store and serve from L3 again."""
    url = server.url()
    cfg = small_config(storage=url, storage_failures_to_open=3, storage_cooldown=0.2, **L3)
    rng = random.Random(0)
    batch = [make_tokens(32, seed=rng.randrange(3)) + make_tokens(rng.randrange(8, 120),
                                                                  seed=rng.randrange(4, 40))
             for _ in range(120)]
    stop = asyncio.Event()

    async def chaos_loop() -> None:
        with raw(server) as r:
            await disturb(r, chaos, stop, rng, policy="noeviction", limits=["1mb", "1200kb", "0"])

    async with HiCache(cfg) as a, HiCache(cfg) as b:
        oracles = [KVOracle(a), KVOracle(b)]

        async def serve(k: int) -> None:
            for tokens in batch[k::4]:
                await oracles[k % 2].prefill(tokens)

        task = asyncio.ensure_future(chaos_loop())
        await asyncio.gather(*(serve(k) for k in range(4)))
        stop.set()
        await task
        for cache in (a, b):
            await cache.drain()
            cache.check_invariants()
    await asyncio.sleep(0.25)  # past the cool-down
    await store(url, batch[:10])
    async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as fresh:
        kv = KVOracle(fresh)
        assert [await kv.prefill(t) for t in batch[:10]] == [len(t) // 4 * 4 for t in batch[:10]]


def restart(server: RedisServer) -> None:
    """SIGKILL the server, then start it again on its port and directory (what it persisted
    is loaded)."""
    proc = server._proc
    assert proc is not None
    args = proc.args
    server.kill()
    with open(f"{server._dir.name}/stderr.log", "ab") as err:  # type: ignore[union-attr]
        server._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    for _ in range(500):
        try:
            with raw(server) as r:
                if r.ping():
                    return
        except redis.exceptions.RedisError:
            pass
        subprocess.run(["sleep", "0.01"], check=True)
    raise AssertionError("the server did not come back")


@pytest.mark.parametrize("persist", [("--appendonly", "yes", "--appendfsync", "always"), ()],
                         ids=["aof", "none"])
async def test_a_restarted_server_with_or_without_its_pages_is_served_right(
        persist: tuple[str, ...]) -> None:
    """The server is killed and restarted under an open cache: with AOF the pages come
    back and a fresh cache is served them, right; without persistence they are misses and
    the open cache stores them again as it serves."""
    srv = started(RedisServer(extra_args=persist))
    try:
        url = srv.url()
        batch = [make_tokens(160, seed=60 + i) for i in range(3)]
        async with HiCache(small_config(storage=url, **L3)) as cache:
            kv = KVOracle(cache)
            for tokens in batch[:2]:
                await kv.prefill(tokens)
            await cache.drain()
            restart(srv)
            await kv.prefill(batch[2])  # over connections the old server had
            await cache.drain()
            st = cache.stats().storage
            assert st is not None and st.backup_failed_pages == 0
        async with HiCache(small_config(storage=url, backup_threshold=1000, **L3)) as fresh:
            kv = KVOracle(fresh)
            hits = [await kv.prefill(tokens) for tokens in batch]
        assert hits == ([160, 160, 160] if persist else [0, 0, 160])
    finally:
        srv.stop()
