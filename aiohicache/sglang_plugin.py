"""An SGLang HiCache storage backend over aiohicache's stores (file, Redis): checksummed,
key-bound pages, a miss rather than wrong KV.

SGLang loads it as its ``dynamic`` backend::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "aiohicache",
            "module_path": "aiohicache.sglang_plugin", "class_name": "AiohicacheStorage",
            "interface_v1": 1, "storage_url": "file:///var/cache/aiohicache"}'

SGLang calls the backend from its prefetch and backup threads; the stores are asyncio. One
event loop runs on a thread of this backend's own, and every call is handed to it
(``run_coroutine_threadsafe``) and waited for by the calling thread, so SGLang's threads block
as they expect while the loop serves them all concurrently.

Each SGLang page is one store object of the host pool's flat page bytes, under a key derived
from SGLang's page hash, the model, the TP shard (MLA: one copy for all ranks) and, where they
are split, the pipeline stage and attention-CP rank, and the page format (dtype, shape,
layout, page size). Its header binds the key, the model and the page layout, and a checksum
covers the payload (`aiohicache.storage.base`): a damaged, moved or foreign object is a miss.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ._validate import check_int, check_number
from .errors import ConfigError
from .storage import BackendStats, Breaker, PageFormat, StorageBackend, backend_from_url
from .storage.factory import shown_url

try:  # subclass SGLang's base class where SGLang is installed: its factory checks for it
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
        HiCacheStorage as _Base,
    )
except ImportError:  # not installed: the same protocol, duck-typed
    _Base = object

__all__ = ("AiohicacheStorage", "StorageStats")

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_URL = "file:///tmp/aiohicache-sglang"
_CLEAR_MEMORY = 1 << 20


@dataclass
class StorageStats:
    """What `get_stats` returns: SGLang's ``StorageMetrics`` fields (pages and GB/s of each
    prefetch and backup batch since the last call, kept only with ``enable_storage_metrics``),
    plus the store's counters."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    backend: BackendStats | None = None


class _LoopThread:
    """An event loop on a daemon thread; `run` executes a coroutine there and blocks the
    calling thread for its result (at most `timeout` seconds: then it is cancelled).

    NOTE: plain asyncio, not anyio, on purpose: SGLang's world is threads, not an event
    loop, so this is the one place the package owns a loop's lifetime from the outside (made
    here, run forever on its own thread, stopped from another); the stores it serves are
    asyncio-only (redis-py's asyncio client), so there is no backend to choose.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._calls: set[concurrent.futures.Future[Any]] = set()
        """Calls other threads wait on: `stop` cancels them (they would wait out `timeout`)."""
        self._stopped = False

    def run(self, make: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        """Raises `concurrent.futures.CancelledError` when `stop` came first or meanwhile."""
        async def call() -> T:
            return await make()

        with self._lock:
            if self._stopped:
                raise concurrent.futures.CancelledError("the loop thread has stopped")
            future = asyncio.run_coroutine_threadsafe(call(), self.loop)
            self._calls.add(future)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise
        finally:
            with self._lock:
                self._calls.discard(future)

    def stop(self) -> None:
        """Cancel the calls in flight, stop the loop and close it once its thread ended
        (idempotent)."""
        with self._lock:
            self._stopped = True
            calls, self._calls = self._calls, set()
        for future in calls:
            future.cancel()  # wakes its waiter now; the task is cancelled on the loop
        if self.loop.is_closed():
            return
        # NOTE: the cancelled tasks must run to their end on the loop before it stops: a loop
        # stopped at once left them pending, their `finally` blocks unrun ("Task was
        # destroyed but it is pending!" at exit)
        settled = asyncio.run_coroutine_threadsafe(_settle(), self.loop)
        with contextlib.suppress(Exception):
            settled.result(_SETTLE_S + 1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


_SETTLE_S = 5.0
"""How long `_LoopThread.stop` waits for the cancelled calls to finish their clean-up."""


async def _settle() -> None:
    """Cancel every other task on this loop and wait (at most `_SETTLE_S`) for them to end."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        if not task.cancelling():  # a second cancel would cut its clean-up short
            task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=_SETTLE_S)


