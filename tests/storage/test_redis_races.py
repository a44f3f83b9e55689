"""Races of `RedisBackend` with cancellation, `aclose` and its pool, each found by the
randomized stress (``python -m tests.storage.stress_redis``) and pinned here against a real
redis-server of the test's own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
from redis.asyncio.connection import Connection

from aiohicache import ClosedError
from aiohicache._redis_server import RedisServer
from aiohicache.storage.redis import RedisBackend
from tests.storage.redis_server import raw_client

from .conftest import FMT, PAYLOAD, make_keys
from .conftest import page_views as pages


def buffers(n: int) -> list[memoryview]:
    return [memoryview(bytearray(PAYLOAD)) for _ in range(n)]


def clients_of(server: RedisServer) -> int:
    """Connections the server has, besides the one asking."""
    deadline = time.monotonic() + 2.0
    with raw_client(server.url()) as client:
        while True:  # NOTE: the server notices a closed connection at its next loop turn
            count = len(client.client_list()) - 1
            if count == 0 or time.monotonic() > deadline:
                return count
            time.sleep(0.02)


# ---------------------------------------------------------------------- aclose, calls in flight


async def test_a_call_sending_when_closed_ends_with_its_result_and_close_waits_for_it(
        own_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(3)
    sending, go_on = asyncio.Event(), asyncio.Event()
    real_send = Connection._send_packed_command

    async def slow_send(self: Connection, command: object) -> None:
        sending.set()
        await go_on.wait()
        await real_send(self, command)  # type: ignore[arg-type]

    b = RedisBackend(own_server.url(), FMT)
    await b.set_from(keys, pages(keys))
    monkeypatch.setattr(Connection, "_send_packed_command", slow_send)
    call = asyncio.ensure_future(b.delete(keys))
    await sending.wait()
    closing = asyncio.ensure_future(b.aclose())
    await asyncio.sleep(0.05)
    go_on.set()
    assert not closing.done()  # it waits for the call in flight...
    assert await call == 3  # ...which ends as if it were alone (was an AttributeError: the
    await closing  # connection's writer, gone mid-send)
    with pytest.raises(ClosedError):
        await b.exists(keys)
    assert clients_of(own_server) == 0


async def test_a_call_in_flight_when_closed_reopens_no_connection(
        own_server: RedisServer) -> None:
    keys = make_keys(3)
    b = RedisBackend(own_server.url(), FMT, socket_timeout=2.0, retries=1)
    await b.set_from(keys, pages(keys))
    own_server.pause()
    try:
        call = asyncio.ensure_future(b.get_into(keys, buffers(3)))
        await asyncio.sleep(0.1)  # the MGET sent, its reply awaited
        closing = asyncio.ensure_future(b.aclose())
        await asyncio.sleep(0.1)
    finally:
        own_server.resume()
    assert await call == [True] * 3
    await closing
    # NOTE: was 1: aclose dropped the call's connection, its retry opened another, and
    # nothing closed that one
    assert clients_of(own_server) == 0


# ---------------------------------------------------------------------- waiting for a connection


def _after_turns(turns: int, fn: Callable[[], object]) -> None:
    """Call `fn` on the loop's `turns`-th turn from now (0: the next)."""
    loop = asyncio.get_running_loop()
    if turns:
        loop.call_soon(_after_turns, turns - 1, fn)
    else:
        loop.call_soon(fn)


@pytest.mark.parametrize("limit", ["keyword", "url"])
async def test_a_waiter_cancelled_as_a_connection_frees_passes_it_on(
        own_server: RedisServer, limit: str) -> None:
    """`url`: ``max_connections`` in the URL sized redis-py's pool below the backend's own
    limit (the URL wins there), so callers waited in the pool again (a review found it)."""
    keys = make_keys(2)
    url, kwargs = (own_server.url(), {"max_connections": 1}) if limit == "keyword" else \
        (f"{own_server.url()}?max_connections=1", {})
    async with RedisBackend(url, FMT, **kwargs) as b:
        await b.set_from(keys, pages(keys))
        for turns in range(6):  # NOTE: the turn it must land on differs between loops
            own_server.pause()
            try:
                holder = asyncio.ensure_future(b.exists(keys))
                await asyncio.sleep(0.05)  # it holds the one connection, awaiting its reply
                first, second = (asyncio.ensure_future(b.exists(keys)) for _ in range(2))
                await asyncio.sleep(0.05)  # both wait for the connection
                holder.cancel()  # it gives the connection back and wakes `first`...
                _after_turns(turns, first.cancel)  # ...cancelled before it could run
                await asyncio.sleep(0.05)
            finally:
                own_server.resume()
            # NOTE: was a hang: redis-py's pool waits on an asyncio.Condition, which (Python
            # 3.11) drops a wake-up whose waiter is cancelled before it runs
            async with asyncio.timeout(2.0):
                assert await second == 2, f"cancelled {turns} turns after the wake-up"
            for task in (holder, first):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
