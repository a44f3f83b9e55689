"""L3 storage: the backend protocol, the page format, page keys and the backends."""

from .base import BackendStats, PageFormat, StorageBackend, decode_page, encode_header
from .errors import StorageError, StorageReadError, StorageWriteError
from .factory import backend_from_url, check_url
from .faults import Breaker, BreakerState, FaultyBackend
from .file import FileBackend
from .keys import chain_keys, namespace_root
from .memory import MemoryBackend

__all__ = ("BackendStats", "Breaker", "BreakerState", "FaultyBackend", "FileBackend",
           "MemoryBackend", "PageFormat", "StorageBackend", "StorageError", "StorageReadError",
           "StorageWriteError", "backend_from_url", "chain_keys", "check_url", "decode_page",
           "encode_header", "namespace_root")
