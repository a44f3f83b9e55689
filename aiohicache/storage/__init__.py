"""L3 storage: the backend protocol, the page format, page keys and the backends."""

from .base import BackendStats, PageFormat, StorageBackend, decode_page, encode_header
from .keys import chain_keys, namespace_root

__all__ = ("BackendStats", "PageFormat", "StorageBackend", "chain_keys", "decode_page",
           "encode_header", "namespace_root")
