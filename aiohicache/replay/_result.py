"""What a replay measured (`ReplayResult`), built from the cache's stats at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._lagprobe import LagSummary
from ..api import CacheStats
from ..config import HiCacheConfig
from ..storage.factory import shown_url

if TYPE_CHECKING:
    from .runner import ReplayConfig


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
    """The L3 as configured (``tmp``, a URL without its user and password), or None."""
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




@dataclass(frozen=True, slots=True)
class Timing:
    """Wall time of the replay, its loop lag and the idle loop's right after."""

    wall: float
    lag: LagSummary
    floor: LagSummary


def make_result(config: ReplayConfig, cache_config: HiCacheConfig, stats: CacheStats,
            timing: Timing, not_inserted: int) -> ReplayResult:
    page_bytes = cache_config.page_bytes
    return ReplayResult(
        requests=stats.requests, prompt_tokens=stats.prompt_tokens,
        l1_tokens=stats.device_hit_tokens, l2_tokens=stats.host_hit_tokens,
        l3_tokens=stats.storage_hit_tokens,
        bytes_l3_read=(stats.storage.prefetched_pages if stats.storage else 0) * page_bytes,
        bytes_l3_written=(stats.storage.backed_up_pages if stats.storage else 0) * page_bytes,
        recomputed_tokens=stats.miss_tokens, not_inserted=not_inserted,
        bytes_h2d=stats.loaded_bytes, bytes_d2h=stats.written_bytes,
        model_bytes_h2d=stats.loaded_bytes * config.kv_scale,
        model_bytes_d2h=stats.written_bytes * config.kv_scale, wall_seconds=timing.wall,
        lag=timing.lag, device_tokens=cache_config.device_pages * config.page_size,
        host_tokens=cache_config.host_capacity_pages * config.page_size,
        storage=None if config.storage is None else shown_url(config.storage),  # no password
        bytes_per_token=cache_config.spec.bytes_per_token, kv_scale=config.kv_scale,
        eviction=config.eviction, lag_floor=timing.floor)
