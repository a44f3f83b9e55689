"""Cancellation: every public coroutine, cancelled mid-flight, leaves the cache consistent.

Design rule 4: a cancelled request releases its pins and leases, transfers it started go on
(and stay shared with other requests), and nothing is lost or leaked. Each test here blocks an
operation for real, cancels it, then checks that

- every transfer still settles (`drain()` returns) and the invariants hold;
- nothing stays pinned or leased (the whole device pool can be leased afterwards);
- a later, ordinary fetch of the same tokens returns exactly the KV that was computed.

Operations are blocked without sleeps: a `GatedEngine` holds every copy on a threading.Event
until the test opens the gate, so loads and writes are genuinely in flight, and channel
capacities of one job make queueing block. Each test runs with three ways to cancel, as a
serving framework would: `Task.cancel()`, an `asyncio.timeout` expiring, and an anyio cancel
scope. The cancellation must surface to the canceller (it may be deferred, never swallowed).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import pytest
import torch

from aiohicache import ClosedError, CpuTransferEngine, FetchContext, HiCache, TransferHandle
from aiohicache.memory import PageIds
from tests.conftest import fill_kv, make_config, make_tokens, prefill, read_kv

How = Literal["task.cancel", "asyncio.timeout", "anyio.CancelScope"]
SETTLE_LIMIT = 2.0
"""Seconds after which a wait that should finish at once counts as hung (a lost transfer)."""


@pytest.fixture(params=["task.cancel", "asyncio.timeout", "anyio.CancelScope"])
def how(request: pytest.FixtureRequest) -> How:
    """The way a test cancels its operation."""
    return request.param  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ the gated engine

class GatedEngine(CpuTransferEngine):
    """The CPU engine, but every copy waits on its direction's gate before moving a byte.

    Gates start open. Closing `loads` (or `writes`) keeps the next copies genuinely in flight
    on the engine's worker thread until the test opens it again. Every handle is recorded.
    """

    def __init__(self) -> None:  # pools are bound in `attach`, once the cache has made them
        self.loads = threading.Event()
        self.writes = threading.Event()
        self.open_gates()
        self.load_handles: list[TransferHandle] = []
        self.write_handles: list[TransferHandle] = []

    def attach(self, cache: HiCache) -> None:
        super().__init__(cache.device_pool, cache.host_pool, inline_bytes=0)  # all on threads

    def open_gates(self) -> None:
        self.loads.set()
        self.writes.set()

    def load(self, host_pages: PageIds, device_pages: PageIds) -> TransferHandle:
        handle = super().load(host_pages, device_pages)
        self.load_handles.append(handle)
        return handle

    def write(self, device_pages: PageIds, host_pages: PageIds) -> TransferHandle:
        handle = super().write(device_pages, host_pages)
        self.write_handles.append(handle)
        return handle

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        (self.loads if to_device else self.writes).wait()
        super()._run(src, dst, handle, to_device)


@asynccontextmanager
async def gated_cache(**overrides: Any) -> AsyncIterator[tuple[HiCache, GatedEngine]]:
    """An open cache on a `GatedEngine`, with room for one queued load and one queued write."""
    fields: dict[str, Any] = {"max_inflight_loads": 1, "max_inflight_writes": 1}
    fields.update(overrides)
    engine = GatedEngine()
    cache = HiCache(make_config(**fields), engine=engine)
    engine.attach(cache)
    await cache.__aenter__()
    failed = False
    try:
        yield cache, engine
    except BaseException:
        failed = True
        raise
    finally:
        engine.open_gates()
        settled = False
        try:
            async with asyncio.timeout(0.5 if failed else SETTLE_LIMIT):
                await cache.drain()
            settled = True
        except TimeoutError:
            if not failed:
                pytest.fail("drain() never returned: a planned transfer was lost")
        finally:
            if not settled:
                abandon_transfers(cache)
            await cache.aclose()


def abandon_transfers(cache: HiCache) -> None:
    """After a failure that lost a transfer: let `aclose()` skip waiting (60 s) for it."""
    async def return_at_once() -> None:
        pass
    cache.controller.drain = return_at_once  # type: ignore[method-assign]


# ------------------------------------------------------------------------------ cancelling

@dataclass
class Flight:
    """An operation running in its own task, to be cancelled in one of the three ways."""

    task: asyncio.Task[Any]
    how: How
    _cancel: list[Callable[[], object]] = field(default_factory=list)
    _scope: anyio.CancelScope | None = None

    def cancel(self) -> None:
        assert not self.task.done(), "the operation finished before it could be cancelled"
        self._cancel[0]()

    async def outcome(self) -> Literal["cancelled", "completed"]:
        """Wait for the task; say whether the cancellation reached the canceller."""
        try:
            await self.task
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            if self.how != "asyncio.timeout":
                raise
            return "cancelled"
        if self._scope is not None and self._scope.cancelled_caught:
            return "cancelled"
        return "completed"

    async def cancelled(self) -> None:
        """Wait for the task and require the cancellation to surface: deferred, not swallowed.

        (An anyio scope may legitimately end quietly when a shielded operation completes
        without another checkpoint; it is not held to this.)
        """
        result = await self.outcome()
        if self.how != "anyio.CancelScope":
            assert result == "cancelled", "the operation swallowed its cancellation"


async def launch(aw: Coroutine[Any, Any, Any], how: How, *,
                 first_suspension: bool = False) -> Flight:
    """Run `aw` in a task until it blocks (every task waits), ready to be cancelled.

    With `first_suspension`, stop instead right where `aw` first yields to the event loop.
    """
    loop = asyncio.get_running_loop()
    flight: Flight
    if how == "task.cancel":
        task = asyncio.ensure_future(aw)
        flight = Flight(task, how, [task.cancel])
    elif how == "asyncio.timeout":
        async def with_timeout() -> Any:
            async with asyncio.timeout(None) as timeout:
                flight._cancel.append(lambda: timeout.reschedule(loop.time()))
                return await aw
        flight = Flight(asyncio.ensure_future(with_timeout()), how)
    else:
        scope = anyio.CancelScope()

        async def in_scope() -> Any:
            with scope:
                return await aw
        flight = Flight(asyncio.ensure_future(in_scope()), how, [scope.cancel], scope)
    if first_suspension:
        await asyncio.sleep(0)  # one turn of the loop: the task runs up to its first await
    else:
        await anyio.wait_all_tasks_blocked()
    return flight

async def cancel_the_one_that_waits(request: Callable[[list[int]], Coroutine[Any, Any, Any]],
                                    how: How, *, waiting: Callable[[list[int]], bool],
                                    gate: threading.Event, what: str) -> list[Flight]:
    """Launch `request` for each of SEQS until one waits for room (`waiting`), cancel that
    one, open the engine's `gate`; return the others, each checked to have completed."""
    flights = []
    for tokens in SEQS:
        flights.append(await launch(request(tokens), how))
        if waiting(tokens):
            break
    else:
        pytest.fail(f"the {what} queue never filled up")
    blocked = flights.pop()
    blocked.cancel()
    await anyio.wait_all_tasks_blocked()
    gate.set()
    await blocked.cancelled()
    for other in flights:
        assert await other.outcome() == "completed"
    return flights



