"""The hub that turns the tree's residency changes into `EventBatch`es for subscribers."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio.lowlevel

from ._events_snapshot import Snapshot
from ._events_stream import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventStream,
    KVEvent,
    Medium,
)
from .controller._l3_parts import shard
from .radix import Node
from .storage.keys import chain_keys, namespace_root

if TYPE_CHECKING:
    from .api import HiCache

__all__ = ("hub_of",)


class _Hub:
    """Turns the tree's residency changes into batches for the cache's subscribers.

    Hooked into the tree only while someone subscribes. Per change it does
    O(pages of the node) work: the node's page keys, cached per node id (a node keeps its
    prefix for life; a split only cuts its front off, so the cached keys' tail stays right).
    """

    def __init__(self, cache: HiCache) -> None:
        cfg = cache.config
        self._tree = cache.tree
        rank, size = shard(cfg)
        self._root = namespace_root(namespace=cfg.namespace,
                                    spec_fingerprint=cfg.spec.fingerprint(),
                                    page_size=cfg.page_size, layout=cfg.host_layout,
                                    tp_rank=rank, tp_size=size)
        self._ps = cfg.page_size
        self._streams: weakref.WeakSet[EventStream] = weakref.WeakSet()
        self._pending: list[KVEvent] = []
        self._keys: dict[int, list[bytes]] = {}
        self._seq = 0
        self._scheduled = False
        self._attached = False
        self._call_soon: Callable[[Callable[[], object]], object] | None = None
        self.closed = False

    def subscribe(self, max_batches: int, *, snapshot: bool) -> EventStream:
        stream = EventStream(self, max_batches)
        if self.closed:
            stream._end()
            return stream
        self._call_soon = _soon_caller()
        # NOTE: the open batch holds changes made before this stream existed (and already in
        # its snapshot): seal it for the others first, or the new stream gets them twice.
        self.flush()
        self._streams.add(stream)
        if not self._attached:
            self._attached = True
            self._tree.on_residency.append(self._on_residency)
            self._tree.on_stored.append(self._on_stored)
        if snapshot:
            stream._offer(Snapshot(self._tree.root, root=self._root, page_size=self._ps,
                                   known=self._known, remember=self._remember))
        return stream

    def unsubscribe(self, stream: EventStream) -> None:
        self._streams.discard(stream)
        if not self._streams:
            self._detach()

    def _detach(self) -> None:
        if self._attached:
            self._attached = False
            self._tree.on_residency.remove(self._on_residency)
            self._tree.on_stored.remove(self._on_stored)
            self._keys.clear()
            # NOTE: unhooked, the tiers change unseen: the next batch skips a number, so a
            # subscriber following `seq` from one stream to the next (a router across a
            # publisher's restart) sees a gap, not a view gone stale carrying on
            self._seq += 1

    def close(self) -> None:
        """The cache closed: a last batch with `AllBlocksCleared`, then every stream ends."""
        if self.closed:
            return
        self._pending.append(AllBlocksCleared())
        self.flush()
        self.closed = True
        for stream in list(self._streams):
            stream._end()
        self._detach()

    # ------------------------------------------------------------------ hooks (sync)

    def _on_residency(self, node: Node, tier: str, present: bool) -> None:
        keys = self._node_keys(node)
        medium: Medium = "device" if tier == "device" else "host"
        if present:
            self._pending.append(BlockStored(keys, self._parent_key(node), node.key.tolist(),
                                             self._ps, medium))
        else:
            self._pending.append(BlockRemoved(keys, medium))
            if not node.on_device and not node.on_host:
                self._keys.pop(node.id, None)
        self._schedule()

    def _on_stored(self, node: Node, pages: list[int], present: bool) -> None:
        keys, ps = self._node_keys(node), self._ps
        if not present:  # forgotten (the node left the tree): runs need no parent
            self._pending.append(BlockRemoved([keys[i] for i in pages], "storage"))
            if not node.alive:
                self._keys.pop(node.id, None)
            self._schedule()
            return
        runs: list[list[int]] = []
        for i in pages:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent = keys[first - 1] if first else self._parent_key(node)
            self._pending.append(BlockStored(keys[first:end], parent,
                                             node.key[first * ps:end * ps].tolist(), ps,
                                             "storage"))
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._call_soon is not None:
            self._scheduled = True
            self._call_soon(self.flush)

    def flush(self) -> None:
        """Seal the changes so far into a batch for every stream; the loop's next turn does
        it anyway (a batch is one turn), a stream joining or leaving does it sooner."""
        self._scheduled = False
        if not self._pending:
            return
        batch = EventBatch(seq=self._seq, ts=time.time(), events=self._pending)
        self._seq += 1
        self._pending = []
        for stream in list(self._streams):
            stream._offer(batch)
        if not self._streams:
            self._detach()

    # ------------------------------------------------------------------ page keys

    def _known(self, node: Node) -> list[bytes] | None:
        n = len(node.key) // self._ps
        if node.hashes is not None and len(node.hashes) == n:
            return node.hashes
        cached = self._keys.get(node.id)
        if cached is None or len(cached) < n:
            return None
        if len(cached) > n:  # split since: the node kept the tail
            cached = self._keys[node.id] = cached[-n:]
        return cached

    def _node_keys(self, node: Node) -> list[bytes]:
        """The page keys of `node`; ancestors' keys are computed (once) as needed."""
        known = self._known(node)
        if known is not None:
            return list(known)
        chain = [node]
        prev = self._root
        parent = node.parent
        while parent is not None and parent.parent is not None:
            above = self._known(parent)
            if above is not None:
                prev = above[-1]
                break
            chain.append(parent)
            parent = parent.parent
        for n in reversed(chain):
            keys = chain_keys(prev, n.key, self._ps)
            self._keys[n.id] = keys
            prev = keys[-1]
        return list(self._keys[node.id])

    def _parent_key(self, node: Node) -> bytes | None:
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        return self._node_keys(parent)[-1]

    def _remember(self, node: Node, keys: list[bytes]) -> None:
        """Cache keys a snapshot computed, for a node whose changes still get events."""
        if self._attached and node.alive and node.id not in self._keys:
            self._keys[node.id] = keys


def hub_of(cache: HiCache) -> _Hub:
    hub: _Hub | None = getattr(cache, "_event_hub", None)
    if hub is None:
        hub = _Hub(cache)
        # NOTE: a closed cache never closes a hub made now: its streams would never end
        hub.closed = cache._core.state == "closed"
        cache._event_hub = hub  # type: ignore[attr-defined]
    return hub



def _soon_caller() -> Callable[[Callable[[], object]], object]:
    """How to run a callback on the current event loop's next turn, whatever the backend.

    NOTE: a batch is what changed during one turn of the loop, so the hub flushes from a
    callback the loop runs next, not from a task: the hub has no owner that could keep a
    task group open. anyio has no such call; its loop token holds the backend's own (the
    asyncio loop's `call_soon`, trio's `run_sync_soon`).
    """
    native = anyio.lowlevel.current_token().native_token
    call: Callable[[Callable[[], object]], object] | None = getattr(native, "call_soon", None)
    return call if call is not None else native.run_sync_soon  # type: ignore[attr-defined]
