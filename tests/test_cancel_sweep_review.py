"""A deterministic cancellation sweep: every public coroutine, cancelled at EVERY await point.

`tests/test_cancellation.py` cancels each coroutine at one chosen point and the L3 harness
at random ones. Here each scenario (opening and closing a cache, a whole request: fetch with
a load-back from L2 or a prefetch from a ``memory://`` or ``file://`` L3, ``layer_ready`` of
every layer, ``ready``, ``allocate``, ``commit``, a decode step; ``HiCache.allocate`` /
``free`` waiting on write-backs; ``drain``; an event stream; two requests sharing a load)
is run once uncancelled to count the times the caller's task suspends, then once for every
``k`` in ``0..N``, cancelled right at its ``k``-th suspension (``k == 0``: before its first
step). A suspension is the only place asyncio can deliver a cancellation, so this is every
cancellation point of the call, in order, exactly once.

After each cancelled run:

- the cancellation surfaced to the canceller (``Task.cancel``) or the call completed (an
  anyio scope may end quietly when a shielded step completes without another checkpoint);
- every copy settles (``drain`` returns), ``check_invariants`` holds, nothing is leased or
  pinned, nothing is pending, health is ``ok``, and the whole device can be leased;
- every prefix committed (before or during the run) is served right or missed
  (`KVChecker`: KV is a function of the tokens, their positions and their prefix);
- the cache still works: a new request computes, commits and then hits.

A second mode (``steps``) cancels from a sibling task after each of the first loop turns
instead: the same await points, reached while the copies' threads and the workers are at
other stages. Every async test here also runs on uvloop (tests/conftest.py).
``AIOHICACHE_CANCEL_SWEEP_FULL=1`` sweeps every loop turn, not just the first `MAX_TURNS`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
import torch

from aiohicache import CpuTransferEngine, HiCache, HiCacheConfig, TransferHandle
from aiohicache.memory import DevicePool, HostPool, PageIds
from tests.conftest import SPEC_MHA, make_tokens
from tests.kvcheck import KVChecker

FULL = os.environ.get("AIOHICACHE_CANCEL_SWEEP_FULL", "") not in ("", "0")
SETTLE = 5.0
"""Seconds within which a wait that should end at once (drain, a close) counts as hung."""
PS = 4
How = Literal["task", "scope", "timeout", "steps"]
MAX_TURNS = 10_000 if FULL else 40
"""Loop turns a ``steps`` sweep cancels after, at most (the rest of a long copy is waits
on its thread, where every turn looks alike)."""


# ------------------------------------------------------------------------------ cancelling

class _Counted:
    """Awaits `coro`, counting its suspensions; at the `at`-th one calls `cancel()`.

    Called from inside the task's step, right after the coroutine yielded its future: a
    ``Task.cancel()`` then cancels exactly the future that suspension waits for, so the
    cancellation lands at that await point and nowhere else.
    """

    def __init__(self, coro: Coroutine[Any, Any, Any], at: int | None,
                 cancel: Callable[[], object]) -> None:
        self.coro, self.at, self.cancel = coro, at, cancel
        self.suspensions = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        send: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = self.coro.throw(error) if error is not None else self.coro.send(send)
            except StopIteration as stop:
                return stop.value
            self.suspensions += 1
            if self.suspensions == self.at:
                self.cancel()
            try:
                send, error = (yield yielded), None
            except BaseException as exc:
                send, error = None, exc


@dataclass
class Outcome:
    """How one run ended: ``cancelled`` (the cancellation reached the canceller),
    ``completed``, or the exception it raised; and how often the caller suspended."""

    result: str
    suspensions: int
    error: BaseException | None = None
    issued: bool | None = None
    """Whether the cancellation was made (None: made iff the call reached the point)."""


async def run_cancelled_at(aw: Coroutine[Any, Any, Any], at: int | None, how: How) -> Outcome:
    """Run `aw` in its own task, cancelled `how` at its `at`-th suspension (None: never;
    0: before it starts)."""
    try:
        if how == "steps":  # counted in loop turns, cancelled by a sibling
            return await _cancelled_after_turns(aw, at)
        return await _cancelled_at_suspension(aw, at, how)
    finally:
        aw.close()  # one cancelled before its first step never ran: no "never awaited"


async def _cancelled_at_suspension(aw: Coroutine[Any, Any, Any], at: int | None,
                                   how: How) -> Outcome:
    loop = asyncio.get_running_loop()
    cancels: list[Callable[[], object]] = []
    counted = _Counted(aw, at, lambda: cancels[0]())
    scope = anyio.CancelScope()

    async def body() -> None:
        if how == "task":
            cancels.append(asyncio.current_task().cancel)  # type: ignore[union-attr]
            await counted
        elif how == "scope":
            cancels.append(scope.cancel)
            with scope:
                await counted
        else:
            async with asyncio.timeout(None) as timeout:
                cancels.append(lambda: timeout.reschedule(loop.time()))
                await counted

    task = asyncio.ensure_future(body())
    if at == 0:
        task.cancel()  # before its first step: the call never starts
    try:
        async with asyncio.timeout(SETTLE * 2):
            await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return Outcome("cancelled", counted.suspensions)
    except TimeoutError as exc:
        if task.done() and how == "timeout":
            return Outcome("cancelled", counted.suspensions)
        if not task.done():
            task.cancel()
            return Outcome("hung", counted.suspensions, exc)
        return Outcome("raised", counted.suspensions, exc)
    except Exception as exc:  # reported by the sweep, with its k
        return Outcome("raised", counted.suspensions, exc)
    if scope.cancelled_caught:
        return Outcome("cancelled", counted.suspensions)
    return Outcome("completed", counted.suspensions)


async def _cancelled_after_turns(aw: Coroutine[Any, Any, Any], at: int | None) -> Outcome:
    """Run `aw` in a task; a sibling yields `at` loop turns, then cancels it. ``suspensions``
    counts the loop turns the task took (while the copies' threads and the workers move on,
    so a cancellation lands at the same await point at different stages of their work)."""
    task = asyncio.ensure_future(aw)
    turns = 0
    while not task.done() and (at is None or turns < at):
        await asyncio.sleep(0)
        turns += 1
        assert turns < 100_000, "the operation never ends"
    issued = not task.done()
    if issued:
        task.cancel()
    try:
        async with asyncio.timeout(SETTLE * 2):
            await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return Outcome("cancelled", turns, issued=issued)
    except TimeoutError as exc:
        return Outcome("hung" if not task.done() else "raised", turns, exc)
    except Exception as exc:
        return Outcome("raised", turns, exc)
    return Outcome("completed", turns, issued=issued)


# ------------------------------------------------------------------------------ the world

@dataclass
class World:
    """One open cache, the KV checker on it, and every sequence anyone may have committed."""

    cache: HiCache
    kv: KVChecker
    sequences: list[list[int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    async def request(self, tokens: list[int], *, decode: int = 0,
                      layers: bool = True) -> int:
        """One request as a model runs it: every `layer_ready`, `ready`, check the hit,
        `allocate` and compute the rest, `commit`, then `decode` one-token steps
        (allocate + commit each). Returns the cached token count."""
        self.remember(tokens)
        self.remember(tokens + _decode_tokens(tokens, decode))
        async with self.cache.fetch(tokens) as hit:
            if layers:
                for layer in range(self.cache.config.spec.num_layers):
                    await hit.layer_ready(layer)
            await self.kv.verify_prefix(hit, tokens)
            cached = hit.num_cached_tokens
            seq = list(tokens)
            tail = torch.empty(0, dtype=torch.int64)
            if cached < len(seq):
                slots = await hit.allocate(len(seq) - cached)
                self.kv.fill(slots, seq, cached)
                await hit.commit(seq, slots)
                tail = slots[(len(seq) // PS * PS) - cached:] if len(seq) % PS else tail
            for token in _decode_tokens(tokens, decode):
                seq.append(token)
                more = await hit.allocate(1)
                self.kv.fill(more, seq, len(seq) - 1)
                tail = torch.cat([tail, more.to(tail.device)])
                await hit.commit(seq, tail)
                if len(seq) % PS == 0:
                    tail = torch.empty(0, dtype=torch.int64)
            await self.kv.verify_after_commit(hit, seq, tail if len(tail) else None)
        return cached

    def remember(self, tokens: list[int]) -> None:
        if tokens not in self.sequences:
            self.sequences.append(list(tokens))

    async def evict_device(self) -> None:
        """Push every unpinned page off the device (to the host where it has a copy)."""
        await settle(self.cache)
        slots = await self.cache.allocate(self.cache.device_pool.num_slots)
        self.cache.free(slots)

    async def evict_host(self) -> None:
        """Drop every host-only page (after its L3 backup was stored)."""
        await settle(self.cache)
        await self.evict_device()
        self.cache.tree.evict_host(self.cache.host_pool.num_pages)
        self.cache.check_invariants()


def _decode_tokens(tokens: list[int], n: int) -> list[int]:
    return [tokens[-1] + 7_000_001 + i for i in range(n)]


async def settle(cache: HiCache) -> None:
    try:
        async with asyncio.timeout(SETTLE):
            await cache.drain()
    except TimeoutError:
        pytest.fail(f"drain() never returned: a copy was lost ({cache!r})")


async def check_world(world: World, where: str) -> None:
    """Everything settles and nothing leaks; every committed prefix is served right or
    missed; a new request works and then hits."""
    cache = world.cache
    await settle(cache)
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0, f"{where}: {stats.device_pages_leased} pages leased"
    assert stats.pending_loads == stats.pending_writes == 0, f"{where}: copies pending"
    assert not cache._pins, f"{where}: pins left: {cache._pins}"
    assert stats.health == "ok", f"{where}: health {stats.health}"
    slots = await cache.allocate(cache.device_pool.num_slots)  # nothing pinned
    cache.free(slots)
    for tokens in world.sequences:
        async with cache.fetch(tokens) as hit:
            await world.kv.verify_prefix(hit, tokens)
    fresh = make_tokens(9, seed=777)
    world.sequences.append(fresh)
    assert await world.request(fresh) == 0
    assert await world.request(fresh) == 8, f"{where}: a new request's commit was not cached"
    await settle(cache)
    cache.check_invariants()


async def check_outcome(world: World, outcome: Outcome, where: str) -> None:
    await check_world(world, where)


def threaded(device_pool: DevicePool, host_pool: HostPool) -> CpuTransferEngine:
    """The CPU engine with every copy on its thread (none inline): loads and writes really
    are in flight across await points, as on a GPU."""
    return CpuTransferEngine(device_pool, host_pool, inline_bytes=0)


class SlowEngine(CpuTransferEngine):
    """`threaded`, but every copy takes a few milliseconds: under load, the channels of one
    job stay full, so a request's loads and writes wait for room."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool, inline_bytes=0)

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        time.sleep(0.003)
        super()._run(src, dst, handle, to_device)


