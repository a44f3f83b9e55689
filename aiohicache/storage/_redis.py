"""`RedisBackend`: one Redis (or Valkey) server as the L3 page store, pipelined batches.

One page is one Redis string, its 64-byte header then its payload (see `base.py`), written by
a single SET: a reader sees a whole object or none. The Redis key is ``<prefix><page key>``;
the default prefix names the namespace, so caches of different models never see each other's
pages. Payloads are bytes in and bytes out; nothing is ever pickled.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from types import TracebackType
from typing import Any, Self, TypeVar, TypeVarTuple, cast

import anyio.to_thread
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from .._concurrency import finish_then_cancel
from ..errors import ClosedError, ConfigError
from ._common import check_buffers, check_keys
from ._redis_parts import (
    Blob,
    cancel_requests,
    check_settings,
    client,
    copy_payloads,
    encode_objects,
    leading_true,
    raise_lost_cancel,
    redact,
    verify,
)
from .base import HEADER_SIZE, BackendStats, PageFormat
from .errors import StorageError, StorageReadError, StorageWriteError

__all__ = ("RedisBackend",)

log = logging.getLogger("aiohicache.storage.redis")

_INFO_INTERVAL_S = 10.0
"""Seconds between looks at the server's memory (``INFO memory``), made by writes."""
Add = Callable[[Any, str, int], object]
"""How a pipelined call queues one name's command: ``add(pipe, name, index)``."""
R = TypeVar("R")
Ts = TypeVarTuple("Ts")

