"""Review of `aiohicache serve` under hostile and heavy HTTP traffic, over real sockets: clients
that stop reading, trickle or never finish a body, send bodies the JSON reader chokes on,
come by the hundred, disconnect at every stage, and a server stopped under all of that.

The rules: a client holds a generating turn, device pages and leases only while it takes its
answer; every answer is the no-cache server's (greedy); whatever clients do, the server ends
with nothing running, waiting or leased, the cache's invariants intact, and once stopped no
socket of its own left open.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import random
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp
import anyio

from aiohicache import ConfigError
from aiohicache.hf import tiny_llama
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, build_app, running_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads this process's sockets from /proc")

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def engine(**overrides: Any) -> Engine:
    fields: dict[str, Any] = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192}
    fields.update(overrides)
    return Engine(tiny_llama(seed=5, **MODEL), ByteTokenizer(), EngineConfig(**fields))


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 512 for i in range(n)]


def settled(eng: Engine) -> None:
    """Nothing generating, waiting or leased; the cache's invariants hold."""
    assert (eng.metrics.running, eng.metrics.waiting) == (0, 0)
    assert eng.cache is not None and eng.cache.stats().device_pages_leased == 0
    eng.cache.check_invariants()


async def until(condition: Callable[[], object], within: float) -> None:
    """Until `condition()` holds (what it watches has nothing to await); fails after
    `within` seconds."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def until_settled(eng: Engine, within: float = 10) -> None:
    """Handlers of clients that went away end on their own: wait for that, then `settled`."""
    with anyio.move_on_after(within):
        await until(lambda: not (eng.metrics.running or eng.metrics.waiting or (
            eng.cache is not None and eng.cache.stats().device_pages_leased)), within)
    settled(eng)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def server_sockets(port: int) -> set[int]:
    """The peer ports of this process's open TCP sockets whose local port is `port` (the
    server's side of its connections; the listening socket has none)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    peers = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for row in table:
            fields = row.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(local.split(":")[1], 16) == port \
                    and int(remote.split(":")[1], 16) != 0:
                peers.add(int(remote.split(":")[1], 16))
    return peers