def config(**overrides: Any) -> HiCacheConfig:
    fields: dict[str, Any] = {"spec": SPEC_MHA, "page_size": PS, "device_pages": 16,
                              "host_pages": 32, "load_back_threshold": 0}
    fields.update(overrides)
    return HiCacheConfig(**fields)


Setup = Callable[[World], Awaitable[None]]
Op = Callable[[World], Coroutine[Any, Any, Any]]


async def open_world(cfg: HiCacheConfig | Callable[[], HiCacheConfig],
                     setup: Setup | None, engine: Any = threaded) -> World:
    cache = HiCache(cfg if isinstance(cfg, HiCacheConfig) else cfg(), engine=engine)
    await cache.__aenter__()
    world = World(cache, KVChecker(cache))
    if setup is not None:
        await setup(world)
        await settle(cache)
    return world


async def close_world(world: World) -> None:
    await world.cache.aclose()
    await asyncio.sleep(0)
    stray = {t for t in asyncio.all_tasks() if not t.done()} - {asyncio.current_task()}
    assert not stray, f"tasks outlive a closed cache: {stray}"


Check = Callable[[World, Outcome, str], Awaitable[None]]


async def sweep(cfg: HiCacheConfig | Callable[[], HiCacheConfig], op: Op, *,
                setup: Setup | None = None, how: How = "task", check: Check | None = None,
                engine: Any = threaded) -> int:
    """Run `op` uncancelled to count its suspensions N, then cancelled at each k in 0..N,
    each on a fresh cache made by `cfg` and `setup`; check the world after each."""
    world = await open_world(cfg, setup, engine)
    try:
        base = await run_cancelled_at(op(world), None, how)
        assert base.result == "completed", f"uncancelled run: {base}"
        await (check or check_outcome)(world, base, "uncancelled")
    finally:
        await close_world(world)
    n = base.suspensions
    print(f"{how}: {n} suspensions")  # noqa: T201 -- shown with -s: the sweep's size
    last = min(n, MAX_TURNS) if how == "steps" else n
    for k in range(last + 1) if how in ("task", "steps") else range(1, last + 1):
        where = f"{how} cancel at suspension {k} of {n}"
        world = await open_world(cfg, setup, engine)
        try:
            outcome = await run_cancelled_at(op(world), k, how)
            assert outcome.result in ("cancelled", "completed"), \
                f"{where}: {outcome.result}: {outcome.error!r}"
            issued = outcome.issued if outcome.issued is not None \
                else outcome.suspensions >= k
            if how in ("task", "steps") and issued:
                assert outcome.result == "cancelled", f"{where}: the cancellation was swallowed"
            await (check or check_outcome)(world, outcome, where)
        finally:
            await close_world(world)
    return n


