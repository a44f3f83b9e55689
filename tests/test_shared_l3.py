"""Several caches sharing one L3: correct-or-miss, no hang, no leak.

Two or three `HiCache` instances share one store (a file-store directory with tiny segments,
so segments roll and compact all the time, or one real Redis server started for the tests)
and serve one workload of requests with shared prefixes between them, so what one instance
backs up another prefetches. Meanwhile requests are cancelled at random points (in a
fetch's prefetch wait, `ready`, `allocate`, `commit`, ...), `drain` and `aclose` calls are
cancelled, instances restart while the others run (after their requests finish, after
cancelling them, or closing under them), one instance reaches the store through a fault
injector, and stored objects are corrupted behind everyone's back. The third instance, where
there is one, has another identity (namespace, dtype, layer count or page size): it shares
the store and must never be served the others' pages.

KV is `KVChecker`'s (a function of the token ids, positions and prefix), so it is the same
in every instance of one model and every hit is verified bit-exactly wherever it was read.
At the end every instance must be quiescent (nothing leased or pinned) and serve every
transcript right or miss it, and so must fresh instances that read only from L3.

The deterministic tests below pin the identities: a page stored under one model's or
layout's keys is a miss for any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from aiohicache import HiCache, HiCacheConfig, KVSpec
from aiohicache.controller import _l3_parts, page_format
from aiohicache.controller._l3_parts import PageKeys
from aiohicache.errors import CapacityError, HiCacheError, InvariantError
from aiohicache.storage import FaultyBackend, FileBackend, StorageBackend
from aiohicache.storage.redis import RedisBackend
from tests.conftest import SPEC_MHA, SPEC_MLA, make_tokens
from tests.kvcheck import KVChecker
from tests.storage import segment_hooks
from tests.storage.redis_server import (  # noqa: F401  (fixtures)
    raw_client,
    redis_server,
    redis_url,
)
from tests.test_stress import Request, Server, make_workload

SEEDS = range(3)
PAGE_SIZE = 4
NUM_REQUESTS = 48
CONCURRENCY = 6
"""Requests each instance serves at once."""
ATTEMPTS = 8
"""Tries per request (device pinned full, or its instance restarted under it)."""
TIME_LIMIT = 30.0
"""Seconds a run may take before it counts as hung (it takes two or three)."""
SEGMENT_BYTES = 4096
"""About four pages a segment: segments roll and compact all the time."""
STORE_PAGES = 96
"""The file store's byte budget, in pages: instances evict each other's pages."""
CANCEL_RATE = 0.2
"""Chance that a request is cancelled after a random delay."""

BASE: dict[str, Any] = {
    "spec": SPEC_MHA, "page_size": PAGE_SIZE, "device_pages": 24, "host_pages": 24,
    "load_back_threshold": 0, "prefetch_threshold": PAGE_SIZE, "prefetch_timeout_base": 0.02,
    "prefetch_timeout_max": 0.05, "storage_miss_ttl": 0.01, "storage_cooldown": 0.05,
}
OTHER_IDENTITIES: dict[str, dict[str, Any]] = {
    "namespace": {"namespace": "another-model"},
    "dtype": {"spec": replace(SPEC_MHA, dtype=torch.float16)},  # same bytes per page
    "layers": {"spec": replace(SPEC_MHA, num_layers=4)},
    "page_size": {"page_size": 2 * PAGE_SIZE},
}


# ------------------------------------------------------------------------------ the store

@dataclass
class Shared:
    """The store every instance opens its own backend on, and a way to damage it."""

    kind: str
    """``file`` or ``redis``."""
    where: str
    """The directory, or the server's URL."""
    client: redis.Redis | None = None
    """Raw access to the Redis server (one connection for the run)."""

    def url(self, config: HiCacheConfig) -> str:
        """The store's URL, for a cache that builds (and closes) its own backend."""
        if self.kind == "redis":
            return self.where
        size = STORE_PAGES * (64 + config.page_bytes)
        return f"file://{self.where}?segment_bytes={SEGMENT_BYTES}&max_bytes={size}"

    def backend(self, config: HiCacheConfig, faults: int | None) -> StorageBackend:
        """A new backend for `config` (through a fault injector seeded `faults`, if set)."""
        fmt = page_format(config)
        inner: StorageBackend
        if self.kind == "file":
            inner = FileBackend(self.where, fmt, segment_bytes=SEGMENT_BYTES,
                                capacity_bytes=STORE_PAGES * (64 + config.page_bytes),
                                refresh_interval=0.01, max_concurrency=2)
        else:
            inner = RedisBackend(self.where, fmt)
        if faults is None:
            return inner
        return FaultyBackend(inner, seed=faults, error_rate=0.03, latency=(0.0, 0.002),
                             timeout_rate=0.01, corrupt_rate=0.03, partial_rate=0.03,
                             timeout_s=0.01)

    def corrupt_one(self, rng: random.Random) -> None:
        """Flip a byte of a random stored object, behind every instance's back."""
        if self.kind == "file":
            with contextlib.suppress(OSError):  # a segment compacted away meanwhile
                latest = segment_hooks.latest_entries(self.where)
                if latest:
                    segment_hooks.corrupt_record(self.where, rng.choice(sorted(
                        latest.values())))
            return
        if self.client is None:
            self.client = raw_client(self.where)
        name = self.client.randomkey()
        blob = self.client.get(name) if isinstance(name, bytes) else None
        if isinstance(name, bytes) and isinstance(blob, bytes) and blob:
            at = rng.randrange(len(blob))
            self.client.set(name, blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1:])

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# ------------------------------------------------------------------------------ instances