def request_bytes(path: str, body: dict[str, Any] | bytes) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def stalled_client(url: str, body: dict[str, Any], path: str = COMPLETIONS,
                         ) -> socket.socket:
    """A client that sends a request, then reads nothing: a receive window of a couple of
    KiB and segments of 536 bytes (as across a real network: on loopback the kernel
    buffers a megabyte or more), so the server's writes back up after a few hundred
    tokens. The caller closes it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's least
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port_of(url)))
    await loop.sock_sendall(sock, request_bytes(path, {**body, "stream": True}))
    return sock


async def until_generation_stalls(eng: Engine, *, quiet: float = 0.3,
                                  within: float = 20) -> int:
    """Tokens generated once none more come for `quiet` seconds."""
    with anyio.fail_after(within):
        seen = -1
        while eng.metrics.generated_tokens != seen or not eng.metrics.generated_tokens:
            seen = eng.metrics.generated_tokens
            await asyncio.sleep(quiet)
    return seen


async def answer(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                 stream: bool) -> list[int] | int:
    """The generated ids of a request, streamed or not; its status if not 200 (a 503 must
    say when to retry)."""
    async with session.post(f"{url}{path}", json={**body, "stream": stream}) as resp:
        if resp.status != 200:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1", resp.status
            assert (await resp.json())["error"]["type"] == "server_busy"
            return resp.status
        if not stream:
            ids: list[int] = (await resp.json())["aiohicache"]["token_ids"]
            return ids
        ids, done = [], False
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                ids += json.loads(line[6:])["token_ids"]
        assert done
        return ids


def workload() -> list[tuple[str, dict[str, Any]]]:
    """Twelve greedy requests, completions and chats, sharing prefixes."""
    base = prompt_of(64, 1)
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(12):
        body: dict[str, Any] = {"max_tokens": 8, "temperature": 0}
        if i < 4:
            out.append((COMPLETIONS, {**body, "prompt": base + prompt_of(8 * i, 2)}))
        elif i < 8:
            out.append((CHAT, {**body, "messages": [
                {"role": "system", "content": "be brief " * 8},
                {"role": "user", "content": f"question {i}"}]}))
        else:
            out.append((COMPLETIONS, {**body, "prompt": "shared text prefix " * 4 + str(i)}))
    return out


async def no_cache_answers() -> list[list[int]]:
    async with engine(use_cache=False) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        got = [await answer(session, url, path, body, False) for path, body in workload()]
    assert all(isinstance(ids, list) for ids in got)
    return got  # type: ignore[return-value]


@asynccontextmanager
async def raw_connection(url: str) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                          asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


# ------------------------------------------------------------------ clients that stop reading


async def test_a_streaming_client_that_stops_reading_is_cut_off_and_frees_its_turn(
        caplog: pytest.LogCaptureFixture) -> None:
    """A client that stops reading its stream (its window full) held its generating turn,
    its device pages and leases for as long as it kept the connection open: the handler
    waited on the write for ever, with no timeout. `max_running` such clients, a few KiB
    of bandwidth each, starved every other request. A stream that takes no data for
    `stall_timeout` seconds is now cut off: the generation is closed first (turn and pages
    let go), then the connection is dropped."""
    caplog.set_level(logging.INFO, "aiohicache.serve")
    expected = (await no_cache_answers())[0]
    path, body = workload()[0]
    async with engine(max_running=1) as eng, \
            running_server(eng, stall_timeout=0.5) as url, aiohttp.ClientSession() as session:
        sock = await stalled_client(url, {"prompt": prompt_of(40, 3), "max_tokens": 4096,
                                          "temperature": 0})
        try:
            await until(lambda: eng.metrics.generated_tokens, 2)  # the stalled one's turn
            with anyio.fail_after(8):  # it stalls within ~1 s, and is cut off 0.5 s later
                got = await answer(session, url, path, body, False)
            assert got == expected
            assert eng.metrics.generated_tokens < 4096  # it did stall: cut off, not done
            await until_settled(eng)
            peer = sock.getsockname()[1]
            await until(lambda: peer not in server_sockets(port_of(url)), 2)  # dropped
        finally:
            sock.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("cut off a streaming client" in r.getMessage() for r in caplog.records)


async def test_a_client_reading_slowly_but_steadily_is_not_cut_off() -> None:
    """The stall timeout bounds a wait for the client to take data, not the stream: a
    client that reads a little every so often gets its whole answer."""
    async with engine() as eng, running_server(eng, stall_timeout=0.5) as url:
        sock = await stalled_client(url, {"prompt": prompt_of(40, 4), "max_tokens": 1500,
                                          "temperature": 0})
        loop, received = asyncio.get_running_loop(), bytearray()
        try:
            with anyio.fail_after(20):
                while not received.endswith(b"0\r\n\r\n"):  # the chunked stream's end
                    await asyncio.sleep(0.25)  # reads nothing for half the stall timeout
                    with anyio.move_on_after(0.05):  # then all it can for a moment
                        while not received.endswith(b"0\r\n\r\n"):
                            received += await loop.sock_recv(sock, 1 << 16)
        finally:
            sock.close()
        assert b"data: [DONE]" in received
        assert eng.metrics.generated_tokens == 1500
        await until_settled(eng)


def test_the_stall_timeout_must_be_positive() -> None:
    eng = engine()
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="stall_timeout"):
            build_app(eng, stall_timeout=bad)


# ------------------------------------------------------------------ hostile bodies


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": [1' + b"0" * 5000 + b"]}",
], ids=["max_tokens", "prompt"])
async def test_a_number_too_long_for_python_to_read_is_a_400(
        body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """An integer literal of more than 4,300 digits makes `json.loads` raise a plain
    `ValueError` (CPython's int conversion limit), which the body reader did not catch: a
    500 and a traceback logged, for each such request."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        async with session.post(f"{url}{COMPLETIONS}", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            message = (await resp.json())["error"]["message"]
        assert message.startswith("the body:") and "4300 digits" in message
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        settled(eng)


@pytest.mark.parametrize(("body", "status"), [
    (b"[" * 100_000 + b"]" * 100_000, 400),
    (b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413),
    (b'{"prompt": "x", "temperature": NaN}', 400),
    (b'{"prompt": "\xff"}', 400),
    (b"", 400),
], ids=["deep", "deep-messages", "over-client-max-size", "nan", "not-utf8", "empty"])
async def test_hostile_bodies_get_a_4xx_and_touch_nothing(body: bytes, status: int) -> None:
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        for path in (COMPLETIONS, CHAT):
            async with session.post(f"{url}{path}", data=io.BytesIO(body),
                                    headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == status
        assert eng.metrics.requests == 0
        settled(eng)


async def test_a_body_trickled_or_never_finished_holds_no_turn() -> None:
    """A client that sends its headers, then its body a byte at a time (or never all of
    it), waits before the engine: the other requests are served meanwhile."""
    expected = await no_cache_answers()
    path, body = workload()[0]
    data = request_bytes(path, body)
    head, rest = data[:data.index(b"\r\n\r\n") + 4], data[data.index(b"\r\n\r\n") + 4:]
    async with engine(max_running=1) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session, \
            raw_connection(url) as (_, never), raw_connection(url) as (reader, trickle):
        never.write(head + rest[:5])  # and no more
        trickle.write(head)
        for i in range(len(rest)):
            trickle.write(rest[i:i + 1])
            await trickle.drain()
            if i % 8 == 0:
                got = await answer(session, url, path, body, stream=i % 16 == 0)
                assert got == expected[0]
        assert b" 200 OK" in await reader.readline()
        assert eng.metrics.waiting == 0
    await until_settled(eng)


# ------------------------------------------------------------------ many clients


async def test_hundreds_of_mixed_requests_get_the_no_cache_answers_or_a_503() -> None:
    """300 requests at once (completions and chats, streamed and not, over reused
    keep-alive connections) against 4 turns and 40 waiting places, with /metrics and
    /health scraped meanwhile: each gets the no-cache answer or a 503 with Retry-After,
    and the gauges return to 0."""
    expected = await no_cache_answers()
    requests = workload()
    async with engine(max_running=4, max_waiting=40, device_tokens=1024,
                      host_tokens=2048) as eng, \
            running_server(eng) as url, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:

        async def one(k: int) -> None:
            path, body = requests[k % len(requests)]
            got = await answer(session, url, path, body, stream=k % 3 == 0)
            assert got == 503 or got == expected[k % len(requests)], k

        async def scrape() -> None:
            for _ in range(50):
                async with session.get(f"{url}/metrics") as resp:
                    assert resp.status == 200 and "aiohicache_requests_running" in \
                        await resp.text()
                async with session.get(f"{url}/health") as resp:
                    assert (await resp.json()) == {"status": "ok"}

        await asyncio.gather(*(one(k) for k in range(300)), scrape(), scrape())
        assert 0 < eng.metrics.busy_rejections < 300
        await until_settled(eng)
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        assert "aiohicache_requests_running 0\n" in text
        assert "aiohicache_requests_waiting 0\n" in text


async def test_requests_in_turn_on_one_keep_alive_connection() -> None:
    expected = await no_cache_answers()
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1)) as session:
        for k, (path, body) in enumerate(workload() * 3):
            assert await answer(session, url, path, body, stream=k % 2 == 0) == \
                expected[k % 12]
        assert len(server_sockets(port_of(url))) == 1
        settled(eng)


