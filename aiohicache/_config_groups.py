"""The typed groups of `HiCacheConfig` that each component receives: `TransferConfig` for the
transfer controller, `StorageConfig` for the L3 tier, `TPConfig` for the consensus.

A group is a frozen value object validated on construction with the `_validate` helpers. Its
`FLAT` table names the flat `HiCacheConfig` field behind each of its fields: the table builds a
group from a flat config, flattens a group into one, and names the flat knob in every error, so
``TPConfig(rank=2, size=2)`` and ``HiCacheConfig(tp_rank=2, tp_size=2)`` fail with the same
``tp_rank: ...`` message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from ._validate import check_choice, check_int, check_number
from .errors import ConfigError

__all__ = ("StorageConfig", "TPConfig", "TransferConfig", "flatten", "group_of",
           "repr_hiding_credentials")

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
IOBackend = Literal["auto", "cpu", "kernel", "direct"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """How pages move between L1 and L2: engine, backpressure, write and load-back policy."""

    FLAT: ClassVar[dict[str, str]] = {
        "io_backend": "io_backend", "ctas": "transfer_ctas",
        "max_inflight_loads": "max_inflight_loads", "max_inflight_writes": "max_inflight_writes",
        "max_worker_restarts": "max_worker_restarts", "write_policy": "write_policy",
        "write_through_threshold": "write_through_threshold",
        "load_back_threshold": "load_back_threshold"}

    io_backend: IOBackend = "auto"
    ctas: int = 4
    max_inflight_loads: int = 64
    max_inflight_writes: int = 64
    max_worker_restarts: int = 3
    write_policy: WritePolicy = "write_through"
    write_through_threshold: int | None = None
    load_back_threshold: int = 0

    def __post_init__(self) -> None:
        n = self.FLAT
        check_choice(n["io_backend"], self.io_backend, ("auto", "cpu", "kernel", "direct"))
        check_int(n["ctas"], self.ctas, low=1, high=1024)
        check_int(n["max_inflight_loads"], self.max_inflight_loads, low=1)
        check_int(n["max_inflight_writes"], self.max_inflight_writes, low=1)
        check_int(n["max_worker_restarts"], self.max_worker_restarts, low=0)
        check_choice(n["write_policy"], self.write_policy,
                     ("write_through", "write_through_selective", "write_back"))
        if self.write_through_threshold is not None:
            check_int(n["write_through_threshold"], self.write_through_threshold, low=1)
        check_int(n["load_back_threshold"], self.load_back_threshold, low=0)

    @property
    def hit_threshold(self) -> int:
        """Hits after which a device node is written through to the host."""
        if self.write_through_threshold is not None:
            return self.write_through_threshold
        return 2 if self.write_policy == "write_through_selective" else 1


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    """The L3 tier: its backend, when to prefetch from it and back up to it, its breaker."""

    FLAT: ClassVar[dict[str, str]] = {
        "backend": "storage", "prefetch_policy": "prefetch_policy",
        "prefetch_threshold": "prefetch_threshold",
        "prefetch_timeout_base": "prefetch_timeout_base",
        "prefetch_timeout_per_1k_tokens": "prefetch_timeout_per_1k_tokens",
        "prefetch_timeout_max": "prefetch_timeout_max",
        "prefetch_host_fraction": "prefetch_host_fraction", "miss_ttl": "storage_miss_ttl",
        "miss_max_entries": "storage_miss_max_entries", "backup_threshold": "backup_threshold",
        "backup_max_inflight_bytes": "backup_max_inflight_bytes",
        "failures_to_open": "storage_failures_to_open", "cooldown": "storage_cooldown"}

    backend: object = None
    prefetch_policy: PrefetchPolicy = "timeout"
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_1k_tokens: float = 0.1
    prefetch_timeout_max: float = 30.0
    prefetch_host_fraction: float = 0.5
    miss_ttl: float = 5.0
    miss_max_entries: int = 4096
    backup_threshold: int = 1
    backup_max_inflight_bytes: int = 256 << 20
    failures_to_open: int = 5
    cooldown: float = 10.0

    def __repr__(self) -> str:
        return repr_hiding_credentials(self, "backend")

    def __post_init__(self) -> None:
        n = self.FLAT
        self._check_backend()
        check_choice(n["prefetch_policy"], self.prefetch_policy,
                     ("best_effort", "wait_complete", "timeout"))
        check_int(n["prefetch_threshold"], self.prefetch_threshold, low=0)
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_1k_tokens",
                     "prefetch_timeout_max", "miss_ttl", "cooldown"):
            check_number(n[name], getattr(self, name), low=0)
        check_number(n["prefetch_host_fraction"], self.prefetch_host_fraction, low=0,
                     high=1, low_open=True)
        check_int(n["backup_threshold"], self.backup_threshold, low=1)
        check_int(n["backup_max_inflight_bytes"], self.backup_max_inflight_bytes, low=1)
        check_int(n["failures_to_open"], self.failures_to_open, low=1)
        check_int(n["miss_max_entries"], self.miss_max_entries, low=0)

    def _check_backend(self) -> None:
        if isinstance(self.backend, str):
            from .storage.factory import check_url  # storage imports config: not at the top

            check_url(self.backend)
        elif self.backend is not None and not all(
                hasattr(self.backend, m) for m in ("exists", "get_into", "set_from", "aclose")):
            raise ConfigError("storage: must be None, a URL or a StorageBackend object")

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds a ``timeout``-policy fetch waits for an L3 prefetch of `num_tokens`."""
        return min(self.prefetch_timeout_max, self.prefetch_timeout_base
                   + self.prefetch_timeout_per_1k_tokens * num_tokens / 1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class TPConfig:
    """Tensor parallelism: this rank, the group size, and how the consensus tick waits."""

    FLAT: ClassVar[dict[str, str]] = {"rank": "tp_rank", "size": "tp_size",
                                      "timeout": "tp_timeout", "tick_interval": "tp_tick_interval"}

    rank: int = 0
    size: int = 1
    timeout: float = 60.0
    tick_interval: float = 0.002

    def __post_init__(self) -> None:
        check_int("tp_rank", self.rank, low=0)
        check_int("tp_size", self.size, low=1)
        if self.rank >= self.size:
            raise ConfigError(f"tp_rank: {self.rank} must be below tp_size {self.size}")
        check_number("tp_tick_interval", self.tick_interval, low=0)
        check_number("tp_timeout", self.timeout, low=0, low_open=True)


Group = TransferConfig | StorageConfig | TPConfig


def group_of(cls: type[Any], flat: object) -> Any:
    """Build the group `cls` from the flat fields of `flat` (a `HiCacheConfig`)."""
    return cls(**{name: getattr(flat, field) for name, field in cls.FLAT.items()})


def flatten(group: Group) -> dict[str, object]:
    """The flat `HiCacheConfig` keyword arguments that `group` stands for."""
    return {group.FLAT[f.name]: getattr(group, f.name) for f in fields(group)}


def repr_hiding_credentials(obj: Any, url_field: str) -> str:
    """The dataclass repr of `obj`, its `url_field` (a storage URL) without user, password
    or key passphrase (`shown_url`).

    NOTE: configs are what servers log: the generated repr showed the Redis password.
    """
    from .storage.factory import shown_url  # storage imports config: not at the top

    def shown(name: str, value: object) -> object:
        return shown_url(value) if name == url_field and isinstance(value, str) else value

    items = ", ".join(f"{f.name}={shown(f.name, getattr(obj, f.name))!r}"
                      for f in fields(obj) if f.repr)
    return f"{type(obj).__qualname__}({items})"
