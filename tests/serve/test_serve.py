"""`aiohicache serve` over real HTTP: a real aiohttp client against a real port."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp
import anyio
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from aiohicache import ConfigError
from aiohicache.cli import cli
from aiohicache.controller import page_format
from aiohicache.hf import tiny_llama
from aiohicache.serve import (
    ByteTokenizer,
    Engine,
    EngineConfig,
    SamplingParams,
    Usage,
    cache_config,
    load_model,
    running_server,
    serve,
)
from aiohicache.storage import FaultyBackend, backend_from_url

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 512 for i in range(n)]


def engine(**overrides: Any) -> Engine:
    fields: dict[str, Any] = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192}
    fields.update(overrides)
    return Engine(tiny_llama(seed=5, **MODEL), ByteTokenizer(), EngineConfig(**fields))


async def post(session: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data: dict[str, Any] = await resp.json()
        data["status"] = resp.status
        return data


async def events(session: aiohttp.ClientSession, url: str,
                 **body: Any) -> AsyncIterator[dict[str, Any] | str]:
    """The server-sent events of a streaming completion, parsed (``"[DONE]"`` as is)."""
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip().decode()
                yield payload if payload == "[DONE]" else json.loads(payload)


async def test_completions_hit_the_cache_and_generate_what_recomputation_does() -> None:
    first, turn2 = prompt_of(100, 1), [*prompt_of(100, 1), *prompt_of(30, 2)]
    outputs = {}
    for use_cache in (True, False):
        async with engine(use_cache=use_cache) as eng, running_server(eng) as url, \
                aiohttp.ClientSession() as session:
            a = await post(session, url, prompt=first, max_tokens=6, temperature=0)
            b = await post(session, url, prompt=turn2, max_tokens=6, temperature=0)
            outputs[use_cache] = (a["aiohicache"]["token_ids"], b["aiohicache"]["token_ids"])
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (96 if use_cache else 0)
            assert b["usage"] == {"prompt_tokens": 130, "completion_tokens": 6,
                                  "total_tokens": 136, "prompt_tokens_details":
                                  {"cached_tokens": cached}}
            assert b["choices"][0]["finish_reason"] == "length"
            if eng.cache is not None:
                eng.cache.check_invariants()
    assert outputs[True] == outputs[False]


async def test_streaming_sends_one_event_per_token_then_usage_and_done() -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        got = [e async for e in events(session, url, prompt="hello, streaming world",
                                       max_tokens=4, temperature=0,
                                       stream_options={"include_usage": True})]
        plain = await post(session, url, prompt="hello, streaming world", max_tokens=4,
                           temperature=0)
    tokens, finish, usage, done = got[:4], got[4], got[5], got[6]
    assert done == "[DONE]" and len(got) == 7
    assert [e["token_ids"][0] for e in tokens] == plain["aiohicache"]["token_ids"]  # type: ignore[index]
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 4  # type: ignore[index]
    assert finish["choices"][0] == {"index": 0, "text": "", "logprobs": None,  # type: ignore[index]
                                    "finish_reason": "length"}
    assert finish["token_ids"] == []  # type: ignore[index]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4  # type: ignore[index]


async def test_a_streamed_token_is_sent_before_the_next_one_is_decoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each token's event went out only once the next token was decoded (to tell whether
    it was the last): time to first token included a decode step, every token lagged one."""
    second = asyncio.Event()

    async def generate(prompt: list[int], params: SamplingParams,
                       usage: Usage) -> AsyncIterator[int]:
        usage.completion_tokens = 1
        yield 65
        await second.wait()  # the next decode step, held until the client saw the first
        usage.completion_tokens = 2
        yield 66

    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        monkeypatch.setattr(eng, "generate", generate)
        stream = aclosing(events(session, url, prompt="x", max_tokens=2, temperature=0))
        async with stream as got:
            with anyio.fail_after(10):
                first = await anext(got)
            assert first["token_ids"] == [65]  # type: ignore[index]
            second.set()
            rest = [e async for e in got]
    assert [e["token_ids"] for e in rest[:2]] == [[66], []]  # type: ignore[index]
    assert rest[1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


async def test_metrics_and_health() -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        for _ in range(2):
            await post(session, url, prompt=prompt_of(40, 3), max_tokens=2, temperature=0)
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
        async with session.get(f"{url}/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "tiny-llama"
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    assert {("aiohicache_server_requests_total", ()): 2, ("aiohicache_requests_running", ()): 0,
            ("aiohicache_server_prompt_tokens_total", ()): 80,
            ("aiohicache_generated_tokens_total", ()): 4,
            ("aiohicache_server_hit_tokens_total", (("tier", "L1"),)): 32,
            ("aiohicache_server_hit_tokens_total", (("tier", "L2"),)): 0,
            ("aiohicache_ttft_seconds_bucket", (("le", "+Inf"),)): 2,
            ("aiohicache_hit_tokens_total", (("tier", "L1"),)): 32,  # the cache's own
            ("aiohicache_health", (("state", "ok"),)): 1}.items() <= got.items()


@pytest.mark.parametrize("body, message", [
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": [600]}, "token ids must be in 0..511"),
    ({"prompt": "x", "seed": 1 << 64}, "seed"),  # torch's generator refused it, a 500
], ids=["empty", "batch", "max_tokens", "temperature", "vocab", "seed"])
async def test_bad_requests_get_a_400_naming_the_field(body: dict[str, Any],
                                                       message: str) -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        got = await post(session, url, **body)
        assert eng.cache is not None and eng.cache.stats().device_pages_leased == 0
    assert got["status"] == 400 and message in got["error"]["message"]


async def test_servers_of_other_weights_sharing_one_l3_miss_each_others_pages(
        tmp_path: Path) -> None:
    """The namespace was left "default": two servers of models whose KV has one shape (here
    two seeds of the tiny model; a model and its fine-tune) sharing an L3 served each
    other's KV. It is the weights' digest now: the same weights hit, others miss."""
    store, prompt = f"file://{tmp_path}", prompt_of(320, 3)
    fields = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192, "storage": store}

    async def cached(seed: int, **config: Any) -> int:
        model = tiny_llama(seed=seed, **MODEL)
        async with Engine(model, ByteTokenizer(), EngineConfig(**fields, **config)) as eng, \
                running_server(eng) as url, aiohttp.ClientSession() as session:
            got = await post(session, url, prompt=prompt, max_tokens=1, temperature=0)
            assert eng.cache is not None
            await eng.cache.drain()  # backed up to L3
            return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert await cached(seed=5) == 0
    assert await cached(seed=6) == 0  # another model of the same shape: its pages miss
    assert await cached(seed=5) == 319  # the first model again: served from L3
    assert await cached(seed=6, namespace="fleet") == 0
    assert await cached(seed=6, namespace="fleet") == 319  # a namespace given is kept


async def test_a_request_waiting_on_slow_l3_does_not_hold_up_others(tmp_path: Path) -> None:
    store, slow = f"file://{tmp_path}", 0.6  # exists + get: 1.2 s, in the 2 s prefetch wait
    old = prompt_of(320, 4)
    async with engine(storage=store) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        await post(session, url, prompt=old, max_tokens=1, temperature=0)
        assert eng.cache is not None
        await eng.cache.drain()  # backed up to L3
    fresh = engine()
    fmt = page_format(cache_config(fresh.model, EngineConfig(page_size=16, device_tokens=2048,
                                                             host_tokens=8192)))
    backend = FaultyBackend(backend_from_url(store, fmt), seed=0, latency=(slow, slow))
    async with backend, engine(storage=backend) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        done: dict[str, float] = {}

        async def timed(name: str, prompt: list[int]) -> dict[str, Any]:
            out = await post(session, url, prompt=prompt, max_tokens=2, temperature=0)
            done[name] = time.perf_counter()
            return out

        start = time.perf_counter()
        from_l3, other = await asyncio.gather(timed("l3", old), timed("other", prompt_of(20, 5)))
    assert from_l3["aiohicache"]["cached_tiers"]["L3"] == 319  # all but the last token
    assert done["other"] - start < slow <= done["l3"] - start  # not queued behind the L3 wait
    assert done["other"] < done["l3"]
    assert other["status"] == 200


async def test_a_client_that_disconnects_mid_stream_leaks_nothing() -> None:
    async with engine() as eng, running_server(eng) as url:
        async with aiohttp.ClientSession() as session:
            stream = events(session, url, prompt=prompt_of(64, 6), max_tokens=200,
                            temperature=0)
            assert isinstance(await anext(stream), dict)
            await stream.aclose()  # closes the connection mid-stream
        cache = eng.cache
        assert cache is not None
        deadline = time.monotonic() + 20
        while eng.metrics.running and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # the server's handler ends on its own: nothing to await
        assert eng.metrics.running == 0 and eng.metrics.generated_tokens < 200
        assert cache.stats().device_pages_leased == 0
        cache.check_invariants()


async def test_a_local_checkpoint_serves_through_the_cache(tmp_path: Path) -> None:
    tiny_llama(seed=7, **MODEL).save_pretrained(tmp_path / "ckpt")
    model, tokenizer, name = load_model(str(tmp_path / "ckpt"))
    assert name == "ckpt" and isinstance(tokenizer, ByteTokenizer)
    async with Engine(model, tokenizer, EngineConfig(device_tokens=1024), name=name) as eng, \
            running_server(eng) as url, aiohttp.ClientSession() as session:
        for cached in (0, 32):
            got = await post(session, url, prompt=prompt_of(40, 8), max_tokens=1)
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
            assert got["model"] == "ckpt"


_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "runpy.run_module('aiohicache', run_name='__main__', alter_sys=True)")
"""``python -m aiohicache`` with Ctrl-C handled as in a terminal. NOTE: a process started
with SIGINT ignored (as a shell's background job is, and a CI run launched as one was) keeps
ignoring it, as it should: the Ctrl-C test then saw a stream run its 25 s out."""