# ------------------------------------------------------------------------------ scenarios

BASE = make_tokens(12, seed=1)  # three pages
LONG = BASE + make_tokens(6, seed=2)  # continues BASE: one page and a half more


async def computed(world: World) -> None:
    await world.request(BASE)


async def on_host(world: World) -> None:
    await world.request(BASE)
    await world.request(BASE)  # a second hit: the selective policy writes it through now
    await world.evict_device()
    stats = world.cache.stats()
    assert stats.device_pages_used == 0 and stats.host_pages_used == 3


async def on_l3_only(world: World) -> None:
    await on_host(world)
    await world.evict_host()
    assert world.cache.stats().host_pages_used == 0


def request_op(tokens: list[int], decode: int = 0) -> Op:
    def op(world: World) -> Coroutine[Any, Any, Any]:
        return world.request(tokens, decode=decode)
    return op


POLICIES = ["write_through", "write_through_selective", "write_back"]


@pytest.mark.parametrize("policy", POLICIES)
async def test_request_from_device_cancelled_anywhere(policy: str) -> None:
    """A request whose prefix is on the device (fetch, every layer_ready, ready, allocate,
    commit, three decode steps), cancelled at each of its await points (today it never
    suspends, nothing being waited for: only k = 0; an await added later gets swept)."""
    await sweep(config(write_policy=policy), request_op(LONG, decode=3), setup=computed)


