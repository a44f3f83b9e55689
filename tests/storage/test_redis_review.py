"""Redis and Redis Cluster L3 stores under what a server or a user does to them: connections
dropped by a restart, options in the URL that change what the client returns, a pool smaller
than the backend thinks. Each test runs against real redis-server processes."""

from __future__ import annotations

import asyncio
import re

import pytest
import redis

from aiohicache._redis_server import RedisServer
from aiohicache.errors import ConfigError
from aiohicache.storage.redis import RedisBackend, RedisClusterBackend

from .conftest import FMT, make_keys, make_page
from .conftest import page_views as pages
from .conftest import read_pages as read
from .redis_server import shared_cluster, shared_server


def drop_clients(ports: list[int]) -> int:
    """Close every client connection of the servers on `ports` (what a restart does to the
    clients, the data and the topology kept); how many were closed."""
    closed = 0
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as raw:
            closed += int(raw.client_kill_filter(_type="normal", skipme=True))
    return closed


def clients_per_node(ports: list[int]) -> list[int]:
    counts = []
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as raw:
            counts.append(len(raw.client_list(_type="normal")) - 1)
    return counts


# ---------------------------------------------------------------------- connections dropped


async def test_a_cluster_whose_connections_were_dropped_serves_the_next_calls() -> None:
    """Every node restarted (or a proxy or NAT dropping idle connections) leaves the pool of
    each node full of dead connections. The single-server backend retries on a fresh one
    (`retries`, default 1) and the next call succeeds; the cluster backend failed one call
    per dead connection in a row, each a `StorageError` (or misses), so a healthy cluster
    opened the cache's breaker (5 failures) and L3 was bypassed."""
    cluster = shared_cluster()
    keys = make_keys(48, seed=101)
    ports = [n.port for n in cluster.primaries()]
    async with RedisClusterBackend(cluster.url(), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * len(keys)
        # concurrent calls: each node's pool holds several connections
        await asyncio.gather(*(read(backend, keys) for _ in range(6)))
        assert min(clients_per_node(ports)) >= 2
        assert drop_clients(ports) >= 6
        for attempt in range(6):
            assert await read(backend, keys) == [make_page(k) for k in keys], attempt
        await asyncio.gather(*(read(backend, keys) for _ in range(6)))
        assert drop_clients(ports) >= 6
        for attempt in range(6):
            assert await backend.exists(keys) == len(keys), attempt
        assert backend.stats().errors == 0


async def test_a_server_whose_connections_were_dropped_serves_the_next_calls(
        own_server: RedisServer) -> None:
    """The same for one server: the reference behaviour (passes)."""
    keys = make_keys(48, seed=102)
    async with RedisBackend(own_server.url(), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * len(keys)
        await asyncio.gather(*(read(backend, keys) for _ in range(6)))
        assert clients_per_node([own_server.port])[0] >= 2
        drop_clients([own_server.port])
        for attempt in range(6):
            assert await read(backend, keys) == [make_page(k) for k in keys], attempt
        assert backend.stats().errors == 0


# ---------------------------------------------------------------------- options in the URL


async def refused(cls: type[RedisBackend], url: str, match: str) -> None:
    """`cls(url)` must raise ConfigError matching `match` (one built anyway is shown to be
    unusable, then closed)."""
    try:
        backend = cls(url, FMT)
    except ConfigError as exc:
        assert re.search(match, str(exc)), exc
        return
    async with backend:
        keys = make_keys(2, seed=104)
        stored = await backend.set_from(keys, pages(keys))
        try:
            got: object = await read(backend, keys)
        except Exception as exc:  # shown in the failure
            got = exc
    pytest.fail(f"{url!r} was accepted: set_from -> {stored}, then get_into -> {got!r}")


@pytest.mark.parametrize("query", ["decode_responses=true", "decode_responses=false",
                                   "encoding=latin-1&decode_responses=1"])
async def test_a_url_option_that_makes_replies_text_is_a_config_error(query: str) -> None:
    """The backend reads bytes. ``decode_responses`` in the URL (any value: redis-py passes
    the string on, and "false" is true) made every read of one server raise a
    UnicodeDecodeError or TypeError (not a StorageError), and made every page of a cluster
    a silent miss while writes reported success: an L3 that never hits."""
    await refused(RedisBackend, f"{shared_server().url()}?{query}", "decode_responses")
    await refused(RedisClusterBackend, f"{shared_cluster().url()}?{query}", "decode_responses")


@pytest.mark.parametrize("url", [
    "redis+cluster://127.0.0.1:7000?foo=bar",
    "redis+cluster://127.0.0.1:7000?max_connections=2",
    "redis+cluster://127.0.0.1:7000?retry_on_timeout=1",
    "redis+cluster://127.0.0.1:7000?socket_timeout=1",
    "redis+cluster://[::1:7000",
])
def test_a_bad_cluster_url_is_a_config_error(url: str) -> None:
    """`RedisClusterBackend` promises a ConfigError for a bad URL, as `RedisBackend` gives
    for ``?foo=bar``; an unknown option, or one the backend sets itself, escaped as
    redis-py's TypeError, an unclosed IPv6 bracket as a ValueError (only
    `backend_from_url` turned them into a ConfigError)."""
    with pytest.raises(ConfigError, match="url"):
        RedisClusterBackend(url, FMT)
