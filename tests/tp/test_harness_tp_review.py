"""A seeded random harness over tensor parallelism: ranks driven as a TP scheduler drives them.

Each seed draws a world: 2-4 ranks in one event loop (`TPGroup.local`), MHA or MLA, page size
1-8, tiny device and host pools, random eviction / write / prefetch policies, and L3 none, a
shared in-memory store (one `MemoryBackend` per shard: one for MLA, one per rank for MHA), a
shared ``file://`` directory with tiny segments, or the in-memory store reached through a
fault injector with its own seed on each rank. What may differ per rank does: the copy
engine's timing, the tick interval, the host layout (without a shared MLA store), the faults.

The driver is a TP scheduler: every step it plans calls once and runs that plan on every
rank, each rank with its own lag. Calls of one step are a batch (fetches entered together,
then allocates, then commits, as a serving loop's phases), started in plan order; requests
stay open across steps (prefill in chunks, decode, finish). At most one call of a batch is
cancelled, on every rank, at a point drawn per rank (at once, after some ticks, after a
delay, or just after the tick that ran it): the same call, as the contract asks, but where
between two ticks the cancellation lands differs by rank. Between steps the ranks are
drained (maybe cancelled, per rank), pushed out, emptied of host copies, restarted over the
same groups (maybe with calls in flight), and a stored object is corrupted on one shard.

Checks: every call has the same outcome on every rank (hit lengths and tiers, slots,
errors); every hit's KV is verified on every rank (`KVChecker`, salted per rank for MHA so a
page of another rank's shard is caught); after every tick each rank's tree fingerprint
(pages, refs, hit counts) is recorded and the ranks' sequences must be equal; after every
step ``check_invariants()`` holds on every rank; nothing hangs (a time limit, and a
``tp_timeout``); every restart closes the ranks at the same tick, healthy; at the end every
rank has backed up what is due, is quiescent (nothing pinned or leased once the lazy releases
ran, nothing in flight, the ranks at the same tick and state), serves every computed prefix
right or misses it, and so do fresh ranks reading only the shared L3 (and, for MLA, a cache
of TP size 1: its pages are shared by every TP size); after closing no task is left running.

``AIOHICACHE_TP_HARNESS_SEEDS`` (default 3) seeds run from ``AIOHICACHE_TP_HARNESS_FIRST_SEED``
(default 0), ``AIOHICACHE_TP_HARNESS_STEPS`` (default 30) steps each, with a ``tp_timeout`` of
``AIOHICACHE_TP_HARNESS_TIMEOUT`` seconds (default 20); a failure names its seed (`run_seed`
replays it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from aiohicache import CapacityError, ClosedError, FetchContext, HiCache, HiCacheConfig
from aiohicache.controller import page_format
from aiohicache.distributed import TPGroup
from aiohicache.storage import FaultyBackend
from aiohicache.storage.memory import MemoryBackend
from tests import test_harness_l3_review as harness_l3
from tests.kvcheck import KVChecker
from tests.test_stateful import JitteryEngine

SEEDS = int(os.environ.get("AIOHICACHE_TP_HARNESS_SEEDS", "3"))
FIRST_SEED = int(os.environ.get("AIOHICACHE_TP_HARNESS_FIRST_SEED", "0"))
STEPS = int(os.environ.get("AIOHICACHE_TP_HARNESS_STEPS", "30"))
TIME_LIMIT = 60.0
"""Seconds one seed may take before it counts as hung (a seed takes about one)."""
TP_TIMEOUT = float(os.environ.get("AIOHICACHE_TP_HARNESS_TIMEOUT", "20"))
"""The ranks' `tp_timeout`: a stuck consensus raises `RankTimeoutError` instead of hanging.
Generous: on an overloaded machine the whole process may stall for seconds."""

Tokens = tuple[int, ...]


# ------------------------------------------------------------------------------ the world

def draw_config(rng: random.Random, with_l3: bool) -> dict[str, Any]:
    """The single-rank harness's random fields, the host layout left to each rank."""
    fields = harness_l3.draw_config(rng, with_l3)
    del fields["host_layout"]
    return {**fields, "tp_timeout": TP_TIMEOUT}


