"""Review of `aiohicache serve`'s HTTP face as a demanding operator of an OpenAI-compatible
server probes it: clients that never finish sending a request, bodies over the limit,
special tokens in the text, errors that name the field the client sent, a request for
another model, and counters that say what the cache served.

The rules: a client gets a bounded time to send its request, then its connection is closed
and the server goes on serving others; every error is a JSON error naming what is wrong;
the text is what vLLM's would be (special tokens counted, not shown), streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp
import anyio
from click.testing import CliRunner

from aiohicache import ConfigError
from aiohicache.cli import cli
from aiohicache.hf import tiny_llama
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, build_app, running_server
from tests.serve.test_chat import word_tokenizer

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def engine(tokenizer: Any = None, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192}
    fields.update(overrides)
    return Engine(tiny_llama(seed=5, **MODEL), tokenizer or ByteTokenizer(),
                  EngineConfig(**fields))


def settled(eng: Engine) -> None:
    """Nothing generating, waiting or leased; the cache's invariants hold."""
    assert (eng.metrics.running, eng.metrics.waiting) == (0, 0)
    assert eng.cache is not None and eng.cache.stats().device_pages_leased == 0
    eng.cache.check_invariants()


async def post(session: aiohttp.ClientSession, url: str, path: str,
               body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{url}{path}", json=body) as resp:
        return {**await resp.json(), "status": resp.status}


async def streamed(session: aiohttp.ClientSession, url: str, path: str,
                   body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed answer, parsed (``[DONE]`` checked and left out)."""
    async with session.post(f"{url}{path}", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        lines = [line.strip() async for line in resp.content if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@asynccontextmanager
async def raw_connection(url: str) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                          asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


async def served_meanwhile(session: aiohttp.ClientSession, url: str) -> None:
    got = await post(session, url, COMPLETIONS, {"prompt": "hello", "max_tokens": 2,
                                                 "temperature": 0})
    assert got["status"] == 200 and got["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ requests that never arrive


async def test_a_connection_whose_headers_never_end_is_closed_after_the_read_timeout() -> None:
    """A slowloris: headers begun and never finished (a byte now and then). aiohttp closes
    such a connection only at its keep-alive timeout, an hour (3,630 s) by default: a few
    thousand of them held as many sockets and file descriptors. Now it is closed once
    `read_timeout` has passed since it opened; others are served meanwhile."""
    async with engine() as eng, running_server(eng, read_timeout=0.5) as url, \
            aiohttp.ClientSession() as session, raw_connection(url) as (reader, writer):
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        await served_meanwhile(session, url)
        with anyio.fail_after(8):
            for header in (b"X-A: 1\r\n", b"X-B: 2\r\n"):
                await asyncio.sleep(0.1)
                writer.write(header)
            assert await reader.read() == b""  # closed, with nothing to say
        await served_meanwhile(session, url)
        settled(eng)


async def test_a_body_that_never_arrives_gets_a_408_and_the_connection_is_closed() -> None:
    """``Content-Length: 1000000`` and ten bytes, then nothing: the handler waited for the
    rest for ever (a task and a connection held). Now, after `read_timeout`, a JSON 408
    naming the wait, then the connection closes; the request never reached the engine."""
    async with engine() as eng, running_server(eng, read_timeout=0.5) as url, \
            aiohttp.ClientSession() as session, raw_connection(url) as (reader, writer):
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000\r\n\r\n{\"prompt\":")
        await served_meanwhile(session, url)
        with anyio.fail_after(8):
            answer = await reader.read()  # to the end: the server closes
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"]["message"] == \
            "the request's body did not arrive within the read timeout (0.5 s)"
        assert eng.metrics.requests == 1  # the one served meanwhile
        settled(eng)


async def test_a_body_declared_over_the_size_limit_is_a_413_at_once() -> None:
    """A ``Content-Length`` over the 1 MiB limit is answered at once, a JSON 413 naming the
    limit, and the connection closed: the server read up to the limit first (or waited for
    ever for a body never sent), and answered in plain text."""
    async with engine() as eng, running_server(eng) as url, raw_connection(url) as (reader,
                                                                                     writer):
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000\r\n\r\n")
        with anyio.fail_after(8):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413 ")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
            # closed at once: aiohttp went on reading (and dropping) the body for 10 s
            assert await reader.read() == b""
        assert body["error"]["message"] == \
            "the request's body: 1000000000 bytes, more than the limit of 1048576"
        assert eng.metrics.requests == 0


async def test_a_body_sent_over_the_size_limit_is_a_json_413() -> None:
    """A body over the limit with no length said beforehand (chunked) is cut off at the
    limit: a 413 in OpenAI's JSON error shape (aiohttp's own is plain text), which a client
    library reads as an error message."""
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b" " * (512 << 10)

    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        async with session.post(f"{url}{COMPLETIONS}", data=chunks(),
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 413
            message = (await resp.json())["error"]["message"]
        assert message == "the request's body: more than the limit of 1048576 bytes"
        await served_meanwhile(session, url)
        settled(eng)


async def test_the_read_timeout_bounds_the_request_not_its_answer() -> None:
    """A generation that takes longer than `read_timeout`, streamed or not, on a connection
    kept alive for the next request, is not cut off: only a request's arrival is timed."""
    eng = engine()
    eng.model.register_forward_pre_hook(lambda *_: time.sleep(0.1))
    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0}
    async with eng, running_server(eng, read_timeout=0.5) as url, \
            aiohttp.ClientSession() as session:
        whole = await post(session, url, COMPLETIONS, body)
        chunks = await streamed(session, url, COMPLETIONS, body)
    assert whole["status"] == 200 and whole["usage"]["completion_tokens"] == 12
    assert [t for c in chunks for t in c["token_ids"]] == whole["aiohicache"]["token_ids"]