@dataclass(eq=False)
class Instance:
    """One serving instance: its cache, restarted now and then over the same store."""

    name: str
    config: HiCacheConfig
    shared: Shared
    faults: int | None
    """Seeds the fault injector the instance reaches the store through (None: none)."""
    rng: random.Random
    owns: bool = False
    """The cache builds its backend from the store's URL (and closes it)."""
    cache: HiCache | None = None
    backend: StorageBackend | None = None
    """The backend object the cache was given (None: it owns its own)."""
    server: Server | None = None
    generation: int = 0
    serving: asyncio.Event = field(default_factory=asyncio.Event)
    running: set[asyncio.Task[None]] = field(default_factory=set)
    admission: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CONCURRENCY))
    storage_hit_tokens: int = 0
    restarts: int = 0
    l3: dict[str, int] = field(default_factory=dict)
    """The L3 counters of every closed generation, summed (for a failing run's report)."""

    async def start(self) -> None:
        faults = None if self.faults is None else self.faults * 1000 + self.generation
        self.backend = None if self.owns else self.shared.backend(self.config, faults)
        storage = self.shared.url(self.config) if self.backend is None else self.backend
        self.cache = HiCache(replace(self.config, storage=storage))
        await self.cache.__aenter__()
        self.server = Server(self.cache, self.rng)
        self.generation += 1
        self.serving.set()

    async def stop(self, how: str) -> None:
        """Close the cache (`how`: ``wait`` for its requests, ``cancel`` them, or close
        ``under`` them), check it leaked nothing, close its backend."""
        assert self.cache is not None
        self.serving.clear()
        cache = self.cache
        if how == "cancel":
            for task in self.running:
                task.cancel()
        if how != "under":
            while self.running:
                await asyncio.wait(set(self.running))
            await assert_quiescent(cache, self.faults is not None)
        self.count(cache)
        closing = asyncio.ensure_future(cache.aclose())
        if self.rng.random() < 0.5:  # a cancelled close still closes
            await asyncio.sleep(0)
            closing.cancel()
        await asyncio.wait({closing})
        await cache.aclose()
        while self.running:
            await asyncio.wait(set(self.running))
        assert "closed" in repr(cache), repr(cache)
        if self.backend is not None:
            await self.backend.aclose()

    async def abandon(self) -> None:
        """Close what is still open, checking nothing (after a failure: no minute-long
        wait in `aclose` for a lost copy)."""
        for task in self.running:
            task.cancel()
        if self.cache is not None and "closed" not in repr(self.cache):
            async def at_once() -> None:
                pass
            self.cache.controller.drain = at_once  # type: ignore[method-assign]
            await self.cache.aclose()
        if self.backend is not None:
            await self.backend.aclose()

    def count(self, cache: HiCache) -> None:
        """Add `cache`'s L3 hits and counters to the instance's (before it closes)."""
        stats = cache.stats()
        self.storage_hit_tokens += stats.storage_hit_tokens
        for name, value in (stats.storage.as_dict() if stats.storage else {}).items():
            if isinstance(value, int):
                self.l3[name] = self.l3.get(name, 0) + value

    async def restart(self) -> None:
        await self.stop(self.rng.choice(["wait", "cancel", "under"]))
        self.restarts += 1
        await self.start()


