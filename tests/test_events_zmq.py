"""The ZMQ publisher's lifecycle on real sockets: it releases them whatever way it ends,
rejects a config it could not publish with, survives a bad batch, and replays losslessly."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest
import zmq

from aiohicache import ConfigError
from aiohicache.events import (
    END_SEQ,
    BlockStored,
    EventBatch,
    EventStream,
    ZmqEventPublisher,
)
from tests.conftest import make_cache, make_tokens, prefill, until
from tests.test_events import settle

LOCAL = "tcp://127.0.0.1:*"


def open_contexts() -> int:
    """ZMQ contexts alive and not yet closed, anywhere in the process.

    NOTE: `type(o)`, not `isinstance`: that reads `o.__class__`, and some objects (torch's
    deprecated aliases) warn when touched.
    """
    return sum(issubclass(type(o), zmq.Context) and not o.closed for o in gc.get_objects())


def free_endpoint() -> str:
    """A TCP endpoint nobody binds (bound once, then released)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUB)
        return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    finally:
        ctx.destroy(linger=0)


def assert_released(*endpoints: str) -> None:
    """Each endpoint can be bound again at once: no socket of ours still holds it."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PUB) for _ in endpoints]  # held: a dropped one warns unclosed
    try:
        for sock, endpoint in zip(socks, endpoints, strict=True):
            sock.bind(endpoint)
    finally:
        ctx.destroy(linger=0)


def replay_from(endpoint: str, start: int = 0, *, read_after_s: float = 0.0,
                leave_after: int | None = None, poll_ms: int = 2000) -> tuple[list[int], bool]:
    """A router's replay request (blocking: run it in a thread). Returns the sequence
    numbers received and whether the end marker came. `read_after_s` models a client that
    reads slowly (the replay must wait for it, not outrun it); `leave_after` one that
    disconnects after that many batches."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.rcvhwm = 1
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        time.sleep(read_after_s)
        seqs: list[int] = []
        while sock.poll(poll_ms):
            _, seq, _ = sock.recv_multipart()
            if seq == END_SEQ:
                return seqs, True
            seqs.append(int.from_bytes(seq, "big"))
            if len(seqs) == leave_after:
                break
        return seqs, False
    finally:
        ctx.destroy(linger=0)


class FakeCache:
    """The one thing the publisher asks of a HiCache, a stream of batches; `emit` feeds it.

    It lets a test hand the publisher thousands of batches without running a cache."""

    def __init__(self) -> None:
        self.streams: list[EventStream] = []

    def events(self, *, max_batches: int) -> EventStream:
        stream = EventStream(self, max_batches)
        self.streams.append(stream)
        return stream

    def emit(self, batch: EventBatch) -> None:
        for stream in self.streams:
            stream._offer(batch)

    def flush(self) -> None:
        pass

    def unsubscribe(self, stream: EventStream) -> None:
        if stream in self.streams:
            self.streams.remove(stream)


def big_batch(seq: int, pages: int = 64, page_size: int = 16) -> EventBatch:
    keys = [seq.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(pages)]
    return EventBatch(seq=seq, ts=0.0, events=[
        BlockStored(keys, None, list(range(pages * page_size)), page_size, "host")])


# ---------------------------------------------------------------- sockets are released


Body = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


async def cancel_by_task(body: Body) -> None:
    entered = asyncio.Event()
    task = asyncio.create_task(body(entered))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def cancel_by_timeout(body: Body) -> None:
    entered = asyncio.Event()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as deadline, asyncio.TaskGroup() as tg:
            tg.create_task(body(entered))
            await entered.wait()
            deadline.reschedule(asyncio.get_running_loop().time())


async def cancel_by_scope(body: Body) -> None:
    entered = asyncio.Event()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(body, entered)
            await entered.wait()
            scope.cancel()
    assert scope.cancelled_caught


