"""aiohicache: an asyncio-native hierarchical KV-cache manager for LLM serving."""

from ._stats import StorageStats, TPStats
from .api import CacheStats, FetchContext, HiCache
from .config import HiCacheConfig, KVSpec, StorageConfig, TPConfig, TransferConfig
from .errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    HiCacheError,
    InvariantError,
    LoopError,
    PageError,
    StorageError,
    StorageReadError,
    StorageWriteError,
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
    "FetchContext",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "InvariantError",
    "KVSpec",
    "LoopError",
    "PageError",
    "StorageError",
    "StorageConfig",
    "StorageReadError",
    "StorageStats",
    "StorageWriteError",
    "TPConfig",
    "TPStats",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "WorkerError",
)
