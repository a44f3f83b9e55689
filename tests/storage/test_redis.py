"""RedisBackend against real redis-servers: what only Redis has (URLs, AUTH, databases, key
prefixes, pipelines, TTL, a server that dies or hangs). The backend-independent contract is
the conformance suite's.

Most tests share the session's server (emptied before each test); those that need a
password, a memory limit, or a server to kill start their own.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from aiohicache import ClosedError, ConfigError
from aiohicache._redis_server import RedisServer, RedisServerError
from aiohicache.bench.redis import run_redis_bench
from aiohicache.storage import _redis as redis_module
from aiohicache.storage.base import HEADER_SIZE, BackendStats, PageFormat, encode_header
from aiohicache.storage.errors import StorageError, StorageReadError, StorageWriteError
from aiohicache.storage.redis import RedisBackend
from tests.storage.redis_server import corrupt_object, raw_client, redis_server, redis_url, started

__all__ = ("redis_server", "redis_url")  # the session fixtures, for this module

PAGE = 4096
PASSWORD = "s3cret-pw"


def make_fmt(namespace: str = "model-a", payload_bytes: int = PAGE) -> PageFormat:
    return PageFormat.make(namespace=namespace, spec_fingerprint="spec", page_size=16,
                           payload_bytes=payload_bytes)


FMT = make_fmt()


def make_keys(n: int, start: int = 0) -> list[str]:
    return [f"{i:032x}" for i in range(start, start + n)]


def make_pages(n: int, *, seed: int = 0, nbytes: int = PAGE) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.bytes(nbytes)) for _ in range(n)]


def make_buffers(n: int, nbytes: int = PAGE) -> list[memoryview]:
    return [memoryview(bytearray(nbytes)) for _ in range(n)]


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    async with RedisBackend(redis_url, FMT) as b:
        yield b



@pytest.fixture
def auth_server() -> Iterator[RedisServer]:
    server = started(RedisServer(password=PASSWORD))
    yield server
    server.stop()


# ---------------------------------------------------------------------- objects and keys


async def test_pages_round_trip_with_exact_stats(backend: RedisBackend) -> None:
    keys, pages, bufs = make_keys(3), make_pages(3), make_buffers(4)
    assert await backend.set_from(keys, pages) == [True, True, True]
    assert await backend.exists([*keys, "ff" * 16]) == 3
    assert await backend.get_into([*keys, "ff" * 16], bufs) == [True, True, True, False]
    assert [bytes(b) for b in bufs[:3]] == [bytes(p) for p in pages]
    assert bytes(bufs[3]) == bytes(PAGE)
    assert await backend.delete([keys[0], "ff" * 16]) == 1
    stats = backend.stats()
    stats.extra.clear()
    assert stats == BackendStats(exists_calls=1, pages_read=3, pages_written=3, pages_deleted=1,
                                 bytes_read=3 * PAGE, bytes_written=3 * PAGE, misses=1)


async def test_stored_value_is_header_and_payload_never_a_pickle(backend: RedisBackend,
                                                                 redis_url: str) -> None:
    [key], [page] = make_keys(1), make_pages(1)
    await backend.set_from([key], [page])
    with raw_client(redis_url) as client:
        raw = client.get(f"ahkv:{FMT.namespace_id.hex()}:{key}")
    assert isinstance(raw, bytes) and raw.startswith(b"AHKV")
    assert raw == encode_header(FMT, key, page) + bytes(page)


async def test_a_pickle_stored_under_a_key_is_a_miss_never_unpickled(
        backend: RedisBackend, redis_url: str) -> None:
    import pickle  # only to make the hostile value

    [key] = make_keys(1)
    with raw_client(redis_url) as client:
        client.set(backend.key_prefix + key, pickle.dumps(bytes(HEADER_SIZE + PAGE)))
    assert await backend.get_into([key], make_buffers(1)) == [False]
    assert backend.stats().corrupt == 1


async def test_corrupt_truncated_and_wrong_type_objects_are_misses(backend: RedisBackend,
                                                                   redis_url: str) -> None:
    keys, pages = make_keys(4), make_pages(4)
    await backend.set_from(keys, pages)
    corrupt_object(redis_url, backend.key_prefix + keys[0])
    with raw_client(redis_url) as client:
        name = backend.key_prefix + keys[1]
        client.set(name, client.get(name)[:-1])  # type: ignore[index]
        client.delete(backend.key_prefix + keys[2])
        client.rpush(backend.key_prefix + keys[2], b"x")  # not a string: MGET gives nil
    bufs = make_buffers(4)
    assert await backend.get_into(keys, bufs) == [False, False, False, True]
    assert [bytes(b) for b in bufs[:3]] == [bytes(PAGE)] * 3  # rejected: left as they were
    stats = backend.stats()
    assert (stats.corrupt, stats.misses, stats.pages_read) == (2, 1, 1)


async def test_a_user_not_allowed_to_run_scripts_still_gets_the_other_pages(
        own_server: RedisServer) -> None:
    """A least-privilege ACL user (no @scripting): the compare-and-delete of a rejected
    object failed, and with it the whole batch, at every read that met the object."""
    keys, pages = make_keys(8), make_pages(8)
    with raw_client(own_server.url()) as client:
        client.execute_command("ACL", "SETUSER", "kv", "on", ">kv-pw", "~ahkv:*", "+@read",
                               "+@write", "+@connection", "+info")
    async with RedisBackend(own_server.url(username="kv", password="kv-pw"),
                            make_fmt()) as b:
        assert await b.set_from(keys, pages) == [True] * 8
        corrupt_object(own_server.url(), b.key_prefix + keys[3])
        for _ in range(2):
            bufs = make_buffers(8)
            assert await b.get_into(keys, bufs) == [True] * 3 + [False] + [True] * 4
            assert [bytes(x) for x in bufs[4:]] == [bytes(p) for p in pages[4:]]
        assert b.stats().corrupt == 2


async def test_rejected_objects_are_deleted_by_digest_not_sent_back(
        own_server: RedisServer) -> None:
    """Each was sent back whole for the compare-and-delete, in one pipeline not capped in
    bytes (asyncio joins a pipeline on the loop: 96 rejected 1 MiB objects held it 0.8 s)."""
    fmt = make_fmt(payload_bytes=256 << 10)
    keys, pages = make_keys(8), make_pages(8, nbytes=256 << 10)
    async with RedisBackend(own_server.url(), fmt) as b:
        assert await b.set_from(keys, pages) == [True] * 8
        for key in keys:
            corrupt_object(own_server.url(), b.key_prefix + key)
        with raw_client(own_server.url()) as client:
            before = int(client.info("stats")["total_net_input_bytes"])
            assert await b.get_into(keys, make_buffers(8, 256 << 10)) == [False] * 8
            sent = int(client.info("stats")["total_net_input_bytes"]) - before
        assert await b.exists(keys) == 0  # deleted
        assert sent < 64 << 10  # not the 2 MiB of objects


async def test_a_rejected_object_rewritten_meanwhile_is_left_alone(
        own_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, pages = make_keys(1), make_pages(1)
    url = own_server.url()
    async with RedisBackend(url, make_fmt()) as b:
        assert await b.set_from(keys, pages) == [True]
        with raw_client(url) as client:
            good = client.get(b.key_prefix + keys[0])
        corrupt_object(url, b.key_prefix + keys[0])
        real = redis_module.verify

        def rewrite_then_verify(*args: Any) -> Any:  # a writer replaces it after the read
            with raw_client(url) as client:
                client.set(b.key_prefix + keys[0], good)
            return real(*args)
        monkeypatch.setattr(redis_module, "verify", rewrite_then_verify)
        assert await b.get_into(keys, make_buffers(1)) == [False]  # what it read was bad
        monkeypatch.undo()
        bufs = make_buffers(1)
        assert await b.get_into(keys, bufs) == [True] and bytes(bufs[0]) == bytes(pages[0])


async def test_set_overwrites_a_corrupt_object(backend: RedisBackend, redis_url: str) -> None:
    keys, pages = make_keys(1), make_pages(1)
    await backend.set_from(keys, pages)
    corrupt_object(redis_url, backend.key_prefix + keys[0])
    await backend.set_from(keys, pages)
    bufs = make_buffers(1)
    assert await backend.get_into(keys, bufs) == [True]
    assert bytes(bufs[0]) == bytes(pages[0])


@pytest.mark.parametrize("key", ["ABCDEF0123456789", "abc", "g" * 16, "a" * 129,
                                 "0123456789abcdef\n", b"0123456789abcdef", 12345])
async def test_keys_must_be_16_to_128_lowercase_hex(backend: RedisBackend, key: object) -> None:
    with pytest.raises(ConfigError, match="16-128 lowercase hex") as info:
        await backend.exists([key])  # type: ignore[list-item]
    assert repr(key) in str(info.value)
    for call in (backend.get_into, backend.set_from):
        with pytest.raises(ConfigError):
            await call([key], make_buffers(1))  # type: ignore[list-item, operator]
    with pytest.raises(ConfigError):
        await backend.delete([key])  # type: ignore[list-item]


async def test_buffers_must_be_one_page_each_and_writable_for_reads(
        backend: RedisBackend) -> None:
    keys = make_keys(2)
    with pytest.raises(ConfigError, match="buffers"):
        await backend.set_from(keys, make_buffers(1))
    with pytest.raises(ConfigError, match=str(PAGE)):
        await backend.set_from(keys, make_buffers(2, PAGE + 1))
    with pytest.raises(ConfigError, match="read-only"):
        await backend.get_into(keys, make_pages(2))


# ---------------------------------------------------------------------- namespaces, databases


async def test_default_prefix_names_the_namespace(backend: RedisBackend) -> None:
    assert backend.key_prefix == f"ahkv:{FMT.namespace_id.hex()}:"


async def test_prefixes_isolate_namespaces_on_one_server(redis_url: str) -> None:
    fmt_b = make_fmt("model-b")
    keys = make_keys(2)
    async with RedisBackend(redis_url, FMT) as a, RedisBackend(redis_url, fmt_b) as b:
        await a.set_from(keys, make_pages(2, seed=1))
        assert await b.exists(keys) == 0
        assert await b.get_into(keys, make_buffers(2)) == [False, False]
        await b.set_from(keys[:1], make_pages(1, seed=2))
        bufs = make_buffers(2)
        assert await a.get_into(keys, bufs) == [True, True]
        assert [bytes(x) for x in bufs] == [bytes(p) for p in make_pages(2, seed=1)]
        assert await b.delete(keys) == 1
        assert await a.exists(keys) == 2
        assert b.stats().corrupt == a.stats().corrupt == 0


async def test_custom_prefix_is_used_verbatim(redis_url: str) -> None:
    keys = make_keys(1)
    async with RedisBackend(redis_url, FMT, key_prefix="tenant7/") as b:
        await b.set_from(keys, make_pages(1))
    with raw_client(redis_url) as client:
        assert client.keys("*") == [f"tenant7/{keys[0]}".encode()]


async def test_db_number_in_url_selects_the_database(redis_server: RedisServer,
                                                     redis_url: str) -> None:
    keys = make_keys(2)
    async with RedisBackend(redis_server.url(db=3), FMT) as db3, \
            RedisBackend(redis_server.url(db=0), FMT) as db0:
        await db3.set_from(keys, make_pages(2))
        assert await db0.exists(keys) == 0
        assert await db3.exists(keys) == 2
    with raw_client(redis_server.url(db=3)) as client:
        assert client.dbsize() == 2


async def test_a_second_backend_sees_the_pages(redis_url: str) -> None:
    keys, pages, bufs = make_keys(5), make_pages(5), make_buffers(5)
    async with RedisBackend(redis_url, FMT) as writer:
        await writer.set_from(keys, pages)
    async with RedisBackend(redis_url, FMT) as reader:
        assert await reader.get_into(keys, bufs) == [True] * 5
    assert [bytes(b) for b in bufs] == [bytes(p) for p in pages]


# ---------------------------------------------------------------------- pipelines


def round_trips(b: RedisBackend) -> int:
    return b.stats().extra.get("round_trips", 0)


async def test_large_batches_go_in_pipelines_of_max_batch(redis_url: str) -> None:
    n = 1000
    keys, pages, bufs = make_keys(n), make_pages(n), make_buffers(n)
    async with RedisBackend(redis_url, FMT, max_batch=128) as b:
        assert await b.set_from(keys, pages) == [True] * n
        assert round_trips(b) == math.ceil(n / 128)
        assert await b.exists(keys) == n
        assert await b.get_into(keys, bufs) == [True] * n
        assert await b.delete(keys) == n
        assert round_trips(b) == 4 * math.ceil(n / 128)
        assert b.stats().extra["commands"] == 3 * n + math.ceil(n / 128)  # DEL: 1 per batch
    assert all(bytes(x) == bytes(p) for x, p in zip(bufs, pages, strict=True))


async def test_pipelines_are_also_capped_in_bytes(redis_url: str) -> None:
    keys, pages = make_keys(10), make_pages(10)
    cap = 3 * (HEADER_SIZE + PAGE)  # 3 pages per pipeline
    async with RedisBackend(redis_url, FMT, max_pipeline_bytes=cap) as b:
        assert await b.set_from(keys, pages) == [True] * 10
        assert round_trips(b) == 4
        assert await b.get_into(keys, make_buffers(10)) == [True] * 10
        assert round_trips(b) == 8


async def test_exists_stops_at_the_first_miss_and_sends_no_later_pipeline(
        redis_url: str) -> None:
    keys = make_keys(6)
    async with RedisBackend(redis_url, FMT, max_batch=2) as b:
        await b.set_from([k for i, k in enumerate(keys) if i != 1], make_pages(5))
        before = round_trips(b)
        assert await b.exists(keys) == 1
        assert round_trips(b) == before + 1
        assert await b.exists(keys[2:]) == 4


async def test_batches_above_inline_bytes_are_copied_off_the_loop(redis_url: str) -> None:
    keys, pages, bufs = make_keys(40), make_pages(40), make_buffers(40)
    async with RedisBackend(redis_url, FMT, inline_bytes=0) as b:
        assert await b.set_from(keys, pages) == [True] * 40
        assert await b.get_into(keys, bufs) == [True] * 40
    assert all(bytes(x) == bytes(p) for x, p in zip(bufs, pages, strict=True))


class _Tracked(bytes):
    """A fetched object that records the thread that freed it."""

    freed_on: ClassVar[list[str]] = []

    def __del__(self) -> None:
        self.freed_on.append(threading.current_thread().name)


async def test_objects_of_a_batch_above_inline_bytes_are_freed_off_the_loop(
        redis_url: str) -> None:
    """The fetched objects were freed on the loop when `get_into` returned: 10k objects of
    64 KiB held it 9-14 ms."""
    keys, pages, bufs = make_keys(40), make_pages(40), make_buffers(40)
    async with RedisBackend(redis_url, FMT, inline_bytes=0) as b:
        assert await b.set_from(keys, pages) == [True] * 40
        mget = b._mget

        async def tracked(names: list[str]) -> list[bytes | None]:
            return [None if blob is None else _Tracked(blob) for blob in await mget(names)]

        b._mget = tracked  # type: ignore[method-assign]
        _Tracked.freed_on.clear()
        assert await b.get_into([*keys, "ff" * 16], [*bufs, *make_buffers(1)]) == \
            [True] * 40 + [False]
        gc.collect()
    assert len(_Tracked.freed_on) == 40
    assert threading.main_thread().name not in _Tracked.freed_on
    assert all(bytes(x) == bytes(p) for x, p in zip(bufs, pages, strict=True))
    assert b.stats().pages_read == 40 and b.stats().misses == 1


async def test_concurrent_callers_share_a_bounded_pool(redis_url: str) -> None:
    async with RedisBackend(redis_url, FMT, max_connections=2, max_batch=4) as b:
        async def round_trip(i: int) -> bool:
            keys, pages, bufs = make_keys(10, 10 * i), make_pages(10, seed=i), make_buffers(10)
            await b.set_from(keys, pages)
            await b.get_into(keys, bufs)
            return all(bytes(x) == bytes(p) for x, p in zip(bufs, pages, strict=True))

        assert await asyncio.gather(*(round_trip(i) for i in range(8))) == [True] * 8


# ---------------------------------------------------------------------- TTL, refusals


async def test_ttl_expires_pages(redis_url: str) -> None:
    keys = make_keys(2)
    async with RedisBackend(redis_url, FMT, ttl=0.3) as b:
        await b.set_from(keys, make_pages(2))
        with raw_client(redis_url) as client:
            assert 0 < client.pttl(b.key_prefix + keys[0]) <= 300
        await asyncio.sleep(0.5)  # NOTE: expiry runs on the server's clock: nothing to await
        assert await b.exists(keys) == 0
        assert await b.get_into(keys, make_buffers(2)) == [False, False]


async def test_without_ttl_pages_do_not_expire(backend: RedisBackend, redis_url: str) -> None:
    keys = make_keys(1)
    await backend.set_from(keys, make_pages(1))
    with raw_client(redis_url) as client:
        assert client.pttl(backend.key_prefix + keys[0]) == -1


async def test_pages_the_server_refuses_are_false_and_counted() -> None:
    server = started(RedisServer(extra_args=("--maxmemory", "2mb",
                                             "--maxmemory-policy", "noeviction")))
    try:
        n = 64  # 4 MiB of 64 KiB pages: past the limit
        fmt = make_fmt(payload_bytes=64 << 10)
        async with RedisBackend(server.url(), fmt) as b:
            stored = await b.set_from(make_keys(n), make_pages(n, nbytes=64 << 10))
            assert stored[0] and not stored[-1]
            assert b.stats().errors == stored.count(False)
            assert b.stats().pages_written == stored.count(True)
    finally:
        server.stop()


# ---------------------------------------------------------------------- auth, URLs, secrets


async def test_auth_with_password_in_url(auth_server: RedisServer) -> None:
    keys = make_keys(1)
    for url in (auth_server.url(), auth_server.url(username="default")):
        async with RedisBackend(url, FMT) as b:
            assert await b.set_from(keys, make_pages(1)) == [True]
            assert await b.exists(keys) == 1


@pytest.mark.parametrize("password", ["wrong", ""])
async def test_a_wrong_or_missing_password_is_a_storage_error_not_a_hang(
        auth_server: RedisServer, password: str) -> None:
    url = auth_server.url(password=password) if password else \
        auth_server.url().replace(f":{PASSWORD}@", "")
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        async with RedisBackend(url, FMT, socket_timeout=2):
            pass
    assert time.monotonic() - start < 2
    assert "auth" in str(info.value).lower()
    b = RedisBackend(url, FMT, socket_timeout=2)
    try:
        with pytest.raises(StorageReadError):
            await b.exists(make_keys(1))
        with pytest.raises(StorageWriteError):
            await b.set_from(make_keys(1), make_pages(1))
    finally:
        await b.aclose()


async def test_credentials_appear_in_no_repr_message_or_log(
        auth_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = auth_server.url(username="default", password="wrong-" + PASSWORD)
    b = RedisBackend(url, FMT, socket_timeout=2)
    seen = [repr(b), b.url]
    try:
        with pytest.raises(StorageError) as info:
            await b.get_into(make_keys(1), make_buffers(1))
        seen += [str(info.value), repr(info.value)]
    finally:
        await b.aclose()
    seen += [repr(b), caplog.text]
    assert b.url == f"redis://***@127.0.0.1:{auth_server.port}/0"
    for text in seen:
        assert PASSWORD not in text and "default:" not in text


@pytest.mark.parametrize("url", ["http://h:1/0?password=hunter2", "redis://u:hunter2@h:x/0",
                                 "redis://h:1/x?password=hunter2"])
def test_bad_urls_never_show_their_secrets(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisBackend(url, FMT)
    assert "hunter2" not in str(info.value)


def test_an_unclosed_backend_warns() -> None:
    b = RedisBackend("redis://localhost:6379/0", FMT)
    with pytest.warns(ResourceWarning, match="unclosed <RedisBackend"):
        del b
        gc.collect()


async def test_rediss_url_makes_tls_connections() -> None:
    from redis.asyncio.connection import SSLConnection

    b = RedisBackend("rediss://:pw@localhost:6380/2", FMT)  # nothing connects yet
    try:
        assert issubclass(b._client.connection_pool.connection_class, SSLConnection)
        assert repr(b) == ("<RedisBackend rediss://***@localhost:6380/2 "
                           f"prefix='ahkv:{FMT.namespace_id.hex()}:' open>")
    finally:
        await b.aclose()


@pytest.mark.parametrize(("url", "opts", "match"), [
    ("http://localhost:6379/0", {}, "scheme"),
    ("redis://localhost:6379/notadb", {}, "database number"),
    ("redis://localhost:6379/0?socket_timeout=soon", {}, "socket_timeout"),
    ("redis://localhost:6379/0?nosuch=1", {}, "an option redis-py does not take.*nosuch"),
    ("redis://u:hunter2@localhost:port/0", {}, "unparsable url"),
    ("redis://localhost:6379/0", {"max_batch": 0}, "max_batch"),
    ("redis://localhost:6379/0", {"ttl": -1.0}, "ttl"),
    ("redis://localhost:6379/0", {"ttl": 1e16}, "ttl"),  # Redis would refuse every SET
    ("redis://localhost:6379/0", {"socket_timeout": math.inf}, "socket_timeout"),
    ("redis://localhost:6379/0", {"retries": -1}, "retries"),
])
def test_bad_urls_and_settings_are_config_errors(url: str, opts: dict[str, float],
                                                 match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisBackend(url, FMT, **opts)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- failures


async def test_unreachable_server_raises_storage_error_promptly() -> None:
    server = started(RedisServer())
    url = server.url()
    server.stop()  # the port now refuses connections
    start = time.monotonic()
    with pytest.raises(StorageError, match="Connection refused|connecting"):
        async with RedisBackend(url, FMT):
            pass
    assert time.monotonic() - start < 1


async def test_server_killed_mid_test_raises_storage_errors_promptly(
        own_server: RedisServer) -> None:
    keys = make_keys(4)
    async with RedisBackend(own_server.url(), FMT, socket_timeout=5) as b:
        await b.set_from(keys, make_pages(4))
        own_server.kill()
        start = time.monotonic()
        with pytest.raises(StorageReadError):
            await b.get_into(keys, make_buffers(4))
        with pytest.raises(StorageReadError):
            await b.exists(keys)
        with pytest.raises(StorageWriteError):
            await b.set_from(keys, make_pages(4))
        with pytest.raises(StorageWriteError):
            await b.delete(keys)
        assert time.monotonic() - start < 1  # refused at once: no timeout involved
        assert b.stats().errors == 4


async def test_hung_server_times_out_then_recovers(own_server: RedisServer) -> None:
    keys, pages = make_keys(2), make_pages(2)
    async with RedisBackend(own_server.url(), FMT, socket_timeout=0.3, retries=1) as b:
        await b.set_from(keys, pages)
        own_server.pause()
        try:
            start = time.monotonic()
            with pytest.raises(StorageReadError, match="[Tt]imeout"):
                await b.get_into(keys, make_buffers(2))
            assert time.monotonic() - start < 0.3 * 2 + 0.5  # one try + one retry
        finally:
            own_server.resume()
        bufs = make_buffers(2)
        assert await b.get_into(keys, bufs) == [True, True]
        assert [bytes(x) for x in bufs] == [bytes(p) for p in pages]


# ---------------------------------------------------------------------- cancellation


async def test_cancelled_get_writes_no_buffer_and_leaves_the_backend_usable(
        own_server: RedisServer) -> None:
    keys, pages = make_keys(3), make_pages(3)
    async with RedisBackend(own_server.url(), FMT) as b:
        await b.set_from(keys, pages)
        own_server.pause()
        bufs = make_buffers(3)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await b.get_into(keys, bufs)
        finally:
            own_server.resume()
        assert [bytes(x) for x in bufs] == [bytes(PAGE)] * 3
        # The dropped connection's late reply is never served to the next caller.
        assert await b.get_into(keys[::-1], bufs) == [True] * 3
        assert [bytes(x) for x in bufs] == [bytes(p) for p in pages[::-1]]


async def test_cancelled_set_leaves_each_page_whole_or_absent(own_server: RedisServer) -> None:
    n, nbytes = 64, 64 << 10
    fmt = make_fmt(payload_bytes=nbytes)
    keys, pages = make_keys(n), make_pages(n, nbytes=nbytes)
    async with RedisBackend(own_server.url(), fmt, max_pipeline_bytes=1 << 20) as b:
        await b.set_from(keys[:8], pages[:8])  # a connection is open before the pause
        own_server.pause()
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await b.set_from(keys, pages)
        finally:
            own_server.resume()
        bufs = make_buffers(n, nbytes)
        filled = await b.get_into(keys, bufs)
        assert all(filled[:8])
        assert b.stats().corrupt == 0
        for ok, buf, page in zip(filled, bufs, pages, strict=True):
            assert bytes(buf) == (bytes(page) if ok else bytes(nbytes))


async def test_closed_backend_raises_closed_error_and_aclose_is_idempotent(
        redis_url: str) -> None:
    b = RedisBackend(redis_url, FMT)
    await b.aclose()
    await b.aclose()
    assert repr(b).endswith(" closed>")
    with pytest.raises(ClosedError):
        await b.exists(make_keys(1))
    with pytest.raises(ClosedError):
        await b.get_into(make_keys(1), make_buffers(1))


# ---------------------------------------------------------------------- helper and bench


def test_missing_redis_server_is_a_clear_error_not_a_skip() -> None:
    with pytest.raises(RedisServerError, match="not found on PATH: install it"):
        RedisServer(executable="no-such-redis-server").start()


def test_a_server_that_cannot_start_says_why() -> None:
    with pytest.raises(RedisServerError, match="did not start: .*no-such-option"):
        RedisServer(extra_args=("--no-such-option", "1")).start()


def test_helper_server_answers_with_and_without_password(auth_server: RedisServer) -> None:
    with raw_client(auth_server.url()) as client:
        assert client.ping() is True
    assert repr(auth_server) == f"<RedisServer 127.0.0.1:{auth_server.port} running>"


def test_bench_redis_quick_reports_ratios_and_loop_lag() -> None:
    report = run_redis_bench(quick=True)
    for text in ("bench redis (quick)", "1. RedisBackend vs a raw redis-py pipeline",
                 "64  write", "64  read", "2. Event-loop lag", "backup: set_from",
                 "raw SET pipeline", "restore: get_into", "raw GET pipeline",
                 "floor: idle loop"):
        assert text in report