@dataclass
class World:
    seed: int
    size: int
    store: str
    """``none``, ``memory`` (shared `MemoryBackend` objects), ``faulty`` (the same, each rank
    through its own fault injector) or ``file`` (one shared directory)."""
    configs: list[HiCacheConfig]
    """Rank r's config (its ``storage`` is filled in by `storage`)."""
    prompts: list[Tokens]
    branches: list[Tokens]
    directory: Path
    backends: dict[int, MemoryBackend] = field(default_factory=dict)
    """The in-memory store of each shard (MLA: one, shard 0; MHA: one per rank)."""

    @property
    def mla(self) -> bool:
        return self.configs[0].spec.kind == "mla"

    def shard(self, rank: int) -> int:
        return 0 if self.mla else rank

    def backend(self, rank: int) -> MemoryBackend:
        shard = self.shard(rank)
        if shard not in self.backends:
            self.backends[shard] = MemoryBackend(page_format(self.configs[rank]))
        return self.backends[shard]

    def storage(self, rank: int, rng: random.Random) -> tuple[object, bool]:
        """Rank `rank`'s L3 for one start, and whether it reaches it through faults."""
        config = self.configs[rank]
        if self.store == "file":
            page = 64 + config.page_bytes
            return f"file://{self.directory}?segment_bytes={4 * page}&max_bytes={64 * page}", False
        if self.store in ("memory", "faulty"):
            backend = self.backend(rank)
            if self.store == "faulty" and rng.random() < 0.7:
                # the wrapper is not closed by the cache: the store outlives every start
                return FaultyBackend(backend, seed=rng.randrange(2**32),
                                     error_rate=rng.choice([0.02, 0.02, 0.3]),
                                     latency=(0.0, 0.002), timeout_rate=0.005,
                                     corrupt_rate=0.02, partial_rate=0.03,
                                     timeout_s=0.005), True
            return backend, False
        return None, False