def _model_namespace(storage_config: Any, extra: dict[str, Any]) -> str:
    """What keys bind for the model: ``extra_config["namespace"]``, else the model name."""
    name = str(extra.get("namespace") or getattr(storage_config, "model_name", None) or "")
    if not name:
        # NOTE: SGLang's page hashes cover tokens only: two models with the same page format
        # over one store would read each other's KV (headers bind the format, not the model).
        log.warning("aiohicache storage: SGLang passed no model_name and extra_config has no "
                    "'namespace': pages are shared with every other unnamed deployment of the "
                    "same KV format on this store; set one of them")
    return name


class AiohicacheStorage(_Base):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over an aiohicache store.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; read: ``tp_rank``, ``tp_size``,
            ``pp_rank``, ``pp_size``, ``attn_cp_rank``, ``attn_cp_size``, ``is_mla_model``,
            ``model_name``, ``enable_storage_metrics`` and ``extra_config`` keys ``storage_url``
            (default ``file:///tmp/aiohicache-sglang``; ``redis://host:port/db`` too),
            ``storage_options`` (keyword arguments of the store, e.g. ``capacity_bytes``),
            ``namespace`` (what keys bind instead of ``model_name``),
            ``timeout_s`` (per call, default 30), ``failures_to_open`` and ``cooldown_s``
            (a store that failed that many calls in a row is skipped for that long, each
            call a miss at once, then probed; default 3 and 10) and ``clear_memory`` (how
            many of the keys this process stored `clear` remembers, the most recent; default
            1,048,576).
        kwargs: what SGLang's factory passes beside the config (unused).

    Every batch call returns a list (never None: SGLang's prefetch thread would stop for
    good); a failing store is a miss (False) and is logged (once a minute while it fails).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.url = str(extra.get("storage_url", DEFAULT_URL))
        self._shown_url = shown_url(self.url)
        """`url` as logged: without user, password or key passphrase."""
        self.options = dict(extra.get("storage_options") or {})
        self.timeout_s = check_number("timeout_s", extra.get("timeout_s", 30.0), low=0,
                                      low_open=True)
        self.clear_memory = check_int("clear_memory", extra.get("clear_memory", _CLEAR_MEMORY),
                                      low=0)
        # NOTE: a store that hangs (a stopped Redis, a dead NFS server) cost every call of
        # SGLang's prefetch and backup threads `timeout_s`, for as long as it hung
        self._breaker = Breaker(failures_to_open=extra.get("failures_to_open", 3),
                                cooldown_s=extra.get("cooldown_s", 10.0))
        self._breaker_lock = threading.Lock()  # SGLang's threads call at once
        shard = _shard(storage_config)
        self.namespace = f"sglang|{_model_namespace(storage_config, extra)}|{shard}"
        self._key_prefix = self.namespace.encode() + b"|"
        """What a store key binds besides SGLang's page hash: the namespace, and (once the
        host pool is registered) the page format."""
        self.mem_pool_host: Any = None
        self._page_dtype = torch.uint8
        self._backend: StorageBackend | None = None
        self._stored: OrderedDict[str, None] = OrderedDict()
        """The keys this process stored, the latest `clear_memory` (for `clear`). NOTE: a set
        of every key grew for the life of the server (about 140 bytes a page stored)."""
        self._stats = StorageStats()
        # NOTE: SGLang drains `get_stats` only with storage metrics on; without them a record
        # of every batch would grow for the life of the server
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._lock = threading.Lock()
        self._closing = threading.Lock()
        self._failures = _FailureLog()
        self._loop = _LoopThread(f"aiohicache-sglang-{shard}")

    # ---------------------------------------------------------------- setup and teardown

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host pool: its flat page is the unit stored; the store opens here.

        Raises:
            ConfigError: a host pool is registered already (the first store was left open,
                and batches under way read with one page format and wrote with another).
        """
        if self._backend is not None:
            raise ConfigError("register_mem_pool_host: a host pool is registered already; "
                              "one plug-in instance serves one pool")
        self.mem_pool_host = mem_pool_host
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_dtype = page.dtype  # NOTE: asked once: each call makes a page
        layout = getattr(mem_pool_host, "layout", "?")
        spec = f"sglang|{page.dtype}|{tuple(page.shape)}|{layout}"
        fmt = PageFormat.make(
            namespace=self.namespace, page_size=int(mem_pool_host.page_size),
            spec_fingerprint=spec, payload_bytes=page.numel() * page.element_size())
        # NOTE: the format is in the key, not only in the header: a deployment of the same
        # model with another layout or KV dtype over this store counted our pages as present
        # (then failed to read them) and overwrote them with its own.
        self._key_prefix = (f"{self.namespace}|{spec}|page={int(mem_pool_host.page_size)}|"
                            .encode())

        async def build() -> StorageBackend:  # on the loop: a store may bind to it
            return backend_from_url(self.url, fmt, **self.options)

        self._backend = self._loop.run(build, self.timeout_s)
        log.info("aiohicache storage for SGLang: %s, %d-byte pages", self._shown_url,
                 fmt.payload_bytes)

    def close(self) -> None:
        """Close the store and stop the loop thread (SGLang calls it on detach); idempotent,
        and a second thread closing meanwhile returns once the first is done."""
        # NOTE: two at once: the second stopped the loop under the first's close of the
        # store (cancelled, half done), then raised from the stopped loop
        with self._closing:
            backend, self._backend = self._backend, None
            if backend is not None:
                try:
                    self._loop.run(backend.aclose, self.timeout_s)
                except Exception:
                    log.exception("aiohicache storage: closing %s failed", self._shown_url)
            self._loop.stop()

    # ---------------------------------------------------------------- zero-copy batch API

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored (0 if the store fails).

        Raises:
            ConfigError: a key is not a str.
        """
        if not keys:
            return 0
        store_keys = self._keys(keys)
        return int(self._call(self._require(), "exists", lambda b: b.exists(store_keys), 0))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Read each page into the host pool at ``host_indices[i * page_size]``.

        Raises:
            ConfigError: a key is not a str, or `host_indices` do not reach the last page
                (nothing is read).
        """
        start = time.perf_counter()
        store_keys = self._keys(keys)
        backend = self._require()
        pool = self.mem_pool_host
        _check_indices(host_indices, len(keys), pool.page_size)
        staging = self._staging(backend, len(keys))
        ok = self._call(backend, "get", lambda b: b.get_into(store_keys, _views(staging)),
                        [False] * len(keys))
        for i, filled in enumerate(ok):
            if filled:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]),
                                             staging[i].view(self._page_dtype))
        self._record("prefetch", ok, start, backend)
        return list(ok)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices[i * page_size]`` under `keys`.

        Raises:
            ConfigError: as `batch_get_v1` (nothing is stored).
        """
        start = time.perf_counter()
        store_keys = self._keys(keys)
        pool = self.mem_pool_host
        backend = self._require()
        _check_indices(host_indices, len(keys), pool.page_size)
        staging = self._staging(backend, len(keys))
        for i in range(len(keys)):
            page = pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True)
            staging[i].copy_(page.contiguous().view(torch.uint8))
        ok = self._call(backend, "set", lambda b: b.set_from(store_keys, _views(staging)),
                        [False] * len(keys))
        self._remember(store_keys, ok)
        self._record("backup", ok, start, backend)
        return list(ok)

    # ---------------------------------------------------------------- per-key API

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """The flat page stored under `key`, read into `target_location` if given (a flat
        page tensor), else into a new one; None if absent or invalid."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each key's page, as `get` reads it.

        Raises:
            ConfigError: a key is not a str; a target is not one page of the pool's dtype,
                or shares memory with another (nothing is read).
        """
        targets = list(target_locations or [None] * len(keys))
        if len(targets) != len(keys):
            raise ConfigError(f"target_locations: {len(targets)} for {len(keys)} keys")
        store_keys = self._keys(keys)
        backend = self._require()
        staging = self._staging(backend, len(keys))
        _check_targets(targets, staging.shape[1], self._page_dtype)
        ok = self._call(backend, "get", lambda b: b.get_into(store_keys, _views(staging)),
                        [False] * len(keys))
        out: list[torch.Tensor | None] = []
        for i, filled in enumerate(ok):
            if not filled:
                out.append(None)
                continue
            page = staging[i].view(self._page_dtype)
            target = targets[i]
            out.append(page.clone() if target is None else target.copy_(page.view_as(target)))
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page tensor of `values` under its key; True if all were stored.

        Raises:
            ConfigError: a key is not a str, or a value is not one page of the pool's dtype
                (nothing is stored).
        """
        if values is None or len(values) != len(keys):
            return False
        store_keys = self._keys(keys)
        backend = self._require()
        staging = self._staging(backend, len(keys))
        for i, value in enumerate(values):
            raw = value.contiguous().view(torch.uint8).reshape(-1)
            # NOTE: bytes of another dtype (float16 for a bfloat16 pool) were stored as they
            # are, and read back as the pool's dtype: noise served as KV; copy_ would
            # broadcast a 1-byte value
            if raw.numel() != staging.shape[1] or value.dtype != self._page_dtype:
                raise ConfigError(f"values[{i}]: {raw.numel()} bytes of {value.dtype}, a page "
                                  f"holds {staging.shape[1]} bytes of {self._page_dtype}")
            staging[i].copy_(raw)
        ok = self._call(backend, "set", lambda b: b.set_from(store_keys, _views(staging)),
                        [False] * len(keys))
        self._remember(store_keys, ok)
        return all(ok)

    # ---------------------------------------------------------------- admin

    def clear(self) -> None:
        """Delete the pages this process stored, the latest `clear_memory` of them (the store
        may hold others' pages too; older pages leave it by its own budget)."""
        with self._lock:
            keys, self._stored = list(self._stored), OrderedDict()
        if keys:
            self._call(self._require(), "delete", lambda b: b.delete(keys), 0)

    def get_stats(self) -> StorageStats:
        """Batches since the last call (then forgotten) and the store's counters."""
        with self._lock:
            stats, self._stats = self._stats, StorageStats()
        if self._backend is not None:
            stats.backend = self._backend.stats()
        return stats

    # ---------------------------------------------------------------- internals

    def _keys(self, keys: Sequence[str]) -> list[str]:
        """Store keys: SGLang's page hash bound to this model, shard and page format, as 64
        hex digits.

        NOTE: made on the calling thread, before any I/O: made on the loop, a key that is
        not a str was a miss with a traceback logged (for ever), or an AttributeError
        after the pages were stored.
        """
        prefix = self._key_prefix
        try:
            return [hashlib.blake2b(prefix + k.encode(), digest_size=32).hexdigest()
                    for k in keys]
        except (AttributeError, UnicodeEncodeError):  # not a str; a lone surrogate
            i, bad = next((i, k) for i, k in enumerate(keys) if not _is_text(k))
            raise ConfigError(f"keys[{i}]: must be a str of Unicode text, got {bad!r:.80}") \
                from None

    @staticmethod
    def _staging(backend: StorageBackend, num_pages: int) -> torch.Tensor:
        return torch.empty((num_pages, backend.fmt.payload_bytes), dtype=torch.uint8)

    def _require(self) -> StorageBackend:
        if self._backend is None:
            raise RuntimeError("aiohicache storage: register_mem_pool_host() first (or closed)")
        return self._backend

    def _call(self, backend: StorageBackend, what: str,
              op: Callable[[StorageBackend], Awaitable[T]], failed: T) -> T:
        """Run ``op(backend)`` on the loop thread; on any error log it and return `failed`.

        NOTE: `backend` is the one the batch began with (`_require`): `close` may run on
        another thread meanwhile, and the batch must then end as a miss (the loop refuses
        it), not raise because the store is gone.
        """
        with self._breaker_lock:
            allowed = self._breaker.allow()
        if not allowed:
            self._failures.failed(what, self._shown_url, _SKIPPED)
            return failed
        try:
            got = self._loop.run(lambda: op(backend), self.timeout_s)
        except Exception as exc:
            with self._breaker_lock:
                self._breaker.record_failure()
            self._failures.failed(what, self._shown_url, exc)
            return failed
        with self._breaker_lock:
            self._breaker.record_success()
        self._failures.succeeded(self._shown_url)
        return got

    def _remember(self, store_keys: Sequence[str], ok: Sequence[bool]) -> None:
        with self._lock:
            stored = self._stored
            for key, good in zip(store_keys, ok, strict=True):
                if good:
                    stored[key] = None
                    stored.move_to_end(key)
            while len(stored) > self.clear_memory:
                stored.popitem(last=False)

    def _record(self, kind: str, ok: Sequence[bool], start: float,
                backend: StorageBackend) -> None:
        """Note a prefetch or backup batch: pages done and GB/s (with storage metrics)."""
        if not self._metrics:
            return
        done = sum(ok)
        seconds = max(time.perf_counter() - start, 1e-9)
        gbps = done * backend.fmt.payload_bytes / seconds / 1e9
        with self._lock:
            getattr(self._stats, f"{kind}_pgs").append(done)
            getattr(self._stats, f"{kind}_bandwidth").append(gbps)


def _shard(storage_config: Any) -> str:
    """Which part of the model's KV this rank's pages hold: its TP shard (MLA: every rank
    holds all of it), and its pipeline stage (other layers) and attention-CP rank (another
    slice of each page) where those are split. Written only when split, as SGLang's own file
    backend does, so single-stage pages keep their keys."""
    mla = bool(getattr(storage_config, "is_mla_model", False))
    shard = "mla" if mla else f"tp={storage_config.tp_rank}/{storage_config.tp_size}"
    for part in ("pp", "attn_cp"):
        size = int(getattr(storage_config, f"{part}_size", 1) or 1)
        if size > 1:
            shard += f"|{part}={getattr(storage_config, f'{part}_rank')}/{size}"
    return shard


def _views(staging: torch.Tensor) -> list[memoryview]:
    return [memoryview(row.numpy()) for row in staging]


def _check_targets(targets: Sequence[Any], page_bytes: int, dtype: torch.dtype) -> None:
    """Refuse, before reading, a target that cannot hold exactly one page as it is stored
    (another dtype of the same size would be filled with converted values)."""
    for i, target in enumerate(targets):
        if target is None:
            continue
        size = target.numel() * target.element_size()
        if size != page_bytes or target.dtype != dtype:
            raise ConfigError(f"target_locations[{i}]: {size} bytes of {target.dtype}, a page "
                              f"holds {page_bytes} bytes of {dtype}")
    # NOTE: two keys read into one target were both reported read, the first holding the
    # second's page: a wrong-KV hit
    if (pair := _first_overlap(targets)) is not None:
        raise ConfigError(f"target_locations: {pair[0]} and {pair[1]} overlap (each key "
                          f"needs a target of its own)")


def _is_text(key: object) -> bool:
    """`key` is a str that encodes as UTF-8 (no lone surrogate)."""
    if not isinstance(key, str):
        return False
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_indices(host_indices: torch.Tensor, num_pages: int, page_size: int) -> None:
    """Refuse, before any page moves, host indices that do not reach the last key's page
    (torch's IndexError came after the pages before it were written into the pool)."""
    if len(host_indices) < num_pages * page_size:
        raise ConfigError(f"host_indices: {len(host_indices)} for {num_pages} pages of "
                          f"{page_size} tokens")


def _first_overlap(targets: Sequence[Any]) -> tuple[int, int] | None:
    """Two of `targets` (tensors or None) that share memory (``i < j``), or None."""
    spans = sorted((str(t.device), *_span(t), i) for i, t in enumerate(targets)
                   if t is not None and t.numel())
    # sorted by start, a span overlapping any later one overlaps the next one
    for (device, _, end, i), (other, start, _, j) in itertools.pairwise(spans):
        if device == other and start < end:
            return min(i, j), max(i, j)
    return None


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses `tensor`'s elements lie in: ``[low, high)``, whatever its strides."""
    size = tensor.element_size()
    reach = [(n - 1) * stride * size for n, stride in zip(tensor.shape, tensor.stride(),
                                                          strict=True)]
    base = tensor.data_ptr()
    return base + sum(r for r in reach if r < 0), base + sum(r for r in reach if r > 0) + size


class _FailureLog:
    """Logs a store's failures as runs: the first of a run with its traceback, then a count
    (and the latest error) at most every `_FAILURE_LOG_S`, and the recovery.

    NOTE: a warning with a traceback per failed call filled the log while the store was
    down: each request's prefetch is two calls, every call a miss.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing = False
        self._unlogged = 0
        self._logged = 0.0

    def failed(self, what: str, url: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            first, self._failing = not self._failing, True
            self._unlogged += 1
            due = first or now - self._logged >= _FAILURE_LOG_S
            if due:
                count, self._unlogged, self._logged = self._unlogged, 0, now
        if first:
            log.warning("aiohicache storage: %s on %s failed; a miss (until it answers, "
                        "failures are counted, logged every %.0f s)", what, url,
                        _FAILURE_LOG_S, exc_info=exc)
        elif due:
            log.warning("aiohicache storage: %s still failing: %d calls missed, the latest "
                        "%s: %r", url, count, what, exc)

    def succeeded(self, url: str) -> None:
        if not self._failing:  # NOTE: unlocked for every call: a stale read is harmless
            return
        with self._lock:
            was, self._failing = self._failing, False
            count, self._unlogged = self._unlogged, 0
        if was:
            log.info("aiohicache storage: %s answers again (%d calls missed since the last "
                     "log)", url, count)


_SKIPPED = ConnectionError("skipped: the store failed the calls before (the breaker is open)")
"""What a call the breaker skipped is logged with."""

_FAILURE_LOG_S = 60.0
"""How often a store that keeps failing is logged again."""
