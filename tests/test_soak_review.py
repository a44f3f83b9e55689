"""A compact seeded soak over configurations the other stress tests do not reach.

`test_shared_l3.py` and `test_stress.py` run 4-token pages of one bf16 MHA layout under LRU.
Here two caches share one file store (tiny segments, a byte budget, so segments roll,
compact and evict) at page sizes 1, 16 and 64, MHA and MLA, float16, bfloat16 and
float8_e4m3fn, LFU and ARC eviction (one name or a pair per tier), every write and prefetch
policy, with prefetch off for some; one cache reaches the store through a fault injector.
Meanwhile requests are cancelled mid-flight (fetch, `layer_ready`, `ready`, `allocate`,
`commit`), anonymous `allocate` calls are cancelled, drains and closes are cancelled, caches
restart (waiting for, cancelling or closing under their requests), stored records are
corrupted and lock-free segments and journals are torn at their tail, as a writer that died
mid-append leaves them.

KV is `KVChecker`'s code written into the pool's raw bytes (so float8 is checked bit-exactly
like the others: the cache moves bytes, it never reads them) and every hit is verified. An
event model built from each cache's `events()` stream must match a fresh snapshot of L1 and
L2 at random points and at the end. This is a cut of a longer exploration (about 150 seeds
of the same driver, Redis too, 5-100 s each), which found no wrong KV, leak or hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from aiohicache import FetchContext, HiCache, HiCacheConfig, KVSpec
from aiohicache.errors import HiCacheError
from aiohicache.events import AllBlocksCleared, BlockRemoved, BlockStored, hub_of
from aiohicache.storage import _journal
from tests import test_shared_l3 as sl3
from tests.kvcheck import KVChecker
from tests.test_stress import Request, Server, make_workload


class ByteKVChecker(KVChecker):
    """`KVChecker` over the pool's bytes: any dtype, float8 included, checked bit-exactly."""

    def __init__(self, cache: HiCache) -> None:
        pool = cache.device_pool
        self.cache = cache
        self.page_size = pool.page_size
        self._num_kv, self._num_layers = pool.spec.num_kv, pool.spec.num_layers
        self._slots = pool.data.view(torch.uint8).view(self._num_kv, self._num_layers,
                                                       pool.num_slots, -1)
        self._cols = torch.arange(self._slots.shape[-1], dtype=torch.int64)


@dataclass
class SoakServer(Server):
    """`Server`, checking bytes, and waiting for random layers (some waits cancelled)."""

    def __post_init__(self) -> None:
        self.kv = ByteKVChecker(self.cache)

    async def hit(self, hit: FetchContext, tokens: list[int]) -> None:
        for _ in range(self.rng.randint(0, 2)):
            wait = asyncio.ensure_future(hit.layer_ready(
                self.rng.randrange(self.cache.config.spec.num_layers)))
            if self.rng.random() < 0.3:
                await asyncio.sleep(0)
                wait.cancel()
            await asyncio.wait({wait})
            if not wait.cancelled() and wait.exception() is not None:
                raise wait.exception()  # type: ignore[misc]
        await super().hit(hit, tokens)


