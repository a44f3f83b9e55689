"""Review of allocation, leases and commit (docs/api.md, "Allocation, leases and commit"),
model-based: several fetch contexts open at once, driven step by step against a model of
which slots the caller holds and what KV each holds.

The rules a caller may rely on, checked after every step:

- A slot the caller holds (handed out by `allocate`, not committed, not freed) is never handed
  out again, by either `allocate`, and never read or written by the cache: it keeps the KV the
  caller wrote (or the poison it was marked with, if the caller wrote nothing).
- Every cached prefix (a context's `num_cached_tokens`) holds exactly the KV some request
  committed for those tokens, and a prefix an open context pins is a hit for any new fetch.
- The leased pages are exactly those the model holds, each with the owner the model expects;
  `cache.check_invariants()` holds; a context's `allocate` after a commit that ended mid-page
  continues that page (when it is the context's).
- Misuse (a commit of another context's slots, of misaligned slots, of the wrong number of
  slots or of diverging tokens; a double free; a free of committed slots) raises
  `ConfigError` / `PageError` and changes nothing.

Contexts are entered by hand (``__aenter__``) on the machine's own event loop and left by
hand, normally or from a task cancelled in the middle of an `allocate`, `commit`, `ready` or
a wait of its own. Slots come from ``hit.allocate`` and ``cache.allocate`` mixed in one
commit, commits cover a prefix of what was allocated (chunked prefill) or one more token
(decode). Pools are tiny, so eviction, write-back and load-back (and, with L3, prefetch from
``memory://``) happen all the time.

CI runs a fixed, derandomized set of examples (a few hundred steps, seconds);
``AIOHICACHE_STATEFUL_EXAMPLES=N`` runs N random examples per machine instead
(``AIOHICACHE_STATEFUL_STEPS`` sets the steps).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pytest
import torch
import uvloop
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiohicache import (
    CapacityError,
    ConfigError,
    CpuTransferEngine,
    FetchContext,
    HiCache,
    PageError,
    TransferHandle,
)
from aiohicache.memory import PageIds
from aiohicache.testing import KVOracle
from tests.conftest import make_config, make_tokens
from tests.kvcheck import POISON, KVChecker

T = TypeVar("T")

ANON = -1
"""The model's owner of pages leased by `HiCache.allocate` (the cache's `ANONYMOUS`)."""

_B0 = tuple(range(1, 81))
BASES: tuple[tuple[int, ...], ...] = (
    _B0,
    (*_B0[:5], *range(101, 176)),    # shares 5 tokens with the first (mid-page mostly)
    (*_B0[:17], *range(201, 264)),   # shares 17
    tuple(range(301, 381)),
)
DECODE = 1000
"""Decoded tokens are DECODE + 0..3: few values, so requests decode the same tokens too
(their commits then insert pages another request inserted: duplicates)."""

CHOICE = st.integers(min_value=0, max_value=2**16)
"""Picks among things that exist only at run time (modulo their number)."""

POOLS = {1: (12, 20), 3: (8, 12), 4: (6, 10), 16: (5, 8)}
"""Device pages by page size: a handful, so contexts fight over them."""
MAX_PAGES = 4
"""A request's sequence stays within this many pages (plus the partial one)."""


# ---------------------------------------------------------------------- found by the machine

PS = 4


class GatedWrites(CpuTransferEngine):
    """The CPU engine, every device -> host copy on a thread held until `open`: a write-back
    allocate waits (its pages are still being written) for as long as the test wants."""

    def __init__(self, device_pool: Any, host_pool: Any) -> None:
        super().__init__(device_pool, host_pool, inline_bytes=0)
        self.gate = threading.Event()

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        if not to_device:
            self.gate.wait(timeout=10)
        super()._run(src, dst, handle, to_device)


async def _waiting_allocate(cache: HiCache, hit: FetchContext,
                            num_tokens: int) -> asyncio.Future[torch.Tensor]:
    """Fill the device with pages not yet written back, then start ``hit.allocate``: it takes
    the rest of the context's partial page and waits for a write-back to free a page."""
    kv = KVOracle(cache)
    for seed in range(3):
        await kv.prefill(make_tokens(PS, seed=60 + seed))
    waiting = asyncio.ensure_future(hit.allocate(num_tokens))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done(), "(the allocate waits for a write-back)"
    return waiting


def _gated_cache() -> tuple[HiCache, list[GatedWrites]]:
    engines: list[GatedWrites] = []

    def engine(device_pool: Any, host_pool: Any) -> GatedWrites:
        engines.append(GatedWrites(device_pool, host_pool))
        return engines[-1]
    cache = HiCache(make_config(device_pages=4, host_pages=16, write_policy="write_back"),
                    engine=engine)
    return cache, engines


