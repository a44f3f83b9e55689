"""Replay a request trace through a real `HiCache` and report what each tier served.

Every request runs the path a serving engine runs: ``fetch`` (match L1/L2, load back the L2
part), wait for the loaded layers, ``allocate`` slots for the tokens that must be computed,
``commit`` them (write-through per policy). No KV is computed: the bytes in the pools are
whatever the pages held, and every copy between tiers is real. Nothing is simulated.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from .._lagprobe import LoopLagProbe, idle_floor, quiet_runtime
from .._validate import check_choice, check_int, check_number
from ..api import HiCache
from ..config import HiCacheConfig, KVSpec
from ..errors import CapacityError, ConfigError
from ..radix import Belady
from ._result import ReplayResult, Timing, make_result
from ._units import parse_capacity, scaled_spec
from .belady import FutureUses
from .traces import Request

__all__ = ("EVICTIONS", "MODELS", "ReplayConfig", "ReplayResult", "eviction_tiers",
           "parse_capacity", "replay", "scaled_spec")

EVICTIONS = ("lru", "lfu", "arc", "opt")
"""Eviction policies a replay can use: the cache's online ones, and ``opt`` (Belady's MIN,
which needs the trace's future, so only a replay has it)."""

MODELS: dict[str, KVSpec] = {
    "llama3-8b": KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16"),
    "llama3-70b": KVSpec.mha(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bf16"),
    "qwen2.5-7b": KVSpec.mha(num_layers=28, num_kv_heads=4, head_dim=128, dtype="bf16"),
    "deepseek-v3": KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, dtype="bf16"),
    "tiny": KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=16, dtype="fp16"),
}
"""Model presets: the KV of one token on one tensor-parallel rank (TP = 1)."""

