"""KV events: what entered and left each tier, as an async stream and over ZMQ.

    async with cache.events() as stream:
        async for batch in stream:                 # EventBatch(seq, ts, events)
            for event in batch.events:             # BlockStored / BlockRemoved / AllBlocksCleared
                ...

`ZmqEventPublisher` sends the same batches in the wire format vLLM and SGLang use (topic,
8-byte big-endian sequence number, msgpack payload; optional replay socket), so routers built
for those engines can subscribe. Buffers are bounded everywhere: a subscriber that falls
behind loses whole batches (counted, and visible as a gap in `seq`); the cache never waits.
docs/observability.md describes every field.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

from .controller._l3_parts import shard
from .radix import Node
from .storage.keys import chain_keys, namespace_root

if TYPE_CHECKING:
    from .api import HiCache

__all__ = ("AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "EventStream",
           "KVEvent", "Medium", "ZmqEventPublisher", "encode_batch")

log = logging.getLogger(__name__)

Medium = Literal["device", "host", "storage"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages (blocks) now held by `medium`, in prefix order."""

    block_hashes: list[bytes]
    """Page keys (16-byte chained digests, the L3 keys; docs/storage.md)."""
    parent_block_hash: bytes | None
    """Key of the page before the first one; None at the start of a sequence."""
    token_ids: list[int]
    """The tokens of those pages (``len(block_hashes) * block_size``)."""
    block_size: int
    medium: Medium
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages `medium` no longer holds."""

    block_hashes: list[bytes]
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every page of L1 and L2 is gone (the cache closed)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one turn of the event loop, in the order the tiers changed."""

    seq: int
    """0, 1, 2, ... per cache; a gap means this subscriber dropped batches."""
    ts: float
    """Wall-clock time (`time.time()`) the batch was sealed."""
    events: list[KVEvent]


class EventStream:
    """One subscriber's bounded queue of batches; an async iterator and context manager.

    Leaving the block (or `aclose`) unsubscribes; so does dropping the last reference. Full
    (`max_batches` unread): new batches are dropped and counted in `dropped`.
    """

    __slots__ = ("__weakref__", "_closed", "_hub", "_max", "_queue", "_waiter", "dropped")

    def __init__(self, hub: _Hub, max_batches: int) -> None:
        self._hub = hub
        self._max = max_batches
        self._queue: deque[EventBatch] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.dropped = 0

    def _offer(self, batch: EventBatch) -> None:
        if len(self._queue) >= self._max:
            self.dropped += 1
            return
        self._queue.append(batch)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self) -> None:
        self._closed = True
        self._wake()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EventBatch:
        """The next batch; ends once the cache closed (after its last batch) or `aclose`.

        Cancellation: only the wait stops; no batch is lost.
        """
        while not self._queue:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def get_nowait(self) -> EventBatch | None:
        """The next queued batch, or None."""
        return self._queue.popleft() if self._queue else None

    async def aclose(self) -> None:
        self._hub.unsubscribe(self)
        self._end()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


class _Hub:
    """Turns the tree's residency changes into batches for the cache's subscribers.

    Hooked into the tree (and the L3 tier) only while someone subscribes. Per change it does
    O(pages of the node) work: the node's page keys, cached per node id (a node keeps its
    prefix for life; a split only cuts its front off, so the cached keys' tail stays right).
    """

    def __init__(self, cache: HiCache) -> None:
        cfg = cache.config
        self._tree = cache.tree
        self._storage = cache.storage
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def subscribe(self, max_batches: int, *, snapshot: bool) -> EventStream:
        stream = EventStream(self, max_batches)
        if self.closed:
            stream._end()
            return stream
        self._loop = asyncio.get_running_loop()
        self._streams.add(stream)
        if not self._attached:
            self._attached = True
            self._tree.on_residency.append(self._on_residency)
            if self._storage is not None:
                self._storage.on_stored.append(self._on_stored)
        if snapshot:
            stream._offer(EventBatch(seq=-1, ts=time.time(), events=self._snapshot()))
        return stream

    def unsubscribe(self, stream: EventStream) -> None:
        self._streams.discard(stream)
        if not self._streams:
            self._detach()

    def _detach(self) -> None:
        if self._attached:
            self._attached = False
            self._tree.on_residency.remove(self._on_residency)
            if self._storage is not None:
                self._storage.on_stored.remove(self._on_stored)
            self._keys.clear()

    def close(self) -> None:
        """The cache closed: a last batch with `AllBlocksCleared`, then every stream ends."""
        if self.closed:
            return
        self._pending.append(AllBlocksCleared())
        self._flush()
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

    def _on_stored(self, node: Node, pages: list[int]) -> None:
        keys, ps = self._node_keys(node), self._ps
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
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
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

    def _snapshot(self) -> list[KVEvent]:
        """BlockStored events for everything the tiers hold now (parents first)."""
        events: list[KVEvent] = []
        for node in self._tree.iter_nodes():
            for tier, present in (("device", node.on_device), ("host", node.on_host)):
                if present:
                    events.append(BlockStored(self._node_keys(node), self._parent_key(node),
                                              node.key.tolist(), self._ps,
                                              "device" if tier == "device" else "host"))
        return events


