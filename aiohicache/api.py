"""The public face: `HiCache`, its `fetch()` context and `stats()`.

    async with HiCache(config) as cache:
        async with cache.fetch(token_ids) as hit:
            await hit.layer_ready(0)                 # per-layer readiness of loaded KV
            slots = await hit.allocate(n_new)        # device slots for the new tokens
            ...write K/V of the new tokens at `slots`...
            await hit.commit(token_ids, slots)       # insert; write-through per policy
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

import anyio
import numpy as np
import torch

from ._concurrency import finish_then_cancel
from .config import HiCacheConfig
from .consensus import AGAIN, Consensus, Op
from .controller import Controller, LoadJob, WriteJob
from .distributed import TPGroup
from .errors import CapacityError, ClosedError, ConfigError, InvariantError, PageError
from .l3 import PrefetchJob, StorageTier
from .memory import DevicePool, HostPool, PageIds
from .memory._allocator import has_repeats
from .radix import DeviceState, Match, Node, RadixTree
from .radix._tree import Tokens
from .transfer import CpuTransferEngine, TransferEngine

__all__ = ("CacheStats", "FetchContext", "HiCache")

log = logging.getLogger(__name__)

TokenInput = Sequence[int] | torch.Tensor | np.ndarray
EngineFactory = Callable[[DevicePool, HostPool], TransferEngine]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache's counters; tokens unless a name says otherwise.

    The hit ratio of a workload is ``(device + host + storage hit tokens) / prompt_tokens``.
    """

    requests: int
    prompt_tokens: int
    device_hit_tokens: int
    """Prompt tokens already on the device (L1) when fetched."""
    host_hit_tokens: int
    """Prompt tokens loaded back from the host (L2), by this fetch or one it joined."""
    storage_hit_tokens: int
    """Prompt tokens prefetched from storage (L3) for this request, then loaded back."""
    miss_tokens: int
    """Prompt tokens the engine has to compute."""
    loaded_bytes: int
    written_bytes: int
    loads: int
    writes: int
    merged_loads: int
    merged_writes: int
    device_evicted_pages: int
    host_evicted_pages: int
    pending_loads: int
    pending_writes: int
    device_pages_used: int
    device_pages_free: int
    device_pages_leased: int
    host_pages_used: int
    host_pages_free: int
    num_nodes: int
    worker_restarts: int
    health: Literal["ok", "degraded", "failed"]
    storage: dict[str, int | str] | None = None
    """L3 counters (prefetched / backed-up pages, misses, errors, breaker state), if any."""
    tp: dict[str, float] | None = None
    """Consensus ticks (count, mean µs in the collective) with ``tp_size > 1``."""

    @property
    def hit_ratio(self) -> float:
        hits = self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0


