"""A stream's first batch (``snapshot=True``): taken at subscribe time, hashed as it is read."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from ._events_stream import BlockStored, EventBatch, KVEvent, Medium
from .radix import Node
from .radix._node import DeviceState, HostState
from .storage.keys import chain_keys

__all__ = ("Snapshot",)

_STEP_PAGES = 512
"""Pages hashed per step (1-3 ms of the loop on this project's 2-core VM)."""


_Entry = tuple[Node, npt.NDArray[np.int64], int, DeviceState, HostState, list[bool] | None]
"""A node as it was at subscribe time: the node, its key then (a split replaces `node.key`,
it never writes into it), its parent's entry (-1: the root), its tier states then, which of
its pages were in L3 then (`Node.stored`: replaced on change, never written into)."""


class Snapshot:
    """`BlockStored` events for what the tiers held when it was made, parents first.

    NOTE: made in O(nodes) at subscribe time (each node's token array, parent and tiers
    then), so it stays consistent with the batches that follow it; the page keys, O(tokens)
    (835 ms of loop for a 5M-token tree), are hashed later, `_STEP_PAGES` at a time, by
    whoever reads the stream (`step`): an async reader yields to the loop between steps.
    """

    __slots__ = ("_entries", "_events", "_keys", "_known", "_remember", "_root", "_steps",
                 "_ts", "page_size")

    def __init__(self, tree_root: Node, *, root: bytes, page_size: int,
                 known: Callable[[Node], list[bytes] | None],
                 remember: Callable[[Node, list[bytes]], None]) -> None:
        self.page_size, self._root = page_size, root
        self._known, self._remember = known, remember
        self._ts = time.time()
        self._entries = _capture(tree_root)
        self._keys: list[list[bytes]] = []
        """Page keys of each entry hashed so far (entries in order, parents first)."""
        self._events: list[KVEvent] = []
        self._steps = self._run()

    def step(self) -> EventBatch | None:
        """Hash about `_STEP_PAGES` pages; the batch once every page is done, else None."""
        if next(self._steps, True) is None:
            return None
        return EventBatch(seq=-1, ts=self._ts, events=self._events)

    def finish(self) -> EventBatch:
        """All the remaining steps at once."""
        while (batch := self.step()) is None:
            pass
        return batch

    def _run(self) -> Iterator[None]:
        budget = _STEP_PAGES
        for node, tokens, up, device, host, stored in self._entries:
            parent = self._keys[up][-1] if up >= 0 else None
            keys = self._known(node)
            if keys is None or len(keys) * self.page_size != len(tokens):
                keys = []  # NOTE: unknown, or the node was split since (it kept its tail)
                yield from self._hash(tokens, parent or self._root, keys)
                self._remember(node, keys)
            self._keys.append(keys)
            for medium in _media(device, host):
                self._events.append(BlockStored(list(keys), parent, tokens.tolist(),
                                                self.page_size, medium))
            self._storage(keys, parent, tokens, stored or ())
            budget -= len(keys)
            if budget <= 0:
                budget = _STEP_PAGES
                yield None

    def _storage(self, keys: list[bytes], parent: bytes | None,
                 tokens: npt.NDArray[np.int64], stored: Sequence[bool]) -> None:
        """`storage` events for the runs of pages known to be in L3 (`Node.stored`: the
        stream reports each change of it, so a subscriber from the start knows the same)."""
        ps, first = self.page_size, None
        for i, in_l3 in enumerate([*stored, False]):
            if in_l3 and first is None:
                first = i
            elif not in_l3 and first is not None:
                self._events.append(BlockStored(
                    keys[first:i], keys[first - 1] if first else parent,
                    tokens[first * ps:i * ps].tolist(), ps, "storage"))
                first = None

    def _hash(self, tokens: npt.NDArray[np.int64], prev: bytes,
              out: list[bytes]) -> Iterator[None]:
        """Append the page keys of `tokens` to `out`, a step per `_STEP_PAGES` pages."""
        span = _STEP_PAGES * self.page_size
        for lo in range(0, len(tokens), span):
            out += chain_keys(prev, tokens[lo:lo + span], self.page_size)
            prev = out[-1]
            if lo + span < len(tokens):
                yield None


def _media(device: DeviceState, host: HostState) -> tuple[Medium, ...]:
    on_device: tuple[Medium, ...] = () if device is DeviceState.ABSENT else ("device",)
    return on_device + (() if host is HostState.ABSENT else ("host",))


def _capture(root: Node) -> list[_Entry]:
    """Every node but the root, parents first: O(nodes), no token is read (about 1 µs a
    node: 20 ms for 21k nodes on this project's 2-core VM)."""
    entries: list[_Entry] = []
    nodes, ups = list(root.children.values()), [-1] * len(root.children)
    while nodes:
        node, up = nodes.pop(), ups.pop()
        if children := node.children:
            nodes += children.values()
            ups += [len(entries)] * len(children)
        entries.append((node, node.key, up, node.device_state, node.host_state, node.stored))
    return entries