@pytest.mark.parametrize("policy", POLICIES)
async def test_request_loading_back_from_host_cancelled_anywhere(policy: str) -> None:
    """A request whose prefix loads back from L2: cancelled at each await point (while the
    load is queued, copying, waited for layer by layer, then allocating and committing)."""
    await sweep(config(write_policy=policy), request_op(LONG, decode=2), setup=on_host)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("l3", ["memory", "file"])
async def test_request_prefetching_from_l3_cancelled_anywhere(
        policy: str, l3: str, tmp_path: Path) -> None:
    """A request whose prefix is only in L3 (``memory://`` or ``file://``): cancelled at each
    await point, including while its prefetch is read and while it is loaded to the device."""
    worlds = iter(range(10_000))

    def fresh() -> HiCacheConfig:  # a store of its own for each world
        url = "memory://" if l3 == "memory" else f"file://{tmp_path}/l3-{next(worlds)}"
        return config(write_policy=policy, storage=url, prefetch_threshold=PS,
                      prefetch_policy="wait_complete")
    await sweep(fresh, request_op(LONG, decode=1), setup=on_l3_only)


async def test_write_back_allocate_and_free_cancelled_anywhere() -> None:
    """`HiCache.allocate` waiting for write-backs to free pages, then `free`: cancelled at
    each await point, nothing stays leased and the written-back KV loads back intact."""
    seqs = [make_tokens(8, seed=s) for s in range(10, 14)]

    async def full(world: World) -> None:
        for tokens in seqs:
            await world.request(tokens)

    async def op(world: World) -> None:
        slots = await world.cache.allocate(12)
        world.cache.free(slots)
    await sweep(config(write_policy="write_back", device_pages=8), op, setup=full)


