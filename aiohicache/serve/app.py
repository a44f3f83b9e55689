"""The HTTP face of the engine (aiohttp): OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions``, ``/metrics``, ``/health`` and ``/v1/models``.

Each request is its own task; its cache work (match, prefetch, load-back, commit) is awaited
in its handler. A client that disconnects cancels its handler (``handler_cancellation``):
the forward pass in flight finishes, the cache context exits, nothing leaks. A server that
stops drains its handlers the same way before the engine may close.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import resource
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from transformers import PreTrainedTokenizerBase

from .. import ConfigError, HiCacheError
from .._concurrency import finish_then_cancel
from .._validate import check_int, check_number
from ._chat import chat_ids, check_messages
from .engine import (
    Engine,
    EngineBusy,
    EngineConfig,
    PromptError,
    SamplingParams,
    Tokenizer,
    Usage,
)

__all__ = ("ListenError", "build_app", "running_server", "serve")

log = logging.getLogger(__name__)

_MAX_TOKENS_LIMIT = 4096
_INLINE_CHARS = 4096
"""A text prompt up to this long is tokenized on the loop; a longer one on a thread. A fast
(Rust) HF tokenizer takes 1.2-1.7 ms of CPU a thousand tokens, and lets go of the GIL: a
103k-token prompt held the loop, and every other request's cache work and tokens, for
125-175 ms."""
_MESSAGE_CHARS = 64
"""What a chat message weighs against `_INLINE_CHARS` besides its text: a template renders
each message at about 7 us (a 1 MiB body of empty messages held the loop for 0.22 s)."""
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ListenError(OSError):
    """The server cannot listen where it was asked to (port in use, unknown host, no
    permission); the message names the address and the reason."""


class _BadRequest(Exception):
    """A request the server refuses (400), with the message the client sees."""

    status = 400
    code: str | None = None


class _TooLarge(_BadRequest):
    status = 413


class _NotServed(_BadRequest):
    """A model this server does not run."""

    status, code = 404, "model_not_found"


class _TooSlow(_BadRequest):
    """The request's body did not all arrive within the read timeout."""

    status = 408


class _InFlight:
    """The tasks of the requests in the server, so a stopping server can drain them.

    Once `closed`, requests are answered 503 before they touch the engine, so the set only
    shrinks while the server waits for it; but for ``/metrics``, which Prometheus scrapes on
    its kept-alive connection to watch the drain.
    """

    def __init__(self) -> None:
        self.closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        # NOTE: /metrics was a 503 too: the drain could not be watched
        if self.closed and request.path != "/metrics":
            return _error(503, "the server is shutting down", "server_error")
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await handler(request)
        finally:
            self._tasks.discard(task)

    async def wait(self) -> None:
        """Until every tracked request has ended."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


class _Connections:
    """At most `bound` connections open at once (None: no bound). A connection past it closes
    the connection idle longest (waiting for a request: kept alive, or its headers not all
    come); with none idle, its own request is answered 503 and it is closed.

    NOTE: there was no bound but the process's open files: a client holding a few hundred
    idle connections (each closed only after the read timeout) used up the descriptors, and
    every other client's connection waited in the listen queue, unaccepted, until those
    timed out, while asyncio logged a traceback a second ("Too many open files").
    """

    def __init__(self) -> None:
        self.bound: int | None = None
        self._open: dict[RequestHandler, None] = {}  # least recently used first
        self._over: set[RequestHandler] = set()

    def attach(self, server: web.Server, bound: int) -> None:
        """Watch `server`'s connections (aiohttp's manager calls; its handlers report to
        it as they connect and go)."""
        self.bound = bound
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._made(handler)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            self._open.pop(handler, None)
            self._over.discard(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _made(self, handler: RequestHandler) -> None:
        self._open[handler] = None
        if self._full() and not self._reclaim(handler):
            self._over.add(handler)

    def _full(self) -> bool:
        return self.bound is not None and len(self._open) > self.bound

    def _used(self, handler: RequestHandler) -> None:
        """`handler`'s request is done: its connection is idle for the shortest time now.

        NOTE: `_open` is kept in order of last use, so `_reclaim` closes the connection idle
        longest: in order of opening, a client's kept-alive connection (opened first,
        answered a moment ago) was closed before a flood of silent ones opened after it.
        """
        if handler in self._open:
            del self._open[handler]
            self._open[handler] = None

    def _reclaim(self, handler: RequestHandler) -> bool:
        """Close the connection idle longest but `handler`'s; False if none is idle."""
        for old in self._open:
            if old is not handler and _idle(old):
                del self._open[old]  # and iterate no more
                old.force_close()
                return True
        return False

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        # NOTE: tried again at its request: connections accepted together, in one turn of
        # the loop, are not idle yet when the next connects (their loops have not started);
        # and those open then may have closed since (else it was a 503, the server empty)
        if request.protocol not in self._over or not self._full() \
                or self._reclaim(request.protocol):
            self._over.discard(request.protocol)
            try:
                return await handler(request)
            finally:
                self._used(request.protocol)
        response = _busy(f"{len(self._open)} connections open, the most this server keeps "
                         f"(max_connections)")
        response.force_close()
        return response


