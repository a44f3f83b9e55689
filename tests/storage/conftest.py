"""The backends the storage conformance suite runs on, and how to add one.

Every factory in `BACKENDS` runs every test of ``test_conformance.py`` twice: as is
("clean") and wrapped in a `FaultyBackend` ("faulty", where the suite only asks for
correct-or-miss). A factory is an async context manager that gets a `StoreContext` and
yields a `Store`: the backend, plus hooks that reach around it into its storage. To add a
backend, write one and append it, e.g. for Redis::

    @asynccontextmanager
    async def redis_store(ctx: StoreContext) -> AsyncIterator[Store]:
        async with RedisBackend(url, ctx.fmt) as backend:
            async def put_raw(key: str, blob: bytes) -> None:
                await raw_client.set(backend.key_prefix + key, blob)
            ...
            yield Store(backend, corrupt=corrupt, put_raw=put_raw, copy_raw=copy_raw,
                        rename_raw=rename_raw, reopen=reopen, has_capacity=False)

    BACKENDS.append(pytest.param(redis_store, id="redis", marks=needs_redis_server))

Hooks: `corrupt(key)` flips one byte of the stored object; `put_raw(key, blob)` stores
`blob` as the object, bypassing encoding; `copy_raw(src, dst)` and `rename_raw(src, dst)`
copy or move the object of `src` over `dst` the storage's own way (journal entries binding
`dst` to a copy of, or to, the record of `src`; Redis ``COPY`` and ``RENAME``), bypassing the
backend; `reopen()` opens a second backend
over the same storage (None where storage does not outlive the instance); `has_capacity` says
whether the factory honoured `ctx.capacity_bytes` (else the budget tests skip).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast
from unittest import mock

import anyio
import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from aiohicache._redis_server import RedisServer
from aiohicache.storage import (
    FaultyBackend,
    FileBackend,
    MemoryBackend,
    PageFormat,
    StorageBackend,
    StorageError,
    _native,
    chain_keys,
    namespace_root,
)
from aiohicache.storage._journal import Entry, segment_path
from aiohicache.storage.redis import RedisBackend, RedisClusterBackend

from . import segment_hooks as hooks
from .redis_server import shared_cluster, shared_server, started

T = TypeVar("T")

PAYLOAD = 512
FMT = PageFormat.make(namespace="conformance", spec_fingerprint="mha-L2-2x8-bf16",
                      page_size=4, payload_bytes=PAYLOAD)
SENTINEL = 0xEE
"""Every buffer handed to `get_into` starts filled with this byte (to see whether it was
written)."""
FAULTS: dict[str, Any] = {"error_rate": 0.1, "latency": (0.0, 0.002), "timeout_rate": 0.05,
                          "timeout_s": 0.005, "corrupt_rate": 0.1, "partial_rate": 0.1}
"""The moderate fault mix of the "faulty" mode."""


# ---------------------------------------------------------------------------- what factories make

@dataclass(frozen=True, slots=True)
class StoreContext:
    """What a factory is given."""

    fmt: PageFormat
    capacity_bytes: int | None
    tmp_path: Path


@dataclass(slots=True)
class Store:
    """A backend under test, and the hooks that reach into its storage."""

    backend: StorageBackend
    corrupt: Callable[[str], Awaitable[None]]
    put_raw: Callable[[str, bytes], Awaitable[None]]
    copy_raw: Callable[[str, str], Awaitable[None]]
    rename_raw: Callable[[str, str], Awaitable[None]]
    reopen: Callable[[], AbstractAsyncContextManager[StorageBackend]] | None = None
    has_capacity: bool = True


StoreFactory = Callable[[StoreContext], AbstractAsyncContextManager[Store]]


@asynccontextmanager
async def memory_store(ctx: StoreContext) -> AsyncIterator[Store]:
    async with MemoryBackend(ctx.fmt, capacity_bytes=ctx.capacity_bytes) as backend:
        async def corrupt(key: str) -> None:
            backend._objects[key][-1] ^= 0xFF

        async def put_raw(key: str, blob: bytes) -> None:
            backend._objects[key] = bytearray(blob)

        async def copy_raw(src: str, dst: str) -> None:
            backend._objects[dst] = bytearray(backend._objects[src])

        async def rename_raw(src: str, dst: str) -> None:
            backend._objects[dst] = backend._objects.pop(src)

        yield Store(backend, corrupt=corrupt, put_raw=put_raw, copy_raw=copy_raw,
                    rename_raw=rename_raw)


@asynccontextmanager
async def file_store(ctx: StoreContext) -> AsyncIterator[Store]:
    root = ctx.tmp_path / "l3"

    def open_file() -> FileBackend:
        return FileBackend(root, ctx.fmt, capacity_bytes=ctx.capacity_bytes)

    async with open_file() as backend:
        # NOTE: a journal entry is what binds a key to a record in the segment layout, so
        # rename and copy are entries written behind the backend's back (as another process
        # would); the backend then reads the journals, as it does on any unknown key.
        def stamp() -> int:
            return max(time.time_ns(), backend._index.last_stamp + 1)

        async def changed(fn: Callable[..., None], *args: Any) -> None:
            await anyio.to_thread.run_sync(fn, *args)
            await backend._refresh(force=True)

        async def corrupt(key: str) -> None:
            await anyio.to_thread.run_sync(hooks.corrupt_record, root, backend._index.entries[key])

        async def put_raw(key: str, blob: bytes) -> None:
            await changed(hooks.append_record, root, key, blob, stamp())

        async def copy_raw(src: str, dst: str) -> None:
            blob = await anyio.to_thread.run_sync(_record_bytes, root, backend._index.entries[src])
            await changed(hooks.append_record, root, dst, blob, stamp())

        async def rename_raw(src: str, dst: str) -> None:
            entries = hooks.rename_entries(backend._index.entries[src], dst, stamp())
            await changed(hooks.append_entries, root, entries)

        yield Store(backend, corrupt=corrupt, put_raw=put_raw, copy_raw=copy_raw,
                    rename_raw=rename_raw, reopen=open_file)


@asynccontextmanager
async def file_store_in_python(ctx: StoreContext) -> AsyncIterator[Store]:
    """`file_store` reading and hashing in Python, as where the native module is not built."""
    with mock.patch.object(_native, "SPAN_READER", None), \
            mock.patch.object(_native, "CHECKSUMS", None):
        async with file_store(ctx) as store:
            yield store


@pytest.fixture(params=["native", "python"])
def file_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The file store's reader for the test: the native span reader (skipped where it is not
    built, unless ``AIOHICACHE_REQUIRE_NATIVE=1``: CI), or the Python one."""
    if request.param == "python":
        monkeypatch.setattr(_native, "SPAN_READER", None)
        monkeypatch.setattr(_native, "CHECKSUMS", None)
    elif _native.SPAN_READER is None and os.environ.get("AIOHICACHE_REQUIRE_NATIVE") != "1":
        pytest.skip("the native span reader is not built here")
    return str(request.param)