async def test_context_allocate_waiting_for_write_backs_cancelled_anywhere() -> None:
    """`FetchContext.allocate` of a request continuing a partial page while the device is
    full of write-back KV: cancelled anywhere, the partial page is kept or freed, never
    handed out twice."""
    seqs = [make_tokens(8, seed=s) for s in range(20, 23)]

    async def full(world: World) -> None:
        for tokens in seqs:
            await world.request(tokens)

    await sweep(config(write_policy="write_back", device_pages=8),
                request_op(make_tokens(6, seed=30), decode=5), setup=full)


async def test_drain_cancelled_anywhere() -> None:
    """`drain` with write-throughs and a load in flight: only the wait stops."""
    async def op(world: World) -> None:
        others = [make_tokens(8, seed=s) for s in range(40, 43)]
        for tokens in others:
            world.remember(tokens)
        tasks = [asyncio.ensure_future(world.request(t)) for t in others]
        try:
            await world.cache.drain()
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)
    await sweep(config(), op, setup=on_host)


async def close_opened(world: World, where: str) -> HiCache | None:
    """Close the cache the scenario opened, if it got that far: it must end closed."""
    opened: HiCache | None = world.extra.get("opened")
    if opened is not None:
        await asyncio.wait_for(opened.aclose(), SETTLE)
        assert "closed" in repr(opened), f"{where}: {opened!r}"
    return opened


async def test_open_cancelled_anywhere() -> None:
    """`HiCache.__aenter__` cancelled at each await point: no worker is left running, the
    cache closes, and a new cache works."""
    async def op(world: World) -> None:
        cache = HiCache(config(), engine=threaded)
        world.extra["opened"] = cache
        await cache.__aenter__()

    async def check(world: World, outcome: Outcome, where: str) -> None:
        await close_opened(world, where)
        await check_world(world, where)
    await sweep(config(), op, check=check)


async def test_close_cancelled_anywhere() -> None:
    """`HiCache.aclose` with write-throughs in flight, cancelled at each await point: the
    cache still ends closed, the copies settled; a cache reopened on its store serves it."""
    async def op(world: World) -> None:
        cache = HiCache(config(storage="memory://"), engine=threaded)
        await cache.__aenter__()
        world.extra["opened"] = cache
        kv = KVChecker(cache)
        async with cache.fetch(BASE) as hit:
            slots = await hit.allocate(len(BASE))
            kv.fill(slots, BASE)
            await hit.commit(BASE, slots)
        await cache.aclose()

    async def check(world: World, outcome: Outcome, where: str) -> None:
        opened = await close_opened(world, where)
        if opened is not None:
            opened.check_invariants()
            assert opened.stats().pending_writes == 0
        await check_world(world, where)
    await sweep(config(), op, check=check)


