"""Storage-tier errors, defined with the rest of the hierarchy in `aiohicache.errors`."""

from __future__ import annotations

from ..errors import StorageError, StorageReadError, StorageWriteError

__all__ = ("StorageError", "StorageReadError", "StorageWriteError")