# ------------------------------------------------------------------------------ checks

_reference: dict[Any, HiCache] = {}


def expected_kv(cache: HiCache, tokens: list[int]) -> torch.Tensor:
    """The KV `fill_kv` computes for `tokens`, as `read_kv` returns it (built in an unopened
    scratch cache of the same layout)."""
    key = (cache.config.spec, cache.config.page_size)
    if key not in _reference:
        _reference[key] = HiCache(make_config(spec=cache.config.spec,
                                              page_size=cache.config.page_size,
                                              device_pages=64, host_pages=1))
    ref = _reference[key]
    slots = torch.arange(len(tokens), dtype=torch.int64)
    fill_kv(ref, slots, tokens)
    return read_kv(ref, slots)


def assert_kv(cache: HiCache, hit: FetchContext, tokens: list[int]) -> None:
    """The cached prefix of `hit` holds exactly the KV computed for its tokens."""
    n = hit.num_cached_tokens
    got = read_kv(cache, hit.device_indices[:n])
    assert torch.equal(got, expected_kv(cache, tokens[:n])), "wrong KV served"


async def drained(cache: HiCache) -> None:
    try:
        async with asyncio.timeout(SETTLE_LIMIT):
            await cache.drain()
    except TimeoutError:
        pytest.fail("drain() never returned: a planned transfer was lost")


