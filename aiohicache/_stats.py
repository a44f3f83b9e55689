"""`CacheStats`: the snapshot `HiCache.stats()` returns, and the counters behind it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ._core import Core

__all__ = ("CacheStats", "Counters", "StorageStats", "TPStats", "snapshot")


class _ByName:
    """Read access by field name (``stats.storage["errors"]``): these groups were plain dicts
    before they were typed, and callers that index them keep working."""

    __slots__ = ()

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self.keys() else default

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.keys()}


@dataclass(frozen=True, slots=True)
class StorageStats(_ByName):
    """The L3 tier's counters (pages unless named) and state."""

    prefetches: int
    """Prefetches from L3 that inserted pages."""
    prefetched_pages: int
    prefetch_misses: int
    """Prefetches L3 had too few pages for."""
    negative_hits: int
    """Prefetches skipped because L3 recently did not have the prefix."""
    backed_up_pages: int
    backup_failed_pages: int
    """Pages L3 refused or failed to store."""
    backups_skipped: int
    """Pages of backups a close cancelled before L3 took them (not failures)."""
    errors: int
    """L3 operations that failed (each one a miss)."""
    bypassed: int
    """L3 operations skipped while the breaker was open."""
    breaker: str
    """``closed``, ``open`` or ``half_open``."""
    corrupt: int
    """Objects the backend rejected by their checksum or key (each one a miss)."""
    capacity_bytes: int | None = None
    """The backend's byte budget, when it has one and reports it."""
    used_bytes: int | None = None
    """Bytes the backend holds, when it reports them."""
    evicted_pages: int | None = None
    """Pages the backend evicted for its byte budget (file and memory stores); None: not
    known (Redis evicts on its own and does not say which: see `server_evicted_keys`)."""
    server_evicted_keys: int | None = None
    """Redis only: the server's ``evicted_keys`` (INFO stats, summed over a cluster's
    primaries) as last looked at. Server-wide: every database and client's keys, not only
    this cache's pages; None: not Redis, or not seen."""


@dataclass(frozen=True, slots=True)
class TPStats(_ByName):
    """Consensus ticks of a tensor-parallel cache."""

    ticks: int
    tick_us_mean: float
    """Mean microseconds a tick spent in the collective (NaN before the first tick)."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache's counters; tokens unless a name says otherwise.

    The hit ratio of a workload is ``(device + host + storage hit tokens) / prompt_tokens``.
    """

    requests: int
    prompt_tokens: int
    device_hit_tokens: int
    """Prompt tokens already on the device (L1) when fetched."""
    host_hit_tokens: int
    """Prompt tokens loaded back from the host (L2), by this fetch or one it joined."""
    storage_hit_tokens: int
    """Prompt tokens prefetched from storage (L3) for this request, then loaded back."""
    miss_tokens: int
    """Prompt tokens the engine has to compute."""
    loaded_bytes: int
    written_bytes: int
    loads: int
    writes: int
    merged_loads: int
    merged_writes: int
    device_evicted_pages: int
    host_evicted_pages: int
    pending_loads: int
    pending_writes: int
    device_pages_used: int
    device_pages_free: int
    device_pages_leased: int
    host_pages_used: int
    host_pages_free: int
    num_nodes: int
    worker_restarts: int
    health: Literal["ok", "degraded", "failed"]
    storage: StorageStats | None = None
    """L3 counters (prefetched / backed-up pages, misses, errors, breaker state), if any."""
    tp: TPStats | None = None
    """Consensus ticks (count, mean µs in the collective) with ``tp_size > 1``."""

    @property
    def hit_ratio(self) -> float:
        hits = self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0


def snapshot(core: Core) -> CacheStats:
    """Read every counter of `core` into one frozen `CacheStats`."""
    c, t, ctl = core.counters, core.tree, core.controller
    tc = ctl.counters if ctl is not None else None
    dev, host = core.device_pool.allocator, core.host_pool.allocator
    return CacheStats(
        requests=c.requests, prompt_tokens=c.prompt_tokens,
        device_hit_tokens=c.device_hit_tokens, host_hit_tokens=c.host_hit_tokens,
        storage_hit_tokens=c.storage_hit_tokens,
        miss_tokens=(c.prompt_tokens - c.device_hit_tokens - c.host_hit_tokens
                     - c.storage_hit_tokens),
        loaded_bytes=tc.loaded_bytes if tc else 0, written_bytes=tc.written_bytes if tc else 0,
        loads=tc.loads if tc else 0, writes=tc.writes if tc else 0,
        merged_loads=tc.load_merges if tc else 0, merged_writes=tc.write_merges if tc else 0,
        device_evicted_pages=t.device_evicted_pages, host_evicted_pages=t.host_evicted_pages,
        pending_loads=ctl.pending_loads if ctl else 0,
        pending_writes=ctl.pending_writes if ctl else 0,
        device_pages_used=dev.num_used, device_pages_free=dev.num_free,
        device_pages_leased=core.leases.count, host_pages_used=host.num_used,
        host_pages_free=host.num_free, num_nodes=t.num_nodes,
        worker_restarts=tc.worker_restarts if tc else 0, health=health(core),
        storage=_storage_stats(core), tp=core.tp.stats() if core.tp else None)


def health(core: Core) -> Literal["ok", "degraded", "failed"]:
    ctl = core.controller
    if ctl is not None and ctl.failure is not None:
        return "failed"
    if (ctl is not None and ctl.counters.worker_restarts) or (
            core.storage is not None and core.storage.degraded):
        return "degraded"
    return "ok"


def _storage_stats(core: Core) -> StorageStats | None:
    storage = core.storage
    if storage is None:
        return None
    backend = storage.backend.stats()
    # NOTE: an eviction count the store does not know is None, never 0 ("none evicted")
    counted = getattr(backend, "counts_evictions", True)
    return StorageStats(**dataclasses.asdict(storage.counters),
                        breaker=storage.breaker.state.value, corrupt=backend.corrupt,
                        capacity_bytes=getattr(backend, "capacity_bytes", None),
                        used_bytes=getattr(backend, "used_bytes", None),
                        evicted_pages=getattr(backend, "evicted_pages", None) if counted
                        else None,
                        server_evicted_keys=getattr(backend, "server_evicted_keys", None))
