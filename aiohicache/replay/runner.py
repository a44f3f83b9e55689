"""Replay a request trace through a real `HiCache` and report what each tier served.

Every request runs the path a serving engine runs: ``fetch`` (match L1/L2, load back the L2
part), wait for the loaded layers, ``allocate`` slots for the tokens that must be computed,
``commit`` them (write-through per policy). No KV is computed: the bytes in the pools are
whatever the pages held, and every copy between tiers is real. Nothing is simulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import anyio

from .._lagprobe import LagSummary, LoopLagProbe, idle_floor, quiet_runtime
from ..api import HiCache
from ..config import HiCacheConfig, KVSpec
from ..errors import CapacityError, ConfigError
from ..radix import Belady
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


def scaled_spec(spec: KVSpec, kv_scale: int) -> KVSpec:
    """`spec` with bytes per token divided by `kv_scale`.

    Lets a laptop replay production capacities in tokens: tier sizes in tokens, hit ratios
    and page counts stay those of the model; bytes shrink by `kv_scale`. Layers go first
    (fewer, wider copies stay efficient), then the row narrows; at least 16 bytes per row
    are kept where the scale allows.

    Raises:
        ConfigError: `kv_scale` does not divide layers x row width.
    """
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, int) or kv_scale < 1:
        raise ConfigError(f"kv_scale: must be a positive int, got {kv_scale!r}")
    if kv_scale == 1:
        return spec
    layers, width = spec.num_layers, spec.row_elems
    if (layers * width) % kv_scale:
        raise ConfigError(f"kv_scale: {kv_scale} does not divide layers x row width "
                          f"({layers} x {width}) of {spec.fingerprint()}")
    layer_div = math.gcd(layers, kv_scale)
    row_div = kv_scale // layer_div
    if width % row_div:
        raise ConfigError(f"kv_scale: {kv_scale} cannot be split between {layers} layers and "
                          f"a row of {width}")
    layers, width = layers // layer_div, width // row_div
    if spec.kind == "mha":
        return KVSpec.mha(num_layers=layers, num_kv_heads=1, head_dim=width, dtype=spec.dtype)
    return KVSpec.mla(num_layers=layers, kv_lora_rank=width, rope_dim=0, dtype=spec.dtype)


_TOKENS = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*(tok|tokens)?\s*$")
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?[bB]\s*$")
_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_capacity(text: str, *, bytes_per_token: int, field_name: str) -> int:
    """Tokens from ``"512k"``, ``"10.24M"``, ``"2000"`` (tokens) or ``"4GiB"``, ``"1.5GB"``.

    Raises:
        ConfigError: the text is neither form.
    """
    m = _TOKENS.match(text)
    if m:
        return int(float(m.group(1)) * _SI[m.group(2).lower()])
    m = _BYTES.match(text)
    if m:
        unit = (m.group(2) or "").lower()
        scale = _IEC.get(unit) or _SI[unit]
        return int(float(m.group(1)) * scale) // bytes_per_token
    raise ConfigError(f"{field_name}: {text!r} is neither tokens (512k, 10M) nor bytes (4GiB)")


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
    """Requests in flight at once (``fast``); a cap on it (``timestamps``). 1 = sequential."""
    storage: str | None = None
    """L3: None, ``"tmp"`` (a file store in a temporary directory, removed afterwards) or a
    storage URL (``file:///dir``, ``redis://host:port/0``, ``memory://``)."""
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "wait_complete"
    settle: bool = True
    """With ``fast`` and concurrency 1: wait for each request's copies to settle before the
    next starts, so a replay gives the same numbers every run. Off, copies overlap the next
    requests as in a server, and which pages are still in flight at an eviction varies."""

    def __post_init__(self) -> None:
        if self.time_mode not in ("fast", "timestamps"):
            raise ConfigError(f"time_mode: must be 'fast' or 'timestamps', got {self.time_mode!r}")
        if not (isinstance(self.speedup, int | float) and self.speedup > 0):
            raise ConfigError(f"speedup: must be > 0, got {self.speedup!r}")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or \
                self.concurrency < 1:
            raise ConfigError(f"concurrency: must be a positive int, got {self.concurrency!r}")
        for name in ("device_tokens", "host_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}: must be an int >= 0, got {value!r}")
        if self.device_tokens < self.page_size:
            raise ConfigError(f"device_tokens: {self.device_tokens} is less than one page "
                              f"({self.page_size} tokens)")
        if "opt" in eviction_tiers(self.eviction) and (
                self.time_mode != "fast" or self.concurrency != 1):
            raise ConfigError("eviction: 'opt' follows the trace request by request: it needs "
                              "time_mode 'fast' and concurrency 1")
        scaled_spec(self.spec, self.kv_scale)

    def cache_config(self, storage: str | None = None) -> HiCacheConfig:
        return HiCacheConfig(
            spec=scaled_spec(self.spec, self.kv_scale), page_size=self.page_size,
            device_pages=self.device_tokens // self.page_size,
            host_pages=self.host_tokens // self.page_size, write_policy=self.write_policy,
            eviction=_online(eviction_tiers(self.eviction)), host_layout=self.host_layout,
            storage=storage, prefetch_policy=self.prefetch_policy)


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


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay measured. Token counts are prompt tokens.

    ``hit_ratio`` = (L1 + L2 + L3 tokens) / prompt tokens, token-weighted over all requests,
    no warm-up excluded; only whole cached pages count.
    """

    requests: int
    prompt_tokens: int
    l1_tokens: int
    l2_tokens: int
    l3_tokens: int
    recomputed_tokens: int
    not_inserted: int
    """Requests whose new KV did not fit beside everything pinned (served, not cached)."""
    bytes_h2d: int
    bytes_d2h: int
    bytes_l3_read: int
    bytes_l3_written: int
    model_bytes_h2d: int
    """`bytes_h2d` times `kv_scale`: what the unscaled model would move."""
    model_bytes_d2h: int
    wall_seconds: float
    lag: LagSummary
    device_tokens: int
    host_tokens: int
    storage: str | None
    bytes_per_token: int
    kv_scale: int
    extra: dict[str, float] = field(default_factory=dict)
    eviction: str = "lru"
    lag_floor: LagSummary | None = None
    """The same probe on the idle loop right after the replay (`idle_floor`): the machine's
    share of `lag`."""

    @property
    def hit_ratio(self) -> float:
        hits = self.l1_tokens + self.l2_tokens + self.l3_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def storage_gbps(self) -> float:
        """Bytes moved between L2 and L3 (both directions) per second of wall time."""
        return (self.bytes_l3_read + self.bytes_l3_written) / self.wall_seconds / 1e9 \
            if self.wall_seconds else 0.0

    @property
    def transfer_gbps(self) -> float:
        """Bytes moved between L1 and L2 (both directions) per second of wall time."""
        return (self.bytes_h2d + self.bytes_d2h) / self.wall_seconds / 1e9 \
            if self.wall_seconds else 0.0


Progress = Callable[[int], None]


async def replay(config: ReplayConfig, requests: Sequence[Request], *,
                 progress: Progress | None = None) -> ReplayResult:
    """Replay `requests` through a fresh `HiCache` built from `config`.

    `progress(n)` is called as requests complete.

    With ``opt`` eviction the requests are rewritten first (`FutureUses`): hit ratios are
    those of the trace, token ids are not.

    Cancellation: in-flight requests are cancelled (they unpin) and the cache is closed.
    """
    future = None
    if "opt" in eviction_tiers(config.eviction):
        future = FutureUses(requests, config.page_size)
        requests = future.requests
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_runtime())
        storage = config.storage
        if storage == "tmp":
            storage = "file://" + stack.enter_context(
                tempfile.TemporaryDirectory(prefix="aiohicache-l3-"))
        return await _replay(config, config.cache_config(storage), requests, progress,
                             future)


def _use_belady(cache: HiCache, config: ReplayConfig, future: FutureUses) -> None:
    """Give the ``opt`` tiers Belady's policy, keyed by the trace's future."""
    device, host = (Belady(future.next_use, config.page_size) if name == "opt" else None
                    for name in eviction_tiers(config.eviction))
    cache.tree.set_policies(device=device, host=host)


async def _replay(config: ReplayConfig, cache_config: HiCacheConfig,
                  requests: Sequence[Request], progress: Progress | None,
                  future: FutureUses | None = None) -> ReplayResult:
    not_inserted = 0
    order = itertools.count()

    async def serve(request: Request) -> None:
        nonlocal not_inserted
        if future is not None:  # sequential (ReplayConfig checks): requests start in order
            future.now = next(order)
        if not await _serve(cache, request):
            not_inserted += 1
        if progress is not None:
            progress(1)

    async with HiCache(cache_config) as cache, LoopLagProbe() as probe:
        if future is not None:
            _use_belady(cache, config, future)
        start = time.perf_counter()
        if config.time_mode == "fast" and config.concurrency == 1 and config.settle:
            for request in requests:
                await serve(request)
                await cache.drain()
        elif config.time_mode == "fast":
            await _run_fast(serve, requests, config.concurrency)
        else:
            await _run_timed(serve, requests, config)
        await cache.drain()
        wall = time.perf_counter() - start
        stats = cache.stats()
        lag = probe.summary()
    cache.check_invariants()
    floor = await idle_floor(min(1.0, max(0.1, wall / 10)))
    return ReplayResult(
        requests=stats.requests, prompt_tokens=stats.prompt_tokens,
        l1_tokens=stats.device_hit_tokens, l2_tokens=stats.host_hit_tokens,
        l3_tokens=stats.storage_hit_tokens,
        bytes_l3_read=(stats.storage.prefetched_pages if stats.storage else 0)
        * cache_config.page_bytes,
        bytes_l3_written=(stats.storage.backed_up_pages if stats.storage else 0)
        * cache_config.page_bytes,
        recomputed_tokens=stats.miss_tokens, not_inserted=not_inserted,
        bytes_h2d=stats.loaded_bytes, bytes_d2h=stats.written_bytes,
        model_bytes_h2d=stats.loaded_bytes * config.kv_scale,
        model_bytes_d2h=stats.written_bytes * config.kv_scale, wall_seconds=wall,
        lag=lag, device_tokens=cache_config.device_pages * config.page_size,
        host_tokens=cache_config.host_capacity_pages * config.page_size,
        storage=config.storage,
        bytes_per_token=cache_config.spec.bytes_per_token, kv_scale=config.kv_scale,
        eviction=config.eviction, lag_floor=floor)


async def _serve(cache: HiCache, request: Request) -> bool:
    """One request, as an engine runs it. Returns False if its new KV could not be cached."""
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


async def _run_fast(serve: Callable[[Request], Any], requests: Sequence[Request],
                    concurrency: int) -> None:
    limit = anyio.Semaphore(concurrency)
    async with anyio.create_task_group() as tg:
        for request in requests:
            await limit.acquire()
            tg.start_soon(_release_after, serve, request, limit)


async def _run_timed(serve: Callable[[Request], Any], requests: Sequence[Request],
                     config: ReplayConfig) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    limit = anyio.Semaphore(config.concurrency if config.concurrency > 1 else 1_000_000)
    async with anyio.create_task_group() as tg:
        for request in sorted(requests, key=lambda r: r.arrival):
            delay = t0 + request.arrival / config.speedup - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await limit.acquire()
            tg.start_soon(_release_after, serve, request, limit)


async def _release_after(serve: Callable[[Request], Any], request: Request,
                         limit: anyio.Semaphore) -> None:
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
