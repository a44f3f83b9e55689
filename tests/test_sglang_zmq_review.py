"""A review of the SGLang plug-in's shutdown and of the ZMQ publisher's end and counters.

Each test states a rule the docs promise and that the code broke."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from aiohicache import ConfigError
from aiohicache.events import AllBlocksCleared, BlockStored, EventBatch, ZmqEventPublisher
from tests.test_events_zmq import LOCAL, FakeCache, big_batch
from tests.test_sglang_plugin import MHAHostPool, indices, make_backend, page_hashes

# ---------------------------------------------------------------- ZMQ publisher


class Listener:
    """A router's SUB socket on a thread: every sequence number it receives, in order.
    It is slow to take its first batch, as a router busy with other work is."""

    def __init__(self, endpoint: str) -> None:
        self.seqs: list[int] = []
        self._ready, self._first = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self, endpoint: str) -> None:
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.rcvhwm = 1  # what it has not read waits in the publisher's queue
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._ready.set()
            while sub.poll(2000):  # the publisher is gone once nothing came for 2 s
                _, seq, _ = sub.recv_multipart()
                if not self.seqs:
                    self._first.set()
                    time.sleep(0.6)  # busy with its first batch: the next ones queue up
                self.seqs.append(int.from_bytes(seq, "big"))
        finally:
            ctx.destroy(linger=0)

    async def subscribed(self, fake: FakeCache) -> int:
        """Publish probe batches until one arrives (a SUB's subscription reaches the PUB
        socket some time after it connects; before that the PUB drops everything).
        Returns the next free sequence number."""
        seq = 0
        while not self._first.is_set():
            fake.emit(big_batch(seq, pages=1))
            seq += 1
            await asyncio.sleep(0.01)
        return seq

    def join(self) -> list[int]:
        self._thread.join(10)
        return self.seqs


async def test_leaving_the_block_delivers_the_last_batches_to_a_subscriber() -> None:
    """"Leaving the block publishes the changes made until then" (and the cache's last
    batch, `AllBlocksCleared`, which tells a router to forget this instance). The sockets
    were destroyed with linger 0 right after the last sends, so ZMQ threw away whatever it
    had not yet written to the subscriber's connection: the tail, `AllBlocksCleared` last
    of all, never reached a connected router."""
    fake = FakeCache()
    n, pages = 400, 4096  # 30 MB, cheap to encode: more than the kernel's socket buffers
    async with ZmqEventPublisher(fake, LOCAL, max_batches=n + 1,  # type: ignore[arg-type]
                                 hash_format="bytes") as pub:
        listener = await asyncio.to_thread(Listener, pub.endpoint)
        first = await listener.subscribed(fake)
        for seq in range(first, first + n):
            fake.emit(EventBatch(seq=seq, ts=0.0, events=[
                BlockStored([seq.to_bytes(16, "big")] * pages, None, [0] * pages, 1, "host")]))
        last = first + n
        fake.emit(EventBatch(seq=last, ts=0.0, events=[AllBlocksCleared()]))
    seqs = await asyncio.to_thread(listener.join)
    assert pub.sent == last + 1
    assert seqs[-1] == last, f"the subscriber's last batch is {seqs[-1]}, not {last}"
    assert seqs == sorted(set(seqs)) and set(range(first, last + 1)) <= set(seqs)


async def test_a_publisher_that_lags_counts_the_batches_it_never_sent() -> None:
    """`dropped` was documented as the batches the PUB socket refused past `hwm`; a PUB
    socket never refuses one (ZMQ drops it per subscriber, silently), so it read 0 for
    ever, while the batches the publisher's own stream dropped (it fell `max_batches`
    behind: gaps for every subscriber, which no replay can fill) were counted nowhere."""
    fake = FakeCache()
    async with ZmqEventPublisher(fake, LOCAL, max_batches=2) as pub:  # type: ignore[arg-type]
        for seq in range(10):  # no await: the publishing task cannot keep up
            fake.emit(big_batch(seq))
    assert (pub.sent, pub.dropped) == (2, 8)


async def test_past_the_high_water_mark_a_pub_socket_drops_silently() -> None:
    """What the docs now say of `hwm`: a subscriber that does not read loses batches
    without the publisher knowing (ZMQ's PUB never refuses a send); it sees the gap in
    `seq` and replays. `sent` counts what the socket took."""
    fake = FakeCache()
    n = 400
    async with ZmqEventPublisher(fake, LOCAL, hwm=1, max_batches=n) as pub:  # type: ignore[arg-type]
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.rcvhwm = 1
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.endpoint)
            await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
            for seq in range(n):
                fake.emit(big_batch(seq, pages=256))
            await asyncio.sleep(0.3)
            got = 0
            while await asyncio.to_thread(sub.poll, 200):
                sub.recv_multipart()
                got += 1
        finally:
            ctx.destroy(linger=0)
        assert pub.sent == n and pub.dropped == 0 and 0 < got < n


# ---------------------------------------------------------------- SGLang plug-in


def test_close_ends_a_call_in_flight_as_a_miss_with_storage_metrics_on(tmp_path: Path) -> None:
    """SGLang detaches the store while its prefetch thread may be mid-call; docs/serving.md:
    "a call another thread is waiting on when `close` runs ends at once as a miss". With
    ``enable_storage_metrics`` the call ended in a RuntimeError instead ("register_mem_pool_host()
    first (or closed)"), raised while recording the batch's bandwidth, which ended SGLang's
    prefetch thread."""
    backend = make_backend(f"file://{tmp_path}", enable_storage_metrics=True)
    backend.register_mem_pool_host(MHAHostPool(2))

    async def never(*_: Any) -> list[bool]:
        await asyncio.sleep(3600)  # a store that stopped answering
        return []

    backend._require().get_into = never  # type: ignore[method-assign,assignment]
    keys = page_hashes(list(range(4)))
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(backend.batch_get_v1, keys, indices(range(1)))
        time.sleep(0.2)  # the call is on the loop, waiting
        backend.close()
        assert got.result(timeout=5) == [False]


@pytest.mark.parametrize("call", ["batch_get_v1", "batch_set_v1"])
def test_a_batch_that_began_before_close_is_a_miss_not_an_error(tmp_path: Path,
                                                                call: str) -> None:
    """`close` may run between a batch's own steps (it sized its staging buffer from the
    store, and copies 128 pages into it, before the I/O goes to the loop): that batch must
    end as a miss, as one already waiting on the loop does, not raise into SGLang's
    thread."""
    backend = make_backend(f"file://{tmp_path}", enable_storage_metrics=True)
    backend.register_mem_pool_host(MHAHostPool(2))
    real = backend._staging

    def then_close(*args: Any) -> Any:  # SGLang detaches meanwhile, from another thread
        staging = real(*args)
        backend.close()
        return staging

    backend._staging = then_close  # type: ignore[method-assign,assignment]
    assert getattr(backend, call)(page_hashes(list(range(4))), indices(range(1))) == [False]


@pytest.mark.parametrize("bad", [-1, float("nan"), "1", 1e7])
async def test_a_bad_linger_is_a_config_error(bad: Any) -> None:
    """A linger past an hour (ZMQ takes an int of milliseconds: past ~2.1e6 s it overflowed
    at close, after the router was closed, leaking the sockets) is refused too."""
    with pytest.raises(ConfigError, match="linger_s"):
        ZmqEventPublisher(FakeCache(), LOCAL, linger_s=bad)  # type: ignore[arg-type]


def test_stopping_the_loop_thread_lets_the_cancelled_calls_clean_up() -> None:
    """`close` (SGLang's detach) cancels the calls other threads wait on; each must then run
    its clean-up on the loop before the loop stops. The loop was stopped at once: the
    cancelled tasks stayed pending, their `finally` blocks never ran (a connection or a
    lease not given back), "Task was destroyed but it is pending!" at exit."""
    import concurrent.futures
    import threading

    from aiohicache.sglang_plugin import _LoopThread

    thread = _LoopThread("review")
    started, cleaned = threading.Event(), threading.Event()

    async def stuck() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # clean-up that itself awaits
            cleaned.set()

    outcome: list[BaseException] = []

    def caller() -> None:
        try:
            thread.run(stuck, None)
        except BaseException as exc:  # what the caller saw is the point
            outcome.append(exc)

    waiter = threading.Thread(target=caller)
    waiter.start()
    assert started.wait(5)
    thread.stop()
    waiter.join(5)
    assert cleaned.is_set()
    assert thread.loop.is_closed()
    assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "soon"])
def test_a_bad_timeout_is_a_config_error(tmp_path: Path, bad: Any) -> None:
    """``extra_config["timeout_s"]`` bounds every call SGLang's threads wait on: 0 or less
    failed every call as a miss, NaN waited for ever; a config error names it."""
    with pytest.raises(ConfigError, match="timeout_s"):
        make_backend(f"file://{tmp_path}", extra={"timeout_s": bad})
