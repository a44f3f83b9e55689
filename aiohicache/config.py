"""Configuration value objects: the KV layout of a model (`KVSpec`) and the cache (`HiCacheConfig`).

Both are frozen, keyword-only dataclasses validated on construction; every invalid value raises
`ConfigError` with a message that starts with the name of the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ._config_groups import (
    IOBackend,
    PrefetchPolicy,
    StorageConfig,
    TPConfig,
    TransferConfig,
    WritePolicy,
    flatten,
    group_of,
    repr_hiding_credentials,
)
from ._validate import check_choice, check_int, check_number
from .errors import ConfigError

__all__ = ("HiCacheConfig", "KVSpec", "StorageConfig", "TPConfig", "TransferConfig",
           "parse_dtype")

HostLayout = Literal["layer_first", "page_first"]
Eviction = Literal["lru", "lfu", "arc"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def parse_dtype(value: str | torch.dtype, *, field_name: str = "dtype") -> torch.dtype:
    """Return the torch dtype named by `value` (a torch dtype, or a name such as ``"bf16"``).

    Raises:
        ConfigError: the dtype is not one KV caches are stored in.
    """
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise ConfigError(f"{field_name}: unsupported dtype {value}; use one of {sorted(_DTYPES)}")
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(f"{field_name}: unknown dtype {value!r}; use one of {sorted(_DTYPES)}")


def _positive_int(name: str, value: object, *, upper: int | None = None) -> None:
    check_int(name, value, low=1, high=upper)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVSpec:
    """The per-token KV layout of a model.

    Build it with `KVSpec.mha(...)` (K and V per layer, ``num_kv_heads x head_dim`` each) or
    `KVSpec.mla(...)` (one latent row per layer, ``kv_lora_rank + rope_dim`` wide).

    >>> KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16").bytes_per_token
    131072
    """

    kind: Literal["mha", "mla"]
    """``"mha"`` stores K and V; ``"mla"`` stores one compressed latent row."""
    num_layers: int
    """Number of attention layers."""
    dtype: torch.dtype
    """Element type of the stored KV."""
    num_kv_heads: int = 0
    """MHA/GQA: KV heads per layer (per tensor-parallel shard)."""
    head_dim: int = 0
    """MHA/GQA: dimension of each head."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed KV latent."""
    rope_dim: int = 0
    """MLA: width of the decoupled rotary key part."""

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, ("mha", "mla"))
        _positive_int("num_layers", self.num_layers)
        if not isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        parse_dtype(self.dtype)
        if self.kind == "mha":
            _positive_int("num_kv_heads", self.num_kv_heads)
            _positive_int("head_dim", self.head_dim)
        else:
            _positive_int("kv_lora_rank", self.kv_lora_rank)
            check_int("rope_dim", self.rope_dim, low=0)

    @classmethod
    def mha(cls, *, num_layers: int, num_kv_heads: int, head_dim: int,
            dtype: str | torch.dtype = torch.bfloat16) -> KVSpec:
        """Multi-head / grouped-query attention: a K and a V row per layer and token."""
        return cls(kind="mha", num_layers=num_layers, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, dtype=parse_dtype(dtype))

    @classmethod
    def mla(cls, *, num_layers: int, kv_lora_rank: int, rope_dim: int,
            dtype: str | torch.dtype = torch.bfloat16) -> KVSpec:
        """Multi-head latent attention: one ``kv_lora_rank + rope_dim`` row per layer and token."""
        return cls(kind="mla", num_layers=num_layers, kv_lora_rank=kv_lora_rank,
                   rope_dim=rope_dim, dtype=parse_dtype(dtype))

    @property
    def num_kv(self) -> int:
        """Tensors per layer: 2 (K, V) for MHA, 1 for MLA."""
        return 2 if self.kind == "mha" else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one token's row in one layer's K (or V, or latent) buffer."""
        if self.kind == "mha":
            return (self.num_kv_heads, self.head_dim)
        return (self.kv_lora_rank + self.rope_dim,)

    @property
    def row_elems(self) -> int:
        return math.prod(self.row_shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one token in one layer of one of the `num_kv` tensors."""
        return self.row_elems * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        return self.num_kv * self.num_layers * self.row_bytes

    def fingerprint(self) -> str:
        """A stable text identity of the layout (part of storage keys and headers).

        NOTE: an MLA row is named by its two parts (``512+64``), not its width: two models
        whose rows are as wide but split elsewhere between latent and rotary part would
        have shared pages (a review found it; the KV of one is wrong for the other).
        """
        dims = "x".join(str(d) for d in self.row_shape) if self.kind == "mha" else \
            f"{self.kv_lora_rank}+{self.rope_dim}"
        return f"{self.kind}-L{self.num_layers}-{dims}-{str(self.dtype).removeprefix('torch.')}"