def _record_bytes(root: Path, entry: Entry) -> bytes:
    with open(segment_path(str(root), entry.seg_id), "rb") as f:
        f.seek(entry.offset)
        return f.read(entry.length)


@asynccontextmanager
async def redis_store(ctx: StoreContext) -> AsyncIterator[Store]:
    url = shared_server().url()  # a real redis-server; fails (never skips) if there is none
    prefix = f"conformance:{os.urandom(8).hex()}:"  # a keyspace of this test's own

    def open_redis() -> RedisBackend:
        return RedisBackend(url, ctx.fmt, key_prefix=prefix)

    async with open_redis() as backend, Redis.from_url(url) as raw:
        corrupt, put_raw = raw_edits(raw, prefix)

        async def copy_raw(src: str, dst: str) -> None:
            assert await raw.copy(prefix + src, prefix + dst, replace=True)

        async def rename_raw(src: str, dst: str) -> None:
            assert await raw.rename(prefix + src, prefix + dst)

        yield Store(backend, corrupt=corrupt, put_raw=put_raw, copy_raw=copy_raw,
                    rename_raw=rename_raw, reopen=open_redis, has_capacity=False)


def raw_edits(raw: Redis | RedisCluster, prefix: str) -> tuple[
        Callable[[str], Awaitable[None]], Callable[[str, bytes], Awaitable[None]]]:
    """Hooks that edit stored objects behind the backend's back: flip a payload byte, put
    raw bytes under a key."""
    async def corrupt(key: str) -> None:
        blob = await raw.get(prefix + key)
        await raw.set(prefix + key, blob[:-1] + bytes([blob[-1] ^ 0xFF]))

    async def put_raw(key: str, blob: bytes) -> None:
        await raw.set(prefix + key, blob)
    return corrupt, put_raw


@asynccontextmanager
async def cluster_store(ctx: StoreContext) -> AsyncIterator[Store]:
    url = shared_cluster().url()  # a real cluster, shared with test_cluster.py
    prefix = f"conformance:{os.urandom(8).hex()}:"

    def open_cluster() -> RedisClusterBackend:
        return RedisClusterBackend(url, ctx.fmt, key_prefix=prefix)

    async with open_cluster() as backend:
        # NOTE: the backend's own client, as raw access (a second client would learn the
        # cluster again: a third of a second per test); COPY and RENAME refuse keys of
        # different hash slots (CROSSSLOT), so the hooks move objects with GET, SET and DEL
        raw = cast(RedisCluster, backend._client)
        corrupt, put_raw = raw_edits(raw, prefix)

        async def copy_raw(src: str, dst: str) -> None:
            await raw.set(prefix + dst, await raw.get(prefix + src))

        async def rename_raw(src: str, dst: str) -> None:
            await copy_raw(src, dst)
            assert await raw.delete(prefix + src) == 1

        yield Store(backend, corrupt=corrupt, put_raw=put_raw, copy_raw=copy_raw,
                    rename_raw=rename_raw, reopen=open_cluster, has_capacity=False)


