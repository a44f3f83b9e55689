"""The single-server Redis L3 store under cancellation landing as replies arrive, and over a
local unix socket. Each test runs against a real redis-server.

Cancellation: on Python 3.11 redis-py's send (``asyncio.wait_for``) swallows a cancellation
that lands as its write finishes (CPython gh-86296); a cancelled call must still raise it,
never return normally while its task goes on (a cancelled request handler would continue).

Unix sockets: ``unix:///path/redis.sock?db=N&password=...`` names a server's local socket,
from the config and the command line as from `RedisBackend`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from aiohicache import ConfigError, HiCache
from aiohicache._redis_server import RedisServer
from aiohicache.storage import StorageError, backend_from_url, check_url
from aiohicache.storage.redis import RedisBackend
from tests.conftest import make_config, make_tokens, prefill

from .conftest import FMT, SENTINEL, make_keys, make_page
from .conftest import page_views as pages
from .conftest import read_pages as read
from .redis_server import raw_client, redis_server, redis_url, started  # noqa: F401
from .sweep import NEW, OLD, assert_pages_whole_or_missed, swept_call

OPS = ["exists", "get_into", "set_from", "delete"]
TURNS = range(1, 25)
"""Loop turns after which the canceller strikes: from the pool wait to the last reply."""
REPEATS = 4


async def cancelled_after(turns: int, call: Callable[[], object],
                          cancel: Callable[[], object]) -> bool:
    """Let `turns` loop turns pass, then `cancel()` unless `call` is done; whether it was
    cancelled in flight."""
    for _ in range(turns):
        await asyncio.sleep(0)
    if call():
        return False
    cancel()
    return True


# ---------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("op", OPS)
async def test_a_call_cancelled_in_flight_raises_and_never_returns(
        op: str, redis_url: str) -> None:  # noqa: F811  (the fixture)
    """A call whose task is cancelled (``task.cancel()``) before it ends raises
    `CancelledError`, wherever the cancellation lands: it never returns a result with the
    cancellation lost (on 3.11, a third of them returned normally, `cancelling()` still 1),
    and the pages stay whole or missed, a cancelled read writing no buffer."""
    returned = raised = 0
    async with RedisBackend(redis_url, FMT) as backend:
        for turns in TURNS:
            for _ in range(REPEATS):
                buffers = [bytearray([SENTINEL]) * FMT.payload_bytes for _ in [*OLD, *NEW]]
                assert await backend.set_from(OLD, pages(OLD)) == [True] * len(OLD)
                task = asyncio.ensure_future(swept_call(op, backend, buffers))
                if not await cancelled_after(turns, task.done, task.cancel):
                    await task
                    continue
                try:
                    await task
                    returned += 1
                except asyncio.CancelledError:
                    raised += 1
                    if op == "get_into":
                        assert all(b == bytearray([SENTINEL]) * FMT.payload_bytes
                                   for b in buffers), "a cancelled read wrote a buffer"
                await assert_pages_whole_or_missed(backend, op, f"{op} at {turns}")
                await backend.delete(NEW)
    assert returned == 0, f"{returned} of {returned + raised} cancelled calls returned"
    assert raised >= 3, "the sweep hardly cancelled a call in flight"


async def expiring_in_call(backend: RedisBackend, op: str, buffers: list[bytearray],
                           turns: int) -> str:
    """Run `op` in an ``asyncio.timeout`` that expires after `turns` loop turns: "raised"
    (`TimeoutError`), "ignored" (the call returned although the deadline expired in it) or
    "done" (it ended first)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as deadline:
            expire = asyncio.ensure_future(cancelled_after(
                turns, lambda: False, lambda: deadline.reschedule(loop.time())))
            await swept_call(op, backend, buffers)
    except TimeoutError:
        return "raised"
    finally:
        expire.cancel()
    return "ignored" if deadline.expired() else "done"


@pytest.mark.parametrize("op", OPS)
async def test_an_asyncio_timeout_expiring_in_a_call_raises_timeout_error(
        op: str, redis_url: str) -> None:  # noqa: F811
    """An ``asyncio.timeout`` that expires while a call is in flight raises `TimeoutError`
    out of its block: the call never returns with the deadline passed and ignored."""
    outcomes: list[str] = []
    async with RedisBackend(redis_url, FMT) as backend:
        assert await backend.set_from(OLD, pages(OLD)) == [True] * len(OLD)
        buffers = [bytearray(FMT.payload_bytes) for _ in [*OLD, *NEW]]
        for turns in TURNS:
            for _ in range(REPEATS):
                outcomes.append(await expiring_in_call(backend, op, buffers, turns))
    ignored, timed_out = outcomes.count("ignored"), outcomes.count("raised")
    assert ignored == 0, f"{ignored} expired deadlines were ignored ({timed_out} raised)"
    assert timed_out >= 3, "the sweep hardly expired a deadline in flight"