@contextlib.contextmanager
def serve_command(*args: str, script: str = _WITH_CTRL_C,
                  **env: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`aiohicache serve` in a subprocess (tiny model, port 0; run by `script`, Python's
    ``-c``), until it printed its URL: the process and the URL. Killed at the end if it is
    still running."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--port", "0", "--l1", "4096", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert re.match(r"aiohicache serve: \S+ on http://127.0.0.1:", line), line
        yield proc, line.split(" on ")[1].split()[0]
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_serve_command_listens_and_answers_under_its_served_model_name() -> None:
    """``--served-model-name`` is the name requests' ``model`` gives and /v1/models lists;
    the model's own name is then another model's (404)."""
    with serve_command("--served-model-name", "org/chat-1") as (_, url):

        async def ask() -> tuple[dict[str, Any], dict[str, Any], Any]:
            async with aiohttp.ClientSession() as session:
                got = await post(session, url, prompt="hi there", max_tokens=3,
                                 model="org/chat-1")
                other = await post(session, url, prompt="hi there", model="tiny-llama")
                async with session.get(f"{url}/v1/models") as response:
                    return got, other, await response.json()

        got, other, listed = asyncio.run(ask())
        assert got["status"] == 200 and got["usage"]["completion_tokens"] == 3
        assert got["model"] == "org/chat-1"
        assert other["status"] == 404 and other["error"]["code"] == "model_not_found"
        assert [m["id"] for m in listed["data"]] == ["org/chat-1"]


async def test_a_prompt_longer_than_the_device_pool_is_computed_without_it() -> None:
    """A prompt the device pool can never hold is computed without the cache, not fetched:
    its cached prefix is neither loaded back nor counted as a hit by the cache (until
    2026-11-25 the cache's counters said 32 tokens were served to a request computed whole)."""
    async with engine(device_tokens=64) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        long, short = prompt_of(100, 9), prompt_of(40, 10)
        got = await post(session, url, prompt=long, max_tokens=2, temperature=0)
        assert got["status"] == 200 and got["usage"]["completion_tokens"] == 2
        assert eng.metrics.uncached_fallbacks == 1
        for cached in (0, 32):  # prompts that fit are still cached
            got = await post(session, url, prompt=short, max_tokens=1, temperature=0)
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        cache = eng.cache
        assert cache is not None and cache.stats().device_pages_leased == 0
        before = cache.stats()
        got = await post(session, url, prompt=short + prompt_of(60, 11), max_tokens=1)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert eng.metrics.uncached_fallbacks == 2
        after = cache.stats()
        assert (after.device_hit_tokens, after.host_hit_tokens, after.prompt_tokens) == \
            (before.device_hit_tokens, before.host_hit_tokens, before.prompt_tokens)


# ---------------------------------------------------------------------------- shutdown


class SlowEngine(Engine):
    """The test engine with `delay` seconds added to every forward pass (a stream of 4096
    tokens outlasts any test); it records what was still in use when it closed."""

    def __init__(self, delay: float) -> None:
        super().__init__(tiny_llama(seed=5, **MODEL), ByteTokenizer(),
                         EngineConfig(page_size=16, device_tokens=2048, host_tokens=8192))
        self.model.register_forward_pre_hook(lambda *_: time.sleep(delay))
        self.in_use_at_close: tuple[int, int] | None = None
        """(requests generating, device pages leased) as the cache closed."""

    async def aclose(self) -> None:
        assert self.cache is not None
        self.in_use_at_close = (self.metrics.running, self.cache.stats().device_pages_leased)
        await super().aclose()


class Served:
    """`serve()` in a task of its own, under a cancel scope the test cancels (as a task
    group's cancel or ``move_on_after`` would)."""

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.url = ""
        self.listening = anyio.Event()
        self.stopped = anyio.Event()

    async def run(self, eng: Engine, **kwargs: Any) -> None:
        with self.scope:
            await serve(eng, "127.0.0.1", 0, on_ready=self._ready, **kwargs)
        self.stopped.set()

    def _ready(self, url: str) -> None:
        self.url = url
        self.listening.set()


async def test_a_cancelled_serve_unwinds_its_requests_before_the_cache_closes(
        caplog: pytest.LogCaptureFixture) -> None:
    eng, server = SlowEngine(0.01), Served()
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as session:
        tg.start_soon(functools.partial(server.run, eng, shutdown_timeout=0))  # cancel at once
        await server.listening.wait()
        stream = events(session, server.url, prompt=prompt_of(40, 12), max_tokens=4096,
                        temperature=0)
        assert isinstance(await anext(stream), dict)  # the handler is mid-stream
        server.scope.cancel()
        await server.stopped.wait()
        await stream.aclose()
    assert eng.in_use_at_close == (0, 0)  # no handler generating, no page leased
    assert eng.cache is not None and eng.cache.stats().device_pages_leased == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_shutdown_lets_requests_finish_for_the_timeout_then_cancels_the_rest() -> None:
    eng, server, grace = SlowEngine(0.01), Served(), 3.0  # 8 tokens: ~0.1 s, loaded CI
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as session:
        tg.start_soon(functools.partial(server.run, eng, shutdown_timeout=grace))
        await server.listening.wait()
        short = events(session, server.url, prompt=prompt_of(20, 13), max_tokens=8,
                       temperature=0)
        endless = events(session, server.url, prompt=prompt_of(20, 14), max_tokens=4096,
                         temperature=0)
        assert isinstance(await anext(short), dict) and isinstance(await anext(endless), dict)
        start = time.perf_counter()
        server.scope.cancel()
        rest = [e async for e in short]  # finishes within the grace period
        await server.stopped.wait()
        took = time.perf_counter() - start
        await endless.aclose()
    assert len(rest) == 9 and rest[-1] == "[DONE]"  # 7 more tokens, the finish, done
    assert grace <= took < grace + 5  # the endless stream was cancelled once the grace ran out
    assert eng.in_use_at_close == (0, 0)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
async def test_closing_a_generation_between_tokens_releases_everything_at_once(
        use_cache: bool) -> None:
    async with engine(use_cache=use_cache) as eng:
        gen = eng.generate(prompt_of(40, 15), SamplingParams(max_tokens=50), Usage(40))
        await anext(gen)
        await anext(gen)
        await gen.aclose()  # as a handler's aclosing() does when its client goes away
        assert eng.metrics.running == 0
        assert eng.cache is None or eng.cache.stats().device_pages_leased == 0


class ClosingSignalled(Engine):
    """The test engine; `closing` is set as it starts to close."""

    def __init__(self) -> None:
        super().__init__(tiny_llama(seed=5, **MODEL), ByteTokenizer(),
                         EngineConfig(page_size=16, device_tokens=2048, host_tokens=8192))
        self.closing = asyncio.Event()

    async def aclose(self) -> None:
        self.closing.set()
        await super().aclose()


async def test_an_engine_cancelled_while_it_closes_still_stops_its_compute_thread() -> None:
    eng, generated, before = ClosingSignalled(), asyncio.Event(), set(threading.enumerate())

    async def hold() -> None:
        async with eng:
            async with aclosing(eng.generate(prompt_of(20, 16), SamplingParams(max_tokens=1),
                                             Usage(20))) as gen:
                assert len([t async for t in gen]) == 1  # the compute thread has started
            generated.set()
            await anyio.sleep_forever()

    task = asyncio.create_task(hold())
    await generated.wait()
    threads = [t for t in set(threading.enumerate()) - before
               if t.name.startswith("aiohicache-compute")]
    task.cancel()
    await eng.closing.wait()
    task.cancel()  # a second cancellation (a supervisor, a timeout) while the cache closes
    with pytest.raises(asyncio.CancelledError):
        await task
    for thread in threads:
        thread.join(5)
    assert threads and not any(t.is_alive() for t in threads)


def test_ctrl_c_on_the_serve_command_returns_within_the_shutdown_timeout() -> None:
    with serve_command("--shutdown-timeout", "0.5") as (proc, url):

        async def interrupt_mid_stream() -> float:
            async with aiohttp.ClientSession() as session:
                stream = events(session, url, prompt="a stream that outlasts the test",
                                max_tokens=4096)  # ~4 ms a token: 16 s and more
                assert isinstance(await anext(stream), dict)
                start = time.perf_counter()
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(aiohttp.ClientPayloadError):  # cut mid-stream
                    async for _ in stream:
                        pass
                return time.perf_counter() - start

        took = asyncio.run(interrupt_mid_stream())
        assert took < 0.5 + 5, took  # not when the stream is done
        proc.wait(30)
        output = proc.stdout.read() if proc.stdout is not None else ""
        assert proc.returncode == 0 and "Traceback" not in output, output


def test_sigterm_stops_the_serve_command_as_ctrl_c_does(tmp_path: Path) -> None:
    with serve_command("--l3", "tmp", TMPDIR=str(tmp_path)) as (proc, _):
        assert [p.name[:14] for p in tmp_path.iterdir()] == ["aiohicache-l3-"]
        proc.terminate()
        proc.wait(30)
        output = proc.stdout.read() if proc.stdout is not None else ""
        assert proc.returncode == 0 and "Traceback" not in output, output
        assert list(tmp_path.iterdir()) == []  # the temporary L3 store is gone


def test_the_serve_command_refuses_a_negative_shutdown_timeout() -> None:
    result = CliRunner().invoke(cli, ["serve", "--shutdown-timeout", "-1"])
    assert result.exit_code == 2
    assert "Invalid value for '--shutdown-timeout': -1.0 is not in the range" in result.output


def test_the_serve_command_refuses_an_l1_under_one_page() -> None:
    """It was rounded up to one page, unsaid: the server ran with another L1 than asked."""
    result = CliRunner().invoke(cli, ["serve", "--l1", "8", "--page-size", "16"])
    assert result.exit_code == 2
    assert "Invalid value for '--l1': 8 is less than one page (16 tokens)" in result.output


@pytest.mark.parametrize("option", [["--l1", "4096"], ["--l2", "0"], ["--l3", "tmp"],
                                    ["--page-size", "32"], ["--cache-option", "eviction=arc"]])
def test_the_serve_command_refuses_cache_options_with_no_cache(option: list[str]) -> None:
    """``--no-cache`` has no cache to size: its options were ignored, unsaid."""
    result = CliRunner().invoke(cli, ["serve", "--no-cache", *option])
    assert result.exit_code == 2
    assert f"'{option[0]}' sets up the cache: --no-cache has none" in result.output


async def test_cache_options_reach_the_cache() -> None:
    """`EngineConfig.cache_options` are further `HiCacheConfig` fields: here a prefetch
    threshold under the default 256 tokens, so a short prompt is read from L3 after a
    restart (it was not: serve users could not lower it)."""
    storage = "memory://"
    backend = backend_from_url(storage, page_format(cache_config(
        tiny_llama(seed=5, **MODEL), EngineConfig(namespace="n"))))
    prompt = prompt_of(64, 3)
    low = {"prefetch_threshold": 16, "eviction": "arc"}
    for options, from_l3 in ((low, 0), ({}, 0), (low, 63)):  # 63: all but the last token
        async with engine(storage=backend, namespace="n", cache_options=options) as eng:
            assert eng.cache is not None
            assert eng.cache.config.prefetch_threshold == options.get("prefetch_threshold", 256)
            usage = Usage(prompt_tokens=len(prompt))
            [t async for t in eng.generate(prompt, SamplingParams(max_tokens=1), usage)]
            await eng.cache.drain()
        assert usage.tiers["L3"] == from_l3


@pytest.mark.parametrize(("options", "message"), [
    ({"page_size": 8}, "'page_size' is set by the engine"),
    ({"storage": "memory://"}, "'storage' is set by the engine"),
    ({"prefetch_treshold": 8}, "'prefetch_treshold' is not a HiCacheConfig field"),
    ([("eviction", "arc")], "a mapping"),
])
def test_cache_options_the_engine_owns_or_does_not_know_are_refused(options: Any,
                                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=f"cache_options: .*{message}"):
        EngineConfig(cache_options=options)


def test_a_bad_cache_option_value_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="prefetch_threshold"):
        engine(cache_options={"prefetch_threshold": -1})


