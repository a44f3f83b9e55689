"""A review of the Redis Cluster L3's corners, on real clusters: the cluster's own ports, the
node redis-py pings, a redirect to a hung node, and what re-reading the slot map costs the
healthy nodes' connections. Each test that damages a cluster starts its own (3 primaries,
about 2 s); every page read back is checked against the one written (right or a miss).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import NodesManager

from aiohicache import _redis_server
from aiohicache.storage.errors import StorageError
from aiohicache.storage.redis import RedisClusterBackend

from .conftest import FMT, make_keys, make_page
from .conftest import page_views as pages
from .conftest import read_pages as read
from .redis_server import shared_cluster
from .test_cluster import _migrate, _settle, slot_of
from .test_cluster_node_breaker import served_by, timed
from .test_cluster_pressure_review import own_cluster

TIMEOUT = 1.5
"""The backends' `socket_timeout` here (the default is 5 s)."""
PROMPT = TIMEOUT / 3
"""What "at once" means: well under one timeout."""


# ------------------------------------------------------------------------------ the ports

def test_a_cluster_node_never_gets_a_port_whose_bus_port_is_not_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster node also listens on its port + 10000 (its bus): the ports `LocalCluster`
    gives its nodes leave room for it. (A node given a port over 55535 by the kernel, or
    one whose bus port was taken, exited at once: each cost one of five attempts to start
    it, and now and then a cluster did not start.) The kernel is made to offer five such
    ports first: three past 55535, two whose bus port this test holds."""
    real = _redis_server._free_port
    with socket.socket() as held_1, socket.socket() as held_2:
        held = []
        for sock in (held_1, held_2):
            while True:  # a port whose bus port can be held here
                port = real()
                if port <= 55535:
                    try:
                        sock.bind(("127.0.0.1", port + 10000))
                    except OSError:
                        continue
                    held.append(port)
                    break
        offered = iter([60001, 58000, 55536, *held])
        monkeypatch.setattr(_redis_server, "_free_port", lambda: next(offered, None) or real())
        with own_cluster(replicas=0) as cluster:
            assert all(node.port <= 55535 and node.port not in held for node in cluster.nodes)
            assert all(_redis_server._cluster_ok(node.port) for node in cluster.nodes)


# ------------------------------------------------------------------------------ entering

@pytest.mark.slow
async def test_the_first_primary_down_or_hung_costs_its_pages_only() -> None:
    """redis-py reads the commands (``COMMAND``) and sends ``PING`` to one node, its
    default: the first primary. With that node killed (no replica to take over), a backend
    made then (a cache's, from a URL: not entered) failed every call, for good, while the
    two other nodes served: the cache's breaker opened; entering one raised too. Hung, the
    same after a timeout. Now either costs that node's pages only: missed, not stored, the
    other nodes' pages served right; with every primary down, entering raises."""
    keys = make_keys(60, seed=1)
    with own_cluster(replicas=0) as cluster:
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT) as backend:
            assert await backend.set_from(keys, pages(keys)) == [True] * 60
            client: Any = backend._client
            first = client.get_default_node().port
            lost = served_by(backend, keys, first)
        right = [None if gone else make_page(k) for k, gone in zip(keys, lost, strict=True)]
        victim = next(node for node in cluster.nodes if node.port == first)
        victim.pause()
        try:
            async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT,
                                           node_cooldown=30) as backend:
                assert await read(backend, keys) == right
                assert await backend.exists(keys) == lost.index(True)
        finally:
            victim.resume()
        cluster.wait_ok(cluster.nodes)
        victim.kill()
        backend = RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT)
        try:
            for _ in range(3):
                assert await read(backend, keys) == right
                stored = await backend.set_from(keys, pages(keys))
                assert stored == [not gone for gone in lost]
        finally:
            await backend.aclose()
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT) as backend:
            assert await read(backend, keys) == right
        for node in cluster.nodes:
            node.kill()
        with pytest.raises(StorageError, match="ping"):
            async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT):
                pass


# ------------------------------------------------------------------------------ redirects