async def assert_clean(cache: HiCache) -> None:
    """Transfers settle, invariants hold, and nothing is left pinned or leased."""
    await drained(cache)
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0
    assert stats.pending_loads == stats.pending_writes == 0
    assert stats.health == "ok"
    slots = await cache.allocate(cache.device_pool.num_slots)  # needs every page unpinned
    cache.free(slots)
    cache.check_invariants()


async def assert_fetch_returns_computed_kv(cache: HiCache, *sequences: list[int]) -> None:
    """An ordinary request for each sequence gets exactly the KV computed for it."""
    for tokens in sequences:
        kv = await prefill(cache, tokens)
        full = len(tokens) // cache.config.page_size * cache.config.page_size
        assert kv.shape[1] == full, "a computed prefix was not cached"
        assert torch.equal(kv, expected_kv(cache, tokens[:full])), "wrong KV after cancellation"
    cache.check_invariants()


async def evict_all(cache: HiCache) -> None:
    """Move every unpinned node off the device (to the host where it has a copy)."""
    await drained(cache)
    slots = await cache.allocate(cache.device_pool.num_slots)
    cache.free(slots)


async def host_only(cache: HiCache, *sequences: list[int]) -> None:
    """Compute `sequences` and leave their KV on the host only (load-back on the next fetch)."""
    for tokens in sequences:
        await prefill(cache, tokens)
    await evict_all(cache)
    assert cache.stats().device_pages_used == 0


def user_tasks(exclude: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if not t.done()} - exclude


SEQS = [make_tokens(4, seed=s) for s in range(1, 9)]
"""One page each (page_size 4): distinct prefixes whose loads and writes are separate jobs."""


# ------------------------------------------------------------------------------ HiCache

async def test_cancelled_open_leaves_no_worker_task_behind(how: How) -> None:
    """`HiCache.__aenter__` cancelled while it waits for its workers to start: no task started
    by it outlives it, and the cache can still be closed."""
    cache = HiCache(make_config())
    before = asyncio.all_tasks()
    flight = await launch(cache.__aenter__(), how, first_suspension=True)
    flight.cancel()
    await flight.cancelled()
    leftover = user_tasks(before | {flight.task})
    await cache.aclose()
    assert not leftover, f"tasks outlive a cancelled open: {leftover}"
    cache.check_invariants()


async def test_cancelled_close_still_closes_the_cache(how: How) -> None:
    """`HiCache.aclose` is shielded: cancelled while it drains an in-flight write, it still
    settles the write, stops the workers and ends closed."""
    before = asyncio.all_tasks()
    async with gated_cache() as (cache, engine):
        engine.writes.clear()
        await prefill(cache, SEQS[0])  # its write-through is now in flight
        flight = await launch(cache.aclose(), how)
        assert engine.write_handles and not engine.write_handles[-1].done()
        flight.cancel()
        await anyio.wait_all_tasks_blocked()
        engine.writes.set()
        await flight.cancelled()
        assert "closed" in repr(cache), f"cancelled close left {cache!r}"
        leftover = user_tasks(before | {flight.task})
        assert not leftover, f"tasks outlive a cancelled close: {leftover}"
        assert engine.write_handles[-1].done()
        cache.check_invariants()
        with pytest.raises(ClosedError):
            async with cache.fetch(SEQS[0]):
                pass
        await cache.aclose()  # idempotent