BACKENDS: list[Any] = [
    pytest.param(memory_store, id="memory"),
    pytest.param(file_store, id="file"),
    pytest.param(file_store_in_python, id="file-python"),
    pytest.param(redis_store, id="redis"),
    pytest.param(cluster_store, id="redis-cluster"),
]
"""The factories the conformance suite runs on (append yours: see the module docstring)."""


# ---------------------------------------------------------------------------- what tests get

@dataclass(slots=True)
class Case:
    """One backend in one mode, with calls that check the rules every call must keep.

    `backend` is what a test exercises: `store.backend` itself ("clean"), or a
    `FaultyBackend` around it ("faulty"). `store.backend` is never faulty: use it to set up
    and to look at what really landed. In faulty mode the helpers turn a `StorageError`
    into "nothing known" (all False, or None for counts); in clean mode it fails the test.
    """

    store: Store
    backend: StorageBackend
    faulty: bool

    async def set(self, keys: list[str], pages: list[bytes],
                  via: StorageBackend | None = None) -> list[bool]:
        """Store `pages`; True where stored (always all True in clean mode)."""
        backend = via or self.backend
        stored = await self.guard(backend.set_from(keys, [memoryview(p) for p in pages]),
                                   [False] * len(keys))
        if not self.faulty:
            assert stored == [True] * len(keys)
        return stored

    async def get(self, keys: list[str], via: StorageBackend | None = None
                  ) -> list[bytes | None]:
        """Read `keys`: each page's bytes, or None where missed (a missed buffer's bytes are
        not the backend's to promise: a rejected object may have been read into it)."""
        backend = via or self.backend
        buffers = [bytearray([SENTINEL]) * PAYLOAD for _ in keys]
        hits = await self.guard(backend.get_into(keys, [memoryview(b) for b in buffers]),
                                 [False] * len(keys))
        assert len(hits) == len(keys)
        return [bytes(buf) if hit else None for hit, buf in zip(hits, buffers, strict=True)]

    async def exists(self, keys: list[str], via: StorageBackend | None = None) -> int | None:
        return await self.guard((via or self.backend).exists(keys), None)

    async def guard(self, call: Awaitable[T], unknown: T) -> T:
        """`call`'s result; faulty, `unknown` if it raised `StorageError`."""
        if not self.faulty:
            return await call
        try:
            return await call
        except StorageError:
            return unknown


@pytest.fixture(params=BACKENDS)
def factory(request: pytest.FixtureRequest) -> StoreFactory:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=["clean", "faulty"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


OpenCase = Callable[..., AbstractAsyncContextManager[Case]]


@pytest.fixture
def open_case(factory: StoreFactory, mode: str, tmp_path: Path) -> OpenCase:
    """``async with open_case(capacity_bytes=..., fmt=..., **faults) as case``: a fresh case.

    `faults` (FaultyBackend keywords) wrap the backend even in clean mode (a test that needs
    latency, say); in faulty mode they override the moderate mix.
    """

    @asynccontextmanager
    async def open_(*, capacity_bytes: int | None = None, fmt: PageFormat = FMT,
                    **faults: Any) -> AsyncIterator[Case]:
        async with factory(StoreContext(fmt, capacity_bytes, tmp_path)) as store:
            if mode == "clean" and not faults:
                yield Case(store, store.backend, faulty=False)
                return
            mix = {**FAULTS, **faults} if mode == "faulty" else faults
            yield Case(store, FaultyBackend(store.backend, seed=1, **mix),
                       faulty=mode == "faulty")

    return open_


@pytest.fixture
async def case(open_case: OpenCase) -> AsyncIterator[Case]:
    async with open_case() as case:
        yield case


# ---------------------------------------------------------------------------- keys and pages

def make_keys(num: int, *, seed: int = 0) -> list[str]:
    """`num` page keys as the cache makes them (a chain over made-up tokens)."""
    root = namespace_root(namespace=f"test-{seed}", spec_fingerprint="mha", page_size=4,
                          layout="page_first")
    tokens = np.arange(num * 4, dtype=np.int64) + seed * 1_000_003
    return [digest.hex() for digest in chain_keys(root, tokens, 4)]


def make_page(key: str, *, version: int = 0) -> bytes:
    """The page stored under `key` (a different one for another `version`)."""
    return hashlib.shake_128(f"{key}/{version}".encode()).digest(PAYLOAD)


def page_views(keys: list[str]) -> list[memoryview]:
    """`make_page` of each key, as the buffers `set_from` takes."""
    return [memoryview(make_page(key)) for key in keys]


async def read_pages(backend: StorageBackend, keys: list[str]) -> list[bytes | None]:
    """What `get_into` reads for each key (None: a miss)."""
    buffers = [bytearray(PAYLOAD) for _ in keys]
    hits = await backend.get_into(keys, [memoryview(b) for b in buffers])
    return [bytes(b) if hit else None for hit, b in zip(hits, buffers, strict=True)]


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A Redis server of this test's own, to kill or pause."""
    server = started(RedisServer())
    yield server
    server.stop()
