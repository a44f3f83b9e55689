"""Review of the serving engine and its HTTP face: streamed text, the output's commit when the
cache fails, and requests the server cannot honour (tiny model, real HTTP)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp

from aiohicache import ConfigError
from aiohicache.hf import tiny_llama
from aiohicache.serve import (
    ByteTokenizer,
    Engine,
    EngineConfig,
    SamplingParams,
    Usage,
    running_server,
)

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}


def engine(tokenizer: Any = None, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192}
    fields.update(overrides)
    return Engine(tiny_llama(seed=5, **MODEL), tokenizer or ByteTokenizer(),
                  EngineConfig(**fields))


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 512 for i in range(n)]


async def raw_post(session: aiohttp.ClientSession, url: str, body: str) -> tuple[int, Any]:
    async with session.post(f"{url}/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:  # a 500's page
        return resp.status, text


async def streamed_text(session: aiohttp.ClientSession, url: str, **body: Any) -> str:
    """The text of a streamed completion: its chunks' texts joined."""
    text = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                text += [c["text"] for c in choices]
    return "".join(text)


def generating(ids: Sequence[int]) -> Any:
    """A stand-in for `Engine.generate` that yields `ids` (what a real tokenizer's model
    would emit), so the text of the tokens is known."""

    async def generate(prompt: list[int], params: SamplingParams,
                       usage: Usage) -> AsyncIterator[int]:
        for token in ids:
            usage.completion_tokens += 1
            yield token
    return generate


async def test_streamed_text_joins_to_the_text_of_the_completion_with_multibyte_characters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's pieces join to the non-streamed text. Each token was decoded alone, so a
    character whose UTF-8 bytes span tokens (byte-level BPE; the byte tokenizer) streamed as
    U+FFFD replacement characters: "h\\ufffd\\ufffdllo" for "héllo"."""
    text = "héllo wörld ✓ 日本"
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        monkeypatch.setattr(eng, "generate", generating(list(text.encode())))
        plain_status, plain = await raw_post(session, url, '{"prompt": "x"}')
        streamed = await streamed_text(session, url, prompt="x")
    assert plain_status == 200 and plain["choices"][0]["text"] == text
    assert streamed == text


class SentencePieceLike:
    """Decodes as SentencePiece does: a word's piece carries its leading space ("▁"), and
    the space of a sequence's first piece is dropped."""

    pieces: ClassVar[dict[int, str]] = {1: "▁Hello", 2: "▁world", 3: ",", 4: "▁again"}

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


