"""The cancellation sweep, extended: the transformers adapter, the serving engine and the
storage backends, each public coroutine cancelled at EVERY await point.

`tests/test_cancel_sweep_review.py` sweeps the cache's own coroutines; its
`run_cancelled_at` runs a call once uncancelled to count the times the caller's task
suspends, then cancels it at each of them (``Task.cancel``, an anyio cancel scope, an
expiring ``asyncio.timeout``; ``steps``: from a sibling after each loop turn). Here the same
is done to:

- `HFAdapter.prefill` (a miss, a prefix on the device, a prefix loading back from L2),
  `decode` and `commit_decoded`, each then retried in the same context: the retry commits,
  its logits are ``torch.equal`` to recomputation, the cache serves exactly the model's KV,
  nothing stays leased;
- `Engine.generate` cancelled at each await point, or closed after each token: nothing
  leased or running, the cache's invariants hold, and a next request generates what a
  no-cache engine generates (greedy);
- the storage backends' `get_into`, `set_from`, `exists`, `delete` and `aclose` (memory,
  file, a real redis-server): every page reads back as written or misses (on the same
  instance and on a second one over the same store), and nothing leaks (files, threads,
  connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from redis.asyncio import Redis
from transformers import PreTrainedModel

from aiohicache import CpuTransferEngine, HiCache, TransferHandle
from aiohicache.hf import HFAdapter, tiny_llama
from aiohicache.memory import DevicePool, HostPool, PageIds
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, SamplingParams, Usage
from aiohicache.storage import FileBackend, MemoryBackend
from aiohicache.storage.redis import RedisBackend
from tests.storage.conftest import FMT
from tests.storage.redis_server import shared_server
from tests.storage.sweep import (
    NEW,
    OLD,
    assert_pages_whole_or_missed,
    cancel_and_check,
    cancelled_or_done,
)
from tests.test_cancel_sweep_review import MAX_TURNS, How, Outcome, run_cancelled_at, threaded
from tests.test_hf import (  # noqa: F401  (an autouse fixture)
    SMALL,
    config_for,
    one_compute_thread,
    recompute,
    tokens_of,
)
from tests.test_hf_misuse_review import assert_cached_kv

SETTLE = 5.0


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_llama(seed=1, **SMALL)


async def counted(make: Callable[[int | None], Coroutine[Any, Any, Outcome]]) -> list[int]:
    """The points a sweep cancels at: run `make(None)` (uncancelled) to count them (loop
    turns, in ``steps`` mode: the first `MAX_TURNS` of them)."""
    base = await make(None)
    assert base.result == "completed", base
    return list(range(min(base.suspensions, MAX_TURNS) + 1))


async def settled(cache: HiCache, where: str) -> None:
    """Every copy settles, nothing is leased, the invariants hold."""
    async with asyncio.timeout(SETTLE):
        await cache.drain()
    cache.check_invariants()
    stats = cache.stats()
    assert stats.device_pages_leased == 0, f"{where}: {stats.device_pages_leased} leased"
    assert stats.pending_loads == stats.pending_writes == 0, f"{where}: copies pending"


# ------------------------------------------------------------------------------ the adapter

BASE = tokens_of(8, seed=21)  # two pages
PROMPT = [*BASE, *tokens_of(9, seed=22)]  # continues it: four pages and one token
CHUNKS = [len(BASE), len(PROMPT) - len(BASE)]
"""The forward calls that computed `PROMPT`'s KV: the base's prefill, then the rest's."""


async def prefix_nowhere(adapter: HFAdapter) -> None:
    pass


async def prefix_on_device(adapter: HFAdapter) -> None:
    async with adapter.cache.fetch(BASE) as hit:
        await adapter.prefill(hit, BASE)


async def prefix_on_host(adapter: HFAdapter) -> None:
    """The base computed, written through to L2, then pushed off the device: a fetch of
    `PROMPT` loads it back layer by layer."""
    cache = adapter.cache
    await prefix_on_device(adapter)
    await cache.drain()
    slots = await cache.allocate(cache.device_pool.num_slots)
    cache.free(slots)
    assert cache.stats().device_pages_used == 0 and cache.stats().host_pages_used == 2


