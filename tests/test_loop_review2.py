"""Review (second pass): work that grew with a call's size ran on the event loop in one
stretch. As in ``test_loop_review.py``, each test counts the work done between two turns
of the loop (not wall time: this shared 2-core VM's own floor is 10+ ms), and each failed
before its fix:

- a file-store `delete` unbound and tombstoned every key of the call in one turn (19k keys:
  36-48 ms of the loop, 90-185 ms under load);
- a new leaf of the radix tree was queued for eviction as never used (recency 0, no hit)
  before `insert` touched it, so each left a stale entry ahead of every node's, and the
  next eviction popped every one made since the last (100k one-page leaves, then an
  eviction of 8,192 pages: 108k entries popped, 370 ms of the loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiohicache.memory import PageAllocator
from aiohicache.radix import RadixTree, _policy
from aiohicache.storage import FileBackend
from tests.storage.conftest import FMT, make_keys
from tests.storage.test_file_sharing import pages, read, written


def _count_unbinds(store: FileBackend) -> list[int]:
    """[unbinds since the last reset]: the index's `unbind` calls, counted."""
    index, done = store._index, [0]
    real = index.unbind

    def unbind(key: str) -> Any:
        done[0] += 1
        return real(key)
    index.unbind = unbind  # type: ignore[method-assign]
    return done


async def _most_per_turn(done: list[int], call: Any) -> int:
    """The most `done[0]` grew in one turn of the loop while `call()` ran."""
    most = [0]

    async def ticker() -> None:
        while True:
            done[0] = 0
            await anyio.lowlevel.checkpoint()
            most[0] = max(most[0], done[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()  # the ticker counts from here
        await call()
        tg.cancel_scope.cancel()
    return most[0]


async def test_a_file_store_delete_of_many_keys_lets_the_loop_run(tmp_path: Path) -> None:
    """Deleting 4,096 keys in one call unbinds a few hundred a turn; every one is gone,
    here and after a restart, and the keys not named are served."""
    keys = make_keys(4200, seed=21)
    dead, kept = keys[:4096], keys[4096:]
    async with FileBackend(tmp_path, FMT) as store:
        await store.set_from(keys, pages(keys))
        done = _count_unbinds(store)
        removed: list[int] = []

        async def delete() -> None:
            removed.append(await store.delete(dead + dead[:10]))  # a key twice counts once
        most = await _most_per_turn(done, delete)
        assert removed == [len(dead)]
        assert most <= 1024, f"{most} keys unbound in one turn of the loop"
        assert await store.exists(dead[:1]) == 0
        assert await read(store, kept) == written(kept)
        assert store.stats().pages_deleted == len(dead)
    async with FileBackend(tmp_path, FMT) as fresh:
        assert await fresh.exists(dead[-1:]) == 0
        assert await read(fresh, dead[::512]) == [None] * len(dead[::512])
        assert await read(fresh, kept) == written(kept)


async def test_a_cancelled_delete_of_many_keys_journals_all_it_unbound(
        tmp_path: Path) -> None:
    """A delete cancelled while it unbinds in steps ends them, and journals every delete:
    no key comes back after a restart, none is served here."""
    keys = make_keys(4096, seed=22)
    async with FileBackend(tmp_path, FMT) as store:
        await store.set_from(keys, pages(keys))
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.delete, keys)
                await anyio.lowlevel.checkpoint()  # the delete is under way
                await anyio.lowlevel.checkpoint()
                scope.cancel()
        assert await store.exists(keys[-1:]) == 0
        assert await read(store, keys[::256]) == [None] * len(keys[::256])
    async with FileBackend(tmp_path, FMT) as fresh:
        assert await read(fresh, keys[::256]) == [None] * len(keys[::256])
        assert await fresh.exists(keys[-1:]) == 0


@pytest.mark.parametrize("eviction", ["lru", "lfu", "arc"])
def test_an_eviction_pops_about_as_many_entries_as_it_evicts(
        eviction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 one-page leaves committed with no eviction, then 64 pages wanted: the eviction
    takes the 64 least recently used (the oldest first) and pops about as many queue
    entries, not one per leaf made since the last eviction."""
    ps, num = 4, 5000
    tree = RadixTree(page_size=ps, device_alloc=PageAllocator(num, name="device"),
                     host_alloc=PageAllocator(16, name="host"), eviction=eviction)
    for i in range(num):
        pages = tree.alloc_device(1)
        assert pages is not None
        tree.insert(np.full(ps, i, dtype=np.int64), pages)
    popped, real = [0], _policy.heapq.heappop

    def heappop(heap: list[Any]) -> Any:
        popped[0] += 1
        return real(heap)
    monkeypatch.setattr(_policy.heapq, "heappop", heappop)
    tree.device_eviction_order = []
    assert tree.alloc_device(64) is not None
    assert popped[0] <= 4 * 64, f"{popped[0]} queue entries popped to evict 64 leaves"
    firsts = [next(n for n in tree.iter_nodes() if n.id == i) for i in (1, 65)
              if any(n.id == i for n in tree.iter_nodes())]
    assert [n.id for n in firsts] == [65]  # the oldest 64 went, the 65th stayed
    assert sorted(tree.device_eviction_order) == list(range(1, 65))
    tree.check()
