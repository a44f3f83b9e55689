"""Concurrency stress: many requests with shared prefixes through a tiny cache, KV checked on
every read.

Requests share a few system prompts and conversation prefixes and add private tails, as a
chat server's do. Each one prefills in chunks (one context committing a growing prefix of
what it fetched, or a fresh fetch per chunk, re-matching each time), then decodes token by
token (``allocate(1)``, commit the extended list: a fresh list, or the very list passed to
``fetch`` after appending to it). L1 and L2 hold a few requests' worth of pages, so eviction,
demotion, load-back, write-through (or write-back) and, with L3, backup and prefetch race all
the time; random yields and small sleeps vary the interleaving.

The stock CPU engine does the copies (inline on the loop when idle, or on its threads). KV is
written by `KVChecker`, so it depends on every token's id, position and prefix, and it is
verified wherever a request reads it: every hit after ``ready()``, after every commit, and
between decode steps. After every step the cache's invariants must hold; at the end nothing
may stay leased or pinned, and every transcript must still be served right (or missed).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from aiohicache import CapacityError, CpuTransferEngine, FetchContext, HiCache, HiCacheConfig
from aiohicache.controller import _l3_parts, page_format
from aiohicache.storage.faults import FaultyBackend
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import SPEC_MHA
from tests.kvcheck import KVChecker

SEEDS = range(4)
PAGE_SIZE = 4
CONCURRENCY = 8
"""Requests served at once (a server's running batch); the rest wait their turn."""
NUM_REQUESTS = 40
TIME_LIMIT = 20.0
"""Seconds a whole run may take before it counts as hung (it takes about one)."""
EMPTY = torch.empty(0, dtype=torch.int64)


# ------------------------------------------------------------------------------ the workload

SERVE_ATTEMPTS = 8
"""Tries per request when the device is pinned full. The pins held meanwhile are other
requests' and last as long as their (sleep-modelled) passes, so on a loaded machine four
tries once left a run at 27 of 40 requests (CI, write_back): a server requeues on."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request's script: everything random is drawn up front, from the test's seed."""

    prompt: tuple[int, ...]
    decode: tuple[int, ...]
    """Tokens it generates, one per decode step."""
    chunk: int
    """Prefill chunk, in tokens."""
    fetch_per_chunk: bool
    """A fresh fetch (and match) for every chunk, instead of one context for all."""
    same_list: bool
    """Decode appends to the very list object that was passed to ``fetch``."""


def make_workload(rng: random.Random, num_requests: int = NUM_REQUESTS) -> list[Request]:
    """Requests over 6 conversations (most under one of 3 system prompts), plus twins (the
    same prompt at once, e.g. parallel samples) and next turns of earlier transcripts."""
    systems = [tuple(range(1000 * s, 1000 * s + rng.randint(6, 14))) for s in (1, 2, 3)]
    convos = [(*rng.choice([*systems, ()]), *private(rng, 4, 8)) for _ in range(6)]
    requests: list[Request] = []
    for _ in range(num_requests):
        r = rng.random()
        if requests and r < 0.25:  # a twin: the same prompt, arriving together
            prompt = requests[-1].prompt
        elif requests and r < 0.45:  # the next turn of an earlier conversation
            before = rng.choice(requests)
            prompt = (*(*before.prompt, *before.decode)[:30], *private(rng, 1, 8))
        else:
            prompt = (*rng.choice(convos), *private(rng, 1, 8))
        requests.append(Request(prompt=prompt, decode=private(rng, 1, 6),
                                chunk=rng.randint(2, 9), fetch_per_chunk=rng.random() < 0.4,
                                same_list=rng.random() < 0.5))
    return requests


def private(rng: random.Random, low: int, high: int) -> tuple[int, ...]:
    return tuple(rng.randrange(50_000) for _ in range(rng.randint(low, high)))


# ------------------------------------------------------------------------------ serving

@dataclass
class Server:
    """Serves requests like an engine's scheduler would, checking every KV read."""

    cache: HiCache
    rng: random.Random
    kv: KVChecker = field(init=False)
    completed: int = 0
    capacity_errors: int = 0

    def __post_init__(self) -> None:
        self.kv = KVChecker(self.cache)

    @property
    def ps(self) -> int:
        return self.cache.config.page_size

    async def step(self) -> None:
        """A safe point between operations: the invariants hold; then maybe let others run."""
        self.cache.check_invariants()
        r = self.rng.random()
        if r < 0.4:
            await asyncio.sleep(0)
        elif r < 0.55:
            await asyncio.sleep(self.rng.random() * 0.002)

    async def forward_pass(self) -> None:
        """The model computing: other requests go on meanwhile (and may compute the same
        prefix, commit it, evict it and load it back before this one commits)."""
        await asyncio.sleep(self.rng.random() * 0.001)

    async def serve(self, req: Request, admission: asyncio.Semaphore) -> None:
        """Serve `req`; when the device is pinned full, give up and retry, as a server
        would preempt and requeue."""
        for attempt in range(SERVE_ATTEMPTS):
            async with admission:
                try:
                    await self.serve_once(req)
                except CapacityError:
                    self.capacity_errors += 1
                    self.cache.check_invariants()
                else:
                    self.completed += 1
                    return
            await asyncio.sleep(0.001 * (attempt + 1) * self.rng.random())

    async def serve_once(self, req: Request) -> None:
        tokens = list(req.prompt)
        if req.fetch_per_chunk:
            for end in range(req.chunk, len(tokens), req.chunk):
                async with self.cache.fetch(tokens[:end]) as hit:
                    await self.hit(hit, tokens[:end])
                    await self.prefill(hit, tokens, end, req.chunk, EMPTY)
        async with self.cache.fetch(tokens) as hit:
            await self.hit(hit, tokens)
            tail = await self.prefill(hit, tokens, len(tokens), req.chunk, EMPTY)
            await self.decode(hit, tokens, tail, req)

    async def hit(self, hit: FetchContext, tokens: list[int]) -> None:
        await self.kv.verify_prefix(hit, tokens)
        await self.step()

    async def prefill(self, hit: FetchContext, tokens: list[int], end: int, chunk: int,
                      tail: torch.Tensor) -> torch.Tensor:
        """Compute ``tokens[:end]`` past what is cached, `chunk` tokens per commit; return
        the slots of the partial last page (leased, committed, not in the tree)."""
        while (computed := hit.num_cached_tokens + len(tail)) < end:
            stop = min(end, computed + chunk)
            new = await hit.allocate(stop - computed)
            await self.forward_pass()
            self.kv.fill(new, tokens, computed)
            tail = await self.commit(hit, tokens[:stop], torch.cat([tail, new]))
        return tail

    async def commit(self, hit: FetchContext, tokens: list[int],
                     slots: torch.Tensor) -> torch.Tensor:
        """Commit and check what the context then holds; return its partial page's slots."""
        cached = hit.num_cached_tokens
        await hit.commit(tokens, slots)
        tail = slots[len(tokens) // self.ps * self.ps - cached:]
        await self.kv.verify_after_commit(hit, tokens, tail)
        await self.step()
        return tail

    async def decode(self, hit: FetchContext, tokens: list[int], tail: torch.Tensor,
                     req: Request) -> None:
        """One token per step; the pinned KV must survive every other request's step."""
        for token in req.decode:
            if req.same_list:
                tokens.append(token)  # the list fetch() was given: commit must see the edit
            else:
                tokens = [*tokens, token]
            new = await hit.allocate(1)
            await self.forward_pass()
            self.kv.fill(new, tokens, len(tokens) - 1)
            tail = await self.commit(hit, tokens, torch.cat([tail, new]))
            await self.kv.verify_prefix(hit, tokens)
            self.kv.verify(tail, tokens, hit.num_cached_tokens, what="the partial last page")


# ------------------------------------------------------------------------------ running it

@asynccontextmanager
async def open_cache(config: HiCacheConfig, *, threads: bool) -> AsyncIterator[HiCache]:
    """The cache on the stock CPU engine (small copies inline on the loop, or all on its
    threads); a failing test does not wait a minute in `aclose()` for a lost transfer."""
    engine = (lambda d, h: CpuTransferEngine(d, h, inline_bytes=0)) if threads else None
    cache = HiCache(config, engine=engine)
    await cache.__aenter__()
    try:
        yield cache
    except BaseException:
        async def return_at_once() -> None:
            pass
        cache.controller.drain = return_at_once  # type: ignore[method-assign]
        raise
    finally:
        await cache.aclose()


Meddler = Callable[[random.Random], None]
"""Something outside the cache that changes its world now and then (L3 objects)."""


async def run_workload(cache: HiCache, seed: int, *, meddle: Meddler | None = None) -> Server:
    """Serve the seed's workload (with `meddle` called every 20 ms meanwhile), then check
    that the cache is quiescent and still serves every transcript right."""
    rng = random.Random(seed)
    server = Server(cache, rng)
    requests = make_workload(rng)
    admission = asyncio.Semaphore(CONCURRENCY)
    async with asyncio.timeout(TIME_LIMIT), asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(server.serve(req, admission)) for req in requests]
        if meddle is not None:
            tg.create_task(meddling(meddle, rng, tasks))
    await assert_quiescent(cache)
    for req in requests:  # whatever is still cached is the transcript's own KV
        transcript = [*req.prompt, *req.decode]
        async with cache.fetch(transcript) as hit:
            await server.kv.verify_prefix(hit, transcript)
    await assert_quiescent(cache)
    assert server.completed >= 0.75 * len(requests), (
        f"only {server.completed} of {len(requests)} requests completed "
        f"({server.capacity_errors} CapacityErrors)")
    return server


async def meddling(meddle: Meddler, rng: random.Random,
                   tasks: list[asyncio.Task[None]]) -> None:
    while not all(task.done() for task in tasks):
        meddle(rng)
        await asyncio.sleep(0.02)


async def assert_quiescent(cache: HiCache) -> None:
    """Drained, consistent, and nothing leased or pinned."""
    async with asyncio.timeout(5):
        await cache.drain()
    cache.check_invariants()
    stats = cache.stats()
    assert stats.health == "ok", stats.health
    assert stats.device_pages_leased == 0
    assert stats.pending_loads == stats.pending_writes == 0
    pinned = [n for n in cache.tree.iter_nodes() if n.lock_ref]
    # A context that matched nothing pins the bare root, which only the registry shows.
    assert not pinned and not cache._pins, f"pins outlive their requests: {cache._pins}"


def config(seed: int, **overrides: Any) -> HiCacheConfig:
    """About three requests' worth of L1 and four of L2. Seeds but the first recompute
    host tails under two pages instead of loading them (load_back_threshold), so one
    request recomputes a prefix while another loads it back."""
    fields: dict[str, Any] = {"spec": SPEC_MHA, "page_size": PAGE_SIZE, "device_pages": 24,
                              "host_pages": 32, "load_back_threshold": 2 * PAGE_SIZE * (seed > 0)}
    fields.update(overrides)
    return HiCacheConfig(**fields)


# ------------------------------------------------------------------------------ the tests

@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", SEEDS)
async def test_concurrent_requests_read_only_their_own_kv(seed: int, policy: str) -> None:
    """L1 and L2 only; odd seeds run every copy on the engine's threads."""
    async with open_cache(config(seed, write_policy=policy), threads=bool(seed % 2)) as cache:
        await run_workload(cache, seed)
        stats = cache.stats()
        assert stats.device_evicted_pages and stats.writes, "resize the workload"
        if policy != "write_back":  # (write-back stages a leaf only if its parent is on L2)
            assert stats.host_hit_tokens, "L2 never served: resize the workload"
        if policy == "write_through":
            assert stats.host_evicted_pages, "L2 never evicted: resize the workload"


L3 = {"prefetch_threshold": PAGE_SIZE, "prefetch_timeout_base": 0.02,
      "prefetch_timeout_max": 0.05, "storage_miss_ttl": 0.01, "storage_cooldown": 0.05,
      "host_pages": 24, "load_back_threshold": 0}


def faulty_backend(seed: int) -> FaultyBackend:
    """L3 that errs, hangs, corrupts and drops pages now and then."""
    inner = MemoryBackend(page_format(config(seed, **L3)))
    return FaultyBackend(inner, seed=seed, error_rate=0.05, latency=(0.0, 0.002),
                         timeout_rate=0.02, corrupt_rate=0.05, partial_rate=0.05,
                         timeout_s=0.01)


def stored_objects(backend: object) -> dict[str, bytearray] | None:
    """The dict a `MemoryBackend` (maybe inside a `FaultyBackend`) keeps its objects in."""
    inner = getattr(backend, "inner", backend)
    return inner._objects if isinstance(inner, MemoryBackend) else None


def swap_two_objects(objects: dict[str, bytearray]) -> Meddler:
    """Every call swaps two stored page objects between their keys, as a misdirected rename
    or copy in the store would: reading one must then be a miss, never the other's KV."""
    def meddle(rng: random.Random) -> None:
        if len(objects) >= 2:
            a, b = rng.sample(sorted(objects), 2)
            objects[a], objects[b] = objects[b], objects[a]
    return meddle


@pytest.mark.parametrize(("storage", "prefetch", "policy"), [
    ("memory", "wait_complete", "write_through"),
    ("memory", "best_effort", "write_through_selective"),
    ("file", "wait_complete", "write_through"),
    ("faulty", "timeout", "write_through"),
    ("faulty", "wait_complete", "write_back"),
])
@pytest.mark.parametrize("seed", SEEDS[:2])
async def test_l3_under_concurrency_serves_right_kv_or_misses(
        seed: int, storage: str, prefetch: str, policy: str, tmp_path: Path) -> None:
    """L1, L2 and L3 (in memory with objects swapped meanwhile, in files, or failing)."""
    faulty = faulty_backend(seed)
    url = {"memory": "memory://", "file": f"file://{tmp_path}", "faulty": faulty}[storage]
    cfg = config(seed, storage=url, prefetch_policy=prefetch, write_policy=policy, **L3)
    try:
        async with open_cache(cfg, threads=bool(seed % 2)) as cache:
            assert cache.storage is not None
            objects = stored_objects(cache.storage.backend)
            await run_workload(cache, seed, meddle=None if objects is None
                               else swap_two_objects(objects))
            st = cache.stats().storage
            assert st is not None and st["prefetch_misses"], st  # L3 was asked
            if policy != "write_back":
                assert st["backed_up_pages"], st
            if objects is None:  # nothing meddles: what L3 holds is found
                assert cache.stats().storage_hit_tokens, "L3 never served: resize the workload"
    finally:
        await faulty.aclose()  # a backend object stays the caller's to close


@pytest.mark.parametrize("storage", ["file", "faulty"])
async def test_l3_keys_hashed_off_the_loop_under_concurrency_serve_right_kv(
        storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt's L3 keys hashed on a worker thread (as long prompts' are), while
    requests, copies and faults run concurrently: every hit is still the right KV."""
    monkeypatch.setattr(_l3_parts, "OFFLOAD_HASH_TOKENS", 1)
    seed = SEEDS[0]
    faulty = faulty_backend(seed)
    url = f"file://{tmp_path}" if storage == "file" else faulty
    cfg = config(seed, storage=url, prefetch_policy="wait_complete", **L3)
    try:
        async with open_cache(cfg, threads=True) as cache:
            await run_workload(cache, seed)
            st = cache.stats().storage
            assert st is not None and st.backed_up_pages, st
            if storage == "file":
                assert cache.stats().storage_hit_tokens, "L3 never served: resize the workload"
    finally:
        await faulty.aclose()