@dataclass
class Run:
    """One run: the instances, the workload and what happened."""

    instances: list[Instance]
    requests: list[Request]
    rng: random.Random
    done: int = 0
    cancelled: int = 0
    aborted: int = 0
    """Requests whose instance closed under them (tried again)."""

    async def serve(self, req: Request, inst: Instance) -> None:
        """Serve `req` on `inst`, retrying on a full device or a restart; maybe cancel it."""
        for _ in range(ATTEMPTS):
            await inst.serving.wait()
            async with inst.admission:
                if not inst.serving.is_set():
                    continue
                assert inst.server is not None
                task = asyncio.ensure_future(inst.server.serve_once(req))
                inst.running.add(task)
                task.add_done_callback(inst.running.discard)
                if self.rng.random() < CANCEL_RATE:
                    asyncio.get_running_loop().call_later(self.rng.random() * 0.01, task.cancel)
                generation = inst.generation
                await asyncio.wait({task})
            if task.cancelled():
                self.cancelled += 1
                return
            exc = task.exception()
            if exc is None:
                self.done += 1
                return
            if isinstance(exc, CapacityError):
                await asyncio.sleep(0.002 * self.rng.random())
            elif isinstance(exc, HiCacheError) and not isinstance(exc, InvariantError) and (
                    generation != inst.generation or not inst.serving.is_set()):
                self.aborted += 1  # closed under it
            else:
                raise exc

    async def restarting(self, served: asyncio.Future[list[None]]) -> None:
        """Restart an instance now and then, until every request is served (a restart is
        not cancelled: that would leave its instance half closed)."""
        while not served.done():
            await asyncio.wait({served}, timeout=self.rng.uniform(0.1, 0.3))
            if not served.done():
                await self.rng.choice(self.instances).restart()

    async def meddling(self, shared: Shared) -> None:
        while True:
            await asyncio.sleep(0.03)
            shared.corrupt_one(self.rng)

    async def draining(self) -> None:
        """Drains cancelled at random points (only the wait ends)."""
        while True:
            await asyncio.sleep(self.rng.uniform(0.0, 0.03))
            inst = self.rng.choice(self.instances)
            if inst.serving.is_set() and inst.cache is not None:
                # NOTE: not wait_for, which on 3.11 can swallow this task's own cancellation
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.rng.uniform(0, 0.003)):
                        await inst.cache.drain()


def make_instances(shared: Shared, seed: int, rng: random.Random) -> list[Instance]:
    """Two instances of one model (the first writing through, on a backend it builds from
    the URL; the second through the fault injector), and on all seeds but 1 a third of
    another identity."""
    policies = ["write_through", "write_through_selective", "write_back"]
    prefetch = ["wait_complete", "timeout", "best_effort"]
    layout = rng.choice(["page_first", "layer_first"])
    configs = [HiCacheConfig(**{**BASE, "write_policy": rng.choice(policies[:i + 1]),
                                "prefetch_policy": rng.choice(prefetch[:2]),
                                "host_layout": layout})
               for i in range(2)]
    if seed != 1:
        other = sorted(OTHER_IDENTITIES)[(seed + len(shared.kind)) % len(OTHER_IDENTITIES)]
        configs.append(HiCacheConfig(**{**BASE, "prefetch_policy": rng.choice(prefetch),
                                        "host_layout": layout, **OTHER_IDENTITIES[other]}))
    return [Instance(f"i{i}", cfg, shared, seed + 1 if i == 1 else None,
                     random.Random(rng.random()), owns=i == 0) for i, cfg in enumerate(configs)]


