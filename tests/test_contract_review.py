"""The documented contract against the behaviour: claims of README.md, docs/api.md,
docs/architecture.md and docs/tensor-parallel.md that no other test pinned, each checked as
written (from a contract review)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aiohicache import HiCache, HiCacheConfig, KVSpec, TransferError, WorkerError
from aiohicache.controller import Controller
from aiohicache.distributed import TPGroup
from aiohicache.errors import DivergenceError

from .conftest import SPEC_MHA, SPEC_MLA, fill_kv, make_cache, make_config, make_tokens, prefill
from .test_cancellation import SETTLE_LIMIT, host_only
from .tp.test_local import on_ranks, opened

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ README

IMPORT = "from aiohicache import HiCache, HiCacheConfig, KVSpec\n"


def readme_sample() -> str:
    """The "Using it" code sample as a coroutine `sample(token_ids)`, sized down to fit any
    machine; its `...x...` placeholder lines become the work they stand for (writing the new
    tokens' K/V) or nothing (attention)."""
    section = (ROOT / "README.md").read_text().split("## Using it", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    for big, small in ((IMPORT, ""), ("num_layers=32", "num_layers=2"),
                       ("num_kv_heads=8", "num_kv_heads=1"), ("head_dim=128", "head_dim=8"),
                       ("device_pages=4096", "device_pages=32")):
        assert big in code, f"the README sample no longer says {big!r}"
        code = code.replace(big, small)

    def placeholder(m: re.Match[str]) -> str:
        work = "fill_kv(cache, slots, token_ids[hit.num_cached_tokens:])" \
            if "write K/V" in m.group(2) else "pass"
        return m.group(1) + work
    code = re.sub(r"^( *)\.\.\.(.*)\.\.\. *$", placeholder, code, flags=re.M)
    return "async def sample(token_ids):\n" + textwrap.indent(code, "    ")


async def test_the_readme_sample_runs_as_written_also_on_a_full_hit() -> None:
    """It allocated `len(token_ids) - hit.num_cached_tokens` slots unconditionally: a request
    for a prompt of whole pages already cached (a full hit) got
    ConfigError("num_tokens: must be a positive int, got 0")."""
    kept: list[HiCache] = []

    @contextlib.asynccontextmanager
    async def one_cache(config: HiCacheConfig) -> AsyncIterator[HiCache]:
        """`HiCache(config)` for the sample: every request enters the same open cache."""
        if not kept:
            kept.append(await HiCache(config).__aenter__())
        yield kept[0]

    namespace: dict[str, Any] = {"HiCache": one_cache, "HiCacheConfig": HiCacheConfig,
                                 "KVSpec": KVSpec, "fill_kv": fill_kv}
    exec(compile(readme_sample(), "README.md", "exec"), namespace)  # the README sample itself
    prompt = make_tokens(32)  # two whole pages of 16
    try:
        await namespace["sample"](prompt)  # a miss
        await namespace["sample"](prompt)  # a full hit: nothing to compute
        await namespace["sample"](prompt + make_tokens(5, seed=9))  # a partial hit
        stats = kept[0].stats()
        assert stats.requests == 3 and stats.device_hit_tokens == 64
        kept[0].check_invariants()
    finally:
        if kept:
            await kept[0].aclose()


# ------------------------------------------------------------------------------ workers

@pytest.mark.parametrize("worker", ["load", "write"])
async def test_a_worker_crashing_with_copies_in_hand_fails_them_instead_of_hanging(
        monkeypatch: pytest.MonkeyPatch, worker: str) -> None:
    """docs/architecture.md: a worker that raises is restarted, and wrong KV is never served.
    A worker that crashed after taking jobs from its channel lost them: their nodes stayed
    LOADING/WRITING for good, `ready()` and `drain()` hung, and so did `aclose` (60 s).
    A copy that never ran leaves pages of unknown content, like a failed copy: it is one."""
    name = "_launch_loads" if worker == "load" else "_launch_writes"
    real = getattr(Controller, name)
    crashed: list[int] = []

    def crash_once(self: Controller, batch: Any) -> None:
        if not crashed:
            crashed.append(len(batch))
            raise RuntimeError(f"the {worker} worker crashed")
        real(self, batch)
    monkeypatch.setattr(Controller, name, crash_once)
    tokens = make_tokens(8)
    async with asyncio.timeout(SETTLE_LIMIT):
        async with make_cache() as cache:
            if worker == "load":
                await host_only(cache, tokens)  # writes only: the first load is the lost job
                async with cache.fetch(tokens) as hit:
                    assert hit.num_host_hit_tokens == 8
                    with pytest.raises(TransferError, match="never launched"):
                        await hit.ready()  # never the KV the device pages held before
            else:
                await prefill(cache, tokens)  # its write-through is the lost job
            await cache.drain()
            assert crashed and cache.stats().worker_restarts == 1
            assert cache.stats().health == "failed"
            with pytest.raises(WorkerError):
                async with cache.fetch(make_tokens(8, seed=3)):
                    pass


# ------------------------------------------------------------------------------ TP config

L3 = {"prefetch_threshold": 4, "backup_threshold": 1, "prefetch_policy": "wait_complete",
      "storage_miss_ttl": 0.0}


def tp_ranks(per_rank: dict[str, list[Any]], **common: Any) -> list[HiCache]:
    groups = TPGroup.local(2, timeout=5.0)
    return [HiCache(make_config(tp_rank=r, tp_size=2, **common,
                                **{k: v[r] for k, v in per_rank.items()}), tp_group=groups[r])
            for r in range(2)]


async def serve_twice(r: int, cache: HiCache, tokens: list[int]) -> None:
    """A miss, then a hit (write-through, then backup), then everything backed up."""
    for _ in range(2):
        async with cache.fetch(tokens) as hit:
            await hit.ready()
            if hit.num_cached_tokens < len(tokens):
                slots = await hit.allocate(len(tokens))
                fill_kv(cache, slots, tokens)
                await hit.commit(tokens, slots)
    await cache.drain()


async def storage_hits(r: int, cache: HiCache, tokens: list[int]) -> int:
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        return hit.num_storage_hit_tokens


@pytest.mark.parametrize("per_rank", [
    {"host_layout": ["page_first", "layer_first"]},
    {"namespace": ["model-a", "model-b"]},
], ids=["host_layout", "namespace"])
async def test_mla_ranks_sharing_l3_pages_must_name_them_alike(
        tmp_path: Path, per_rank: dict[str, list[Any]]) -> None:
    """docs/tensor-parallel.md listed host_layout as free to differ per rank. MLA ranks share
    their L3 pages (one rank writes each, every rank reads all), and the layout and the
    namespace are part of a page's key: ranks differing there each found only the pages
    they had written themselves, so a restarted pair got no L3 hit at all (measured: 0 of 64
    tokens, against 64 when they agree), while both counted every page as backed up. Now the
    first call names the difference, as for every other setting the ranks must share."""
    ranks = tp_ranks(per_rank, spec=SPEC_MLA, storage=f"file://{tmp_path}", tp_timeout=5.0,
                     **L3)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache:
            with pytest.raises(DivergenceError, match="configs differ in storage"):
                await serve_twice(r, cache, make_tokens(64, seed=8))
    await on_ranks(ranks, rank)


async def test_mha_ranks_may_differ_in_host_layout_tp_timeout_and_io_backend(
        tmp_path: Path) -> None:
    """docs/tensor-parallel.md: free to differ per rank. MHA ranks read back their own
    shard's pages from one shared directory, each in its own layout."""
    per_rank: dict[str, list[Any]] = {"host_layout": ["page_first", "layer_first"],
                                      "tp_timeout": [5.0, 7.0], "io_backend": ["auto", "cpu"]}
    tokens = make_tokens(64, seed=8)
    common = {"spec": SPEC_MHA, "storage": f"file://{tmp_path}", **L3}
    async with opened(tp_ranks(per_rank, **common)) as caches:
        await on_ranks(caches, lambda r, c: serve_twice(r, c, tokens))
    async with opened(tp_ranks(per_rank, **common)) as caches:  # restarted: L1, L2 empty
        assert await on_ranks(caches, lambda r, c: storage_hits(r, c, tokens)) == [64, 64]


async def test_ranks_differing_in_the_prefetch_timeout_per_1k_tokens_stop_at_the_first_call(
        ) -> None:
    """docs/tensor-parallel.md: every `prefetch_*` setting is compared at each tick;
    `prefetch_timeout_per_1k_tokens` was not (the base and the maximum were)."""
    ranks = tp_ranks({"prefetch_timeout_per_1k_tokens": [0.1, 0.5]}, storage="memory://",
                     tp_timeout=5.0)

    async def rank(r: int, cache: HiCache) -> None:
        async with cache:
            with pytest.raises(DivergenceError, match="configs differ in storage"):
                await prefill(cache, make_tokens(16))
    await on_ranks(ranks, rank)


async def test_ranks_naming_the_same_write_through_threshold_two_ways_agree() -> None:
    """The tick compares what the ranks decide by: the default threshold of write_through
    (None: one hit) and an explicit 1 are the same policy, not a divergence."""
    ranks = tp_ranks({"write_through_threshold": [None, 1]}, write_policy="write_through")
    async with opened(ranks):
        await on_ranks(ranks, lambda r, cache: serve_twice(r, cache, make_tokens(16)))
        for cache in ranks:
            assert cache.stats().host_hit_tokens + cache.stats().device_hit_tokens == 16