class HiCache:
    """A hierarchical KV cache (device pool, host pool) driven from the event loop.

    Use it as an async context manager; the workers run while it is open. All methods must be
    called from the event loop that opened it.

    With tensor parallelism (``config.tp_size > 1``) pass the ranks' `TPGroup`; every rank
    must then make the same request-path calls in the same order (docs/tensor-parallel.md).

    `engine` replaces the transfer engine the config chooses: an engine, or a callable
    ``(device_pool, host_pool) -> engine`` called once the pools exist (e.g. a
    `CudaTransferEngine` with a given producer stream).
    """

    def __init__(self, config: HiCacheConfig, *,
                 engine: TransferEngine | EngineFactory | None = None,
                 tp_group: TPGroup | None = None) -> None:
        if not isinstance(config, HiCacheConfig):
            raise ConfigError(f"config: must be a HiCacheConfig, got {type(config).__name__}")
        _check_group(config, tp_group)
        self.config = config
        self.tp_group = tp_group if config.tp_size > 1 else None
        self._tp: Consensus | None = None
        self.device_pool = DevicePool(config.spec, num_pages=config.device_pages,
                                      page_size=config.page_size, device=config.device)
        self.host_pool = HostPool(config.spec, num_pages=config.host_capacity_pages,
                                  page_size=config.page_size, layout=config.host_layout,
                                  pin_memory=config.device != "cpu")
        self.tree = RadixTree(page_size=config.page_size,
                              device_alloc=self.device_pool.allocator,
                              host_alloc=self.host_pool.allocator, eviction=config.eviction)
        self._engine = engine
        self.storage = StorageTier(config, self.tree, self.host_pool,
                                   tp=self.tp_group is not None) \
            if config.storage is not None else None
        self._controller: Controller | None = None
        self._runner: asyncio.Task[None] | None = None
        self._leased = np.zeros(config.device_pages, dtype=np.int64)  # page -> owner, 0 = none
        self._num_leased = 0
        self._pins: dict[int, Node] = {}  # live fetch context (owner id) -> deepest pinned node
        self._contexts: weakref.WeakValueDictionary[int, FetchContext] = \
            weakref.WeakValueDictionary()  # owner id -> context, to tell live pins from leaks
        self._counters = _Counters()
        self._calls_crc = 0  # TP: CRC of every fetched token sequence, in agreed order
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._closer: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return (f"<HiCache {self._state} device={self.device_pool.allocator.num_used}/"
                f"{self.config.device_pages} host={self.host_pool.allocator.num_used}/"
                f"{self.host_pool.num_pages} pages>")

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise ClosedError("a HiCache can be opened once")
        engine = self._make_engine()
        self._controller = Controller(self.config, self.tree, engine, storage=self.storage,
                                      tp=self.tp_group is not None)
        if self.tp_group is not None:
            self._tp = Consensus(self.config, self.tp_group, self._controller, self.storage,
                                 self._digest)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run(started), name="aiohicache-workers")
        self._state = "open"
        try:
            await asyncio.shield(started)
        except BaseException:
            await self.aclose()  # cancelled while starting: leave nothing running
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def _make_engine(self) -> TransferEngine:
        if isinstance(self._engine, TransferEngine):
            return self._engine
        if self._engine is not None:
            return self._engine(self.device_pool, self.host_pool)
        backend = self.config.resolved_io_backend
        if backend == "cpu":
            return CpuTransferEngine(self.device_pool, self.host_pool)
        from .transfer.cuda import CudaTransferEngine  # imports CuPy: only on CUDA

        return CudaTransferEngine(self.device_pool, self.host_pool, backend=backend,
                                  ctas=self.config.transfer_ctas)

    async def _run(self, started: asyncio.Future[None]) -> None:
        assert self._controller is not None
        async with anyio.create_task_group() as tg:
            await tg.start(self._controller.run)
            if self._tp is not None:
                await tg.start(self._tp.run)
            if not started.done():
                started.set_result(None)

    async def aclose(self) -> None:
        """Stop accepting work, let queued and in-flight copies settle, stop the workers.

        Idempotent; concurrent calls wait for the same close. Open fetch contexts may still
        exit afterwards (they only unpin).

        Cancellation: the close runs to the end first, then the cancellation propagates.
        """
        if self._state == "new":
            self._state = "closed"
            self.host_pool.close()
        if self._state == "closed" and self._closer is None:
            return
        if self._closer is None:
            self._state = "closing"
            self._closer = asyncio.ensure_future(self._close())
        await finish_then_cancel(self._closer)

    async def _close(self) -> None:
        ctl = self.controller
        if self._tp is not None and not self._tp.finished.done():
            # Closing is an op: every rank stops ticking at the same tick, once all is settled.
            self._tp.post(self._tp.close_op, lazy=False)
            with anyio.move_on_after(self.config.tp_timeout + 60):
                await asyncio.shield(self._tp.finished)
        await ctl.close_channels()
        with anyio.move_on_after(60):
            await ctl.drain()
        assert self._runner is not None
        self._runner.cancel()
        await asyncio.gather(self._runner, return_exceptions=True)
        await ctl.close_receivers()
        await ctl.engine.aclose()
        if self.storage is not None:
            await self.storage.aclose()
        self.host_pool.close()  # unpin: no copy uses it any more
        if self.tp_group is not None:
            self.tp_group.close()
        self._state = "closed"

    def __del__(self, _warn: object = warnings.warn) -> None:
        # Don't try to do more here: the event loop may already be gone.
        if getattr(self, "_state", "closed") == "open":
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)  # type: ignore[operator]

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise ClosedError("the cache is not open: use 'async with HiCache(config)'")
        return self._controller

    def _check_open(self) -> Controller:
        if self._state != "open":
            raise ClosedError(f"the cache is {self._state}")
        ctl = self.controller
        ctl.check_healthy()
        return ctl

    # ------------------------------------------------------------------ requests

    def fetch(self, tokens: TokenInput) -> FetchContext:
        """Match `tokens` in L1/L2, start loading the L2 part, pin the prefix.

        Returns an async context manager; entering it does the match and returns the
        `FetchContext`, leaving it unpins (also on error or cancellation).
        """
        return FetchContext(self, _as_tokens(tokens))

    async def allocate(self, num_tokens: int) -> torch.Tensor:
        """Lease device slots for `num_tokens` new tokens (whole pages), evicting as needed.

        The slots belong to the caller until `FetchContext.commit` takes them or `free`
        returns them.

        Raises:
            ConfigError: `num_tokens` is not a positive int.
            CapacityError: the device cannot free enough unpinned pages.
            ClosedError: the cache is not open.

        Cancellation: nothing is leased; write-backs this started continue.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ConfigError(f"num_tokens: must be a positive int, got {num_tokens!r}")
        self._check_open()
        return (await self._allocate(num_tokens, owner=_ANONYMOUS))[0]

    async def _allocate(self, num_tokens: int, *, owner: int) -> tuple[torch.Tensor, PageIds]:
        ctl = self._check_open()
        num_pages = -(-num_tokens // self.config.page_size)
        if self._tp is not None:
            if num_pages > self.tree.device_alloc.capacity:
                raise CapacityError(f"asked for {num_pages} device pages; the pool has "
                                    f"{self.tree.device_alloc.capacity}")
            pages = await self._tp.call(lambda op: self._alloc_op(num_pages, owner),
                                        undo=lambda got: self._release_owned(got, owner))
        else:
            pages = await ctl.alloc_device_wait(num_pages)
            self._lease(pages, owner)
        return self.device_pool.pages_to_slots(pages)[:num_tokens], pages

    def _alloc_op(self, num_pages: int, owner: int) -> PageIds:
        """TP op: lease `num_pages`, or wait for a tick that settles copies which free some."""
        ctl = self._check_open()
        pages = ctl.alloc_device(num_pages)
        if pages is None:
            if ctl.demoting_pages or not ctl.idle:
                return AGAIN  # type: ignore[no-any-return]
            raise CapacityError(
                f"cannot allocate {num_pages} device pages: {self.tree.device_alloc.num_free}"
                " free and the rest pinned")
        self._lease(pages, owner)
        return pages

    def free(self, slots: torch.Tensor) -> None:
        """Give back slots leased by `allocate` and not committed.

        With TP the pages return to the pool at the next tick (an op, like every call).

        Raises:
            ConfigError: `slots` is not a tensor of whole leased pages.
            PageError: a page is not leased (double free or foreign).
        """
        pages = self.device_pool.slots_to_pages(slots)
        if self._tp is None or self._tp.finished.done():
            self._release_leases(pages, free=True)
            return
        self._check_leased(pages)
        self._tp.post(lambda op: self._release_leases(pages, free=True))

    def _lease(self, pages: PageIds, owner: int) -> None:
        self._leased[pages] = owner
        self._num_leased += len(pages)

    def _check_leased(self, pages: PageIds) -> None:
        if not self._leased[pages].all() or (len(pages) > 1 and has_repeats(pages)):
            raise PageError("slots: pages not leased by allocate() (double free or foreign)")

    def _release_leases(self, pages: PageIds, *, free: bool) -> None:
        if len(pages) == 0:
            return
        self._check_leased(pages)
        self._leased[pages] = 0
        self._num_leased -= len(pages)
        if free:
            self.device_pool.allocator.free(pages)

    def _release_owned(self, pages: PageIds, owner: int) -> None:
        """Free those of `pages` still leased to `owner` (the user may have freed some)."""
        self._release_leases(pages[self._leased[pages] == owner], free=True)

    def _pin(self, ctx: FetchContext, node: Node | None) -> int:
        """Pin `node` for `ctx`; a context holds at most one pin."""
        owner = ctx._owner
        if owner in self._pins:
            raise InvariantError(f"fetch context {owner} is pinned already")
        self._contexts[owner] = ctx
        self.tree.lock(node)
        self._pins[owner] = node if node is not None else self.tree.root
        return owner

    def _repin(self, key: int, node: Node | None) -> None:
        self.tree.lock(node)
        old = self._pins[key]
        self.tree.unlock(old if old is not self.tree.root else None)
        self._pins[key] = node if node is not None else self.tree.root

    def _release_context(self, pin: int | None, leases: list[PageIds], owner: int) -> None:
        if pin is not None:
            self._unpin(pin)
        for pages in leases:
            self._release_owned(pages, owner)

    def _unpin(self, key: int) -> None:
        node = self._pins.pop(key)
        self.tree.unlock(node if node is not self.tree.root else None)

    # ------------------------------------------------------------------ observability

    def stats(self) -> CacheStats:
        """A snapshot of hit, transfer, eviction and occupancy counters."""
        c, t = self._counters, self.tree
        ctl = self._controller
        tc = ctl.counters if ctl is not None else None
        dev, host = self.device_pool.allocator, self.host_pool.allocator
        health: Literal["ok", "degraded", "failed"] = "ok"
        if ctl is not None and ctl.failure is not None:
            health = "failed"
        elif (tc is not None and tc.worker_restarts) or (
                self.storage is not None and self.storage.degraded):
            health = "degraded"
        return CacheStats(
            requests=c.requests, prompt_tokens=c.prompt_tokens,
            device_hit_tokens=c.device_hit_tokens, host_hit_tokens=c.host_hit_tokens,
            storage_hit_tokens=c.storage_hit_tokens,
            miss_tokens=(c.prompt_tokens - c.device_hit_tokens - c.host_hit_tokens
                         - c.storage_hit_tokens),
            loaded_bytes=tc.loaded_bytes if tc else 0, written_bytes=tc.written_bytes if tc else 0,
            loads=tc.loads if tc else 0, writes=tc.writes if tc else 0,
            merged_loads=tc.load_merges if tc else 0, merged_writes=tc.write_merges if tc else 0,
            device_evicted_pages=t.device_evicted_pages, host_evicted_pages=t.host_evicted_pages,
            pending_loads=ctl.pending_loads if ctl else 0,
            pending_writes=ctl.pending_writes if ctl else 0,
            device_pages_used=dev.num_used, device_pages_free=dev.num_free,
            device_pages_leased=self._num_leased, host_pages_used=host.num_used,
            host_pages_free=host.num_free, num_nodes=t.num_nodes,
            worker_restarts=tc.worker_restarts if tc else 0, health=health,
            storage=self._storage_stats(), tp=self._tp.stats() if self._tp else None)

    def _digest(self) -> tuple[int, ...]:
        """Cheap numbers that equal caches share; the TP tick compares them across ranks."""
        c = self._counters
        return (self.device_pool.allocator.num_free, self.host_pool.allocator.num_free,
                self.tree.num_nodes, self._num_leased, c.requests, self._calls_crc)

    def _storage_stats(self) -> dict[str, int | str] | None:
        if self.storage is None:
            return None
        out: dict[str, int | str] = dict(dataclasses.asdict(self.storage.counters))
        out["breaker"] = self.storage.breaker.state.value
        out["corrupt"] = self.storage.backend.stats().corrupt
        return out

    async def drain(self) -> None:
        """Wait until every queued and in-flight transfer has settled.

        Cancellation: only the wait is cancelled.
        """
        await self.controller.drain()
        if self.storage is not None:
            await self.storage.drain()
            await self.controller.drain()  # backups may have queued nothing new; settle all

    def check_invariants(self) -> None:
        """Assert the cache's internal consistency; raise `InvariantError` if broken.

        Checks the tree (links, tier states, prefix closure, page ownership, eviction queues),
        that every allocated page is owned by exactly one of tree / lease, and that pins match
        the live fetch contexts and in-flight jobs exactly.
        """
        self.tree.check()
        self._check_pages()
        self._check_refs()

    def _check_pages(self) -> None:
        dev, host = self.device_pool.allocator, self.host_pool.allocator
        for alloc in (dev, host):
            if alloc.num_free + alloc.num_used != alloc.capacity:
                raise InvariantError(f"{alloc!r}: free + used != capacity")
        nodes = list(self.tree.iter_nodes())
        tree_dev = _ids([n.device_pages for n in nodes])
        tree_host = _ids([n.host_pages for n in nodes]
                         + (list(self.storage.reserved_host.values()) if self.storage else []))
        leased = np.flatnonzero(self._leased != 0)
        if len(leased) != self._num_leased or np.intersect1d(leased, tree_dev).size:
            raise InvariantError("leased pages disagree with the lease count or the tree")
        owned = np.sort(np.concatenate([tree_dev, leased]))
        if not np.array_equal(owned, dev.used_pages()):
            raise InvariantError("device pages used by the allocator != tree + leases")
        if not np.array_equal(np.sort(tree_host), host.used_pages()):
            raise InvariantError("host pages used by the allocator != tree")

    def _check_refs(self) -> None:
        for owner in self._pins:  # a pin whose context has ended (or is gone) is a leak
            ctx = self._contexts.get(owner)
            if ctx is None or (ctx._pin != owner and not ctx._releasing):
                raise InvariantError(f"a pin outlives its fetch context ({owner})")
        locks: dict[int, int] = {}
        for node in self._pins.values():
            for n in node.path_to_root():
                locks[n.id] = locks.get(n.id, 0) + 1
        host_refs: dict[int, int] = {}
        for group in self.storage.backup_holds() if self.storage is not None else ():
            for n in group:
                host_refs[n.id] = host_refs.get(n.id, 0) + 1
        if self._controller is not None:
            for job in self._controller.inflight_jobs():
                if isinstance(job, LoadJob):
                    for n in job.nodes:
                        host_refs[n.id] = host_refs.get(n.id, 0) + 1
        for n in self.tree.iter_nodes():
            if n.lock_ref != locks.get(n.id, 0):
                raise InvariantError(f"{n!r}: lock_ref {n.lock_ref}, live pins "
                                     f"{locks.get(n.id, 0)}")
            if n.host_ref != host_refs.get(n.id, 0):
                raise InvariantError(f"{n!r}: host_ref {n.host_ref}, live loads "
                                     f"{host_refs.get(n.id, 0)}")


_ANONYMOUS = -1
_owner_ids = itertools.count(1)


def _ids(parts: list[PageIds | None]) -> PageIds:
    arrays = [p for p in parts if p is not None]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


def _as_tokens(tokens: TokenInput) -> Tokens:
    """Token ids as a fresh 1-D int64 array (a copy: the caller may reuse its buffer).

    Ids must fit in int64: a uint64 id of 2**63 or more would wrap to a negative id and
    match KV committed for another token, so it is refused rather than converted.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex \
                or tokens.dtype == torch.bool:
            raise ConfigError("tokens: must be a 1-D integer tensor")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence | np.ndarray):
        raise ConfigError(f"tokens: must be a sequence of ints, got {type(tokens).__name__}")
    else:
        try:
            arr = np.array(tokens)
        except (ValueError, TypeError) as exc:  # ragged nesting, or ids numpy cannot hold
            raise ConfigError(f"tokens: must be a 1-D sequence of int token ids ({exc})") \
                from None
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError("tokens: must be a 1-D sequence of int token ids (each in int64 "
                          "range)")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _MAX_TOKEN:
        raise ConfigError(f"tokens: token id {int(arr.max())} does not fit in int64 "
                          f"(max {_MAX_TOKEN})")
    return arr.astype(np.int64, copy=True)