def _idle(handler: RequestHandler) -> bool:
    """Whether `handler`'s connection waits for a request: it has had none parsed yet (its
    loop may not have started), or its loop awaits the next (``_waiter``: aiohttp's own
    test of an idle connection, its keep-alive timer's). A request parsed and not yet
    handled is not idle: its waiter is done."""
    waiter = handler._waiter
    return handler.transport is not None and (
        handler._request_count == 0 or (waiter is not None and not waiter.done()))


_BACKLOG = 128
"""The listen queue (aiohttp's default), which is also how many connections asyncio accepts
at once, before any is seen (and one idle closed): the bound's headroom."""


def default_max_connections() -> int:
    """Half this process's open-file limit (``RLIMIT_NOFILE``) less one accept burst
    (`_BACKLOG`): the rest is the cache's files and the model's."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = min(soft if soft != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    return max(1, (files - _BACKLOG) // 2)


@web.middleware
async def _json_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every error in OpenAI's JSON shape, which OpenAI clients parse.

    NOTE: aiohttp's own (an unknown path, a wrong method, a handler's exception) were plain
    text: a client reported a decoding error instead of the server's."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        where = f"{request.method} {request.path:.100}"
        message = f"{where}: no such endpoint" if exc.status == 404 else \
            f"{where}: {exc.reason.lower()}"
        if exc.status == 405:
            message += f" (allowed: {exc.headers.get('Allow', '')})"
        response = _error(exc.status, message)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:
        if request.writer.output_size > 0:  # an answer is under way: aiohttp drops it
            raise
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "the server failed to answer (its log says why)", "server_error")


ENGINE = web.AppKey("engine", Engine)
_IN_FLIGHT = web.AppKey("in_flight", _InFlight)
_CONNECTIONS = web.AppKey("connections", _Connections)
_STALL_TIMEOUT = web.AppKey("stall_timeout", float)
_READ_TIMEOUT = web.AppKey("read_timeout", float)
_TOKENIZING = web.AppKey("tokenizing", anyio.CapacityLimiter)
"""One prompt tokenized off the loop at a time: an HF fast tokenizer is one object that
refuses ("Already borrowed", tokenizers#537) to change its truncation or padding while
another thread encodes with it."""


class _Room:
    """How many requests are in the completion handlers: reading their bodies, tokenizing,
    waiting for a turn or generating. At most ``max_running + max_waiting`` (none with no
    `max_waiting`): one more is refused before its body is read.

    NOTE: the engine's `max_waiting` counted only requests already tokenized: any number of
    clients could each have a body of up to 1 MiB read, parsed and queued for the one
    tokenizer thread (tens of MB each, as lists of messages and token ids), past the
    bound that was to shed such a load."""

    __slots__ = ("bound", "inside")

    def __init__(self, config: EngineConfig) -> None:
        self.bound = None if config.max_waiting is None else \
            config.max_running + config.max_waiting
        self.inside = 0

    @property
    def full(self) -> bool:
        return self.bound is not None and self.inside >= self.bound


_ROOM = web.AppKey("room", _Room)


def build_app(engine: Engine, *, stall_timeout: float = 30.0,
              read_timeout: float = 60.0) -> web.Application:
    """The aiohttp application serving `engine` (open it before serving).

    A streaming client that takes none of the stream for `stall_timeout` seconds is cut off;
    a request whose body has not all arrived `read_timeout` seconds after its headers is
    answered 408 and its connection closed.

    Raises:
        ConfigError: `stall_timeout` or `read_timeout` is not a positive finite number.
    """
    in_flight, connections = _InFlight(), _Connections()
    app = web.Application(middlewares=[_json_errors, connections.middleware,
                                       in_flight.middleware])
    app[ENGINE] = engine
    app[_IN_FLIGHT] = in_flight
    app[_CONNECTIONS] = connections
    app[_STALL_TIMEOUT] = check_number("stall_timeout", stall_timeout, low=0, low_open=True)
    app[_READ_TIMEOUT] = check_number("read_timeout", read_timeout, low=0, low_open=True)
    app[_TOKENIZING] = anyio.CapacityLimiter(1)
    app[_ROOM] = _Room(engine.config)
    app.add_routes([web.post("/v1/completions", completions),
                    web.post("/v1/chat/completions", chat_completions),
                    web.get("/metrics", metrics), web.get("/health", health),
                    web.get("/v1/models", models), web.get("/v1/models/{model:.+}", model)])
    return app


@asynccontextmanager
async def running_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, *,
                         shutdown_timeout: float = 5.0, stall_timeout: float = 30.0,
                         read_timeout: float = 60.0,
                         max_connections: int | None = None) -> AsyncIterator[str]:
    """Serve `engine` on ``host:port`` (0: a free port) while the block runs; yields the base
    URL, e.g. ``http://127.0.0.1:43121``.

    Leaving the block stops the server: it stops accepting, gives the requests in flight
    `shutdown_timeout` seconds to finish, cancels the rest (each finishes its forward pass in
    flight and exits its cache context) and waits for them, so `engine` may close after;
    then it drops the connections still open (a client that reads no more).

    A streaming client that takes none of its stream for `stall_timeout` seconds is cut off
    (its turn, pages and connection are let go). A client gets `read_timeout` seconds to send
    a request's headers, from when its connection opens or its last answer ends (an idle
    keep-alive connection is closed then), and as long again for its body (then a 408).
    At most `max_connections` connections are open at once (None: about half the process's
    open-file limit; connections accepted together, a few hundred, may pass it until the
    next): one more closes the one idle longest, or with none idle, is answered 503
    (``server_busy``, ``Retry-After``).

    Raises:
        ConfigError: `shutdown_timeout` is negative or not finite, `stall_timeout` or
            `read_timeout` not positive, or `max_connections` not a positive int.
        ListenError: the server cannot listen on ``host:port``.

    Cancellation: the stop above runs to the end all the same, then the cancellation
    propagates.
    """
    grace = check_number("shutdown_timeout", shutdown_timeout, low=0)
    bound = default_max_connections() if max_connections is None else \
        check_int("max_connections", max_connections, low=1)
    app = build_app(engine, stall_timeout=stall_timeout, read_timeout=read_timeout)
    # NOTE: aiohttp's own wait (for connections still open once the handlers are done)
    # reads 0 as no limit. Its keep-alive timer also closes a connection whose request's
    # headers have not all come (its only bound on them): 3,630 s by default, so headers
    # trickled a byte at a time (slowloris) held a socket for an hour.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=max(grace, 0.1), keepalive_timeout=read_timeout)
    await runner.setup()
    assert runner.server is not None
    app[_CONNECTIONS].attach(runner.server, bound)
    try:
        yield await _listen(runner, host, port)
    finally:
        # NOTE: in a task of its own, which aiohttp's shutdown needs: run by a task being
        # cancelled (as this one usually is), it re-raises its timeout where it would go on
        # to cancel the handlers and close the connections; through `finish_then_cancel`,
        # so it runs to the end whatever cancels this task. (aiohttp is asyncio-only.)
        await finish_then_cancel(asyncio.ensure_future(_stop(runner, app[_IN_FLIGHT], grace)))


async def serve(engine: Engine, host: str, port: int, *, on_ready: Any = None,
                shutdown_timeout: float = 5.0, stall_timeout: float = 30.0,
                read_timeout: float = 60.0, max_connections: int | None = None) -> None:
    """Open `engine` and serve it until cancelled; ``on_ready(url)`` once listening.
    `stall_timeout`, `read_timeout`, `max_connections`: as `running_server`'s.

    Raises:
        ConfigError: `shutdown_timeout` is negative or not finite, `stall_timeout` or
            `read_timeout` not positive, or `max_connections` not a positive int.
        ListenError: the server cannot listen on ``host:port``.

    Cancellation: how it ends: the server stops accepting, requests in flight get
    `shutdown_timeout` seconds to finish, the rest are cancelled and unwind (their cache
    contexts exit), then the engine and its cache close.
    """
    check_number("shutdown_timeout", shutdown_timeout, low=0)  # before the cache opens
    check_number("stall_timeout", stall_timeout, low=0, low_open=True)
    check_number("read_timeout", read_timeout, low=0, low_open=True)
    if max_connections is not None:
        check_int("max_connections", max_connections, low=1)
    async with engine, running_server(engine, host, port, shutdown_timeout=shutdown_timeout,
                                      stall_timeout=stall_timeout, read_timeout=read_timeout,
                                      max_connections=max_connections) as url:
        if on_ready is not None:
            on_ready(url)
        await anyio.sleep_forever()


async def _listen(runner: web.AppRunner, host: str, port: int) -> str:
    """Start listening; the base URL."""
    try:
        await web.TCPSite(runner, host, port, backlog=_BACKLOG).start()
    except OSError as exc:
        where = f"{_host_for_url(host)}:{port}"
        raise ListenError(f"cannot listen on {where}: {_reason(exc)}") from exc
    bound = runner.addresses[0]
    return f"http://{_host_for_url(bound[0])}:{bound[1]}"


async def _stop(runner: web.AppRunner, in_flight: _InFlight, grace: float) -> None:
    """Stop accepting, give the requests in flight `grace` seconds, cancel the rest and wait
    for them to unwind, then close the connections (nothing they wait for touches the
    engine any more) and drop those a close leaves open.

    It takes `grace` at most, plus the time a cancelled handler takes to unwind (the forward
    pass it has in flight), plus aiohttp's close.

    Cancellation: not meant to be cancelled (the engine must not close under a handler):
    `running_server` runs it through `finish_then_cancel`.
    """
    for site in list(runner.sites):
        await site.stop()
    in_flight.closed = True
    assert runner.server is not None
    # NOTE: taken now, as aiohttp's close forgets them: a closed transport stays open while
    # it has unsent data, so the socket of a client that reads no more (a stalled stream)
    # outlived the server, for ever
    transports = [c.transport for c in runner.server.connections if c.transport is not None]
    with anyio.move_on_after(grace):
        await in_flight.wait()
    in_flight.cancel()
    await in_flight.wait()
    await runner.cleanup()
    for transport in transports:
        transport.abort()  # nothing if it closed already


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _reason(exc: OSError) -> str:
    # asyncio words a failed bind "error while attempting to bind on address (...): ...";
    # its errno says the same plainly. A resolver error's errno is not an OS errno.
    if exc.errno and not isinstance(exc, socket.gaierror):
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


# ---------------------------------------------------------------------------- handlers


@dataclass(frozen=True, slots=True)
class _Kind:
    """How one endpoint reads its prompt and shapes its answers."""

    name: str
    chunk_name: str
    id_prefix: str
    unsupported: dict[str, tuple[object, ...]]
    prompt_field: str = "prompt"
    """Where the prompt comes from: what the engine's prompt errors name."""

    async def prompt(self, app: web.Application, body: dict[str, Any]) -> list[int]:
        return await _prompt(app, body.get("prompt"))

    def max_tokens(self, body: dict[str, Any], room: int) -> tuple[str, object]:
        """The field that sets the completion's length, and its value (`room`: the tokens
        the model's context has left after the prompt)."""
        return "max_tokens", _given(body, "max_tokens", 16)

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        return self.choice(text, finish)


