"""The cache as anyio code uses it: cancel scopes, task groups, and the trio backend.

`tests/test_cancel_sweep_review.py` cancels every public coroutine at each of its await
points on asyncio (``Task.cancel``, an anyio scope, ``asyncio.timeout``). Here the same calls
run under ``trio.run`` (what docs/architecture.md claims: the core with a memory or file
store) and under anyio on asyncio, inside task groups and level-triggered cancel scopes
(``move_on_after`` deadlines from 0 to a call's length, and a scope cancelled after each of
the first loop turns): a cancelled scope raises again at every later await, cleanup code's
included. After each cancelled run copies settle, the invariants hold, nothing is leased or
pinned, every committed prefix is served right or missed (`KVChecker`), the store's pages
are whole, no I/O thread, file or system task is left, and the cache closes.

What does not run under trio must say so: a Redis store (redis-py is asyncio-only) is a
`ConfigError` naming it, when the cache opens or the store is called, not a cache that
logs every L3 call as a bug and runs degraded for good.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aiohicache import HiCache
from aiohicache.errors import ConfigError
from aiohicache.storage import FaultyBackend, FileBackend
from aiohicache.storage.redis import RedisBackend
from aiohicache.testing import storage_format, with_storage
from tests.conftest import make_config, make_tokens
from tests.kvcheck import KVChecker
from tests.storage.conftest import FMT, SENTINEL, page_views
from tests.storage.redis_server import shared_server
from tests.storage.sweep import NEW, OLD, assert_pages_whole_or_missed, swept_call

trio = pytest.importorskip("trio")

BACKENDS = ["trio", "asyncio"]
PROMPTS = [make_tokens(8, seed=99) + make_tokens(12, seed=s) for s in range(4)]
"""A shared system prompt (two pages), then three pages of each request's own."""


def run_on(backend: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
    anyio.run(fn, *args, backend=backend)


async def serve(cache: HiCache, kv: KVChecker, tokens: list[int]) -> None:
    """One request: wait for every layer, check every cached token, compute and commit."""
    async with cache.fetch(tokens) as hit:
        for layer in range(cache.config.spec.num_layers):
            await hit.layer_ready(layer)
        await hit.ready()
        await kv.verify_prefix(hit, tokens)
        if new := len(tokens) - hit.num_cached_tokens:
            slots = await hit.allocate(new)
            kv.fill(slots, tokens, hit.num_cached_tokens)
            await hit.commit(tokens, slots)


async def evict(cache: HiCache) -> None:
    """Every page off the device and the host: the next requests prefetch from L3."""
    await cache.drain()
    cache.free(await cache.allocate(cache.device_pool.num_slots))
    cache.tree.evict_host(cache.host_pool.num_pages)


async def assert_clean(cache: HiCache, kv: KVChecker, where: str) -> None:
    with anyio.fail_after(5):
        await cache.drain()
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0, f"{where}: pages leased"
    assert not cache._pins, f"{where}: pins left"
    assert stats.pending_loads == stats.pending_writes == 0, f"{where}: copies pending"
    assert stats.health == "ok", f"{where}: health {stats.health}"
    for tokens in PROMPTS:  # served right or missed
        async with cache.fetch(tokens) as hit:
            await kv.verify_prefix(hit, tokens)


async def cancelled_after_turns(turns: int, fn: Callable[..., Awaitable[Any]],
                                *args: object) -> None:
    """`fn(*args)` in a scope a sibling cancels after `turns` loop turns."""
    with anyio.CancelScope() as scope:
        async def cancel() -> None:
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
            scope.cancel()
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel)
            await fn(*args)


# ------------------------------------------------------------------------------ requests

@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_prefetching_from_a_file_store_cancelled_by_scopes(
        backend: str, tmp_path: Path) -> None:
    """Concurrent requests in a task group, each prefetching from a ``file://`` L3, under a
    ``move_on_after`` deadline swept from 0 to their whole length, then under a scope
    cancelled after each of the first loop turns: the cache stays consistent, serves every
    prefix right or misses it, and closes."""
    async def main() -> None:
        config = make_config(device_pages=32, host_pages=48, storage=f"file://{tmp_path}",
                             prefetch_policy="wait_complete", prefetch_threshold=4,
                             storage_miss_ttl=0)
        async with HiCache(config) as cache:
            kv = KVChecker(cache)

            async def batch() -> None:
                async with anyio.create_task_group() as tg:
                    for tokens in PROMPTS:
                        tg.start_soon(serve, cache, kv, tokens)
            await batch()
            await evict(cache)
            start = time.monotonic()
            await batch()
            length = time.monotonic() - start
            assert cache.stats().storage_hit_tokens > 0
            for i in range(30):
                await evict(cache)
                with anyio.move_on_after(length * i / 30):
                    await batch()
                await assert_clean(cache, kv, f"deadline {i}/30 of {length:.4f} s")
            for turns in range(30):
                await evict(cache)
                await cancelled_after_turns(turns, batch)
                await assert_clean(cache, kv, f"cancelled after {turns} turns")
            assert cache.stats().storage is not None
            assert cache.stats().storage.errors == 0  # type: ignore[union-attr]
        assert "closed" in repr(cache)

    run_on(backend, main)


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_and_close_cancelled_by_scopes_leave_nothing_running(
        backend: str, tmp_path: Path) -> None:
    """``__aenter__`` and ``aclose`` (with backups to a file store in flight) cancelled by a
    scope after each of the first loop turns: the cache ends closed, and no worker task or
    copy/I/O thread outlives it."""
    def threads() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("aiohicache")}

    async def main() -> None:
        before = threads()
        for turns in range(25):
            config = make_config(device_pages=32, host_pages=48,
                                 storage=f"file://{tmp_path / str(turns)}")
            cache = HiCache(config)
            await cancelled_after_turns(turns, cache.__aenter__)
            if cache._core.state == "open":
                kv = KVChecker(cache)
                for tokens in PROMPTS:
                    await serve(cache, kv, tokens)
                await cancelled_after_turns(turns, cache.aclose)
            assert cache._core.state == "closed", f"turn {turns}: {cache!r}"
            assert cache._runner is None or cache._runner.done.done(), f"turn {turns}"
        await anyio.sleep(0.2)  # executors' threads exit once shut down
        assert threads() <= before, f"threads left: {threads() - before}"

    run_on(backend, main)


