"""Model-based, stateful tests: random operation sequences against a real, small `HiCache`.

A `RuleBasedStateMachine` drives fetch / allocate / commit / free / drain / eviction on a CPU
cache with a handful of device and host pages, so eviction, demotion, load-back, write-through
and write-back all happen within a few steps. Token sequences come from a few shared prefixes,
so they overlap heavily and nodes split and merge all the time.

After every step the cache's own invariants must hold, and a model checks correctness: KV in
the device pool only ever comes from `KVChecker`, which derives it from each token's id,
position and prefix, so any prefix the cache reports as cached must hold exactly those values
for those tokens (bit-exact) once ``ready()`` returned, and it must be a prefix some request
committed. The cache may forget; it must never return wrong KV, and never report a hit for
tokens nobody computed.

Besides plain traffic, rules replay the misuse and races that once served wrong KV: fetches of
overlapping prefixes at once; a commit over pages another request is loading back; freeing a
partial page, then allocating again in the same context; entering a context twice; token ids
of 2**63 and more; and, with L3, stored page objects swapped between keys or corrupted.

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
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest
import torch
import uvloop
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiohicache import (
    CapacityError,
    ClosedError,
    ConfigError,
    CpuTransferEngine,
    FetchContext,
    HiCache,
    TransferHandle,
)
from aiohicache.controller import page_format
from aiohicache.memory import PageIds
from aiohicache.storage import chain_keys
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import make_config
from tests.kvcheck import KVChecker

T = TypeVar("T")

PREFIXES: tuple[tuple[int, ...], ...] = (
    tuple(range(1, 13)),
    (*range(1, 7), *range(20, 26)),       # shares 6 tokens with the first
    (*range(1, 3), *range(30, 40)),       # shares 2 tokens (mid-page for page_size 4)
    tuple(range(50, 62)),
)
SUFFIX_TOKENS = st.integers(min_value=70, max_value=75)  # few values: suffixes collide too
FRESH_TOKENS = st.integers(min_value=80, max_value=99)
"""Tokens of a part nobody has computed yet (most likely)."""

CHOICE = st.integers(min_value=0, max_value=2**16)
"""Picks among things that exist only at run time (modulo their number): drawing it never
depends on the machine's state, which copy timing may change between runs of one example."""

sequences = st.tuples(
    st.sampled_from(PREFIXES), st.integers(min_value=0, max_value=12),
    st.lists(SUFFIX_TOKENS, max_size=6),
).map(lambda p: (*p[0][:p[1]], *p[2])).filter(len)
"""Token sequences: a cut of a shared prefix plus a short suffix."""

L3_FIELDS: dict[str, Any] = {"prefetch_policy": "wait_complete", "prefetch_threshold": 1,
                             "storage_miss_ttl": 0.0}
"""With L3: every fetch that runs past L1 + L2 asks it, and waits for what it has."""


async def _return_at_once() -> None:
    pass