async def test_cancelled_allocate_leases_nothing(how: How) -> None:
    """`HiCache.allocate` cancelled while it waits for write-backs to free pages: nothing is
    leased, the write-backs go on, and the written-back KV loads back intact."""
    async with gated_cache(write_policy="write_back", device_pages=4) as (cache, engine):
        for tokens in SEQS[:4]:
            await prefill(cache, tokens)  # the device is full of KV that exists nowhere else
        engine.writes.clear()
        flight = await launch(cache.allocate(8), how)  # stages two write-backs, waits for them
        assert cache.stats().pending_writes > 0
        flight.cancel()
        await flight.cancelled()
        assert cache.stats().device_pages_leased == 0
        engine.writes.set()
        await assert_clean(cache)
        await assert_fetch_returns_computed_kv(cache, *SEQS[:4])


async def test_cancelled_drain_cancels_only_the_wait(how: How) -> None:
    """`HiCache.drain` cancelled while a write is in flight: the write goes on and settles."""
    async with gated_cache() as (cache, engine):
        engine.writes.clear()
        await prefill(cache, SEQS[0])
        flight = await launch(cache.drain(), how)
        flight.cancel()
        await flight.cancelled()
        handle = engine.write_handles[-1]
        assert not handle.done()
        engine.writes.set()
        await handle.wait()
        await assert_clean(cache)
        await evict_all(cache)  # now host-only: the fetch below loads the written copy
        await assert_fetch_returns_computed_kv(cache, SEQS[0])


# ------------------------------------------------------------------------------ fetch (__aenter__)

async def test_request_cancelled_while_its_load_is_queued_unpins_and_the_load_still_runs(
        how: How) -> None:
    """`FetchContext.__aenter__` cancelled while queueing its load-back (the load queue is
    full): the load is still queued and settles, the request unpins, a later fetch is right."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, *SEQS)
        engine.loads.clear()
        entered: list[list[int]] = []

        async def request(tokens: list[int]) -> None:
            async with cache.fetch(tokens) as hit:
                entered.append(tokens)
                await hit.ready()

        # fill the load queue until a fetch has to wait for room
        await cancel_the_one_that_waits(
            request, how, waiting=lambda tokens: tokens not in entered,
            gate=engine.loads, what="load")
        await assert_clean(cache)
        await assert_fetch_returns_computed_kv(cache, *SEQS)


async def test_request_cancelled_while_its_load_is_in_flight_unpins(how: How) -> None:
    """A request cancelled while its load-back is copying: the context exits and unpins, the
    load settles, and the loaded KV serves the next request."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, SEQS[0])
        engine.loads.clear()

        async def request() -> None:
            async with cache.fetch(SEQS[0]) as hit:
                assert hit.num_host_hit_tokens == 4
                await hit.ready()

        flight = await launch(request(), how)
        assert len(engine.load_handles) == 1 and not engine.load_handles[0].done()
        flight.cancel()
        await flight.cancelled()
        engine.loads.set()
        await drained(cache)
        async with cache.fetch(SEQS[0]) as hit:
            assert hit.num_device_hit_tokens == 4, "the cancelled request's load was wasted"
            assert_kv(cache, hit, SEQS[0])
        await assert_clean(cache)


# ------------------------------------------------------------------------------ waits

@pytest.mark.parametrize("wait", ["layer_ready", "ready"])
async def test_cancelled_wait_for_a_load_cancels_only_the_wait(how: How, wait: str) -> None:
    """`FetchContext.layer_ready` / `ready` cancelled while the load copies: the load goes on,
    the context stays usable, and waiting again returns the right KV."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, SEQS[0])
        engine.loads.clear()
        async with cache.fetch(SEQS[0]) as hit:
            waiter = hit.layer_ready(0) if wait == "layer_ready" else hit.ready()
            flight = await launch(waiter, how)
            flight.cancel()
            await flight.cancelled()
            assert not engine.load_handles[0].done()
            engine.loads.set()
            await hit.layer_ready(0)
            await hit.ready()
            assert_kv(cache, hit, SEQS[0])
        await assert_clean(cache)


async def test_cancelled_wait_for_a_load_still_queued_cancels_only_the_wait(how: How) -> None:
    """`layer_ready` cancelled while its load is queued behind others (not yet launched)."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, *SEQS[:3])
        engine.loads.clear()
        contexts = [cache.fetch(tokens) for tokens in SEQS[:3]]
        for ctx in contexts:
            await ctx.__aenter__()
            await anyio.wait_all_tasks_blocked()
        try:
            assert len(engine.load_handles) == 2, "expected two loads launched, one queued"
            queued = contexts[2]
            flight = await launch(queued.layer_ready(0), how)
            flight.cancel()
            await flight.cancelled()
            engine.loads.set()
            for ctx, tokens in zip(contexts, SEQS, strict=False):
                await ctx.ready()
                assert_kv(cache, ctx, tokens)
        finally:
            for ctx in contexts:
                await ctx.__aexit__(None, None, None)
        await assert_clean(cache)