async def test_a_cancelled_allocate_does_not_restore_the_mark_of_a_page_freed_meanwhile(
) -> None:
    """An allocate waiting for pages took the rest of partial page X; meanwhile X is freed
    and leased again by another allocate of the context (all of it handed out), then the
    first is cancelled: it gave back its mark on X, and the next allocate handed out X's
    slots 2.. again, still held by the caller."""
    cache, engines = _gated_cache()
    async with cache:
        async with cache.fetch(make_tokens(12, seed=50)) as hit:
            first = await hit.allocate(2)  # page X: the context's partial page
            waiting = await _waiting_allocate(cache, hit, 2 + PS)
            cache.free(first)
            whole = await hit.allocate(PS)  # X again, all of it
            assert int(whole[0]) == int(first[0]), "(the pool hands the freed page out again)"
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            engines[0].gate.set()
            more = await hit.allocate(1)
            again = set(more.tolist()) & set(whole.tolist())
            assert not again, f"slots {sorted(again)} handed out again while still held"
        cache.check_invariants()
        assert cache.stats().device_pages_leased == 0


async def test_an_allocate_waiting_for_pages_never_returns_the_rest_of_a_page_freed_meanwhile(
) -> None:
    """An allocate waiting for pages took the rest of partial page X; meanwhile the caller
    frees X (the slots it holds of it). The allocate returned X's rest anyway, slots of a
    free page that the next lease handed out to someone else too."""
    cache, engines = _gated_cache()
    async with cache:
        async with cache.fetch(make_tokens(12, seed=51)) as hit:
            first = await hit.allocate(2)
            waiting = await _waiting_allocate(cache, hit, 2 + PS)
            cache.free(first)
            engines[0].gate.set()
            got = await waiting
            assert len(got) == 2 + PS
            other = await cache.allocate(2 * PS)
            again = set(got.tolist()) & set(other.tolist())
            assert not again, f"slots {sorted(again)} handed out to two callers at once"
            cache.free(other)
        cache.check_invariants()
        assert cache.stats().device_pages_leased == 0


# ---------------------------------------------------------------------- the model

@dataclass
class Req:
    """An open fetch context as the caller sees it."""

    ctx: FetchContext
    owner: int
    plan: list[int]
    """The tokens this request computes: the fetched ones, then what it decodes."""
    cached: int
    chain: list[int] = field(default_factory=list)
    """Slots of ``plan[cached:cached + len(chain)]``, KV written: what the next commit
    passes (page-aligned by construction: every page from its first slot)."""
    raced: bool = False
    """Two allocates of it ran at once: where its partial page is, the model cannot tell,
    so what it allocates from now on is loose."""


