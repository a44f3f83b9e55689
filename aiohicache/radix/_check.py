"""Consistency checks and fingerprints of a radix tree (tests, TP agreement; O(n))."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvariantError
from ..memory import PageIds
from ._node import DeviceState, HostState, Node

if TYPE_CHECKING:
    from ._state import TreeState

__all__ = ("check", "fingerprint")


def fingerprint(tree: TreeState, *, pages: bool = False) -> str:
    """A digest of the tree's shape and tier states, stable across processes (equal trees
    give equal values). With `pages`, page ids and ref counts count too (TP ranks agree
    on those as well)."""
    items: list[str] = []
    for n in tree.iter_nodes():
        # (the ids as int64 whatever the tree's key dtype: equal trees, equal values)
        key = n.key.astype(np.int64, copy=False).tobytes()
        item: list[object] = [len(n.path_to_root()), key, n.device_state.value,
                              n.host_state.value]
        if pages:
            item += [_page_bytes(n.device_pages), _page_bytes(n.host_pages), n.lock_ref,
                     n.host_ref, n.hit_count, n.last_access]
        items.append(repr(item))
    h = hashlib.blake2b(digest_size=16)
    for text in sorted(items):
        h.update(text.encode())
    return h.hexdigest()


def check(tree: TreeState) -> None:
    """Raise `InvariantError` if the tree's structure or tier states are inconsistent."""
    seen_device: set[int] = set()
    seen_host: set[int] = set()
    count = 0
    for node in tree.iter_nodes():
        count += 1
        _check_node(tree, node)
        _claim(seen_device, node.device_pages, f"device pages of {node!r}")
        _claim(seen_host, node.host_pages, f"host pages of {node!r}")
    if count != tree.num_nodes:
        raise InvariantError(f"node count {tree.num_nodes} but {count} reachable")
    for policy, pred, tier in ((tree.device_policy, tree._device_candidate, "on_device"),
                               (tree.host_policy, tree._host_candidate, "on_host")):
        queued = policy.queued()
        for node in tree.iter_nodes():
            if pred(node) and node.id not in queued:
                raise InvariantError(f"eviction candidate {node!r} is not queued")
        problem = policy.problem(n for n in tree.iter_nodes() if getattr(n, tier))
        if problem:
            raise InvariantError(problem)


def _check_node(tree: TreeState, node: Node) -> None:
    problem = _node_problem(tree, node)
    if problem:
        raise InvariantError(f"{node!r}: {problem}")


def _node_problem(tree: TreeState, node: Node) -> str:
    """The first broken invariant of `node`, or "" (messages built only on failure)."""
    ps, parent = tree.page_size, node.parent
    if parent is None or parent.children.get(node.key[:ps].tobytes()) is not node:
        return "not linked from its parent"
    kids = node.children.values()
    checks = (
        (len(node.key) == node.num_pages * ps and node.num_pages > 0,
         "key length disagrees with its pages"),
        (node.key.dtype == tree.key_dtype, "key dtype is not the tree's"),
        ((node.device_pages is None) == (not node.on_device), "device state vs pages"),
        ((node.host_pages is None) == (not node.on_host), "host state vs pages"),
        (node.on_device or node.on_host, "holds KV in no tier"),
        (all(p is None or len(p) == node.num_pages
             for p in (node.device_pages, node.host_pages)), "page counts differ"),
        (parent is tree.root or parent.on_device or not node.on_device,
         "device residency not prefix-closed"),
        (parent is tree.root or parent.on_host or not node.on_host,
         "host residency not prefix-closed"),
        (node.device_children == sum(c.on_device for c in kids), "device child count"),
        (node.host_children == sum(c.on_host for c in kids), "host child count"),
        (node.lock_ref >= sum(c.lock_ref for c in kids), "lock_ref below its children's"),
        ((node.device_state is DeviceState.LOADING) == (node.load_op is not None),
         "LOADING iff owned by a load"),
        ((node.host_state is HostState.WRITING) == (node.write_op is not None),
         "WRITING iff owned by a write"),
    )
    return next((message for ok, message in checks if not ok), "")



def _claim(seen: set[int], pages: PageIds | None, what: str) -> None:
    if pages is None:
        return
    ids = set(pages.tolist())
    if len(ids) != len(pages) or ids & seen:
        raise InvariantError(f"{what} are referenced twice")
    seen |= ids


def _page_bytes(pages: PageIds | None) -> bytes:
    return b"-" if pages is None else pages.tobytes()
