"""Second review of `aiohicache serve`'s OpenAI-compatible face, as an OpenAI SDK user and an
operator probe it: errors in OpenAI's JSON shape for every path and method, fields named as
the client sent them, values typed as vLLM's protocol reads them, metrics scraped while a
stopping server drains, a bound on the requests the server holds before they reach the
engine, and a tiny model's answers that round-trip through its byte tokenizer so the next
chat turn is served their KV.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp
import anyio

from aiohicache.hf import tiny_llama
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, load_model, running_server
from tests.serve.test_serve_hardening_review import post, raw_connection, settled, streamed

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


async def until(predicate: Any, within: float = 10) -> None:
    """Until `predicate()` holds (it moves with the server's progress: no event to await)."""
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def engine(tokenizer: Any = None, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192}
    fields.update(overrides)
    return Engine(tiny_llama(seed=5, **MODEL), tokenizer or ByteTokenizer(),
                  EngineConfig(**fields))


def is_openai_error(body: object, status: int, expected_type: str | None = None) -> bool:
    """`body` is OpenAI's error shape: ``{"error": {message, type, param, code}}``."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if expected_type is not None:
        assert error["type"] == expected_type, (status, error)
    return True


async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
               path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request on a kept-alive raw connection; its status and body."""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return int(head.split(b" ")[1]), await reader.readexactly(length)


# ------------------------------------------------------------------ errors in OpenAI's shape


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/chat/completion", 404), ("POST", "/v1/embeddings", 404),
    ("GET", "/v1/completions", 405), ("POST", "/v1/models", 405),
    ("PUT", "/metrics", 405)])
async def test_unknown_paths_and_methods_are_openai_json_errors(method: str, path: str,
                                                                status: int) -> None:
    """aiohttp answered them in plain text (``404: Not Found``): an OpenAI client, which
    parses the body of every error as JSON, reported a decoding error instead of the
    server's. Now they are OpenAI's error shape, naming the method and path."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session, \
            session.request(method, f"{url}{path}", json={}) as resp:
        assert resp.status == status
        assert resp.content_type == "application/json"
        body = await resp.json()
    assert is_openai_error(body, status, "invalid_request_error")
    assert path in body["error"]["message"] and method in body["error"]["message"]


async def test_a_model_that_fails_is_a_json_500_and_the_server_goes_on() -> None:
    """A forward pass that raises (a CUDA out-of-memory is a RuntimeError) before the
    first token was aiohttp's plain-text 500; now OpenAI's JSON shape, type
    ``server_error``, and nothing is left behind."""
    eng = engine()

    def fail(*_: object) -> None:
        raise RuntimeError("CUDA out of memory")

    async with eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        hook = eng.model.register_forward_pre_hook(fail)
        async with session.post(f"{url}{CHAT}", json={"messages": HELLO}) as resp:
            assert resp.status == 500 and resp.content_type == "application/json"
            body = await resp.json()
        hook.remove()
        assert is_openai_error(body, 500, "server_error")
        assert "RuntimeError" not in body["error"]["message"]  # no internals shown
        got = await post(session, url, CHAT, {"messages": HELLO, "max_tokens": 2})
        assert got["status"] == 200
        settled(eng)


# ------------------------------------------------------------------ fields as sent


async def test_a_chat_too_long_for_its_max_completion_tokens_names_that_field() -> None:
    """A chat that sets ``max_completion_tokens`` (OpenAI's newer name, which the SDK's
    docs use) past the model's context was told of ``max_tokens``, a field it never sent;
    one that sets neither, with a prompt filling the context, was told of ``max_tokens 1``."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        eng.max_positions = 64
        long = await post(session, url, CHAT, {"messages": HELLO,
                                               "max_completion_tokens": 100})
        full = await post(session, url, CHAT, {
            "messages": [{"role": "user", "content": "x" * 64}]})
        plain = await post(session, url, COMPLETIONS, {"prompt": "hello", "max_tokens": 100})
    assert long["status"] == full["status"] == plain["status"] == 400
    assert long["error"]["message"] == \
        "messages: 29 tokens + max_completion_tokens 100 exceed the model's 64 positions"
    assert full["error"]["message"] == \
        "messages: 88 tokens + at least 1 generated exceed the model's 64 positions"
    assert plain["error"]["message"] == \
        "prompt: 5 tokens + max_tokens 100 exceed the model's 64 positions"