async def prefix_on_device_writes_queued(adapter: HFAdapter) -> None:
    """The base on the device, and write-throughs of it and of two other prompts still
    copying (`SlowCopies`) or queued: the channel (one job) is full, so the prompt's commit
    waits to queue its own, and a cancellation can land after the commit."""
    await prefix_on_device(adapter)
    for seed in (23, 24):
        others = tokens_of(4, seed=seed)
        async with adapter.cache.fetch(others) as hit:
            await adapter.prefill(hit, others)


class SlowCopies(CpuTransferEngine):
    """Every copy on its thread, each taking 30 ms: loads are still in flight when a
    cancelled prefill is retried, and write-throughs queue up."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool, inline_bytes=0)

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        time.sleep(0.03)
        super()._run(src, dst, handle, to_device)


SETUPS = {"miss": prefix_nowhere, "device": prefix_on_device, "host": prefix_on_host,
          "busy": prefix_on_device_writes_queued}
"""Where the base prompt is, and what the cache is doing."""


@contextlib.asynccontextmanager
async def hf_world(llama: PreTrainedModel, setup: str) -> AsyncIterator[HFAdapter]:
    """An adapter over a fresh cache where `setup` put the base prompt."""
    cfg = config_for(llama, write_policy="write_through", load_back_threshold=0,
                     max_inflight_writes=1)
    engine = SlowCopies if setup in ("host", "busy") else threaded
    async with HiCache(cfg, engine=engine) as cache:
        adapter = HFAdapter(llama, cache)
        await SETUPS[setup](adapter)
        yield adapter


def chunks_of(setup: str) -> list[int]:
    return [len(PROMPT)] if setup == "miss" else CHUNKS


async def prefilled_exactly(adapter: HFAdapter, setup: str, where: str) -> None:
    """A prefill of `PROMPT` in a fresh context gives the logits recomputation gives; the
    cache then serves exactly the model's KV of its whole pages; nothing stays leased."""
    cache, chunks = adapter.cache, chunks_of(setup)
    await settled(cache, where)
    async with cache.fetch(PROMPT) as hit:
        out = await adapter.prefill(hit, PROMPT, all_logits=True)
    assert torch.equal(out.logits, recompute(adapter.model, PROMPT, out.num_reused_tokens,
                                             chunks)), f"{where}: other logits"
    served = await assert_cached_kv(cache, adapter.model, PROMPT, chunks)
    assert served == len(PROMPT) // 4 * 4, f"{where}: {served} tokens served"
    await settled(cache, where)


async def retried_prefill(adapter: HFAdapter, hit: Any, setup: str, where: str) -> None:
    """A prefill after a cancelled one, in the same context: it commits, and its logits are
    recomputation's."""
    out = await adapter.prefill(hit, PROMPT, all_logits=True)
    assert hit.num_cached_tokens == len(PROMPT) // 4 * 4, f"{where}: not committed"
    assert torch.equal(out.logits, recompute(adapter.model, PROMPT, out.num_reused_tokens,
                                             chunks_of(setup))), f"{where}: other logits"


@pytest.mark.parametrize("how", ["task", "scope", "timeout"])
@pytest.mark.parametrize("setup", ["miss", "device", "host", "busy"])
async def test_prefill_cancelled_anywhere_then_retried_in_its_context(
        llama: PreTrainedModel, setup: str, how: How) -> None:
    """`HFAdapter.prefill` (its prefix nowhere, on the device, or loading back from L2)
    cancelled at each await point, then run again in the same context: the retry commits
    with the logits recomputation gives, nothing stays leased, and the cache serves exactly
    the model's KV."""
    async def run(at: int | None) -> Outcome:
        where = f"{setup}, {how} cancel at {at}"
        async with hf_world(llama, setup) as adapter:
            async with adapter.cache.fetch(PROMPT) as hit:
                outcome = await run_cancelled_at(
                    adapter.prefill(hit, PROMPT, all_logits=True), at, how)
                cancelled_or_done(outcome, where)
                if outcome.result == "cancelled":
                    await retried_prefill(adapter, hit, setup, where)
            await prefilled_exactly(adapter, setup, where)
        return outcome

    for at in (await counted(run))[1 if how != "task" else 0:]:
        await run(at)


