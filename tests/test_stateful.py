"""Model-based, stateful tests: random operation sequences against a real, small `HiCache`.

A `RuleBasedStateMachine` drives fetch / allocate / commit / free / drain / eviction on a CPU
cache with a handful of device and host pages, so eviction, demotion, load-back, write-through
and write-back all happen within a few steps. Token sequences come from a few shared prefixes,
so they overlap heavily and nodes split and merge all the time.

After every step the cache's own invariants must hold, and a model checks correctness: KV in
the device pool only ever comes from `fill_kv`, which derives it from token ids, so any prefix
the cache reports as cached must hold exactly `fill_kv`'s values for those tokens (bit-exact),
and it must be a prefix some request committed. The cache may forget; it must never return
wrong KV, and never report a hit for tokens nobody computed.

Rules are synchronous, so each machine owns a fresh event loop (asyncio or uvloop) and runs
every coroutine to completion on it. Copies run on the engine's threads (held back by a
random jitter) while requests go on, so loads and writes are in flight while other requests
match, pin, evict and commit; `concurrent_requests` runs several requests at once, and open
requests keep their pins across steps. Most machines let every copy settle between steps, so
a failing example replays the same way and shrinks well; the `...Racy` ones keep copies in
flight across steps for more interleavings (see `SETTLE_BETWEEN_STEPS`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
import uvloop
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiohicache import (
    CapacityError,
    CpuTransferEngine,
    FetchContext,
    HiCache,
    HiCacheConfig,
    KVSpec,
    TransferHandle,
)
from aiohicache.memory import PageIds
from tests.conftest import fill_kv, make_config, read_kv

T = TypeVar("T")

# Token ids stay below 100: fill_kv's values (t/2 + 7*layer + 3*kv) are then exact and
# distinct per token in bf16, so a page holding another token's KV can never compare equal.
PREFIXES: tuple[tuple[int, ...], ...] = (
    tuple(range(1, 13)),
    (*range(1, 7), *range(20, 26)),       # shares 6 tokens with the first
    (*range(1, 3), *range(30, 40)),       # shares 2 tokens (mid-page for page_size 4)
    tuple(range(50, 62)),
)
SUFFIX_TOKENS = st.integers(min_value=70, max_value=75)  # few values: suffixes collide too
POISON_TOKEN = 99
"""Leased slots are filled with this token's KV: if the cache ever hands out a page it still
serves as cached KV, the model check sees the poison."""

CHOICE = st.integers(min_value=0, max_value=2**16)
"""Picks among things that exist only at run time (modulo their number): drawing it never
depends on the machine's state, which copy timing may change between runs of one example."""

sequences = st.tuples(
    st.sampled_from(PREFIXES), st.integers(min_value=0, max_value=12),
    st.lists(SUFFIX_TOKENS, max_size=6),
).map(lambda p: (*p[0][:p[1]], *p[2])).filter(len)
"""Token sequences: a cut of a shared prefix plus a short suffix."""

_reference: dict[tuple[KVSpec, int], HiCache] = {}


def expected_kv(config: HiCacheConfig, tokens: tuple[int, ...]) -> torch.Tensor:
    """What `read_kv` must return for the cached slots of `tokens`: `fill_kv`'s encoding,
    produced in the pool of an unopened scratch cache of the same layout."""
    key = (config.spec, config.page_size)
    ref = _reference.get(key)
    if ref is None:
        ref = _reference[key] = HiCache(make_config(
            spec=config.spec, page_size=config.page_size, device_pages=64, host_pages=1))
    slots = torch.arange(len(tokens), dtype=torch.int64)
    fill_kv(ref, slots, list(tokens))
    return read_kv(ref, slots)


async def _return_at_once() -> None:
    pass


