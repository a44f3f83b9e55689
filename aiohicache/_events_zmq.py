"""KV events on the wire: vLLM's msgpack batch format over a ZMQ PUB socket."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, get_args

import anyio
import anyio.abc

from ._events_stream import BlockRemoved, BlockStored, EventBatch, EventStream, KVEvent, Medium
from ._validate import check_choice, check_int, check_number
from .errors import ConfigError

if TYPE_CHECKING:
    from .api import HiCache

__all__ = ("DEFAULT_MEDIUM_NAMES", "END_SEQ", "EventFormat", "HashFormat", "ZmqEventPublisher",
           "encode_batch")

log = logging.getLogger("aiohicache.events")


DEFAULT_MEDIUM_NAMES: Mapping[str, str] = {"device": "GPU", "host": "CPU", "storage": "DISK"}

HashFormat = Literal["int", "uint", "bytes"]
EventFormat = Literal["array", "map"]


def _hash_of(hash_format: HashFormat) -> Callable[[bytes], int | bytes]:
    """How a page key goes on the wire.

    NOTE: "int" is signed, as SGLang sends its hashes (`hash_str_to_int64`): SGLang's router
    decodes `block_hashes` as i64 and rejects the whole batch at a msgpack uint64 >= 2**63;
    Dynamo and llm-d read either sign as the same u64, vLLM's decoders any int.
    """
    if hash_format == "bytes":
        return bytes
    if hash_format == "uint":  # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES range
        return lambda key: int.from_bytes(key[:8], "big")
    return lambda key: int.from_bytes(key[:8], "big", signed=True)


def encode_batch(batch: EventBatch, *, hash_format: HashFormat = "int",
                 event_format: EventFormat = "array",
                 medium_names: Mapping[str, str] = DEFAULT_MEDIUM_NAMES,
                 data_parallel_rank: int | None = None) -> bytes:
    """The msgpack payload vLLM's and SGLang's ``KVEventBatch`` decode (tagged msgspec structs).

    ``[ts, [event, ...]]`` (plus ``data_parallel_rank`` when set). With ``event_format="array"``
    (msgspec ``array_like``, vLLM before PR #42892) each event is an array led by its tag:
    ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``,
    ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``; with ``"map"`` (vLLM since
    #42892, SGLang since #37482) a map of the same fields by name, the tag under ``"type"``.
    A key goes out as its first 8 bytes, big-endian: a signed int64 (``"int"``), unsigned
    (``"uint"``), or all 16 bytes (``"bytes"``).
    """
    import msgpack  # type: ignore[import-untyped]

    h = _hash_of(hash_format)
    events = [_event_fields(ev, h, medium_names) for ev in batch.events]
    body: list[Any] = [batch.ts, [_shaped(fields, event_format) for fields in events]]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def _event_fields(ev: KVEvent, h: Callable[[bytes], int | bytes],
                  medium_names: Mapping[str, str]) -> dict[str, Any]:
    """An event's fields by name in vLLM's declaration order, its tag first under "type".

    NOTE: `lora_name` (vLLM PR #27577) has no default: a vLLM decoder of 0.11.1 and later
    rejects a ``BlockStored`` without it, by position as by name.
    """
    if isinstance(ev, BlockStored):
        return {"type": "BlockStored", "block_hashes": [h(k) for k in ev.block_hashes],
                "parent_block_hash": (None if ev.parent_block_hash is None
                                      else h(ev.parent_block_hash)),
                "token_ids": ev.token_ids, "block_size": ev.block_size, "lora_id": ev.lora_id,
                "medium": medium_names[ev.medium], "lora_name": None}
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [h(k) for k in ev.block_hashes],
                "medium": medium_names[ev.medium]}
    return {"type": "AllBlocksCleared"}


def _shaped(fields: dict[str, Any], event_format: EventFormat) -> list[Any] | dict[str, Any]:
    return fields if event_format == "map" else list(fields.values())


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last reply to a request."""


class ZmqEventPublisher:
    """Publishes a cache's KV events on a ZMQ PUB socket, vLLM/SGLang style.

    Each batch is one message of three frames: `topic`, the batch's sequence number (8 bytes,
    big-endian, 0 first), and `encode_batch`'s payload. With `replay_endpoint`, a ROUTER
    socket answers a request frame holding a start sequence number (8 bytes, big-endian) with
    every buffered batch from there (``[seq, payload]`` each, the last `buffer_steps` kept),
    then ``[-1, b""]``. Past `hwm` batches queued for one subscriber, ZMQ drops the next ones
    for that subscriber, silently (a PUB socket never refuses a send, so nothing here can
    count them); it sees the gap in `seq` and replays it. Sequence numbers are the cache's
    batch numbers, so batches this publisher's own stream dropped (it fell `max_batches`
    behind) are gaps for every subscriber, which replay cannot fill: counted in `dropped`.
    So is a batch that cannot be encoded (a bug): it is skipped, logged at ERROR and counted
    in `failed`, and publishing goes on, as vLLM's publisher does; telemetry never stops the
    cache. `hash_format` and `event_format` pick the shapes a given router decodes (see
    `encode_batch`; docs/observability.md lists which router takes which).

    A replay waits for a slow client rather than drop what its pipe cannot take yet; one
    that takes longer than `replay_timeout_s` is abandoned (no end marker comes), since
    requests are served one at a time. Leaving the block publishes the changes made until
    then, waits up to `linger_s` for the PUB socket to hand what it still queues to the
    subscribers (on a worker thread: the loop runs meanwhile), and closes the sockets even
    when the block is cancelled.

        cache = HiCache(config)
        async with ZmqEventPublisher(cache, "tcp://*:5557",
                                     replay_endpoint="tcp://*:5558"), cache:
            ...

    Enter the publisher before the cache, as above, so that it closes after it: the cache's
    last batch, `AllBlocksCleared`, is published only then (subscribers drop what they knew of
    this instance on it). Entered inside the cache's block, it closes first and sends none.

    Needs the ``metrics`` extra (pyzmq, msgpack).

    Raises:
        ConfigError: an option is out of range, or `medium_names` lacks a medium (publishing
            would stop at its first event) or names an unknown one.
    """

    def __init__(self, cache: HiCache, endpoint: str = "tcp://*:5557", *,
                 replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_batches: int = 1024,
                 hash_format: HashFormat = "int", event_format: EventFormat = "array",
                 medium_names: Mapping[str, str] = DEFAULT_MEDIUM_NAMES,
                 data_parallel_rank: int | None = None,
                 replay_timeout_s: float = 10.0, linger_s: float = 1.0) -> None:
        self.cache = cache
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.hwm = check_int("hwm", hwm, low=1)  # NOTE: 0 is "no limit" to ZMQ
        self.max_batches = check_int("max_batches", max_batches, low=1)
        check_choice("hash_format", hash_format, get_args(HashFormat))
        check_choice("event_format", event_format, get_args(EventFormat))
        self.hash_format, self.event_format = hash_format, event_format
        self.medium_names = _checked_medium_names(medium_names)
        self.data_parallel_rank = (None if data_parallel_rank is None else
                                   check_int("data_parallel_rank", data_parallel_rank, low=0))
        self.replay_timeout_s = check_number("replay_timeout_s", replay_timeout_s, low=0,
                                             low_open=True)
        self.linger_s = check_number("linger_s", linger_s, low=0, high=3600)  # ZMQ: int ms
        self._dropped = 0
        """Batches the streams closed so far dropped (a stream is replaced on re-entry)."""
        self.sent = 0
        self.failed = 0
        self._buffer: deque[tuple[int, bytes]] = deque(
            maxlen=check_int("buffer_steps", buffer_steps, low=1))
        self._tasks: anyio.abc.TaskGroup | None = None
        self._stream: EventStream | None = None
        self._ctx: Any = None
        self._pub: Any = None
        self._router: Any = None

    async def __aenter__(self) -> Self:
        """Bind the sockets and start publishing.

        Raises:
            RuntimeError: the publisher is already open.
            zmq.ZMQError: an endpoint cannot be bound; nothing is left open.
        """
        if self._ctx is not None:
            raise RuntimeError("ZmqEventPublisher: already open")
        try:
            self._bind()
            self._stream = stream = self.cache.events(max_batches=self.max_batches)
        except BaseException:
            self._close_sockets()
            raise
        # NOTE: entering a task group has no checkpoint: nothing past here can fail.
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._contained, partial(self._publish, stream),
                               name="aiohicache-events-publish")
        if self._router is not None:
            self._tasks.start_soon(self._contained, self._serve_replay,
                                   name="aiohicache-events-replay")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    @property
    def dropped(self) -> int:
        """Batches this publisher never got to send: its stream fell `max_batches` behind
        the cache (gaps in `seq` for every subscriber, which replay cannot fill)."""
        return self._dropped + (0 if self._stream is None else self._stream.dropped)

    async def aclose(self) -> None:
        """Publish the changes made up to now, give the PUB socket up to `linger_s` to
        deliver them, then close the sockets. Idempotent.

        Call it from the task that entered the publisher (its task group is scoped there).

        Cancellation: the queued batches are sent before the first wait, and the sockets
        close whatever happens (the wait for delivery is shielded: at most `linger_s`);
        the cancellation is then re-raised.
        """
        tasks, self._tasks = self._tasks, None
        try:
            await self._send_the_rest()
            if tasks is not None:
                tasks.cancel_scope.cancel()
                # NOTE: re-raises a cancellation of the caller (this scope wraps its
                # `async with` body); the `finally` is what still closes the sockets.
                await tasks.__aexit__(None, None, None)
        finally:
            await self._linger_and_close()

    def _bind(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.sndhwm = self.hwm
        self._pub.bind(self.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            # NOTE: a plain ROUTER drops what a client's full pipe cannot take, the end
            # marker too; mandatory makes the send wait instead (or fail: client gone).
            self._router.router_mandatory = 1
            self._router.bind(self.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        """Close at once, dropping what the sockets still queue (nothing sent yet)."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes every socket it made
        self._ctx = self._pub = self._router = None

    async def _linger_and_close(self) -> None:
        """Close the sockets; the PUB socket's queue still goes out for up to `linger_s`.

        NOTE: ZMQ discards what a socket closed with linger 0 still queues: the last batches
        sent, `AllBlocksCleared` among them, never reached a subscriber that was a moment
        behind. The wait is the context's `term`, which blocks: on a worker thread. The
        sockets are closed here, on the loop, which watches their descriptors.
        """
        ctx, pub, router = self._ctx, self._pub, self._router
        self._ctx = self._pub = self._router = None
        if ctx is None:
            return
        if router is not None:
            router.close(linger=0)  # a replay in progress is abandoned anyway
        pub.close(linger=round(self.linger_s * 1000))
        with anyio.CancelScope(shield=True):  # bounded by linger_s
            await anyio.to_thread.run_sync(ctx.term)

    async def _send_the_rest(self) -> None:
        """Send what the stream holds, the open batch sealed into it first.

        NOTE: nothing here waits (`EventStream.aclose` never suspends), so a cancellation
        cannot cut it short.
        """
        stream = self._stream
        if stream is None:
            return
        await stream.aclose()
        while (batch := stream.get_nowait()) is not None:
            self._send(batch)
        self._stream, self._dropped = None, self._dropped + stream.dropped

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
            log.exception("KV event publisher task failed; it stopped")

    async def _publish(self, stream: EventStream) -> None:
        """Send each batch as it comes; `aclose` sends the rest (this may not have started)."""
        async for batch in stream:
            self._send(batch)

    def _send(self, batch: EventBatch) -> None:
        import zmq

        seq = batch.seq  # a batch the stream dropped is a gap here too (not replayable)
        try:
            payload = encode_batch(batch, hash_format=self.hash_format,
                                   event_format=self.event_format, medium_names=self.medium_names,
                                   data_parallel_rank=self.data_parallel_rank)
        except Exception:
            # NOTE: a bug, or `medium_names` edited since construction. Skipping the batch
            # keeps the later ones flowing; subscribers see its seq as a gap.
            self.failed += 1
            log.exception("KV event batch %d could not be encoded; skipped", seq)
            return
        if self.replay_endpoint is not None:  # else nobody can ask: up to GBs kept for none
            self._buffer.append((seq, payload))
        # NOTE: a PUB socket never blocks nor refuses: past a subscriber's high-water mark
        # ZMQ drops the message for that subscriber without telling (zmq.Again never comes)
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload],
                                 flags=zmq.NOBLOCK)
        self.sent += 1

    async def _serve_replay(self) -> None:
        """Answer replay requests one at a time, each for at most `replay_timeout_s`."""
        import zmq

        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 3:
                continue
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            with anyio.move_on_after(self.replay_timeout_s) as scope:
                try:
                    await self._replay(client, start)
                except zmq.ZMQError as exc:  # unroutable: the client left mid-replay
                    log.debug("KV event replay abandoned: %s", exc)
            if scope.cancelled_caught:
                log.warning("KV event replay to a client took over %gs; abandoned",
                            self.replay_timeout_s)

    async def _replay(self, client: bytes, start: int) -> None:
        for seq, payload in list(self._buffer):  # a copy: batches keep arriving meanwhile
            if seq >= start:
                await self._send_replay([client, b"", seq.to_bytes(8, "big"), payload])
        await self._send_replay([client, b"", END_SEQ, b""])

    async def _send_replay(self, frames: list[bytes]) -> None:
        """Send to one client, waiting while its pipe is full.

        Cancellation: the message is not sent (a multipart message goes whole or not at all).
        """
        import zmq

        while True:
            try:
                await self._router.send_multipart(frames)
                return
            except zmq.Again:
                # NOTE: a mandatory ROUTER is writable when any client's pipe has room; this
                # one's may still be full. Look again shortly.
                await anyio.sleep(_REPLAY_RETRY_S)


_REPLAY_RETRY_S = 0.005


def _checked_medium_names(names: Mapping[str, str]) -> dict[str, str]:
    """`names` as a dict, if it gives a str for each medium and names no other."""
    media = get_args(Medium)
    missing = [m for m in media if m not in names]
    if missing:
        raise ConfigError(f"medium_names: no name for {', '.join(map(repr, missing))} "
                          f"(publishing would stop at its first event); give one for each "
                          f"of {', '.join(map(repr, media))}")
    unknown = [k for k in names if k not in media]
    if unknown:
        raise ConfigError(f"medium_names: unknown medium {', '.join(map(repr, unknown))}; "
                          f"the media are {', '.join(map(repr, media))}")
    not_str = [k for k, v in names.items() if not isinstance(v, str)]
    if not_str:
        raise ConfigError(f"medium_names: the name of {', '.join(map(repr, not_str))} must "
                          f"be a str")
    return dict(names)