@pytest.mark.parametrize("setup", ["device", "host", "busy"])
async def test_prefill_cancelled_twice_then_retried_in_its_context(
        llama: PreTrainedModel, setup: str) -> None:
    """A prefill cancelled at each await point, its retry cancelled at each of its own
    (while it holds the first one's slots), then a third run: it commits exactly. (The
    retry took back the cancelled run's slots before its first await: cancelled there,
    they were lost to it, and the third run leased the slots after them.)"""
    async def run(first: int | None, second: int | None = None) -> Outcome:
        where = f"{setup}, cancelled at {first}, then at {second}"
        async with hf_world(llama, setup) as adapter:
            async with adapter.cache.fetch(PROMPT) as hit:
                outcome = await run_cancelled_at(adapter.prefill(hit, PROMPT), first, "task")
                cancelled_or_done(outcome, where)
                if outcome.result == "cancelled":  # (a loaded machine: fewer suspensions)
                    again = await run_cancelled_at(adapter.prefill(hit, PROMPT), second,
                                                   "task")
                    cancelled_or_done(again, where)
                    outcome = again
                    if again.result == "cancelled":
                        await retried_prefill(adapter, hit, setup, where)
            await prefilled_exactly(adapter, setup, where)
        return outcome

    for first in (await counted(run))[1:]:
        seconds = await counted(lambda at, first=first: run(first, at))  # type: ignore[misc]
        for second in seconds[1:]:
            await run(first, second)


@pytest.mark.parametrize("how", ["task", "scope", "timeout"])
@pytest.mark.parametrize("setup", ["device", "busy"])
async def test_decode_cancelled_anywhere_feeds_its_token_whole_or_not_at_all(
        llama: PreTrainedModel, setup: str, how: How) -> None:
    """`HFAdapter.decode` cancelled at each await point: the step is fed whole (the model's
    cache and its record of the tokens one longer) or not at all; decoding goes on from
    there, and `commit_decoded` commits exactly the model's KV."""
    async def run(at: int | None) -> Outcome:
        where = f"{setup}, {how} cancel at {at}"
        async with hf_world(llama, setup) as adapter:
            async with adapter.cache.fetch(PROMPT) as hit:
                out = await adapter.prefill(hit, PROMPT)
                past, token = out.past_key_values, int(out.logits[0, -1].argmax())
                outcome = await run_cancelled_at(adapter.decode(past, token), at, how)
                cancelled_or_done(outcome, where)
                held = past.get_seq_length()
                assert held == len(past.tokens) and held in (17, 18), f"{where}: {held}"
                if held == 17:  # not fed: feed it now
                    await adapter.decode(past, token)
                after = int((await adapter.decode(past, 7)).argmax())
                await adapter.commit_decoded(hit, out, [*PROMPT, token, 7])
            seq = [*PROMPT, token, 7, after]
            assert await assert_cached_kv(adapter.cache, llama, seq, [*chunks_of(setup), 1, 1]) \
                == 16, where
            await settled(adapter.cache, where)
        return outcome

    for at in (await counted(run))[1 if how != "task" else 0:]:
        await run(at)


