"""Device pins of live fetch contexts: each context pins its matched prefix, once."""

from __future__ import annotations

import weakref
from typing import Protocol

from .errors import InvariantError
from .radix import Node, RadixTree

__all__ = ("Pins",)


class _Holder(Protocol):
    """What a pin's owner tells the invariant check (a fetch context's request state)."""

    owner: int
    pin: int | None
    releasing: bool


class Pins:
    """Deepest pinned node per owner id; the tree's `lock_ref`s are the sum of these."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.nodes: dict[int, Node] = {}
        self._holders: weakref.WeakValueDictionary[int, _Holder] = \
            weakref.WeakValueDictionary()  # owner id -> holder, to tell live pins from leaks

    def pin(self, holder: _Holder, node: Node | None) -> int:
        """Pin `node` for `holder`; a holder has at most one pin."""
        owner = holder.owner
        if owner in self.nodes:
            raise InvariantError(f"fetch context {owner} is pinned already")
        self._holders[owner] = holder
        self.tree.lock(node)
        self.nodes[owner] = node if node is not None else self.tree.root
        return owner

    def repin(self, key: int, node: Node | None) -> None:
        self.tree.lock(node)
        self.unpin(key)
        self.nodes[key] = node if node is not None else self.tree.root

    def unpin(self, key: int) -> None:
        node = self.nodes.pop(key)
        self.tree.unlock(node if node is not self.tree.root else None)

    def node(self, key: int) -> Node | None:
        node = self.nodes.get(key)
        return None if node is None or node is self.tree.root else node

    def check(self) -> dict[int, int]:
        """Raise `InvariantError` for a pin whose holder has ended; return locks per node id."""
        locks: dict[int, int] = {}
        for owner, node in self.nodes.items():
            holder = self._holders.get(owner)
            if holder is None or (holder.pin != owner and not holder.releasing):
                raise InvariantError(f"a pin outlives its fetch context ({owner})")
            for n in node.path_to_root():
                locks[n.id] = locks.get(n.id, 0) + 1
        return locks