async def test_an_anyio_scope_cancelled_in_a_call_catches_its_own_cancellation(
        redis_url: str) -> None:  # noqa: F811
    """A call inside an anyio cancel scope that is cancelled in flight ends the scope with
    the scope's own cancellation, caught there: never a bare `CancelledError` (a lost
    cancellation raised again) leaking past the scope and cancelling the whole task."""
    keys = make_keys(4, seed=7)
    leaked = caught = 0
    async with RedisBackend(redis_url, FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * len(keys)
        for turns in TURNS:
            for _ in range(REPEATS):
                async def call(scope: anyio.CancelScope) -> None:
                    with scope:
                        await backend.exists(keys)

                scope = anyio.CancelScope()
                task = asyncio.ensure_future(call(scope))
                if not await cancelled_after(turns, task.done, scope.cancel):
                    await task
                    continue
                try:
                    await task
                except asyncio.CancelledError:
                    leaked += 1
                caught += scope.cancelled_caught
    assert leaked == 0
    assert caught >= 3


# ---------------------------------------------------------------------- unix sockets


@pytest.fixture(scope="module")
def unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, str]]:
    """A redis-server with a password, listening on a unix socket too; (server, socket)."""
    sock = str(tmp_path_factory.mktemp("sock") / "redis.sock")
    server = started(RedisServer(password="s3cr/et", extra_args=(
        "--unixsocket", sock, "--unixsocketperm", "700")))
    yield server, sock
    server.stop()


def unix_urls(sock: str) -> list[str]:
    return [f"unix://{sock}?db=3&password=s3cr%2Fet", f"unix://:s3cr%2Fet@{sock}?db=3"]


@pytest.mark.parametrize("form", [0, 1], ids=["password-in-query", "password-in-userinfo"])
async def test_a_unix_socket_url_reads_writes_and_misses(
        unix_server: tuple[RedisServer, str], form: int) -> None:
    """``unix:///path/redis.sock?db=N&password=...`` (or ``unix://:password@/path...``) is a
    store URL like ``redis://``: `check_url` and `backend_from_url` take it, pages round-trip
    in database N, an absent page misses, and the password is in no repr or URL shown."""
    server, sock = unix_server
    url = unix_urls(sock)[form]
    check_url(url)
    keys, absent = make_keys(5, seed=41), make_keys(2, seed=42)
    backend = backend_from_url(url, FMT)
    assert isinstance(backend, RedisBackend)
    async with backend:
        assert "s3cr" not in repr(backend) and "s3cr" not in backend.url
        assert sock in backend.url
        assert await backend.set_from(keys, pages(keys)) == [True] * len(keys)
        assert await backend.exists([*keys, *absent]) == len(keys)
        assert await read(backend, [*keys, *absent]) == [*map(make_page, keys), None, None]
        assert backend.stats().misses == 2
        with raw_client(server.url(db=3)) as raw:
            assert raw.exists(backend.key_prefix + keys[0]) == 1
        assert await backend.delete(keys) == len(keys)


@pytest.mark.parametrize(("url", "why"), [
    ("unix://", "absolute socket path"),
    ("unix:relative/redis.sock", "absolute socket path"),
    ("unix://localhost/run/redis.sock", "no host"),
    ("unix:///run/redis.sock#frag", "fragment"),
    ("unix:///run/redis.sock?db=x&password=hunter2", "'db'"),
    ("unix:///run/redis.sock?decode_responses=1", "decode_responses"),
    ("unix:///run/redis.sock?bogus=1&password=hunter2", "bogus"),
])
def test_a_malformed_unix_url_says_what_is_wrong(url: str, why: str) -> None:
    """A bad unix URL is a `ConfigError` naming the problem, never the password."""
    with pytest.raises(ConfigError, match="storage") as info:
        check_url(url)
    assert why in str(info.value) and "hunter2" not in str(info.value)


async def test_a_wrong_socket_path_is_a_storage_error_naming_the_path(
        unix_server: tuple[RedisServer, str], tmp_path: Path) -> None:
    """A socket that is not there fails promptly with a `StorageError` naming the path (a
    typo, or a server not started), and the password in none of it."""
    missing = tmp_path / "nope.sock"
    with pytest.raises(StorageError) as info:
        async with RedisBackend(f"unix://{missing}?password=s3cr%2Fet", FMT):
            pass
    assert str(missing) in str(info.value) and "s3cr" not in str(info.value)


L3 = {"prefetch_policy": "wait_complete", "prefetch_threshold": 8, "device_pages": 16,
      "host_pages": 32, "backup_threshold": 1}


async def test_a_cache_over_a_unix_socket_serves_its_kv_back_from_l3(
        unix_server: tuple[RedisServer, str]) -> None:
    """``HiCacheConfig(storage="unix://...")``: pages backed up to the server over its
    socket come back as L3 hits with the KV they were written with."""
    _, sock = unix_server
    with raw_client(unix_server[0].url(db=3)) as raw:
        raw.flushdb()
    async with HiCache(make_config(storage=unix_urls(sock)[0], **L3)) as cache:
        tokens = make_tokens(16, seed=5)
        first = await prefill(cache, tokens)
        await cache.drain()
        await cache.drain()
        cache.tree.evict_device(cache.device_pool.num_pages)
        cache.tree.evict_host(cache.host_pool.num_pages)
        again = await prefill(cache, tokens)
        assert cache.stats().storage_hit_tokens > 0
    assert again.equal(first)


async def test_a_cache_whose_socket_is_missing_opens_its_breaker_and_serves_on(
        tmp_path: Path) -> None:
    """A cache configured with a socket path that does not exist counts L3 errors, opens
    its breaker and keeps serving from L1/L2 (no error reaches the user)."""
    url = f"unix://{tmp_path / 'nope.sock'}"
    cfg = make_config(storage=url, storage_failures_to_open=2, storage_cooldown=60.0, **L3)
    async with HiCache(cfg) as cache:
        for seed in range(4):
            await prefill(cache, make_tokens(16, seed=seed))
        await cache.drain()
        st = cache.stats().storage
        assert st is not None and st.breaker == "open" and st.errors >= 2
