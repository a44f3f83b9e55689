"""`NodeCircuits`: a circuit per Redis Cluster node, so a hung node costs one timeout per
cool-down, not one per call."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ("NodeCircuits", "NodeSkippedError")

log = logging.getLogger("aiohicache.storage.redis")

T = TypeVar("T")
_NO_VERDICT = object()
"""The outcome of a call that ended with neither replies nor an error (cancelled)."""


class NodeSkippedError(RedisClusterException):
    """A node was not asked: it timed out less than `node_cooldown` seconds ago (its
    pages are a failed node's: misses, or not stored)."""


class NodeCircuits:
    """A circuit per node: a node whose call timed out (a hung process, a host that does not
    answer) is skipped for `cooldown` seconds, then one call goes to it as the probe
    (half-open): an answer closes the circuit, another timeout opens it again.

    NOTE: timeouts only: they are what costs a wait (redis-py reports a connect that timed
    out as a timeout too); a refused or reset connection fails at once, so that node is
    asked again by the next call and served the moment it is back.
    """

    def __init__(self, cooldown: float) -> None:
        self.cooldown = cooldown
        self._failed_at: dict[str, float] = {}
        """Nodes whose circuit is open (or half-open): when each last timed out."""
        self._probing: set[str] = set()
        """Half-open nodes whose probe is in flight."""

    def failing(self) -> set[str]:
        """The nodes not known to answer (open or half-open)."""
        return set(self._failed_at)

    async def call(self, node: str, fn: Callable[[], Awaitable[T]]) -> T | Exception:
        """`fn()`'s result, or the exception it raised; a `NodeSkippedError`, `fn` not
        called, while `node`'s circuit is open or its probe in flight. The outcome
        settles the circuit; a cancelled call settles nothing (the next call probes)."""
        failed_at = self._failed_at.get(node)
        probe = failed_at is not None
        if failed_at is not None:
            age = time.monotonic() - failed_at
            if node in self._probing or age < self.cooldown:
                return NodeSkippedError(f"node {node} not asked: it timed out {age:.1f} s "
                                        f"ago (node_cooldown {self.cooldown:g} s)")
            self._probing.add(node)
        outcome: object = _NO_VERDICT
        try:
            outcome = await fn()
        except Exception as exc:  # the caller judges it (a failed node costs its pages)
            outcome = exc
        finally:
            if probe:  # NOTE: only the probe's own end lets another call probe
                self._probing.discard(node)
            self._settle(node, outcome)
        return outcome

    def _settle(self, node: str, outcome: object) -> None:
        if outcome is _NO_VERDICT:
            return
        if _timed_out(outcome):
            if node not in self._failed_at:
                log.warning("redis cluster node %s timed out: skipped for %g s",
                            node, self.cooldown)
            self._failed_at[node] = time.monotonic()
        elif self._failed_at.pop(node, None) is not None:
            log.info("redis cluster node %s answers again", node)


def _timed_out(outcome: object) -> bool:
    """Whether a node's call timed out: raised a timeout, or got one and no reply.

    NOTE: a pipeline whose read timed out gets the timeout for its first command and a
    connection error for the others (redis-py closes the connection)."""
    errors = outcome if isinstance(outcome, list) else [outcome]
    return (any(isinstance(e, RedisTimeoutError | TimeoutError) for e in errors)
            and all(isinstance(e, RedisTimeoutError | RedisConnectionError | OSError)
                    for e in errors))