@pytest.mark.slow
async def test_an_ask_to_a_hung_node_is_skipped_with_the_node() -> None:
    """A slot is migrating to a node that hangs: its old owner answers ASK for the pages
    moved, and the follow-up to the hung node went around its circuit, so every call that
    read such a page waited `socket_timeout`, however long the node was skipped. After the
    first timeout, the calls return at once: the migrating page and the hung node's pages
    missed, every other page served, right."""
    keys = make_keys(120, seed=2)
    with own_cluster(replicas=0) as cluster:
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT,
                                       node_cooldown=30) as backend:
            assert await backend.set_from(keys, pages(keys)) == [True] * 120
            client: Any = backend._client
            moving = keys[0]
            slot = slot_of(client, backend.key_prefix + moving)
            dst = _migrate(cluster, slot, finish=False)  # its owner answers ASK for it
            hung = next(node for node in cluster.nodes if node.port == dst)
            there = served_by(backend, keys, dst)
            right = [None if k == moving or on else make_page(k)
                     for k, on in zip(keys, there, strict=True)]
            assert any(there) and right[0] is None
            hung.pause()
            try:
                got, took = await timed(lambda: read(backend, keys))
                assert got == right and took >= TIMEOUT * 0.9  # the one timeout
                for _ in range(3):
                    got, took = await timed(lambda: read(backend, keys))
                    assert got == right and took < PROMPT, took
                    got, took = await timed(lambda: read(backend, [moving]))
                    assert got == [None] and took < PROMPT, took
            finally:
                hung.resume()
            cluster.wait_ok(cluster.nodes)
            _settle(cluster, slot, dst)


# ------------------------------------------------------------------------------ re-reads

def connections_received(port: int) -> int:
    with redis.Redis(port=port, socket_timeout=5) as client:
        return int(client.info("stats")["total_connections_received"])


@pytest.fixture
def map_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """When each slot map read (redis-py's `NodesManager.initialize`) began."""
    reads: list[float] = []
    initialize = NodesManager.initialize

    async def counted(self: NodesManager, *args: Any, **kwargs: Any) -> None:
        reads.append(time.monotonic())
        await initialize(self, *args, **kwargs)

    monkeypatch.setattr(NodesManager, "initialize", counted)
    yield reads


@pytest.mark.slow
async def test_re_reading_the_slot_map_keeps_the_healthy_nodes_connections(
        map_reads: list[float]) -> None:
    """With a primary down (no replica), the slot map is read again every 0.25 s while
    calls come (a replica may take over). redis-py marked every connection of every node to
    reconnect at each read: each call after a read opened its connections to the healthy
    nodes again, about one per node per read here (with TLS, a handshake each). Read after
    read, the healthy nodes' connections are kept, their pages served right."""
    keys = make_keys(60, seed=3)
    with own_cluster(replicas=0) as cluster:
        async with RedisClusterBackend(cluster.url(), FMT, socket_timeout=TIMEOUT) as backend:
            assert await backend.set_from(keys, pages(keys)) == [True] * 60
            victim, *healthy = cluster.nodes[2], *cluster.nodes[:2]
            lost = served_by(backend, keys, victim.port)
            right = [None if gone else make_page(k) for k, gone in zip(keys, lost, strict=True)]
            for _ in range(3):
                await asyncio.gather(read(backend, keys), read(backend, keys))
            victim.kill()
            assert await read(backend, keys) == right
            before = [connections_received(node.port) for node in healthy]
            first = len(map_reads)
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                got = await asyncio.gather(read(backend, keys), read(backend, keys))
                assert list(got) == [right, right]
                await asyncio.sleep(0.05)
            opened = [connections_received(node.port) - n
                      for node, n in zip(healthy, before, strict=True)]
            reads = len(map_reads) - first
            assert reads >= 4  # the map was read again all along
            assert max(opened) <= 4, (opened, reads)  # about 3 a read before


async def test_a_burst_of_first_calls_reads_the_commands_once() -> None:
    """A new backend's first calls, eight at once, each read the slot map and ``COMMAND``'s
    long reply (a connection slot each, on the first primary the burst reached); one reads
    them now, the others wait for it, and every call is answered."""
    cluster = shared_cluster()
    keys = make_keys(8, seed=77)

    def command_calls() -> int:
        total = 0
        for node in cluster.nodes:
            with redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5) as raw:
                stats = raw.info("commandstats")
                total += stats.get("cmdstat_command", {}).get("calls", 0)
        return total

    before = command_calls()
    backend = RedisClusterBackend(cluster.url(), FMT, key_prefix="burst")
    try:
        got = await asyncio.gather(*(backend.exists(keys) for _ in range(8)))
    finally:
        await backend.aclose()
    assert got == [0] * 8
    assert command_calls() - before == 1