TimeMode = Literal["fast", "timestamps"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """How to replay: the cache to build and how to pace the trace."""

    spec: KVSpec = MODELS["llama3-8b"]
    """The model's KV per token, before `kv_scale`."""
    kv_scale: int = 1
    """Divide bytes per token by this (see `scaled_spec`)."""
    device_tokens: int = 1_000_000
    """L1 capacity in tokens (rounded down to pages)."""
    host_tokens: int = 4_000_000
    """L2 capacity in tokens; 0 replays a single tier."""
    page_size: int = 16
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = \
        "write_through"
    eviction: str = "lru"
    """A policy of `EVICTIONS` for both tiers, or ``"L1:L2"`` (``"arc:lru"``) one per tier.
    ``opt`` needs a sequential replay (``fast``, concurrency 1)."""
    host_layout: Literal["layer_first", "page_first"] = "page_first"
    time_mode: TimeMode = "fast"
    """``fast``: as fast as possible; ``timestamps``: honour arrival times / `speedup`."""
    speedup: float = 1.0
    concurrency: int = 1
    """Requests in flight at once with ``fast`` (1: sequential); with ``timestamps`` a cap on
    them, 1 meaning none (each request starts at its arrival, whatever is still running)."""
    storage: str | None = None
    """L3: None, ``"tmp"`` (a file store in a temporary directory, removed afterwards) or a
    storage URL (``file:///dir``, ``redis://host:port/0``, ``memory://``)."""
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "wait_complete"
    settle: bool = True
    """With ``fast`` and concurrency 1: wait for each request's copies to settle before the
    next starts, so a replay gives the same numbers every run. Off, copies overlap the next
    requests as in a server, and which pages are still in flight at an eviction varies."""

    def __post_init__(self) -> None:
        check_choice("time_mode", self.time_mode, ("fast", "timestamps"))
        check_number("speedup", self.speedup, low=0, low_open=True)
        check_int("concurrency", self.concurrency, low=1)
        check_int("page_size", self.page_size, low=1, high=256)
        check_int("device_tokens", self.device_tokens, low=0)
        check_int("host_tokens", self.host_tokens, low=0)
        if self.device_tokens < self.page_size:
            raise ConfigError(f"device_tokens: {self.device_tokens} is less than one page "
                              f"({self.page_size} tokens)")
        if 0 < self.host_tokens < self.page_size:
            # NOTE: rounded down to no page: a single tier, its L3 unused, unsaid
            raise ConfigError(f"host_tokens: {self.host_tokens} is less than one page "
                              f"({self.page_size} tokens); 0 for no L2")
        if self.storage is not None and self.host_tokens == 0:  # "tmp" is made only to run
            raise ConfigError("storage: L3 pages are read into L2 and written from it, and "
                              "host_tokens 0 leaves no L2; give L2 tokens or no storage")
        if "opt" in eviction_tiers(self.eviction) and (
                self.time_mode != "fast" or self.concurrency != 1):
            raise ConfigError("eviction: 'opt' follows the trace request by request: it needs "
                              "time_mode 'fast' and concurrency 1")
        if not isinstance(self.spec, KVSpec):
            raise ConfigError(f"spec: must be a KVSpec, got {type(self.spec).__name__}")
        # NOTE: the cache's config, made now: a bad policy, layout or L3 URL was an error
        # only once the replay ran (a temporary L3 made first)
        self.cache_config(None if isinstance(self.storage, str) and self.storage == "tmp"
                          else self.storage)

    def cache_config(self, storage: str | None = None, *,
                     namespace: str = "default") -> HiCacheConfig:
        return HiCacheConfig(
            spec=scaled_spec(self.spec, self.kv_scale), page_size=self.page_size,
            device_pages=self.device_tokens // self.page_size,
            host_pages=self.host_tokens // self.page_size, write_policy=self.write_policy,
            eviction=_online(eviction_tiers(self.eviction)), host_layout=self.host_layout,
            storage=storage, prefetch_policy=self.prefetch_policy, namespace=namespace)


def eviction_tiers(text: str) -> tuple[str, str]:
    """``"arc"`` -> ``("arc", "arc")``; ``"arc:lru"`` -> ``("arc", "lru")`` (L1, L2).

    Raises:
        ConfigError: not one or two names of `EVICTIONS`.
    """
    names = text.split(":") if isinstance(text, str) else []
    if len(names) not in (1, 2) or not all(n in EVICTIONS for n in names):
        raise ConfigError(f"eviction: expected one of {', '.join(EVICTIONS)} or two of them "
                          f"as L1:L2, got {text!r}")
    return (names[0], names[-1])


def _online(tiers: tuple[str, str]) -> Any:
    """The cache's own eviction setting: ``opt`` tiers start as LRU and get `Belady` before
    the first request."""
    device, host = ("lru" if name == "opt" else name for name in tiers)
    return device if device == host else (device, host)


Progress = Callable[[int], None]
Serve = Callable[[Request], Awaitable[None]]


Requests = Sequence[Request] | AsyncIterable[Request]
"""A trace: a list, or a stream read as the replay proceeds (`traces.stream_trace`)."""


async def replay(config: ReplayConfig, requests: Requests, *,
                 progress: Progress | None = None) -> ReplayResult:
    """Replay `requests` through a fresh `HiCache` built from `config`.

    `requests` is a list, or an async iterable (`traces.stream_trace`) that the replay reads
    as it goes: with ``timestamps`` a request is read shortly before it is due, so a long
    trace is never loaded whole. `progress(n)` is called as requests complete.

    With ``opt`` eviction the requests are rewritten first (`FutureUses`): hit ratios are
    those of the trace, token ids are not.

    The cache keys its L3 pages under a namespace of this replay's own, so a replay starts
    with an empty L3 even when `config.storage` is a store that outlives it (a file or Redis
    URL): token ids are names within one trace (and one renaming), and a sweep's rows must
    not be served what the replays before them stored. Its pages stay in such a store.

    Raises:
        ConfigError: ``opt`` with a stream (it needs the whole trace), or a bad trace line.

    Cancellation: in-flight requests are cancelled (they unpin) and the cache is closed.
    """
    future = None
    if "opt" in eviction_tiers(config.eviction):
        if not isinstance(requests, Sequence):
            raise ConfigError("eviction: 'opt' needs the whole trace, not a stream")
        future = FutureUses(requests, config.page_size)
        requests = future.requests
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_runtime())
        storage = config.storage
        if storage == "tmp":
            storage = "file://" + stack.enter_context(
                tempfile.TemporaryDirectory(prefix="aiohicache-l3-"))
        # NOTE: a fresh namespace: the L3 keys of what earlier replays stored never match
        namespace = f"aiohicache-replay-{secrets.token_hex(8)}"
        return await _replay(config, config.cache_config(storage, namespace=namespace),
                             requests, progress, future)


def _use_belady(cache: HiCache, config: ReplayConfig, future: FutureUses) -> None:
    """Give the ``opt`` tiers Belady's policy, keyed by the trace's future."""
    device, host = (Belady(future.next_use, config.page_size) if name == "opt" else None
                    for name in eviction_tiers(config.eviction))
    cache.tree.set_policies(device=device, host=host)


class _Server:
    """Serves one request at a time as an engine would, and counts what it saw."""

    __slots__ = ("cache", "future", "not_inserted", "order", "progress")

    def __init__(self, cache: HiCache, progress: Progress | None,
                 future: FutureUses | None) -> None:
        self.cache, self.progress, self.future = cache, progress, future
        self.not_inserted = 0
        self.order = itertools.count()

    async def __call__(self, request: Request) -> None:
        """Cancellation: the request's fetch context unpins; nothing is counted."""
        if self.future is not None:  # sequential (ReplayConfig checks): in order
            self.future.now = next(self.order)
        if not await _serve(self.cache, request):
            self.not_inserted += 1
        if self.progress is not None:
            self.progress(1)


