"""aiohicache: an asyncio-native hierarchical KV-cache manager for LLM serving."""

from ._stats import StorageStats, TPStats
from .api import CacheStats, FetchContext, HiCache
from .config import HiCacheConfig, KVSpec, StorageConfig, TPConfig, TransferConfig
from .errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    DivergenceError,
    HiCacheError,
    InvariantError,
    LoopError,
    PageError,
    RankTimeoutError,
    StorageError,
    StorageReadError,
    StorageWriteError,
    TPError,
    TransferError,
    WorkerError,
)
from .transfer import CpuTransferEngine, TransferEngine, TransferHandle

__version__ = "0.1.0"

__all__ = (
    "CacheStats",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "CpuTransferEngine",
    "DivergenceError",
    "FetchContext",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "InvariantError",
    "KVSpec",
    "LoopError",
    "PageError",
    "RankTimeoutError",
    "StorageError",
    "StorageConfig",
    "StorageReadError",
    "StorageStats",
    "StorageWriteError",
    "TPConfig",
    "TPError",
    "TPStats",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "WorkerError",
)
