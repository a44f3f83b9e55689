"""Redis for the tests: one real redis-server per test process, and raw access to it.

`shared_server()` starts it on first use (the conformance factory calls it; so does the
`redis_server` fixture) and it stops when the process exits. Redis-backed tests never skip:
without redis-server on PATH they fail, with a message saying how to install it.
"""

from __future__ import annotations

import asyncio
import atexit
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import redis

from aiohicache._redis_server import LocalCluster, RedisServer, RedisServerError

__all__ = ("corrupt_object", "disturb", "raw_client", "redis_server", "redis_url",
           "running_cluster", "shared_cluster", "shared_server", "started")

_shared: RedisServer | None = None
_shared_cluster: LocalCluster | None = None


def started(server: RedisServer) -> RedisServer:
    """`server`, started; a missing or broken redis-server fails the test (never a skip)."""
    try:
        server.start()
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    return server


@contextmanager
def running_cluster(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """`cluster`, running until the block ends; a missing redis fails (never skips)."""
    try:
        cluster.start()
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


async def disturb(client: redis.Redis, chaos: str, stop: asyncio.Event, rng: random.Random, *,
                  policy: str, limits: Sequence[str]) -> None:
    """Until `stop` is set, every few milliseconds: FLUSHALL (sync or async) when `chaos` is
    ``"flushall"``, kill the other clients' connections for ``"client_kill"``, otherwise set
    ``maxmemory`` to one of `limits` under eviction `policy`; then lift the limit."""
    client.config_set("maxmemory-policy", policy)
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.0, 0.02))
        if chaos == "flushall":
            client.flushall(asynchronous=rng.random() < 0.5)
        elif chaos == "client_kill":
            client.client_kill_filter(_type="normal", skipme=True)
        else:
            client.config_set("maxmemory", rng.choice(list(limits)))
    client.config_set("maxmemory", 0)


def shared_server() -> RedisServer:
    """The process's redis-server (no password), started on first use; never kill it."""
    global _shared
    if _shared is None or not _shared.running:
        _shared = started(RedisServer())
        atexit.register(_shared.stop)
    return _shared


def shared_cluster() -> LocalCluster:
    """The process's Redis Cluster (3 primaries + 3 replicas), started on first use (about
    2 s) and shared by the conformance suite and ``test_cluster.py``; never kill its nodes
    (the failover test makes its own)."""
    global _shared_cluster
    if _shared_cluster is None:
        cluster = LocalCluster()
        atexit.register(cluster.stop)
        try:
            cluster.start()
        except RedisServerError as exc:
            pytest.fail(str(exc), pytrace=False)
        _shared_cluster = cluster
    return _shared_cluster


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    """`shared_server()`, as a fixture."""
    return shared_server()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL (db 0), every database emptied first."""
    with raw_client(redis_server.url()) as client:
        client.flushall()
    return redis_server.url()


def raw_client(url: str) -> redis.Redis:
    """A plain synchronous client (use it in a ``with`` block: it must be closed)."""
    return redis.Redis.from_url(url, socket_timeout=5)


def corrupt_object(url: str, name: str) -> None:
    """Flip every bit of the last payload byte of the object stored under `name`."""
    with raw_client(url) as client:
        blob = client.get(name)
        assert isinstance(blob, bytes), f"nothing stored under {name!r}"
        client.set(name, blob[:-1] + bytes([blob[-1] ^ 0xFF]))