def test_the_read_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="read_timeout"):
        build_app(engine(), read_timeout=0)
    got = CliRunner().invoke(cli, ["serve", "--read-timeout", "0"])
    assert got.exit_code == 2 and "--read-timeout" in got.output


# ------------------------------------------------------------------ the text


def special_tokenizer() -> Any:
    """The word tokenizer with its role markers as special tokens (as a chat model's
    ``<|im_start|>``), and ``w309`` as its end of sequence."""
    tok = word_tokenizer(eos="w309")
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>",
                                                          "<|assistant|>"]})
    return tok


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_special_tokens_are_counted_but_not_in_the_text_streamed_or_not(
        path: str) -> None:
    """A generated special token (here ``<|assistant|>``, and the end of sequence that
    `ignore_eos` generates past) is a token of the completion, not text: vLLM decodes with
    ``skip_special_tokens`` by default. They were in the text, streamed and not."""
    tok = special_tokenizer()
    body: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"prompt": "w5 w6 w7 w8"} if path == COMPLETIONS else \
        {"messages": [{"role": "user", "content": "w5 w6 w7 w8"}]}
    async with engine(tok) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        whole = await post(session, url, path, body)
        chunks = await streamed(session, url, path, body)
        settled(eng)
    ids = whole["aiohicache"]["token_ids"]
    assert 3 in ids or 309 in ids  # a special token was generated, and counted
    assert whole["usage"]["completion_tokens"] == len(ids) == 12
    expected = tok.decode(ids, skip_special_tokens=True)
    if path == COMPLETIONS:
        text = whole["choices"][0]["text"]
        pieces = [c["choices"][0]["text"] for c in chunks]
    else:
        text = whole["choices"][0]["message"]["content"]
        pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert text == expected and "<|" not in text and "w309" not in text
    assert "".join(pieces) == expected
    assert [t for c in chunks for t in c["token_ids"]] == ids


# ------------------------------------------------------------------ errors


async def test_a_chat_the_model_cannot_take_is_an_error_naming_messages() -> None:
    """The engine's prompt errors name ``prompt``, the completions field: a chat client,
    which sent ``messages``, was told about a field it never sent."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        eng.max_positions = 64
        got = await post(session, url, CHAT, {
            "messages": [{"role": "user", "content": "x" * 80}], "max_tokens": 4})
        plain = await post(session, url, COMPLETIONS, {"prompt": "x" * 80, "max_tokens": 4})
    assert got["status"] == plain["status"] == 400
    assert got["error"]["message"].startswith("messages: ")
    assert "exceed the model's 64 positions" in got["error"]["message"]
    assert plain["error"]["message"].startswith("prompt: 80 tokens")


async def test_a_request_for_another_model_is_a_404_naming_the_served_one() -> None:
    """``"model": "gpt-4"`` was answered by whatever this server runs, as if it were
    gpt-4 (vLLM and OpenAI answer 404). The served model's name, or none, is answered."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        for path, body in ((COMPLETIONS, {"prompt": "x"}),
                           (CHAT, {"messages": [{"role": "user", "content": "x"}]})):
            got = await post(session, url, path, {**body, "model": "gpt-4", "max_tokens": 1})
            assert got["status"] == 404
            assert got["error"] == {"message": "model: 'gpt-4' is not served here (this "
                                               "server runs 'tiny-llama')",
                                    "type": "invalid_request_error", "param": "model",
                                    "code": "model_not_found"}
            for model in ("tiny-llama", None):
                got = await post(session, url, path, {**body, "model": model, "max_tokens": 1})
                assert got["status"] == 200
        got = await post(session, url, COMPLETIONS, {"prompt": "x", "model": 5})
        assert got["status"] == 400 and got["error"]["message"].startswith("model: ")
        assert eng.metrics.requests == 4


# ------------------------------------------------------------------ the length of a chat


async def test_a_chat_that_sets_no_length_runs_to_its_end_not_16_tokens() -> None:
    """OpenAI's chat has no default length (vLLM: what the context has room for); 16 is
    the legacy completions' default. A chat client that set none (the OpenAI SDK sets
    none) had every answer cut at 16 tokens, ``finish_reason: "length"``. Now a chat runs
    to its end of sequence, or the model's context, or the server's 4,096-token bound."""
    tok = word_tokenizer(eos="w176")  # greedy, the answer ends at its 7th token
    chat = {"messages": [{"role": "user", "content": "w5 w6 w7 w8"}], "temperature": 0}
    async with engine(tok) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        ended = await post(session, url, CHAT, chat)
        eng.eos_token_ids = frozenset()
        eng.max_positions = 6 + 30  # 6 prompt tokens: room for 30
        full = await post(session, url, CHAT, chat)
        plain = await post(session, url, COMPLETIONS, {"prompt": "w5 w6 w7 w8"})
        settled(eng)
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["usage"]["completion_tokens"] == 7 > 0
    assert full["usage"]["prompt_tokens"] == 6 and full["usage"]["completion_tokens"] == 30
    assert full["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 16  # the completions' default stays