_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class HiCacheConfig:
    """Everything a `HiCache` needs to know, validated at construction.

    >>> spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16")
    >>> cfg = HiCacheConfig(spec=spec, page_size=16, device_pages=64, host_pages=256)
    >>> cfg.host_capacity_pages
    256
    """

    spec: KVSpec
    """KV layout of the model (per tensor-parallel shard)."""
    device_pages: int
    """L1 capacity in pages (``device_pages * page_size`` token slots)."""
    page_size: int = 16
    """Tokens per page, 1..256: the unit of matching, allocation and transfer."""
    device: str = "cpu"
    """Where L1 lives: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    host_pages: int | None = None
    """L2 capacity in pages (0: no L2 tier); when None, `host_bytes` or `host_ratio` decides."""
    host_bytes: int | None = None
    """L2 capacity in bytes (rounded down to whole pages); used when `host_pages` is None."""
    host_ratio: float = 2.0
    """L2 capacity as a multiple of L1, used when neither `host_pages` nor `host_bytes` is set."""
    host_layout: HostLayout = "page_first"
    """``layer_first`` mirrors the device pool; ``page_first`` keeps each page contiguous."""
    write_policy: WritePolicy = "write_through"
    """When device pages are copied to the host: on the Nth hit (write-through) or on eviction."""
    write_through_threshold: int | None = None
    """Hits before a node is written through: default 1 (write_through), 2 (selective)."""
    load_back_threshold: int = 0
    """Host-resident tails shorter than this many tokens are recomputed instead of loaded."""
    io_backend: IOBackend = "auto"
    """Transfer engine: ``cpu`` on CPU; ``kernel`` or ``direct`` on CUDA; ``auto`` chooses."""
    transfer_ctas: int = 4
    """CUDA ``kernel`` backend: CTAs one copy may use, i.e. the SMs taken from the forward pass."""
    eviction: Eviction | tuple[Eviction, Eviction] = "lru"
    """Order in which unpinned leaves leave a tier: least recently used (``lru``), least
    frequently used (``lfu``), or ``arc``, which learns how much room pages hit only once
    deserve beside pages hit again (docs/eviction.md). One name for both tiers, or a pair
    ``(L1, L2)``, e.g. ``("arc", "lru")``."""
    namespace: str = "default"
    """Model identity; part of every storage key so different models never share pages."""
    max_inflight_loads: int = 64
    """Load-back jobs queued or in flight before new fetches wait (backpressure)."""
    max_inflight_writes: int = 64
    """Write jobs queued or in flight before new commits wait (backpressure)."""
    max_worker_restarts: int = 3
    """Times a crashed worker is restarted before the cache reports itself failed."""
    storage: object = None
    """L3: None, a URL (``memory://``, ``file:///dir``, ``redis://[user:pass@]host:port/db``,
    ``rediss://...``, ``unix:///path/redis.sock?db=0``) or an object implementing
    `aiohicache.storage.StorageBackend`."""
    prefetch_policy: PrefetchPolicy = "timeout"
    """How long a fetch waits for its L3 prefetch: not at all (``best_effort``), until done
    (``wait_complete``), or up to ``min(max, base + per_1k_tokens * tokens / 1024)`` s."""
    prefetch_threshold: int = 256
    """Tokens past the L1+L2 match below which L3 is not asked."""
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_1k_tokens: float = 0.1
    prefetch_timeout_max: float = 30.0
    prefetch_host_fraction: float = 0.5
    """Share of the host pool that prefetches in flight may hold."""
    storage_miss_ttl: float = 5.0
    """Seconds a prefix L3 did not have is not asked for again (negative cache)."""
    storage_miss_max_entries: int = 4096
    """Most prefixes the negative cache remembers; past it the oldest are forgotten (and
    asked of L3 again). 0 turns the negative cache off."""
    backup_threshold: int = 1
    """Hits a node needs before its settled host copy is backed up to L3."""
    backup_max_inflight_bytes: int = 256 << 20
    """Bytes of backups in flight at once."""
    storage_failures_to_open: int = 5
    """Consecutive L3 failures after which L3 is bypassed for `storage_cooldown` seconds."""
    storage_cooldown: float = 10.0
    tp_rank: int = 0
    """This rank's shard (part of storage keys)."""
    tp_size: int = 1
    """Tensor-parallel ranks sharing the cache's decisions; above 1, pass a `TPGroup`."""
    tp_timeout: float = 60.0
    """Seconds a consensus tick waits for the other ranks before failing with `RankTimeoutError`."""
    tp_tick_interval: float = 0.002
    """While work is in flight, the longest a rank waits for news before ticking again."""
    extra: dict[str, object] = field(default_factory=dict)
    """Free-form settings for plug-ins; ignored by the core."""

    transfer: TransferConfig = field(init=False, repr=False, compare=False)
    """The transfer fields as one typed group (what the transfer controller receives)."""
    l3: StorageConfig = field(init=False, repr=False, compare=False)
    """The L3 fields (`storage`, ``prefetch_*``, ``backup_*``, ``storage_*``) as one group."""
    tp: TPConfig = field(init=False, repr=False, compare=False)
    """The ``tp_*`` fields as one typed group."""

    def __repr__(self) -> str:
        return repr_hiding_credentials(self, "storage")

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise ConfigError(f"spec: must be a KVSpec, got {type(self.spec).__name__}")
        _positive_int("page_size", self.page_size, upper=256)
        _positive_int("device_pages", self.device_pages)
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device: must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self._check_host()
        check_choice("host_layout", self.host_layout, ("layer_first", "page_first"))
        # Each group validates its own fields; only checks across groups are made here.
        for name, cls in (("transfer", TransferConfig), ("l3", StorageConfig), ("tp", TPConfig)):
            object.__setattr__(self, name, group_of(cls, self))
        self._check_io_backend()
        self._check_eviction()
        if self.storage is not None and self.host_capacity_pages == 0:
            # NOTE: prefetches land in L2 and backups are written from it: with no L2 page
            # the store was opened and never used, unsaid (replay --l3 with --l2 0 refuses)
            raise ConfigError("storage: L3 pages are read into L2 and written from it, and "
                              "host_pages 0 leaves no L2; give L2 pages or no storage")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError(f"namespace: must be a non-empty str, got {self.namespace!r}")
        try:  # storage keys and page headers hash its UTF-8 bytes
            self.namespace.encode()
        except UnicodeEncodeError:  # a lone surrogate (a name decoded with surrogateescape)
            raise ConfigError(f"namespace: must be UTF-8 text, got {self.namespace!r}") from None

    @classmethod
    def build(cls, *, transfer: TransferConfig | None = None, l3: StorageConfig | None = None,
              tp: TPConfig | None = None, **flat: Any) -> HiCacheConfig:
        """A config from typed groups and flat fields, e.g.
        ``HiCacheConfig.build(spec=..., device_pages=64, tp=TPConfig(rank=1, size=2))``.

        Raises:
            ConfigError: a field is given both in a group and flat, or is invalid.
        """
        for group in (g for g in (transfer, l3, tp) if g is not None):
            for name, value in flatten(group).items():
                if name in flat:
                    raise ConfigError(f"{name}: given both flat and in {type(group).__name__}")
                flat[name] = value
        return cls(**flat)

    def _check_io_backend(self) -> None:
        if self.device == "cpu" and self.io_backend in ("kernel", "direct"):
            raise ConfigError(f"io_backend: {self.io_backend!r} needs a CUDA device; "
                              "use 'cpu' or 'auto' with device='cpu'")
        if self.device != "cpu" and self.io_backend == "cpu":
            raise ConfigError("io_backend: 'cpu' copies CPU pools only; with a CUDA device "
                              "use 'kernel', 'direct' or 'auto'")

    def _check_eviction(self) -> None:
        tiers = self.eviction if isinstance(self.eviction, tuple) else (self.eviction,)
        if isinstance(self.eviction, tuple) and len(tiers) != 2:  # the tree unpacks a pair
            raise ConfigError(f"eviction: a name or a pair (L1, L2), got {self.eviction!r}")
        for name in tiers:
            if isinstance(name, str) and name in ("opt",):  # a str first: an array is no name
                raise ConfigError("eviction: 'opt' (Belady) needs the future; only a replay "
                                  "has it (aiohicache replay --eviction opt)")
            check_choice("eviction", name, ("lru", "lfu", "arc"))

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds a ``timeout``-policy fetch waits for an L3 prefetch of `num_tokens`."""
        return self.l3.prefetch_timeout(num_tokens)

    def _check_host(self) -> None:
        if self.host_pages is not None:  # 0: no L2 tier (not False or 0.0: they compare equal)
            check_int("host_pages", self.host_pages, low=0)
        if self.host_bytes is not None:
            _positive_int("host_bytes", self.host_bytes)
            if self.host_bytes < self.page_bytes:
                raise ConfigError(f"host_bytes: {self.host_bytes} is smaller than one page "
                                  f"({self.page_bytes} bytes)")
        check_number("host_ratio", self.host_ratio, low=0, low_open=True)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (the unit of host and storage I/O)."""
        return self.page_size * self.spec.bytes_per_token

    @property
    def host_capacity_pages(self) -> int:
        """L2 capacity in pages, resolved from `host_pages`, `host_bytes` or `host_ratio`."""
        if self.host_pages is not None:
            return self.host_pages
        if self.host_bytes is not None:
            return self.host_bytes // self.page_bytes
        return max(1, int(self.device_pages * self.host_ratio))

    @property
    def hit_threshold(self) -> int:
        """Hits after which a device node is written through to the host."""
        return self.transfer.hit_threshold

    @property
    def resolved_io_backend(self) -> Literal["cpu", "kernel", "direct"]:
        if self.io_backend != "auto":
            return self.io_backend
        return "cpu" if self.device == "cpu" else "kernel"
