"""Adversarial review of tensor parallelism: the ranks must make identical cache decisions
whatever differs between them (timing, cancellation, L3 faults and latency per rank)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from aiohicache import HiCache
from aiohicache.controller._l3_parts import OFFLOAD_HASH_TOKENS

from ..conftest import fill_kv, make_tokens, read_kv, until
from .test_local import assert_same, hold_ticks, on_ranks, opened, serve, tp_caches

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------ cancellation

async def test_a_long_fetch_cancelled_while_hashing_on_one_rank_keeps_the_ranks_identical(
        ) -> None:
    """A prompt of OFFLOAD_HASH_TOKENS tokens or more is hashed on a thread *before* its
    enter op is submitted. The scheduler cancels the fetch on every rank (say, a timeout),
    but at different times: on rank 0 while it hashes, on rank 1 once its op is in the log.
    Rank 1's log then holds the enter op and its cancellation, rank 0's nothing: the logs
    differ and the next (identical) call diverges."""
    caches = tp_caches(2, timeout=3.0, storage="memory://", device_pages=16)
    long = make_tokens(OFFLOAD_HASH_TOKENS + 8, seed=4)
    async with opened(caches):
        enters = [asyncio.ensure_future(c.fetch(long).__aenter__()) for c in caches]
        await asyncio.sleep(0)  # both started: rank 0's hashing thread is running
        enters[0].cancel()  # rank 0: cancelled while hashing
        await until(lambda: len(caches[1]._tp._log) == 1)  # type: ignore[union-attr]
        enters[1].cancel()  # rank 1: cancelled while its op waits for the tick
        for task in enters:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        tokens = make_tokens(16, seed=5)
        hits = await asyncio.gather(*(serve(c, tokens) for c in caches))
        assert hits == [0, 0]
        await asyncio.gather(*(c.drain() for c in caches))
        assert_same(caches)
        assert all(c.stats().health == "ok" for c in caches)


async def test_a_context_used_after_its_cancelled_commit_acts_the_same_on_every_rank() -> None:
    """`commit` is cancelled on every rank (a timeout), on rank 0 just after the tick that
    ran it, on rank 1 just before. The commit still runs on both (its op is in both logs),
    and the context goes on: `allocate` continues the partial page the commit kept. But
    `allocate` reads the context's tail page at once, before its own tick: rank 0 (commit
    run) takes the rest of the kept page without a call to the tick, rank 1 (commit not yet
    run) queues a lease. The logs differ and the ranks fail (or serve different slots)."""
    caches = tp_caches(2, timeout=2.0)
    tokens = make_tokens(6)
    async with opened(caches):
        hits = [c.fetch(tokens) for c in caches]
        await on_ranks(caches, lambda r, c: hits[r].__aenter__())
        release, all_held = hold_ticks(caches)  # from the tick after the next one
        slots = await on_ranks(caches, lambda r, c: c.allocate(6))  # anonymous: adopted
        for cache, got in zip(caches, slots, strict=True):
            fill_kv(cache, got, tokens)
        await until(all_held)
        commits = [asyncio.ensure_future(hit.commit(tokens, got))
                   for hit, got in zip(hits, slots, strict=True)]
        await until(lambda: all(len(c._tp._log) == 1 for c in caches))  # type: ignore[union-attr]
        async def decode(r: int) -> Any:
            with contextlib.suppress(asyncio.CancelledError):
                await commits[r]
            return await hits[r].allocate(2)  # the context goes on decoding

        commits[1].cancel()  # before its tick
        going_on = [asyncio.ensure_future(decode(r)) for r in range(2)]
        for _ in range(10):
            await asyncio.sleep(0)
        caches[0]._tp.on_tick.append(lambda _: commits[0].cancel())  # type: ignore[union-attr]
        release.set()  # rank 0: cancelled just after the tick that ran its commit
        async with asyncio.timeout(5):
            more = await asyncio.gather(*going_on)
        assert all(c.cancelled() for c in commits)
        assert [s.tolist() for s in more] == [more[0].tolist()] * 2
        for hit in hits:
            await hit.__aexit__(None, None, None)
        cached = await on_ranks(caches, lambda r, c: serve(c, tokens))
        assert cached == [4, 4]
        assert_same(caches)
        assert all(c.stats().health == "ok" for c in caches)


# ------------------------------------------------------------------------------ closing

async def test_a_call_made_before_aclose_has_the_same_outcome_on_every_rank() -> None:
    """Every rank allocates, then closes (a server shutting down). Rank 0 gets to `aclose`
    before the tick that runs its allocate, rank 1 after: the op then checked the *local*
    state, already "closing" on rank 0 only, so rank 0's allocate raised ClosedError while
    rank 1's leased pages. A TP scheduler that sees different outcomes of the same call
    runs different model steps on different ranks; the caches diverge."""
    caches = tp_caches(2, timeout=2.0)
    for cache in caches:
        await cache.__aenter__()
    allocating = [asyncio.ensure_future(caches[0].allocate(8))]
    await asyncio.sleep(0)  # rank 0's op is in its log, waiting for rank 1
    closing = [asyncio.ensure_future(caches[0].aclose())]  # rank 0 goes on to close
    await asyncio.sleep(0)
    allocating.append(asyncio.ensure_future(caches[1].allocate(8)))
    outcomes = await asyncio.gather(*allocating, return_exceptions=True)
    closing.append(asyncio.ensure_future(caches[1].aclose()))
    await asyncio.gather(*closing)
    assert [type(o) for o in outcomes] == [type(outcomes[1])] * 2, outcomes
    assert all(c._tp.ticks == caches[0]._tp.ticks for c in caches)  # type: ignore[union-attr]
    assert all(c.stats().health != "failed" for c in caches), [c.stats().health for c in caches]


# ------------------------------------------------------------------------------ L3 shards
# Kept although it passes: no test restarts MHA ranks over ONE shared directory and checks
# that each rank reads back its own shard's KV (not another rank's pages of the same tokens).

def shard_kv(cache: HiCache, slots: Any, tokens: list[int], rank: int) -> None:
    """KV of `tokens` on `rank`'s shard: the same tokens get other values on another rank."""
    fill_kv(cache, slots, [t * 7 + 5000 * (rank + 1) for t in tokens])


