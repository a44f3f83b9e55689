"""Review of `aiohicache serve` at its edges, over real sockets: clients that open connections
and send nothing, more connections than the server keeps, prompt ids as a Python client
computes them.

The rules: a server's open files are bounded by the server, not by how many connections
clients open: one more connection closes the one idle longest, or, with every connection
busy, is refused with a clear 503, so a client that asks is answered at once; a prompt's
token ids are read as vLLM's pydantic reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp
from click.testing import CliRunner

from aiohicache import ConfigError
from aiohicache.cli import cli
from aiohicache.serve import running_server
from tests.serve.test_serve import serve_command
from tests.serve.test_serve_load_review import (
    COMPLETIONS,
    engine,
    port_of,
    prompt_of,
    server_sockets,
    settled,
    until_settled,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads sockets and open files from /proc")


def idle_connections(url: str, n: int) -> list[socket.socket]:
    """`n` connections to the server that send nothing (the caller closes them)."""
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # connecting: the kernel completes it
            sock.connect(("127.0.0.1", port_of(url)))
        socks.append(sock)
    return socks


async def ask(url: str, within: float = 10) -> tuple[int, dict[str, Any]]:
    """A short greedy completion on a new connection: its status and body."""
    timeout = aiohttp.ClientTimeout(total=within)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
            f"{url}{COMPLETIONS}", json={"prompt": "hello", "max_tokens": 2,
                                         "temperature": 0}) as resp:
        return resp.status, await resp.json()


# ------------------------------------------------------------------ connections


async def test_idle_connections_past_the_bound_make_room_for_a_client_that_asks() -> None:
    """40 connections that send nothing, to a server that keeps 8: each past the bound closes
    the one idle longest, so the server holds about 8 (not 40, each for the read timeout),
    and a client that then asks is answered at once."""
    async with engine() as eng, running_server(eng, max_connections=8) as url:
        socks = idle_connections(url, 40)
        try:
            await asyncio.sleep(0.5)  # the server accepts them
            status, body = await ask(url, within=5)
            assert status == 200 and body["usage"]["completion_tokens"] == 2
            assert len(server_sockets(port_of(url))) <= 8 + 1
        finally:
            for sock in socks:
                sock.close()
        await until_settled(eng)


async def test_with_every_connection_busy_one_more_is_a_503_not_a_wait() -> None:
    """With `max_connections` streams in flight, none idle to close, one more connection's
    request is refused at once (503, ``server_busy``, ``Retry-After``), and closed; the
    streams run on to their ends, and once they are done the server answers again."""
    async with engine() as eng, running_server(eng, max_connections=2) as url, \
            aiohttp.ClientSession() as session:
        body = {"prompt": prompt_of(32, 3), "max_tokens": 200, "temperature": 0,
                "stream": True}
        streams = [await session.post(f"{url}{COMPLETIONS}", json=body) for _ in range(2)]
        try:
            assert [s.status for s in streams] == [200, 200]
            status, refused = await ask(url, within=5)
            assert status == 503 and refused["error"]["type"] == "server_busy"
            assert "max_connections" in refused["error"]["message"]
            for stream in streams:
                assert (await stream.read()).endswith(b"data: [DONE]\n\n")
        finally:
            for stream in streams:
                stream.release()
        await session.close()  # its kept-alive connections are idle now: closed either way
        status, _ = await ask(url)
        assert status == 200
        await until_settled(eng)


async def test_max_connections_must_be_a_positive_int() -> None:
    async with engine() as eng:
        for bad in (0, -1, 2.5):
            with pytest.raises(ConfigError, match="max_connections"):
                async with running_server(eng, max_connections=bad):  # type: ignore[arg-type]
                    pass
    result = CliRunner().invoke(cli, ["serve", "--max-connections", "0"])
    assert result.exit_code == 2 and "'--max-connections'" in result.output


_SERVE_WITH_FEW_FILES = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))\n"
    "from aiohicache.cli import main\n"
    "sys.argv = ['aiohicache', *sys.argv[1:]]\n"
    "main()\n")


def serve_with_1024_files() -> contextlib.AbstractContextManager[
        tuple[subprocess.Popen[str], str]]:
    """`aiohicache serve` (tiny model, port 0) allowed 1,024 open files, until it printed its
    URL: the process and the URL. Killed at the end."""
    return serve_command(script=_SERVE_WITH_FEW_FILES)


def test_idle_connections_cannot_use_up_the_servers_open_files() -> None:
    """A server allowed 1,024 open files and 1,500 connections that send nothing: it keeps
    about half its files for connections by default, closes the idle ones past that, and
    answers a client that asks at once, before and after the idle ones go.

    NOTE: it accepted connections until the descriptors ran out (each held for the read
    timeout, 60 s): every other client waited in the listen queue, unanswered, while asyncio
    logged "Too many open files" with a traceback each second."""
    with serve_with_1024_files() as (proc, url):
        socks = idle_connections(url, 1500)
        try:
            time.sleep(1)  # the server accepts them
            status, body = asyncio.run(ask(url, within=5))
            assert status == 200 and body["usage"]["completion_tokens"] == 2
        finally:
            for sock in socks:
                sock.close()
        assert asyncio.run(ask(url, within=5))[0] == 200
        proc.terminate()
        proc.wait(30)
        output = proc.stdout.read() if proc.stdout is not None else ""
        assert proc.returncode == 0 and "Too many open files" not in output, output


# ------------------------------------------------------------------ prompts


async def test_prompt_ids_as_integral_floats_are_ids_as_in_vllm() -> None:
    """``[1.0, 2.0]`` (a Python client's ids after numpy or a division) are ids 1 and 2, as
    in every integer field here and in vLLM's pydantic models: the answer of ``[1, 2]``.
    A fraction, a boolean or a number past the vocabulary is still refused, naming
    ``prompt``."""
    ids = prompt_of(40, 7)
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:

        async def complete(prompt: object) -> dict[str, Any]:
            async with session.post(f"{url}{COMPLETIONS}", json={
                    "prompt": prompt, "max_tokens": 4, "temperature": 0}) as resp:
                return {**await resp.json(), "status": resp.status}

        exact = await complete(ids)
        for loose in ([float(t) for t in ids], [[float(t) for t in ids]]):
            got = await complete(loose)
            assert got["status"] == 200, got
            assert got["aiohicache"]["token_ids"] == exact["aiohicache"]["token_ids"]
            assert got["usage"]["prompt_tokens"] == 40
        for bad in ([1.5, 2.0], [True, 2], [1e300]):
            got = await complete(bad)
            assert got["status"] == 400 and got["error"]["param"] == "prompt", got
        got = await _raw_nan(url)
        assert got["status"] == 400 and got["error"]["param"] == "prompt", got
        settled(eng)


async def _raw_nan(url: str) -> dict[str, Any]:
    """A prompt of ``[NaN]``, which Python's JSON writes (and reads back)."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{COMPLETIONS}", data=b'{"prompt": [NaN], "max_tokens": 2}',
            headers={"Content-Type": "application/json"}) as resp:
        return {**await resp.json(), "status": resp.status}


async def test_a_prompt_exactly_at_the_context_length_less_one_is_served() -> None:
    """The longest prompt a model of 96 positions takes with ``max_tokens`` 1 is 95 tokens:
    answered, with the cached answer the recomputed one; 96 is a 400 naming ``prompt``."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        eng.max_positions = 96
        answers = []
        for n, status in ((95, 200), (95, 200), (96, 400)):
            async with session.post(f"{url}{COMPLETIONS}", json={
                    "prompt": prompt_of(n, 9), "max_tokens": 1, "temperature": 0}) as resp:
                assert resp.status == status
                answers.append(await resp.json())
        assert answers[0]["aiohicache"]["token_ids"] == answers[1]["aiohicache"]["token_ids"]
        assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        assert answers[2]["error"]["param"] == "prompt"
        settled(eng)