class _ChatKind(_Kind):
    async def prompt(self, app: web.Application, body: dict[str, Any]) -> list[int]:
        """Cancellation: a template being rendered on its thread finishes first."""
        messages = check_messages(body.get("messages"))
        tokenizer = app[ENGINE].tokenizer
        if sum(len(m["content"]) + _MESSAGE_CHARS for m in messages) <= _INLINE_CHARS:
            return chat_ids(tokenizer, messages)
        return await anyio.to_thread.run_sync(chat_ids, tokenizer, messages,
                                              limiter=app[_TOKENIZING])

    def max_tokens(self, body: dict[str, Any], room: int) -> tuple[str, object]:
        """``max_completion_tokens`` (OpenAI's newer name) or else ``max_tokens``; neither:
        what the context has room for, up to the server's bound (OpenAI's and vLLM's chat).

        NOTE: it was 16, the legacy completions' default: a chat client that sets no length
        (the OpenAI SDK sets none) had every answer cut at 16 tokens."""
        if body.get("max_completion_tokens") is not None:
            return "max_completion_tokens", body["max_completion_tokens"]
        return "max_tokens", _given(body, "max_tokens", max(1, min(room, _MAX_TOKENS_LIMIT)))

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def chunk(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text or finish is None else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, _COMPLETION)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, _CHAT)