@pytest.mark.parametrize("stop", ["\ud800", ["ok", "a\udfffb"]])
async def test_a_stop_string_that_is_not_unicode_text_is_a_400_naming_stop(
        stop: object) -> None:
    """JSON can spell a lone surrogate; no decoded text ever holds one, so such a stop
    string was taken and could never match (the client's stop silently did nothing)."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        got = await post(session, url, COMPLETIONS, {"prompt": "hi", "stop": stop})
    assert got["status"] == 400
    assert got["error"]["message"].startswith("stop: not valid Unicode text")
    assert eng.metrics.requests == 0


# ------------------------------------------------------------------ types as vLLM reads them


@pytest.mark.parametrize(("options", "message"), [
    ("yes", "stream_options: an object"),
    ([], "stream_options: an object"),
    ({"include_usage": "false"}, "stream_options.include_usage: true or false"),
    ({"include_usage": 1}, "stream_options.include_usage: true or false"),
    ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats: not "
                                       "supported"),
])
async def test_stream_options_of_the_wrong_shape_are_refused_by_name(options: object,
                                                                     message: str) -> None:
    """vLLM reads ``stream_options`` into a model: a string is a 400, and so is an
    ``include_usage`` that is no boolean. Here a string was ignored and ``"false"`` read as
    true (usage sent to a client that asked for none). ``stream`` itself takes only true or
    false, and so does ``include_usage`` now; vLLM's ``continuous_usage_stats`` (usage in
    every chunk) is not implemented, so refused unless false."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        got = await post(session, url, CHAT, {"messages": HELLO, "stream": True,
                                              "stream_options": options})
        assert got["status"] == 400 and got["error"]["message"].startswith(message)
        for fine in ({}, None, {"include_usage": None, "continuous_usage_stats": False}):
            chunks = await streamed(session, url, CHAT, {"messages": HELLO, "max_tokens": 2,
                                                         "stream_options": fine})
            assert "usage" not in chunks[-1]  # usage only when asked for
        chunks = await streamed(session, url, CHAT, {
            "messages": HELLO, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_integral_floats_are_integers_as_in_vllm(path: str) -> None:
    """A Python client that computes a length sends ``8.0`` (``json.dumps`` of a float);
    vLLM's pydantic models read an integral float as the integer. ``"n": 1.0`` was refused
    as "not supported" (n 1 is), ``"max_tokens": 8.0`` and ``"seed": 3.0`` as not ints. A
    fraction is still refused."""
    body: dict[str, Any] = {"prompt": "hello"} if path == COMPLETIONS else {"messages": HELLO}
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        exact = await post(session, url, path, {**body, "max_tokens": 8, "seed": 3, "n": 1})
        loose = await post(session, url, path, {**body, "max_tokens": 8.0, "seed": 3.0,
                                                "n": 1.0})
        for field, value in (("max_tokens", 8.5), ("n", 1.5), ("n", 2.0), ("seed", 1e300)):
            got = await post(session, url, path, {**body, field: value})
            assert got["status"] == 400 and got["error"]["message"].startswith(f"{field}: ")
    assert exact["status"] == loose["status"] == 200
    assert loose["aiohicache"]["token_ids"] == exact["aiohicache"]["token_ids"]
    assert loose["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------ a model that fails


async def test_a_stream_whose_model_fails_ends_with_an_error_event_then_done() -> None:
    """A forward pass that raises mid-stream cut the stream with no word (a broken chunked
    answer, an ERROR traceback from aiohttp). Now, as vLLM's, an error event in OpenAI's
    shape (which the OpenAI SDK raises as the server's error), then ``[DONE]``; the
    generation unwinds and the server goes on."""
    eng = engine()
    passes = [0]

    def fail_third(*_: object) -> None:
        passes[0] += 1
        if passes[0] == 3:
            raise RuntimeError("CUDA out of memory")

    async with eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        hook = eng.model.register_forward_pre_hook(fail_third)
        chunks = await streamed(session, url, CHAT, {"messages": HELLO, "max_tokens": 8})
        hook.remove()
        assert [c["choices"][0]["delta"].get("content") is not None for c in chunks[:-1]] \
            == [True, True]  # the prefill's token, the first decode step's
        assert is_openai_error(chunks[-1], 200, "server_error")
        got = await post(session, url, CHAT, {"messages": HELLO, "max_tokens": 2})
        assert got["status"] == 200
        settled(eng)


# ------------------------------------------------------------------ load and shutdown


async def test_metrics_answer_while_a_stopping_server_drains() -> None:
    """A stopping server answered everything 503 while its requests drained, ``/metrics``
    too: Prometheus, scraping on its kept-alive connection, lost sight of the drain. Now
    ``/metrics`` answers (the running request shows); ``/health`` and new completions are
    503, so balancers and clients go elsewhere."""
    release = threading.Event()
    eng = engine()

    def hold(*_: object) -> None:
        release.wait(20)

    eng.model.register_forward_pre_hook(hold)
    stop, ready, urls = anyio.Event(), anyio.Event(), []

    async def serve() -> None:
        async with running_server(eng, shutdown_timeout=30) as url:
            urls.append(url)
            ready.set()
            await stop.wait()

    try:
        async with eng, anyio.create_task_group() as tg:
            tg.start_soon(serve)
            await ready.wait()
            async with raw_connection(urls[0]) as (reader, writer), \
                    aiohttp.ClientSession() as session:
                running = asyncio.ensure_future(post(session, urls[0], COMPLETIONS,
                                                     {"prompt": "hi", "max_tokens": 2}))
                await until(lambda: eng.metrics.running == 1)
                assert (await http(reader, writer, "GET", "/metrics"))[0] == 200
                stop.set()
                with anyio.fail_after(10):  # the stop begins: sites close, then the drain
                    while (await http(reader, writer, "GET", "/health"))[0] != 503:  # noqa: ASYNC110
                        await asyncio.sleep(0.01)
                status, text = await http(reader, writer, "GET", "/metrics")
                assert status == 200 and b"\naiohicache_requests_running 1\n" in text
                status, body = await http(reader, writer, "POST", COMPLETIONS,
                                          b'{"prompt": "x"}')
                assert status == 503 and is_openai_error(json.loads(body), 503)
                release.set()
                assert (await running)["status"] == 200  # drained, not cut
    finally:
        release.set()


class GatedTokenizer(ByteTokenizer):
    """Bytes, but a long text waits at `gate` (a slow tokenizer, or one busy with others'
    long prompts)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def encode(self, text: str) -> list[int]:
        if len(text) > 4096:
            self.gate.wait(20)
        return super().encode(text)


async def test_requests_past_max_running_plus_max_waiting_are_refused_before_their_body(
        ) -> None:
    """`max_waiting` bounded only requests already tokenized: any number of clients could
    each have a body of up to 1 MiB read, parsed (tens of MB as lists of messages or token
    ids) and queued for the one tokenizer thread, past the bound meant to shed that load.
    Now at most ``max_running + max_waiting`` requests are in the server, reading,
    tokenizing, waiting or generating; one more is a 503 ``server_busy`` with
    ``Retry-After`` before its body is read, counted as a busy rejection."""
    tok = GatedTokenizer()
    long = {"prompt": "y" * 4100, "max_tokens": 1}
    async with engine(tok, max_running=1, max_waiting=1) as eng, \
            running_server(eng) as url, aiohttp.ClientSession() as session:

        async def send() -> tuple[int, str | None, dict[str, Any]]:
            async with session.post(f"{url}{COMPLETIONS}", json=long) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        tasks = [asyncio.ensure_future(send()) for _ in range(5)]
        try:
            await until(lambda: sum(t.done() for t in tasks) == 3)
            refused = [t.result() for t in tasks if t.done()]
            assert all(status == 503 and retry == "1" and
                       body["error"]["type"] == "server_busy" for status, retry, body in refused)
            assert "max_running + max_waiting" in refused[0][2]["error"]["message"]
            assert (eng.metrics.busy_rejections, eng.metrics.requests) == (3, 0)
        finally:
            tok.gate.set()
        results = await asyncio.gather(*tasks)
        assert sorted(status for status, _, _ in results) == [200, 200, 503, 503, 503]
        assert (await post(session, url, COMPLETIONS, {"prompt": "z", "max_tokens": 1})
                )["status"] == 200  # the room is given back
        settled(eng)


# ------------------------------------------------------------------ the byte tokenizer


async def test_a_tiny_model_answer_quoted_next_turn_is_served_its_kv() -> None:
    """The byte tokenizer wrote ids past 255 as ``<id>`` and read that text back as its
    bytes: a chat's next turn, quoting the tiny model's answer, was other tokens than the
    answer, so only the earlier prompt hit the cache, never the answer's KV (cached with
    the output). Given the model's vocabulary, ``<id>`` now reads back as the id; text
    that is no such id (``<12>``, ``<99999>``, a leading zero) stays bytes. (A model of
    4,096 ids: bytes past ASCII, which decode as U+FFFD unless they make UTF-8, are rare.)"""
    assert ByteTokenizer(512).encode("a<300><12><99999><0300><512><511>") == \
        [97, 300, *b"<12><99999><0300><512>", 511]
    tok = ByteTokenizer(4096)
    assert load_model()[1].vocab_size == 32000  # the default tiny model's, read back too
    first_turn = [{"role": "user", "content": "hello there"}]
    eng = Engine(tiny_llama(seed=5, **{**MODEL, "vocab_size": 4096}), tok,
                 EngineConfig(page_size=16, device_tokens=2048, host_tokens=8192))
    async with eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        first = await post(session, url, CHAT, {"messages": first_turn, "max_tokens": 32,
                                                "temperature": 0})
        answer, ids = first["choices"][0]["message"]["content"], first["aiohicache"]["token_ids"]
        assert tok.encode(answer) == ids and any(i >= 256 for i in ids)
        second = await post(session, url, CHAT, {"temperature": 0, "max_tokens": 1, "messages": [
            *first_turn, {"role": "assistant", "content": answer},
            {"role": "user", "content": "and then?"}]})
        settled(eng)
    prompt = first["usage"]["prompt_tokens"]
    # the answer's KV is cached but for its last token's (never computed), by whole pages
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        (prompt + len(ids) - 1) // 16 * 16 > prompt // 16 * 16


async def test_a_model_is_retrieved_by_its_id_and_another_is_a_404() -> None:
    """``GET /v1/models/{id}`` (the OpenAI SDK's ``models.retrieve``) was a 404 for every
    id: the served model's card now, and for another id a 404 ``model_not_found``."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models/tiny-llama") as resp:
            assert resp.status == 200
            assert await resp.json() == {"id": "tiny-llama", "object": "model",
                                         "created": 0, "owned_by": "aiohicache"}
        async with session.get(f"{url}/v1/models/org/other") as resp:
            body = await resp.json()
        assert resp.status == 404 and is_openai_error(body, 404, "invalid_request_error")
        assert body["error"]["code"] == "model_not_found"


async def test_stream_options_without_a_stream_are_refused() -> None:
    """``stream_options`` on a request that does not stream was ignored unsaid (OpenAI and
    vLLM refuse it): a client that asked for a usage chunk believed it would get one."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": HELLO})):
            got = await post(session, url, path, {**body, "max_tokens": 1,
                                                  "stream_options": {"include_usage": True}})
            assert got["status"] == 400
            assert got["error"]["message"] == 'stream_options: only with "stream": true'
            got = await post(session, url, path, {**body, "max_tokens": 1,
                                                  "stream_options": None})
            assert got["status"] == 200
        assert eng.metrics.requests == 2


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", 5]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, "model"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content")])
async def test_an_error_names_the_field_in_param_as_openai_does(path: str, body: dict[str, Any],
                                                                 param: str) -> None:
    """OpenAI's errors carry the field at fault in ``param``; it was always null."""
    async with engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        got = await post(session, url, path, body)
    assert got["status"] in (400, 404) and got["error"]["param"] == param, got