async def test_a_sentencepiece_tokenizer_streams_the_spaces_between_words(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoded alone, every token is a sequence's first piece and loses its space: the
    stream read "Helloworld,again" where the completion is "Hello world, again"."""
    async with engine(SentencePieceLike()) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        monkeypatch.setattr(eng, "generate", generating([1, 2, 3, 4]))
        streamed = await streamed_text(session, url, prompt="x")
    assert streamed == "Hello world, again"


async def test_a_cache_failing_after_the_last_token_does_not_lose_the_completion() -> None:
    """Caching the generated tokens' KV is an extra: when the cache fails meanwhile
    (another request's copy failed), the request still gets every token. The commit's
    `WorkerError` was raised after the last token: the server answered a finished
    non-streamed completion with a 500, and cut a stream before its finish and [DONE]."""
    async with engine() as eng:
        assert eng.cache is not None
        gen = eng.generate(prompt_of(40, 1), SamplingParams(max_tokens=4, temperature=0),
                           Usage(40))
        got = [await anext(gen)]
        eng.cache.controller.fail(RuntimeError("a copy of another request failed"))
        got += [token async for token in gen]
        assert len(got) == 4 and eng.metrics.running == 0
        assert eng.cache.stats().device_pages_leased == 0 and eng.cache.stats().health == "failed"


async def test_a_prompt_with_a_lone_surrogate_is_a_400_naming_the_prompt() -> None:
    """JSON can spell a lone surrogate; no tokenizer encodes it. It was a 500 (the byte
    tokenizer's UnicodeEncodeError)."""
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        status, got = await raw_post(session, url, '{"prompt": "ok \\ud800", "max_tokens": 1}')
        fine, _ = await raw_post(session, url, '{"prompt": "ok \\ud83d\\ude00", "max_tokens": 1}')
    assert status == 400 and "prompt" in got["error"]["message"]
    assert fine == 200  # a surrogate pair is one character


async def test_null_optional_fields_ask_for_their_defaults() -> None:
    """OpenAI's optional fields are nullable, and clients send nulls for what they leave
    unset: ``"max_tokens": null`` asks for the default (16), not a 400."""
    body = {"prompt": "x", "max_tokens": None, "temperature": None, "stream": None,
            "seed": None, "stop": None, "n": None}
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        status, got = await raw_post(session, url, json.dumps(body))
    assert status == 200, got
    assert got["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("field, value", [
    ("n", 3), ("best_of", 2), ("logprobs", 1), ("echo", True),
    ("suffix", "end"), ("presence_penalty", 1.0), ("logit_bias", {"5": 10}),
    ("n", True),
])
async def test_fields_the_server_does_not_implement_are_refused_by_name(field: str,
                                                                        value: object) -> None:
    """A request the server cannot honour gets a 400 naming the field. They were ignored:
    ``"n": 3`` got one choice (and ``"stop"`` the text past the stop, until it was
    implemented: tests/serve/test_stop.py). Their values that ask for nothing are accepted."""
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        status, got = await raw_post(session, url, json.dumps(
            {"prompt": "x", "max_tokens": 1, field: value}))
        neutral = {"n": 1, "best_of": 1, "stop": [], "echo": False,
                   "presence_penalty": 0, "logit_bias": {}, "suffix": ""}
        ok, _ = await raw_post(session, url, json.dumps({"prompt": "x", "max_tokens": 1,
                                                         **neutral}))
    assert status == 400 and got["error"]["message"].startswith(f"{field}:")
    assert ok == 200


def test_an_l2_under_one_page_is_a_config_error_not_no_l2() -> None:
    """``host_tokens`` under one page became 0 host pages: no L2 tier at all, unsaid (as
    ``device_tokens`` under a page was rounded up, before it was refused)."""
    with pytest.raises(ConfigError, match="host_tokens"):
        EngineConfig(page_size=16, host_tokens=8)
    assert EngineConfig(page_size=16, host_tokens=0).host_tokens == 0  # no L2: as asked


def test_top_p_keeps_the_fewest_most_likely_tokens_that_reach_it() -> None:
    """Nucleus sampling draws from the smallest set of most likely tokens whose mass reaches
    `top_p`; the most likely token always stays."""
    from aiohicache.serve.engine import _nucleus
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    assert _nucleus(probs.clone(), 0.5).tolist() == [0, 0.5, 0, 0]
    assert _nucleus(probs.clone(), 0.6).tolist() == [0, 0.5, 0, 0.25]
    assert _nucleus(probs.clone(), 0.95).tolist() == [0.1, 0.5, 0.15, 0.25]
    assert _nucleus(probs.clone(), 1e-9).tolist() == [0, 0.5, 0, 0]


async def test_top_p_is_honoured_and_checked() -> None:
    """A tiny `top_p` keeps only the most likely token: sampling then gives the greedy
    completion, whatever the temperature. It was ignored (a sampled completion); a top_p out
    of (0, 1] is a 400 naming it."""
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8}
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        _, greedy = await raw_post(session, url, json.dumps({**body, "temperature": 0}))
        nucleus = [await raw_post(session, url, json.dumps(
            {**body, "temperature": 2, "top_p": 1e-6, "seed": seed})) for seed in range(3)]
        _, hot = await raw_post(session, url, json.dumps({**body, "temperature": 2, "seed": 0}))
        bad = [await raw_post(session, url, json.dumps({**body, "top_p": p}))
               for p in (0, 1.5, "0.5", True)]
    ids = greedy["aiohicache"]["token_ids"]
    assert all(got["aiohicache"]["token_ids"] == ids for _, got in nucleus)
    assert hot["aiohicache"]["token_ids"] != ids  # the draw is not greedy without top_p
    assert all(status == 400 and got["error"]["message"].startswith("top_p:")
               for status, got in bad)


def test_sampling_params_are_checked() -> None:
    """`SamplingParams` built by hand (the engine's Python API) refuses what would fail or
    mean nothing mid-generation."""
    for fields in ({"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -1.0},
                   {"temperature": float("nan")}, {"max_tokens": 0}):
        with pytest.raises(ConfigError, match=next(iter(fields))):
            SamplingParams(**fields)  # type: ignore[arg-type]


async def test_a_server_fault_is_a_500_not_a_client_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `ConfigError` that is not about the request (a model whose KV does not fit its
    spec, found at the first layer) is the server's fault: 500, not a 400 telling the
    client to change a request that is fine. A prompt the model cannot take stays a 400."""
    async def misfit(prompt: list[int], params: SamplingParams,
                     usage: Usage) -> AsyncIterator[int]:
        raise ConfigError("kv: the model computed 1 KV head, its spec says 4")
        yield 0

    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        bad_prompt, _ = await raw_post(session, url, json.dumps(
            {"prompt": [5, 600], "max_tokens": 1}))  # 600: past the vocabulary
        monkeypatch.setattr(eng, "_cached", misfit)
        status, got = await raw_post(session, url, json.dumps({"prompt": "x", "max_tokens": 1}))
    assert bad_prompt == 400
    assert status == 500 and "kv:" in got["error"]["message"]


async def test_the_hit_by_tier_sums_to_the_cached_tokens() -> None:
    """`cached_tiers` splits `cached_tokens` (prompt tokens not computed) by tier, and the
    server's hit counters add it up. A prompt found whole still computes its last token
    (its logits): the tiers said 64 where `cached_tokens` said 63."""
    prompt = prompt_of(64, 3)  # four whole pages: found whole the second time
    async with engine() as eng:
        for _ in range(2):
            usage = Usage(len(prompt))
            async for _ in eng.generate(prompt, SamplingParams(max_tokens=1), usage):
                pass
        assert usage.cached_tokens == 63
        assert sum(usage.tiers.values()) == usage.cached_tokens
        assert eng.metrics.hit_tokens["L1"] == 63


async def test_past_max_waiting_a_request_is_refused_at_once_with_a_503() -> None:
    """Requests beyond `max_running` wait for a turn; beyond `max_waiting` of those, one more
    gets a 503 with Retry-After at once (counted), instead of a queue without bound. The
    waiting ones are served when turns free up."""
    async with engine(max_running=1, max_waiting=1) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        gate = asyncio.Event()
        real = eng._admitted

        async def held(*args: Any) -> AsyncIterator[int]:
            await gate.wait()  # the running request holds its turn until the test says
            async for token in real(*args):
                yield token

        eng._admitted = held  # type: ignore[method-assign]
        body = json.dumps({"prompt": "x", "max_tokens": 1})
        running = asyncio.create_task(raw_post(session, url, body))
        waiting = asyncio.create_task(raw_post(session, url, body))
        while eng.metrics.waiting < 1:  # noqa: ASYNC110 - polled: the engine has no event
            await asyncio.sleep(0.01)
        async with session.post(f"{url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            status, retry, got = resp.status, resp.headers.get("Retry-After"), await resp.json()
        metrics = await (await session.get(f"{url}/metrics")).text()
        gate.set()
        assert [s for s, _ in await asyncio.gather(running, waiting)] == [200, 200]
    assert (status, retry, got["error"]["type"]) == (503, "1", "server_busy")
    assert "aiohicache_busy_rejections_total 1" in metrics
    assert "aiohicache_requests_waiting 1" in metrics
    assert eng.metrics.waiting == 0


def test_max_waiting_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_waiting"):
        EngineConfig(max_waiting=-1)