async def test_clients_that_disconnect_at_every_stage_leave_nothing_behind() -> None:
    """120 clients, completions and chats, streamed or not, that go away (a close or a
    reset) at every stage: mid body, waiting for a turn, in prefill, mid-stream, at the
    output commit. Then the server settles and still answers as the no-cache one."""
    expected = await no_cache_answers()
    rng = random.Random(7)
    async with engine(max_running=3, max_waiting=60) as eng, running_server(eng) as url:

        async def leave(k: int) -> None:
            path, body = workload()[k % 12]
            data = request_bytes(path, {**body, "max_tokens": 20, "stream": k % 4 < 2})
            async with raw_connection(url) as (_, writer):
                writer.write(data[:len(data) // 2] if k % 17 == 0 else data)
                await writer.drain()
                await asyncio.sleep(rng.random() * 0.3)
                if k % 2:
                    writer.close()  # a FIN; the reset on the way out is the same then

        await asyncio.gather(*(leave(k) for k in range(120)))
        await until_settled(eng)
        async with aiohttp.ClientSession() as session:
            for k, (path, body) in enumerate(workload()):
                assert await answer(session, url, path, body, stream=k % 2 == 0) == \
                    expected[k]
        settled(eng)


# ------------------------------------------------------------------ stopping under load


async def test_a_stopped_server_drops_the_socket_of_a_client_that_reads_no_more() -> None:
    """aiohttp's close of a connection keeps its socket open while it has unsent data: the
    connection of a client that stopped reading outlived the server (its socket and
    buffered stream held for as long as the client kept it open)."""
    async with engine(max_running=1) as eng:
        async with running_server(eng, shutdown_timeout=0) as url:
            sock = await stalled_client(url, {"prompt": prompt_of(40, 5),
                                              "max_tokens": 4096, "temperature": 0})
            await until_generation_stalls(eng)
            assert len(server_sockets(port_of(url))) == 1
        try:
            settled(eng)
            await asyncio.sleep(0.1)
            assert server_sockets(port_of(url)) == set()
        finally:
            sock.close()


async def test_a_server_stopped_under_hostile_load_stops_in_time_and_leaks_nothing() -> None:
    """Stopped with streams stalled, bodies trickling, headers half sent, requests waiting
    for a turn and streams running: the stop takes the grace period and the unwinding, no
    more; then nothing runs, waits or is leased, no socket of the server is left and the
    cache closes."""
    eng = engine(max_running=2, max_waiting=100)
    grace = 0.5
    stalled: list[socket.socket] = []
    async with eng:
        async with running_server(eng, shutdown_timeout=grace) as url, \
                aiohttp.ClientSession() as session, \
                raw_connection(url) as (_, body_trickle), raw_connection(url) as (_, half):
            for seed in (6, 7):
                stalled.append(await stalled_client(url, {"prompt": prompt_of(40, seed),
                                                          "max_tokens": 4096,
                                                          "temperature": 0}))
            body_trickle.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                               b"Content-Length: 1000\r\n\r\n{")
            half.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
            await until_generation_stalls(eng)
            waiting = [asyncio.ensure_future(answer(session, url, *workload()[k % 12],
                                                    stream=k % 2 == 0)) for k in range(30)]
            await until(lambda: eng.metrics.waiting == 30, 5)
            start = time.perf_counter()
        took = time.perf_counter() - start
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, aiohttp.ClientError | int) for r in results), results
        assert took < grace + 3
        settled(eng)
        assert server_sockets(port_of(url)) == set()
    for sock in stalled:
        sock.close()
    assert eng.cache is not None and eng.cache.stats().health == "ok"