@pytest.mark.parametrize("how", ["scope", "timeout"])
@pytest.mark.parametrize("setup", ["device", "busy"])
async def test_commit_decoded_cancelled_anywhere_by_scope_or_timeout_then_called_again(
        llama: PreTrainedModel, setup: str, how: How) -> None:
    """`commit_decoded` cancelled at each await point by a cancel scope or a timeout (with
    write-throughs queued: also after its commit), then called again with more tokens: it
    commits, the cache serves exactly the model's KV, nothing stays leased.
    (``Task.cancel`` is swept in tests/test_hf_misuse_review.py.)"""
    async def run(at: int | None) -> Outcome:
        where = f"{setup}, {how} cancel at {at}"
        async with hf_world(llama, setup) as adapter:
            async with adapter.cache.fetch(PROMPT) as hit:
                out = await adapter.prefill(hit, PROMPT)
                seq, token = [*PROMPT], int(out.logits[0, -1].argmax())
                for _ in range(6):
                    seq.append(token)
                    token = int((await adapter.decode(out.past_key_values, token)).argmax())
                outcome = await run_cancelled_at(
                    adapter.commit_decoded(hit, out, seq[:20]), at, how)
                cancelled_or_done(outcome, where)
                await adapter.commit_decoded(hit, out, seq)
                assert hit.num_cached_tokens == 20, where
            chunks = [*chunks_of(setup), 1, 1, 1, 1, 1, 1]
            assert await assert_cached_kv(adapter.cache, llama, seq, chunks) == 20, where
            await settled(adapter.cache, where)
        return outcome

    for at in (await counted(run))[1:]:
        await run(at)


# ------------------------------------------------------------------------------ the engine

ENGINE_MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                "num_kv_heads": 2}
ASK = [(11 * 7919 + i * 31) % 512 for i in range(21)]  # five pages of 4 and one token
GREEDY = SamplingParams(max_tokens=5)


@pytest.fixture(scope="module")
def engine_model() -> PreTrainedModel:
    return tiny_llama(seed=5, **ENGINE_MODEL)


def engine_of(model: PreTrainedModel, *, use_cache: bool = True) -> Engine:
    return Engine(model, ByteTokenizer(), EngineConfig(
        page_size=4, device_tokens=256, host_tokens=1024, use_cache=use_cache,
        namespace="sweep", max_running=2,
        cache_options={"write_policy": "write_through", "load_back_threshold": 0}))


async def generated(eng: Engine, prompt: list[int], params: SamplingParams = GREEDY,
                    ) -> list[int]:
    async with contextlib.aclosing(eng.generate(prompt, params, Usage(len(prompt)))) as gen:
        return [token async for token in gen]


@pytest.fixture(scope="module")
def no_cache_answers(engine_model: PreTrainedModel) -> dict[str, list[int]]:
    """What an engine with no cache generates for `ASK`, and for a next turn quoting it."""
    async def answers() -> dict[str, list[int]]:
        async with engine_of(engine_model, use_cache=False) as eng:
            first = await generated(eng, ASK)
            turn = [*ASK, *first, 9, 8, 7]
            return {"ask": first, "turn": turn, "next": await generated(eng, turn)}
    return asyncio.run(answers())


async def engine_left_clean(eng: Engine, want: dict[str, list[int]], where: str) -> None:
    """Nothing running, waiting or leased; the cache's invariants hold; the next requests
    (the same prompt again, a turn quoting its answer) generate what a no-cache engine
    generates."""
    assert eng.metrics.running == 0 and eng.metrics.waiting == 0, f"{where}: {eng.metrics}"
    assert eng._admission.value == eng.config.max_running, f"{where}: a turn kept"
    assert eng.cache is not None
    await settled(eng.cache, where)
    assert not eng.cache._pins, f"{where}: pins left"
    assert await generated(eng, ASK) == want["ask"], f"{where}: another answer"
    assert await generated(eng, want["turn"]) == want["next"], f"{where}: another next turn"
    await settled(eng.cache, where)


@pytest.mark.parametrize("how", ["task", "scope", "timeout"])
@pytest.mark.parametrize("cached", [False, True], ids=["cold", "warm"])
async def test_generate_cancelled_anywhere_leaves_the_engine_clean(
        engine_model: PreTrainedModel, no_cache_answers: dict[str, list[int]], cached: bool,
        how: How) -> None:
    """`Engine.generate` consumed whole, cancelled at each await point (its prompt cold, or
    its first pages cached and pushed to L2): nothing leaks, and the next requests generate
    what a no-cache engine does."""
    async def run(at: int | None) -> Outcome:
        where = f"{'warm' if cached else 'cold'}, {how} cancel at {at}"
        async with engine_of(engine_model) as eng:
            assert eng.cache is not None
            if cached:
                await generated(eng, ASK[:12], SamplingParams(max_tokens=1))
                await eng.cache.drain()
                eng.cache.free(await eng.cache.allocate(eng.cache.device_pool.num_slots))
            outcome = await run_cancelled_at(generated(eng, ASK), at, how)
            cancelled_or_done(outcome, where)
            await engine_left_clean(eng, no_cache_answers, where)
        return outcome

    for at in (await counted(run))[1 if how != "task" else 0:]:
        await run(at)


