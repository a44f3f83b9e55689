"""A review of the `storage` KV events: a late snapshot says what the stream said.

The rule, for every medium, `storage` included: at any moment, the batch ``snapshot=True``
starts with lists exactly the pages a subscriber from the start holds in its model, having
applied every batch so far; and both are what the tree holds: L1 and L2 residency, and for
`storage` the pages its nodes know to be in L3 (`Node.stored`: backed up, or read from there
by a prefetch). A router keeps one model per instance, from a snapshot or from the start; two
routers must not disagree about which prefixes the instance can serve without recompute, and
the model must stay bounded by what the instance tracks (a `storage` page never removed was
kept by a router for ever, long after the store had evicted it).

The checker replays random workloads on two caches sharing one file store with a small byte
budget (each reads what the other backed up: prefetches adopt pages into the tree), small L1
and L2 (eviction in every tier, nodes leaving the tree), and compares the snapshot, the
model built from a stream subscribed from the start, and the tree, at random moments while
requests and transfers are in flight."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiohicache import HiCache
from aiohicache.controller import page_format
from aiohicache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventStream
from aiohicache.storage import FileBackend
from aiohicache.storage.keys import chain_keys
from tests.conftest import make_config, make_tokens, prefill
from tests.test_events import root_of, settle

Page = tuple[str, bytes]
"""(medium, page key)."""

STORE_PAGES = 24
"""The file store's byte budget, in pages: each cache evicts the other's pages."""

SHARED: dict[str, Any] = {
    "device_pages": 16, "host_pages": 24, "load_back_threshold": 0, "prefetch_threshold": 4,
    "prefetch_timeout_base": 0.05, "prefetch_timeout_max": 0.1, "storage_miss_ttl": 0.01,
    "backup_threshold": 1,
}


class Router:
    """A subscriber's model of one instance: the pages each medium holds, as a count per
    page so that a page announced twice, or removed when not held, is caught."""

    def __init__(self, cache: HiCache) -> None:
        self.root = root_of(cache)
        self.pages: Counter[Page] = Counter()

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert chain_keys(ev.parent_block_hash or self.root, np.array(ev.token_ids),
                                  ev.block_size) == ev.block_hashes
                for k in ev.block_hashes:
                    assert not self.pages[ev.medium, k], f"{ev.medium} page stored twice"
                    self.pages[ev.medium, k] += 1
            elif isinstance(ev, BlockRemoved):
                for k in ev.block_hashes:
                    assert self.pages[ev.medium, k], f"{ev.medium} page removed, not held"
                    del self.pages[ev.medium, k]
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.pages = Counter({p: n for p, n in self.pages.items() if p[0] == "storage"})

    def read(self, stream: EventStream) -> None:
        while (batch := stream.get_nowait()) is not None:
            self.apply(batch)

    @property
    def state(self) -> set[Page]:
        return set(self.pages)


def tree_truth(cache: HiCache) -> set[Page]:
    """What the tree holds: L1 and L2 pages, and the pages it knows to be in L3."""
    root, ps, out = root_of(cache), cache.config.page_size, set[Page]()
    for node in cache.tree.iter_nodes():
        tokens = np.concatenate([n.key for n in node.path_to_root()[::-1]])
        keys = chain_keys(root, tokens, ps)[-node.num_pages:]
        for medium, present in (("device", [node.on_device] * len(keys)),
                                ("host", [node.on_host] * len(keys)),
                                ("storage", node.stored or [False] * len(keys))):
            out |= {(medium, k) for k, p in zip(keys, present, strict=True) if p}
    return out


async def check(cache: HiCache, stream: EventStream, router: Router) -> set[Page]:
    """Snapshot now == the model of `stream` (subscribed at the start) == the tree.

    Synchronous up to the `aclose` (which never suspends): nothing changes in between."""
    router.read(stream)  # NOTE: subscribing seals the open batch for `stream` first
    late_stream = cache.events(snapshot=True)
    router.read(stream)
    late = Router(cache)
    late.read(late_stream)
    await late_stream.aclose()
    truth = tree_truth(cache)
    for medium in ("device", "host", "storage"):
        early_m = {k for m, k in router.state if m == medium}
        late_m = {k for m, k in late.state if m == medium}
        tree_m = {k for m, k in truth if m == medium}
        assert not early_m ^ late_m, (
            f"{medium}: the snapshot lists {len(late_m - early_m)} pages a subscriber from "
            f"the start never heard of, and misses {len(early_m - late_m)} it still holds")
        assert not early_m ^ tree_m, (
            f"{medium}: the stream says {len(early_m - tree_m)} pages the tree does not "
            f"hold, and not {len(tree_m - early_m)} that it holds")
    return truth


def store(path: Path, cache_cfg: Any, *, pages: int | None) -> FileBackend:
    cap = None if pages is None else pages * (64 + cache_cfg.page_bytes)
    return FileBackend(path, page_format(cache_cfg), segment_bytes=4096, capacity_bytes=cap,
                       refresh_interval=0.0, max_concurrency=2)


async def test_pages_a_prefetch_adopts_from_l3_are_announced_as_storage(
        tmp_path: Path) -> None:
    """Pages an L3 prefetch brings into the tree (another instance backed them up) are known
    to be in L3 (`Node.stored`), and a late snapshot lists them as `storage`; the stream
    said only `host` for them, so a router subscribed from the start never learnt that the
    instance holds them in L3 too, while one that joined later did."""
    cfg = make_config(**SHARED)
    tokens = make_tokens(32, seed=3)
    async with store(tmp_path, cfg, pages=None) as writer_store, \
            store(tmp_path, cfg, pages=None) as reader_store:
        await read_after_write(writer_store, reader_store, tokens)


async def read_after_write(writer_store: FileBackend, reader_store: FileBackend,
                           tokens: list[int]) -> None:
    async with HiCache(make_config(storage=writer_store, **SHARED)) as writer:
        await prefill(writer, tokens)
        await prefill(writer, tokens)  # a hit: the host copy is backed up
        await settle(writer)
        stats = writer.stats().storage
        assert stats is not None and stats.backed_up_pages
    async with HiCache(make_config(storage=reader_store, **SHARED)) as reader:
        router = Router(reader)
        async with reader.events() as stream:
            async with reader.fetch(tokens) as hit:  # from L3: a prefetch, then a load
                await hit.ready()
                assert hit.num_cached_tokens == len(tokens)
            await settle(reader)
            truth = await check(reader, stream, router)
            assert any(m == "storage" for m, _ in truth), "nothing adopted: shows nothing"


async def test_pages_the_tree_forgets_leave_the_storage_medium(tmp_path: Path) -> None:
    """A node evicted from L1 and L2 leaves the tree, and with it the knowledge that its
    pages are in L3: a late snapshot no longer lists them. No `storage` BlockRemoved was
    sent, so a router subscribed from the start kept them for ever (its model grew without
    bound, past what the store still held), and disagreed with one that joined later."""
    cfg = make_config(**SHARED)
    async with store(tmp_path, cfg, pages=None) as backend, \
            HiCache(make_config(storage=backend, **SHARED)) as cache:
        router = Router(cache)
        async with cache.events() as stream:
            first = make_tokens(32, seed=1)
            await prefill(cache, first)
            await prefill(cache, first)  # a hit: backed up
            await settle(cache)
            router.read(stream)
            assert any(m == "storage" for m, _ in router.state)
            for seed in range(2, 12):  # push the first prompt out of L1 and L2
                await prefill(cache, make_tokens(32, seed=seed))
                await settle(cache)
            assert cache.stats().host_evicted_pages
            await check(cache, stream, router)


async def run_instance(cache: HiCache, rng: random.Random, prompts: list[list[int]],
                       turns: int) -> None:
    """One instance's requests, one at a time: shared prefixes, conversations that grow."""
    for _ in range(turns):
        conv = rng.choice(prompts)
        if rng.random() < 0.5 and len(conv) < 48:
            conv += [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 9))]
        await prefill(cache, list(conv))
        if rng.random() < 0.3:
            await cache.drain()
        await asyncio.sleep(rng.random() * 0.002)