@pytest.mark.parametrize("cancel", [
    pytest.param(cancel_by_task, id="task.cancel"),
    pytest.param(cancel_by_timeout, id="asyncio.timeout"),
    pytest.param(cancel_by_scope, id="anyio.CancelScope"),
])
async def test_a_cancelled_block_closes_the_sockets(cancel: Callable[[Body], Any]) -> None:
    """A review: the cancellation re-raised by the task group's exit skipped the close,
    leaking the context and both bound sockets."""
    before = open_contexts()
    async with make_cache() as cache:
        pub = ZmqEventPublisher(cache, LOCAL, replay_endpoint=LOCAL)

        async def body(entered: asyncio.Event) -> None:
            async with pub:
                await prefill(cache, make_tokens(16))  # batches in flight when cancelled
                entered.set()
                await asyncio.Event().wait()

        await cancel(body)
        assert open_contexts() == before
        assert_released(pub.endpoint, str(pub.replay_endpoint))


@pytest.mark.parametrize("busy", ["endpoint", "replay_endpoint"])
async def test_a_failed_enter_closes_what_it_opened(busy: str) -> None:
    """A review: a bind failing after the context (and maybe the PUB socket) was made
    leaked them."""
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    taken = f"tcp://127.0.0.1:{holder.bind_to_random_port('tcp://127.0.0.1')}"
    endpoints = {"endpoint": free_endpoint(), "replay_endpoint": free_endpoint()}
    endpoints[busy] = taken
    before = open_contexts()
    try:
        async with make_cache() as cache:
            with pytest.raises(zmq.ZMQError):
                async with ZmqEventPublisher(cache, endpoints["endpoint"],
                                             replay_endpoint=endpoints["replay_endpoint"]):
                    pass
            assert open_contexts() == before
            assert_released(*(e for e in endpoints.values() if e != taken))
    finally:
        ctx.destroy(linger=0)


async def test_entering_twice_is_refused_and_leaks_nothing() -> None:
    """Entering an open publisher again dropped the first context, still bound."""
    before = open_contexts()
    async with make_cache() as cache:
        async with ZmqEventPublisher(cache, LOCAL) as pub:
            with pytest.raises(RuntimeError, match="already open"):
                await pub.__aenter__()
        assert open_contexts() == before
        assert_released(pub.endpoint)


# ---------------------------------------------------------------- bad config, bad batches


@pytest.mark.parametrize(("names", "match"), [
    pytest.param({"device": "GPU", "host": "CPU"}, "'storage'", id="missing"),
    pytest.param({"device": "GPU", "host": "CPU", "storage": "DISK", "disk": "SSD"}, "'disk'",
                 id="unknown"),
    pytest.param({"device": "GPU", "host": "CPU", "storage": 3}, "'storage'", id="not-str"),
])
async def test_bad_medium_names_are_a_config_error(names: dict[str, Any], match: str) -> None:
    """A review: a mapping without "storage" was taken, and publishing stopped at the first
    backup event (a KeyError in the publisher's task, logged as a warning)."""
    async with make_cache() as cache:
        with pytest.raises(ConfigError, match=rf"medium_names: .*{match}"):
            ZmqEventPublisher(cache, LOCAL, medium_names=names)


@pytest.mark.parametrize(("arg", "value"), [
    ("buffer_steps", 0), ("buffer_steps", -1), ("hwm", 0), ("max_batches", 0),
    ("hash_format", "hex"), ("data_parallel_rank", -1), ("replay_timeout_s", 0),
])
async def test_bad_options_are_a_config_error(arg: str, value: Any) -> None:
    """hash_format="hex" went out as bytes, hwm=0 is "unbounded" to ZMQ, max_batches=0 failed
    at enter with the sockets bound, buffer_steps=-1 a bare ValueError."""
    async with make_cache() as cache:
        with pytest.raises(ConfigError, match=arg):
            ZmqEventPublisher(cache, LOCAL, **{arg: value})


async def test_a_batch_that_cannot_be_encoded_is_skipped_and_publishing_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """A review: one batch failing to encode ended the publisher's task, so every later
    batch was silently never sent. Now it is logged at ERROR, counted in `failed`, and
    skipped (a gap in `seq`); the next batches go out."""
    async with make_cache() as cache, ZmqEventPublisher(cache, LOCAL,
                                                        replay_endpoint=LOCAL) as pub:
        del pub.medium_names["device"]  # changed after construction: the check can't see it
        await prefill(cache, make_tokens(8, seed=1))
        await settle(cache)
        assert pub.failed >= 1 and pub.sent == 0
        pub.medium_names["device"] = "GPU"
        await prefill(cache, make_tokens(8, seed=2))
        await settle(cache)
        assert pub.sent >= 1
        seqs, ended = await asyncio.to_thread(replay_from, str(pub.replay_endpoint))
        assert ended and len(seqs) == pub.sent and min(seqs) >= pub.failed
    errors = [r for r in caplog.records
              if r.name == "aiohicache.events" and r.levelno == logging.ERROR]
    assert len(errors) == pub.failed and "batch 0" in errors[0].getMessage()


