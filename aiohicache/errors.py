"""The error hierarchy of aiohicache, grouped by what the caller should do.

    HiCacheError
     ├─ ConfigError (ValueError)         a configuration or argument is invalid: fix the call
     ├─ CapacityError                    a pool cannot hold what was asked, even after eviction
     ├─ ClosedError                      the cache was used after ``aclose()``
     ├─ LoopError (RuntimeError)         called from another event loop or thread than the cache's
     ├─ PageError (ValueError)           page ids handed back are foreign or already free
     ├─ InvariantError (AssertionError)  internal state is inconsistent: a bug, report it
     ├─ WorkerError                      a background worker failed for good; the cache is degraded
     ├─ TransferError                    moving bytes between tiers failed
     ├─ StorageError                     the L3 backend failed (a miss, never wrong KV)
     │   ├─ StorageReadError             reading (exists, get) failed
     │   └─ StorageWriteError            writing (set, delete) failed
     └─ TPError                          tensor-parallel ranks cannot agree; the cache stops
         ├─ RankTimeoutError             another rank did not join a consensus tick in time
         └─ DivergenceError              ranks reached different states (their calls differ)
"""

from __future__ import annotations

__all__ = (
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "DivergenceError",
    "HiCacheError",
    "InvariantError",
    "LoopError",
    "PageError",
    "RankTimeoutError",
    "StorageError",
    "StorageReadError",
    "StorageWriteError",
    "TPError",
    "TransferError",
    "WorkerError",
)


class HiCacheError(Exception):
    """Base class of every error raised by aiohicache."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value or an argument is invalid; the message names it."""


class CapacityError(HiCacheError):
    """A pool cannot provide the pages asked for, even after evicting what it may."""


class ClosedError(HiCacheError):
    """The cache (or one of its contexts) was used after it was closed."""


class LoopError(HiCacheError, RuntimeError):
    """The cache was used from another event loop (or thread) than the one that opened it."""


class InvariantError(HiCacheError, AssertionError):
    """``check_invariants()`` found inconsistent internal state."""


class WorkerError(HiCacheError):
    """A background worker kept failing and was given up; see ``stats().health``."""


class TransferError(HiCacheError):
    """Copying KV between tiers failed."""


class PageError(HiCacheError, ValueError):
    """Page or slot ids handed back are foreign to the pool, or not allocated (double free)."""


class StorageError(HiCacheError):
    """The storage backend failed; the message names the backend and the cause."""


class StorageReadError(StorageError):
    """Reading from the storage backend failed."""


class StorageWriteError(StorageError):
    """Writing to the storage backend failed."""


class TPError(HiCacheError):
    """Tensor-parallel ranks could not agree; this rank's cache stops serving."""


class RankTimeoutError(TPError):
    """Another rank did not join a consensus tick within ``tp_timeout`` (dead or stuck)."""


class DivergenceError(TPError):
    """The ranks' cache states differ: their request-path calls were not the same sequence."""
