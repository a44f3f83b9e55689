"""Radix tree nodes with explicit, per-tier residency state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..memory import PageIds

__all__ = ("DeviceState", "HostState", "Node", "PendingOp")


class DeviceState(enum.Enum):
    """Where a node's KV stands on the device (L1)."""

    ABSENT = "absent"
    """No device pages: the node is host-only (evicted from L1)."""
    LOADING = "loading"
    """Device pages are allocated and a host->device copy is in flight."""
    RESIDENT = "resident"
    """The device pages hold the node's KV."""


class HostState(enum.Enum):
    """Where a node's KV stands on the host (L2)."""

    ABSENT = "absent"
    """No host copy."""
    WRITING = "writing"
    """Host pages are allocated and a device->host copy is in flight."""
    RESIDENT = "resident"
    """The host pages hold the node's KV."""


class PendingOp:
    """An in-flight transfer that owns nodes in a transitional state.

    The tree appends to `nodes` when it splits a node the op owns, so the op settles both
    halves when it completes.
    """

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: list[Node] = []


@dataclass(slots=True, eq=False)
class Node:
    """One edge of the radix tree: a run of whole pages with their tier state.

    Ownership: only `RadixTree` mutates nodes; the controller reads them.
    Invariants (see `RadixTree.check`): ``device_pages is None`` iff the device state is
    ABSENT; ``host_pages is None`` iff the host state is ABSENT; every node but the root has
    at least one of the two; both sets are prefix-closed (a node's parent has the tier too).
    """

    id: int
    parent: Node | None
    key: npt.NDArray[np.signedinteger[Any]]
    """The node's token ids, in the tree's key dtype (`TreeState.keys`)."""
    device_pages: PageIds | None = None
    host_pages: PageIds | None = None
    device_state: DeviceState = DeviceState.ABSENT
    host_state: HostState = HostState.ABSENT
    children: dict[bytes, Node] = field(default_factory=dict)
    """Keyed by the bytes of the child's first page of tokens (in the tree's key dtype)."""
    device_children: int = 0
    """Children whose device state is not ABSENT (O(1) leaf test)."""
    host_children: int = 0
    """Children whose host state is not ABSENT."""
    lock_ref: int = 0
    """Device pins: requests whose matched prefix runs through this node."""
    host_ref: int = 0
    """Host pins: in-flight reads of this node's host pages."""
    hit_count: int = 0
    last_access: int = 0
    load_op: PendingOp | None = None
    write_op: PendingOp | None = None
    alive: bool = True
    hashes: list[bytes] | None = None
    """Per-page storage keys (chained page digests) when an L3 tier is configured."""
    stored: list[bool] | None = None
    """Per page: known to be in L3 (backed up or prefetched from there)."""
    backup_hits: int = 0
    """`hit_count` when its host copy was last sent to L3 (0: never); a copy the store
    failed or refused is sent again once the hits have doubled."""
    checked_at: float = 0.0
    """When its `stored` marks were last taken or checked against L3 (`time.monotonic`;
    0: not yet): the store may drop pages on its own, so they are checked again now and
    then while the node is hit (`StorageTier.on_hits`)."""

    def __repr__(self) -> str:
        return (f"<Node {self.id} pages={self.num_pages} device={self.device_state.value} "
                f"host={self.host_state.value} lock={self.lock_ref}>")

    @property
    def num_pages(self) -> int:
        if self.device_pages is not None:
            return len(self.device_pages)
        if self.host_pages is not None:
            return len(self.host_pages)
        return 0

    @property
    def on_device(self) -> bool:
        return self.device_state is not DeviceState.ABSENT

    @property
    def on_host(self) -> bool:
        return self.host_state is not HostState.ABSENT

    def path_to_root(self) -> list[Node]:
        """This node and its ancestors, deepest first, root excluded."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out


def empty_pages() -> PageIds:
    return np.empty(0, dtype=np.int64)