# Compare-and-delete: a rejected object is removed only if no writer has replaced it since.
# NOTE: compared by its SHA-1, not sent back whole: a pipeline of rejected objects was not
# capped in bytes, and asyncio joins a pipeline on the loop (96 x 1 MiB held it 0.8 s)
_DELETE_IF_UNCHANGED = """
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBackend:
    """A `StorageBackend` on one Redis server (``redis://``, ``rediss://`` for TLS, ``unix://``).

        async with RedisBackend("redis://user:pass@10.0.0.5:6379/2", fmt, ttl=3600) as l3:
            await l3.set_from(keys, pages)
            n = await l3.exists(keys)

    Batches go out as pipelines of at most `max_batch` commands and about
    `max_pipeline_bytes`. NOTE: asyncio (Python 3.11) joins a pipeline into one buffer on the
    event loop, so the byte cap bounds how long the loop is held. ``bench redis``, 1 MiB
    pages: raw pipelines of 128 pages showed a p99 loop lag over 150 ms, the backend's 4 MiB
    pipelines about 4 ms (on a busy 2-core machine whose idle floor is about 2 ms).

    Reads fetch every object of the call, verify them all, delete the rejected ones, and only
    then copy payloads into the buffers. Writes build each page's object (header + payload)
    and send it with one SET. Work on more than `inline_bytes` of pages (checksums, copies)
    runs on a worker thread; xxh3 and numpy release the GIL, so the loop keeps running.

    A connection failure or a timeout raises `StorageError`: a backend that cannot be
    reached never hangs the caller past `socket_timeout` per attempt. The URL's credentials
    appear in no message, log or repr (`url` has them removed).

    Args:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS), or a local
            socket: ``unix:///path/to/redis.sock?db=N`` (a password as ``password=`` in
            the query, or ``unix://:password@/path/...``).
        fmt: the page format every object is written in and checked against.
        key_prefix: prepended to every key; default ``ahkv:<namespace id hex>:``.
        max_batch: most commands (pages) in one pipeline.
        max_pipeline_bytes: pages per pipeline are also capped so a pipeline holds about
            this many bytes (at least one page).
        ttl: seconds each written page lives (None: until deleted or evicted by Redis).
        socket_timeout: seconds to wait for one reply (or to send one pipeline).
        connect_timeout: seconds to open a connection.
        max_connections: connections at most; further calls wait for a free one.
        retries: times a command is retried after a connection error or timeout.
        inline_bytes: batches up to this size are verified and copied on the loop.

    Raises:
        ConfigError: a bad URL or setting (nothing is connected yet).

    NOTE: redis-py's client is asyncio-only, so this backend needs an asyncio loop (trio
    would need another client); its own work off the loop uses anyio.to_thread.
    """

    def __init__(self, url: str, fmt: PageFormat, *, key_prefix: str | None = None,
                 max_batch: int = 128, max_pipeline_bytes: int = 4 << 20,
                 ttl: float | None = None, socket_timeout: float = 5.0,
                 connect_timeout: float = 2.0, max_connections: int = 16, retries: int = 1,
                 inline_bytes: int = 1 << 20) -> None:
        check_settings(max_batch=max_batch, max_pipeline_bytes=max_pipeline_bytes,
                       max_connections=max_connections, retries=retries,
                       inline_bytes=inline_bytes, ttl=ttl, socket_timeout=socket_timeout,
                       connect_timeout=connect_timeout)
        if key_prefix is not None and not isinstance(key_prefix, str):
            raise ConfigError(f"key_prefix: must be a str or None, got {key_prefix!r}")
        self.fmt = fmt
        self.url = redact(url)
        """The server's URL without credentials or query."""
        self.key_prefix = f"ahkv:{fmt.namespace_id.hex()}:" if key_prefix is None \
            else key_prefix
        self.max_batch = max_batch
        self.inline_bytes = inline_bytes
        self._pages_per_pipeline = max(1, min(
            max_batch, max_pipeline_bytes // (HEADER_SIZE + fmt.payload_bytes)))
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._stats = BackendStats()
        self._info_at = -math.inf
        self._memory: tuple[int | None, int | None] = (None, None)
        """(maxmemory, used_memory) as last seen; maxmemory None: no limit."""
        self._memory_seen = False
        """Whether a look at the memory succeeded (`_memory` is known)."""
        self._evicted_keys: int | None = None
        """The server's ``evicted_keys`` as last seen (None: not seen)."""
        self._calls = 0
        """Calls in flight: `aclose` closes the pool once none is left."""
        self._idle: anyio.Event | None = None
        # NOTE: redis-py's BlockingConnectionPool waits on an asyncio.Condition, which
        # (Python 3.11) drops a wake-up whose waiter is cancelled before it runs: the next
        # waiter then waited forever beside a free connection. anyio's semaphore passes such
        # a wake-up on, so callers wait here and the pool has a connection for each holder.
        self._connections = anyio.Semaphore(max_connections)
        """Held by each command or pipeline sent (at most `max_connections`)."""
        self._client = self._connect(url, socket_timeout=socket_timeout,
                                     connect_timeout=connect_timeout,
                                     max_connections=max_connections, retries=retries)
        if isinstance(self._client, Redis):
            # NOTE: a URL's max_connections sizes redis-py's pool (the URL wins over the
            # keyword): callers wait here within the smaller, never in the pool (see above)
            pool_limit = self._client.connection_pool.max_connections
            self._connections = anyio.Semaphore(min(max_connections, pool_limit))
        self._closed = False  # set last: an instance that failed to build has nothing to close
        log.debug("redis backend %s, prefix %r", self.url, self.key_prefix)

    def _connect(self, url: str, **settings: float) -> Redis | RedisCluster:
        return client(url, self.url, **settings)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.url} prefix={self.key_prefix!r} {state}>"

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        """Check that the server answers (and accepts the credentials), then return self.

        Raises:
            StorageError: the server cannot be reached, or refused the credentials.
        """
        try:
            await self.ping()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def ping(self) -> None:
        """Round trip to the server.

        Raises:
            StorageError: the server cannot be reached, or refused the credentials.

        Cancellation: nothing to undo; the connection in use is dropped.
        """
        with self._in_flight():
            with self._translate(StorageError, "ping"):
                await self._ping()
            await self._look_at_memory()

    async def _ping(self) -> None:
        async with self._connection():
            await self._client.ping()

    async def _look_at_memory(self) -> None:
        """Record the server's ``maxmemory`` and ``used_memory``, then its ``evicted_keys``
        (errors are not counted: a user may lack the right to INFO)."""
        self._info_at = time.monotonic()
        replies = await self._info_or_none("memory")
        if replies is None:
            return
        extra = self._stats.extra
        limits = [int(cast(int, r.get("maxmemory", 0))) for r in replies]
        # NOTE: a primary with no limit (0) makes the cluster's none: summed, the others'
        # limits were reported as its budget
        extra["max_bytes"] = sum(limits) if all(limits) else 0
        extra["used_bytes"] = sum(int(cast(int, r.get("used_memory", 0))) for r in replies)
        self._memory = (extra["max_bytes"] or None, extra["used_bytes"])
        self._memory_seen = True
        if (stats := await self._info_or_none("stats")) is not None:
            evicted = [r.get("evicted_keys") for r in stats]
            # NOTE: a server that does not say is not known, not 0 evicted
            self._evicted_keys = None if None in evicted else sum(
                int(cast(int, n)) for n in evicted)

    async def _info_or_none(self, section: str) -> list[dict[str, object]] | None:
        """`_server_info` of `section`, or None if it failed (logged, not counted)."""
        try:
            return await self._server_info(section)
        except (RedisError, RedisClusterException, OSError) as exc:
            log.debug("redis INFO %s on %s failed: %r", section, self.url, exc)
            return None

    async def _first_look(self) -> None:
        """Look at the server's memory until a look succeeds (at most every 10 s): a cache
        enters no backend it builds from a URL, and one that only read reported no budget
        (writes look every 10 s). NOTE: not only once: a reader whose first look failed (a
        cluster node down as it started) reported none for good, the cluster healed."""
        if not self._memory_seen and time.monotonic() - self._info_at > _INFO_INTERVAL_S:
            await self._look_at_memory()  # NOTE: it raises nothing

    async def _server_info(self, section: str) -> list[dict[str, object]]:
        async with self._connection():
            return [await self._client.info(section)]

    async def aclose(self) -> None:
        """Close every connection once the calls in flight have ended (each ends within its
        timeouts); idempotent. Later calls raise `ClosedError`.

        Cancellation: the calls in flight are still waited for and the pool closed
        (shielded); then the cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # NOTE: trio: every call was refused, nothing connected (and
            return  # redis-py's own close needs asyncio)
        await finish_then_cancel(self._close_when_idle())
        log.debug("redis backend %s closed", self.url)

    async def _close_when_idle(self) -> None:
        # NOTE: the pool closed under a call in flight failed that call with redis-py's own
        # AttributeError (its writer gone mid-send), or the call's retry opened a connection
        # that nothing closed
        if self._calls:
            self._idle = anyio.Event()
            await self._idle.wait()
        await self._close_client()

    async def _close_client(self) -> None:
        await self._client.aclose()

    def __del__(self, _warn: object = warnings.warn) -> None:
        # Don't try to do more here: the event loop may already be gone.
        if not getattr(self, "_closed", True):
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)  # type: ignore[operator]

    def stats(self) -> BackendStats:
        """A copy of the counters, with the server's memory as last seen (on entering or at
        the first call, then at most every 10 s by a write), summed over a cluster's
        primaries: `capacity_bytes` (``maxmemory``; None: no limit, or INFO not allowed) and
        `used_bytes` (``used_memory``; None: not known), and `server_evicted_keys`
        (``evicted_keys``: server-wide). `evicted_pages` is not known (`counts_evictions`
        False): the server evicts on its own. `extra` has ``round_trips`` (pipelines and
        single commands sent), ``commands``, ``max_bytes`` (``maxmemory``, 0: no limit) and
        ``used_bytes``."""
        capacity, used = self._memory
        return replace(self._stats, extra=dict(self._stats.extra), capacity_bytes=capacity,
                       used_bytes=used, counts_evictions=False,
                       server_evicted_keys=self._evicted_keys)

    # ------------------------------------------------------------------ operations

    async def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present; stops at the first absent one
        (later pipelines are not sent). Presence is not verification: `get_into` checks.

        Raises:
            ConfigError: a key is not 16-128 lowercase hex characters.
            StorageReadError: the server cannot be reached or timed out.

        Cancellation: nothing to undo; the connection in use is dropped.
        """
        names = self._names(keys)
        self._stats.exists_calls += 1
        found = 0
        with self._in_flight(), self._translate(StorageReadError, "exists"):
            await self._first_look()
            for lo in range(0, len(names), self.max_batch):
                replies = await self._pipelined(names[lo:lo + self.max_batch],
                                                lambda pipe, name, _: pipe.exists(name))
                present = leading_true(replies)
                found += present
                if present < len(replies):
                    break
        return found

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's verified payload into its buffer; True where it was filled.

        An absent key is a miss (`stats().misses`). An object that fails `decode_page` is a
        miss too (`stats().corrupt`), another key's object (``RENAME``, ``COPY``) included:
        it is deleted, unless it was replaced meanwhile, and its buffer is left as it was.

        Raises:
            ConfigError: a bad key, or a buffer that is not `fmt.payload_bytes` writable bytes.
            StorageReadError: the server cannot be reached or timed out (no buffer was written).

        Cancellation: until every object is fetched and checked, no buffer has been written
        and none will be. The copy into the buffers comes last; once it has begun it runs to
        its end, then the cancellation propagates (no write lands after the call has ended).
        """
        names = self._names(keys)
        views = check_buffers(self.fmt, keys, buffers, to_fill=True)
        with self._in_flight(), self._translate(StorageReadError, "get"):
            await self._first_look()
            blobs: list[Blob] = []
            for lo, hi in self._page_ranges(len(names)):
                blobs += await self._mget(names[lo:hi])
            payloads = await self._off_loop(len(blobs), verify, self.fmt, keys, blobs)
            await self._remove_rejected(names, blobs, payloads)
        num_absent = blobs.count(None)
        filled = await self._off_loop(len(views), copy_payloads, payloads, views, blobs)
        self._count_reads(len(filled), num_absent, sum(filled))
        return filled

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store each buffer under its key (header + payload, one SET each; `ttl` if set).

        Returns True where the server stored the page; False where it refused that command
        (e.g. out of memory under ``maxmemory-policy noeviction``), counted in
        `stats().errors`.

        Raises:
            ConfigError: a bad key, or a buffer that is not `fmt.payload_bytes` bytes.
            StorageWriteError: the server cannot be reached or timed out; pages of earlier
                pipelines may be stored.

        Cancellation: every page is either stored whole or absent (a SET is atomic); which
        pages of the pipeline in flight were stored is unknown.
        """
        names = self._names(keys)
        views = check_buffers(self.fmt, keys, buffers)
        stored: list[bool] = []
        with self._in_flight(), self._translate(StorageWriteError, "set"):
            if time.monotonic() - self._info_at > _INFO_INTERVAL_S:
                await self._look_at_memory()  # NOTE: it raises nothing
            for lo, hi in self._page_ranges(len(names)):
                objects = await self._off_loop(hi - lo, encode_objects, self.fmt, keys[lo:hi],
                                               views[lo:hi])
                stored += await self._set_pipeline(names[lo:hi], objects)
        num_stored = sum(stored)
        self._stats.pages_written += num_stored
        self._stats.bytes_written += num_stored * self.fmt.payload_bytes
        self._stats.errors += len(stored) - num_stored
        return stored

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys`; return how many existed.

        Raises:
            ConfigError: a key is not 16-128 lowercase hex characters.
            StorageWriteError: the server cannot be reached or timed out.

        Cancellation: keys of the DEL in flight may or may not be removed.
        """
        names = self._names(keys)
        removed = 0
        with self._in_flight(), self._translate(StorageWriteError, "delete"):
            for lo in range(0, len(names), self.max_batch):
                self._count_round_trip(1)
                async with self._connection():
                    removed += await self._client.delete(*names[lo:lo + self.max_batch])
        self._stats.pages_deleted += removed
        return removed

    # ------------------------------------------------------------------ helpers

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[None]:
        """Hold one of the `max_connections` while the block sends; a cancellation redis-py
        swallowed meanwhile is raised as the block ends (see `raise_lost_cancel`)."""
        async with self._connections:
            before = cancel_requests()
            yield
        await raise_lost_cancel(before)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")
        self.check_loop()

    def check_loop(self) -> None:
        """Raise `ConfigError` unless an asyncio loop runs here: redis-py's client is
        asyncio-only. NOTE: under trio every call raised a bare ``RuntimeError: no running
        event loop``, and a cache over this store logged each L3 call as a bug and ran
        degraded for good (its breaker open), never saying why."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError(
                "storage: a Redis store needs an asyncio event loop (redis-py's client is "
                "asyncio-only); under trio use a file:// or memory:// store") from None

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Count a call in flight (`ClosedError` if closed): `aclose` waits for it."""
        self._check_open()
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
            if not self._calls and self._idle is not None:
                self._idle.set()

    def _names(self, keys: Sequence[str]) -> list[str]:
        self._check_open()
        check_keys(keys)
        prefix = self.key_prefix
        return [prefix + key for key in keys]

    def _page_ranges(self, n: int) -> Iterator[tuple[int, int]]:
        step = self._pages_per_pipeline
        for lo in range(0, n, step):
            yield lo, min(n, lo + step)

    @contextmanager
    def _translate(self, error: type[StorageError], what: str) -> Iterator[None]:
        """Raise `error` (naming the server, never its credentials) for a Redis failure."""
        try:
            yield
        except (RedisError, RedisClusterException, OSError) as exc:
            self._stats.errors += 1
            log.debug("redis %s on %s failed: %r", what, self.url, exc)
            raise error(f"redis {what} on {self.url} failed: {type(exc).__name__}: {exc}") \
                from exc

    async def _pipelined(self, names: list[str], add: Add, *,
                         raise_on_error: bool = True) -> list[object]:
        """One reply per name: `add(pipe, name, i)` queues each name's command, and the
        pipeline is sent in one round trip (a cluster overrides this: one per node)."""
        pipe = self._client.pipeline(transaction=False)
        for i, name in enumerate(names):
            add(pipe, name, i)
        return await self._execute(pipe, raise_on_error=raise_on_error)

    async def _execute(self, pipe: Pipeline | ClusterPipeline, *,
                       raise_on_error: bool = True) -> list[object]:
        self._count_round_trip(len(pipe))
        async with self._connection():
            replies: list[object] = await pipe.execute(raise_on_error=raise_on_error)
        return replies

    async def _mget(self, names: list[str]) -> list[Blob]:
        self._count_round_trip(len(names))
        # decode_responses is off: values come back as bytes (or None where absent).
        async with self._connection():
            return cast(list[Blob], await self._client.mget(names))

    async def _set_pipeline(self, names: list[str], objects: list[memoryview]) -> list[bool]:
        replies = await self._pipelined(
            names, lambda pipe, name, i: pipe.set(name, objects[i], px=self._ttl_ms),
            raise_on_error=False)
        return [reply is True for reply in replies]

    def _count_round_trip(self, commands: int) -> None:
        extra = self._stats.extra
        extra["round_trips"] = extra.get("round_trips", 0) + 1
        extra["commands"] = extra.get("commands", 0) + commands

    async def _off_loop(self, num_pages: int, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """`fn(*args)`, work on `num_pages` pages: on the loop up to `inline_bytes`, else on a
        worker thread, run to its end even if the caller is cancelled meanwhile (the
        cancellation propagates after)."""
        if num_pages * self.fmt.payload_bytes <= self.inline_bytes:
            return fn(*args)
        return await finish_then_cancel(anyio.to_thread.run_sync(fn, *args))

    async def _remove_rejected(self, names: list[str], blobs: list[Blob],
                               payloads: list[memoryview | None]) -> None:
        """Delete the objects that failed verification, each only if it is still the same
        object (a page rewritten since it was read is left alone).

        Cancellation: each object is deleted or not; none is half-deleted.
        """
        rejected = [(name, blob) for name, blob, payload in zip(names, blobs, payloads,
                                                                strict=True)
                    if blob is not None and payload is None]
        if not rejected:
            return
        # NOTE: not raising: the call's pages are read already, and a user whose ACL does
        # not allow EVAL would otherwise fail every batch that meets a rejected object
        digests = await self._off_loop(len(rejected), _sha1_hex, [b for _, b in rejected])
        replies = await self._pipelined(
            [name for name, _ in rejected],
            lambda pipe, name, i: pipe.eval(_DELETE_IF_UNCHANGED, 1, name, digests[i]),
            raise_on_error=False)
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        if failed:
            log.warning("redis %s: %d rejected objects not deleted: %r", self.url,
                        len(failed), failed[0])
        log.debug("redis %s: deleted %d rejected objects", self.url,
                  len(rejected) - len(failed))

    def _count_reads(self, num_pages: int, num_absent: int, num_filled: int) -> None:
        s = self._stats
        s.pages_read += num_filled
        s.bytes_read += num_filled * self.fmt.payload_bytes
        s.misses += num_absent
        s.corrupt += num_pages - num_filled - num_absent


def _sha1_hex(blobs: list[bytes]) -> list[str]:
    return [hashlib.sha1(blob, usedforsecurity=False).hexdigest() for blob in blobs]