class JitteryEngine(CpuTransferEngine):
    """The CPU engine, each copy on a worker thread held back 0-1 ms (or, with `inline`, the
    engine's own choice: small copies run on the event loop when their stream is idle).

    Copies then finish at varied points relative to the event loop and to each other's
    settling, so race windows (a node still LOADING or WRITING while other requests match,
    pin or evict it) stay open long enough for the rules to hit them.
    """

    def __init__(self, seed: int, *, inline: bool) -> None:  # pools are bound in `attach`
        self._rng = random.Random(seed)
        self._inline = inline

    def attach(self, cache: HiCache) -> None:
        if self._inline:
            super().__init__(cache.device_pool, cache.host_pool)
        else:
            super().__init__(cache.device_pool, cache.host_pool, inline_bytes=0)

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             loop: asyncio.AbstractEventLoop, to_device: bool) -> None:
        time.sleep(self._rng.random() * 0.001)
        super()._run(src, dst, handle, loop, to_device)


@dataclass
class OpenRequest:
    """A fetch context kept open across steps, like a request still decoding."""

    ctx: FetchContext
    tokens: tuple[int, ...]
    tail: torch.Tensor
    """Leased slots of the trailing partial page left by the last commit (may be empty)."""


class HiCacheMachine(RuleBasedStateMachine):
    """Random request traffic against one small cache; see the module docstring."""

    WRITE_POLICY: ClassVar[str] = "write_through"
    HOST_LAYOUT: ClassVar[str] = "page_first"
    LOOP_FACTORY: ClassVar[Callable[[], asyncio.AbstractEventLoop]] = asyncio.new_event_loop
    SETTLE_BETWEEN_STEPS: ClassVar[bool] = True
    """True: each step starts with every copy settled, so a failing example replays the same
    way and shrinks well. False: copies stay in flight across steps, so the next rule's
    requests meet nodes still LOADING or WRITING; more interleavings, but a timing-dependent
    failure may not replay (Hypothesis then reports it as flaky)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).LOOP_FACTORY()
        self.cache: HiCache | None = None
        self.leases: list[torch.Tensor] = []
        self.open: list[OpenRequest] = []
        self.known: set[tuple[int, ...]] = set()
        """Every page-aligned prefix of every committed sequence."""

    # ---------------------------------------------------------------- plumbing

    def run(self, coro: Coroutine[Any, Any, T], *, settle: bool = True) -> T:
        """Run `coro` on the machine's loop, then (with `settle`, in machines that settle
        between steps) let every copy it started settle."""
        result = self.loop.run_until_complete(coro)
        if settle and self.SETTLE_BETWEEN_STEPS:
            self.loop.run_until_complete(self._settle())
        return result

    async def _settle(self) -> None:
        try:
            async with asyncio.timeout(5):
                await self.c.drain()
        except TimeoutError:
            raise AssertionError("drain() hung: a planned transfer was lost") from None
        stats = self.c.stats()
        assert stats.pending_loads == stats.pending_writes == 0

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    @property
    def ps(self) -> int:
        return self.c.config.page_size

    def remember(self, tokens: tuple[int, ...]) -> None:
        ps = self.ps
        for k in range(ps, len(tokens) + 1, ps):
            self.known.add(tokens[:k])

    def check_hit(self, ctx: FetchContext, tokens: tuple[int, ...]) -> None:
        """The cached prefix was committed by someone and holds exactly its KV."""
        n = ctx.num_cached_tokens
        assert n % self.ps == 0 and 0 <= n <= len(tokens), f"bad num_cached_tokens {n}"
        assert len(ctx.device_indices) >= n
        if n == 0:
            return
        assert tokens[:n] in self.known, f"hit on {tokens[:n]} that nobody committed"
        got = read_kv(self.c, ctx.device_indices[:n])
        want = expected_kv(self.c.config, tokens[:n])
        assert torch.equal(got, want), f"wrong KV served for {tokens[:n]}"

    async def lease(self, num_tokens: int) -> torch.Tensor | None:
        try:
            slots = await self.c.allocate(num_tokens)
        except CapacityError:
            return None
        fill_kv(self.c, slots, [POISON_TOKEN] * len(slots))
        return slots

    async def decode_allocate(self, ctx: FetchContext, tail: torch.Tensor,
                              num_tokens: int) -> torch.Tensor | None:
        """`ctx.allocate` after a commit that left the partial page `tail`: the slots continue
        that page. When the pool is full, decoding goes on one token at a time in the page's
        free rest: a failed allocate must not have used it up."""
        try:
            slots = await ctx.allocate(num_tokens)
        except CapacityError:
            if not len(tail):
                return None
            try:
                slots = await ctx.allocate(1)
            except CapacityError:
                raise AssertionError("allocate(1) wanted a new page although the partial page "
                                     "has room: a failed allocate used it up") from None
        if len(tail):
            assert slots[0] == tail[-1] + 1, "allocate skipped the rest of the partial page"
        return slots

    # ---------------------------------------------------------------- lifecycle

    @initialize(page_size=st.sampled_from([2, 4]), device_pages=st.integers(8, 12),
                host_pages=st.integers(16, 24), eviction=st.sampled_from(["lru", "lfu"]),
                jitter_seed=st.integers(0, 2**32 - 1), inline_copies=st.booleans())
    def open_cache(self, page_size: int, device_pages: int, host_pages: int,
                   eviction: str, jitter_seed: int, inline_copies: bool) -> None:
        config = make_config(page_size=page_size, device_pages=device_pages,
                             host_pages=host_pages, eviction=eviction,
                             write_policy=self.WRITE_POLICY, host_layout=self.HOST_LAYOUT)
        engine = JitteryEngine(jitter_seed, inline=inline_copies)
        self.cache = HiCache(config, engine=engine)
        engine.attach(self.cache)
        self.run(self.cache.__aenter__(), settle=False)

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.run(self._close(), settle=False)
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _close(self) -> None:
        cache = self.c
        settled = False
        try:
            for req in self.open:
                await req.ctx.__aexit__(None, None, None)
            self.open.clear()
            for slots in self.leases:
                cache.free(slots)
            self.leases.clear()
            await self._settle()
            settled = True
            cache.check_invariants()
            stats = cache.stats()
            assert stats.device_pages_leased == 0
            assert stats.pending_loads == stats.pending_writes == 0
        finally:
            if not settled:  # a lost transfer must not hold aclose() in its 60 s drain
                cache.controller.drain = _return_at_once  # type: ignore[method-assign]
            await cache.aclose()

    # ---------------------------------------------------------------- rules

    @rule(tokens=sequences)
    def prefill(self, tokens: tuple[int, ...]) -> None:
        """Fetch, compute what is missing, commit: then the whole prefix is a hit."""
        self.run(self._prefill(tokens, alone=True))

    async def _prefill(self, tokens: tuple[int, ...], *, alone: bool = False) -> None:
        committed = False
        async with self.c.fetch(tokens) as hit:
            await hit.ready()
            self.check_hit(hit, tokens)
            cached = hit.num_cached_tokens
            if cached < len(tokens):
                try:
                    slots = await hit.allocate(len(tokens) - cached)
                except CapacityError:
                    return
                fill_kv(self.c, slots, list(tokens[cached:]))
                self.remember(tokens)
                await hit.commit(tokens, slots)
                committed = True
                assert hit.num_cached_tokens == len(tokens) // self.ps * self.ps
            self.check_hit(hit, tokens)
        if committed and alone:  # (concurrent requests may evict it meanwhile)
            async with self.c.fetch(tokens) as again:
                assert again.num_cached_tokens == len(tokens) // self.ps * self.ps, \
                    "a prefix committed just now is not found by the next fetch"
                await again.ready()
                self.check_hit(again, tokens)

    @rule(tokens=sequences, wait=st.booleans())
    def fetch_only(self, tokens: tuple[int, ...], wait: bool) -> None:
        """Fetch and leave without committing, with or without waiting for the load-back."""
        self.run(self._fetch_only(tokens, wait))

    async def _fetch_only(self, tokens: tuple[int, ...], wait: bool) -> None:
        async with self.c.fetch(tokens) as hit:
            if wait:
                await hit.ready()
                self.check_hit(hit, tokens)

    @rule(batch=st.lists(st.tuples(st.sampled_from(["prefill", "partial", "fetch"]), sequences,
                                   st.booleans(), CHOICE), min_size=2, max_size=4))
    def concurrent_requests(self, batch: list[tuple[str, tuple[int, ...], bool, int]]) -> None:
        """Several requests at once: their fetches, loads, evictions and commits interleave."""
        async def one(kind: str, tokens: tuple[int, ...], flag: bool, cut: int) -> None:
            if kind == "prefill":
                await self._prefill(tokens)
            elif kind == "partial" and len(tokens) >= 3:
                await self._partial_commits(tokens, flag, cut)
            else:
                await self._fetch_only(tokens, flag)

        async def go() -> None:  # no TaskGroup: a failure must not cancel the others
            results = await asyncio.gather(*(one(*op) for op in batch), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        self.run(go())

    @rule(tokens=sequences.filter(lambda t: len(t) >= 3), upfront=st.booleans(), cut=CHOICE)
    def partial_commits(self, tokens: tuple[int, ...], upfront: bool, cut: int) -> None:
        """Commit a prefix that ends mid-page, then the whole sequence in the same context.

        With `upfront`, all slots are allocated first (chunked prefill); otherwise the rest is
        allocated after the first commit, continuing its partial page (decode).
        """
        self.run(self._partial_commits(tokens, upfront, cut))

    async def _partial_commits(self, tokens: tuple[int, ...], upfront: bool, cut: int) -> None:
        ps = self.ps
        async with self.c.fetch(tokens) as hit:
            await hit.ready()
            self.check_hit(hit, tokens)
            cached = hit.num_cached_tokens
            if len(tokens) - cached < 2:
                return
            mid = cached + 1 + cut % (len(tokens) - cached - 1)  # ends anywhere, mid-page too
            try:
                slots = await hit.allocate((len(tokens) if upfront else mid) - cached)
            except CapacityError:
                return
            fill_kv(self.c, slots[:mid - cached], list(tokens[cached:mid]))
            self.remember(tokens[:mid])
            await hit.commit(tokens[:mid], slots[:mid - cached])
            first = hit.num_cached_tokens
            assert first == mid // ps * ps
            self.check_hit(hit, tokens)
            tail = slots[first - cached:mid - cached]  # the partial page so far
            if upfront:
                rest = slots[mid - cached:]
            else:
                rest = await self.decode_allocate(hit, tail, len(tokens) - mid)
                if rest is None:
                    return
                tokens = tokens[:mid + len(rest)]
            fill_kv(self.c, rest, list(tokens[mid:]))  # "decode" the rest
            self.remember(tokens)
            await hit.commit(tokens, torch.cat([tail, rest]))
            assert hit.num_cached_tokens == len(tokens) // ps * ps
            self.check_hit(hit, tokens)

    @precondition(lambda self: len(self.open) < 2)
    @rule(tokens=sequences)
    def open_request(self, tokens: tuple[int, ...]) -> None:
        """Open a fetch context and keep it (and its pins) across steps."""
        async def go() -> None:
            ctx = self.c.fetch(tokens)
            await ctx.__aenter__()
            try:
                await ctx.ready()
                self.check_hit(ctx, tokens)
            except BaseException:
                await ctx.__aexit__(None, None, None)
                raise
            self.open.append(OpenRequest(ctx, tokens, torch.empty(0, dtype=torch.int64)))
        self.run(go())

    @precondition(lambda self: self.open)
    @rule(which=CHOICE, extra=st.lists(SUFFIX_TOKENS, max_size=5))
    def commit_open_request(self, which: int, extra: list[int]) -> None:
        """An open request computes the rest of its tokens (plus some decoded ones), commits."""
        req = self.open[which % len(self.open)]
        self.run(self._commit_open(req, (*req.tokens, *extra)))

    async def _commit_open(self, req: OpenRequest, tokens: tuple[int, ...]) -> None:
        ctx, ps = req.ctx, self.ps
        cached = ctx.num_cached_tokens
        computed = cached + len(req.tail)  # the tail: a leased partial page from a commit
        if len(tokens) <= computed:
            return
        new = await self.decode_allocate(ctx, req.tail, len(tokens) - computed)
        if new is None:
            return
        tokens = tokens[:computed + len(new)]
        fill_kv(self.c, new, list(tokens[computed:]))
        slots = torch.cat([req.tail, new])
        self.remember(tokens)
        await ctx.commit(tokens, slots)
        full = len(tokens) // ps * ps
        assert ctx.num_cached_tokens == full
        req.tokens, req.tail = tokens, slots[full - cached:]
        self.check_hit(ctx, tokens)

    @precondition(lambda self: self.open)
    @rule(which=CHOICE)
    def close_request(self, which: int) -> None:
        req = self.open.pop(which % len(self.open))
        self.run(req.ctx.__aexit__(None, None, None))

    @rule(num_tokens=st.integers(1, 12))
    def allocate(self, num_tokens: int) -> None:
        """Lease slots outside any request and scribble on them."""
        slots = self.run(self.lease(num_tokens))
        if slots is not None:
            self.leases.append(slots)

    @rule(which=CHOICE)
    def free(self, which: int) -> None:
        if self.leases:
            self.c.free(self.leases.pop(which % len(self.leases)))

    @rule(fraction=st.sampled_from([0.5, 0.75, 1.0]))
    def force_eviction(self, fraction: float) -> None:
        """Allocate (and scribble on) a large part of the device pool, then give it back."""
        cfg = self.c.config
        num_tokens = max(1, int(cfg.device_pages * fraction) * cfg.page_size)
        slots = self.run(self.lease(num_tokens))
        if slots is not None:
            self.c.free(slots)

    @rule()
    def drain(self) -> None:
        self.run(self._settle(), settle=False)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def internally_consistent(self) -> None:
        if self.cache is not None:
            self.cache.check_invariants()
            assert self.cache.stats().health == "ok"

    @invariant()
    def leases_are_accounted(self) -> None:
        if self.cache is None:
            return
        ps = self.ps
        mine = sum(-(-len(s) // ps) for s in self.leases) + sum(len(r.tail) > 0 for r in self.open)
        assert self.cache.stats().device_pages_leased == mine

    @invariant()
    def pinned_kv_stays_intact(self) -> None:
        """Pages an open request holds are neither evicted nor overwritten."""
        for req in self.open:
            self.check_hit(req.ctx, req.tokens)


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
"""Modest counts keep the module well under a minute on two cores. No `explain` phase: its
line tracing is far too slow for this much code per example."""


class WriteThroughPageFirst(HiCacheMachine):
    WRITE_POLICY = "write_through"
    HOST_LAYOUT = "page_first"
    LOOP_FACTORY = asyncio.new_event_loop


class WriteThroughLayerFirst(HiCacheMachine):
    WRITE_POLICY = "write_through"
    HOST_LAYOUT = "layer_first"
    LOOP_FACTORY = uvloop.new_event_loop


class WriteBackPageFirst(HiCacheMachine):
    WRITE_POLICY = "write_back"
    HOST_LAYOUT = "page_first"
    LOOP_FACTORY = uvloop.new_event_loop


class WriteBackLayerFirst(HiCacheMachine):
    WRITE_POLICY = "write_back"
    HOST_LAYOUT = "layer_first"
    LOOP_FACTORY = asyncio.new_event_loop


class SelectiveWriteThrough(HiCacheMachine):
    WRITE_POLICY = "write_through_selective"
    HOST_LAYOUT = "page_first"
    LOOP_FACTORY = asyncio.new_event_loop


class WriteThroughRacy(HiCacheMachine):
    WRITE_POLICY = "write_through"
    HOST_LAYOUT = "page_first"
    LOOP_FACTORY = uvloop.new_event_loop
    SETTLE_BETWEEN_STEPS = False


class WriteBackRacy(HiCacheMachine):
    WRITE_POLICY = "write_back"
    HOST_LAYOUT = "layer_first"
    LOOP_FACTORY = asyncio.new_event_loop
    SETTLE_BETWEEN_STEPS = False


def _test_case(machine: type[HiCacheMachine]) -> Any:
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestWriteThroughPageFirst = _test_case(WriteThroughPageFirst)
TestWriteThroughLayerFirst = _test_case(WriteThroughLayerFirst)
TestWriteBackPageFirst = _test_case(WriteBackPageFirst)
TestWriteBackLayerFirst = _test_case(WriteBackLayerFirst)
TestSelectiveWriteThrough = _test_case(SelectiveWriteThrough)
TestWriteThroughRacy = _test_case(WriteThroughRacy)
TestWriteBackRacy = _test_case(WriteBackRacy)
