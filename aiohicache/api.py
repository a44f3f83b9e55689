"""The public face: `HiCache` and its `fetch()` context.

    async with HiCache(config) as cache:
        async with cache.fetch(token_ids) as hit:
            await hit.layer_ready(0)                 # per-layer readiness of loaded KV
            slots = await hit.allocate(n_new)        # device slots for the new tokens
            ...write K/V of the new tokens at `slots`...
            await hit.commit(token_ids, slots)       # insert; write-through per policy

Each call is one synchronous operation on the cache state (`_request`), run by the cache's
executor (`_executor`: now on this loop, or at the tensor-parallel consensus tick), then one
await of the copies it planned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import warnings
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

import anyio
import torch

from . import _invariants
from ._concurrency import Detached, LoopBridge, Promise, current_loop, finish_then_cancel
from ._context import FetchContext, check_count, lease
from ._core import Core
from ._executor import LocalExecutor, TickExecutor
from ._leases import ANONYMOUS
from ._request import Request
from ._stats import CacheStats, snapshot
from ._tokens import TokenInput, as_tokens
from ._validate import check_int
from .config import HiCacheConfig
from .controller import Consensus, Controller, StorageTier
from .distributed import TPGroup
from .errors import ClosedError, ConfigError
from .memory import DevicePool, HostPool
from .radix import Node, RadixTree
from .transfer import CpuTransferEngine, TransferEngine

if TYPE_CHECKING:
    from .events import EventStream

__all__ = ("CacheStats", "FetchContext", "HiCache")

EngineFactory = Callable[[DevicePool, HostPool], TransferEngine]


class HiCache:
    """A hierarchical KV cache (device pool, host pool, optional storage) on the event loop.

    Use it as an async context manager; the workers run while it is open. All methods must be
    called from the event loop that opened it (else `LoopError`); `stats()` and
    `check_invariants()` only read, and `aclose()` also works once that loop has ended.

    With tensor parallelism (``config.tp.size > 1``) pass the ranks' `TPGroup`; every rank
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
        self.tp_group = tp_group if config.tp.size > 1 else None
        self.device_pool = DevicePool(config.spec, num_pages=config.device_pages,
                                      page_size=config.page_size, device=config.device)
        self.host_pool = HostPool(config.spec, num_pages=config.host_capacity_pages,
                                  page_size=config.page_size, layout=config.host_layout,
                                  pin_memory=config.device != "cpu")
        self.tree = RadixTree(page_size=config.page_size,
                              device_alloc=self.device_pool.allocator,
                              host_alloc=self.host_pool.allocator, eviction=config.eviction)
        self.storage = StorageTier(config, self.tree, self.host_pool,
                                   tp=self.tp_group is not None) \
            if config.storage is not None else None
        self._core = Core(config, self.device_pool, self.host_pool, self.tree, self.storage)
        self._engine = engine
        self._runner: Detached | None = None
        self._closer: Detached | None = None

    def __repr__(self) -> str:
        return (f"<HiCache {self._core.state} device={self.device_pool.allocator.num_used}/"
                f"{self.config.device_pages} host={self.host_pool.allocator.num_used}/"
                f"{self.host_pool.num_pages} pages>")

    @property
    def controller(self) -> Controller:
        return self._core.open_controller()

    @property
    def _tp(self) -> Consensus | None:
        return self._core.tp

    @property
    def _pins(self) -> dict[int, Node]:
        return self._core.pins.nodes

    @property
    def _state(self) -> str:
        return self._core.state

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        core = self._core
        if core.state != "new":
            raise ClosedError("a HiCache can be opened once")
        if self.storage is not None:
            try:
                self.storage.check_loop()  # NOTE: nothing started yet: a plain ConfigError
            except ConfigError:
                await self.storage.aclose()  # a store built from the URL is ours to close
                raise
        core.loop, core.bridge, core.thread = current_loop(), LoopBridge(), threading.get_ident()
        ctl = core.controller = Controller(self.config, self.tree, self._make_engine(),
                                           storage=self.storage, tp=self.tp_group is not None)
        if self.tp_group is not None:
            core.tp = Consensus(self.config, self.tp_group, ctl, self.storage, core.digest)
            core.executor = TickExecutor(core.tp, ctl)
        else:
            local = LocalExecutor(ctl)
            ctl.kick = local.kick
            if self.storage is not None:
                self.storage.kick = local.kick
            core.executor = local
        started: Promise[None] = Promise()
        # The workers outlive this call: they run until `aclose`, from whichever task.
        self._runner = Detached(self._run, started, name="aiohicache-workers")
        core.state = "open"
        try:
            await started.wait()
        except BaseException:
            await self.aclose()  # cancelled while starting: leave nothing running
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def _make_engine(self) -> TransferEngine:
        """The engine given (checked to copy between this cache's pools), or the config's.

        Raises:
            ConfigError: the engine given, or the one a factory returned, copies between
                other pools (the cache would serve device pages no load wrote).
        """
        if self._engine is None:
            return self._default_engine()
        engine = self._engine if isinstance(self._engine, TransferEngine) \
            else self._engine(self.device_pool, self.host_pool)
        if engine.device_pool is not self.device_pool or engine.host_pool is not self.host_pool:
            raise ConfigError("engine: must copy between this cache's pools (cache.device_pool "
                              "and cache.host_pool); pass a factory (device_pool, host_pool) "
                              "-> engine, or build the engine on those pools before opening")
        return engine

    def _default_engine(self) -> TransferEngine:
        backend = self.config.resolved_io_backend
        if backend == "cpu":
            return CpuTransferEngine(self.device_pool, self.host_pool)
        from .transfer._cuda import CudaTransferEngine  # imports CuPy: only on CUDA

        return CudaTransferEngine(self.device_pool, self.host_pool, backend=backend,
                                  ctas=self.config.transfer.ctas)

    async def _run(self, started: Promise[None]) -> None:
        assert self._core.controller is not None
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._core.controller.run)
                if self._core.tp is not None:
                    await tg.start(self._core.tp.run)
                started.set_result(None)
        except BaseException as exc:
            if not started.done():  # failed while starting: `__aenter__` raises it
                # cancelled here only by `aclose` (another task): the opener was not
                # cancelled, so it must not see a CancelledError
                started.set_exception(
                    ClosedError("the cache was closed while it was opening")
                    if isinstance(exc, anyio.get_cancelled_exc_class()) else exc)
            raise

    async def aclose(self) -> None:
        """Stop accepting work, let queued and in-flight copies settle, stop the workers.

        Idempotent; concurrent calls wait for the same close. Open fetch contexts may still
        exit afterwards (they only unpin). L3 backups and prefetches still queued or in
        flight are cancelled (a close does not wait on storage; a backup cancelled mid-write
        may still have stored some pages): to have the last backups stored, ``await
        cache.drain()`` first.

        May also be called from another loop once the loop that opened the cache has ended
        (``asyncio.run`` returned without closing it): its workers are gone, so nothing queued
        is waited for. Else, from another loop or thread: `LoopError`.

        Cancellation: the close runs to the end first, then the cancellation propagates.
        """
        if not self._workers_gone():
            self._core.check_loop()
        if self._core.state == "new":
            self._core.state = "closed"
            self.host_pool.close()
            if (hub := getattr(self, "_event_hub", None)) is not None:
                hub.close()  # streams made before opening end too
        if self._core.state == "closed" and self._closer is None:
            return
        if self._closer is None:
            self._core.state = "closing"
            self._closer = Detached(self._close, name="aiohicache-close")
        await finish_then_cancel(self._closer.done.wait())

    def _workers_gone(self) -> bool:
        """The loop that opened the cache ended without closing it: its workers were cancelled
        (or will never run again), so nothing settles what they had queued."""
        loop = self._core.loop
        return (self._runner is not None and self._runner.done.done()) or (
            isinstance(loop, asyncio.AbstractEventLoop) and loop.is_closed())

    async def _close(self) -> None:
        ctl = self._core.open_controller()
        if self._workers_gone():  # NOTE: a drain would wait its full minute for nothing
            await ctl.close_channels()
            await self._close_resources(ctl)
            return
        if self._core.tp is not None and not self._core.tp.finished.done():
            # Closing is an op: every rank stops ticking at the same tick, once all is settled.
            self._core.tp.post(self._core.tp.close_op, lazy=False)
            with anyio.move_on_after(self.config.tp.timeout + 60):
                await self._core.tp.finished.wait()
        await ctl.close_channels()
        with anyio.move_on_after(60):
            await ctl.drain()
        assert self._runner is not None
        self._runner.cancel()
        await self._runner.done.settled()  # its failure, if any, is already in `health`
        await self._close_resources(ctl)

    async def _close_resources(self, ctl: Controller) -> None:
        """With the workers stopped: launch what they left, close the engine, the store and
        the host pool, end the event streams."""
        # Every step runs even if one before it fails (an engine or a store that fails to
        # close): the first failure is raised once the cache is closed.
        failures: list[Exception] = []

        async def attempt(step: Callable[[], Awaitable[None]]) -> bool:
            try:
                await step()
            except Exception as exc:
                failures.append(exc)
                return False
            return True
        await attempt(ctl.close_receivers)
        engine_closed = await attempt(ctl.engine.aclose)
        if self.storage is not None:
            await attempt(self.storage.aclose)
        if engine_closed:  # else a copy may still use the host pool: leave it registered
            self.host_pool.close()  # unpin: no copy uses it any more
        if self.tp_group is not None:
            self.tp_group.close()
        self._core.state = "closed"
        if (hub := getattr(self, "_event_hub", None)) is not None:
            hub.close()
        if failures:
            raise failures[0]

    def __del__(self, _warn: object = warnings.warn) -> None:
        # Don't try to do more here: the event loop may already be gone.
        if getattr(getattr(self, "_core", None), "state", "closed") == "open":
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)  # type: ignore[operator]

    # ------------------------------------------------------------------ requests

    def fetch(self, tokens: TokenInput) -> FetchContext:
        """Match `tokens` in L1/L2 (and L3), start loading what is not on the device, pin.

        Returns an async context manager; entering it does the match and returns the
        `FetchContext`, leaving it unpins (also on error or cancellation).
        """
        return FetchContext(Request(self._core, as_tokens(tokens)))

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
        check_count(num_tokens)
        return self.device_pool.pages_to_slots(
            await lease(self._core, num_tokens, ANONYMOUS))[:num_tokens]

    def free(self, slots: torch.Tensor) -> None:
        """Give back slots leased by `allocate` and not committed.

        With TP the pages return to the pool at the next tick (an op, like every call).

        Raises:
            ConfigError: `slots` is not a tensor of whole leased pages.
            PageError: a page is not leased (double free or foreign).
        """
        if self._core.state != "closed":  # NOTE: else another thread races the loop's leases
            self._core.check_loop()
        pages = self.device_pool.slots_to_pages(slots)
        leases = self._core.leases
        if self._core.executor is None:
            leases.release(pages, free=True)
            return
        # NOTE: marked now, not at the tick: until then a commit of these slots, a context
        # continuing their partial page or a second free must fail as it would without TP
        leases.mark_freeing(pages)
        self._core.executor.post(lambda: leases.release(pages, free=True, freeing=True))

    # ------------------------------------------------------------------ observability

    def stats(self) -> CacheStats:
        """A snapshot of hit, transfer, eviction and occupancy counters."""
        stats = snapshot(self._core)
        if self._core.state == "open" and self._workers_gone():
            # NOTE: the opening loop ended without aclose: nothing can be served any more
            # (every call is a LoopError), yet health read "ok" to a monitor
            stats = dataclasses.replace(stats, health="failed")
        return stats

    def events(self, *, max_batches: int = 1024, snapshot: bool = False) -> EventStream:
        """Subscribe to KV events: an async iterator of `EventBatch` (see `aiohicache.events`).

        Call on the cache's event loop. At most `max_batches` unread batches are kept; later
        ones are dropped (counted in the stream's `dropped`): the cache never waits. With
        `snapshot`, a first batch (``seq == -1``) lists what the tiers hold now. The stream
        ends after the cache closes (its last batch holds `AllBlocksCleared`).
        """
        from .events import hub_of

        # NOTE: a stream's batches are flushed on the loop of the last subscriber: another
        # loop's took every stream's (and, once ended, made every commit fail)
        self._core.check_loop()
        check_int("max_batches", max_batches, low=1)  # NOTE: a bad one broke the others' flush
        return hub_of(self).subscribe(max_batches, snapshot=snapshot)

    async def drain(self) -> None:
        """Wait until every queued and in-flight transfer has settled.

        Cancellation: only the wait is cancelled.
        """
        self._core.check_loop()
        await self.controller.drain()
        if self.storage is not None:
            await self.storage.drain()
            await self.controller.drain()  # backups may have queued nothing new; settle all

    def check_invariants(self) -> None:
        """Assert the cache's internal consistency; raise `InvariantError` if broken (tree
        links and tier states, page ownership by tree or lease, pins per live context)."""
        _invariants.check(self._core)


def _check_group(config: HiCacheConfig, group: TPGroup | None) -> None:
    if group is None:
        if config.tp.size > 1:
            raise ConfigError(f"tp_group: tp_size is {config.tp_size}; pass the ranks' TPGroup")
        return
    if not isinstance(group, TPGroup):
        raise ConfigError(f"tp_group: must be a TPGroup, got {type(group).__name__}")
    if (group.rank, group.size) != (config.tp_rank, config.tp_size):
        raise ConfigError(f"tp_group: is rank {group.rank} of {group.size} but the config says "
                          f"tp_rank={config.tp_rank}, tp_size={config.tp_size}")
