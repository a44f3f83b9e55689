"""A page the store dropped is backed up again by the instance that keeps it hot.

A node's pages are backed up once and then marked stored (`Node.stored`); `queue_backup`
skips a node whose pages are all marked. But a store may drop pages on its own afterwards:
the file store's byte budget evicts the least recently *used in the store* pages, Redis
evicts under ``maxmemory``, another instance sharing the store deletes. A prefix an instance
keeps hot in its own L1/L2 is never read from L3 by it, so it is exactly what the store's
LRU drops first; and while the node lives on in the instance, the tree went on believing
its pages were in L3, so they were never written again: every other instance sharing the
store (and this one after a restart) recomputed the hottest prefix for as long as this
instance served it from memory.

Required: a node whose pages are marked stored is re-checked against the store (``exists``)
now and then when it is hit, in the background, never on the request's path and at most
once per node per interval; pages found absent are marked not stored (through
`mark_stored`, so the events say so too) and the node is backed up again.

Every hit is verified with `KVChecker`, whichever tier it came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiohicache import HiCache
from aiohicache.controller import _storage_tier
from tests.conftest import make_config, make_tokens
from tests.controller.test_l3_tier_review import serve

PAGE_SIZE = 4
PROMPT_PAGES = 4
STORE_PAGES = 2 * PROMPT_PAGES
"""The store's byte budget: two prompts; a third evicts the least recently used one."""
L3: dict[str, Any] = {"page_size": PAGE_SIZE, "prefetch_policy": "wait_complete",
                      "prefetch_threshold": PAGE_SIZE, "device_pages": 64, "host_pages": 128}


@pytest.fixture
def recheck_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-check a stored node at every hit after the first (the interval is for serving)."""
    # (raising=False: a tree without the re-check fails on what it serves, not here)
    monkeypatch.setattr(_storage_tier, "L3_RECHECK_SECONDS", 0.0, raising=False)


def store_url(root: Path) -> str:
    page_bytes = make_config(**L3).page_bytes
    return f"file://{root}?max_bytes={STORE_PAGES * (64 + page_bytes)}"


@pytest.mark.usefixtures("recheck_at_once")
async def test_a_hot_prefix_the_store_evicted_is_backed_up_again(tmp_path: Path) -> None:
    """One instance keeps a prefix hot in L1/L2 while it writes other prompts to a small
    shared file store, whose budget evicts the hot prefix (never read from the store, so
    least recently used there). Another instance over the same store must still find it
    there: the first one notices the loss at a later hit and backs the prefix up again."""
    cfg = make_config(storage=store_url(tmp_path / "l3"), **L3)
    n = PROMPT_PAGES * PAGE_SIZE
    hot = make_tokens(n, seed=1)
    async with HiCache(cfg) as serving:
        assert await serve(serving, hot) == (0, 0)
        await serving.drain()
        for seed in range(2, 8):  # cold prompts fill the store: the hot one is evicted
            assert await serve(serving, make_tokens(n, seed=seed)) == (0, 0)
            await serving.drain()
            for _ in range(2):  # ...while this instance keeps serving it from memory
                assert await serve(serving, hot) == (n, 0)
                await serving.drain()
        assert serving.storage is not None
        assert serving.storage.backend.stats().evicted_pages > 0  # the budget did evict
        serving.check_invariants()
        async with HiCache(cfg) as other:  # a second instance (or a restart) of the model
            assert await serve(other, hot) == (n, n), "the hot prefix is gone from L3"
            await other.drain()
            other.check_invariants()


async def test_a_stored_prefix_hit_within_the_interval_asks_the_store_nothing(
        tmp_path: Path) -> None:
    """The re-check's cost bound (a guard for the fix): hits of a node whose pages are
    marked stored ask the store nothing until `L3_RECHECK_SECONDS` have passed."""
    async with HiCache(make_config(storage=store_url(tmp_path / "l3"), **L3)) as cache:
        hot = make_tokens(PROMPT_PAGES * PAGE_SIZE, seed=1)
        await serve(cache, hot)
        await cache.drain()
        assert cache.storage is not None
        calls = cache.storage.backend.stats().exists_calls
        for _ in range(50):
            await serve(cache, hot)
        await cache.drain()
        assert cache.storage.backend.stats().exists_calls == calls