async def run_shared(shared: Shared, seed: int) -> Run:
    rng = random.Random(seed)
    instances = make_instances(shared, seed, rng)
    run = Run(instances, make_workload(rng, NUM_REQUESTS), rng)
    for inst in instances:
        await inst.start()
    try:
        async with asyncio.timeout(TIME_LIMIT):
            await serve_all(run, shared)
            for inst in instances:
                await check_instance(inst, run.requests)
                await inst.stop("wait")
    finally:
        for inst in instances:
            await inst.abandon()
        shared.close()
    async with asyncio.timeout(TIME_LIMIT):
        await check_fresh_readers(shared, instances, run.requests)
    return run


async def serve_all(run: Run, shared: Shared) -> None:
    async with asyncio.TaskGroup() as tg:
        served = asyncio.gather(*(tg.create_task(run.serve(req, run.rng.choice(run.instances)))
                                  for req in run.requests))
        restarts = tg.create_task(run.restarting(served))
        background = [tg.create_task(run.meddling(shared)), tg.create_task(run.draining())]
        await served
        for task in background:
            task.cancel()
        await restarts


async def assert_quiescent(cache: HiCache, faulty: bool) -> None:
    """Drained, consistent, and nothing leased or pinned (`test_stress.assert_quiescent`;
    a `faulty` store may have left the breaker open)."""
    async with asyncio.timeout(5):
        await cache.drain()
    cache.check_invariants()
    stats = cache.stats()
    assert stats.health == "ok" or (faulty and stats.health == "degraded"), stats.health
    assert stats.device_pages_leased == 0
    assert stats.pending_loads == stats.pending_writes == 0
    assert not [n for n in cache.tree.iter_nodes() if n.lock_ref] and not cache._pins, (
        f"pins outlive their requests: {cache._pins}")
    assert cache.storage is not None and cache.storage.idle and not cache.storage.reserved_host
    store = getattr(cache.storage.backend, "inner", cache.storage.backend)
    if isinstance(store, FileBackend):  # no write's reservation or segment hold outlives it
        assert store._budget.reserved_bytes == 0 and not store._appender._held, store


async def check_instance(inst: Instance, requests: list[Request]) -> None:
    """Quiescent, and every transcript served right or missed (L3 included)."""
    assert inst.cache is not None and inst.server is not None
    await assert_quiescent(inst.cache, inst.faults is not None)
    for req in requests:
        transcript = [*req.prompt, *req.decode]
        async with inst.cache.fetch(transcript) as hit:
            await inst.server.kv.verify_prefix(hit, transcript)
    await assert_quiescent(inst.cache, inst.faults is not None)


async def check_fresh_readers(shared: Shared, instances: list[Instance],
                              requests: list[Request]) -> None:
    """A new cache per identity, over a clean backend: what L3 serves is right."""
    configs = {inst.config.namespace + repr(page_format(inst.config)): inst.config
               for inst in instances}
    for config in configs.values():
        reader = Instance("reader", config, shared, None, random.Random(0))
        await reader.start()
        await check_instance(reader, requests)
        await reader.stop("wait")


# ------------------------------------------------------------------------------ the stress

