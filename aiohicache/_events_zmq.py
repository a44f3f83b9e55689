"""KV events on the wire: vLLM's msgpack batch format over a ZMQ PUB socket."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import anyio
import anyio.abc

from ._events_stream import BlockRemoved, BlockStored, EventBatch, EventStream

if TYPE_CHECKING:
    from .api import HiCache

__all__ = ("DEFAULT_MEDIUM_NAMES", "END_SEQ", "ZmqEventPublisher", "encode_batch")

log = logging.getLogger("aiohicache.events")


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
        self._tasks: anyio.abc.TaskGroup | None = None
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
        self._stream = self.cache.events(max_batches=self.max_batches)
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._contained, self._publish,
                               name="aiohicache-events-publish")
        if self._router is not None:
            self._tasks.start_soon(self._contained, self._serve_replay,
                                   name="aiohicache-events-replay")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Publish what is queued, then close the sockets. Idempotent.

        Call it from the task that entered the publisher (its task group is scoped there).
        """
        if self._stream is not None:
            while (batch := self._stream.get_nowait()) is not None:
                self._send(batch)
            await self._stream.aclose()
            self._stream = None
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()
            await self._tasks.__aexit__(None, None, None)
            self._tasks = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @staticmethod
    async def _contained(work: Callable[[], Awaitable[None]]) -> None:
        """Run a publisher task; a failure ends that task only (logged), never the caller's
        block: the task group would otherwise cancel the code inside ``async with``.

        `work` is called here, not before: a coroutine made ahead of a task cancelled before
        its first step would never be awaited.
        """
        try:
            await work()
        except Exception:
            log.warning("KV event publisher task failed", exc_info=True)

    async def _publish(self) -> None:
        assert self._stream is not None
        async for batch in self._stream:
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