async def _complete(request: web.Request, kind: _Kind) -> web.StreamResponse:
    room = request.app[_ROOM]
    if room.full:
        request.app[ENGINE].metrics.busy_rejections += 1
        return _busy(f"{room.inside} requests already in the server, the most it takes "
                     f"(max_running + max_waiting)")
    room.inside += 1
    try:
        return await _complete_admitted(request, kind)
    finally:
        room.inside -= 1


async def _complete_admitted(request: web.Request, kind: _Kind) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _json_body(request)
        _check_model(body, engine.name)
        prompt = await kind.prompt(request.app, body)
        params = _params(body, kind, len(prompt), engine.max_positions)
        stop = _stop_strings(body)
        stream = _flag(body, "stream")
        if not stream and _given(body, "stream_options", None) is not None:
            # NOTE: was ignored unsaid (OpenAI and vLLM refuse it): a client that asked for
            # a usage chunk thought it would get one
            raise _BadRequest("stream_options: only with \"stream\": true")
        usage_chunk = _usage_chunk(body)
    except (_TooSlow, _TooLarge) as exc:  # the rest of the body is not worth reading
        return await _answer_and_close(request, _error(exc.status, str(exc)))
    except _BadRequest as exc:
        return _error(exc.status, str(exc), code=exc.code)
    except PromptError as exc:
        return _error(400, str(exc))
    except ConfigError as exc:  # the server's set-up (a chat template that does not parse)
        log.error("completion failed: %s", exc)
        return _error(500, f"server misconfigured: {exc}", "server_error")
    usage = Usage(prompt_tokens=len(prompt))
    async with aclosing(engine.generate(prompt, params, usage)) as tokens:
        try:
            first = await anext(tokens)  # errors before any output are a clean HTTP error
        except PromptError as exc:
            return _error(400, _prompt_error(exc, kind))
        except EngineBusy as exc:
            return _busy(str(exc))
        except ConfigError as exc:  # NOTE: the server's set-up, not the request: was a 400
            log.error("completion failed: %s", exc)
            return _error(500, f"server misconfigured: {exc}", "server_error")
        except HiCacheError as exc:
            return _error(503, f"cache unavailable: {exc}", "server_error")
        head = _head(engine, kind)
        text = _Text(engine.tokenizer, stop)
        if stream:
            return await _stream(request, head, first, tokens, usage, usage_chunk, text,
                                 kind)
        ids: list[int] = []
        pieces: list[str] = []
        token: int | None = first
        while token is not None:
            ids.append(token)
            pieces.append(text.push(token, usage))
            token = await anext(tokens, None)  # None after a stop string: see `_Text.push`
        pieces.append(text.flush())
    return web.json_response({
        **head, "choices": [kind.choice("".join(pieces), text.finish_reason(usage))],
        "usage": _usage(usage), "aiohicache": {"token_ids": ids, "cached_tiers": usage.tiers}})


