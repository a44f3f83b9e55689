"""The radix tree's state: nodes' tier residency, pins, and each tier's eviction queue.

`TreeState` is the base of `RadixTree`: it owns every change of a node's device or host
state and keeps the tiers' eviction policies in step with it (a node is offered to a tier's
policy whenever it may have become a candidate). `RadixTree` adds the operations.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import InvariantError
from ..memory import PageAllocator, PageIds
from . import _check
from ._node import DeviceState, HostState, Node
from ._policy import EvictionPolicy, PolicyName, make_policy
from ._results import Keys, as_token_array, narrow

__all__ = ("TreeState",)


class TreeState:
    """Nodes, their device and host residency and pins, and the tiers' eviction queues.

    Every change of a node's tier state goes through `_set_device` / `_set_host`, which
    keep child counts, the policies' page counts and the KV-event hooks in step. Eviction
    order: each tier has an `EvictionPolicy` (``eviction`` names one for both
    tiers, or a pair: device, host) that keeps its candidates in lazy min-heaps, e.g. keyed
    by ``(last_access, id)`` (LRU) or ``(hit_count, last_access, id)`` (LFU). Entries go stale
    when a node's key changes or it stops being a candidate; the policy's `pop` discards
    those, and they are dropped a few per push and pop once stale entries outnumber live
    nodes (`EvictionPolicy.compact`). Push and pop are O(log n); nothing scans the tree.
    """

    def __init__(self, *, page_size: int, device_alloc: PageAllocator,
                 host_alloc: PageAllocator,
                 eviction: PolicyName | tuple[PolicyName, PolicyName] = "lru") -> None:
        self.page_size = page_size
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc
        self._ids = itertools.count(1)
        self.key_dtype: np.dtype[np.signedinteger[Any]] = np.dtype(np.int32)
        """The dtype of every key in the tree: int32 until an id beyond it comes (`keys`)."""
        self.root = Node(id=0, parent=None, key=np.empty(0, dtype=np.int32))
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self.on_split: list[Callable[[Node, Node], None]] = []
        """Called as ``hook(node, upper)`` when a node holding host refs is split."""
        self.on_residency: list[Callable[[Node, str, bool], None]] = []
        """Called as ``hook(node, "device" | "host", present)`` when a node gains or loses a
        tier (KV events; aiohicache.events). Splits move no page between tiers: not called."""
        self.on_stored: list[Callable[[Node, list[int], bool], None]] = []
        """Called as ``hook(node, pages, present)`` with the indices of `node`'s pages the
        tree learns are in L3 (`Node.stored`, `mark_stored`), or forgets are (the node left
        the tree, `_delete`) (KV events: what a snapshot lists, the stream must have said)."""
        self._num_nodes = 0
        self._pushes = 0  # queue pushes since the entries were last counted
        device, host = (eviction, eviction) if isinstance(eviction, str) else eviction
        self.device_policy = make_policy(device, capacity=device_alloc.capacity,
                                         page_size=page_size)
        self.host_policy = make_policy(host, capacity=host_alloc.capacity, page_size=page_size)
        self._counting = self._learning = False
        self._policies_changed()
        self.device_evicted_pages = 0
        self.host_evicted_pages = 0
        self.device_eviction_order: list[int] | None = None  # node ids, when tracing

    # ------------------------------------------------------------------ queries

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def keys(self, tokens: Keys | Sequence[int]) -> Keys:
        """`tokens` as the tree keeps its keys: int32 while every id it was given fits, else
        int64. Queries convert their tokens with this; a caller that passes the same tokens
        to several of them converts once with it (an array of the key dtype is used as is).

        NOTE: int32 keys halve the bytes a match compares, an insert copies and new keys
        fault in. An id that does not fit widens the tree to int64 for good (every key, the
        children's dicts, the policies' ghosts: O(tokens), once); nothing is ever wrapped.
        """
        return self._keys(tokens)[0]

    def _keys(self, tokens: Keys | Sequence[int]) -> tuple[Keys, bool]:
        """`keys`, and whether they are a new array no one else holds (made here)."""
        if isinstance(tokens, np.ndarray) and tokens.dtype == self.key_dtype:
            return tokens, False
        wide = as_token_array(tokens)  # (may be `tokens`, or share its memory: a tensor's)
        if self.key_dtype == np.int64:
            return wide, False
        keys = narrow(wide)
        if keys is None:
            self._widen()
            return wide, False
        return keys, True

    def _widen(self) -> None:
        """Make every key int64 (a token id beyond int32 came): children are keyed again by
        the bytes of their first page, and so are the policies' ghosts."""
        self.key_dtype = np.dtype(np.int64)
        nodes = [self.root, *self.iter_nodes()]
        for node in nodes:
            node.key = node.key.astype(np.int64)
        for node in nodes:
            node.children = {child.key[:self.page_size].tobytes(): child
                             for child in node.children.values()}
        self.device_policy.widen()
        self.host_policy.widen()

    # ------------------------------------------------------------------ state changes

    def _count_hit(self, node: Node) -> None:
        if self._counting:  # the node may change class: its pages leave, then join again
            self._account(node, -1)
            node.hit_count += 1
            self._account(node, 1)
        else:
            node.hit_count += 1

    def _account(self, node: Node, sign: int) -> None:
        if node.device_pages is not None:
            self.device_policy.on_resident(node, sign * len(node.device_pages))
        if node.host_pages is not None:
            self.host_policy.on_resident(node, sign * len(node.host_pages))

    def _set_device(self, node: Node, pages: PageIds | None, state: DeviceState) -> None:
        was = node.device_state is not DeviceState.ABSENT
        if self._counting:
            self.device_policy.on_resident(node, _num(pages) - _num(node.device_pages))
        node.device_pages, node.device_state = pages, state
        now = state is not DeviceState.ABSENT
        assert (pages is None) == (not now)
        if node.parent is not None and was != now:
            node.parent.device_children += 1 if now else -1
            self._offer(node.parent)
        self._offer(node)
        if self.on_residency and was != now:
            for hook in self.on_residency:
                hook(node, "device", now)

    def _set_host(self, node: Node, pages: PageIds | None, state: HostState) -> None:
        was = node.host_state is not HostState.ABSENT
        if self._counting:
            self.host_policy.on_resident(node, _num(pages) - _num(node.host_pages))
        node.host_pages, node.host_state = pages, state
        now = state is not HostState.ABSENT
        assert (pages is None) == (not now)
        if node.parent is not None and was != now:
            node.parent.host_children += 1 if now else -1
            self._offer(node.parent)
        self._offer(node)
        if self.on_residency and was != now:
            for hook in self.on_residency:
                hook(node, "host", now)

    def lock(self, node: Node | None) -> None:
        """Pin `node` and its ancestors on the device."""
        for n in node.path_to_root() if node is not None else ():
            n.lock_ref += 1

    def unlock(self, node: Node | None) -> None:
        for n in node.path_to_root() if node is not None else ():
            if n.lock_ref <= 0:
                raise InvariantError(f"unlock: {n!r} is not locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._offer(n)

    def protect_host(self, node: Node) -> None:
        node.host_ref += 1

    def release_host(self, node: Node) -> None:
        if node.host_ref <= 0:
            raise InvariantError(f"release_host: {node!r} is not protected")
        node.host_ref -= 1
        if node.host_ref == 0:
            self._offer(node)

    def mark_stored(self, node: Node, stored: list[bool]) -> None:
        """Record which of `node`'s pages are in L3. NOTE: `stored` replaces the list, never
        written into: a snapshot being taken keeps the one it captured."""
        was = node.stored or [False] * len(stored)
        node.stored = stored
        if self.on_stored:
            for present in (True, False):
                if pages := [i for i, (a, b) in enumerate(zip(was, stored, strict=True))
                             if b != a and b == present]:
                    for hook in self.on_stored:
                        hook(node, pages, present)

    def _delete(self, node: Node) -> None:
        assert not node.children and not node.on_device and not node.on_host
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[:self.page_size].tobytes()]
        node.alive = False
        self._num_nodes -= 1
        # NOTE: the tree forgets its pages are in L3 (they may still be there: a later
        # prefetch finds them); a router told they were must be told they no longer are,
        # or its model of the instance outgrows what the instance (and its snapshot) knows
        if self.on_stored and node.stored and any(node.stored):
            for hook in self.on_stored:
                hook(node, [i for i, s in enumerate(node.stored) if s], False)
        # (only the host tier: a parent's device candidacy reads no `children`, and the
        # `_set_device` / `_set_host` before each delete offered it to both)
        self._offer(parent, device=False)

    def _device_candidate(self, node: Node) -> bool:
        # (`_offer` tests the same, inline)
        return (node.alive and node.device_state is DeviceState.RESIDENT
                and node.device_children == 0 and node.lock_ref == 0
                and node.host_state is not HostState.WRITING)

    def _host_candidate(self, node: Node) -> bool:
        # (`_offer` tests the same, inline)
        return (node.alive and node.host_state is HostState.RESIDENT and not node.on_device
                and not node.children and node.host_ref == 0 and node.parent is not None)

    def _offer(self, node: Node, *, device: bool = True) -> None:
        """Queue `node` with the policy of each tier it is now an eviction candidate of
        (only the host tier's unless `device`)."""
        if node.parent is None:
            return
        # NOTE: `_device_candidate` and `_host_candidate` inline, the test most nodes fail
        # first: ten offers a request, and the two calls cost more than the tests
        state, host = node.device_state, node.host_state
        if device and state is _RESIDENT and node.device_children == 0 \
                and node.lock_ref == 0 and host is not _WRITING and node.alive:
            self.device_policy.push(node)
            self._pushes += 1
        if host is _HOST_RESIDENT and state is _ABSENT and not node.children \
                and node.host_ref == 0 and node.alive:
            self.host_policy.push(node)
            self._pushes += 1
        # Counting the queues' entries costs more than a push: look every 256 pushes.
        if self._pushes >= 256:
            self._pushes = 0
            if (self.device_policy.num_entries + self.host_policy.num_entries
                    > 4 * self._num_nodes + 1024):
                self.device_policy.compact(self._device_candidate)
                self.host_policy.compact(self._host_candidate)

    def _rebuild(self) -> None:
        nodes = list(self.iter_nodes())
        self.device_policy.rebuild(n for n in nodes if self._device_candidate(n))
        self.host_policy.rebuild(n for n in nodes if self._host_candidate(n))

    def set_policies(self, *, device: EvictionPolicy | None = None,
                     host: EvictionPolicy | None = None) -> None:
        """Replace a tier's eviction policy (e.g. with `Belady`, which no name builds).

        The new policy learns what the tier holds and queues its candidates: O(n), once.
        """
        self.device_policy = device or self.device_policy
        self.host_policy = host or self.host_policy
        self._policies_changed()
        for policy, pages in ((device, "device_pages"), (host, "host_pages")):
            if policy is not None and policy.counts_pages:
                for node in self.iter_nodes():
                    policy.on_resident(node, _num(getattr(node, pages)))
        self._rebuild()

    def _policies_changed(self) -> None:
        policies = (self.device_policy, self.host_policy)
        self._counting = any(p.counts_pages for p in policies)
        self._learning = any(p.learns_from_misses for p in policies)

    # ------------------------------------------------------------------ checks

    # ------------------------------------------------------------------ checks

    def fingerprint(self, *, pages: bool = False) -> str:
        """A digest of the tree's shape and tier states, stable across processes (equal trees
        give equal values). With `pages`, page ids and ref counts count too (TP ranks agree
        on those as well)."""
        return _check.fingerprint(self, pages=pages)

    def check(self) -> None:
        """Raise `InvariantError` if the tree's structure or tier states are inconsistent."""
        _check.check(self)


_ABSENT, _RESIDENT = DeviceState.ABSENT, DeviceState.RESIDENT
_HOST_RESIDENT, _WRITING = HostState.RESIDENT, HostState.WRITING


def _num(pages: PageIds | None) -> int:
    return 0 if pages is None else len(pages)