class EventModel:
    """L1 and L2 as a subscriber sees them; `check` compares it with a fresh snapshot."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.stream = cache.events(max_batches=1 << 30, snapshot=True)
        self.tiers: dict[str, Counter[bytes]] = {"device": Counter(), "host": Counter()}
        self.seq: int | None = None

    def _apply(self, batch: Any) -> None:
        if batch.seq != -1:
            assert self.seq is None or batch.seq == self.seq + 1, (self.seq, batch.seq)
            self.seq = batch.seq
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                for tier in self.tiers.values():
                    tier.clear()
            elif isinstance(event, BlockStored) and event.medium != "storage":
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                for key in event.block_hashes:
                    self.tiers[event.medium][key] += 1
                    assert self.tiers[event.medium][key] == 1, f"stored twice in {event}"
            elif isinstance(event, BlockRemoved) and event.medium != "storage":
                for key in event.block_hashes:
                    assert self.tiers[event.medium][key] == 1, f"removed absent in {event}"
                    self.tiers[event.medium][key] -= 1

    def check(self) -> None:
        """Synchronous (nothing changes meanwhile): the events add up to the snapshot."""
        if self.cache._core.state != "open":
            return
        hub_of(self.cache).flush()
        while (batch := self.stream.get_nowait()) is not None:
            self._apply(batch)
        snapshot = self.cache.events(snapshot=True)
        first = snapshot.get_nowait()
        snapshot._hub.unsubscribe(snapshot)
        snapshot._end()
        assert first is not None and first.seq == -1
        for medium, tier in self.tiers.items():
            want = {k for e in first.events if isinstance(e, BlockStored) and e.medium == medium
                    for k in e.block_hashes}
            assert {k for k, n in tier.items() if n} == want, f"{medium} events != snapshot"


def tear_tails(root: str, rng: random.Random) -> None:
    """Cut or garble the tail of a lock-free segment or journal (a writer died mid-append)."""
    with contextlib.suppress(OSError):
        names = sorted(n for n in os.listdir(root) if n.endswith((".seg", ".log")))
        for name in rng.sample(names, min(2, len(names))):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if size == 0 or _journal.is_locked(path):
                continue
            if rng.random() < 0.5:
                os.truncate(path, size - rng.randint(1, min(size, 300)))
            else:
                with open(path, "r+b") as f:
                    f.seek(rng.randrange(max(0, size - 200), size))
                    f.write(rng.randbytes(8))


@dataclass(eq=False)
class SoakInstance(sl3.Instance):
    model: EventModel | None = field(default=None)

    async def start(self) -> None:
        faults = None if self.faults is None else self.faults * 1000 + self.generation
        self.backend = None if self.owns else self.shared.backend(self.config, faults)
        storage = self.shared.url(self.config) if self.backend is None else self.backend
        self.cache = HiCache(replace(self.config, storage=storage))
        await self.cache.__aenter__()
        self.server = SoakServer(self.cache, self.rng)
        self.model = EventModel(self.cache)
        self.generation += 1
        self.serving.set()

    async def restart(self) -> None:
        await self.stop(self.rng.choice(["wait", "cancel", "under"]))
        self.restarts += 1
        tear_tails(self.shared.where, self.rng)
        await self.start()


class SoakRun(sl3.Run):
    async def meddling(self, shared: sl3.Shared) -> None:
        while True:
            await asyncio.sleep(0.03)
            with contextlib.suppress(IndexError):  # the record was torn off meanwhile
                shared.corrupt_one(self.rng)
            if self.rng.random() < 0.3:
                await asyncio.to_thread(tear_tails, shared.where, self.rng)
            inst = self.rng.choice(self.instances)
            assert isinstance(inst, SoakInstance)
            if inst.serving.is_set() and inst.model is not None:
                inst.model.check()

    async def draining(self) -> None:
        """Drains cancelled at random points, and anonymous leases, some cancelled."""
        while True:
            await asyncio.sleep(self.rng.uniform(0.0, 0.02))
            inst = self.rng.choice(self.instances)
            if not inst.serving.is_set() or inst.cache is None:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.rng.uniform(0, 0.003)):
                    await inst.cache.drain()
            task = asyncio.ensure_future(self._lease(inst.cache))
            inst.running.add(task)  # a stop waits for it like for a request
            task.add_done_callback(inst.running.discard)
            if self.rng.random() < 0.3:
                await asyncio.sleep(0)
                task.cancel()
            await asyncio.wait({task})

    async def _lease(self, cache: HiCache) -> None:
        try:
            slots = await cache.allocate(self.rng.randint(1, 3 * cache.config.page_size))
        except HiCacheError:
            return
        try:
            await asyncio.sleep(self.rng.uniform(0, 0.005))
        finally:
            with contextlib.suppress(HiCacheError):
                cache.free(slots)


SPECS = {"mha": lambda dtype: KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype),
         "mla": lambda dtype: KVSpec.mla(num_layers=2, kv_lora_rank=12, rope_dim=4, dtype=dtype)}
GRID = [  # (page size, tokens per workload token, layout, dtype)
    pytest.param(1, 1, "mla", "bfloat16", id="ps1-mla-bf16"),
    pytest.param(16, 4, "mla", "float8_e4m3fn", id="ps16-mla-fp8"),
    pytest.param(64, 10, "mha", "float16", id="ps64-mha-fp16"),
]


def soak_config(rng: random.Random, page_size: int, scale: int, spec: KVSpec) -> HiCacheConfig:
    """Two to four requests' worth of L1, one and a half to four of L2."""
    pages = max(1, 25 * scale // page_size)
    return HiCacheConfig(
        spec=spec, page_size=page_size, device_pages=max(4, int(pages * rng.uniform(2, 4))),
        host_pages=max(4, int(pages * rng.uniform(1.5, 4))),
        host_layout=rng.choice(["page_first", "layer_first"]),
        write_policy=rng.choice(["write_through", "write_through_selective", "write_back"]),
        eviction=rng.choice(["lfu", "arc", ("arc", "lru"), ("lfu", "arc")]),
        load_back_threshold=rng.choice([0, page_size]),
        prefetch_policy=rng.choice(["best_effort", "wait_complete", "timeout"]),
        prefetch_threshold=page_size if rng.random() < 0.8 else 1 << 30,
        prefetch_timeout_base=0.02, prefetch_timeout_max=0.05,
        storage_miss_ttl=rng.choice([0.0, 0.01]), storage_cooldown=0.05,
        max_inflight_loads=rng.choice([2, 64]), max_inflight_writes=rng.choice([2, 64]),
        storage_miss_max_entries=rng.choice([0, 4, 4096]))


def scaled(requests: list[Request], scale: int) -> list[Request]:
    """Each prompt token becomes `scale` tokens: prompts fill several pages of any size."""
    return [replace(r, prompt=tuple(t * 97 + j for t in r.prompt for j in range(scale)),
                    chunk=r.chunk * scale) for r in requests]


@pytest.mark.parametrize(("page_size", "scale", "kind", "dtype"), GRID)
async def test_soak_shared_file_store_serves_right_kv_or_miss(
        page_size: int, scale: int, kind: str, dtype: str, tmp_path: Path) -> None:
    """Every hit is the KV computed for its tokens (or a miss), the event stream adds up
    to what L1 and L2 hold, and at the end nothing is leased, pinned or in flight; fresh
    caches reading only the (torn, corrupted) store serve every transcript right or miss."""
    seed = page_size
    rng = random.Random(seed)
    shared = sl3.Shared("file", str(tmp_path / "l3"))
    configs = [soak_config(rng, page_size, scale, SPECS[kind](dtype)) for _ in range(2)]
    instances: list[sl3.Instance] = [
        SoakInstance(f"i{i}", cfg, shared, seed + 1 if i == 1 else None,
                     random.Random(rng.random()), owns=i == 0) for i, cfg in enumerate(configs)]
    run = SoakRun(instances, scaled(make_workload(rng, 20), scale), rng)
    for inst in instances:
        await inst.start()
    try:
        async with asyncio.timeout(60):
            await sl3.serve_all(run, shared)
            for inst in instances:
                while inst.running:  # anonymous leases still held
                    await asyncio.wait(set(inst.running))
                assert isinstance(inst, SoakInstance) and inst.model is not None
                inst.model.check()
                await sl3.check_instance(inst, run.requests)
                inst.model.check()
                await inst.stop("wait")
    finally:
        for inst in instances:
            await inst.abandon()
    async with asyncio.timeout(60):  # a fresh cache serves what the store holds right
        reader = SoakInstance("reader", instances[0].config, shared, None, random.Random(0))
        await reader.start()
        await sl3.check_instance(reader, run.requests)
        await reader.stop("wait")
    assert run.done >= len(run.requests) // 5, (run.done, run.cancelled, run.aborted)