# ------------------------------------------------------------------------------ the stores

@pytest.mark.parametrize("op", ["set_from", "get_into", "exists", "delete", "aclose"])
def test_file_store_calls_under_trio_cancelled_by_scopes(op: str, tmp_path: Path) -> None:
    """Each public call of a `FileBackend` under trio, in a scope cancelled after each of
    the first loop turns and under swept deadlines: no buffer is written after the call
    ended, every page is whole or missed (here and for a second instance reading the
    journals), and once closed no I/O thread or file is left open."""
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    def io_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("aiohicache-file")}

    async def one(root: Path, cancel: Callable[[Callable[[], Awaitable[object]]],
                                               Awaitable[None]], where: str) -> None:
        files, threads = fds(), io_threads()
        async with FileBackend(root, FMT, max_concurrency=2, refresh_interval=0) as store:
            buffers = [bytearray([SENTINEL]) * FMT.payload_bytes for _ in [*OLD, *NEW]]
            assert await store.set_from(OLD, page_views(OLD)) == [True] * len(OLD)
            await cancel(lambda: swept_call(op, store, buffers))
            seen = [bytes(b) for b in buffers]
            await anyio.sleep(0.02)  # a copy still running would land now
            assert [bytes(b) for b in buffers] == seen, f"{where}: written after the call"
            if op != "aclose":
                await assert_pages_whole_or_missed(store, op, where)
        async with FileBackend(root, FMT, max_concurrency=2, refresh_interval=0) as second:
            await assert_pages_whole_or_missed(second, op, where)
        assert io_threads() <= threads, f"{where}: I/O threads left"
        assert fds() <= files, f"{where}: files left open"

    async def main() -> None:
        for turns in range(25):
            await one(tmp_path / f"t{turns}",
                      lambda call, n=turns: cancelled_after_turns(n, call),  # type: ignore[misc]
                      f"{op} cancelled after {turns} turns")
        for i in range(15):
            async def deadline(call: Callable[[], Awaitable[object]], d: float = 0.0003 * i,
                               ) -> None:
                with anyio.move_on_after(d):
                    await call()
            await one(tmp_path / f"d{i}", deadline, f"{op} under a {0.0003 * i} s deadline")

    trio.run(main)


# ------------------------------------------------------------------------------ Redis and trio

def test_a_redis_store_under_trio_is_refused_when_the_cache_opens() -> None:
    """A ``redis://`` L3 (or a Redis store passed in, wrapped or not) under trio: opening
    the cache raises `ConfigError` saying the store needs asyncio, before anything starts.

    (It opened: every prefetch and backup failed with ``RuntimeError: no running event
    loop``, logged as an unexpected bug, the breaker opened and the cache ran degraded for
    good, never saying why.)"""
    url = shared_server().url()

    async def main() -> None:
        config = make_config(storage=url, prefetch_threshold=4)
        cache = HiCache(config)
        with pytest.raises(ConfigError, match=r"storage: a Redis store needs an asyncio"):
            await cache.__aenter__()
        assert cache._runner is None  # no worker was started
        await cache.aclose()
        wrapped = FaultyBackend(RedisBackend(url, storage_format(config)), seed=0)
        with pytest.raises(ConfigError, match="trio"):
            async with HiCache(with_storage(config, wrapped)):
                pass
        await wrapped.aclose()  # passed in: ours to close

    trio.run(main)


def test_a_redis_store_called_under_trio_raises_config_error() -> None:
    """`RedisBackend` used on its own under trio: entering it or any call raises
    `ConfigError` naming the cause (it raised a bare ``RuntimeError: no running event
    loop`` from inside redis-py)."""
    async def main() -> None:
        with pytest.raises(ConfigError, match="asyncio-only"):
            async with RedisBackend(shared_server().url(), FMT):
                pass
        store = RedisBackend(shared_server().url(), FMT)
        with pytest.raises(ConfigError, match="asyncio-only"):
            await store.exists(OLD)
        await store.aclose()

    trio.run(main)


async def test_a_redis_store_on_asyncio_inside_anyio_scopes_still_works() -> None:
    """The check refuses trio only: on asyncio the Redis L3 serves prefetches, also for
    requests in a task group cancelled by a deadline."""
    config = make_config(device_pages=32, host_pages=48, storage=shared_server().url(),
                         prefetch_policy="wait_complete", prefetch_threshold=4,
                         storage_miss_ttl=0,
                         namespace=f"anyio-{os.urandom(4).hex()}")
    async with HiCache(config) as cache:
        kv = KVChecker(cache)
        for tokens in PROMPTS:
            await serve(cache, kv, tokens)
        for i in range(10):
            await evict(cache)
            with anyio.move_on_after(0.001 * i):
                async with anyio.create_task_group() as tg:
                    for tokens in PROMPTS:
                        tg.start_soon(serve, cache, kv, tokens)
            await assert_clean(cache, kv, f"deadline {0.001 * i} s")
        await evict(cache)
        for tokens in PROMPTS:
            await serve(cache, kv, tokens)
        assert cache.stats().storage_hit_tokens > 0
