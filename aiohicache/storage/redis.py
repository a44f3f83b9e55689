"""Redis (or Valkey) as the L3 page store: `redis.asyncio` with pipelined batches.

One page is one Redis string, its 64-byte header then its payload (see `base.py`), written by
a single SET: a reader sees a whole object or none. The Redis key is ``<prefix><page key>``;
the default prefix names the namespace, so caches of different models never see each other's
pages. Payloads are bytes in and bytes out; nothing is ever pickled.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Self, TypeVar, TypeVarTuple, cast
from urllib.parse import urlsplit

import anyio.to_thread
import numpy as np
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.cluster import ClusterPipeline as _ClusterPipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import ClusterDownError, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._concurrency import finish_then_cancel
from ..errors import ClosedError, ConfigError
from ._common import check_buffers, check_keys
from .base import HEADER_SIZE, BackendStats, PageFormat, decode_page, encode_header
from .errors import StorageError, StorageReadError, StorageWriteError

__all__ = ("RedisBackend", "RedisClusterBackend")

log = logging.getLogger(__name__)

_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")
_NODE_ERRORS = (ConnectionError, TimeoutError, OSError, RedisConnectionError, RedisTimeoutError,
                ClusterDownError, TryAgainError)
"""Errors that mean a node (not a command) failed."""
_INFO_INTERVAL_S = 10.0
"""Seconds between looks at the server's memory (``INFO memory``), made by writes."""
Blob = bytes | None
_Add = Callable[[Any, str, int], object]
R = TypeVar("R")
Ts = TypeVarTuple("Ts")

