"""A seeded random harness over the whole stack with L3: correct-or-miss, invariants, no leak.

Each seed draws a world and drives it: one to three `HiCache` instances on one event loop,
sharing one L3 (a ``file://`` directory with tiny segments, or one `MemoryBackend` object),
each with its own ``memory://`` L3, or none; random configs (page size 1-8, tiny device and
host pools, LRU / LFU / ARC eviction per tier, every write policy, every prefetch policy
with a small threshold, backup threshold 1-3, no or a short negative cache, ...); and a
workload of shared system prompts with branching continuations, repeated prompts and long
prompts near the device's capacity. Requests run several at once and are cancelled at
random points (entering, ``ready``, ``layer_ready``, ``allocate``, ``commit``, decoding)
by anyio cancel scopes with small random timeouts, and roll their slots back with
``free``; while they run an instance is drained (maybe cancelled) or restarted under them;
between steps the device is pushed out, the host emptied, an instance drained or restarted
over the same store, and a stored object corrupted behind everyone's back. Some instances
reach a shared in-memory store through a fault injector (errors, timeouts, latency,
corrupt and partial reads).

Every hit is checked: the cached prefix must be one some request committed and, once
``ready()`` (or ``layer_ready(layer)`` for that layer) returned, hold exactly its KV
(`KVChecker`: a function of the tokens, their positions and their prefix, so the same in
every instance and every tier), and its tiers must add up to it. A request alone on its
cache may be refused slots only if it could not fit beside its own prefix.
``check_invariants()`` runs after every step; at the end every instance must be quiescent
(nothing leased, pinned or in flight), have backed up every settled host copy with
`backup_threshold` hits, and serve every committed prefix right or miss it, and so must a
fresh instance reading only L3.

``AIOHICACHE_HARNESS_SEEDS`` (default 6) sets how many seeds the test runs, from
``AIOHICACHE_HARNESS_FIRST_SEED`` (default 0); a failure names its seed, and
`run_seed` replays it.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aiohicache import CapacityError, ClosedError, FetchContext, HiCache, HiCacheConfig
from aiohicache.controller import page_format
from aiohicache.radix import HostState
from aiohicache.storage import FaultyBackend
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import SPEC_MHA, SPEC_MLA
from tests.kvcheck import KVChecker
from tests.test_stateful import JitteryEngine

SEEDS = int(os.environ.get("AIOHICACHE_HARNESS_SEEDS", "6"))
FIRST_SEED = int(os.environ.get("AIOHICACHE_HARNESS_FIRST_SEED", "0"))
TIME_LIMIT = 20.0
"""Seconds one seed may take before it counts as hung (a seed takes well under one)."""

Tokens = tuple[int, ...]


# ------------------------------------------------------------------------------ the world

def draw_config(rng: random.Random, with_l3: bool) -> dict[str, Any]:
    """Random config fields (storage excluded) for one world; tiny pools."""
    ps = rng.randint(1, 8)
    device_pages = rng.randint(4, 16)
    ev = ["lru", "lfu", "arc"]
    fields: dict[str, Any] = {
        "spec": rng.choice([SPEC_MHA, SPEC_MLA]),
        "page_size": ps,
        "device_pages": device_pages,
        "host_pages": rng.choice([0, device_pages // 2 + 1, device_pages, 2 * device_pages,
                                  3 * device_pages]),
        "host_layout": rng.choice(["page_first", "layer_first"]),
        "write_policy": rng.choice(["write_through", "write_through_selective",
                                    "write_back"]),
        "eviction": rng.choice(ev) if rng.random() < 0.6 else (rng.choice(ev), rng.choice(ev)),
        "load_back_threshold": rng.choice([0, 0, 0, ps]),
        "max_inflight_loads": rng.choice([1, 2, 64]),
        "max_inflight_writes": rng.choice([1, 2, 64]),
    }
    if rng.random() < 0.3:
        fields["write_through_threshold"] = rng.randint(1, 3)
    if with_l3:
        fields.update({
            "prefetch_policy": rng.choice(["best_effort", "wait_complete", "timeout"]),
            "prefetch_threshold": rng.randint(1, 3 * ps),
            "prefetch_timeout_base": rng.choice([0.0, 0.002, 0.02]),
            "prefetch_timeout_max": 0.05,
            "prefetch_host_fraction": rng.choice([0.25, 0.5, 1.0]),
            "backup_threshold": rng.randint(1, 3),
            "storage_miss_ttl": rng.choice([0.0, 0.0, 0.005, 0.05]),
            "storage_cooldown": 0.02,
        })
    return fields


@dataclass
class World:
    """What a seed drew: the store, the instances' configs, the workload's pieces."""

    seed: int
    store: str
    """``file`` (one shared directory), ``shared_memory`` (one `MemoryBackend` object),
    ``memory`` (each cache its own ``memory://``) or ``none``."""
    configs: list[HiCacheConfig]
    prompts: list[Tokens]
    """System prompts (some share a head), continued by `branches`."""
    branches: list[Tokens]
    directory: Path
    backend: MemoryBackend | None = None
    notes: list[str] = field(default_factory=list)

    def storage(self, config: HiCacheConfig) -> object:
        if self.store == "file":
            size = 64 * (64 + config.page_bytes)
            return (f"file://{self.directory}?segment_bytes={4 * (64 + config.page_bytes)}"
                    f"&max_bytes={size}")
        if self.store == "shared_memory":
            assert self.backend is not None
            return self.backend
        if self.store == "memory":
            return "memory://"
        return None


def draw_world(seed: int, directory: Path) -> World:
    rng = random.Random(seed)
    store = rng.choice(["file", "file", "shared_memory", "shared_memory", "memory", "none"])
    base = draw_config(rng, store != "none")
    count = 1 if store in ("memory", "none") else rng.randint(1, 3)
    configs = []
    for _ in range(count):
        fields = dict(base)
        if rng.random() < 0.5:  # instances of one model may differ in policies
            other = draw_config(rng, store != "none")
            for name in ("write_policy", "eviction", "prefetch_policy", "backup_threshold",
                         "prefetch_threshold", "storage_miss_ttl",
                         "host_pages", "device_pages"):
                if name in other and rng.random() < 0.5:
                    fields[name] = other[name]
        configs.append(HiCacheConfig(**fields))
    ps, cap = base["page_size"], min(c.device_pages for c in configs) * base["page_size"]
    alphabet = rng.randint(3, 40)  # few token ids: pages of different prompts collide

    def toks(n: int) -> Tokens:
        return tuple(rng.randrange(alphabet) for _ in range(n))
    heads = [toks(rng.randint(0, 2 * ps)) for _ in range(2)]
    prompts = [rng.choice(heads) + toks(rng.randint(1, 3 * ps)) for _ in range(rng.randint(1, 4))]
    branches = [toks(rng.randint(1, max(1, cap // 2))) for _ in range(rng.randint(2, 6))]
    world = World(seed, store, configs, prompts, branches, directory)
    if store == "shared_memory":
        world.backend = MemoryBackend(page_format(configs[0]), capacity_bytes=rng.choice(
            [None, 24 * (64 + configs[0].page_bytes)]))
    return world


# ------------------------------------------------------------------------------ checks

def verify_layer(kv: KVChecker, slots: torch.Tensor, tokens: Tokens, layer: int) -> None:
    """`slots` hold the KV of ``tokens[:len(slots)]`` in `layer` (K and V)."""
    if not len(slots):
        return
    got = kv._slots[:, layer, slots.to(kv._slots.device)]
    want = kv.expected(tokens, 0, len(slots))[:, layer]
    if not torch.equal(got, want):
        bad = int((got != want).any(dim=-1).any(dim=0).nonzero()[0])
        raise AssertionError(f"after layer_ready({layer}): wrong KV of layer {layer} at "
                             f"position {bad} (slot {int(slots[bad])}) of the cached prefix")


@dataclass(eq=False)
class Instance:
    name: str
    config: HiCacheConfig
    world: World
    rng: random.Random
    cache: HiCache | None = None
    kv: KVChecker | None = None
    engine: JitteryEngine | None = None
    starts: int = 0
    faulty: bool = False
    """Some generation reached L3 through a fault injector (its health may degrade)."""

    async def start(self) -> None:
        self.engine = JitteryEngine(self.rng.randrange(2**32), inline=self.rng.random() < 0.5)
        storage = self.world.storage(self.config)
        if isinstance(storage, MemoryBackend) and self.rng.random() < 0.4:
            # this instance reaches the shared store through faults (the wrapper stays
            # open: closing it would close the store under the others)
            storage = FaultyBackend(storage, seed=self.rng.randrange(2**32), error_rate=0.02,
                                    latency=(0.0, 0.002), timeout_rate=0.005,
                                    corrupt_rate=0.02, partial_rate=0.03, timeout_s=0.005)
            self.faulty = True
        cfg = replace(self.config, storage=storage)
        self.cache = HiCache(cfg, engine=self.engine)
        self.engine.attach(self.cache)
        self.kv = KVChecker(self.cache)
        await self.cache.__aenter__()
        self.starts += 1

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    async def stop(self, *, drain: bool) -> None:
        cache = self.c
        if drain:
            await settle(cache)
            assert_quiescent(cache, self.faulty)
        self.cache = None  # (requests it refuses from now on were closed under)
        try:
            await cache.aclose()
        except BaseException:
            self.cache = cache  # for the driver's clean-up
            raise


async def settle(cache: HiCache) -> None:
    try:
        with anyio.fail_after(5):
            await cache.drain()
    except TimeoutError:
        raise AssertionError("drain() hung: a planned transfer was lost") from None


def assert_quiescent(cache: HiCache, faulty: bool = False) -> None:
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0, f"{stats.device_pages_leased} pages still leased"
    assert stats.pending_loads == stats.pending_writes == 0, "transfers still pending"
    assert not cache._pins, f"pins outlive their contexts: {cache._pins}"
    assert stats.health in (("ok", "degraded") if faulty else ("ok",)), stats.health


def assert_backed_up(cache: HiCache) -> None:
    """After a drain, every settled host copy with `backup_threshold` hits is in L3 (as far
    as the cache knows: its pages' `stored` flags)."""
    if cache.storage is None:
        return
    threshold = cache.config.backup_threshold
    for node in cache.tree.iter_nodes():
        if node.host_state is HostState.RESIDENT and node.hit_count >= threshold:
            assert node.stored is not None and all(node.stored), (
                f"{node!r} has {node.hit_count} hits (backup_threshold {threshold}) and a "
                f"settled host copy, but is not backed up: stored={node.stored}")


# ------------------------------------------------------------------------------ the driver

@dataclass
class Counts:
    requests: int = 0
    hits: int = 0
    hit_tokens: int = 0
    cancelled: int = 0
    capacity: int = 0
    commits: int = 0
    restarts: int = 0
    aborted: int = 0
    """Requests refused by a cache closed under them."""
    storage_hit_tokens: int = 0


@dataclass(eq=False)
class OpenRequest:
    """A fetch context kept open across steps (a request still decoding): its pins hold."""

    inst: Instance
    cache: HiCache
    ctx: FetchContext
    tokens: Tokens
    kv: KVChecker


class Driver:
    """Drives one world: random steps, each a few concurrent requests or an event."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = random.Random(world.seed * 7919 + 1)
        self.instances = [Instance(f"i{i}", cfg, world, random.Random(self.rng.random()))
                          for i, cfg in enumerate(world.configs)]
        self.known: set[Tokens] = set()
        """Every whole-page prefix of every sequence some request computed (committed or
        about to: a cancelled commit may have inserted it)."""
        self.counts = Counts()
        self.ps = world.configs[0].page_size
        self.open: list[OpenRequest] = []

    # -------------------------------------------------------------------- workload

    def sequence(self) -> Tokens:
        rng, w = self.rng, self.world
        cap = min(c.device_pages for c in w.configs) * self.ps
        kind = rng.random()
        fresh = tuple(rng.randrange(100, 140) for _ in range(rng.randint(0, 2 * self.ps)))
        if kind < 0.55:
            seq = rng.choice(w.prompts) + rng.choice(w.branches) + fresh
        elif kind < 0.7:
            seq = rng.choice(w.prompts) + fresh
        elif kind < 0.85:  # long: near the device's capacity
            seq = rng.choice(w.prompts)
            while len(seq) < cap - rng.randint(0, self.ps):
                seq += rng.choice(w.branches)
            seq = seq[:cap - rng.randint(0, self.ps)]
        else:  # a cut of a prompt + branch (a prefix of an earlier request)
            seq = rng.choice(w.prompts) + rng.choice(w.branches)
            seq = seq[:rng.randint(1, len(seq))]
        return seq or (1,)

    def remember(self, tokens: Tokens) -> None:
        for k in range(self.ps, len(tokens) + 1, self.ps):
            self.known.add(tokens[:k])

    # -------------------------------------------------------------------- one request

    async def check_hit(self, inst: Instance, hit: Any, tokens: Tokens,
                        kv: KVChecker | None = None) -> None:
        n = hit.num_cached_tokens
        assert n == 0 or tokens[:n] in self.known, (
            f"{inst.name}: hit on {n} tokens {tokens[:n]} that nobody computed")
        kv = kv or inst.kv
        assert kv is not None
        await kv.verify_prefix(hit, tokens)

    async def request(self, inst: Instance, tokens: Tokens, solo: bool = False) -> None:
        """Serve `tokens` on `inst`; a cache closed under the request (a concurrent
        restart) may refuse it with ClosedError, nothing else."""
        cache = inst.cache
        if cache is None:  # restarting
            return
        try:
            await self._request(inst, cache, tokens, solo)
        except ClosedError:
            if inst.cache is cache:
                raise
            self.counts.aborted += 1

    async def _request(self, inst: Instance, cache: HiCache, tokens: Tokens,
                       solo: bool) -> None:
        """`solo`: no other request runs on this cache (nor anything leased outside one),
        so a CapacityError means the pool is too small for this request alone."""
        rng, kv = self.rng, KVChecker(cache)

        def refused(num_tokens: int) -> None:
            self.counts.capacity += 1
            held = -(-hit.num_cached_tokens // self.ps)
            need = -(-num_tokens // self.ps)
            assert not solo or need + held > cache.config.device_pages, (
                f"{inst.name}: allocate({num_tokens}) refused ({need} pages), although this "
                f"request alone holds {held} of {cache.config.device_pages} pages")
        self.counts.requests += 1
        cut = rng.choice([None] * 8 + ["enter", "ready", "layer", "allocate", "commit",
                                       "decode", "whole"])
        delay = rng.choice([0.0, 0.0, 0.0002, 0.001, 0.004])
        layer = rng.randrange(cache.config.spec.num_layers) if rng.random() < 0.3 else None
        decode = rng.randint(1, 2 * self.ps) if rng.random() < 0.3 else 0
        mid = rng.random() < 0.25  # commit a cut first (chunked prefill), then the rest

        def scope(name: str) -> anyio.CancelScope:
            return anyio.move_on_after(delay if cut == name else math.inf)

        with anyio.move_on_after(delay if cut in ("enter", "whole") else math.inf) as outer:
            async with cache.fetch(tokens) as hit:
                n = hit.num_cached_tokens
                tiers = (hit.num_device_hit_tokens, hit.num_host_hit_tokens,
                         hit.num_storage_hit_tokens)
                assert min(tiers) >= 0 and sum(tiers) == n, f"hit tiers {tiers} for {n} tokens"
                if n:
                    self.counts.hits += 1
                    self.counts.hit_tokens += n
                if layer is not None:
                    with scope("layer"):
                        await hit.layer_ready(layer)
                        verify_layer(kv, hit.device_indices[:n], tokens, layer)
                with scope("ready") as s:
                    await self.check_hit(inst, hit, tokens, kv)
                cached = hit.num_cached_tokens
                if cached == len(tokens):
                    return
                slots = None
                with scope("allocate") as s:
                    try:
                        slots = await hit.allocate(len(tokens) - cached)
                    except CapacityError:
                        refused(len(tokens) - cached)
                if slots is not None and rng.random() < 0.1:
                    # give the slots back (a rollback), then ask again: the context's next
                    # allocate must not count them, nor hand out a page someone else holds
                    kv.poison(slots)
                    cache.free(slots)
                    slots = None
                    with scope("allocate"):
                        try:
                            slots = await hit.allocate(len(tokens) - cached)
                        except CapacityError:
                            refused(len(tokens) - cached)
                if slots is None:
                    return
                kv.fill(slots, tokens, cached)
                self.remember(tokens)
                parts = [len(tokens)]
                if mid and len(tokens) - cached >= 2:
                    parts.insert(0, rng.randint(cached + 1, len(tokens) - 1))
                for end in parts:
                    first = hit.num_cached_tokens
                    with scope("commit") as s:
                        await hit.commit(tokens[:end], slots[first - cached:end - cached])
                        self.counts.commits += 1
                    if s.cancelled_caught:
                        # the commit may or may not have happened: the prefix is right either way
                        await self.check_hit(inst, hit, tokens, kv)
                        return
                    full = end // self.ps * self.ps
                    assert hit.num_cached_tokens == full, (
                        f"committed {end} tokens: {hit.num_cached_tokens} cached, not {full}")
                    tail = slots[full - cached:end - cached]
                    await kv.verify_after_commit(hit, tokens[:end], tail)
                if decode:
                    await self.decode(kv, inst, hit, tokens, slots, cached, decode, scope)
        if outer.cancelled_caught:
            self.counts.cancelled += 1

    async def decode(self, kv: KVChecker, inst: Instance, hit: Any, tokens: Tokens,
                     slots: torch.Tensor, cached: int, count: int,
                     scope: Callable[[str], anyio.CancelScope]) -> None:
        """Decode `count` more tokens after `tokens` (committed), one allocate each."""
        full = len(tokens) // self.ps * self.ps
        tail = slots[full - cached:] if full >= cached else slots
        for _ in range(count):
            with scope("decode") as s:
                try:
                    new = await hit.allocate(1)
                except CapacityError:
                    self.counts.capacity += 1
                    return
            if s.cancelled_caught:
                return
            tokens = (*tokens, self.rng.randrange(100, 140))
            kv.fill(new, tokens, len(tokens) - 1)
            tail = torch.cat([tail, new])
            self.remember(tokens)
            with scope("decode") as s:
                await hit.commit(tokens, tail)
            if s.cancelled_caught:
                await self.check_hit(inst, hit, tokens, kv)
                return
            full = len(tokens) // self.ps * self.ps
            tail = tail[len(tail) - (len(tokens) - full):]
            await kv.verify_after_commit(hit, tokens, tail)

    # -------------------------------------------------------------------- events

    async def push_out(self, inst: Instance) -> None:
        """Lease every device page there is (evicting or staging what is cached), give it
        back: what was on the device is now on the host or gone."""
        cache, leased = inst.c, []
        try:
            while True:
                try:
                    leased.append(await cache.allocate(self.ps))
                except CapacityError:
                    break
                assert inst.kv is not None
                inst.kv.poison(leased[-1])
        finally:
            for slots in leased:
                cache.free(slots)

    async def forget_host(self, inst: Instance) -> None:
        await settle(inst.c)
        await self.push_out(inst)
        await settle(inst.c)
        inst.c.tree.evict_host(inst.c.host_pool.num_pages)

    def corrupt(self) -> None:
        backend = self.world.backend
        if backend is not None and backend._objects:
            blob = backend._objects[self.rng.choice(sorted(backend._objects))]
            blob[self.rng.randrange(len(blob))] ^= 0xFF

    async def drain(self, inst: Instance) -> None:
        if self.rng.random() < 0.5:
            with anyio.move_on_after(self.rng.choice([0.0, 0.0005, 0.002])):
                await inst.c.drain()
        else:
            await settle(inst.c)

    async def restart(self, inst: Instance, *, under: bool = False) -> None:
        """Close `inst` (drained and checked first, unless requests run: `under`) and open
        it again over the same store. Its open requests end before, or after (closed under
        them)."""
        self.counts.restarts += 1
        self.counts.storage_hit_tokens += inst.c.stats().storage_hit_tokens
        mine = [o for o in self.open if o.inst is inst]
        before = not under and self.rng.random() < 0.5
        if before:
            await self.close_requests(mine)
        await inst.stop(drain=before and self.rng.random() < 0.7)
        await self.close_requests(mine)
        await inst.start()

    async def close_requests(self, requests: list[OpenRequest]) -> None:
        for req in requests:
            if req in self.open:
                self.open.remove(req)
                await req.ctx.__aexit__(None, None, None)

    async def open_or_close(self, inst: Instance) -> None:
        """Open a request that stays open across steps (computing part of its rest), or
        end one."""
        rng = self.rng
        if self.open and (len(self.open) >= 2 or rng.random() < 0.4):
            await self.close_requests([rng.choice(self.open)])
            return
        cache, tokens = inst.c, self.sequence()
        kv = KVChecker(cache)
        ctx = cache.fetch(tokens)
        await ctx.__aenter__()
        req = OpenRequest(inst, cache, ctx, tokens, kv)
        self.open.append(req)
        await self.check_hit(inst, ctx, tokens, kv)
        cached = ctx.num_cached_tokens
        end = rng.randint(cached, len(tokens))
        if end > cached:
            try:
                slots = await ctx.allocate(end - cached)
            except CapacityError:
                return
            kv.fill(slots, tokens, cached)
            self.remember(tokens[:end])
            await ctx.commit(tokens[:end], slots)
            await self.check_hit(inst, ctx, tokens, kv)

    async def check_open(self) -> None:
        """What open requests hold stays intact whatever ran meanwhile."""
        for req in list(self.open):
            if req.inst.cache is not req.cache:  # closed under it by a restart
                await self.close_requests([req])
                continue
            await self.check_hit(req.inst, req.ctx, req.tokens, req.kv)

    async def meddle(self, inst: Instance) -> None:
        """While requests run: drain `inst` (maybe cancelled), or restart it under them."""
        await asyncio.sleep(self.rng.choice([0.0, 0.0005, 0.002]))
        if inst.cache is None:
            return
        if self.rng.random() < 0.6:
            with anyio.move_on_after(self.rng.choice([0.0, 0.0005, 0.002])):
                await inst.c.drain()
        else:
            await self.restart(inst, under=True)

    # -------------------------------------------------------------------- steps

    async def step(self) -> None:
        rng = self.rng
        what = rng.random()
        inst = rng.choice(self.instances)
        if what < 0.6:
            batch = [(rng.choice(self.instances), self.sequence())
                     for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.3:  # the same prompt, at once, on every instance
                seq = self.sequence()
                batch = [(i, seq) for i in self.instances for _ in range(rng.randint(1, 2))]
            meddle = rng.random() < 0.2
            async with anyio.create_task_group() as tg:
                for i, seq in batch:
                    solo = not meddle and sum(j is i for j, _ in batch) == 1 and not any(
                        o.inst is i for o in self.open)
                    tg.start_soon(self.request, i, seq, solo)
                if meddle:
                    tg.start_soon(self.meddle, inst)
        elif what < 0.66:
            await self.open_or_close(inst)
        elif what < 0.72:
            await self.push_out(inst)
        elif what < 0.78:
            await self.forget_host(inst)
        elif what < 0.88:
            await self.drain(inst)
        elif what < 0.94:
            await self.restart(inst)
        elif what < 0.97:
            self.corrupt()
        else:
            await asyncio.sleep(rng.choice([0.0, 0.001, 0.01]))  # let backups and misses age
        await self.check_open()
        for i in self.instances:
            i.c.check_invariants()
            assert i.c.stats().health in (("ok", "degraded") if i.faulty else ("ok",)), \
                i.c.stats().health

    async def final_check(self) -> None:
        """Quiescent everywhere; every committed prefix served right or missed, by every
        instance, and (with a shared store) by a fresh one reading only L3."""
        await self.check_open()
        await self.close_requests(list(self.open))
        for inst in self.instances:
            await settle(inst.c)
            assert_quiescent(inst.c, inst.faulty)
            if not inst.faulty:
                assert_backed_up(inst.c)
        probes = sorted(self.known, key=lambda t: (len(t), t))
        probes = self.rng.sample(probes, min(len(probes), 12))
        for inst in self.instances:
            for seq in probes:
                async with inst.c.fetch(seq) as hit:
                    await self.check_hit(inst, hit, seq)
            await settle(inst.c)
            assert_quiescent(inst.c, inst.faulty)
        if self.world.store in ("file", "shared_memory"):
            fresh = Instance("fresh", self.instances[0].config, self.world,
                             random.Random(self.rng.random()))
            await fresh.start()
            try:
                await self.forget_host(fresh)
                for seq in probes:
                    async with fresh.c.fetch(seq) as hit:
                        await self.check_hit(fresh, hit, seq)
                await settle(fresh.c)
                assert_quiescent(fresh.c)
            finally:
                await fresh.c.aclose()

    async def run(self, steps: int) -> Counts:
        for inst in self.instances:
            await inst.start()
        try:
            with anyio.fail_after(TIME_LIMIT):
                for _ in range(steps):
                    await self.step()
                await self.final_check()
                for inst in self.instances:
                    self.counts.storage_hit_tokens += inst.c.stats().storage_hit_tokens
                    await inst.stop(drain=True)
        finally:
            for inst in self.instances:
                if inst.cache is not None:
                    await abandon(inst.cache)
            if self.world.backend is not None:
                await self.world.backend.aclose()
        return self.counts


async def abandon(cache: HiCache) -> None:
    """Close without waiting for what a failure may have lost."""
    if "closed" not in repr(cache):
        async def at_once() -> None:
            pass
        cache.controller.drain = at_once  # type: ignore[method-assign]
        await cache.aclose()


async def run_seed(seed: int, directory: Path, steps: int = 40) -> Counts:
    """Draw world `seed` and drive it `steps` steps; raise on the first broken rule."""
    world = draw_world(seed, directory)
    return await Driver(world).run(steps)


def describe(seed: int, directory: Path) -> str:
    w = draw_world(seed, directory)
    return f"seed {seed}: store={w.store} configs={w.configs}"


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
async def test_random_worlds_serve_right_or_miss(seed: int, tmp_path: Path) -> None:
    """Random configs, workloads, cancellations, restarts and corruption: every hit holds
    exactly the KV its tokens were computed with, and the cache stays consistent."""
    counts = await run_seed(seed, tmp_path)
    assert counts.requests > 0


# ------------------------------------------------------------------------------ findings

async def test_slots_given_back_with_free_do_not_count_against_the_next_allocate() -> None:
    """A context that gives its slots back with ``cache.free`` (a rollback) holds none of
    them: its next ``allocate`` of the same size must succeed from the empty pool, not fail
    with a CapacityError that counts the freed pages as held by the request."""
    config = HiCacheConfig(spec=SPEC_MHA, page_size=4, device_pages=4, host_pages=8)
    async with HiCache(config) as cache, cache.fetch(list(range(12))) as hit:
        slots = await hit.allocate(12)
        cache.free(slots)
        assert cache.stats().device_pages_leased == 0
        again = await hit.allocate(12)  # CapacityError: "3 of them held by this request"
        assert len(again) == 12


async def test_a_missing_continuation_does_not_hide_l3_pages_of_other_continuations() -> None:
    """A prefix on the device only (write-back keeps a hot system prompt off the host) makes
    a prefetch ask L3 from the prompt's first page. When L3 had too few pages for one
    continuation, the negative cache remembered that first page, the prompt's own: every
    other continuation of the prompt was then a negative hit for `storage_miss_ttl`, though
    L3 holds its pages (another instance computed and backed them up)."""
    ps = 4
    fields: dict[str, Any] = {"spec": SPEC_MHA, "page_size": ps, "device_pages": 32,
                              "host_pages": 64, "prefetch_policy": "wait_complete",
                              "prefetch_threshold": 3 * ps, "storage_miss_ttl": 60.0}
    backend = MemoryBackend(page_format(HiCacheConfig(**fields)))
    prompt = tuple(range(1000, 1000 + 2 * ps))           # 2 pages: under the threshold
    answer = (*prompt, *range(2000, 2000 + 3 * ps))        # in L3 (from another instance)
    question = (*prompt, *range(3000, 3000 + 3 * ps))      # nowhere

    async def serve(cache: HiCache, tokens: Tokens) -> int:
        kv = KVChecker(cache)
        async with cache.fetch(tokens) as hit:
            await kv.verify_prefix(hit, tokens)
            cached = hit.num_cached_tokens
            if cached < len(tokens):
                slots = await hit.allocate(len(tokens) - cached)
                kv.fill(slots, tokens, cached)
                await hit.commit(tokens, slots)
        return cached

    async with HiCache(HiCacheConfig(**fields, storage=backend)) as other:
        await serve(other, answer)
        await other.drain()  # backed up: the whole answer is in L3
    async with HiCache(HiCacheConfig(**fields, storage=backend,
                                     write_policy="write_back")) as cache:
        assert await serve(cache, prompt) == 0  # the prompt: on the device only
        assert await serve(cache, question) == len(prompt)  # L3 has no page of it
        # the answer's pages are in L3: they must be prefetched, not a negative hit
        assert await serve(cache, answer) == len(answer), cache.stats().storage
        cache.check_invariants()
    await backend.aclose()


async def test_a_host_copy_whose_hits_reach_backup_threshold_in_a_commit_is_backed_up() -> None:
    """Two requests compute one prompt at once; the first commits it, its host copy settles
    (1 hit: under backup_threshold=2) and it leaves the device. The second commit then takes
    the node back onto the device, its second hit. Backups were queued only when a match
    made the hits reach the threshold exactly, so this node was never backed up, however
    often it was hit afterwards: L3 silently lacked the prompt."""
    ps = 4
    fields: dict[str, Any] = {"spec": SPEC_MHA, "page_size": ps, "device_pages": 8,
                              "host_pages": 32, "backup_threshold": 2,
                              "prefetch_policy": "wait_complete", "prefetch_threshold": ps}
    backend = MemoryBackend(page_format(HiCacheConfig(**fields)))
    prompt = tuple(range(500, 500 + 3 * ps))
    async with HiCache(HiCacheConfig(**fields, storage=backend)) as cache:
        kv = KVChecker(cache)
        async with cache.fetch(prompt) as second:  # a miss: computes the prompt too
            async with cache.fetch(prompt) as first:
                slots = await first.allocate(len(prompt))
                kv.fill(slots, prompt, 0)
                await first.commit(prompt, slots)
            await cache.drain()  # the host copy settles; one hit: not backed up yet
            pushed = await cache.allocate(cache.config.device_pages * ps)  # leaves the device
            cache.free(pushed)
            slots = await second.allocate(len(prompt))
            kv.fill(slots, prompt, 0)
            await second.commit(prompt, slots)  # the node's second hit
        for _ in range(2):  # and more hits
            async with cache.fetch(prompt) as hit:
                await kv.verify_prefix(hit, prompt)
        await cache.drain()
        stats = cache.stats().storage
        assert stats is not None and stats.backed_up_pages == 3, stats
    fresh = HiCache(HiCacheConfig(**fields, storage=backend))  # reads only L3
    async with fresh, fresh.fetch(prompt) as hit:
        await KVChecker(fresh).verify_prefix(hit, prompt)
        assert hit.num_cached_tokens == len(prompt)
    await backend.aclose()