@pytest.mark.parametrize("wait", ["wait", "wait_layer"])
async def test_cancelled_handle_wait_does_not_cancel_the_copy(how: How, wait: str) -> None:
    """`TransferHandle.wait` / `wait_layer` cancelled mid-copy: the copy completes and every
    other waiter (the request's own `ready`) sees it."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, SEQS[0])
        engine.loads.clear()
        async with cache.fetch(SEQS[0]) as hit:
            await anyio.wait_all_tasks_blocked()  # the load worker launches the copy
            handle = engine.load_handles[0]
            other = asyncio.ensure_future(hit.ready())
            flight = await launch(handle.wait() if wait == "wait" else handle.wait_layer(1), how)
            flight.cancel()
            await flight.cancelled()
            assert not handle.done() and not other.done()
            engine.loads.set()
            await other
            await handle.wait()
            await handle.wait_layer(1)
            assert_kv(cache, hit, SEQS[0])
        await assert_clean(cache)


async def test_cancelling_one_waiter_of_a_shared_load_keeps_the_other_waiting(how: How) -> None:
    """Single-flight survives cancellation: two requests share one load; cancelling the first
    request (its wait and its context) leaves the second one's wait intact."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, SEQS[0])
        engine.loads.clear()
        second_kv: list[torch.Tensor] = []

        async def request(keep: list[torch.Tensor] | None) -> None:
            async with cache.fetch(SEQS[0]) as hit:
                assert hit.num_cached_tokens == 4
                await hit.ready()
                if keep is not None:
                    keep.append(read_kv(cache, hit.device_indices))

        first = await launch(request(None), how)
        second = asyncio.ensure_future(request(second_kv))
        await anyio.wait_all_tasks_blocked()
        assert len(engine.load_handles) == 1, "the second request did not join the first's load"
        first.cancel()
        await first.cancelled()
        assert not second.done()
        engine.loads.set()
        await second
        assert torch.equal(second_kv[0], expected_kv(cache, SEQS[0]))
        await assert_clean(cache)


# ------------------------------------------------------------------------------ allocate, commit

async def test_cancelled_context_allocate_leases_nothing_and_keeps_the_partial_page(
        how: How) -> None:
    """`FetchContext.allocate` cancelled while it waits for write-backs: nothing is leased,
    and the next allocate still continues the page a partial commit left half full."""
    async with gated_cache(write_policy="write_back", device_pages=4) as (cache, engine):
        for tokens in SEQS[:2]:
            await prefill(cache, tokens)
        tokens = make_tokens(9, seed=99)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(6)  # the device is now full
            fill_kv(cache, slots, tokens[:6])
            await hit.commit(tokens[:6], slots)  # page 2 stays leased, half full
            leased = cache.stats().device_pages_leased
            engine.writes.clear()
            flight = await launch(hit.allocate(3), how)  # 2 slots of page 2 + a page to free
            flight.cancel()
            await flight.cancelled()
            assert cache.stats().device_pages_leased == leased
            engine.writes.set()
            await drained(cache)
            more = await hit.allocate(3)
            assert torch.equal(more[:2], slots[4:6] + 2), "the partial page was skipped"
            fill_kv(cache, more, tokens[6:])
            await hit.commit(tokens, torch.cat([slots[4:6], more]))
            assert_kv(cache, hit, tokens)
        await assert_clean(cache)
        await assert_fetch_returns_computed_kv(cache, tokens, *SEQS[:2])