@pytest.mark.parametrize("seed", SEEDS)
async def test_instances_sharing_a_file_store_serve_right_kv_or_miss(
        seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 2 hashes every prompt's keys on a worker thread (as long prompts' are)."""
    if seed == 2:
        monkeypatch.setattr(_l3_parts, "OFFLOAD_HASH_TOKENS", 1)
    run = await run_shared(Shared("file", str(tmp_path / "l3")), seed)
    assert_exercised(run)


@pytest.mark.parametrize("seed", SEEDS[:2])
async def test_instances_sharing_a_redis_server_serve_right_kv_or_miss(
        seed: int, redis_url: str) -> None:  # noqa: F811  (the fixture)
    run = await run_shared(Shared("redis", redis_url), seed)
    assert_exercised(run)


def assert_exercised(run: Run) -> None:
    """The run did what it is for: requests served, some from L3, some cancelled."""
    served = run.done + run.cancelled  # the rest ran out of attempts
    assert served >= 0.9 * len(run.requests) and run.done >= 0.25 * len(run.requests), (
        run.done, run.cancelled, run.aborted)
    assert run.cancelled, "nothing was cancelled"
    assert sum(inst.storage_hit_tokens for inst in run.instances), "L3 never served"
    assert sum(inst.restarts for inst in run.instances), "no instance restarted"


# ------------------------------------------------------------------------------ identities

IDENTITIES: dict[str, dict[str, Any]] = {
    **OTHER_IDENTITIES,
    "heads": {"spec": replace(SPEC_MHA, num_kv_heads=4, head_dim=4)},  # same bytes per page
    "layout": {"host_layout": "layer_first"},  # same bytes per page, in the same order
    "mla": {"spec": SPEC_MLA},
}


async def compute(cache: HiCache, tokens: list[int]) -> int:
    """Serve `tokens` (computing what is not cached, checking what is) and let its backup
    settle; return the tokens L3 served."""
    kv = KVChecker(cache)
    async with cache.fetch(tokens) as hit:
        await kv.verify_prefix(hit)
        from_l3 = hit.num_storage_hit_tokens
        if hit.num_cached_tokens < len(tokens):
            new = await hit.allocate(len(tokens) - hit.num_cached_tokens)
            kv.fill(new, tokens, hit.num_cached_tokens)
            await hit.commit(tokens, new)
    await cache.drain()
    return from_l3


@asynccontextmanager
async def opened(config: HiCacheConfig, store: str) -> AsyncIterator[HiCache]:
    async with HiCache(replace(config, storage=store, prefetch_policy="wait_complete")) as cache:
        yield cache
        await assert_quiescent(cache, False)


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL: a file-store directory, or the test Redis server (emptied)."""
    if request.param == "file":
        return f"file://{tmp_path}/l3?segment_bytes={SEGMENT_BYTES}"
    return str(request.getfixturevalue("redis_url"))


@pytest.mark.parametrize("other", sorted(IDENTITIES))
async def test_pages_stored_under_one_identity_are_a_miss_for_another(
        other: str, store: str) -> None:
    """A cache of another model, dtype, shape, page size or layout over the same store
    finds none of the first one's pages (and stores its own beside them: the first still
    reads its own)."""
    base = HiCacheConfig(**BASE)
    tokens = make_tokens(24, seed=7)
    async with opened(base, store) as first:
        assert await compute(first, tokens) == 0
    async with opened(HiCacheConfig(**{**BASE, **IDENTITIES[other]}), store) as second:
        assert await compute(second, tokens) == 0, f"served pages of another {other}"
    async with opened(base, store) as again:
        assert await compute(again, tokens) == 24


async def test_the_same_identity_is_a_hit(store: str) -> None:
    """The control of the test above: a second cache of the same identity reads them."""
    tokens = make_tokens(24, seed=7)
    for expected in (0, 24):
        async with opened(HiCacheConfig(**BASE), store) as cache:
            assert await compute(cache, tokens) == expected


def test_every_identity_has_its_own_keys_and_page_format() -> None:
    """Keys chain from a root naming the identity, and the headers name it again: two
    identities agree on neither (TP shards included; MLA is shared across shards)."""
    configs = {name: HiCacheConfig(**{**BASE, **fields}) for name, fields in
               [("base", {}), *IDENTITIES.items(),
                ("tp0", {"tp_rank": 0, "tp_size": 2}), ("tp1", {"tp_rank": 1, "tp_size": 2})]}
    roots = {name: PageKeys(cfg).root for name, cfg in configs.items()}
    formats = {name: page_format(cfg) for name, cfg in configs.items()}
    assert len(set(roots.values())) == len(roots), roots
    assert len(set(formats.values())) == len(formats), formats
    mla = [HiCacheConfig(**{**BASE, "spec": SPEC_MLA, "tp_rank": r, "tp_size": 2})
           for r in (0, 1)]
    assert PageKeys(mla[0]).root == PageKeys(mla[1]).root == roots["mla"]


def test_mla_caches_that_split_the_row_differently_do_not_share_pages() -> None:
    """A spec's identity names where the rotary part of a row begins: it named the row's
    width only, so two MLA models of one width shared pages unless their namespaces
    differed."""
    other = KVSpec.mla(num_layers=SPEC_MLA.num_layers, kv_lora_rank=SPEC_MLA.kv_lora_rank - 4,
                       rope_dim=SPEC_MLA.rope_dim + 4, dtype=SPEC_MLA.dtype)
    one, two = (HiCacheConfig(**{**BASE, "spec": spec}) for spec in (SPEC_MLA, other))
    assert PageKeys(one).root != PageKeys(two).root