async def _stream(request: web.Request, head: dict[str, Any], first: int,
                  tokens: AsyncGenerator[int, None], usage: Usage, usage_chunk: bool,
                  text: _Text, kind: _Kind) -> web.StreamResponse:
    """Server-sent events: one chunk per token as soon as it is sampled, a last one with no
    text and the finish reason, then usage if asked for (`usage_chunk`), then ``[DONE]``.

    NOTE: a token's chunk is not held back to carry the finish reason: it waited for the next
    token's decode step (time to first token included one)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    send = _Sender(resp, request.app[_STALL_TIMEOUT])
    head = {**head, "object": kind.chunk_name}
    token: int | None = first
    # NOTE: a count, not `token is first`: ids up to 256 are one object in CPython, so a
    # later token equal to the first was sent as the first (a chat delta with the role again)
    sent = 0
    try:
        await resp.prepare(request)
        while token is not None:
            piece = kind.chunk(text.push(token, usage), None, sent == 0)
            await send.event({**head, "choices": [piece], "token_ids": [token]})
            sent += 1
            try:
                token = await anext(tokens, None)  # as in `_complete`
            except Exception:  # NOTE: the stream was cut with no word: see `_failed`
                await _failed(send)
                return resp
        last = kind.chunk(text.flush(), text.finish_reason(usage), False)
        await send.event({**head, "choices": [last], "token_ids": []})
        if usage_chunk:
            await send.event({**head, "choices": [], "usage": _usage(usage),
                              "aiohicache": {"cached_tiers": usage.tiers}})
        await send(b"data: [DONE]\n\n")
        await send.eof()
    except _Stalled as exc:
        # NOTE: the generation is closed (its turn, pages and leases let go) before the
        # connection goes, so a disconnect cancels no cleanup. A client that stopped reading
        # held them for as long as it kept its connection open: `max_running` such clients
        # starved every other request
        await tokens.aclose()
        if request.transport is not None:
            request.transport.abort()
        log.info("cut off a streaming client: %s", exc)
    except ConnectionResetError:
        # NOTE: the client went away (a user who stops a chat's answer). Its handler is
        # cancelled as the loop learns the connection is lost, but where the next token was
        # ready in the same turn as the client's end of stream, the write to the closing
        # transport raised first: aiohttp logged "Error handling request" and a traceback at
        # ERROR for an ordinary disconnect. Returned, aiohttp drops the response quietly.
        if request.transport is not None and not request.transport.is_closing():
            raise  # not the client's connection
        log.debug("the client of a stream went away")
    return resp


async def _failed(send: _Sender) -> None:
    """End a stream whose generation failed (the model raised: a CUDA out-of-memory) with an
    error event, as vLLM's, which an OpenAI client raises as the server's error.

    NOTE: it was cut with no word: aiohttp logged the error, the client saw a broken
    connection, or a truncated answer."""
    log.exception("a streamed generation failed")
    await send.event(_error_body("the generation failed (the server's log says why)",
                                 "server_error"))
    await send(b"data: [DONE]\n\n")
    await send.eof()


class _Stalled(Exception):
    """A streaming client took none of the stream for the stall timeout."""


class _Sender:
    """Writes to a stream; a write that waits `timeout` seconds for the client to take
    data raises `_Stalled`. (A write waits only while more than aiohttp's high-water mark,
    64 KiB, is unsent: a client must read about 48 KiB per `timeout`.)"""

    __slots__ = ("_resp", "_timeout")

    def __init__(self, resp: web.StreamResponse, timeout: float) -> None:
        self._resp, self._timeout = resp, timeout

    async def __call__(self, data: bytes) -> None:
        await self._bounded(self._resp.write(data))

    async def event(self, data: dict[str, Any]) -> None:
        await self(b"data: " + json.dumps(data).encode() + b"\n\n")

    async def eof(self) -> None:
        await self._bounded(self._resp.write_eof())

    async def _bounded(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self._timeout):  # NOTE: anyio's scope costs 2x (17 us)
                await write
        except TimeoutError:
            raise _Stalled(f"it took no data for {self._timeout:g} s") from None


class _Text:
    """A completion's text as its tokens arrive: detokenized, less an end-of-sequence token,
    and cut before the first of the request's stop strings (which ends the completion).

    Streamed, text that may be the start of a stop string is held back until the next
    tokens say whether it is; the pieces join to the whole text either way.
    """

    __slots__ = ("_shown", "_stop", "_text", "_tokens", "stopped")

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokens = _Detokenizer(tokenizer)
        self._stop = stop
        self._text = ""  # decoded so far
        self._shown = 0  # characters of it returned
        self.stopped = False
        """A stop string was found: generate no more."""

    def push(self, token: int, usage: Usage) -> str:
        """The text `token` adds that is safe to show now. At a stop string, sets
        `usage.finish_reason` to ``"stop"``: the generation ends at its next step, with no
        more decoding, and its output is cached.

        NOTE: the generator was closed there instead, which skipped caching the output: a
        next chat turn quoting an answer that a stop string ended missed its KV."""
        if usage.finish_reason != "stop":  # NOTE: the engine sets it as it yields the end
            self._text += self._tokens.push(token)
        piece = self._take(final=False)
        if self.stopped:
            usage.finish_reason = "stop"
        return piece

    def flush(self) -> str:
        """The rest of the text, once no token will follow."""
        if not self.stopped:
            self._text += self._tokens.flush()
        return self._take(final=True)

    def finish_reason(self, usage: Usage) -> str:
        return "stop" if self.stopped else usage.finish_reason

    def _take(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        end = min((i for i in (self._text.find(s, self._shown) for s in self._stop) if i >= 0),
                  default=-1)
        if end >= 0:
            self.stopped = True
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held()
        piece, self._shown = self._text[self._shown:end], max(self._shown, end)
        return piece

    def _held(self) -> int:
        """How many characters at the end could begin a stop string.

        NOTE: only where a stop's first character is: comparing every length of every stop
        cost O(stop length ** 2) per token (0.55 ms of loop a token with four of 1,024)."""
        text, held = self._text, 0
        for stop in self._stop:
            at = text.find(stop[0], max(self._shown, len(text) - len(stop) + 1))
            while at >= 0 and len(text) - at > held:
                if stop.startswith(text[at:]):  # the earliest start holds back the most
                    held = len(text) - at
                    break
                at = text.find(stop[0], at + 1)
        return held


class _Detokenizer:
    """The text of a token stream, piece by piece, whose pieces join to what decoding all
    the tokens at once gives (the non-streamed text).

    NOTE: each token was decoded alone: a character whose UTF-8 bytes span tokens (byte-level
    BPE, the byte tokenizer) streamed as U+FFFD replacement characters, and SentencePiece,
    which drops a sequence's leading space, glued words together. Each piece is now the
    decoded text of a short window of recent tokens less that of the window without the new
    ones, held back while it ends in an incomplete character (vLLM and TGI do the same).
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = _text_decoder(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: context for the tokens not yet shown
        self._read = 0  # tokens before this one are shown

    def push(self, token: int) -> str:
        """The text `token` adds ("" while it may still be part of a character)."""
        self._ids.append(token)
        piece = self._piece()
        if not piece or piece.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return piece

    def flush(self) -> str:
        """The text still held back, once the stream has ended."""
        piece = self._piece()
        self._prefix = self._read = len(self._ids)
        return piece

    def _piece(self) -> str:
        shown = self._decode(self._ids[self._prefix:self._read])
        return self._decode(self._ids[self._prefix:])[len(shown):]


def _text_decoder(tokenizer: Tokenizer) -> Callable[[Sequence[int]], str]:
    """`tokenizer`'s decode, less special tokens: a completion counts them, its text does
    not show them (vLLM's ``skip_special_tokens``, on by default).

    NOTE: a transformers tokenizer keeps them unless asked: a generated chat marker
    (``<|im_start|>``), or the end of sequence `ignore_eos` runs past, was in the text."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return functools.partial(tokenizer.decode, skip_special_tokens=True)
    return tokenizer.decode


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(text=engine.metrics.render(engine.cache),
                        content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    state = request.app[ENGINE].health
    return web.json_response({"status": state}, status=200 if state != "failed" else 503)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[ENGINE])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the OpenAI SDK's ``models.retrieve``): the served model, or
    a 404 ``model_not_found``."""
    engine, asked = request.app[ENGINE], request.match_info["model"]
    if asked != engine.name:
        return _error(404, f"model: {asked!r:.80} is not served here (this server runs "
                           f"{engine.name!r})", code="model_not_found")
    return web.json_response(_model_card(engine))


def _model_card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.name, "object": "model", "created": 0, "owned_by": "aiohicache"}


