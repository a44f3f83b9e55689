"""Review of today's changes, adversarially: each test is a rule the change must keep.

Serving: a connection past ``max_connections`` closes the connection idle longest, as the
server's docs and ``--help`` say: one whose client has just been answered (a kept-alive
connection about to carry its next request) outlives one that has sat silent since it
opened. Closing by age instead made the real clients' long-lived keep-alive connections the
first victims of a flood of silent ones. And a connection that came while every other was
busy is refused only while the server is still full when it asks: once the others have
gone, its request is served (it was a 503 saying 1 connection was the most the server keeps).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp

from aiohicache.serve import running_server
from tests.serve.test_serve_load_review import (
    COMPLETIONS,
    engine,
    port_of,
    prompt_of,
    until_settled,
)

# ------------------------------------------------------------------ serve: max_connections


async def _get_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """Send ``GET /health`` on a kept-alive connection; its status (0: the server closed)."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def _closed_by_server(reader: asyncio.StreamReader, within: float = 2.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except (TimeoutError, ConnectionError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="real sockets")
async def test_a_connection_past_the_bound_closes_the_one_idle_longest_not_the_oldest() -> None:
    """Two connections kept at most: A opens first, then B, which sends nothing; A is then
    answered (idle for an instant since), so B has been idle longest. A third connection
    closes B, and A's next request on its kept-alive connection is answered."""
    async with engine() as eng, running_server(eng, max_connections=2) as url:
        port = port_of(url)
        a = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.2)
        b = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.5)  # B: silent since it opened
        assert await _get_health(*a) == 200  # A: just answered, kept alive
        c = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await _closed_by_server(b[0]), "the connection idle longest stayed open"
            assert await _get_health(*a) == 200, "the connection just answered was closed"
            assert await _get_health(*c) == 200
        finally:
            for _, writer in (a, b, c):
                writer.close()
        await until_settled(eng)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="real sockets")
async def test_a_connection_over_the_bound_is_served_once_the_others_have_gone() -> None:
    """Two connections kept at most, both streaming: a third that connects then is over the
    bound. The streams end and their clients close their connections; the third's request,
    sent after that, finds one connection open (its own) and is answered, not refused."""
    async with engine() as eng, running_server(eng, max_connections=2) as url:
        body = {"prompt": prompt_of(32, 3), "max_tokens": 100, "temperature": 0,
                "stream": True}
        async with aiohttp.ClientSession() as session:
            streams = [await session.post(f"{url}{COMPLETIONS}", json=body) for _ in range(2)]
            assert [s.status for s in streams] == [200, 200]
            late = await asyncio.open_connection("127.0.0.1", port_of(url))
            await asyncio.sleep(0.2)  # the server sees it: over the bound, none idle
            for stream in streams:
                assert (await stream.read()).endswith(b"data: [DONE]\n\n")
                stream.release()
        await asyncio.sleep(0.5)  # the streams' connections closed, the server saw it
        try:
            assert await _get_health(*late) == 200
        finally:
            late[1].close()
        await until_settled(eng)