_MAX_TOKEN = int(np.iinfo(np.int64).max)


class FetchContext:
    """One request's view of the cache, from match to commit; also the async context manager.

    Attributes (valid inside the ``async with`` block):
        num_cached_tokens: prefix length whose KV is on the device or being loaded there.
        device_indices: device token slots (int64 tensor) of that prefix, for attention.
    """

    def __init__(self, cache: HiCache, tokens: Tokens) -> None:
        self._cache = cache
        self.tokens = tokens
        self.num_cached_tokens = 0
        self.num_device_hit_tokens = 0
        self.num_host_hit_tokens = 0
        self.num_storage_hit_tokens = 0
        self._storage_pages = 0
        self._pre_storage_pages = 0
        self._pages: PageIds = np.empty(0, dtype=np.int64)
        self._jobs: list[LoadJob] = []
        self._pin: int | None = None
        self._leases: list[PageIds] = []
        self._device_indices: torch.Tensor | None = None
        self._tail: tuple[int, int] | None = None  # leased page being filled, slots used
        self._owner = next(_owner_ids)
        self._allocated: tuple[torch.Tensor, PageIds, int] | None = None
        self._prefetching: PrefetchJob | None = None  # TP: the prefetch the enter op waits on
        self._entered = False  # a context is entered once: its pin and leases are its own
        self._releasing = False  # TP: left, its pin is released at the next tick
        self._page_size = cache.config.page_size

    def __repr__(self) -> str:
        return (f"<FetchContext {len(self.tokens)} tokens, {self.num_cached_tokens} cached, "
                f"{len(self._jobs)} loads>")

    @property
    def device_indices(self) -> torch.Tensor:
        if self._device_indices is None:
            self._device_indices = self._cache.device_pool.pages_to_slots(self._pages)
        return self._device_indices

    async def __aenter__(self) -> Self:
        """Match, pin and plan loads (synchronously), then queue the loads.

        Cancellation: if cancelled while queueing a load, the load is still queued (shielded)
        and this context unpins before the cancellation propagates.
        """
        cache = self._cache
        if self._entered:
            raise ClosedError("a FetchContext can be entered once: call cache.fetch() again")
        ctl = cache._check_open()
        if len(self.tokens) == 0:
            raise ConfigError("tokens: must not be empty")
        self._entered = True
        if cache._tp is not None:
            await cache._tp.call(self._enter_op, undo=lambda _: self._release_now())
            return self
        match = cache.tree.match(self.tokens)
        if cache.storage is not None:
            match = await self._prefetch(match)
        try:
            job = self._plan_load(match)
            wt = ctl.plan_write_through(match.last_device_node)
            if job is not None:
                await ctl.submit_load(job)
            if wt is not None:
                await ctl.submit_write(wt)
        except BaseException:
            self._release()
            raise
        return self

    def _plan_load(self, match: Match) -> LoadJob | None:
        cache = self._cache
        self._pin = cache._pin(self, match.last_device_node)
        job = cache.controller.plan_load(match)
        self._adopt(match, job)
        return job

    async def _prefetch(self, match: Match) -> Match:
        """Ask L3 for the pages after the L1+L2 match, wait per policy, match again."""
        storage = self._cache.storage
        assert storage is not None
        job = storage.plan_prefetch(self.tokens, match.path)
        if job is None:
            return match
        await storage.wait(job, len(self.tokens) - job.start_page * storage.config.page_size)
        return self._after_prefetch(job)

    def _after_prefetch(self, job: PrefetchJob) -> Match:
        if job.done.is_set():
            self._storage_pages = job.inserted
            self._pre_storage_pages = job.start_page
        return self._cache.tree.match(self.tokens, touch=False)

    def _enter_op(self, op: Op) -> None:
        """TP op: `__aenter__` run at a tick; waits (AGAIN) for the prefetch as agreed."""
        cache = self._cache
        ctl, storage = cache._check_open(), cache.storage
        if self._prefetching is None:
            cache._calls_crc = zlib.crc32(self.tokens.tobytes(), cache._calls_crc)
            match = cache.tree.match(self.tokens)
            job = storage.plan_prefetch(self.tokens, match.path) if storage else None
            if job is None:
                return self._enter_planned(match, ctl)
            assert storage is not None
            self._prefetching = job
            wait = storage.wait_seconds(len(self.tokens) - job.start_page * self._page_size)
            if wait and not job.done.is_set():
                op.deadline = None if math.isinf(wait) else time.monotonic() + wait
                return AGAIN  # type: ignore[no-any-return]
        elif not (self._prefetching.done.is_set() or op.stop):
            return AGAIN  # type: ignore[no-any-return]
        return self._enter_planned(self._after_prefetch(self._prefetching), ctl)

    def _enter_planned(self, match: Match, ctl: Controller) -> None:
        try:
            job = self._plan_load(match)
            ctl.launch_now(job)
            ctl.launch_now(ctl.plan_write_through(match.last_device_node))
        except BaseException:
            self._release_now()
            raise

    def _adopt(self, match: Match, job: LoadJob | None) -> None:
        """Record the device prefix (resident, loading, and our own loads) and pin it."""
        cache, ps = self._cache, self._cache.config.page_size
        nodes = match.device_nodes + (job.nodes if job is not None else [])
        if job is not None:
            self._jobs.append(job)
            cache._repin(self._pin_key, nodes[-1])
        self._join_loads(match.device_nodes)
        self._pages = _ids([n.device_pages for n in nodes])
        self.num_cached_tokens = len(self._pages) * ps
        resident = sum(n.num_pages for n in match.device_nodes
                       if n.device_state is DeviceState.RESIDENT) * ps
        self.num_device_hit_tokens = resident
        # Tokens past what L1+L2 matched before the prefetch came from L3.
        beyond = self.num_cached_tokens - max(resident, self._pre_storage_pages * ps)
        self.num_storage_hit_tokens = max(0, min(self._storage_pages * ps, beyond))
        self.num_host_hit_tokens = self.num_cached_tokens - resident - self.num_storage_hit_tokens
        c = cache._counters
        c.requests += 1
        c.prompt_tokens += len(self.tokens)
        c.device_hit_tokens += resident
        c.host_hit_tokens += self.num_host_hit_tokens
        c.storage_hit_tokens += self.num_storage_hit_tokens

    def _join_loads(self, nodes: list[Node]) -> None:
        """Depend on the loads still filling `nodes`: `ready`/`layer_ready` wait for them."""
        known = {id(job) for job in self._jobs}
        for node in nodes:
            op = node.load_op
            if node.device_state is DeviceState.LOADING and isinstance(op, LoadJob) \
                    and id(op) not in known:
                known.add(id(op))
                self._jobs.append(op)

    @property
    def _pin_key(self) -> int:
        assert self._pin is not None, "use the context with 'async with'"
        return self._pin

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._release()

    def _release(self) -> None:
        """Unpin and free what was not committed (with TP: as an op, at the next tick)."""
        tp = self._cache._tp
        if tp is None or tp.finished.done():
            self._release_now()
            return
        pin, self._pin = self._pin, None
        leases, self._leases = self._leases, []
        self._releasing = pin is not None  # the pin goes at the next tick
        tp.post(lambda op: self._cache._release_context(pin, leases, self._owner))

    def _release_now(self) -> None:
        pin, self._pin = self._pin, None
        leases, self._leases = self._leases, []
        self._cache._release_context(pin, leases, self._owner)

    async def layer_ready(self, layer: int, *, stream: torch.cuda.Stream | None = None) -> None:
        """Wait until `layer` of the cached prefix is on the device.

        With a CUDA `stream`, return as soon as `stream` is ordered after the layer's copies
        (``stream.wait_event`` on each load's layer event): the GPU waits, the host does not,
        so the forward pass can be enqueued while the copy runs. Loads whose engine records
        no CUDA events (the CPU engine) are waited for on the host.

        Raises:
            ConfigError: no such layer.
            TransferError: a load this request depends on failed (host waits only: a GPU-side
                wait cannot see a copy fail; the cache reports it in `health`).

        Cancellation: cancels only the wait; loads go on and stay shared with other requests.
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or not (
                0 <= layer < self._cache.config.spec.num_layers):
            raise ConfigError(f"layer: must be in 0..{self._cache.config.spec.num_layers - 1}, "
                              f"got {layer!r}")
        self._check_active()
        for job in self._jobs:
            if stream is None:
                await job.wait_layer(layer)
                continue
            handle = await job.launched_handle()
            event = handle.layer_event(layer)
            if event is None or handle.done():
                await handle.wait_layer(layer)
            else:
                stream.wait_event(event)  # type: ignore[arg-type]

    async def ready(self) -> None:
        """Wait until every layer of the cached prefix is on the device (see `layer_ready`).

        Raises:
            ClosedError: the context's block has ended.
            TransferError: a load this request depends on failed.

        Cancellation: cancels only the wait.
        """
        self._check_active()
        for job in self._jobs:
            await job.wait()

    async def allocate(self, num_tokens: int) -> torch.Tensor:
        """`HiCache.allocate`, tied to this context: slots not committed are freed on exit.

        After a commit that ended mid-page, the first slots returned are the free rest of
        that page, so a sequence's KV stays contiguous page by page.

        Cancellation: nothing is leased.
        """
        self._check_active()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ConfigError(f"num_tokens: must be a positive int, got {num_tokens!r}")
        ps = self._cache.config.page_size
        head = None
        if self._tail is not None and self._cache._leased[self._tail[0]] != self._owner:
            self._tail = None  # the partial page was freed (and maybe re-leased): start afresh
        if self._tail is not None:
            page, used = self._tail
            take = min(num_tokens, ps - used)
            head = torch.arange(page * ps + used, page * ps + used + take, dtype=torch.int64)
            num_tokens -= take
            if num_tokens == 0:
                self._tail = (page, used + take) if used + take < ps else None
                return head.to(self._cache.device_pool.device)
        # NOTE: `_tail` changes only after the await: a cancelled allocate leaves it as it was.
        slots, pages = await self._cache._allocate(num_tokens, owner=self._owner)
        self._leases.append(pages)
        self._tail = (int(slots[-1]) // ps, num_tokens % ps) if num_tokens % ps else None
        if head is not None:
            return torch.cat([head.to(slots.device), slots])
        # commit() of this very tensor, unmodified (torch bumps _version on in-place
        # writes), skips re-deriving its pages.
        self._allocated = (slots, pages, slots._version)
        return slots

    async def commit(self, tokens: TokenInput, slots: torch.Tensor) -> None:
        """Insert `tokens` into the cache, with the KV of ``tokens[num_cached_tokens:]`` at `slots`.

        `tokens` must be a prefix of the fetched tokens (chunked prefill) or extend them
        (decode), and `slots` must be leased (from `allocate`)
        for exactly the tokens after `num_cached_tokens`. Whole pages join the tree (a page
        that another request inserted meanwhile is freed); a trailing partial page stays
        leased to this context, so decoding can continue and a later `commit` can pass it
        again. `num_cached_tokens` then covers the committed pages, which stay pinned until
        the context exits. Write-through starts for nodes that reached the hit threshold.

        Raises:
            ConfigError: `tokens` or `slots` do not fit the rules above.
            PageError: `slots` are not leased.
            ClosedError: the cache is closed.

        Cancellation: the insert is atomic; if cancelled while queueing the write-through, the
        write is still queued (shielded) and the cancellation propagates after.
        """
        self._check_active()
        cache = self._cache
        ctl = cache._check_open()
        toks = _as_tokens(tokens)  # always a copy: the caller may have edited its list
        if cache._tp is not None:
            await cache._tp.call(lambda op: ctl.launch_now(self._commit_now(toks, slots)))
            return
        wt = self._commit_now(toks, slots)
        if wt is not None:
            await ctl.submit_write(wt)

    def _commit_now(self, toks: Tokens, slots: torch.Tensor) -> WriteJob | None:
        """`commit` up to the write-through it plans (sync: the insert is atomic)."""
        cache = self._cache
        ctl = cache._check_open()
        self._check_active()
        ps = cache.config.page_size
        num_full = len(toks) // ps
        if isinstance(slots, torch.Tensor) and len(slots) == 0 and num_full == len(
                self._pages) and self._tail is None:
            self._check_commit(toks, slots)  # nothing new: the prefix is in the tree already
            return None
        pages = self._check_commit(toks, slots)
        new_full = num_full - len(self._pages)
        all_pages = np.concatenate([self._pages, pages[:new_full]])
        hashes = cache.storage.keys(toks[:num_full * ps], self._path()) \
            if cache.storage is not None else None
        # Insert before the leases end: if it raises, the pages are still leased, not lost.
        res = cache.tree.insert(toks[:num_full * ps], all_pages, start_page=len(self._pages),
                                hashes=hashes)
        cache._release_leases(pages[:new_full], free=False)
        self._leases = [kept for p in self._leases
                        if len(kept := p[cache._leased[p] == self._owner])]
        for dup in res.duplicate_pages:
            cache.device_pool.allocator.free(dup)
        self._tail = None
        if len(pages) > new_full:  # the partial tail page stays leased, now to this context
            tail = pages[new_full:]
            adopted = tail[cache._leased[tail] != self._owner]
            cache._leased[adopted] = self._owner
            if len(adopted):
                self._leases.append(adopted)
            self._tail = (int(pages[new_full]), len(toks) % ps)
        cache._repin(self._pin_key, res.last_node)
        if res.last_node is not None:
            # A page another request is loading replaced ours as a duplicate: our prefix now
            # reads that load's pages, so `ready`/`layer_ready` must wait for it.
            self._join_loads(res.last_node.path_to_root())
        if len(toks) > len(self.tokens):
            self.tokens = toks
        self._pages = _ids([n.device_pages for n in reversed(res.last_node.path_to_root())]) \
            if res.last_node is not None else self._pages
        self._device_indices = None
        self.num_cached_tokens = len(self._pages) * ps
        return ctl.plan_write_through(res.last_node)

    def _path(self) -> list[Node]:
        """The pinned prefix's nodes, root first."""
        node = self._cache._pins.get(self._pin_key)
        if node is None or node is self._cache.tree.root:
            return []
        return node.path_to_root()[::-1]

    def _check_commit(self, toks: Tokens, slots: torch.Tensor) -> PageIds:
        cached, common = self.num_cached_tokens, min(len(toks), len(self.tokens))
        if len(toks) < cached or not np.array_equal(toks[:common], self.tokens[:common]):
            raise ConfigError("tokens: must be a prefix or an extension of the fetched tokens, "
                              "and cover the cached prefix")
        if not isinstance(slots, torch.Tensor) or len(slots) != len(toks) - cached:
            raise ConfigError(f"slots: need one slot per token after the cached prefix "
                              f"({len(toks) - cached}), got "
                              f"{len(slots) if isinstance(slots, torch.Tensor) else slots!r}")
        if self._allocated is not None and slots is self._allocated[0] \
                and slots._version == self._allocated[2]:
            pages = self._allocated[1]
        else:
            pages = self._cache.device_pool.slots_to_pages(slots)
        owners = self._cache._leased[pages]
        if len(pages) and not ((owners == self._owner) | (owners == _ANONYMOUS)).all():
            raise PageError("slots: not leased by allocate() of this context or of the cache "
                            "(already committed, freed, or another request's?)")
        return pages

    def _check_active(self) -> None:
        if self._pin is None:
            raise ClosedError("the fetch context is not active (use it inside 'async with')")


def _check_group(config: HiCacheConfig, group: TPGroup | None) -> None:
    if group is None:
        if config.tp_size > 1:
            raise ConfigError(f"tp_group: tp_size is {config.tp_size}; pass the ranks' TPGroup")
        return
    if not isinstance(group, TPGroup):
        raise ConfigError(f"tp_group: must be a TPGroup, got {type(group).__name__}")
    if (group.rank, group.size) != (config.tp_rank, config.tp_size):
        raise ConfigError(f"tp_group: is rank {group.rank} of {group.size} but the config says "
                          f"tp_rank={config.tp_rank}, tp_size={config.tp_size}")