# Compare-and-delete: a rejected object is removed only if no writer has replaced it since.
_DELETE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
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
    """

    def __init__(self, url: str, fmt: PageFormat, *, key_prefix: str | None = None,
                 max_batch: int = 128, max_pipeline_bytes: int = 4 << 20,
                 ttl: float | None = None, socket_timeout: float = 5.0,
                 connect_timeout: float = 2.0, max_connections: int = 16, retries: int = 1,
                 inline_bytes: int = 1 << 20) -> None:
        """
        Args:
            url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS).
            fmt: the page format every object is written in and checked against.
            key_prefix: prepended to every key; default ``ahkv:<namespace id hex>:``.
            max_batch: most commands (pages) in one pipeline.
            max_pipeline_bytes: pages per pipeline are also capped so a pipeline holds
                about this many bytes (at least one page).
            ttl: seconds each written page lives (None: until deleted or evicted by Redis).
            socket_timeout: seconds to wait for one reply (or to send one pipeline).
            connect_timeout: seconds to open a connection.
            max_connections: connections at most; further calls wait for a free one.
            retries: times a command is retried after a connection error or timeout.
            inline_bytes: batches up to this size are verified and copied on the loop.

        Raises:
            ConfigError: a bad URL or setting (nothing is connected yet).
        """
        _check_settings(max_batch=max_batch, max_pipeline_bytes=max_pipeline_bytes,
                        max_connections=max_connections, retries=retries,
                        inline_bytes=inline_bytes)
        _check_seconds(ttl=ttl, socket_timeout=socket_timeout, connect_timeout=connect_timeout)
        if key_prefix is not None and not isinstance(key_prefix, str):
            raise ConfigError(f"key_prefix: must be a str or None, got {key_prefix!r}")
        self.fmt = fmt
        self.url = _redact(url)
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
        self._client = self._connect(url, socket_timeout=socket_timeout,
                                     connect_timeout=connect_timeout,
                                     max_connections=max_connections, retries=retries)
        self._closed = False  # set last: an instance that failed to build has nothing to close
        log.debug("redis backend %s, prefix %r", self.url, self.key_prefix)

    def _connect(self, url: str, **settings: float) -> Redis | RedisCluster:
        return _client(url, self.url, **settings)  # type: ignore[arg-type]

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
        self._check_open()
        with self._translate(StorageError, "ping"):
            await self._client.ping()
        await self._look_at_memory()

    async def _look_at_memory(self) -> None:
        """Record the server's ``maxmemory`` and ``used_memory`` (errors are not counted:
        a user may lack the right to INFO)."""
        self._info_at = time.monotonic()
        try:
            replies = await self._memory_info()
        except (RedisError, OSError) as exc:
            log.debug("redis INFO memory on %s failed: %r", self.url, exc)
            return
        extra = self._stats.extra
        extra["max_bytes"] = sum(int(cast(int, r.get("maxmemory", 0))) for r in replies)
        extra["used_bytes"] = sum(int(cast(int, r.get("used_memory", 0))) for r in replies)

    async def _memory_info(self) -> list[dict[str, object]]:
        return [await self._client.info("memory")]

    async def aclose(self) -> None:
        """Close every connection; idempotent. Later calls raise `ClosedError`.

        Cancellation: the pool is still closed (shielded); then the cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        await finish_then_cancel(self._client.aclose())
        log.debug("redis backend %s closed", self.url)

    def __del__(self, _warn: object = warnings.warn) -> None:
        # Don't try to do more here: the event loop may already be gone.
        if not getattr(self, "_closed", True):
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)  # type: ignore[operator]

    def stats(self) -> BackendStats:
        """A copy of the counters; `extra` has ``round_trips`` (pipelines and single commands
        sent), ``commands``, and the server's memory as last seen (on entering, then at most
        every 10 s by a write): ``max_bytes`` (``maxmemory``, 0: no limit) and ``used_bytes``
        (``used_memory``), summed over a cluster's primaries."""
        s = self._stats
        return BackendStats(s.exists_calls, s.pages_read, s.pages_written, s.pages_deleted,
                            s.bytes_read, s.bytes_written, s.misses, s.corrupt, s.errors,
                            s.evicted_pages, dict(s.extra))

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
        with self._translate(StorageReadError, "exists"):
            for lo in range(0, len(names), self.max_batch):
                replies = await self._pipelined(names[lo:lo + self.max_batch],
                                                lambda pipe, name, _: pipe.exists(name))
                present = _leading_true(replies)
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
        views = check_buffers(self.fmt, keys, buffers)
        _check_writable(views)
        with self._translate(StorageReadError, "get"):
            blobs: list[Blob] = []
            for lo, hi in self._page_ranges(len(names)):
                blobs += await self._mget(names[lo:hi])
            payloads = await self._off_loop(len(blobs), _verify, self.fmt, keys, blobs)
            await self._remove_rejected(names, blobs, payloads)
        filled = await self._off_loop(len(views), _copy_payloads, payloads, views)
        self._count_reads(blobs, filled)
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
        if time.monotonic() - self._info_at > _INFO_INTERVAL_S:
            await self._look_at_memory()
        with self._translate(StorageWriteError, "set"):
            for lo, hi in self._page_ranges(len(names)):
                objects = await self._off_loop(hi - lo, _encode_objects, self.fmt, keys[lo:hi],
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
        with self._translate(StorageWriteError, "delete"):
            for lo in range(0, len(names), self.max_batch):
                self._count_round_trip(1)
                removed += await self._client.delete(*names[lo:lo + self.max_batch])
        self._stats.pages_deleted += removed
        return removed

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")

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
        except (RedisError, OSError) as exc:
            self._stats.errors += 1
            log.debug("redis %s on %s failed: %r", what, self.url, exc)
            raise error(f"redis {what} on {self.url} failed: {type(exc).__name__}: {exc}") \
                from exc

    async def _pipelined(self, names: list[str], add: _Add, *,
                         raise_on_error: bool = True) -> list[object]:
        """One reply per name: `add(pipe, name, i)` queues each name's command, and the
        pipeline is sent in one round trip (a cluster overrides this: one per node)."""
        pipe = self._client.pipeline(transaction=False)
        for i, name in enumerate(names):
            add(pipe, name, i)
        return await self._execute(pipe, raise_on_error=raise_on_error)

    async def _execute(self, pipe: Pipeline | _ClusterPipeline, *,
                       raise_on_error: bool = True) -> list[object]:
        self._count_round_trip(len(pipe))
        replies: list[object] = await pipe.execute(raise_on_error=raise_on_error)
        return replies

    async def _mget(self, names: list[str]) -> list[Blob]:
        self._count_round_trip(len(names))
        # decode_responses is off: values come back as bytes (or None where absent).
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
        await self._pipelined([name for name, _ in rejected], lambda pipe, name, i: pipe.eval(
            _DELETE_IF_UNCHANGED, 1, name, rejected[i][1]))
        log.debug("redis %s: deleted %d rejected objects", self.url, len(rejected))

    def _count_reads(self, blobs: list[Blob], filled: list[bool]) -> None:
        s = self._stats
        num_filled = sum(filled)
        num_absent = sum(blob is None for blob in blobs)
        s.pages_read += num_filled
        s.bytes_read += num_filled * self.fmt.payload_bytes
        s.misses += num_absent
        s.corrupt += len(blobs) - num_filled - num_absent


class RedisClusterBackend(RedisBackend):
    """A `StorageBackend` on a Redis (or Valkey) Cluster:
    ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://`` for
    TLS; ``valkey+cluster://`` is the same). The hosts are seeds: the client learns the
    whole cluster from any of them.

        async with RedisClusterBackend("redis+cluster://10.0.0.5:7000,10.0.0.6:7000", fmt) as l3:
            await l3.set_from(keys, pages)

    Each page is one key, so it lives in its key's hash slot. A batch is split by the node
    that owns each slot and the per-node pipelines run concurrently; ``MOVED`` and ``ASK``
    redirections (slots migrating) are followed by redis-py. A node that fails (killed,
    partitioned, not yet replaced by its replica) costs only its share of the batch: those
    pages are misses (reads, `exists`) or not stored (writes), each lost node counted in
    `stats().errors` and ``extra["node_failures"]``, while the other nodes' pages are
    served; only a batch every node of which failed raises `StorageError` (so the cache's
    breaker opens when the whole cluster is gone). The client re-reads the topology after
    such errors, so once a replica has taken over, its slots are served again.

    Same options as `RedisBackend`; `max_connections` is per node.
    """

    def _connect(self, url: str, **settings: float) -> Redis | RedisCluster:
        return _cluster_client(url, self.url, **settings)  # type: ignore[arg-type]

    _stale_at: float | None = None
    """When a node last failed (the slot map may be stale: re-read it before the next call)."""

    async def _pipelined(self, names: list[str], add: _Add, *,
                         raise_on_error: bool = True) -> list[object]:
        client = cast(RedisCluster, self._client)
        groups: dict[str, list[int]] = {}
        await client.initialize()  # learns the slot map once
        await self._refresh_slot_map(client)
        for i, name in enumerate(names):
            node = client.get_node_from_key(name)
            groups.setdefault(node.name if node else "", []).append(i)
        replies: list[object] = [None] * len(names)
        results = await asyncio.gather(*(self._node_pipeline(names, idx, add)
                                         for idx in groups.values()), return_exceptions=True)
        failures: list[BaseException] = []
        for idx, result in zip(groups.values(), results, strict=True):
            if not isinstance(result, BaseException):
                lost = [r for r in result if isinstance(r, _NODE_ERRORS)]
                if lost and len(lost) == len(result):  # every command: the node is gone
                    result = lost[0]
            if isinstance(result, BaseException):
                if not isinstance(result, RedisError | OSError):
                    raise result
                failures.append(result)
                result = [result] * len(idx)
            for i, reply in zip(idx, result, strict=True):
                if raise_on_error and isinstance(reply, Exception) and reply not in failures:
                    raise reply
                replies[i] = reply
        self._count_node_failures(failures, len(groups))
        return replies

    async def _node_pipeline(self, names: list[str], idx: list[int], add: _Add) -> list[object]:
        pipe = cast(RedisCluster, self._client).pipeline()
        for i in idx:
            add(pipe, names[i], i)
        return await self._execute(pipe, raise_on_error=False)

    async def _refresh_slot_map(self, client: RedisCluster) -> None:
        """After a node failed, re-read the slot map (at most every 0.25 s): a replica may
        have taken over its slots.

        NOTE: redis-py would refresh it by closing every connection of the client and
        retrying the whole pipeline; with one pipeline per node in flight at once, that
        would fail the healthy nodes' pipelines too, so the client retries nothing
        (``retries`` applies to single commands) and the map is refreshed here instead.
        """
        if self._stale_at is None or time.monotonic() - self._stale_at < 0.25:
            return
        self._stale_at = None
        try:
            await client.nodes_manager.initialize()
        except (RedisError, OSError) as exc:
            self._stale_at = time.monotonic()
            log.debug("redis cluster %s: re-reading the slot map failed: %r", self.url, exc)

    def _count_node_failures(self, failures: list[BaseException], num_groups: int) -> None:
        if not failures:
            return
        self._stale_at = time.monotonic()
        log.debug("redis cluster %s: %d of %d nodes failed: %r", self.url, len(failures),
                  num_groups, failures[0])
        if len(failures) == num_groups:
            raise failures[0]  # nothing got through: the caller's error (and breaker)
        self._stats.errors += len(failures)
        extra = self._stats.extra
        extra["node_failures"] = extra.get("node_failures", 0) + len(failures)

    async def _mget(self, names: list[str]) -> list[Blob]:
        # a key per slot: MGET cannot span nodes, so GETs pipelined per node
        replies = await self._pipelined(names, lambda pipe, name, _: pipe.get(name),
                                        raise_on_error=False)
        return [reply if isinstance(reply, bytes) else None for reply in replies]

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys` (a DEL each, pipelined per node); return how many existed.

        Raises:
            ConfigError: a key is not 16-128 lowercase hex characters.
            StorageWriteError: no node could be reached.

        Cancellation: keys of the pipelines in flight may or may not be removed.
        """
        names = self._names(keys)
        with self._translate(StorageWriteError, "delete"):
            replies = await self._pipelined(names, lambda pipe, name, _: pipe.delete(name),
                                            raise_on_error=False)
        removed = sum(reply for reply in replies if isinstance(reply, int))
        self._stats.pages_deleted += removed
        return removed

    async def _memory_info(self) -> list[dict[str, object]]:
        client = cast(RedisCluster, self._client)
        replies = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return list(cast(dict[str, dict[str, object]], replies).values())


# ---------------------------------------------------------------------- page work (any thread)


def _verify(fmt: PageFormat, keys: Sequence[str],
            blobs: list[Blob]) -> list[memoryview | None]:
    """The checked payload of each key's blob, or None (absent or rejected)."""
    return [decode_page(fmt, key, blob) for key, blob in zip(keys, blobs, strict=True)]


def _copy_payloads(payloads: list[memoryview | None], views: list[memoryview]) -> list[bool]:
    """Copy each payload into its view; True where there was one."""
    for payload, view in zip(payloads, views, strict=True):
        if payload is not None:
            np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(payload, np.uint8))
    return [payload is not None for payload in payloads]


def _encode_objects(fmt: PageFormat, keys: Sequence[str],
                    views: list[memoryview]) -> list[memoryview]:
    """Header + payload of each key's page, as one contiguous object each."""
    objects = []
    for key, view in zip(keys, views, strict=True):
        obj = np.empty(HEADER_SIZE + fmt.payload_bytes, np.uint8)
        obj[:HEADER_SIZE] = np.frombuffer(encode_header(fmt, key, view), np.uint8)
        np.copyto(obj[HEADER_SIZE:], np.frombuffer(view, np.uint8))
        objects.append(obj.data)
    return objects


def _check_writable(views: list[memoryview]) -> None:
    for i, view in enumerate(views):
        if view.readonly:
            raise ConfigError(f"buffers[{i}]: is read-only; get_into needs writable buffers")


def _leading_true(replies: list[object]) -> int:
    for i, reply in enumerate(replies):
        if not isinstance(reply, int) or not reply:  # an error (a lost node) is absent
            return i
    return len(replies)


# ---------------------------------------------------------------------- connection set-up


def _client(url: str, safe_url: str, *, socket_timeout: float, connect_timeout: float,
            max_connections: int, retries: int) -> Redis:
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ConfigError(f"url {safe_url!r}: the scheme must be one of {_SCHEMES}")
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():  # redis-py would ignore it
        raise ConfigError(f"url {safe_url!r}: the path must be a database number")
    try:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None,
            socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), retries))
    except ValueError as exc:
        raise ConfigError(f"url {safe_url!r}: {exc}") from None
    return Redis.from_pool(pool)


def _cluster_client(url: str, safe_url: str, *, socket_timeout: float,
                    connect_timeout: float, max_connections: int,
                    retries: int) -> RedisCluster:
    parts = urlsplit(url)
    if parts.scheme not in _CLUSTER_SCHEMES:
        raise ConfigError(f"url {safe_url!r}: the scheme must be one of {_CLUSTER_SCHEMES}")
    auth, _, hosts = parts.netloc.rpartition("@")
    tls = parts.scheme in ("rediss+cluster", "valkeys+cluster")
    try:
        seeds = [urlsplit(f"redis://{seed.strip()}") for seed in hosts.split(",")]
        nodes = [ClusterNode(seed.hostname or "", seed.port or 6379) for seed in seeds]
        # the query and credentials as redis-py reads them for one server
        first = f"redis://{auth + '@' if auth else ''}{hosts.split(',')[0]}"
        query = f"?{parts.query}" if parts.query else ""
        options: dict[str, Any] = parse_url(first + query)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"url {safe_url!r}: {exc}") from None
    for name in ("host", "port", "db", "connection_class"):
        options.pop(name, None)
    # NOTE: no retries in the client (see RedisClusterBackend._refresh_slot_map)
    return RedisCluster(startup_nodes=nodes, ssl=tls, require_full_coverage=False,
                        socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                        max_connections=max_connections, retry=Retry(NoBackoff(), 0),
                        **options)


def _redact(url: str) -> str:
    """`url` without user, password and query (``redis://***@host:port/db``)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme in _CLUSTER_SCHEMES:
        netloc = rest.split("/", 1)[0].split("?", 1)[0]
        auth = "***@" if "@" in netloc else ""
        return f"{scheme}://{auth}{netloc.rpartition('@')[2]}"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<unparsable url>"
    auth = "***@" if "@" in parts.netloc else ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{auth}{host}{port}{parts.path}"


def _check_settings(**values: int) -> None:
    for name, value in values.items():
        least = 0 if name == "retries" or name == "inline_bytes" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")


def _check_seconds(**values: float | None) -> None:
    for name, value in values.items():
        if value is None and name == "ttl":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}: must be a finite number of seconds > 0, got {value!r}")