async def test_generate_closed_after_each_token_leaves_the_engine_clean(
        engine_model: PreTrainedModel, no_cache_answers: dict[str, list[int]]) -> None:
    """A streamed generation whose consumer stops after each of its tokens (``aclose`` of
    the generator, as a handler does when its client goes away): it yielded the no-cache
    engine's tokens so far, nothing leaks, and the next requests are exact."""
    for stop in range(GREEDY.max_tokens + 1):
        where = f"closed after {stop} tokens"
        async with engine_of(engine_model) as eng:
            gen = eng.generate(ASK, GREEDY, Usage(len(ASK)))
            got = [await anext(gen) for _ in range(stop)]
            await gen.aclose()
            assert got == no_cache_answers["ask"][:stop], where
            await engine_left_clean(eng, no_cache_answers, where)


# ------------------------------------------------------------------------------ the backends

def backend_of(kind: str, where: str) -> MemoryBackend | FileBackend | RedisBackend:
    """A backend of `kind` over the store named `where` (a directory, a key prefix), in
    small batches (so its calls suspend often)."""
    if kind == "memory":
        return MemoryBackend(FMT)
    if kind == "file":
        return FileBackend(where, FMT, max_concurrency=2, refresh_interval=0)
    return RedisBackend(shared_server().url(), FMT, key_prefix=where, max_batch=2,
                        inline_bytes=0)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiohicache-file")]


async def redis_clients() -> int:
    async with Redis.from_url(shared_server().url()) as raw:
        return len(await raw.client_list()) - 1  # not this one


@pytest.mark.parametrize("how", ["task", "scope", "timeout", "steps"])
@pytest.mark.parametrize("op", ["set_from", "get_into", "exists", "delete", "aclose"])
@pytest.mark.parametrize("kind", ["memory", "file", "redis"])
async def test_backend_call_cancelled_anywhere_leaves_pages_whole_and_nothing_open(
        kind: str, op: str, how: How, tmp_path: Path) -> None:
    """A backend's public coroutine cancelled at each await point: no buffer is written
    after the call ended; every page reads back as written or misses, on the same instance
    and on a second one over the same store (files: a new instance reading the journals;
    Redis: a new client); once closed, no file, I/O thread or connection is left open.

    (`FileBackend.aclose` ran its steps under an anyio shield, which stops no
    ``Task.cancel``: cancelled while it sealed its segments, it skipped the rest, and its
    I/O threads ran on and its segment files stayed open.)"""
    stores = iter(range(10_000))

    async def run(at: int | None) -> Outcome:
        where = f"{kind} {op}, {how} cancel at {at}"
        name = str(tmp_path / f"l3-{next(stores)}") if kind == "file" else \
            f"sweep:{os.urandom(6).hex()}:"
        clients = await redis_clients() if kind == "redis" else 0
        fds, threads = open_fds(), set(io_threads())
        backend = backend_of(kind, name)
        async with backend:
            outcome = await cancel_and_check(backend, op, at, how, where, settle=0.05)
        if kind != "memory":
            async with backend_of(kind, name) as second:
                await assert_pages_whole_or_missed(second, op, where)
                assert second.stats().extra.get("torn_entries", 0) == 0, where
                if kind == "redis":
                    await second.delete([*OLD, *NEW])
        assert set(io_threads()) <= threads, f"{where}: I/O threads left: {io_threads()}"
        assert open_fds() <= fds, f"{where}: files left open"
        if kind == "redis":
            assert await redis_clients() <= clients, f"{where}: connections left open"
        return outcome

    for at in (await counted(run))[1 if how != "task" else 0:]:
        await run(at)
