"""`check(core)`: the cache's internal consistency, asserted by tests after every step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from ._core import Core
from .controller import LoadJob
from .errors import InvariantError
from .memory import PageIds

__all__ = ("check", "concat_pages")


def check(core: Core) -> None:
    """Raise `InvariantError` if the tree, the page owners or the pins are inconsistent.

    Checks the tree (links, tier states, prefix closure, page ownership, eviction queues),
    that every allocated page is owned by exactly one of tree / lease, and that pins and host
    holds match the live fetch contexts and in-flight jobs exactly.
    """
    core.tree.check()
    _check_pages(core)
    _check_refs(core)


def _check_pages(core: Core) -> None:
    dev, host = core.device_pool.allocator, core.host_pool.allocator
    for alloc in (dev, host):
        if alloc.num_free + alloc.num_used != alloc.capacity:
            raise InvariantError(f"{alloc!r}: free + used != capacity")
    nodes = list(core.tree.iter_nodes())
    reserved: list[PageIds | None] = list(core.storage.reserved_host.values()) \
        if core.storage else []
    tree_dev = concat_pages([n.device_pages for n in nodes])
    tree_host = concat_pages([n.host_pages for n in nodes] + reserved)
    leased = core.leases.leased_pages()
    if len(leased) != core.leases.count or np.intersect1d(leased, tree_dev).size:
        raise InvariantError("leased pages disagree with the lease count or the tree")
    if not np.array_equal(np.sort(np.concatenate([tree_dev, leased])), dev.used_pages()):
        raise InvariantError("device pages used by the allocator != tree + leases")
    if not np.array_equal(np.sort(tree_host), host.used_pages()):
        raise InvariantError("host pages used by the allocator != tree")


def _check_refs(core: Core) -> None:
    locks = core.pins.check()
    host_refs: Counter[int] = Counter()
    for group in core.storage.backup_holds() if core.storage is not None else ():
        host_refs.update(n.id for n in group)
    for job in core.controller.inflight_jobs() if core.controller is not None else ():
        if isinstance(job, LoadJob):
            host_refs.update(n.id for n in job.nodes)
    for n in core.tree.iter_nodes():
        if n.lock_ref != locks.get(n.id, 0):
            raise InvariantError(f"{n!r}: lock_ref {n.lock_ref}, live pins "
                                 f"{locks.get(n.id, 0)}")
        if n.host_ref != host_refs[n.id]:
            raise InvariantError(f"{n!r}: host_ref {n.host_ref}, live loads {host_refs[n.id]}")


def concat_pages(parts: Sequence[PageIds | None]) -> PageIds:
    arrays = [p for p in parts if p is not None]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