async def test_mha_ranks_sharing_one_directory_read_back_only_their_own_shard(
        tmp_path: Any) -> None:
    l3: dict[str, Any] = {"storage": f"file://{tmp_path}", "prefetch_threshold": 4,
                          "backup_threshold": 1, "prefetch_policy": "wait_complete",
                          "storage_miss_ttl": 0.0}
    tokens = make_tokens(32, seed=8)

    async def write(r: int, cache: HiCache) -> None:
        for _ in range(2):  # a miss, then a hit: write-through, then backup
            async with cache.fetch(tokens) as hit:
                await hit.ready()
                if hit.num_cached_tokens < len(tokens):
                    slots = await hit.allocate(len(tokens))
                    shard_kv(cache, slots, tokens, r)
                    await hit.commit(tokens, slots)
        await cache.drain()

    async with opened(tp_caches(2, **l3)) as caches:
        await on_ranks(caches, write)
        assert all(c.stats().storage["backed_up_pages"] == 8 for c in caches)  # type: ignore[index]

    async def read(r: int, cache: HiCache) -> None:  # restarted: L1 and L2 are empty
        async with cache.fetch(tokens) as hit:
            await hit.ready()
            assert hit.num_storage_hit_tokens == 32
            got = read_kv(cache, hit.device_indices)
            scratch = await cache.allocate(32)
            shard_kv(cache, scratch, tokens, r)
            want = read_kv(cache, scratch)
            cache.free(scratch)
            assert torch.equal(got, want), f"rank {r} read another shard's KV"

    async with opened(tp_caches(2, **l3)) as caches:
        await on_ranks(caches, read)
        assert_same(caches)


# ------------------------------------------------------------------------------ restarts

RESTART_RANK = r"""
import asyncio, datetime, json, os, sys
import torch.distributed as dist
from aiohicache import HiCache
from aiohicache.distributed import TPGroup
from tests.conftest import make_config, make_tokens
from tests.tp.test_local import serve

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=30))
group = TPGroup.new(timeout=10.0)

async def main():
    out = []
    for _ in range(2):  # the cache restarts over the same group
        try:
            config = make_config(tp_rank=rank, tp_size=2, tp_timeout=10.0)
            async with HiCache(config, tp_group=group) as cache:
                out.append([await serve(cache, make_tokens(16)),
                            await serve(cache, make_tokens(16))])
        except Exception as exc:
            out.append(repr(exc))
    return out

print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
os._exit(0)
"""


def test_a_cache_restarted_over_the_same_tp_group_works() -> None:
    """`HiCache.aclose` closes the caller's `TPGroup` (its collective thread): a new cache
    over the same group (a restart; the docs say the process group stays the caller's)
    failed at its first tick with "cannot schedule new futures after shutdown"."""
    from .test_tp import ROOT, free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RESTART_RANK, str(r), str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    results = [json.loads(line.split(" ", 1)[1]) for out in outs
               for line in out.splitlines() if line.startswith("RESULT ")]
    assert results == [[[0, 16], [0, 16]]] * 2, outs