# ---------------------------------------------------------------------------- parsing


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The body, read within the read timeout and the size limit, as a JSON object."""
    limit, declared = request.client_max_size, request.content_length
    if declared is not None and declared > limit:
        # NOTE: refused before reading: the body was read up to the limit first, or waited
        # for if it never came
        raise _TooLarge(f"the request's body: {declared} bytes, more than the limit of "
                        f"{limit}")
    try:
        # NOTE: the body was waited for without a bound: ``Content-Length: 1000000`` and no
        # more held its handler and connection for ever
        async with asyncio.timeout(request.app[_READ_TIMEOUT]):
            body = await request.json()
    except TimeoutError:
        raise _TooSlow(f"the request's body did not arrive within the read timeout "
                       f"({request.app[_READ_TIMEOUT]:g} s)") from None
    except web.HTTPRequestEntityTooLarge:  # a chunked body: aiohttp's 413 is plain text
        raise _TooLarge(f"the request's body: more than the limit of {limit} bytes") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # too deep: recursion
        raise _BadRequest("the body must be a JSON object") from None
    except ValueError:  # NOTE: a 500, and a traceback logged, each time
        raise _BadRequest(f"the body: a number of more than {sys.get_int_max_str_digits()} "
                          f"digits") from None  # the one other error json.loads raises
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


async def _prompt(app: web.Application, prompt: object) -> list[int]:
    """A string, a list of token ids, or a batch of exactly one of either.

    Cancellation: a tokenization under way on its thread finishes first.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_text("prompt", prompt)
        encode = app[ENGINE].tokenizer.encode
        if len(prompt) <= _INLINE_CHARS:
            return list(encode(prompt))
        return list(await anyio.to_thread.run_sync(encode, prompt, limiter=app[_TOKENIZING]))
    if isinstance(prompt, list) and prompt:
        ids = [_integral(t) for t in prompt]  # NOTE: [1.0, 2.0] was refused, as no ids
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids  # type: ignore[return-value]
    raise _BadRequest("prompt: a non-empty string or list of token ids (one prompt per "
                      "request)")


