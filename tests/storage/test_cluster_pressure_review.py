"""A review of the Redis Cluster L3 under real pressure, through whole caches (L1 + L2 +
``redis+cluster://`` L3) whose every hit is checked by `KVOracle`: a node of three down or
forgotten, connections killed under concurrent calls, the memory look with a node down,
and (checked, fine) FLUSHALL, CLIENT KILL, ``maxmemory`` and slot migrations on one node
mid-run, a failover that loses unreplicated pages, and every node restarted.

Each page is one key (no hash tag), so a prompt's pages are spread over every primary: with
a node down, a prefix is served up to its first page on that node. Each test that damages
the cluster starts its own (3 primaries, with or without replicas: about 2 s).
"""

from __future__ import annotations

import asyncio
import logging
import random
import subprocess
import time
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
import redis
from redis.crc import key_slot

from aiohicache import HiCache
from aiohicache._redis_server import LocalCluster, RedisServer
from aiohicache.storage import _redis as redis_module
from aiohicache.storage.errors import StorageError
from aiohicache.storage.redis import RedisClusterBackend
from aiohicache.testing import KVOracle, small_config
from tests.conftest import make_tokens

from .conftest import FMT, make_keys, make_page
from .conftest import page_views as pages
from .conftest import read_pages as read
from .redis_server import disturb, running_cluster, shared_cluster

L3: dict[str, Any] = {"prefetch_policy": "wait_complete", "prefetch_threshold": 4,
                      "device_pages": 64, "host_pages": 256}
READER: dict[str, Any] = {**L3, "backup_threshold": 1000}
"""A cache that only reads L3 (it backs nothing up)."""


def own_cluster(*, replicas: int) -> AbstractContextManager[LocalCluster]:
    """A cluster of 3 primaries of the test's own (it damages it); never a skip."""
    return running_cluster(LocalCluster(replicas=replicas))


def raw(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=5)


def slot_owners(cluster: LocalCluster) -> dict[int, int]:
    """Slot -> port of the primary serving it, as a running node sees it (uncovered slots
    are absent)."""
    node = next(n for n in cluster.nodes if n.running)
    with raw(node.port) as client:
        return {slot: int(primary[1])
                for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS")
                for slot in range(start, end + 1)}


def page_slots(cache: HiCache, tokens: list[int]) -> list[int]:
    """The hash slot of each whole page of `tokens` in `cache`'s L3."""
    tier = cache.storage
    assert tier is not None
    prefix = tier.backend.key_prefix  # type: ignore[attr-defined]
    return [key_slot(f"{prefix}{key.hex()}".encode())
            for key in tier.keys(np.asarray(tokens, dtype=np.int64), [])]


async def store(url: str, batch: list[list[int]], **overrides: Any) -> None:
    """Compute `batch` in a cache of its own and back every page up to L3."""
    async with HiCache(small_config(storage=url, **{**L3, **overrides})) as writer:
        kv = KVOracle(writer)
        for tokens in batch:
            await kv.prefill(tokens)
        await writer.drain()
        st = writer.stats().storage
        assert st is not None and st.backup_failed_pages == 0


def restart(server: RedisServer) -> None:
    """Start a killed server again on its port and directory (a cluster node rejoins with
    its ``nodes.conf``; nothing else was persisted)."""
    proc = server._proc
    assert proc is not None and proc.poll() is not None
    with open(f"{server._dir.name}/stderr.log", "ab") as err:  # type: ignore[union-attr]
        server._proc = subprocess.Popen(proc.args, stdin=subprocess.DEVNULL, stdout=err,
                                        stderr=err)


# ------------------------------------------------------------------------------ findings

