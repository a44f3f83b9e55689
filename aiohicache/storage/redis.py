"""Redis (or Valkey) as the L3 page store: one server (`RedisBackend`) or a cluster
(`RedisClusterBackend`), through redis-py's asyncio client, with pipelined batches.

The implementation is private: `_redis` (one server), `_redis_cluster` (a cluster) and
`_redis_parts` (page work and connecting, shared by both).
"""

from __future__ import annotations

from ._redis import RedisBackend
from ._redis_cluster import RedisClusterBackend

__all__ = ("RedisBackend", "RedisClusterBackend")