async def test_commit_cancelled_while_its_write_through_is_queued_still_writes(
        how: How) -> None:
    """`FetchContext.commit` cancelled while queueing its write-through (the write queue is
    full): the insert stands, the write is still queued and settles, and after eviction the
    host copy loads back intact."""
    async with gated_cache() as (cache, engine):
        engine.writes.clear()
        committing: list[list[int]] = []
        committed: list[list[int]] = []

        async def request(tokens: list[int]) -> None:
            async with cache.fetch(tokens) as hit:
                slots = await hit.allocate(len(tokens))
                fill_kv(cache, slots, tokens)
                committing.append(tokens)
                await hit.commit(tokens, slots)
                committed.append(tokens)

        # fill the write queue until a commit has to wait for room
        flights = await cancel_the_one_that_waits(
            request, how, waiting=lambda tokens: tokens in committing and tokens not in committed,
            gate=engine.writes, what="write")
        await assert_clean(cache)
        written = SEQS[:len(flights) + 1]
        assert cache.stats().host_pages_used == len(written), "a write-through was dropped"
        await evict_all(cache)
        await assert_fetch_returns_computed_kv(cache, *written)


async def test_request_cancelled_while_queueing_the_write_through_its_hit_started(
        how: How) -> None:
    """`FetchContext.__aenter__` cancelled while queueing a write-through (selective policy:
    the fetch is the hit that reaches the threshold; the write queue is full): the write is
    still queued and settles, the request unpins, and the host copy loads back intact."""
    async with gated_cache(write_policy="write_through_selective") as (cache, engine):
        for tokens in SEQS:
            await prefill(cache, tokens)  # one hit each: nothing written yet
        assert cache.stats().host_pages_used == 0
        engine.writes.clear()
        entered: list[list[int]] = []

        async def request(tokens: list[int]) -> None:
            async with cache.fetch(tokens):  # the second hit: starts the write-through
                entered.append(tokens)

        # fill the write queue until a fetch has to wait for room
        flights = await cancel_the_one_that_waits(
            request, how, waiting=lambda tokens: tokens not in entered,
            gate=engine.writes, what="write")
        await assert_clean(cache)
        written = SEQS[:len(flights) + 1]
        assert cache.stats().host_pages_used == len(written), "a write-through was dropped"
        await evict_all(cache)
        await assert_fetch_returns_computed_kv(cache, *written)


# ------------------------------------------------------------------------------ errors

async def test_context_exited_by_an_exception_unpins_and_frees_its_leases() -> None:
    """A request that raises inside its fetch context (with a load in flight and slots
    leased) unpins and frees its slots; the load still settles and serves the next request."""
    async with gated_cache() as (cache, engine):
        await host_only(cache, SEQS[0])
        engine.loads.clear()
        with pytest.raises(RuntimeError, match="model crashed"):
            async with cache.fetch([*SEQS[0], 5, 6, 7]) as hit:
                assert hit.num_cached_tokens == 4
                await hit.allocate(3)
                assert cache.stats().device_pages_leased == 1
                raise RuntimeError("model crashed")
        assert cache.stats().device_pages_leased == 0
        engine.loads.set()
        await assert_clean(cache)
        await assert_fetch_returns_computed_kv(cache, SEQS[0], [*SEQS[0], 5, 6, 7])


def test_every_public_coroutine_is_covered() -> None:
    """This module names a test for each public coroutine; a new one needs a test here."""
    public = {f"{cls.__name__}.{name}" for cls in (HiCache, FetchContext, TransferHandle)
              for name, member in vars(cls).items()
              if inspect.iscoroutinefunction(member)
              and (not name.startswith("_") or name in ("__aenter__", "__aexit__"))}
    covered = {"HiCache.__aenter__", "HiCache.__aexit__", "HiCache.aclose", "HiCache.allocate",
               "HiCache.drain", "FetchContext.__aenter__", "FetchContext.__aexit__",
               "FetchContext.layer_ready", "FetchContext.ready", "FetchContext.allocate",
               "FetchContext.commit", "TransferHandle.wait", "TransferHandle.wait_layer"}
    assert public <= covered, f"public coroutines without a cancellation test: {public - covered}"