async def test_one_node_down_of_three_costs_its_pages_never_the_whole_store() -> None:
    """With one primary of three down (no replica to take over), a batch whose pages all
    live on it (a one-page prompt's prefetch, a one-page backup) is a miss or a page not
    stored, never a failure of the store: the breaker stays closed and the two other nodes
    keep serving. (Such a batch raised as if the whole cluster were gone: three short
    prefetches in a row opened the breaker, and L3 was bypassed while two nodes of three
    served.) Once every primary has failed, a call is the store's failure again."""
    with own_cluster(replicas=0) as cluster:
        url = cluster.url()
        victim = cluster.nodes[2]
        owners = slot_owners(cluster)
        cfg = small_config(storage=url, storage_failures_to_open=3, **L3)
        async with HiCache(cfg) as writer:
            singles = [make_tokens(4, seed=s) for s in range(200)]
            down = [t for t in singles if owners[page_slots(writer, t)[0]] == victim.port]
            up = [t for t in singles if owners[page_slots(writer, t)[0]] != victim.port]
            long = [make_tokens(160, seed=300 + i) for i in range(3)]
            kv = KVOracle(writer)
            for tokens in [*down[:3], *up[:2], *long]:
                await kv.prefill(tokens)
            await writer.drain()
            victim.kill()
            for tokens in down[3:7]:  # one-page backups, each to the node down
                await kv.prefill(tokens)
                await writer.drain()
            st = writer.stats().storage
            assert st is not None
            assert (st.backup_failed_pages, st.errors, st.breaker) == (4, 0, "closed")
        async with HiCache(small_config(storage=url, storage_failures_to_open=3,
                                        **READER)) as reader:
            kv = KVOracle(reader)
            assert [await kv.prefill(t) for t in [*down[:3], *up[:2]]] == [0, 0, 0, 4, 4]
            st = reader.stats().storage
            assert st is not None and (st.errors, st.breaker) == (0, "closed")
            assert reader.stats().health == "ok"
            for server in cluster.nodes[:2]:  # the whole cluster gone: the breaker opens
                server.kill()
            assert [await kv.prefill(t) for t in long] == [0, 0, 0]
            st = reader.stats().storage
            assert st is not None and (st.errors, st.breaker) == (3, "open")


def forget(cluster: LocalCluster, victim: RedisServer) -> range:
    """Kill `victim` (a primary) and have every other node forget it, as an operator
    removes a dead node: its slots are served by no one (the cluster stays ok: it does not
    require full coverage). Its slots."""
    owned = [slot for slot, port in slot_owners(cluster).items() if port == victim.port]
    with raw(victim.port) as client:
        node_id = client.execute_command("CLUSTER MYID")
    victim.kill()
    for server in cluster.nodes:
        if server.running:
            with raw(server.port) as client:
                client.execute_command("CLUSTER FORGET", node_id)
    assert len(slot_owners(cluster)) == 16384 - len(owned)
    return range(owned[0], owned[-1] + 1)


def reassign(cluster: LocalCluster, slots: range) -> None:
    """Give `slots` to the first node, and wait until every running node sees them all
    covered."""
    with raw(cluster.nodes[0].port) as client:
        client.execute_command("CLUSTER ADDSLOTSRANGE", slots.start, slots.stop - 1)
    deadline = time.monotonic() + 10
    while any(len(slot_owners_of(n.port)) < 16384 for n in cluster.nodes if n.running):
        assert time.monotonic() < deadline, "the slots were not seen covered"
        time.sleep(0.05)


def slot_owners_of(port: int) -> set[int]:
    with raw(port) as client:
        return {slot for start, end, *_ in client.execute_command("CLUSTER SLOTS")
                for slot in range(start, end + 1)}


async def test_slots_no_node_serves_are_misses_and_served_again_once_reassigned() -> None:
    """A primary is removed (killed, then forgotten by the others) and its slots are served
    by no one for a while: the pages in them are misses and writes to them are refused,
    while the pages in the other slots are served and stored (the breaker stays closed).
    (`get_node_from_key` raised for such a slot: every batch that had one of its pages
    failed whole, nearly every prompt's, and the breaker opened.) Once the slots are given
    to a node, the same cache stores and serves every page again."""
    with own_cluster(replicas=0) as cluster:
        url = cluster.url()
        batch = [make_tokens(160, seed=400 + i) for i in range(6)]
        await store(url, batch)
        lost = forget(cluster, cluster.nodes[2])
        cfg = small_config(storage=url, storage_failures_to_open=3, **READER)
        async with HiCache(cfg) as reader:
            kv = KVOracle(reader)
            served = []  # the leading pages in slots still served, of each prompt
            for tokens in batch:
                slots = page_slots(reader, tokens)
                served.append(next((i for i, s in enumerate(slots) if s in lost), len(slots)))
            assert [await kv.prefill(t) for t in batch] == [4 * n for n in served]
            assert sum(served) > 0
            st = reader.stats().storage
            assert st is not None and (st.errors, st.breaker) == (0, "closed")
            fresh = [make_tokens(160, seed=500 + i) for i in range(2)]
            async with HiCache(small_config(storage=url, storage_failures_to_open=3,
                                            **L3)) as second:
                kv2 = KVOracle(second)
                for tokens in fresh:
                    await kv2.prefill(tokens)
                await second.drain()
                st = second.stats().storage
                refused = sum(s in lost for t in fresh for s in page_slots(second, t))
                assert st is not None and (st.errors, st.breaker) == (0, "closed")
                assert (st.backed_up_pages, st.backup_failed_pages) == (80 - refused, refused)
            reassign(cluster, lost)
            healed = [make_tokens(160, seed=600 + i) for i in range(2)]
            await store(url, healed)
            await asyncio.sleep(0.3)  # the reader's slot map is stale: read again by now
            assert [await kv.prefill(t) for t in healed] == [160, 160]