def draw_world(seed: int, directory: Path) -> World:
    rng = random.Random(seed)
    size = rng.choice([2, 2, 3, 4])
    store = rng.choice(["none", "memory", "memory", "faulty", "faulty", "file"])
    base = draw_config(rng, store != "none")
    mla = base["spec"].kind == "mla"
    same_layout = store != "none" and mla  # a shared MLA page's format names the layout
    layout = rng.choice(["page_first", "layer_first"])
    configs = []
    for r in range(size):
        configs.append(HiCacheConfig(
            **base, tp_rank=r, tp_size=size,
            host_layout=layout if same_layout else rng.choice(["page_first", "layer_first"]),
            tp_tick_interval=rng.choice([0.0005, 0.002, 0.005])))
    ps, cap = base["page_size"], base["device_pages"] * base["page_size"]
    alphabet = rng.randint(3, 40)  # few token ids: pages of different prompts collide

    def toks(n: int) -> Tokens:
        return tuple(rng.randrange(alphabet) for _ in range(n))
    heads = [toks(rng.randint(0, 2 * ps)) for _ in range(2)]
    prompts = [rng.choice(heads) + toks(rng.randint(1, 3 * ps)) for _ in range(rng.randint(1, 4))]
    branches = [toks(rng.randint(1, max(1, cap // 3))) for _ in range(rng.randint(2, 6))]
    return World(seed, size, store, configs, prompts, branches, directory)


def describe(seed: int, directory: Path) -> str:
    w = draw_world(seed, directory)
    return f"seed {seed}: {w.size} ranks, store={w.store}, config={w.configs[0]}"


# ------------------------------------------------------------------------------ a rank

class ShardKV(KVChecker):
    """The KV of one rank's shard: MHA ranks hold other heads, so the same tokens get other
    values on each rank (`salt`), and a page of another rank's shard is caught; MLA KV is
    the same on every rank (salt 0)."""

    def __init__(self, cache: HiCache, salt: int) -> None:
        super().__init__(cache)
        self.salt = salt

    def expected(self, tokens: Any, start_pos: int, num: int) -> torch.Tensor:
        if self.salt:
            tokens = np.asarray(tokens, dtype=np.int64) + self.salt
        return super().expected(tokens, start_pos, num)


@dataclass(eq=False)
class Rank:
    r: int
    group: TPGroup
    world: World
    rng: random.Random
    """This rank's own randomness: timing, cancellation points, faults (not the plan)."""
    cache: HiCache | None = None
    kv: ShardKV | None = None
    faulty: bool = False
    ticks: list[str] = field(default_factory=list)
    """The tree's fingerprint after each tick of the current cache."""
    ops: dict[asyncio.Task[Any], Any] = field(default_factory=dict)
    """The first op each task queued (the op of the call the task makes)."""
    alone: bool = False
    """A cache of TP size 1 (no group): MLA pages in L3 are shared by every TP size."""

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    async def start(self) -> None:
        engine = JitteryEngine(self.rng.randrange(2**32), inline=self.rng.random() < 0.5)
        storage, faulty = self.world.storage(self.r, self.rng)
        self.faulty = self.faulty or faulty
        config = replace(self.world.configs[self.r], storage=storage)
        if self.alone:
            config = replace(config, tp_rank=0, tp_size=1)
        cache = HiCache(config, engine=engine, tp_group=None if self.alone else self.group)
        engine.attach(cache)
        self.kv = ShardKV(cache, 0 if self.world.mla else 7919 * (self.r + 1))
        await cache.__aenter__()
        self.cache, self.ticks = cache, []
        consensus = cache._tp
        if consensus is None:
            return
        consensus.on_tick.append(lambda _: self.ticks.append(self.print()))
        submit = consensus.submit

        def tracked(fn: Any, undo: Any = None, *, lazy: bool = False) -> Any:
            op = submit(fn, undo, lazy=lazy)
            task = asyncio.current_task()
            if task is not None and task not in self.ops:
                self.ops[task] = op
            return op
        consensus.submit = tracked  # type: ignore[method-assign]

    def print(self) -> str:
        core = self.c._core
        return (f"{self.c.tree.fingerprint(pages=True)} leased={core.leases.count} "
                f"free={core.device_pool.allocator.num_free}/{core.host_pool.allocator.num_free}")

    def core_stats(self) -> tuple[int, ...]:
        """The counters every rank must agree on (as test_local's `assert_same`)."""
        s = self.c.stats()
        return (s.requests, s.device_hit_tokens, s.host_hit_tokens, s.storage_hit_tokens,
                s.device_pages_used, s.host_pages_used, s.device_pages_leased)

    async def lag(self) -> None:
        """This rank runs a step's calls a little behind or ahead of the others."""
        how = self.rng.random()
        if how < 0.4:
            return
        if how < 0.7:
            for _ in range(self.rng.randint(1, 5)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(self.rng.choice([0.0002, 0.001, 0.004, 0.02]))


# ------------------------------------------------------------------------------ the driver

class Planned:
    """One call of a batch, the same on every rank: `make(rank)` starts it there. If it is
    cancelled, `then(rank)` (if given) is the rank's next call, made as soon as the
    cancellation has returned there (a retry, or going on with the context); its outcome
    stands for the call's."""

    def __init__(self, name: str, make: Callable[[Rank], Awaitable[Any]],
                 then: Callable[[Rank], Awaitable[Any]] | None = None) -> None:
        self.name = name
        self.make = make
        self.then = then


@dataclass(eq=False)
class Req:
    """One request, open on every rank (its context per rank)."""

    tokens: Tokens
    """What it has computed or will: the prompt, then decoded tokens."""
    ctxs: list[FetchContext]
    full: int = 0
    """Tokens in whole pages, cached (``num_cached_tokens``)."""
    committed: int = 0
    """Tokens committed (`full` plus the partial page kept leased)."""
    own: list[torch.Tensor] = field(default_factory=list)
    """Per rank: slots of positions ``full..``: the partial page, then new ones leased."""


def same(values: list[Any], what: str) -> Any:
    assert all(v == values[0] for v in values), f"ranks differ in {what}: {values}"
    return values[0]


def outcome(value: Any) -> Any:
    """What a call's result says, comparable across ranks."""
    if isinstance(value, BaseException):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return ("slots", value.tolist())
    if isinstance(value, FetchContext):
        return ("hit", value.num_cached_tokens, value.num_device_hit_tokens,
                value.num_host_hit_tokens, value.num_storage_hit_tokens)
    return value


class Driver:
    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = random.Random(world.seed * 7919 + 1)
        groups = TPGroup.local(world.size, timeout=TP_TIMEOUT)
        self.ranks = [Rank(r, groups[r], world, random.Random(self.rng.random()))
                      for r in range(world.size)]
        self.ps = world.configs[0].page_size
        self.cap = world.configs[0].device_pages * self.ps
        self.known: set[Tokens] = set()
        self.live: list[Req] = []
        self.counts: dict[str, int] = {}
        self.cancelled = False
        """Whether the last batch's victim was cancelled (on every rank alike)."""

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    # -------------------------------------------------------------------- running plans

    async def on_ranks(self, fn: Callable[[Rank], Awaitable[Any]]) -> list[Any]:
        async def one(rank: Rank) -> Any:
            await rank.lag()
            return await fn(rank)
        return await asyncio.gather(*(one(rank) for rank in self.ranks))

    async def batch(self, calls: list[Planned], victim: int | None) -> list[Any]:
        """Run `calls` on every rank, started in order; cancel ``calls[victim]`` on every
        rank, where is each rank's draw. Returns the outcomes (the same on every rank)."""
        async def run(rank: Rank) -> list[Any]:
            tasks = [asyncio.ensure_future(call.make(rank)) for call in calls]
            await asyncio.sleep(0)  # each ran its first step: its op (if any) is queued
            then = None
            cancelled[rank.r] = victim is not None and await self.cancel(rank, tasks[victim])
            if cancelled[rank.r] and (after := calls[victim].then) is not None and go_on:
                then = asyncio.ensure_future(after(rank))
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if then is not None:
                results[victim] = (await asyncio.gather(then, return_exceptions=True))[0]
            return results
        go_on = self.rng.random() < 0.5
        cancelled = [False] * len(self.ranks)
        got = await self.on_ranks(run)
        self.cancelled = same(cancelled, "whether the call was cancelled")
        if self.cancelled:
            assert victim is not None
            self.count(f"cancelled: {calls[victim].name.split()[0]}"
                       + (" (went on)" if go_on and calls[victim].then else ""))
        for i, call in enumerate(calls):
            for rank, results in zip(self.ranks, got, strict=True):
                if isinstance(results[i], BaseException) and not isinstance(
                        results[i], CapacityError | asyncio.CancelledError):
                    raise AssertionError(f"rank {rank.r}: {call.name} failed") from results[i]
            same([outcome(results[i]) for results in got], call.name)
        return [[results[i] for results in got] for i in range(len(calls))]

    async def cancel(self, rank: Rank, task: asyncio.Task[Any]) -> bool:
        """Cancel `task` at a point of this rank's choice, but before it returns: at the
        latest just after the tick that ran its op, before the task resumes (the contract:
        the same call is cancelled on every rank). False: it needed no tick (e.g. the rest
        of a partial page) and returned at once, on every rank."""
        if task.done():
            return False
        op = rank.ops.get(task)
        consensus = rank.c._tp
        assert consensus is not None
        mode = rank.rng.choice(["now", "ticks", "delay", "ran"])
        ticks = rank.rng.randint(1, 3) if mode == "ticks" else 10**9

        def at_tick(_: int) -> None:  # (removed below: the ticker iterates the list)
            nonlocal ticks
            ticks -= 1
            if not task.done() and not task.cancelling() and (
                    ticks <= 0 or op is None or op.future.done()):
                task.cancel()
        consensus.on_tick.append(at_tick)
        if mode == "now":
            task.cancel()
        elif mode == "delay":
            await asyncio.sleep(rank.rng.choice([0.0, 0.0005, 0.002]))
            if not task.done() and not task.cancelling():
                task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(ValueError):
            consensus.on_tick.remove(at_tick)
        assert task.cancelled(), f"rank {rank.r}: the cancellation missed its call"
        return True

    def victim(self, n: int) -> int | None:
        return self.rng.randrange(n) if n and self.rng.random() < 0.2 else None

    # -------------------------------------------------------------------- workload

    def sequence(self) -> Tokens:
        rng, w = self.rng, self.world
        kind = rng.random()
        fresh = tuple(rng.randrange(100, 140) for _ in range(rng.randint(0, 2 * self.ps)))
        if kind < 0.55:
            seq = rng.choice(w.prompts) + rng.choice(w.branches) + fresh
        elif kind < 0.7:
            seq = rng.choice(w.prompts) + fresh
        elif kind < 0.8:  # long: near the device's capacity
            seq = rng.choice(w.prompts)
            while len(seq) < self.cap - rng.randint(0, self.ps):
                seq += rng.choice(w.branches)
            seq = seq[:self.cap - rng.randint(0, self.ps)]
        else:
            seq = rng.choice(w.prompts) + rng.choice(w.branches)
            seq = seq[:rng.randint(1, len(seq))]
        return seq or (1,)

    def remember(self, tokens: Tokens) -> None:
        for k in range(self.ps, len(tokens) + 1, self.ps):
            self.known.add(tokens[:k])

    async def check_hit(self, rank: Rank, ctx: FetchContext, tokens: Tokens) -> None:
        n = ctx.num_cached_tokens
        assert n == 0 or tuple(tokens[:n]) in self.known, (
            f"rank {rank.r}: a hit on {n} tokens {tokens[:n]} that nobody computed")
        tiers = (ctx.num_device_hit_tokens, ctx.num_host_hit_tokens, ctx.num_storage_hit_tokens)
        assert min(tiers) >= 0 and sum(tiers) <= len(tokens)
        assert rank.kv is not None
        if rank.rng.random() < 0.2:  # one layer first, as a layer-by-layer forward pass
            layer = rank.rng.randrange(rank.c.config.spec.num_layers)
            await ctx.layer_ready(layer)
            slots = ctx.device_indices[:n]
            want = rank.kv.expected(tokens, 0, n)[:, layer] if n else None
            if want is not None:
                got = rank.kv._slots[:, layer, slots]
                assert torch.equal(got, want), f"rank {rank.r}: wrong KV of layer {layer}"
        await rank.kv.verify_prefix(ctx, tokens)

    # -------------------------------------------------------------------- steps

    async def admit(self) -> None:
        seqs = [self.sequence() for _ in range(self.rng.randint(1, 4))]
        if self.rng.random() < 0.3:
            seqs = [seqs[0]] * len(seqs)  # the same prompt, several times at once

        def enter(seq: Tokens) -> Planned:
            async def make(rank: Rank) -> FetchContext:
                ctx = rank.c.fetch(list(seq))
                return await ctx.__aenter__()
            return Planned(f"fetch {len(seq)} tokens", make, make)
        victim = self.victim(len(seqs))
        results = await self.batch([enter(s) for s in seqs], victim)
        for seq, ctxs in zip(seqs, results, strict=True):
            if isinstance(ctxs[0], asyncio.CancelledError):
                continue
            await self.on_ranks(lambda rank, ctxs=ctxs, seq=seq: self.check_hit(
                rank, ctxs[rank.r], seq))
            n = ctxs[0].num_cached_tokens
            self.count("requests")
            self.count("hit tokens", n)
            self.count("storage hit tokens", ctxs[0].num_storage_hit_tokens)
            self.live.append(Req(seq, ctxs, n, n, [torch.empty(0, dtype=torch.int64)
                                                    for _ in self.ranks]))

    async def compute(self, *, decode: bool) -> None:
        """Allocate, fill and commit the next part of some live requests (prefill: up to
        the prompt's end, maybe in two chunks; decode: one new token each)."""
        reqs = [q for q in self.live if (q.committed == len(q.tokens)) == decode]
        reqs = self.rng.sample(reqs, min(len(reqs), self.rng.randint(1, 3)))
        if not reqs:
            return
        if decode:
            for q in reqs:
                q.tokens = (*q.tokens, self.rng.randrange(100, 140))
        ends = {id(q): len(q.tokens) for q in reqs}

        def allocate(q: Req) -> Planned:
            async def make(rank: Rank) -> torch.Tensor:
                have = q.full + len(q.own[rank.r])
                return await q.ctxs[rank.r].allocate(ends[id(q)] - have)
            return Planned(f"allocate for {len(q.tokens)} tokens", make, make)
        need = [q for q in reqs if ends[id(q)] > q.full + len(q.own[0])]
        results = await self.batch([allocate(q) for q in need], self.victim(len(need)))
        results += [[torch.empty(0, dtype=torch.int64)] * len(self.ranks)
                    for q in reqs if q not in need]
        reqs = need + [q for q in reqs if q not in need]
        ready = []
        refused = []
        for q, slots in zip(reqs, results, strict=True):
            if isinstance(slots[0], BaseException):
                self.count(type(slots[0]).__name__)
                if decode:
                    q.tokens = q.tokens[:-1]
                if isinstance(slots[0], CapacityError):
                    refused.append(q)  # the scheduler gives up on it (frees its pins)
                continue
            for rank in self.ranks:
                assert rank.kv is not None
                rank.kv.fill(slots[rank.r], q.tokens, q.full + len(q.own[rank.r]))
                q.own[rank.r] = torch.cat([q.own[rank.r], slots[rank.r]])
            if not decode and q.committed == q.full and self.rng.random() < 0.1:
                await self.roll_back(q)  # give the slots back instead
                continue
            self.remember(q.tokens)
            ready.append(q)
        if refused:
            await self.finish(refused)
        parts = {id(q): [ends[id(q)]] for q in ready}
        for q in ready:
            if not decode and ends[id(q)] - q.committed >= 2 and self.rng.random() < 0.3:
                parts[id(q)].insert(0, self.rng.randint(q.committed + 1, ends[id(q)] - 1))
        for chunk in range(2):
            todo = [(q, parts[id(q)][chunk]) for q in ready if len(parts[id(q)]) > chunk]
            if todo:
                await self.commit(todo)

    async def commit(self, todo: list[tuple[Req, int]]) -> None:
        victim = self.victim(len(todo))

        def commit(q: Req, end: int) -> Planned:
            async def make(rank: Rank) -> None:
                await q.ctxs[rank.r].commit(list(q.tokens[:end]),
                                            q.own[rank.r][:end - q.full])

            async def then(rank: Rank) -> Any:  # the context goes on: the next token
                if end < len(q.tokens):
                    return None  # (a chunk: its slots are leased already)
                return await q.ctxs[rank.r].allocate(1)
            return Planned(f"commit {end} of {len(q.tokens)} tokens", make, then)
        results = await self.batch([commit(q, end) for q, end in todo], victim)
        going_on = None
        if self.cancelled and isinstance(results[victim][0], torch.Tensor):  # type: ignore[index]
            going_on = todo[victim][0], results[victim]  # type: ignore[index]
        for q, end in todo:  # a cancelled commit ran too (its op was queued on every rank)
            full = end // self.ps * self.ps
            for rank in self.ranks:
                ctx = q.ctxs[rank.r]
                assert ctx.num_cached_tokens == full, (
                    f"rank {rank.r}: committed {end} tokens, {ctx.num_cached_tokens} cached")
                q.own[rank.r] = q.own[rank.r][full - q.full:]
                assert rank.kv is not None
                await rank.kv.verify_after_commit(ctx, q.tokens[:end],
                                                  q.own[rank.r][:end - full])
            q.full, q.committed = full, end
            self.count("commits")
        if going_on is not None:  # a token decoded after the cancelled commit
            q, slots = going_on
            q.tokens = (*q.tokens, self.rng.randrange(100, 140))
            for rank in self.ranks:
                assert rank.kv is not None
                rank.kv.fill(slots[rank.r], q.tokens, len(q.tokens) - 1)
                q.own[rank.r] = torch.cat([q.own[rank.r], slots[rank.r]])
            self.remember(q.tokens)

    async def abort(self) -> None:
        """A request is aborted while its allocate waits for the tick (another task
        leaves its context): the allocate has the same outcome on every rank."""
        q = self.rng.choice(self.live)
        self.live.remove(q)
        n = self.rng.randint(1, 2 * self.ps)

        async def run(rank: Rank) -> Any:
            ctx = q.ctxs[rank.r]
            allocating = asyncio.ensure_future(ctx.allocate(n))
            await asyncio.sleep(0)
            await ctx.__aexit__(None, None, None)
            return outcome((await asyncio.gather(allocating, return_exceptions=True))[0])
        same(await self.on_ranks(run), "an allocate whose context was left")
        self.count("aborted")

    async def roll_back(self, q: Req) -> None:
        """Give back the slots leased past the committed tokens (no partial page kept)."""
        for rank in self.ranks:
            assert rank.kv is not None
            rank.kv.poison(q.own[rank.r])
            rank.c.free(q.own[rank.r])
            q.own[rank.r] = q.own[rank.r][:0]
        self.count("rollbacks")

    async def finish(self, done: list[Req] | None = None) -> None:
        if done is None:
            done = self.rng.sample(self.live, min(len(self.live), self.rng.randint(1, 3)))
        for q in done:
            self.live.remove(q)

        async def leave(rank: Rank) -> None:
            for q in done:
                await self.check_hit(rank, q.ctxs[rank.r], q.tokens)
                await q.ctxs[rank.r].__aexit__(None, None, None)
        await self.on_ranks(leave)

    async def push_out(self) -> None:
        """Lease every device page there is, one page at a time, then give them back."""
        leased: list[list[torch.Tensor]] = [[] for _ in self.ranks]
        try:
            while True:
                got = await self.batch([Planned("push out", lambda rank: rank.c.allocate(
                    self.ps))], None)
                if isinstance(got[0][0], CapacityError):
                    break
                for rank in self.ranks:
                    assert rank.kv is not None
                    rank.kv.poison(got[0][rank.r])
                    leased[rank.r].append(got[0][rank.r])
        finally:
            for rank in self.ranks:
                for slots in leased[rank.r]:
                    rank.c.free(slots)

    async def drain(self, *, settle: bool = False) -> None:
        async def drain(rank: Rank) -> None:
            if settle or rank.rng.random() < 0.5:
                with anyio.fail_after(10):
                    await rank.c.drain()
            else:
                with anyio.move_on_after(rank.rng.choice([0.0, 0.0005, 0.002])):
                    await rank.c.drain()
        await self.on_ranks(drain)

    async def quiesce(self) -> None:
        """Drain every rank: the ranks stop ticking together, at the same tick."""
        await self.drain(settle=True)
        for _ in range(3):
            await asyncio.sleep(0)
        same([len(rank.ticks) for rank in self.ranks], "ticks when idle")
        same([rank.print() for rank in self.ranks], "state when idle")
        same([rank.core_stats() for rank in self.ranks], "counters when idle")

    async def forget_host(self) -> None:
        """Push every page off the device, then empty the host: only L3 is left (done with
        the ranks idle and at the same tick, as the ticks do not see it)."""
        await self.quiesce()
        await self.push_out()
        await self.quiesce()
        for rank in self.ranks:
            rank.c.tree.evict_host(rank.c.host_pool.num_pages)
        self.count("forget host")

    def corrupt(self) -> None:
        """Flip a byte of a stored page on one shard's store (its read fails its check)."""
        backends = [b for b in self.world.backends.values() if b._objects]
        if backends:
            backend = self.rng.choice(backends)
            blob = backend._objects[self.rng.choice(sorted(backend._objects))]
            blob[self.rng.randrange(len(blob))] ^= 0xFF
            self.count("corrupt")

    async def leave_all(self) -> None:
        for q in list(self.live):
            self.live.remove(q)
            for rank in self.ranks:
                await q.ctxs[rank.r].__aexit__(None, None, None)

    async def restart(self) -> None:
        """Close every rank (drained or not; open requests left before, or after: closed
        under them) and open them again over the same groups and stores."""
        before = self.rng.random() < 0.5
        if before:
            await self.leave_all()
        if self.rng.random() < 0.5:
            await self.drain(settle=True)
        await self.on_ranks(lambda rank: rank.c.aclose())
        self.check_closed()
        await self.leave_all()
        await self.on_ranks(lambda rank: rank.start())
        self.count("restarts")

    def check_closed(self) -> None:
        """Every rank closed at the same tick, healthy (a restart's ticks start there)."""
        same([rank.c.stats().tp["ticks"] for rank in self.ranks],  # type: ignore[index]
             "ticks at close")
        for rank in self.ranks:
            assert rank.c.stats().health != "failed", f"rank {rank.r} failed closing"

    async def close_under(self) -> None:
        """Requests in flight as every rank closes (a server shutting down): each call has
        the same outcome on every rank, whichever side of the close its tick fell."""
        seqs = [self.sequence() for _ in range(self.rng.randint(1, 3))]

        async def run(rank: Rank) -> list[Any]:
            tasks = [asyncio.ensure_future(rank.c.fetch(list(s)).__aenter__()) for s in seqs]
            tasks.append(asyncio.ensure_future(rank.c.allocate(self.ps)))
            await asyncio.sleep(0)
            closing = asyncio.ensure_future(rank.c.aclose())
            got = await asyncio.gather(*tasks, return_exceptions=True)
            await closing
            for ctx in got[:-1]:
                if isinstance(ctx, FetchContext):
                    await ctx.__aexit__(None, None, None)
            return got
        await self.leave_all()
        got = await self.on_ranks(run)
        self.check_closed()
        for i in range(len(seqs) + 1):
            results = [g[i] for g in got]
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                        result, ClosedError | CapacityError):
                    raise AssertionError(f"call {i} failed at close") from result
            same([outcome(x) for x in results], f"call {i} made just before closing")
        await self.on_ranks(lambda rank: rank.start())
        self.count("closed under")

    async def step(self) -> None:
        what = self.rng.random()
        if len(self.live) >= 3 and self.rng.random() < 0.5:
            await self.finish()
        elif what < 0.3 or not self.live:
            await self.admit()
            if self.rng.random() < 0.7:  # computed in the same scheduler step
                await self.compute(decode=False)
        elif what < 0.5:
            await self.compute(decode=False)
        elif what < 0.6:
            await self.compute(decode=True)
        elif what < 0.66:
            await self.finish()
        elif what < 0.68:
            await self.abort()
        elif what < 0.72:
            await self.push_out()
        elif what < 0.79:
            await self.drain()
        elif what < 0.84:
            await self.forget_host()
        elif what < 0.89:
            await self.restart()
        elif what < 0.92:
            await self.close_under()
        elif what < 0.95:
            self.corrupt()
        else:
            await asyncio.sleep(self.rng.choice([0.0, 0.001, 0.01]))
        self.check_step()

    def check_step(self) -> None:
        """Invariants on every rank; the ranks went through the same states, tick by tick."""
        for rank in self.ranks:
            rank.c.check_invariants()
            health = rank.c.stats().health
            assert health in (("ok", "degraded") if rank.faulty else ("ok",)), (
                f"rank {rank.r}: health {health}")
        common = min(len(rank.ticks) for rank in self.ranks)
        for t in range(common):
            same([rank.ticks[t] for rank in self.ranks], f"the state after tick {t + 1}")

    # -------------------------------------------------------------------- the end

    async def final_check(self) -> None:
        await self.leave_all()
        await self.quiesce()
        for rank in self.ranks:
            if not rank.faulty:
                assert_backed_up(rank)
        probes = sorted(self.known, key=lambda t: (len(t), t))
        probes = self.rng.sample(probes, min(len(probes), 10))
        await self.probe(self.ranks, probes, "probe")
        if self.world.store in ("memory", "faulty", "file"):
            groups = TPGroup.local(self.world.size, timeout=TP_TIMEOUT)
            fresh = [Rank(r, groups[r], self.world, random.Random(self.rng.random()))
                     for r in range(self.world.size)]
            await asyncio.gather(*(rank.start() for rank in fresh))
            try:  # twice: a prefetch that did not wait (best effort) serves the second
                await self.probe(fresh, probes, "fresh ranks")
                await self.probe(fresh, probes, "fresh ranks")
            finally:
                await close_all(fresh)
            for rank in fresh:
                assert_quiescent(rank)
        if self.world.store in ("memory", "file") and self.world.mla:
            alone = Rank(0, TPGroup.single(), self.world, random.Random(self.rng.random()),
                         alone=True)
            await alone.start()
            try:
                await self.probe([alone], probes, "one rank")
                await self.probe([alone], probes, "one rank")
            finally:
                await alone.c.aclose()

    async def check_released(self) -> None:
        """Every context has been left: once a call has run the releases still waiting for
        a tick (lazy), nothing is pinned and only that call's page is leased."""
        got = await self.batch([Planned("allocate a page", lambda rank: rank.c.allocate(
            self.ps))], None)
        for rank, slots in zip(self.ranks, got[0], strict=True):
            mine = 0 if isinstance(slots, CapacityError) else 1
            assert not rank.c._pins, f"rank {rank.r}: pins outlive their contexts"
            leased = rank.c.stats().device_pages_leased
            assert leased == mine, f"rank {rank.r}: {leased - mine} pages leased by nobody"
            if mine:
                rank.c.free(slots)

    async def probe(self, ranks: list[Rank], probes: list[Tokens], what: str) -> None:
        """Every computed prefix is served right or missed, alike on every rank."""
        for seq in probes:
            async def one(rank: Rank, seq: Tokens = seq) -> Any:
                async with rank.c.fetch(list(seq)) as hit:
                    await self.check_hit(rank, hit, seq)
                    return outcome(hit)
            hit = same(list(await asyncio.gather(*(one(rank) for rank in ranks))),
                       f"probe {seq}")
            self.count(f"{what} hit tokens", hit[1])
            self.count(f"{what} storage hit tokens", hit[4])

        async def settle(rank: Rank) -> None:
            with anyio.fail_after(10):
                await rank.c.drain()
        await asyncio.gather(*(settle(rank) for rank in ranks))

    async def run(self, steps: int) -> dict[str, int]:
        before = asyncio.all_tasks()
        await asyncio.gather(*(rank.start() for rank in self.ranks))
        try:
            with anyio.fail_after(TIME_LIMIT):
                for _ in range(steps):
                    await self.step()
                await self.final_check()
                await self.check_released()
                # closing is an op: it runs the releases still waiting for a tick (lazy)
                await close_all(self.ranks)
        finally:
            with anyio.move_on_after(TP_TIMEOUT + 5):
                await close_all(self.ranks)
            for backend in self.world.backends.values():
                await backend.aclose()
        same([rank.c._tp.ticks for rank in self.ranks], "ticks")  # type: ignore[union-attr]
        same([rank.print() for rank in self.ranks], "the state at the end")
        same([rank.core_stats() for rank in self.ranks], "counters at the end")
        for rank in self.ranks:
            assert_quiescent(rank)
        for _ in range(5):
            await asyncio.sleep(0)
        left = {t for t in asyncio.all_tasks() - before if not t.done()}
        assert not left, f"tasks left running after every rank closed: {left}"
        return self.counts


async def close_all(ranks: list[Rank]) -> None:
    """Close every rank at once (closing is agreed: a rank alone waits for the others)."""
    await asyncio.gather(*(rank.c.aclose() for rank in ranks if rank.cache is not None))


def assert_quiescent(rank: Rank) -> None:
    cache = rank.c
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0, f"rank {rank.r}: {stats.device_pages_leased} leased"
    assert stats.pending_loads == stats.pending_writes == 0, f"rank {rank.r}: copies pending"
    assert not cache._pins, f"rank {rank.r}: pins outlive their contexts: {cache._pins}"
    assert cache._tp is None or cache._tp.finished.done()
    assert stats.health in (("ok", "degraded") if rank.faulty else ("ok",)), stats.health


def assert_backed_up(rank: Rank) -> None:
    """After a drain, every settled host copy with `backup_threshold` hits is in L3, as
    test_harness_l3_review checks, naming the rank."""
    try:
        harness_l3.assert_backed_up(rank.c)
    except AssertionError as exc:
        raise AssertionError(f"rank {rank.r}: {exc}") from None


async def run_seed(seed: int, directory: Path, steps: int = STEPS) -> dict[str, int]:
    """Draw world `seed` and drive it `steps` steps; raise on the first broken rule."""
    return await Driver(draw_world(seed, directory)).run(steps)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
async def test_random_tp_worlds_stay_identical_and_serve_right_or_miss(
        seed: int, tmp_path: Path) -> None:
    """Random configs, workloads, cancellations landing at different points per rank,
    restarts and L3 faults: every rank serves exactly the KV its tokens were computed with,
    and every rank goes through the same states."""
    try:
        counts = await run_seed(seed, tmp_path)
    except BaseException as exc:
        exc.add_note(describe(seed, tmp_path))
        raise
    assert counts.get("requests", 0) > 0


# ------------------------------------------------------------------------------ findings

async def test_a_context_dropped_unexited_acts_the_same_on_every_rank() -> None:
    """A context entered by hand and dropped (misuse) is released when the GC finalises it,
    on the loop's next turn. With TP that release is an op queued *then*: a point that
    differs by rank (GC timing; whether the loop turned before the next call). On rank 0
    the next call was queued first and ran with the prefix still pinned (CapacityError); on
    rank 1 the release ran first and the same call leased the pages: the same call had other
    outcomes on the ranks, and their states parted."""
    from .test_local import assert_same, serve, tp_caches

    caches = tp_caches(2, device_pages=4)
    tokens = list(range(500, 508))  # 2 pages

    async def rank(r: int, cache: HiCache) -> Any:
        await serve(cache, tokens)  # cached
        await cache.drain()
        ctx = cache.fetch(tokens)
        await ctx.__aenter__()  # pins the prefix; never exited
        with pytest.warns(ResourceWarning, match="never exited"):
            del ctx
            gc.collect()
        if r == 1:
            await asyncio.sleep(0)  # this rank's loop turned before its next call
        try:
            slots = await cache.allocate(16)  # the whole pool: the prefix must go
        except CapacityError as exc:
            return type(exc).__name__
        cache.free(slots)
        return "leased"

    for cache in caches:
        await cache.__aenter__()
    try:
        outcomes = await asyncio.gather(*(rank(r, c) for r, c in enumerate(caches)))
        assert outcomes[0] == outcomes[1], outcomes
        await asyncio.gather(*(serve(c, list(range(900, 904))) for c in caches))  # a tick
        assert_same(caches)
    finally:
        await asyncio.gather(*(c.aclose() for c in caches))