@pytest.mark.parametrize("seed", range(3))
async def test_snapshot_equals_the_stream_over_random_shared_l3_workloads(
        tmp_path: Path, seed: int) -> None:
    """The checker: two caches on one file store (byte budget: L3 evicts), prefetch on,
    small L1 and L2; at random moments, mid-flight, each cache's snapshot, the model of its
    stream from the start, and its tree agree, for every medium."""
    rng = random.Random(seed)
    cfg = make_config(**SHARED)
    async with store(tmp_path, cfg, pages=STORE_PAGES) as one, \
            store(tmp_path, cfg, pages=STORE_PAGES) as two:
        await shared_workload(rng, [one, two])


async def shared_workload(rng: random.Random, backends: list[FileBackend]) -> None:
    caches = [HiCache(make_config(storage=b, **SHARED)) for b in backends]
    base = [rng.randrange(1 << 20) for _ in range(12)]
    prompts = [base[:rng.randrange(0, 13)] + [rng.randrange(1 << 20)
                                              for _ in range(rng.randrange(4, 28))]
               for _ in range(10)]
    checks = 0
    async with caches[0], caches[1]:
        routers = [Router(c) for c in caches]
        streams = [c.events(max_batches=1 << 20) for c in caches]
        work = [asyncio.ensure_future(run_instance(c, random.Random(rng.random()),
                                                   [list(p) for p in prompts], 40))
                for c in caches]
        try:
            while not all(w.done() for w in work):
                await asyncio.sleep(rng.random() * 0.01)
                for cache, stream, router in zip(caches, streams, routers, strict=True):
                    await check(cache, stream, router)
                    checks += 1
        finally:
            for w in work:
                w.cancel()
            await asyncio.gather(*work, return_exceptions=True)
        for cache, stream, router in zip(caches, streams, routers, strict=True):
            await settle(cache)
            await check(cache, stream, router)
            assert stream.dropped == 0
        stats = [c.stats() for c in caches]
        assert all(s.host_evicted_pages and s.device_evicted_pages for s in stats)
        assert any(s.storage is not None and s.storage.prefetched_pages for s in stats)
        assert any(b.stats().evicted_pages for b in backends), "L3 never evicted"
        for s in streams:
            await s.aclose()
    assert checks > 10
