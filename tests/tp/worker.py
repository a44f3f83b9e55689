"""One tensor-parallel rank for the TP tests: ``python -m tests.tp.worker '<json args>'``.

Every rank runs the same scheduler (same seed, so the same request-path calls in the same
order) over its own cache, with its own random copy delays and storage latency and faults.
After every consensus tick it records the tree fingerprint (with page ids and ref counts) and
the shared stats; the test compares the records of all ranks. It also checks, for every hit,
that the KV on the device is exactly what was committed for those tokens (on this rank's
shard), and writes what happened to ``<out>/rank<r>.json``.

Scenarios: ``normal``; ``kill`` (the last rank exits abruptly at step `die_at`); ``stall``
(the last rank stops calling the cache at step `die_at` but stays alive); ``diverge`` (the
last rank makes one extra fetch at step `die_at`).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import random
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aiohicache import CpuTransferEngine, HiCache, HiCacheConfig, KVSpec, TransferHandle
from aiohicache.controller import page_format
from aiohicache.distributed import TPGroup
from aiohicache.errors import CapacityError, HiCacheError
from aiohicache.memory import PageIds
from aiohicache.storage.factory import backend_from_url
from aiohicache.storage.faults import FaultyBackend

SHARED_STATS = ("requests", "prompt_tokens", "device_hit_tokens", "host_hit_tokens",
                "storage_hit_tokens", "loads", "writes", "device_evicted_pages",
                "host_evicted_pages", "device_pages_used", "device_pages_leased",
                "host_pages_used", "num_nodes", "pending_loads", "pending_writes")
SHARED_STORAGE = ("prefetches", "prefetched_pages", "prefetch_misses", "negative_hits",
                  "backed_up_pages", "bypassed")


class DelayedEngine(CpuTransferEngine):
    """The CPU engine, every copy delayed on its worker thread by a random time (per rank)."""

    def __init__(self, seed: int, max_delay: float) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.max_delay = max_delay

    def attach(self, cache: HiCache) -> None:
        super().__init__(cache.device_pool, cache.host_pool, inline_bytes=0)

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        with self._lock:
            delay = self._rng.uniform(0, self.max_delay)
        time.sleep(delay)
        super()._run(src, dst, handle, to_device)


def kv_value(tokens: torch.Tensor, positions: torch.Tensor, rank: int, mla: bool) -> torch.Tensor:
    """The KV a rank computes for tokens at positions: MLA is the same on every rank."""
    shard = 0 if mla else rank + 1
    return ((tokens * 3 + positions * 5 + shard * 11) % 241).to(torch.float32)  # bf16-exact


class Scheduler:
    """The same request-path calls on every rank, as a TP serving framework makes them."""

    def __init__(self, cache: HiCache, args: dict[str, Any]) -> None:
        self.cache = cache
        self.args = args
        self.rank = args["rank"]
        self.mla = args["mla"]
        self.rng = random.Random(args["seed"])  # the same on every rank
        self.families = [[self.rng.randrange(1, 50_000) for _ in range(48)]
                         for _ in range(args["families"])]
        self.wrong_kv = 0
        self.capacity_skips = 0
        self.bad_examples: list[Any] = []
        self.last_hit: Any = None
        self.checked_tokens = 0

    def prompt(self) -> list[int]:
        base = self.rng.choice(self.families)
        keep = self.rng.randrange(8, len(base))
        tail = [self.rng.randrange(1, 50_000) for _ in range(self.rng.randrange(1, 16))]
        return base[:keep] + tail

    def _rows(self, kv: int, layer: int) -> torch.Tensor:
        pool = self.cache.device_pool
        return pool.data[kv, layer].view(pool.num_slots, -1)

    def write_kv(self, slots: torch.Tensor, tokens: list[int], start: int) -> None:
        toks = torch.tensor(tokens[start:start + len(slots)], dtype=torch.int64)
        pos = torch.arange(start, start + len(slots))
        val = kv_value(toks, pos, self.rank, self.mla)
        spec = self.cache.config.spec
        for layer in range(spec.num_layers):
            for kv in range(spec.num_kv):
                rows = self._rows(kv, layer)
                rows[slots] = (val + layer)[:, None].to(rows.dtype).expand(-1, rows.shape[1])

    def check_kv(self, indices: torch.Tensor, tokens: list[int]) -> None:
        n = len(indices)
        want = kv_value(torch.tensor(tokens[:n], dtype=torch.int64), torch.arange(n),
                        self.rank, self.mla)
        spec = self.cache.config.spec
        for layer in range(spec.num_layers):
            for kv in range(spec.num_kv):
                got = self._rows(kv, layer)[indices].to(torch.float32)
                bad = (got != (want + layer)[:, None]).any(dim=1)
                self.wrong_kv += int(bad.sum())
                if bad.any() and len(self.bad_examples) < 5:
                    self.bad_examples.append([layer, kv, bad.nonzero().flatten().tolist()[:20],
                                              n, self.last_hit])
        self.checked_tokens += n

    async def step(self, step: int) -> None:
        batch = [self.prompt() for _ in range(self.args["batch"])]
        if self.args["scenario"] == "diverge" and step == self.args["die_at"] and \
                self.rank == self.args["size"] - 1:
            batch.append(self.prompt())  # a call the other ranks do not make
        contexts = []
        for tokens in batch:
            ctx = self.cache.fetch(tokens)
            await ctx.__aenter__()
            contexts.append((ctx, tokens))
        for ctx, tokens in contexts:
            await ctx.ready()
            self.last_hit = [ctx.num_device_hit_tokens, ctx.num_host_hit_tokens,
                             ctx.num_storage_hit_tokens]
            self.check_kv(ctx.device_indices, tokens)
            new = len(tokens) - ctx.num_cached_tokens
            if new:
                try:
                    slots = await ctx.allocate(new)
                except CapacityError:  # the same on every rank: serve it without caching
                    self.capacity_skips += 1
                    continue
                self.write_kv(slots, tokens, ctx.num_cached_tokens)
                await ctx.commit(tokens, slots)
        for ctx, _ in contexts:
            await ctx.__aexit__(None, None, None)


    async def revisit(self) -> None:
        """After the backups settled: every family's prefix again, one by one (with a small
        L1+L2 most of them come back from L3)."""
        await asyncio.sleep(0.1)  # past the negative cache's TTL
        for base in self.families:
            async with self.cache.fetch(base) as hit:
                await hit.ready()
                self.check_kv(hit.device_indices, base)


def shared_stats(cache: HiCache) -> dict[str, Any]:
    stats = cache.stats()
    out = {k: getattr(stats, k) for k in SHARED_STATS}
    if stats.storage is not None:
        out.update({k: stats.storage[k] for k in SHARED_STORAGE})
    return out


def make_config(args: dict[str, Any], storage: object) -> HiCacheConfig:
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=8, rope_dim=4, dtype="fp16") if args["mla"] \
        else KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bf16")
    return HiCacheConfig(
        spec=spec, page_size=4, device_pages=args["device_pages"], host_pages=args["host_pages"],
        write_policy=args["write_policy"], storage=storage, prefetch_threshold=8,
        prefetch_policy=args["prefetch_policy"], prefetch_timeout_base=args["prefetch_timeout"],
        prefetch_timeout_per_1k_tokens=0.0, storage_miss_ttl=0.05, storage_cooldown=0.05,
        storage_failures_to_open=3, tp_rank=args["rank"], tp_size=args["size"],
        tp_timeout=args["tp_timeout"], namespace=f"tp-test-{args['seed']}")


def make_storage(args: dict[str, Any]) -> object:
    if args["storage"] is None:
        return None
    fmt = page_format(make_config(args, None))
    inner = backend_from_url(args["storage"], fmt)
    return FaultyBackend(inner, seed=args["seed"] * 100 + args["rank"],
                         error_rate=args["storage_errors"], corrupt_rate=args["storage_corrupt"],
                         latency=(0.0, args["storage_latency"]))


async def run(args: dict[str, Any], out: dict[str, Any]) -> None:
    group = TPGroup.new(timeout=args["tp_timeout"])
    storage = make_storage(args)
    engine = DelayedEngine(seed=args["seed"] * 1000 + args["rank"], max_delay=args["copy_delay"])
    cache = HiCache(make_config(args, storage), engine=engine, tp_group=group)
    engine.attach(cache)
    ticks: list[list[Any]] = []
    out["ticks"] = ticks
    scheduler = Scheduler(cache, args)
    dying = args["scenario"] in ("kill", "stall") and args["rank"] == args["size"] - 1
    try:
        async with cache:
            assert cache._tp is not None
            cache._tp.on_tick.append(lambda t: ticks.append(
                [t, cache.tree.fingerprint(pages=True), shared_stats(cache)]))
            for step in range(args["steps"]):
                if dying and step == args["die_at"]:
                    if args["scenario"] == "kill":
                        Path(args["out"], "died_at").write_text(  # noqa: ASYNC240
                            str(time.time()))
                        os._exit(17)
                    await asyncio.sleep(3600)  # stall: alive, but makes no more calls
                await scheduler.step(step)
                cache.check_invariants()
            await cache.drain()
            if args["revisit"]:
                await scheduler.revisit()
                await cache.drain()
            out["final"] = shared_stats(cache)
            out["fingerprint"] = cache.tree.fingerprint(pages=True)
            out["tp"] = cache.stats().tp
            out["storage_errors"] = (cache.stats().storage or {}).get("errors", 0)
    except HiCacheError as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        out["error_at"] = time.time()
    finally:
        out["wrong_kv"] = scheduler.wrong_kv
        out["checked_tokens"] = scheduler.checked_tokens
        out["capacity_skips"] = scheduler.capacity_skips
        out["bad_examples"] = scheduler.bad_examples
        out["closed_state"] = cache._state
        try:
            cache.check_invariants()
            out["invariants"] = "ok"
        except Exception as exc:  # reported to the test
            out["invariants"] = repr(exc)


DEFAULTS: dict[str, Any] = {
    "seed": 0, "steps": 30, "batch": 3, "families": 6, "mla": False, "device_pages": 56,
    "host_pages": 64, "write_policy": "write_through", "storage": "memory://",
    "storage_errors": 0.05, "storage_corrupt": 0.02, "storage_latency": 0.004,
    "copy_delay": 0.004, "prefetch_policy": "timeout", "prefetch_timeout": 0.01,
    "tp_timeout": 20.0, "scenario": "normal", "die_at": 5, "revisit": False,
}


def main() -> None:
    args = {**DEFAULTS, **json.loads(sys.argv[1])}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}",
                            rank=args["rank"], world_size=args["size"],
                            timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {"rank": args["rank"]}
    try:
        asyncio.run(run(args, out))
    except BaseException:  # reported to the test
        out["crash"] = traceback.format_exc()
    with open(os.path.join(args["out"], f"rank{args['rank']}.json"), "w") as f:
        json.dump(out, f, default=str)
    os._exit(0)  # skip process-group teardown: a dead peer would make it hang


if __name__ == "__main__":
    main()