def _check_text(field_name: str, text: str) -> None:
    """Refuse text that is not Unicode scalar values (JSON can spell a lone surrogate,
    ``"\\ud800"``, which no tokenizer encodes, nor any decoded text holds: a prompt with
    one was a 500)."""
    if text.isascii():  # O(1): CPython records it
        return
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise _BadRequest(f"{field_name}: not valid Unicode text (a lone surrogate at "
                          f"character {exc.start})") from None


def _params(body: dict[str, Any], kind: _Kind, length: int, positions: int) -> SamplingParams:
    """The sampling fields, for a prompt of `length` tokens and a model of `positions`."""
    _refuse_unsupported(body, kind.unsupported)
    field_name, value = kind.max_tokens(body, positions - length)
    max_tokens = check_int(field_name, _integral(value), low=1, high=_MAX_TOKENS_LIMIT,
                           error=_BadRequest)
    # NOTE: checked here, naming the fields the client sent: the engine's check named
    # ``max_tokens`` to a chat that sent ``max_completion_tokens`` (or none at all)
    if length >= positions:
        raise _BadRequest(f"{kind.prompt_field}: {length} tokens + at least 1 generated "
                          f"exceed the model's {positions} positions")
    if length + max_tokens > positions:
        raise _BadRequest(f"{kind.prompt_field}: {length} tokens + {field_name} {max_tokens} "
                          f"exceed the model's {positions} positions")
    temperature = check_number("temperature", _given(body, "temperature", 1.0), low=0,
                               high=2, error=_BadRequest)
    seed = body.get("seed")
    if seed is not None:
        seed = check_int("seed", _integral(seed), low=-(1 << 63),
                         high=(1 << 64) - 1, error=_BadRequest)  # torch's range
    top_p = check_number("top_p", _given(body, "top_p", 1.0), low=0, low_open=True, high=1,
                         error=_BadRequest)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          top_p=top_p, ignore_eos=_flag(body, "ignore_eos"))


_MAX_STOPS = 4
_MAX_STOP_CHARS = 1024


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    """``stop``: a string or a list of at most 4 (OpenAI's bound); none may be empty."""
    value = _given(body, "stop", [])
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > _MAX_STOPS \
            or not all(isinstance(s, str) and 0 < len(s) <= _MAX_STOP_CHARS for s in stops):
        raise _BadRequest(f"stop: a string or a list of at most {_MAX_STOPS} strings, each "
                          f"of 1..{_MAX_STOP_CHARS} characters (got {value!r:.80})")
    for stop in stops:  # NOTE: one with a lone surrogate was taken, and could never match
        _check_text("stop", stop)
    return tuple(stops)


def _check_model(body: dict[str, Any], served: str) -> None:
    """``model``: absent, null or the served model's name.

    NOTE: it was not read: a request for another model was answered by this one, as if by
    that (vLLM and OpenAI answer 404)."""
    model = body.get("model")
    if model is None or model == served:
        return
    if not isinstance(model, str):
        raise _BadRequest(f"model: a string, the served model's name (got {model!r:.80})")
    raise _NotServed(f"model: {model!r:.80} is not served here (this server runs {served!r})")


def _given(body: dict[str, Any], name: str, default: object) -> object:
    """`name`'s value, or `default` where it is absent or null (OpenAI's optional fields
    are nullable: ``"max_tokens": null`` asks for the default, and was a 400)."""
    value = body.get(name)
    return default if value is None else value