@pytest.mark.parametrize(("args", "message"), [
    (["--cache-option", "eviction"], "is not NAME=VALUE"),
    (["--cache-option", "a=1", "--cache-option", "a=2"], "'a' is given twice"),
    (["--cache-option", "page_size=8"], "'page_size' is set by the engine"),
])
def test_the_serve_command_refuses_bad_cache_options(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "--cache-option" in result.output


def test_the_serve_command_refuses_an_l3_url_its_store_refuses_in_one_line() -> None:
    """An option the Redis client does not take passes the URL's syntax check and is refused
    when the store is made, as the server opens: that was a traceback after the model
    loaded, not a usage error naming --l3."""
    result = CliRunner().invoke(cli, ["serve", "--port", "0",
                                      "--l3", "redis://127.0.0.1:1/0?bogus=1"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--l3'" in result.output and "bogus" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("field, value, match", [
    ("device_tokens", 8, "device_tokens: 8 is less than one page"),
    ("host_tokens", -1, "host_tokens"),
    ("page_size", 0, "page_size"),
    ("max_running", 0, "max_running"),
    ("compute_threads", 0, "compute_threads"),
])
def test_an_engine_config_out_of_range_is_a_config_error(field: str, value: int,
                                                          match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{field: value})


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("where, reason", [
    ("busy", "Address already in use"),
    # NOTE: without DNS the resolver says "Temporary failure in name resolution"
    ("no-such-host.invalid", "(Name or service not known|Temporary failure in name resolution)"),
], ids=["busy-port", "unknown-host"])
def test_the_serve_command_says_in_one_line_why_it_cannot_listen(
        where: str, reason: str, busy_port: int) -> None:
    host, port = ("127.0.0.1", busy_port) if where == "busy" else (where, 8000)
    result = CliRunner().invoke(cli, ["serve", "--host", host, "--port", str(port),
                                      "--l1", "256", "--l2", "0"])
    assert result.exit_code == 1, result.exception
    assert re.fullmatch(f"Error: cannot listen on {re.escape(host)}:{port}: {reason}\n",
                        result.output), result.output