async def test_connections_killed_under_concurrent_calls_are_misses_never_a_bug(
        cluster: LocalCluster) -> None:
    """A node whose connections are killed (CLIENT KILL, a proxy's idle timeout) while
    several calls use it: every call returns or raises `StorageError`, every page read is
    right or a miss. (A call that met a dead connection closed the node's idle ones while
    they stayed in its free list: another call took one meanwhile and wrote to it closed,
    and redis-py's AttributeError escaped: logged as a bug by the cache, the healthy
    nodes' pages of the batch lost with it. About one call in 40 here.)"""
    keys = make_keys(60, seed=41)
    victim = cluster.primaries()[1]
    rng = random.Random(0)
    escaped: list[BaseException] = []
    async with RedisClusterBackend(cluster.url(), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * 60
        done = asyncio.Event()

        async def kill() -> None:
            with raw(victim.port) as client:
                while not done.is_set():
                    await asyncio.sleep(rng.uniform(0.0, 0.01))
                    client.client_kill_filter(_type="normal", skipme=True)

        async def work() -> None:
            for _ in range(60):
                try:
                    got = await read(backend, keys)
                    assert all(p in (None, make_page(k)) for k, p in zip(keys, got,
                                                                          strict=True))
                    await backend.set_from(keys[:7], pages(keys[:7]))
                except StorageError:
                    pass
                except Exception as exc:  # what the test looks for
                    escaped.append(exc)

        killer = asyncio.ensure_future(kill())
        try:
            await asyncio.gather(*(work() for _ in range(6)))
        finally:
            done.set()
            await killer
        assert escaped == []
        assert await read(backend, keys) == [make_page(k) for k in keys]


@pytest.fixture(scope="module")
def cluster() -> LocalCluster:
    """The process's shared 3+3 cluster (tests here only kill connections on it, or change
    and restore its configuration)."""
    return shared_cluster()


async def test_a_reader_started_with_a_node_down_reports_memory_once_it_is_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that only reads, opened while a primary was down, reports the cluster's
    ``maxmemory`` (summed over its primaries) once the node is back: the look that failed
    is tried again (at most every 10 s) until one succeeds. (Reads looked only once: the
    failed first look left no budget reported for good.)"""
    monkeypatch.setattr(redis_module, "_INFO_INTERVAL_S", 0.0)
    with own_cluster(replicas=0) as cluster:
        url = cluster.url()
        batch = [make_tokens(160, seed=700 + i) for i in range(3)]
        await store(url, batch)
        victim = cluster.nodes[2]
        victim.kill()
        async with HiCache(small_config(storage=url, **READER)) as reader:
            kv = KVOracle(reader)
            await kv.prefill(batch[0])
            st = reader.stats().storage
            assert st is not None and st.capacity_bytes is None
            restart(victim)
            cluster.wait_ok(cluster.nodes)
            for server in cluster.nodes:
                with raw(server.port) as client:
                    client.config_set("maxmemory", 64 << 20)
            await asyncio.sleep(0.3)  # past the slot map's re-read
            await kv.prefill(batch[1])
            st = reader.stats().storage
            assert st is not None and st.capacity_bytes == 3 * (64 << 20)


async def test_a_primary_without_maxmemory_leaves_the_cluster_unbounded(
        cluster: LocalCluster) -> None:
    """`capacity_bytes` is None (no limit) when any primary has no ``maxmemory``: the
    others' limits summed are not the cluster's budget (they were reported as it)."""
    primaries = cluster.primaries()
    try:
        for server in primaries[:2]:
            with raw(server.port) as client:
                client.config_set("maxmemory", 64 << 20)
        async with RedisClusterBackend(cluster.url(), FMT) as backend:
            st = backend.stats()
            assert (st.capacity_bytes, st.extra["max_bytes"]) == (None, 0)
        with raw(primaries[2].port) as client:
            client.config_set("maxmemory", 64 << 20)
        async with RedisClusterBackend(cluster.url(), FMT) as backend:
            assert backend.stats().capacity_bytes == 3 * (64 << 20)
    finally:
        for server in primaries:
            with raw(server.port) as client:
                client.config_set("maxmemory", 0)


# ------------------------------------------------------------------------------ checked, fine

def prompts(n: int, *, seed: int) -> list[list[int]]:
    """`n` prompts of 40-152 tokens, each after one of 3 shared 32-token system prompts."""
    rng = random.Random(seed)
    return [make_tokens(32, seed=rng.randrange(3))
            + make_tokens(rng.randrange(8, 120), seed=rng.randrange(4, 40)) for _ in range(n)]


async def serve_two_caches(url: str, batch: list[list[int]]) -> list[HiCache]:
    """Two caches serve `batch` with 4 concurrent streams, every hit checked; each drained
    and its invariants checked. The closed caches (their stats remain)."""
    # NOTE: room on the device for both streams' prompts at once (38 pages each, pinned)
    cfg = small_config(storage=url, storage_failures_to_open=3, storage_cooldown=0.2,
                       **{**L3, "device_pages": 128})
    async with HiCache(cfg) as a, HiCache(cfg) as b:
        oracles = [KVOracle(a), KVOracle(b)]

        async def stream(k: int) -> None:
            for tokens in batch[k::4]:
                await oracles[k % 2].prefill(tokens)

        await asyncio.gather(*(stream(k) for k in range(4)))
        for cache in (a, b):
            await cache.drain()
            cache.check_invariants()
        assert sum(kv.hits_checked for kv in oracles) > 0
    return [a, b]


async def migrate_slots(cluster: LocalCluster, stop: asyncio.Event, rng: random.Random) -> int:
    """Until `stop`: move a slot holding pages from its primary to another, two keys a
    ``MIGRATE`` (the source answers ASK meanwhile), then give it to the new owner; how many
    slots moved."""
    ports = [p.port for p in cluster.primaries()]
    ids = {}
    for port in ports:
        with raw(port) as client:
            ids[port] = client.execute_command("CLUSTER MYID")
    moved = 0
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.0, 0.01))
        src = rng.choice(ports)
        with raw(src) as s:
            names = list(s.scan_iter(count=50))
            if not names:
                continue
            slot = key_slot(rng.choice(names))
            dst = rng.choice([p for p in ports if p != src])
            with raw(dst) as d:
                d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src])
                s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst])
                while keys := s.execute_command("CLUSTER GETKEYSINSLOT", slot, 2):
                    s.migrate("127.0.0.1", dst, keys, 0, 5000, replace=True)
                    await asyncio.sleep(rng.uniform(0.0, 0.01))
            for port in ports:
                with raw(port) as client:
                    client.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst])
            moved += 1
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("chaos", ["flushall", "client_kill", "maxmemory", "migrate"])
async def test_chaos_on_one_node_mid_run_never_serves_wrong_kv_and_the_cache_recovers(
        chaos: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two caches serve 160 prompts concurrently while one primary of three is flushed
    (FLUSHALL, sync and async), has the caches' connections killed (CLIENT KILL), gets a
    low ``maxmemory`` (allkeys-lru) every few milliseconds, or has slots migrated to and
    from it (ASK, then MOVED): every hit is right, the invariants hold, nothing fails as a
    bug (no error logged), and afterwards a cache stores and a fresh one serves every page."""
    caplog.set_level(logging.ERROR)
    rng = random.Random(0)
    batch = prompts(160, seed=1)
    with own_cluster(replicas=0) as cluster:
        url = cluster.url()
        victim = cluster.nodes[1]
        stop = asyncio.Event()

        async def chaos_loop() -> int:
            if chaos == "migrate":
                return await migrate_slots(cluster, stop, rng)
            with raw(victim.port) as client:
                await disturb(client, chaos, stop, rng, policy="allkeys-lru",
                              limits=["1200kb", "1500kb", "0"])
            return 1

        task = asyncio.ensure_future(chaos_loop())
        try:
            await serve_two_caches(url, batch)
        finally:
            stop.set()
        assert await task > 0
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        await store(url, batch[:10])
        async with HiCache(small_config(storage=url, **READER)) as fresh:
            kv = KVOracle(fresh)
            assert [await kv.prefill(t) for t in batch[:10]] == \
                [len(t) // 4 * 4 for t in batch[:10]]


@pytest.mark.slow
async def test_a_primary_killed_mid_run_is_taken_over_and_every_hit_is_right() -> None:
    """Two caches serve while a primary is killed (its replica takes over in about two
    node timeouts): its pages miss meanwhile, every hit is right, the breaker may open
    only as the store's failure; afterwards the cluster serves every page stored again."""
    batch = prompts(160, seed=2)
    with own_cluster(replicas=1) as cluster:
        url = cluster.url()
        victim = cluster.primaries()[1]

        async def kill() -> None:
            await asyncio.sleep(0.05)
            victim.kill()

        task = asyncio.ensure_future(kill())
        caches = await serve_two_caches(url, batch)
        await task
        for cache in caches:
            st = cache.stats().storage
            assert st is not None and st.errors == 0 and st.breaker == "closed"
        cluster.wait_ok([n for n in cluster.nodes if n.running])
        await store(url, batch[:10])
        async with HiCache(small_config(storage=url, **READER)) as fresh:
            kv = KVOracle(fresh)
            assert [await kv.prefill(t) for t in batch[:10]] == \
                [len(t) // 4 * 4 for t in batch[:10]]


def _replica_of(cluster: LocalCluster, primary: RedisServer) -> RedisServer:
    for server in cluster.nodes:
        if server is not primary and server.running:
            with raw(server.port) as client:
                info = client.info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == primary.port:
                return server
    raise AssertionError(f"{primary!r} has no replica")


@pytest.mark.slow
async def test_a_failover_that_loses_unreplicated_pages_serves_misses_never_wrong_kv() -> None:
    """Pages written to a primary that never reached its replica (the replication link cut,
    then the primary killed and the replica promoted) are misses on the new primary; the
    pages it had are served, every hit right, and the lost pages are backed up again by the
    next cache that computes them."""
    before = [make_tokens(160, seed=800 + i) for i in range(3)]
    after = [make_tokens(160, seed=900 + i) for i in range(3)]
    with own_cluster(replicas=1) as cluster:
        url = cluster.url()
        victim = cluster.primaries()[1]
        replica = _replica_of(cluster, victim)
        await store(url, before)
        await asyncio.sleep(0.3)  # replicated by now
        replica.pause()
        with raw(victim.port) as client:
            client.client_kill_filter(_type="replica")  # nothing more reaches the replica
        await store(url, after)
        victim.kill()
        replica.resume()
        cluster.wait_ok([n for n in cluster.nodes if n.running])
        cfg = small_config(storage=url, storage_failures_to_open=3, **L3)
        async with HiCache(cfg) as reader:
            kv = KVOracle(reader)
            hits = [await kv.prefill(t) for t in [*before, *after]]
            assert hits[:3] == [160] * 3 and min(hits[3:]) < 160
            await reader.drain()
            st = reader.stats().storage
            assert st is not None and (st.errors, st.breaker) == (0, "closed")
        async with HiCache(small_config(storage=url, **READER)) as fresh:
            kv = KVOracle(fresh)
            assert [await kv.prefill(t) for t in after] == [160] * 3


@pytest.mark.slow
async def test_every_node_restarted_under_an_open_cache_is_served_right() -> None:
    """Every node of the cluster killed and restarted (their slot map kept, their pages
    gone) under an open cache: the pages are misses, the cache's connections to the old
    processes cost no failure, and it stores and serves again."""
    batch = [make_tokens(160, seed=950 + i) for i in range(4)]
    with own_cluster(replicas=1) as cluster:
        url = cluster.url()
        cfg = small_config(storage=url, storage_failures_to_open=3, **L3)
        async with HiCache(cfg) as cache:
            kv = KVOracle(cache)
            for tokens in batch[:2]:
                await kv.prefill(tokens)
            await cache.drain()
            for server in cluster.nodes:
                server.kill()
                restart(server)
            cluster.wait_ok(cluster.nodes)
            for tokens in batch[2:]:
                await kv.prefill(tokens)
            await cache.drain()
            st = cache.stats().storage
            assert st is not None and (st.backup_failed_pages, st.errors) == (0, 0)
        async with HiCache(small_config(storage=url, **READER)) as fresh:
            kv = KVOracle(fresh)
            assert [await kv.prefill(t) for t in batch] == [0, 0, 160, 160]
