"""Fixtures for your async test suite: a pytest plugin, opt-in.

Turn it on in your ``conftest.py`` (``pytest_plugins = ["aiohicache.testing"]``) or with
``pytest -p aiohicache.testing``. It needs pytest-asyncio. Fixtures:

- ``hicache_config``: a small CPU `HiCacheConfig` (override it in your conftest for yours).
- ``hicache``: an open `HiCache` of that config.
- ``hicache_factory``: ``make(config)`` opens more caches (closed after the test).
- ``kv``: a `KVOracle` on ``hicache``: writes prefix-dependent KV, checks every hit.
- ``faulty_storage``: ``make(config, **faults)`` gives an L3 store (in memory) that injects
  latency, errors, timeouts, corrupt reads and partial batches (`FaultyBackend`).

After each test, every cache a fixture opened is drained and checked: `check_invariants`,
no device slots still leased, health not ``failed``; a failure names the cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio

from .. import HiCache, HiCacheConfig, KVSpec
from ..storage import FaultyBackend, MemoryBackend, PageFormat
from ._kv import KVOracle, kv_code

__all__ = ("KVOracle", "check_cache", "faulty_storage", "hicache", "hicache_config",
           "hicache_factory", "kv", "kv_code", "small_config", "storage_format", "with_storage")

CacheFactory = Callable[[HiCacheConfig], Awaitable[HiCache]]
StorageFactory = Callable[..., FaultyBackend]


def small_config(**overrides: Any) -> HiCacheConfig:
    """A CPU cache of 3 bf16 MHA layers, 4-token pages, 16 device and 64 host pages;
    keyword arguments override fields."""
    fields: dict[str, Any] = {
        "spec": KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bf16"),
        "page_size": 4, "device_pages": 16, "host_pages": 64}
    fields.update(overrides)
    return HiCacheConfig(**fields)


def storage_format(config: HiCacheConfig) -> PageFormat:
    """The page format a cache with `config` expects of a store passed as ``storage=``."""
    from ..controller import page_format

    return page_format(config)


async def check_cache(cache: HiCache) -> None:
    """What the plugin asserts after each test: copies settle, the internal invariants hold,
    no device slot is still leased, no fetch context was left unexited, the cache has not
    failed."""
    await cache.drain()
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0, (
        f"{cache!r}: {stats.device_pages_leased} device pages still leased after the test "
        f"(allocate() without commit or free, outside a fetch context?)")
    # NOTE: a context entered by hand and dropped is released when collected (a warning
    # nobody sees: ResourceWarning is ignored by default), so its leases passed the check
    abandoned = cache._core.abandoned
    assert abandoned == 0, (
        f"{cache!r}: {abandoned} fetch context(s) entered and never exited (released when "
        f"collected; use 'async with cache.fetch(...)')")
    assert stats.health != "failed", f"{cache!r}: the cache failed during the test"


@pytest.fixture
def hicache_config() -> HiCacheConfig:
    """The config of the ``hicache`` fixture; override this fixture to change it."""
    return small_config()


@pytest_asyncio.fixture
async def hicache_factory(faulty_storage: StorageFactory) -> AsyncIterator[CacheFactory]:
    """``await make(config)``: an open cache, checked and closed after the test.

    NOTE: it asks for `faulty_storage` only to be torn down before it: the check drains the
    caches' backups, which need their stores open (asked for after this fixture, the stores
    closed first and those backups failed unseen).
    """
    caches: list[HiCache] = []

    async def make(config: HiCacheConfig) -> HiCache:
        cache = HiCache(config)
        await cache.__aenter__()
        caches.append(cache)
        return cache

    try:
        yield make
        for cache in caches:
            await check_cache(cache)
    finally:
        for cache in caches:
            await cache.aclose()


@pytest_asyncio.fixture
async def hicache(hicache_factory: CacheFactory, hicache_config: HiCacheConfig) -> HiCache:
    """An open `HiCache` of ``hicache_config``, checked after the test."""
    return await hicache_factory(hicache_config)


@pytest.fixture
def kv(hicache: HiCache) -> KVOracle:
    """A `KVOracle` on ``hicache``."""
    return KVOracle(hicache)


@pytest_asyncio.fixture
async def faulty_storage() -> AsyncIterator[StorageFactory]:
    """``make(config, seed=0, **faults)``: a fault-injecting in-memory L3 for caches of
    `config` (pass it as ``storage=``; the same store can serve several caches). Faults are
    `FaultyBackend`'s: ``error_rate``, ``latency=(lo, hi)``, ``timeout_rate``,
    ``corrupt_rate``, ``partial_rate``, ``timeout_s``."""
    stores: list[FaultyBackend] = []

    def make(config: HiCacheConfig, *, seed: int = 0, **faults: Any) -> FaultyBackend:
        store = FaultyBackend(MemoryBackend(storage_format(config)), seed=seed, **faults)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


def with_storage(config: HiCacheConfig, store: object, **overrides: Any) -> HiCacheConfig:
    """`config` with `store` as its L3 (and any other field changed)."""
    return dataclasses.replace(config, storage=store, **overrides)