async def _replay(config: ReplayConfig, cache_config: HiCacheConfig, requests: Requests,
                  progress: Progress | None, future: FutureUses | None = None) -> ReplayResult:
    async with HiCache(cache_config) as cache, LoopLagProbe() as probe:
        if future is not None:
            _use_belady(cache, config, future)
        server = _Server(cache, progress, future)
        start = time.perf_counter()
        await _drive(server, requests, config)
        await cache.drain()
        wall = time.perf_counter() - start
        stats = cache.stats()
        lag = probe.summary()
    cache.check_invariants()
    floor = await idle_floor(min(1.0, max(0.1, wall / 10)))
    return make_result(config, cache_config, stats, Timing(wall, lag, floor),
                   server.not_inserted)


async def _drive(serve: _Server, requests: Requests, config: ReplayConfig) -> None:
    """Run every request at the pace `config` says."""
    if config.time_mode == "fast" and config.concurrency == 1 and config.settle:
        async for request in _each(requests):
            await serve(request)
            await serve.cache.drain()
    elif config.time_mode == "fast":
        await _run_fast(serve, requests, config.concurrency)
    else:
        await _run_timed(serve, requests, config)


async def _serve(cache: HiCache, request: Request) -> bool:
    """One request, as an engine runs it. Returns False if its new KV could not be cached.

    Cancellation: the fetch context unpins and frees its lease.
    """
    tokens = request.tokens()
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        new = len(tokens) - hit.num_cached_tokens
        if new == 0:
            return True
        try:
            slots = await hit.allocate(new)
        except CapacityError:
            return False  # larger than what is not pinned: computed but not cached
        await hit.commit(tokens, slots)
    return True


async def _each(requests: Requests) -> AsyncIterator[Request]:
    """The requests of a list or a stream, in order."""
    if isinstance(requests, Sequence):
        for request in requests:
            yield request
    else:
        async for request in requests:
            yield request


async def _run_fast(serve: Serve, requests: Requests, concurrency: int) -> None:
    limit = anyio.Semaphore(concurrency)
    async with _reading() as tg:
        async for request in _each(requests):
            await limit.acquire()
            tg.start_soon(_release_after, serve, request, limit)


async def _run_timed(serve: Serve, requests: Requests, config: ReplayConfig) -> None:
    """Start each request at its arrival / speedup (a list is sorted by arrival first; a
    stream is in arrival order, `stream_mooncake` checks it), counted from when the first
    request is read.

    NOTE: not from before it: a trace loaded whole first (250-340 ms for the shared
    kv-cache-tester file) was taken out of the first arrivals, which came as one burst."""
    if isinstance(requests, Sequence):
        requests = sorted(requests, key=lambda r: r.arrival)
    t0: float | None = None
    limit = anyio.Semaphore(config.concurrency if config.concurrency > 1 else 1_000_000)
    async with _reading() as tg:
        async for request in _each(requests):
            t0 = anyio.current_time() if t0 is None else t0
            delay = t0 + request.arrival / config.speedup - anyio.current_time()
            if delay > 0:
                await anyio.sleep(delay)
            await limit.acquire()
            tg.start_soon(_release_after, serve, request, limit)


@contextlib.asynccontextmanager
async def _reading() -> AsyncIterator[TaskGroup]:
    """A task group for the requests, whose body reads the trace: a bad trace line
    (`ConfigError`, raised in the body) cancels the requests and is raised as itself, not
    wrapped in an exception group as a failed request is."""
    error: ConfigError | None = None
    async with anyio.create_task_group() as tg:
        try:
            yield tg
        except ConfigError as exc:
            error = exc
            tg.cancel_scope.cancel()
    if error is not None:
        raise error


async def _release_after(serve: Serve, request: Request, limit: anyio.Semaphore) -> None:
    try:
        await serve(request)
    finally:
        limit.release()


def sweep_configs(base: ReplayConfig, device_tokens: Sequence[int],
                  evictions: Sequence[str] = ()) -> list[ReplayConfig]:
    """One config per eviction policy (`base`'s if none) and L1 capacity, policy-major;
    everything else as `base`.

    Raises:
        ConfigError: a policy is invalid (see `ReplayConfig.eviction`).
    """
    return [replace(base, eviction=e, device_tokens=n)
            for e in evictions or [base.eviction] for n in device_tokens]