async def test_two_requests_sharing_a_load_one_cancelled_anywhere() -> None:
    """Single flight under cancellation: a second request joins the first one's load-back;
    cancelling the first at each of its await points leaves the second served right."""
    async def op(world: World) -> None:
        world.extra["other"] = asyncio.ensure_future(world.request(LONG))
        await world.request(LONG, decode=1)

    async def check(world: World, outcome: Outcome, where: str) -> None:
        if (other := world.extra.get("other")) is not None:
            async with asyncio.timeout(SETTLE):
                await other  # never cancelled: must complete, its hit verified
        await check_world(world, where)
    await sweep(config(), op, setup=on_host, check=check)


async def test_event_stream_read_cancelled_anywhere() -> None:
    """Reading an event stream (with a snapshot first) cancelled at each await point loses
    no batch: read on, the stream yields the snapshot and then batches whose seqs continue
    without a gap."""
    async def subscribed(world: World) -> None:
        await computed(world)
        world.extra["stream"] = world.cache.events(snapshot=True)
        world.extra["got"] = []

    async def op(world: World) -> None:
        stream = world.extra["stream"]
        await world.request(make_tokens(8, seed=50))
        async for batch in stream:
            world.extra["got"].append(batch)
            if len(world.extra["got"]) >= 2:
                break

    async def check(world: World, outcome: Outcome, where: str) -> None:
        stream, got = world.extra["stream"], world.extra["got"]
        await world.request(make_tokens(8, seed=51))  # news, whether or not the op ran
        while len(got) < 2:
            async with asyncio.timeout(SETTLE):
                got.append(await stream.__anext__())
        assert got[0].seq == -1, f"{where}: the snapshot batch was lost"
        seqs = [b.seq for b in got[1:]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"{where}: gap {seqs}"
        await stream.aclose()
        await check_world(world, where)
    await sweep(config(), op, setup=subscribed, check=check)


@pytest.mark.parametrize("how", ["scope", "timeout"])
async def test_request_loading_back_cancelled_anywhere_by_scope_or_timeout(how: How) -> None:
    """The load-back request, cancelled at each await point by an anyio cancel scope or an
    expiring ``asyncio.timeout`` (delivered one loop turn later than ``Task.cancel``)."""
    await sweep(config(write_policy="write_back"), request_op(LONG, decode=2),
                setup=on_host, how=how)


# ------------------------------------------------------------------------------ under load

HOSTED = [make_tokens(8, seed=s) for s in range(60, 64)]


async def many_on_host(world: World) -> None:
    await on_host(world)
    for tokens in HOSTED:
        await world.request(tokens)
        await world.request(tokens)
    await world.evict_device()


def busy_op(decode: int) -> Op:
    """Three other requests (never cancelled) load back and write through beside the swept
    one, through channels of one job: its loads and writes wait for room."""
    def op(world: World) -> Coroutine[Any, Any, Any]:
        async def run() -> None:
            others = [asyncio.ensure_future(world.request([*t, 5, 6, 7, 8, 9]))
                      for t in HOSTED[:3]]
            world.extra["others"] = others
            while world.cache.stats().pending_loads < 2:  # noqa: ASYNC110 -- no event to await
                await asyncio.sleep(0)  # the others' loads fill the channel first
            await world.request(LONG, decode=decode)
        return run()
    return op


async def check_busy(world: World, outcome: Outcome, where: str) -> None:
    async with asyncio.timeout(SETTLE):
        for other in world.extra.get("others", []):
            await other  # never cancelled: each completes, its hit verified
    await check_world(world, where)


@pytest.mark.parametrize("how", ["task", "steps"])
@pytest.mark.parametrize("policy", POLICIES)
async def test_request_under_backpressure_cancelled_anywhere(policy: str, how: How) -> None:
    """A load-back request among others, with one-job load and write channels, cancelled at
    each of its await points (``task``) or after each loop turn (``steps``)."""
    cfg = config(write_policy=policy, max_inflight_loads=1, max_inflight_writes=1)
    await sweep(cfg, busy_op(decode=2), setup=many_on_host, how=how, check=check_busy,
                engine=SlowEngine)


@pytest.mark.parametrize("l3", ["memory", "file"])
@pytest.mark.parametrize("prefetch", ["wait_complete", "timeout", "best_effort"])
async def test_l3_request_cancelled_after_every_loop_turn(
        l3: str, prefetch: str, tmp_path: Path) -> None:
    """A request whose prefix is only in L3, cancelled after each loop turn: while the
    prefetch reads the store on its threads, lands in L2, and loads to the device."""
    worlds = iter(range(10_000))

    def fresh() -> HiCacheConfig:
        url = "memory://" if l3 == "memory" else f"file://{tmp_path}/l3-{next(worlds)}"
        return config(storage=url, prefetch_threshold=PS, prefetch_policy=prefetch)
    await sweep(fresh, request_op(LONG, decode=1), setup=on_l3_only, how="steps")


@pytest.mark.parametrize("policy", POLICIES)
async def test_load_back_request_cancelled_after_every_loop_turn(policy: str) -> None:
    """The load-back request cancelled after each loop turn."""
    await sweep(config(write_policy=policy), request_op(LONG, decode=2), setup=on_host,
                how="steps")


@pytest.mark.parametrize("how", ["scope", "timeout"])
async def test_request_under_backpressure_cancelled_anywhere_by_scope_or_timeout(
        how: How) -> None:
    """The busy load-back request, cancelled by an anyio cancel scope (which re-delivers its
    cancellation every turn until the scope exits) or an expiring ``asyncio.timeout``."""
    cfg = config(write_policy="write_back", max_inflight_loads=1, max_inflight_writes=1)
    await sweep(cfg, busy_op(decode=2), setup=many_on_host, how=how, check=check_busy,
                engine=SlowEngine)


@pytest.mark.parametrize("how", ["task", "steps"])
async def test_drain_with_l3_backups_in_flight_cancelled_anywhere(
        how: How, tmp_path: Path) -> None:
    """`drain` while write-throughs and their L3 backups (``file://``) are in flight,
    cancelled anywhere: only the wait stops; the backups still land (a fresh cache on the
    store is served them)."""
    worlds = iter(range(10_000))
    stores: list[str] = []

    def fresh() -> HiCacheConfig:
        stores.append(f"file://{tmp_path}/l3-{next(worlds)}")
        return config(storage=stores[-1], prefetch_threshold=PS,
                      prefetch_policy="wait_complete")

    async def op(world: World) -> None:
        world.extra["store"] = stores[-1]
        for tokens in HOSTED:
            await world.request(tokens)
        await world.cache.drain()

    async def check(world: World, outcome: Outcome, where: str) -> None:
        await check_world(world, where)
        done = [t for t in HOSTED if t in world.sequences]
        cache = HiCache(config(storage=world.extra.get("store", stores[-1]),
                               prefetch_threshold=PS, prefetch_policy="wait_complete"))
        async with cache:  # reads the same store: every settled backup is served right
            kv = KVChecker(cache)
            for tokens in done:
                async with cache.fetch(tokens) as hit:
                    await kv.verify_prefix(hit, tokens)
    await sweep(fresh, op, how=how, check=check)


async def test_long_prompt_hashed_on_a_thread_cancelled_anywhere(tmp_path: Path) -> None:
    """A prompt long enough that its L3 keys are hashed on a thread, its prefix in L3 only:
    cancelled at each await point (while hashing, prefetching, loading, computing)."""
    long = make_tokens(8200, seed=70)

    async def stored(world: World) -> None:
        await world.request(long[:64])
        await world.evict_host()

    def fresh() -> HiCacheConfig:
        return config(storage="memory://", device_pages=2100, host_pages=2100,
                      prefetch_threshold=PS, prefetch_policy="wait_complete")
    await sweep(fresh, request_op(long), setup=stored)