_UNSUPPORTED_ENDS: dict[str, tuple[object, ...]] = {
    "stop_token_ids": ([],), "min_tokens": (0,), "include_stop_str_in_output": (False,),
}
"""vLLM's (and SGLang's) fields beside `ignore_eos` that move where a completion ends.
NOTE: they were ignored: ``stop_token_ids`` got a 200 that ran past the token asked to end
it."""
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "logit_bias": ({},), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "logprobs": (), **_UNSUPPORTED_ENDS,
}
_UNSUPPORTED_CHAT: dict[str, tuple[object, ...]] = {
    "n": (1,), "logit_bias": ({},), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},),
    "modalities": (["text"],), "audio": (), "prediction": (), **_UNSUPPORTED_ENDS,
}
"""OpenAI fields the server does not implement, with the values that ask for nothing (and
null): any other value is refused, naming the field. NOTE: they were ignored, so
``"n": 3`` got a 200 that did not do what it asked (one choice)."""


def _refuse_unsupported(body: dict[str, Any], fields: dict[str, tuple[object, ...]]) -> None:
    for name, neutral in fields.items():
        value = _integral(body.get(name))
        # of the neutral value's type too: True == 1 and False == 0 in Python
        if value is not None and not any(type(value) is type(n) and value == n
                                         for n in neutral):
            raise _BadRequest(f"{name}: not supported by this server (got {value!r}); "
                              f"leave it out")


def _flag(body: dict[str, Any], name: str, label: str = "") -> bool:
    """A boolean field (null: false); `label`: its name as the client sees it, if not
    `name`. NOTE: strict, where vLLM's pydantic also reads ``"false"`` or 0 as false: a
    string here was read as true."""
    value = _given(body, name, False)
    if not isinstance(value, bool):
        raise _BadRequest(f"{label or name}: true or false (got {value!r:.40})")
    return value


def _integral(value: object) -> object:
    """An integral float as its int, anything else as is: vLLM's pydantic models read
    ``8.0`` as 8, and a Python client that computes a length sends it (``json.dumps`` of a
    float). NOTE: ``"n": 1.0`` was refused as not supported, ``"max_tokens": 8.0`` as no
    int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _usage_chunk(body: dict[str, Any]) -> bool:
    """Whether a stream ends with a usage chunk: ``stream_options.include_usage``.

    NOTE: ``stream_options`` that was no object was ignored, and an ``include_usage`` read
    as true if truthy (``"false"`` sent usage); vLLM refuses both."""
    options = _given(body, "stream_options", {})
    if not isinstance(options, dict):
        raise _BadRequest(f"stream_options: an object such as {{\"include_usage\": true}}, "
                          f"or null (got {options!r:.40})")
    if _given(options, "continuous_usage_stats", False) is not False:  # vLLM's: every chunk
        raise _BadRequest(f"stream_options.continuous_usage_stats: not supported by this "
                          f"server (got {options['continuous_usage_stats']!r:.40}); leave it "
                          f"out")
    return _flag(options, "include_usage", "stream_options.include_usage")


# ---------------------------------------------------------------------------- responses


def _head(engine: Engine, kind: _Kind) -> dict[str, Any]:
    return {"id": f"{kind.id_prefix}-{uuid.uuid4().hex}", "object": kind.name,
            "created": int(time.time()), "model": engine.name}


_COMPLETION = _Kind("text_completion", "text_completion", "cmpl", _UNSUPPORTED)
_CHAT = _ChatKind("chat.completion", "chat.completion.chunk", "chatcmpl", _UNSUPPORTED_CHAT,
                  "messages")


def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _error(status: int, message: str, kind: str = "invalid_request_error", *,
           code: str | None = None) -> web.Response:
    return web.json_response(_error_body(message, kind, code), status=status)


def _error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; ``param`` is the field a message begins by naming
    (``max_tokens: ...``), as OpenAI's, else null."""
    named = _NAMED_FIELD.match(message) if kind == "invalid_request_error" else None
    return {"error": {"message": message, "type": kind,
                      "param": named[1] if named else None, "code": code}}


_NAMED_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")
"""A message that names a request's field first: ``stop[1]: ...``."""


def _busy(message: str) -> web.Response:
    response = _error(503, f"server busy: {message}", "server_busy")
    response.headers["Retry-After"] = "1"
    return response


def _prompt_error(exc: PromptError, kind: _Kind) -> str:
    """The engine's refusal of a prompt, naming the field the client sent it in (a chat's
    prompt is its ``messages``: it was told of ``prompt``, a field it never sent)."""
    field_name, _, why = str(exc).partition(": ")
    return f"{kind.prompt_field}: {why}" if field_name == "prompt" else str(exc)


async def _answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send `response`, then close the connection: the rest of the request is never read
    (aiohttp would linger 10 s more, reading it)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()  # once the answer is sent
    return response