async def gather_all(coros: Iterable[Awaitable[None]]) -> None:
    """Run `coros` at once; raise the first failure after all ended (no TaskGroup: a failure
    must not cancel the others)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


class JitteryEngine(CpuTransferEngine):
    """The CPU engine, each copy on a worker thread held back 0-1 ms (or, with `inline`, the
    engine's own choice: small copies run on the event loop when their stream is idle).

    Copies then finish at varied points relative to the event loop and to each other's
    settling, so race windows (a node still LOADING or WRITING while other requests match,
    pin or evict it) stay open long enough for the rules to hit them. `hold_loads` keeps the
    next loads in flight, on a thread, until `release_loads`.
    """

    def __init__(self, seed: int, *, inline: bool) -> None:  # pools are bound in `attach`
        self._rng = random.Random(seed)
        self._inline = inline
        self._loads_open = threading.Event()
        self._loads_open.set()

    def attach(self, cache: HiCache) -> None:
        if self._inline:
            super().__init__(cache.device_pool, cache.host_pool)
        else:
            super().__init__(cache.device_pool, cache.host_pool, inline_bytes=0)

    def hold_loads(self) -> None:
        self._loads_open.clear()

    def release_loads(self) -> None:
        self._loads_open.set()

    def load(self, host_pages: PageIds, device_pages: PageIds) -> TransferHandle:
        if self._loads_open.is_set():
            return super().load(host_pages, device_pages)
        inline, self.inline_bytes = self.inline_bytes, 0  # a held load waits on a thread
        try:
            return super().load(host_pages, device_pages)
        finally:
            self.inline_bytes = inline

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        time.sleep(self._rng.random() * 0.001)
        if to_device:
            self._loads_open.wait(timeout=5)
        super()._run(src, dst, handle, to_device)


@dataclass
class OpenRequest:
    """A fetch context kept open across steps, like a request still decoding."""

    ctx: FetchContext
    tokens: tuple[int, ...]
    tail: torch.Tensor
    """Leased slots of the trailing partial page left by the last commit (may be empty)."""
    source: list[int] | None
    """The list passed to ``fetch`` if decoding appends to it (and commits that very list)."""


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
    WITH_L3: ClassVar[bool] = False
    """An in-memory L3 (a `MemoryBackend` the rules can reach into) behind L2."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).LOOP_FACTORY()
        self.cache: HiCache | None = None
        self.engine: JitteryEngine | None = None
        self.backend: MemoryBackend | None = None
        self.checker: KVChecker | None = None
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
    def kv(self) -> KVChecker:
        assert self.checker is not None
        return self.checker

    @property
    def ps(self) -> int:
        return self.c.config.page_size

    def remember(self, tokens: tuple[int, ...]) -> None:
        ps = self.ps
        for k in range(ps, len(tokens) + 1, ps):
            self.known.add(tokens[:k])

    async def check_hit(self, ctx: FetchContext, tokens: tuple[int, ...]) -> None:
        """The cached prefix was committed by someone and, once ready, holds exactly its KV."""
        n = ctx.num_cached_tokens
        assert n == 0 or tokens[:n] in self.known, f"hit on {tokens[:n]} that nobody committed"
        await self.kv.verify_prefix(ctx, tokens)

    async def check_commit(self, ctx: FetchContext, tokens: tuple[int, ...], cached: int,
                           slots: torch.Tensor) -> torch.Tensor:
        """After ``ctx.commit(tokens, slots)`` (`cached` tokens were cached before): the
        whole pages are the cached prefix and hold their KV once ready, the partial last
        page holds the rest. Returns that page's slots."""
        tail = slots[len(tokens) // self.ps * self.ps - cached:]
        await self.kv.verify_after_commit(ctx, tokens, tail)
        return tail

    async def lease(self, num_tokens: int) -> torch.Tensor | None:
        """Slots outside any request, poisoned (if the cache ever serves a page it handed
        out, the KV check sees the poison); None when the device is pinned full."""
        try:
            slots = await self.c.allocate(num_tokens)
        except CapacityError:
            return None
        self.kv.poison(slots)
        return slots

    async def push_out_device(self) -> None:
        """Lease every device page that can be had (evicting, or staging, all unpinned KV),
        poison it and give it back: what was cached is now in L2 or gone."""
        leased: list[torch.Tensor] = []
        try:
            while (slots := await self.lease(self.ps)) is not None:
                leased.append(slots)
        finally:
            for slots in leased:
                self.c.free(slots)

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
                host_pages=st.integers(16, 24),
                eviction=st.sampled_from(["lru", "lfu", "arc", ("arc", "lru")]),
                jitter_seed=st.integers(0, 2**32 - 1), inline_copies=st.booleans())
    def open_cache(self, page_size: int, device_pages: int, host_pages: int,
                   eviction: str | tuple[str, str], jitter_seed: int,
                   inline_copies: bool) -> None:
        fields: dict[str, Any] = {
            "page_size": page_size, "device_pages": device_pages, "host_pages": host_pages,
            "eviction": eviction, "write_policy": self.WRITE_POLICY,
            "host_layout": self.HOST_LAYOUT}
        if self.WITH_L3:
            self.backend = MemoryBackend(page_format(make_config(**fields)))
            fields.update(storage=self.backend, **L3_FIELDS)
        self.engine = JitteryEngine(jitter_seed, inline=inline_copies)
        self.cache = HiCache(make_config(**fields), engine=self.engine)
        self.engine.attach(self.cache)
        self.checker = KVChecker(self.cache)
        self.run(self.cache.__aenter__(), settle=False)

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.run(self._close(), settle=False)
            if self.backend is not None:  # a backend object stays the caller's to close
                self.loop.run_until_complete(self.backend.aclose())
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
            assert not cache._pins, f"pins outlive their contexts: {cache._pins}"
        finally:
            if not settled:  # a lost transfer must not hold aclose() in its 60 s drain
                cache.controller.drain = _return_at_once  # type: ignore[method-assign]
            if self.engine is not None:
                self.engine.release_loads()
            await cache.aclose()

    # ---------------------------------------------------------------- rules: traffic

    @rule(tokens=sequences)
    def prefill(self, tokens: tuple[int, ...]) -> None:
        """Fetch, compute what is missing, commit: then the whole prefix is a hit."""
        self.run(self._prefill(tokens, alone=True))

    async def _prefill(self, tokens: tuple[int, ...], *, alone: bool = False) -> None:
        committed = False
        async with self.c.fetch(tokens) as hit:
            await self.check_hit(hit, tokens)
            cached = hit.num_cached_tokens
            if cached < len(tokens):
                try:
                    slots = await hit.allocate(len(tokens) - cached)
                except CapacityError:
                    return
                self.kv.fill(slots, tokens, cached)
                self.remember(tokens)
                await hit.commit(tokens, slots)
                committed = True
                await self.check_commit(hit, tokens, cached, slots)
        if committed and alone:  # (concurrent requests may evict it meanwhile)
            async with self.c.fetch(tokens) as again:
                assert again.num_cached_tokens == len(tokens) // self.ps * self.ps, \
                    "a prefix committed just now is not found by the next fetch"
                await self.check_hit(again, tokens)

    @rule(tokens=sequences, wait=st.booleans())
    def fetch_only(self, tokens: tuple[int, ...], wait: bool) -> None:
        """Fetch and leave without committing, with or without waiting for the load-back."""
        self.run(self._fetch_only(tokens, wait))

    async def _fetch_only(self, tokens: tuple[int, ...], wait: bool) -> None:
        async with self.c.fetch(tokens) as hit:
            if wait:
                await self.check_hit(hit, tokens)

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
        self.run(gather_all(one(*op) for op in batch))

    @rule(tokens=sequences, cuts=st.lists(CHOICE, min_size=2, max_size=4),
          push_out=st.booleans(), compute=st.booleans())
    def overlapping_fetches(self, tokens: tuple[int, ...], cuts: list[int], push_out: bool,
                            compute: bool) -> None:
        """Requests for prefixes of one sequence at once, after L1 was pushed out (so they
        meet each other's load-backs of the same pages); with `compute`, each computes and
        commits its rest."""
        async def one(cut: int) -> None:
            prefix = tokens[:1 + cut % len(tokens)]
            await (self._prefill(prefix) if compute else self._fetch_only(prefix, True))

        async def go() -> None:
            if push_out:
                await self.push_out_device()
            await gather_all(one(cut) for cut in cuts)
        self.run(go())

    @rule(tokens=sequences.filter(lambda t: len(t) >= 3), upfront=st.booleans(), cut=CHOICE)
    def partial_commits(self, tokens: tuple[int, ...], upfront: bool, cut: int) -> None:
        """Commit a prefix that ends mid-page, then the whole sequence in the same context.

        With `upfront`, all slots are allocated first (chunked prefill); otherwise the rest is
        allocated after the first commit, continuing its partial page (decode).
        """
        self.run(self._partial_commits(tokens, upfront, cut))

    async def _partial_commits(self, tokens: tuple[int, ...], upfront: bool, cut: int) -> None:
        async with self.c.fetch(tokens) as hit:
            await self.check_hit(hit, tokens)
            cached = hit.num_cached_tokens
            if len(tokens) - cached < 2:
                return
            mid = cached + 1 + cut % (len(tokens) - cached - 1)  # ends anywhere, mid-page too
            try:
                slots = await hit.allocate((len(tokens) if upfront else mid) - cached)
            except CapacityError:
                return
            self.kv.fill(slots[:mid - cached], tokens, cached)
            self.remember(tokens[:mid])
            await hit.commit(tokens[:mid], slots[:mid - cached])
            tail = await self.check_commit(hit, tokens[:mid], cached, slots[:mid - cached])
            first = hit.num_cached_tokens
            if upfront:
                rest = slots[mid - cached:]
            else:
                rest = await self.decode_allocate(hit, tail, len(tokens) - mid)
                if rest is None:
                    return
                tokens = tokens[:mid + len(rest)]
            self.kv.fill(rest, tokens, mid)  # "decode" the rest
            self.remember(tokens)
            await hit.commit(tokens, torch.cat([tail, rest]))
            await self.check_commit(hit, tokens, first, torch.cat([tail, rest]))

    @precondition(lambda self: len(self.open) < 2)
    @rule(tokens=sequences, same_list=st.booleans())
    def open_request(self, tokens: tuple[int, ...], same_list: bool) -> None:
        """Open a fetch context and keep it (and its pins) across steps. With `same_list`,
        it is fetched with a list that its commits then extend in place."""
        async def go() -> None:
            source = list(tokens) if same_list else None
            ctx = self.c.fetch(tokens if source is None else source)
            await ctx.__aenter__()
            try:
                await self.check_hit(ctx, tokens)
            except BaseException:
                await ctx.__aexit__(None, None, None)
                raise
            self.open.append(OpenRequest(ctx, tokens, torch.empty(0, dtype=torch.int64),
                                         source))
        self.run(go())

    @precondition(lambda self: self.open)
    @rule(which=CHOICE, extra=st.lists(SUFFIX_TOKENS, max_size=5))
    def commit_open_request(self, which: int, extra: list[int]) -> None:
        """An open request computes the rest of its tokens (plus some decoded ones), commits."""
        req = self.open[which % len(self.open)]
        self.run(self._commit_open(req, (*req.tokens, *extra)))

    async def _commit_open(self, req: OpenRequest, tokens: tuple[int, ...]) -> None:
        ctx = req.ctx
        cached = ctx.num_cached_tokens
        computed = cached + len(req.tail)  # the tail: a leased partial page from a commit
        if len(tokens) <= computed:
            return
        new = await self.decode_allocate(ctx, req.tail, len(tokens) - computed)
        if new is None:
            return
        tokens = tokens[:computed + len(new)]
        self.kv.fill(new, tokens, computed)
        slots = torch.cat([req.tail, new])
        self.remember(tokens)
        if req.source is None:
            await ctx.commit(tokens, slots)
        else:  # the list fetch() was given, edited since: commit must read it as it is now
            req.source[:] = tokens
            await ctx.commit(req.source, slots)
        req.tokens, req.tail = tokens, await self.check_commit(ctx, tokens, cached, slots)

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

    # ---------------------------------------------------------------- rules: races, misuse

    @rule(head=st.sampled_from(PREFIXES), cut=st.integers(0, 12),
          fresh=st.lists(FRESH_TOKENS, min_size=4, max_size=8),
          extra=st.lists(SUFFIX_TOKENS, min_size=1, max_size=4))
    def commit_during_load_back(self, head: tuple[int, ...], cut: int, fresh: list[int],
                                extra: list[int]) -> None:
        """A fetches S + X with S not cached. Meanwhile C computes S (written to L2), S leaves
        L1, and B fetches S: B's load-back is in flight when A commits S + X. A's prefix then
        reads B's pages, so A's ``ready()`` must wait for B's load."""
        shared = (*head[:cut], *fresh)
        self.run(self._commit_during_load_back(shared, (*shared, *extra)))

    async def _commit_during_load_back(self, shared: tuple[int, ...],
                                       tokens: tuple[int, ...]) -> None:
        async with self.c.fetch(tokens) as a:
            await self.check_hit(a, tokens)
            cached = a.num_cached_tokens
            await self._prefill(shared)  # request C
            await self._settle()  # C's write-through lands
            await self.push_out_device()
            await self._settle()  # (write-back: the staged copies land)
            if cached == len(tokens):
                return
            try:
                slots = await a.allocate(len(tokens) - cached)
            except CapacityError:
                return
            self.kv.fill(slots, tokens, cached)  # A's forward pass
            await self._commit_while_loads_held(a, tokens, cached, slots, shared)

    async def _commit_while_loads_held(self, a: FetchContext, tokens: tuple[int, ...],
                                       cached: int, slots: torch.Tensor,
                                       shared: tuple[int, ...]) -> None:
        assert self.engine is not None
        self.engine.hold_loads()
        try:
            async with self.c.fetch(shared) as b:  # B's load-back of S is queued, held
                self.remember(tokens)
                await a.commit(tokens, slots)
                release = asyncio.ensure_future(self._release_loads_soon())
                await self.check_commit(a, tokens, cached, slots)  # ready() must wait
                await release
                await self.check_hit(b, shared)
        finally:
            self.engine.release_loads()

    async def _release_loads_soon(self) -> None:
        """Open the gate after a few loop turns: a ``ready()`` that waits for a held load
        lets this run; one that does not returns (and is checked) before."""
        for _ in range(3):
            await asyncio.sleep(0)
        assert self.engine is not None
        self.engine.release_loads()

    @rule(tokens=sequences, first=st.integers(1, 3))
    def free_then_allocate(self, tokens: tuple[int, ...], first: int) -> None:
        """A context allocates a partial page and frees it (``cache.free``); another request
        leases it; the context's next ``allocate`` must hand out only slots of its own."""
        self.run(self._free_then_allocate(tokens, first))

    async def _free_then_allocate(self, tokens: tuple[int, ...], first: int) -> None:
        async with self.c.fetch(tokens) as hit:
            await self.check_hit(hit, tokens)
            cached = hit.num_cached_tokens
            if cached == len(tokens):
                return
            try:
                freed = await hit.allocate(min(first, self.ps - 1))
            except CapacityError:
                return
            self.c.free(freed)
            other = await self.lease(self.ps)  # LIFO: most likely the page just freed
            if other is not None:
                self.leases.append(other)
            try:
                slots = await hit.allocate(len(tokens) - cached)
            except CapacityError:
                return
            if other is not None:
                assert not np.intersect1d(slots.numpy(), other.numpy()).size, (
                    "hit.allocate handed out slots another request leased: it continued "
                    "a partial page that was freed")
            self.kv.fill(slots, tokens, cached)
            self.remember(tokens)
            await hit.commit(tokens, slots)
            await self.check_commit(hit, tokens, cached, slots)

    @rule(tokens=sequences, inside=st.booleans())
    def enter_twice(self, tokens: tuple[int, ...], inside: bool) -> None:
        """A context is entered once: entering it again, inside its block or after, raises
        and pins nothing; after its block it cannot be used."""
        async def go() -> None:
            ctx = self.c.fetch(tokens)
            async with ctx:
                await self.check_hit(ctx, tokens)
                if inside:
                    with pytest.raises((ClosedError, ConfigError)):
                        await ctx.__aenter__()
                    await self.check_hit(ctx, tokens)
            with pytest.raises((ClosedError, ConfigError)):
                async with ctx:
                    pass
            with pytest.raises(ClosedError):
                await ctx.allocate(1)
            with pytest.raises(ClosedError):
                await ctx.ready()
        self.run(go())

    @rule(tokens=sequences, at=CHOICE, big=st.integers(2**63, 2**64 - 1),
          form=st.sampled_from(["list", "numpy", "tensor", "commit"]))
    def huge_token_ids(self, tokens: tuple[int, ...], at: int, big: int, form: str) -> None:
        """Token ids must fit in int64: an id of 2**63 or more (uint64) is a ConfigError, in
        a fetch or a commit, never wrapped to a negative id that matches another token."""
        async def go() -> None:
            if form == "commit":
                await self._commit_huge_id(tokens, big)
                return
            bad = [*tokens[:at % len(tokens)], big, *tokens[at % len(tokens) + 1:]]
            source: Any = {"list": bad, "numpy": np.array(bad, dtype=np.uint64),
                           "tensor": torch.tensor(bad, dtype=torch.uint64)}[form]
            with pytest.raises(ConfigError):
                async with self.c.fetch(source):
                    pass
        self.run(go())

    async def _commit_huge_id(self, tokens: tuple[int, ...], big: int) -> None:
        async with self.c.fetch(tokens) as hit:
            await self.check_hit(hit, tokens)
            try:
                slots = await hit.allocate(len(tokens) + 1 - hit.num_cached_tokens)
            except CapacityError:
                return
            self.kv.poison(slots)
            with pytest.raises(ConfigError):
                await hit.commit([*tokens, big], slots)

    # ---------------------------------------------------------------- rules: L3

    @precondition(lambda self: self.backend is not None)
    @rule()
    def forget_l1_l2(self) -> None:
        """Push everything unpinned out of L1 and L2: the next fetches read L3."""
        self.run(self._forget_l1_l2())

    async def _forget_l1_l2(self) -> None:
        await self._settle()
        await self.push_out_device()
        self.c.tree.evict_host(self.c.host_pool.num_pages)
        self.c.check_invariants()

    @property
    def objects(self) -> dict[str, bytearray]:
        """The L3 objects by key (the `MemoryBackend`'s own dict)."""
        assert self.backend is not None
        return self.backend._objects

    @precondition(lambda self: self.backend is not None)
    @rule(first=CHOICE, second=CHOICE)
    def swap_l3_objects(self, first: int, second: int) -> None:
        """Two stored page objects trade keys (a misdirected rename or copy in the store):
        reading either must be a miss, never the other's KV."""
        keys = sorted(self.objects)
        if len(keys) >= 2:
            a, b = keys[first % len(keys)], keys[second % len(keys)]
            self.objects[a], self.objects[b] = self.objects[b], self.objects[a]

    @precondition(lambda self: self.backend is not None)
    @rule(first=CHOICE, second=CHOICE)
    def swap_pages_of_two_prefixes(self, first: int, second: int) -> None:
        """Swap the L3 objects of the last pages of two committed prefixes, forget L1 and
        L2, fetch both: each is served right up to its swapped page, or misses there."""
        stored = sorted(p for p in self.known if self.page_key(p) in self.objects)
        if len(stored) < 2:
            return
        a, b = stored[first % len(stored)], stored[second % len(stored)]
        ka, kb = self.page_key(a), self.page_key(b)
        self.objects[ka], self.objects[kb] = self.objects[kb], self.objects[ka]

        async def go() -> None:
            await self._forget_l1_l2()
            await gather_all(self._fetch_only(p, True) for p in (a, b))
        self.run(go())

    def page_key(self, tokens: tuple[int, ...]) -> str:
        """The L3 key of the last whole page of `tokens`."""
        assert self.c.storage is not None
        return chain_keys(self.c.storage.root, np.asarray(tokens, dtype=np.int64),
                          self.ps)[-1].hex()

    @precondition(lambda self: self.backend is not None)
    @rule(which=CHOICE, offset=CHOICE)
    def corrupt_l3_object(self, which: int, offset: int) -> None:
        """Flip a byte of a stored page object: reading it must be a miss."""
        keys = sorted(self.objects)
        if keys:
            blob = self.objects[keys[which % len(keys)]]
            blob[offset % len(blob)] ^= 0xFF

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
    def only_open_requests_pin(self) -> None:
        """Every context but the open requests has ended, and so has its pin."""
        if self.cache is not None:
            assert len(self.cache._pins) == len(self.open), (
                f"{len(self.cache._pins)} pins for {len(self.open)} open requests")

    @invariant()
    def pinned_kv_stays_intact(self) -> None:
        """Pages an open request holds are neither evicted nor overwritten."""
        for req in self.open:
            self.run(self.check_hit(req.ctx, req.tokens), settle=False)


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


class WriteThroughL3(HiCacheMachine):
    WRITE_POLICY = "write_through"
    HOST_LAYOUT = "layer_first"
    LOOP_FACTORY = uvloop.new_event_loop
    WITH_L3 = True


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
TestWriteThroughL3 = _test_case(WriteThroughL3)