def hub_of(cache: HiCache) -> _Hub:
    hub: _Hub | None = getattr(cache, "_event_hub", None)
    if hub is None:
        hub = _Hub(cache)
        cache._event_hub = hub  # type: ignore[attr-defined]
    return hub


# ---------------------------------------------------------------------------- the wire


DEFAULT_MEDIUM_NAMES: Mapping[str, str] = {"device": "GPU", "host": "CPU", "storage": "DISK"}


def encode_batch(batch: EventBatch, *, hash_format: Literal["int", "bytes"] = "int",
                 medium_names: Mapping[str, str] = DEFAULT_MEDIUM_NAMES,
                 data_parallel_rank: int | None = None) -> bytes:
    """The msgpack payload vLLM's ``KVEventBatch`` decodes (msgspec ``array_like``, tagged).

    ``[ts, [event, ...]]`` (plus ``data_parallel_rank`` when set), each event an array led by
    its tag: ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``,
    ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``. With ``hash_format="int"``
    a key is its first 8 bytes as a big-endian unsigned int (as SGLang's 64-bit hashes).
    """
    import msgpack  # type: ignore[import-untyped]

    def h(key: bytes) -> int | bytes:
        return int.from_bytes(key[:8], "big") if hash_format == "int" else key

    events: list[list[Any]] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            events.append(["BlockStored", [h(k) for k in ev.block_hashes],
                           None if ev.parent_block_hash is None else h(ev.parent_block_hash),
                           ev.token_ids, ev.block_size, ev.lora_id, medium_names[ev.medium]])
        elif isinstance(ev, BlockRemoved):
            events.append(["BlockRemoved", [h(k) for k in ev.block_hashes],
                           medium_names[ev.medium]])
        else:
            events.append(["AllBlocksCleared"])
    body: list[Any] = [batch.ts, events]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last reply to a request."""


class ZmqEventPublisher:
    """Publishes a cache's KV events on a ZMQ PUB socket, vLLM/SGLang style.

    Each batch is one message of three frames: `topic`, the batch's sequence number (8 bytes,
    big-endian, 0 first), and `encode_batch`'s payload. With `replay_endpoint`, a ROUTER
    socket answers a request frame holding a start sequence number (8 bytes, big-endian) with
    every buffered batch from there (``[seq, payload]`` each, the last `buffer_steps` kept),
    then ``[-1, b""]``. A batch the PUB socket cannot take at once (past `hwm`) is dropped and
    counted in `dropped`; subscribers see the gap and replay it. Sequence numbers are the
    cache's batch numbers, so batches this publisher's own stream dropped (it fell
    `max_batches` behind) are gaps too, which replay cannot fill.

        async with HiCache(config) as cache, ZmqEventPublisher(cache, "tcp://*:5557",
                                                               replay_endpoint="tcp://*:5558"):
            ...

    Needs the ``metrics`` extra (pyzmq, msgpack).
    """

    def __init__(self, cache: HiCache, endpoint: str = "tcp://*:5557", *,
                 replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_batches: int = 1024,
                 hash_format: Literal["int", "bytes"] = "int",
                 medium_names: Mapping[str, str] = DEFAULT_MEDIUM_NAMES,
                 data_parallel_rank: int | None = None) -> None:
        self.cache = cache
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.hwm = hwm
        self.max_batches = max_batches
        self.hash_format = hash_format
        self.medium_names = dict(medium_names)
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0
        self.sent = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._tasks: list[asyncio.Task[None]] = []
        self._stream: EventStream | None = None
        self._ctx: Any = None
        self._pub: Any = None
        self._router: Any = None

    async def __aenter__(self) -> Self:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.sndhwm = self.hwm
        self._pub.bind(self.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.bind(self.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._serve_replay(),
                                                   name="aiohicache-events-replay"))
        self._stream = self.cache.events(max_batches=self.max_batches)
        self._tasks.append(asyncio.create_task(self._publish(self._stream),
                                               name="aiohicache-events-publish"))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Publish what is queued, then close the sockets. Idempotent."""
        if self._stream is not None:
            while (batch := self._stream.get_nowait()) is not None:
                self._send(batch)
            await self._stream.aclose()
            self._stream = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _publish(self, stream: EventStream) -> None:
        async for batch in stream:
            self._send(batch)

    def _send(self, batch: EventBatch) -> None:
        import zmq

        payload = encode_batch(batch, hash_format=self.hash_format,
                               medium_names=self.medium_names,
                               data_parallel_rank=self.data_parallel_rank)
        seq = batch.seq  # a batch the stream dropped is a gap here too (not replayable)
        self._buffer.append((seq, payload))
        try:
            # NOTE: a PUB socket never blocks; NOBLOCK makes "past the high-water mark" an
            # error we count instead of a silent drop.
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1
            log.debug("KV event batch %d dropped (PUB high-water mark)", seq)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 3:
                continue
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart(
                        [client, b"", seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([client, b"", END_SEQ, b""])