# ---------------------------------------------------------------- replay


async def test_replay_waits_for_a_slow_client_and_loses_nothing() -> None:
    """The replay ROUTER dropped what a client's pipe could not take at once (ZMQ's
    high-water mark), the end marker included: a slow client got ~2000 of 3000 batches
    and then nothing, or a complete-looking reply with holes."""
    n = 3000
    fake = FakeCache()
    async with ZmqEventPublisher(fake, LOCAL, replay_endpoint=LOCAL,  # type: ignore[arg-type]
                                 max_batches=n, buffer_steps=n) as pub:
        for seq in range(n):
            fake.emit(big_batch(seq))
        await until(lambda: pub.sent == n)
        seqs, ended = await asyncio.to_thread(replay_from, str(pub.replay_endpoint),
                                              read_after_s=0.5)
        assert ended and seqs == list(range(n))


async def test_replay_survives_a_client_that_left_and_one_that_never_reads(
        caplog: pytest.LogCaptureFixture) -> None:
    """A client gone mid-replay (unroutable) or one that never reads (its pipe full) must
    neither end the replay service nor hold it past `replay_timeout_s`."""
    n = 3000
    fake = FakeCache()
    async with ZmqEventPublisher(fake, LOCAL, replay_endpoint=LOCAL,  # type: ignore[arg-type]
                                 max_batches=n, buffer_steps=n, replay_timeout_s=0.5) as pub:
        for seq in range(n):
            fake.emit(big_batch(seq))
        await until(lambda: pub.sent == n)
        gone = await asyncio.to_thread(replay_from, str(pub.replay_endpoint), leave_after=1)
        assert gone == ([0], False)
        stuck = zmq.Context()
        try:
            sock = stuck.socket(zmq.DEALER)
            sock.rcvhwm = 1
            sock.connect(str(pub.replay_endpoint))
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            assert await asyncio.to_thread(sock.poll, 5000)  # its replay began, and stalls
            seqs, ended = await asyncio.to_thread(replay_from, str(pub.replay_endpoint),
                                                  n - 5, poll_ms=5000)
        finally:
            stuck.destroy(linger=0)
        assert ended and seqs == list(range(n - 5, n))
    assert any("abandoned" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


# ---------------------------------------------------------------- nothing lost at the end


async def test_the_changes_just_before_leaving_are_published() -> None:
    """A review: `aclose` sent what its stream held, but the changes of the loop turn it
    ran in were not sealed into a batch yet: they were never published."""
    async with make_cache() as cache:
        async with ZmqEventPublisher(cache, LOCAL, replay_endpoint=LOCAL) as pub:
            await prefill(cache, make_tokens(16))
        assert pub.sent >= 1


async def test_without_a_replay_endpoint_no_batch_is_kept_for_replay() -> None:
    """Nobody can ask for a replay, yet every batch was kept (`buffer_steps` of them, about
    1.5 GB at the default with large batches)."""
    async with make_cache() as cache, ZmqEventPublisher(cache, LOCAL) as pub:
        await prefill(cache, make_tokens(16))
        await settle(cache)
        await until(lambda: pub.sent >= 1)
        assert not pub._buffer


async def test_a_publisher_entered_before_its_cache_publishes_all_blocks_cleared_last() -> None:
    """Subscribers (a KV-aware router) drop what they know of this instance on
    `AllBlocksCleared`; it comes when the cache closes, so the publisher must close after the
    cache: entered first, as documented."""
    import msgpack

    cache = make_cache()
    async with ZmqEventPublisher(cache, LOCAL, replay_endpoint=LOCAL) as pub, cache:
        await prefill(cache, make_tokens(16))
    last = msgpack.unpackb(pub._buffer[-1][1])
    assert last[1][-1] == ["AllBlocksCleared"]
    assert open_contexts() == 0
