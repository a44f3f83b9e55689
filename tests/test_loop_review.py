"""Review: work that grew with a long prompt or a large segment ran on the event loop in one
stretch. Each test counts the work done on the loop (not wall time: this 2-core VM's own
floor is 10+ ms), and each failed before its fix:

- a subscriber's page keys of a 128k-token commit were hashed on the loop, in the tree's
  residency hook (8,192 pages, 10-20 ms), with or without an L3 tier (with one, the node got
  the keys hashed at the fetch only after the hook had run);
- with an L3 tier, a commit that extends the fetched tokens (a decoded page with them)
  hashed the whole prompt again on the loop (24 ms at 128k tokens), not the extension;
- a file-store compaction planned and re-pointed a whole segment in one turn (32k records
  of 4 KiB: 57-69 ms; now about the machine's floor).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiohicache import HiCache, KVSpec, _events_hub, _events_snapshot
from aiohicache.controller import _l3_parts
from aiohicache.events import BlockStored
from aiohicache.storage import FileBackend
from aiohicache.storage.keys import chain_keys, namespace_root
from tests.conftest import make_config
from tests.storage.conftest import FMT, make_keys
from tests.storage.test_file_sharing import pages, read, written

PROMPT = 128 * 1024
PS = 16
SPEC = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bf16")


def _hashed_on_loop(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pages each `chain_keys` call hashes on the calling (loop) thread, wherever from."""
    loop_thread, on_loop = threading.get_ident(), []
    for module in (_events_hub, _events_snapshot, _l3_parts):
        real = module.chain_keys

        def spy(prev: bytes, tokens: Any, page_size: int, real: Any = real) -> list[bytes]:
            if threading.get_ident() == loop_thread:
                on_loop.append(len(tokens) // page_size)
            return real(prev, tokens, page_size)  # type: ignore[no-any-return]
        monkeypatch.setattr(module, "chain_keys", spy)
    return on_loop


def _cache(storage: str | None) -> HiCache:
    extra = {"storage": storage} if storage else {}
    return HiCache(make_config(spec=SPEC, page_size=PS, device_pages=PROMPT // PS + 64,
                               host_pages=2 * PROMPT // PS, **extra))


def _root(cache: HiCache) -> bytes:
    cfg = cache.config
    return namespace_root(namespace=cfg.namespace, spec_fingerprint=cfg.spec.fingerprint(),
                          page_size=cfg.page_size, layout=cfg.host_layout)


@pytest.mark.parametrize("storage", [None, "memory://"])
async def test_a_subscriber_does_not_hash_a_long_commit_on_the_loop(
        storage: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An events subscriber names every page a commit stores by its key: a 128k-token
    prompt's are hashed off the loop (as the L3 tier's are), and the events carry them."""
    tokens = list(range(7, 7 + PROMPT))
    async with _cache(storage) as cache:
        stream = cache.events()
        on_loop = _hashed_on_loop(monkeypatch)
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(PROMPT)
            await hit.commit(tokens, slots)
        assert sum(on_loop) <= 16, f"{sum(on_loop)} pages hashed on the loop"
        batch = await stream.__anext__()
        stored = [ev for ev in batch.events
                  if isinstance(ev, BlockStored) and ev.medium == "device"]
        assert [k for ev in stored for k in ev.block_hashes] == \
            chain_keys(_root(cache), np.array(tokens), PS)
        cache.check_invariants()


async def test_a_commit_extending_the_fetched_tokens_hashes_only_the_extension(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fetch(prompt), then commit(prompt + decoded page): the prompt's keys, hashed off the
    loop at the fetch, are reused; only the new page is hashed on the loop."""
    prompt = list(range(11, 11 + PROMPT))
    tokens = prompt + [5] * PS
    async with _cache("memory://") as cache:
        on_loop = _hashed_on_loop(monkeypatch)
        async with cache.fetch(prompt) as hit:
            slots = await hit.allocate(len(tokens))
            await hit.commit(tokens, slots)
        assert sum(on_loop) <= 16, f"{sum(on_loop)} pages hashed on the loop"
        (node,) = cache.tree.iter_nodes()
        assert node.hashes == chain_keys(_root(cache), np.array(tokens), PS)
        await cache.drain()
        cache.check_invariants()


class _CountingEntries(dict[str, Any]):
    """An index's `entries` that counts per-key lookups and bindings since the last reset."""

    done = 0

    def get(self, key: str, default: Any = None) -> Any:
        _CountingEntries.done += 1
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        _CountingEntries.done += 1
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        _CountingEntries.done += 1
        super().__setitem__(key, value)


async def test_a_compaction_plans_and_repoints_a_step_at_a_time(tmp_path: Path) -> None:
    """Compacting a segment of 4,000 records (1,600 live) lets the loop run every few
    hundred of them; every live page is served after, here and after a restart."""
    keys = make_keys(4000, seed=9)
    async with FileBackend(tmp_path, FMT, max_concurrency=1, compact_dead_fraction=0.5,
                           segment_bytes=len(keys) * (len(pages(keys[:1])[0]) + 64)) as store:
        await store.set_from(keys, pages(keys))
        await store.set_from(keys[:1], pages(keys[:1], version=1))  # rolls the segment
        victim = max(store._index.keys_of, key=lambda s: len(store._index.keys_of[s]))
        assert victim not in store._appender.active_ids()
        dead = sorted(store._index.keys_of[victim])[:2400]
        live = [k for k in keys[1:] if k not in set(dead)]
        store._index.entries = _CountingEntries(store._index.entries)
        most, turns = [0], [0]

        async def ticker() -> None:
            while True:
                _CountingEntries.done = 0
                await anyio.lowlevel.checkpoint()
                turns[0] += 1
                most[0] = max(most[0], _CountingEntries.done)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            assert await store.delete(dead) == len(dead)  # compacts before it returns
            tg.cancel_scope.cancel()
        assert store.stats().extra["compactions"] == 1
        assert victim not in store._index.sizes
        assert most[0] <= 1024, f"{most[0]} records planned or re-pointed in one turn"
        assert await read(store, live) == written(live)
    async with FileBackend(tmp_path, FMT) as fresh:
        assert await read(fresh, live) == written(live)
        assert await fresh.exists(dead[:1]) == 0
