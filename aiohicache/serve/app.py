"""The HTTP face of the engine (aiohttp): OpenAI-compatible ``/v1/completions``, ``/metrics``,
``/health`` and ``/v1/models``.

Each request is its own task; its cache work (match, prefetch, load-back, commit) is awaited
in its handler. A client that disconnects cancels its handler (``handler_cancellation``):
the forward pass in flight finishes, the cache context exits, nothing leaks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
from aiohttp import web

from .. import ConfigError, HiCacheError
from .._validate import check_int, check_number
from .engine import Engine, SamplingParams, Usage

__all__ = ("build_app", "running_server", "serve")

ENGINE = web.AppKey("engine", Engine)
_MAX_TOKENS_LIMIT = 4096


class _BadRequest(Exception):
    """A request the server refuses (400), with the message the client sees."""


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving `engine` (open it before serving)."""
    app = web.Application()
    app[ENGINE] = engine
    app.add_routes([web.post("/v1/completions", completions), web.get("/metrics", metrics),
                    web.get("/health", health), web.get("/v1/models", models)])
    return app


@asynccontextmanager
async def running_server(engine: Engine, host: str = "127.0.0.1",
                         port: int = 0) -> AsyncIterator[str]:
    """Serve `engine` on ``host:port`` (0: a free port) while the block runs; yields the base
    URL, e.g. ``http://127.0.0.1:43121``."""
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        yield f"http://{_host_for_url(bound[0])}:{bound[1]}"
    finally:
        await runner.cleanup()


async def serve(engine: Engine, host: str, port: int, *, on_ready: Any = None) -> None:
    """Open `engine` and serve it until cancelled; ``on_ready(url)`` once listening.

    Cancellation: how it ends: the server stops accepting, in-flight handlers are cancelled
    (their cache contexts exit), the engine and its cache close.
    """
    async with engine, running_server(engine, host, port) as url:
        if on_ready is not None:
            on_ready(url)
        await anyio.sleep_forever()


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---------------------------------------------------------------------------- handlers


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _json_body(request)
        prompt = _prompt(engine, body.get("prompt"))
        params = _params(body)
        stream = _flag(body, "stream")
    except _BadRequest as exc:
        return _error(400, str(exc))
    usage = Usage(prompt_tokens=len(prompt))
    async with aclosing(engine.generate(prompt, params, usage)) as tokens:
        try:
            first = await anext(tokens)  # errors before any output are a clean HTTP error
        except ConfigError as exc:
            return _error(400, str(exc))
        except HiCacheError as exc:
            return _error(503, f"cache unavailable: {exc}", "server_error")
        head = _head(engine)
        if stream:
            return await _stream(request, head, first, tokens, usage, body)
        ids = [first] + [t async for t in tokens]
    return web.json_response({
        **head, "choices": [_choice(engine.tokenizer.decode(ids), "length")],
        "usage": _usage(usage), "aiohicache": {"token_ids": ids, "cached_tiers": usage.tiers}})


async def _stream(request: web.Request, head: dict[str, Any], first: int,
                  tokens: AsyncIterator[int], usage: Usage,
                  body: dict[str, Any]) -> web.StreamResponse:
    """Server-sent events: one chunk per token, then usage if asked for, then ``[DONE]``."""
    engine = request.app[ENGINE]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    token: int | None = first
    while token is not None:
        nxt = await anext(tokens, None)
        text = engine.tokenizer.decode([token])
        await _event(resp, {**head, "choices": [
            _choice(text, "length" if nxt is None else None)], "token_ids": [token]})
        token = nxt
    options = body.get("stream_options") or {}
    if isinstance(options, dict) and options.get("include_usage"):
        await _event(resp, {**head, "choices": [], "usage": _usage(usage),
                            "aiohicache": {"cached_tiers": usage.tiers}})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(text=engine.metrics.render(engine.cache),
                        content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    state = request.app[ENGINE].health
    return web.json_response({"status": state}, status=200 if state != "failed" else 503)


async def models(request: web.Request) -> web.Response:
    name = request.app[ENGINE].name
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "aiohicache"}]})


# ---------------------------------------------------------------------------- parsing


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


def _prompt(engine: Engine, prompt: object) -> list[int]:
    """A string, a list of token ids, or a batch of exactly one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(engine.tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise _BadRequest("prompt: a non-empty string or list of token ids (one prompt per "
                      "request)")


def _params(body: dict[str, Any]) -> SamplingParams:
    max_tokens = check_int("max_tokens", body.get("max_tokens", 16), low=1,
                           high=_MAX_TOKENS_LIMIT, error=_BadRequest)
    temperature = check_number("temperature", body.get("temperature", 1.0), low=0, high=2,
                               error=_BadRequest)
    seed = body.get("seed")
    if seed is not None:
        seed = check_int("seed", seed, low=-(1 << 63), high=(1 << 64) - 1,  # torch's range
                         error=_BadRequest)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise _BadRequest(f"{name}: true or false")
    return value


# ---------------------------------------------------------------------------- responses


def _head(engine: Engine) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": engine.name}


def _choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": None}}, status=status)