class AllocMachine(RuleBasedStateMachine):
    """Open contexts, allocate, commit, free, leave, checked against the model."""

    WRITE_POLICY: ClassVar[str] = "write_through"
    WITH_L3: ClassVar[bool] = False
    LOOP_FACTORY: ClassVar[Any] = asyncio.new_event_loop
    SETTLE: ClassVar[bool] = True
    """Drain after every step: a failing example replays alike and shrinks well."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).LOOP_FACTORY()
        self.cache: HiCache | None = None
        self.kv: KVChecker | None = None
        self.reqs: list[Req] = []
        self.owner: dict[int, int] = {}
        """Leased page -> the owner the model expects (a context's owner id, or ANON)."""
        self.loose: dict[int, list[int]] = {}
        """Leased page -> its held slots off every chain (poisoned)."""
        self.known: set[tuple[int, ...]] = set()
        """Every page-aligned prefix some request committed (or may have, if cancelled)."""
        self.committed: list[tuple[int, ...]] = []
        self.concurrent = False
        """Ops of several contexts run at once: a failed one cannot compare the leases."""

    # ------------------------------------------------------------------ plumbing

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        result = self.loop.run_until_complete(coro)
        if self.SETTLE:
            self.loop.run_until_complete(self.settle())
        return result

    async def settle(self) -> None:
        async with asyncio.timeout(10):
            await self.c.drain()

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    @property
    def checker(self) -> KVChecker:
        assert self.kv is not None
        return self.kv

    @property
    def ps(self) -> int:
        return self.c.config.page_size

    def held(self) -> set[int]:
        slots = {s for r in self.reqs for s in r.chain}
        for group in self.loose.values():
            slots.update(group)
        return slots

    def pinned(self) -> set[int]:
        return {s for r in self.reqs
                for s in r.ctx.device_indices[:r.ctx.num_cached_tokens].tolist()}

    def remember(self, tokens: list[int] | tuple[int, ...]) -> None:
        tokens = tuple(tokens)
        for k in range(self.ps, len(tokens) + 1, self.ps):
            self.known.add(tokens[:k])
        if len(tokens) >= self.ps:
            self.committed.append(tokens)

    def poisoned(self, slots: list[int]) -> bool:
        if not slots:
            return True
        got = self.checker._slots[:, :, torch.tensor(slots)]
        return bool((got == POISON).all())

    async def check_hit(self, ctx: FetchContext, tokens: list[int] | tuple[int, ...]) -> int:
        """The cached prefix was committed by someone and, once ready, holds exactly its KV."""
        n = ctx.num_cached_tokens
        assert n == 0 or tuple(tokens[:n]) in self.known, \
            f"hit on {n} tokens {tuple(tokens[:n])} that nobody committed"
        await self.checker.verify_prefix(ctx, list(tokens))
        return n

    def check_handed(self, slots: torch.Tensor, n: int, owner: int) -> list[int]:
        """What either `allocate` returned: `n` slots, none held or pinned, page by page
        (the rest of a page this owner holds, then fresh pages from their first slot)."""
        got = slots.tolist()
        ps = self.ps
        assert len(got) == n and len(set(got)) == n, f"allocate({n}) returned {got}"
        again = self.held() & set(got)
        assert not again, f"allocate handed out slots {sorted(again)} the caller still holds"
        pinned = self.pinned() & set(got)
        assert not pinned, f"allocate handed out slots {sorted(pinned)} of a pinned prefix"
        for i, s in enumerate(got):
            page = s // ps
            if s % ps and (i == 0 or got[i - 1] != s - 1):
                assert i == 0 and self.owner.get(page) == owner, (
                    f"allocate handed out slot {s} mid-page of page {page} "
                    f"(owner {self.owner.get(page)}), not continuing a page of {owner}")
            if s % ps == 0:
                assert page not in self.owner, \
                    f"allocate handed out page {page}, leased to {self.owner[page]}"
        return got

    def take(self, got: list[int], owner: int, req: Req | None,
             plan_at: int | None = None) -> None:
        """Record slots handed out to `owner`: on `req`'s chain (KV written for the tokens
        they are for) if they continue it, else loose (poisoned)."""
        ps = self.ps
        for s in got:
            self.owner.setdefault(s // ps, owner)
        if req is not None and not req.raced and self.continues(req, got):
            event(f"allocate onto a chain ({'cache' if owner == ANON else 'hit'})")
            start = req.cached + len(req.chain)
            self.extend_plan(req, start + len(got), plan_at)
            self.checker.fill(torch.tensor(got), req.plan, start)
            req.chain += got
            return
        event(f"allocate loose ({'cache' if owner == ANON else 'hit'})")
        self.checker.poison(torch.tensor(got))
        for s in got:
            self.loose.setdefault(s // ps, []).append(s)

    def continues(self, req: Req, got: list[int]) -> bool:
        ps = self.ps
        if len(req.chain) % ps:
            return got[0] == req.chain[-1] + 1
        return got[0] % ps == 0 and req.cached + len(req.chain) + len(got) <= \
            (MAX_PAGES + 1) * ps

    def extend_plan(self, req: Req, upto: int, at: int | None) -> None:
        while len(req.plan) < upto:
            req.plan.append(DECODE + ((at or 0) + len(req.plan)) % 4)

    def drop_pages(self, pages: set[int]) -> None:
        for page in pages:
            self.owner.pop(page, None)
            self.loose.pop(page, None)

    # ------------------------------------------------------------------ lifecycle

    @initialize(ps=st.sampled_from(sorted(POOLS)), extra_pages=st.integers(0, 4),
                host_factor=st.sampled_from([0.5, 1.0, 2.0]))
    def open_cache(self, ps: int, extra_pages: int, host_factor: float) -> None:
        low, high = POOLS[ps]
        device = min(high, low + extra_pages)
        fields: dict[str, Any] = {"page_size": ps, "device_pages": device,
                                  "host_pages": max(2, int(device * host_factor)),
                                  "write_policy": self.WRITE_POLICY}
        if self.WITH_L3:
            fields.update(storage="memory://", prefetch_policy="wait_complete",
                          prefetch_threshold=1, storage_miss_ttl=0.0)
        self.cache = HiCache(make_config(**fields))
        self.kv = KVChecker(self.cache)
        self.loop.run_until_complete(self.cache.__aenter__())

    def teardown(self) -> None:
        event(f"steps: {self.steps // 5 * 5}+")
        try:
            if self.cache is not None:
                self.loop.run_until_complete(self._close())
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _close(self) -> None:
        cache = self.c
        try:
            for req in list(self.reqs):
                await self._leave(req)
            for page in list(self.loose):
                await self._free_pages([page])
            await self.settle()
            cache.check_invariants()
            assert cache.stats().device_pages_leased == 0
        finally:
            await cache.aclose()

    # ------------------------------------------------------------------ rules: contexts

    @precondition(lambda self: len(self.reqs) < 3)
    @rule(base=CHOICE, cut=st.integers(0, 4 * 16), extra=st.lists(st.integers(0, 3),
                                                                   max_size=3),
          from_committed=st.booleans())
    def open_context(self, base: int, cut: int, extra: list[int],
                     from_committed: bool) -> None:
        """Enter a context for a prefix or an extension of a committed sequence, or a cut of
        a shared base, and keep it open."""
        if from_committed and self.committed:
            source: tuple[int, ...] = self.committed[base % len(self.committed)]
        else:
            source = BASES[base % len(BASES)]
        cut = cut % (MAX_PAGES * self.ps + 1)
        tokens = [*source[:cut], *(DECODE + e for e in extra)][:MAX_PAGES * self.ps + 1]
        if not tokens:
            tokens = [DECODE]
        self.run(self._open(tokens))

    async def _open(self, tokens: list[int]) -> None:
        ctx = self.c.fetch(tokens)
        await ctx.__aenter__()
        try:
            cached = await self.check_hit(ctx, tokens)
        except BaseException:
            await ctx.__aexit__(None, None, None)
            raise
        event(f"open: hit {bool(cached)}")
        self.reqs.append(Req(ctx, ctx._req.owner, list(tokens), cached))

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, n=st.integers(1, 9), at=CHOICE)
    def hit_allocate(self, which: int, n: int, at: int) -> None:
        """``hit.allocate(n)``: fresh slots, continuing the context's partial page."""
        req = self.reqs[which % len(self.reqs)]
        self.run(self._hit_allocate(req, n, at))

    async def _hit_allocate(self, req: Req, n: int, at: int) -> None:
        before = self.snapshot()
        try:
            slots = await req.ctx.allocate(n)
        except CapacityError:
            assert self.concurrent or self.snapshot() == before, \
                "a failed allocate changed the leases"
            event("hit.allocate: CapacityError")
            return
        got = self.check_handed(slots, n, req.owner)
        page = req.chain[-1] // self.ps if req.chain else None
        if len(req.chain) % self.ps and self.owner.get(page) == req.owner and not req.raced:
            assert got[0] == req.chain[-1] + 1, (
                f"allocate skipped the rest of the context's partial page {page}: "
                f"{req.chain[-1]} then {got[0]}")
        self.take(got, req.owner, req, at)

    @rule(which=CHOICE, n=st.integers(1, 9), onto_chain=st.booleans(), at=CHOICE)
    def cache_allocate(self, which: int, n: int, onto_chain: bool, at: int) -> None:
        """``cache.allocate(n)``: slots the caller may commit in any context (here appended
        to a context's chain when it ends on a page boundary, to be mixed in its commit)."""
        req = self.reqs[which % len(self.reqs)] if self.reqs and onto_chain else None
        if req is not None and len(req.chain) % self.ps:
            req = None
        self.run(self._cache_allocate(req, n, at))

    async def _cache_allocate(self, req: Req | None, n: int, at: int) -> None:
        before = self.snapshot()
        try:
            slots = await self.c.allocate(n)
        except CapacityError:
            assert self.concurrent or self.snapshot() == before, \
                "a failed allocate changed the leases"
            return
        self.take(self.check_handed(slots, n, ANON), ANON, req, at)

    @precondition(lambda self: any(r.chain for r in self.reqs))
    @rule(which=CHOICE, upto=CHOICE, as_list=st.booleans())
    def commit(self, which: int, upto: int, as_list: bool) -> None:
        """Commit a prefix of the chain (a chunk, or all of it: decode)."""
        reqs = [r for r in self.reqs if r.chain]
        req = reqs[which % len(reqs)]
        self.run(self._commit(req, 1 + upto % len(req.chain), as_list))

    async def _commit(self, req: Req, k: int, as_list: bool = True) -> None:
        tokens = req.plan[:req.cached + k]
        slots = torch.tensor(req.chain[:k])
        self.remember(tokens)
        await req.ctx.commit(tokens if as_list else torch.tensor(tokens), slots)
        self.committed_model(req, k)
        event(f"commit, tail left: {bool(req.chain)}")
        await self.check_hit(req.ctx, req.plan)

    def committed_model(self, req: Req, k: int) -> None:
        """The model after `req` committed ``chain[:k]``: its whole pages joined the tree
        (or were freed as duplicates), a partial last page is the context's now."""
        ps = self.ps
        full = (req.cached + k) // ps * ps
        assert req.ctx.num_cached_tokens == full, (
            f"after committing {req.cached + k} tokens, num_cached_tokens is "
            f"{req.ctx.num_cached_tokens}, not {full}")
        gone, req.chain = req.chain[:full - req.cached], req.chain[full - req.cached:]
        partial = req.cached + k > full
        self.drop_pages({s // ps for s in gone})
        req.cached = full
        if partial:  # the partial last page stays leased, to this context now
            self.owner[req.chain[0] // ps] = req.owner

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, steps=st.integers(1, 6), at=CHOICE)
    def decode(self, which: int, steps: int, at: int) -> None:
        """Decode: allocate 1, commit the whole chain; `steps` times."""
        req = self.reqs[which % len(self.reqs)]

        async def go() -> None:
            for _ in range(steps):
                if req.cached + len(req.chain) >= (MAX_PAGES + 1) * self.ps:
                    return
                await self._hit_allocate(req, 1, at)
                if not req.chain:
                    return
                await self._commit(req, len(req.chain))
        self.run(go())

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, chunks=st.lists(st.integers(1, 7), min_size=1, max_size=3),
          at=CHOICE)
    def chunked_prefill(self, which: int, chunks: list[int], at: int) -> None:
        """Allocate the rest of the prompt at once, then commit it chunk by chunk."""
        req = self.reqs[which % len(self.reqs)]

        async def go() -> None:
            want = len(req.plan) - req.cached - len(req.chain)
            if want > 0:
                await self._hit_allocate(req, want, at)
            for chunk in chunks:
                if not req.chain:
                    return
                await self._commit(req, min(chunk, len(req.chain)))
        self.run(go())

    def freeable(self) -> list[int]:
        """Loose pages the caller can give back: from their first slot, no chain on them
        (after a race, a page may hold some of both)."""
        chains = {s // self.ps for r in self.reqs for s in r.chain}
        return sorted(p for p, group in self.loose.items()
                      if min(group) % self.ps == 0 and p not in chains)

    @precondition(lambda self: self.loose)
    @rule(which=CHOICE, count=st.integers(1, 2))
    def free_loose(self, which: int, count: int) -> None:
        """``cache.free`` of held pages off every chain (whole pages, from their first slot)."""
        pages = self.freeable()
        if not pages:
            return
        start = which % len(pages)
        self.run(self._free_pages(pages[start:start + count]))

    async def _free_pages(self, pages: list[int]) -> None:
        slots: list[int] = []
        for i, page in enumerate(pages):
            group = sorted(self.loose[page])
            if group[0] % self.ps or (i < len(pages) - 1 and len(group) < self.ps):
                return self._free_one_by_one(pages)
            slots += group
        self.c.free(torch.tensor(slots))
        self.drop_pages(set(pages))

    def _free_one_by_one(self, pages: list[int]) -> None:
        for page in pages:
            group = sorted(self.loose[page])
            assert group[0] % self.ps == 0, f"held loose slots {group} start mid-page"
            self.c.free(torch.tensor(group))
            self.drop_pages({page})

    @precondition(lambda self: any(r.chain for r in self.reqs))
    @rule(which=CHOICE, keep=CHOICE)
    def free_chain_pages(self, which: int, keep: int) -> None:
        """``cache.free`` of the chain's last pages (not committed): the context's next
        allocate must start afresh, never continue a freed page."""
        reqs = [r for r in self.reqs if r.chain]
        req = reqs[which % len(reqs)]
        self.free_chain(req, keep % -(-len(req.chain) // self.ps))

    def free_chain(self, req: Req, keep_pages: int) -> None:
        ps = self.ps
        freed = req.chain[keep_pages * ps:]
        self.c.free(torch.tensor(freed))
        req.chain = req.chain[:keep_pages * ps]
        self.drop_pages({s // ps for s in freed})

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, first=st.integers(1, 5), n=st.integers(1, 9), k=CHOICE, at=CHOICE)
    def reallocate_with_cache_allocate(self, which: int, first: int, n: int, k: int,
                                       at: int) -> None:
        """The context allocates, gives the chain back (``cache.free``), leases the tokens
        again with ``cache.allocate`` (the pool hands out the freed pages first) and commits
        a chunk of them; then decodes on."""
        req = self.reqs[which % len(self.reqs)]

        async def go() -> None:
            if len(req.chain) % self.ps == 0:
                await self._hit_allocate(req, first, at)
            if req.chain:
                self.free_chain(req, 0)
            await self._cache_allocate(req, n, at)
            if req.chain:
                await self._commit(req, 1 + k % len(req.chain))
            await self._hit_allocate(req, 1, at)
        self.run(go())

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, n1=st.integers(1, 9), n2=st.integers(1, 9), free=st.booleans(),
          cancel=st.booleans(), spins=st.integers(0, 3))
    def same_context_race(self, which: int, n1: int, n2: int, free: bool, cancel: bool,
                          spins: int) -> None:
        """Two allocates of one context at once (the first may wait for pages, in write-back
        mode); meanwhile the context's partial page is freed, and the first may be
        cancelled. Neither hands out a held slot or a page freed meanwhile."""
        req = self.reqs[which % len(self.reqs)]
        self.run(self._same_context_race(req, n1, n2, free, cancel, spins))

    async def _same_context_race(self, req: Req, n1: int, n2: int, free: bool, cancel: bool,
                                 spins: int) -> None:
        async def one(n: int) -> None:
            try:
                got = await req.ctx.allocate(n)
            except CapacityError:
                return
            self.take(self.check_handed(got, n, req.owner), req.owner, None)
        req.raced = self.concurrent = True
        try:
            first = asyncio.ensure_future(one(n1))
            for _ in range(spins):
                await asyncio.sleep(0)
            if free and req.chain:
                self.free_chain(req, (len(req.chain) - 1) // self.ps)
            second = asyncio.ensure_future(one(n2))
            if cancel:
                first.cancel()
            await asyncio.gather(first, second, return_exceptions=True)
            if not first.cancelled() and first.exception() is not None:
                raise first.exception()  # type: ignore[misc]
            if second.exception() is not None:
                raise second.exception()  # type: ignore[misc]
        finally:
            self.concurrent = False

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE)
    def leave(self, which: int) -> None:
        req = self.reqs[which % len(self.reqs)]
        self.run(self._leave(req))

    async def _leave(self, req: Req) -> None:
        await req.ctx.__aexit__(None, None, None)
        self.left(req)

    def left(self, req: Req) -> None:
        """The model after `req` left: its pages are freed; slots of `cache.allocate` on its
        chain are still the caller's (loose now)."""
        self.reqs.remove(req)
        ps = self.ps
        for page in [p for p, o in self.owner.items() if o == req.owner]:
            self.drop_pages({page})
        for s in req.chain:
            if self.owner.get(s // ps) == ANON:
                self.loose.setdefault(s // ps, []).append(s)
        self.checker.poison(torch.tensor([s for s in req.chain
                                          if self.owner.get(s // ps) == ANON]))

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, what=st.sampled_from(["allocate", "commit", "ready", "wait"]),
          spins=st.integers(0, 3), n=st.integers(1, 9))
    def leave_cancelled(self, which: int, what: str, spins: int, n: int) -> None:
        """The request's task is cancelled in the middle of an op (or of a wait of its
        own): its ``async with`` block ends with CancelledError, and whatever the op did is
        undone or given back at the exit."""
        req = self.reqs[which % len(self.reqs)]
        self.run(self._leave_cancelled(req, what, spins, n))

    async def _leave_cancelled(self, req: Req, what: str, spins: int, n: int) -> None:
        started = asyncio.Event()
        anon_on_chain = any(self.owner.get(s // self.ps) == ANON for s in req.chain)
        if what == "commit" and (not req.chain or anon_on_chain):
            what = "ready"  # (whether it committed decides where anon pages went)

        async def body() -> None:
            try:
                started.set()
                if what == "allocate":
                    try:
                        got = await req.ctx.allocate(n)
                    except CapacityError:
                        pass
                    else:
                        self.check_handed(got, n, req.owner)
                elif what == "commit":
                    k = len(req.chain)
                    self.remember(req.plan[:req.cached + k])
                    await req.ctx.commit(req.plan[:req.cached + k], torch.tensor(req.chain))
                elif what == "ready":
                    await req.ctx.ready()
                await asyncio.Event().wait()
            finally:
                await req.ctx.__aexit__(*sys.exc_info())
        task = asyncio.ensure_future(body())
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if not started.is_set():  # cancelled before it ran: its block never began
            await req.ctx.__aexit__(None, None, None)
        self.left(req)

    @precondition(lambda self: len(self.reqs) < 3)
    @rule(base=CHOICE, cut=st.integers(1, 4 * 16), spins=st.integers(0, 3))
    def enter_cancelled(self, base: int, cut: int, spins: int) -> None:
        """A fetch cancelled while entering (or just after): nothing stays pinned."""
        source = self.committed[base % len(self.committed)] if self.committed and base % 2 \
            else BASES[base % len(BASES)]
        tokens = list(source[:1 + cut % (MAX_PAGES * self.ps)])

        async def go() -> None:
            async def body() -> None:
                async with self.c.fetch(tokens) as ctx:
                    await self.check_hit(ctx, tokens)
                    await asyncio.Event().wait()
            task = asyncio.ensure_future(body())
            for _ in range(spins):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        self.run(go())

    @rule(which=CHOICE, ext=st.lists(st.integers(0, 3), max_size=3), cut=CHOICE)
    def fetch_committed(self, which: int, ext: list[int], cut: int) -> None:
        """A new fetch of a prefix or an extension of a committed sequence: any hit holds
        exactly its KV, and a prefix an open context pins is a hit."""
        pinned = [r for r in self.reqs if r.cached]
        if pinned and which % 2:
            req = pinned[which % len(pinned)]
            source: tuple[int, ...] = tuple(req.plan[:req.cached])
            floor = req.cached
        elif self.committed:
            source, floor = self.committed[which % len(self.committed)], 0
        else:
            return
        tokens = [*source[:max(floor, cut % (len(source) + 1))], *(DECODE + e for e in ext)]
        if not tokens:
            return

        async def go() -> None:
            async with self.c.fetch(tokens) as ctx:
                n = await self.check_hit(ctx, tokens)
                assert n >= floor // self.ps * self.ps, (
                    f"a fetch hit {n} tokens of a prefix of {floor} another context pins")
        self.run(go())

    @rule()
    def drain(self) -> None:
        self.loop.run_until_complete(self.settle())
        stats = self.c.stats()
        assert stats.pending_loads == stats.pending_writes == 0

    @rule(fraction=st.sampled_from([0.5, 1.0]))
    def pressure(self, fraction: float) -> None:
        """Lease (and poison) what the device has to give, then give it back: unpinned KV
        is evicted (written back to L2 first in write-back mode)."""
        async def go() -> None:
            want = max(1, int(self.c.config.device_pages * fraction))
            leased = []
            try:
                for _ in range(want):
                    try:
                        slots = await self.c.allocate(self.ps)
                    except CapacityError:
                        break
                    self.check_handed(slots, self.ps, ANON)
                    self.checker.poison(slots)
                    leased.append(slots)
            finally:
                for slots in leased:
                    self.c.free(slots)
        self.run(go())

    @precondition(lambda self: len(self.reqs) >= 2)
    @rule(ops=st.lists(st.tuples(st.sampled_from(["allocate", "commit", "cache_allocate"]),
                                 st.integers(1, 6)), min_size=2, max_size=3), at=CHOICE)
    def concurrently(self, ops: list[tuple[str, int]], at: int) -> None:
        """One op in each of several contexts at once (their allocations, evictions and
        commits interleave); each context's part of the model is its own."""
        async def one(req: Req, kind: str, n: int) -> None:
            if kind == "commit" and req.chain:
                await self._commit(req, 1 + n % len(req.chain))
            elif kind == "cache_allocate":
                await self._cache_allocate(None, n, at)
            else:
                await self._hit_allocate(req, n, at)

        async def go() -> None:
            self.concurrent = True
            try:
                results = await asyncio.gather(
                    *(one(req, *op) for req, op in zip(self.reqs, ops, strict=False)),
                    return_exceptions=True)
            finally:
                self.concurrent = False
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        self.run(go())

    # ------------------------------------------------------------------ rules: misuse

    @precondition(lambda self: self.reqs)
    @rule(which=CHOICE, how=st.sampled_from(
        ["other_ctx_slots", "misaligned", "count", "diverging", "double_free",
         "free_committed", "free_mid_page", "allocate_zero"]), pick=CHOICE)
    def misuse(self, which: int, how: str, pick: int) -> None:
        """Misuse is refused (ConfigError / PageError) and changes nothing."""
        req = self.reqs[which % len(self.reqs)]
        before = self.snapshot()
        raised = self.run(self._misuse(req, how, pick))
        if raised:
            assert self.snapshot() == before, f"refused misuse ({how}) changed the leases"

    async def _misuse(self, req: Req, how: str, pick: int) -> bool:
        ps, ctx = self.ps, req.ctx
        if how == "other_ctx_slots":  # another context's own (not anonymous) pages
            others = [r for r in self.reqs if r is not req and r.chain
                      and self.owner.get(r.chain[0] // ps) == r.owner]
            if not others:
                return False
            other = others[pick % len(others)]
            k = min(len(other.chain), ps)
            self.extend_plan(req, req.cached + k, pick)
            with pytest.raises(PageError):
                await ctx.commit(req.plan[:req.cached + k], torch.tensor(other.chain[:k]))
        elif how == "misaligned":
            if len(req.chain) < 2 or ps == 1:
                return False
            k = len(req.chain) - 1
            with pytest.raises(ConfigError):
                await ctx.commit(req.plan[:req.cached + k], torch.tensor(req.chain[1:]))
        elif how == "count":
            if not req.chain:
                return False
            k = len(req.chain)
            self.extend_plan(req, req.cached + k + 1, pick)
            with pytest.raises(ConfigError):
                await ctx.commit(req.plan[:req.cached + k + 1], torch.tensor(req.chain))
        elif how == "diverging":
            fetched = len(ctx.tokens)
            if not req.chain or fetched == 0:
                return False
            k = len(req.chain)
            tokens = list(req.plan[:req.cached + k])
            at = pick % min(fetched, len(tokens))
            tokens[at] = 99_999
            with pytest.raises(ConfigError):
                await ctx.commit(tokens, torch.tensor(req.chain))
        elif how == "double_free":
            pages = self.freeable()
            if not pages:
                return False
            page = pages[pick % len(pages)]
            group = sorted(self.loose[page])
            self.c.free(torch.tensor(group))
            self.drop_pages({page})
            with pytest.raises(PageError):
                self.c.free(torch.tensor(group))
            return False  # (the first free did change the leases)
        elif how == "free_committed":
            if not req.cached:
                return False
            page = ctx.device_indices[:req.cached].tolist()[::ps][pick % (req.cached // ps)]
            with pytest.raises(PageError):
                self.c.free(torch.arange(page, page + ps))
        elif how == "free_mid_page":
            if len(req.chain) < 2 or ps == 1:
                return False
            with pytest.raises(ConfigError):
                self.c.free(torch.tensor(req.chain[1:]))
        elif how == "allocate_zero":
            with pytest.raises(ConfigError):
                await ctx.allocate(0)
            with pytest.raises(ConfigError):
                await self.c.allocate(0)
        return True

    # ------------------------------------------------------------------ invariants

    steps = 0

    def snapshot(self) -> tuple[tuple[int, int], ...]:
        leases = self.c._core.leases
        return tuple((int(p), int(leases.owner[p])) for p in leases.leased_pages())

    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        self.steps += 1
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.health == "ok"
        expected = tuple(sorted(self.owner.items()))
        assert self.snapshot() == expected, (
            f"leased pages (page, owner) {self.snapshot()} != the model's {expected}")
        assert stats.device_pages_leased == len(self.owner)
        assert len(self.cache._pins) == len(self.reqs), (
            f"{len(self.cache._pins)} pins for {len(self.reqs)} open contexts")

    @invariant()
    def held_slots_keep_their_kv(self) -> None:
        """Every chain still holds the KV written for it, every loose slot its poison, and no
        slot is held twice or also pinned as a cached prefix."""
        if self.cache is None:
            return
        chains = [s for r in self.reqs for s in r.chain]
        loose = [s for group in self.loose.values() for s in group]
        assert len(set(chains + loose)) == len(chains) + len(loose), "model holds a slot twice"
        assert not set(chains + loose) & self.pinned(), "a held slot is in a cached prefix"
        for req in self.reqs:
            self.checker.verify(torch.tensor(req.chain, dtype=torch.int64), req.plan,
                                req.cached, what="slots the caller holds")
        assert self.poisoned(loose), "a loose held slot was written by someone else"

    @invariant()
    def pinned_prefixes_hold_their_kv(self) -> None:
        for req in self.reqs:
            self.loop.run_until_complete(self.check_hit(req.ctx, req.plan))
            assert req.ctx.num_cached_tokens == req.cached


def _settings() -> settings:
    examples = int(os.environ.get("AIOHICACHE_STATEFUL_EXAMPLES", "0"))
    steps = int(os.environ.get("AIOHICACHE_STATEFUL_STEPS", "0"))
    return settings(max_examples=examples or 6, stateful_step_count=steps or 25,
                    derandomize=not examples, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=list(HealthCheck))


class WriteThrough(AllocMachine):
    WRITE_POLICY = "write_through"


class WriteBack(AllocMachine):
    WRITE_POLICY = "write_back"
    LOOP_FACTORY = uvloop.new_event_loop


class Selective(AllocMachine):
    WRITE_POLICY = "write_through_selective"


class WriteBackL3(AllocMachine):
    WRITE_POLICY = "write_back"
    WITH_L3 = True


class WriteThroughL3Racy(AllocMachine):
    WRITE_POLICY = "write_through"
    WITH_L3 = True
    SETTLE = False
    LOOP_FACTORY = uvloop.new_event_loop


def _case(machine: type[AllocMachine]) -> Any:
    case = machine.TestCase
    case.settings = _settings()
    return case


TestWriteThrough = _case(WriteThrough)
TestWriteBack = _case(WriteBack)
TestSelective = _case(Selective)
TestWriteBackL3 = _case(WriteBackL3)
TestWriteThroughL3Racy = _case(WriteThroughL3Racy)
