"""Where a completion ends: the model's end-of-sequence token and the request's stop strings.

A completion ends with ``finish_reason: "stop"`` at the first end-of-sequence token the model
generates (yielded last and counted, its text left out) or at the first of the request's
``stop`` strings in the text (the text is cut before it and generation stops there), else
with ``"length"`` after ``max_tokens``. Streamed or not, the text is the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp

from aiohicache.hf import tiny_llama
from aiohicache.serve import Engine, EngineConfig, SamplingParams, Usage, running_server

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
PROMPT = [(7919 + i * 31) % 512 for i in range(40)]
MAX = 12


class WordTokenizer:
    """Each id reads ``<id>`` (so any text is the concatenation of its tokens' texts)."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.strip("<>").split("><")]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def engine(eos: int | list[int] | None = None) -> Engine:
    model = tiny_llama(seed=5, **MODEL)
    model.generation_config.eos_token_id = eos
    return Engine(model, WordTokenizer(), EngineConfig(page_size=16, device_tokens=2048,
                                                       host_tokens=8192))


async def complete(eos: int | list[int] | None = None, **body: Any) -> tuple[
        dict[str, Any], list[dict[str, Any]]]:
    """The plain response and the streamed events (less ``[DONE]``) of one request."""
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, **body}
    async with engine(eos) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            plain = {**await resp.json(), "status": resp.status}
        streamed = []
        if plain["status"] == 200:
            async with session.post(f"{url}/v1/completions",
                                    json={**body, "stream": True}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        streamed.append(json.loads(line[6:]))
        assert eng.cache is not None and eng.cache.stats().device_pages_leased == 0
        eng.cache.check_invariants()
    return plain, streamed


async def greedy() -> list[int]:
    """The completion's ids when nothing ends it early."""
    plain, _ = await complete()
    ids: list[int] = plain["aiohicache"]["token_ids"]
    assert len(ids) == MAX and plain["choices"][0]["finish_reason"] == "length"
    return ids


def streamed_text(events: list[dict[str, Any]]) -> tuple[str, list[int], str]:
    """The joined text, the ids and the finish reason of a stream."""
    text = "".join(e["choices"][0]["text"] for e in events)
    ids = [i for e in events for i in e["token_ids"]]
    return text, ids, events[-1]["choices"][0]["finish_reason"]


async def test_the_models_end_of_sequence_token_ends_the_completion() -> None:
    """The first end-of-sequence token is the last token: counted and listed, not in the
    text. It was not looked for: a checkpoint's completion ran past its end until
    `max_tokens`, into text the model never meant."""
    ids = await greedy()
    eos = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    end = ids.index(eos) + 1
    plain, events = await complete(eos=[999_999, eos])  # a list, as Llama-3 instruct has
    assert plain["aiohicache"]["token_ids"] == ids[:end]
    assert plain["usage"]["completion_tokens"] == end
    assert plain["choices"][0] == {"index": 0, "text": WordTokenizer().decode(ids[:end - 1]),
                                   "logprobs": None, "finish_reason": "stop"}
    assert streamed_text(events) == (plain["choices"][0]["text"], ids[:end], "stop")


async def test_ignore_eos_generates_max_tokens() -> None:
    """``ignore_eos`` (vLLM's field, for benchmarks) generates on past the end."""
    ids = await greedy()
    plain, _ = await complete(eos=ids[2], ignore_eos=True)
    assert plain["aiohicache"]["token_ids"] == ids
    assert plain["choices"][0]["finish_reason"] == "length"


async def test_a_stop_string_cuts_the_text_before_it_and_ends_generation() -> None:
    """The text ends before the first stop string, which may span tokens; generation stops
    at the token that completed it (the ids up to it are returned and counted)."""
    ids = await greedy()
    full = WordTokenizer().decode(ids)
    stop = f"{ids[5]}><{ids[6]}"  # across a token boundary
    cut = full.find(stop)
    end = next(n for n in range(1, MAX + 1) if stop in WordTokenizer().decode(ids[:n]))
    assert end < MAX  # the test stops generation early
    plain, events = await complete(stop=["never there", stop])
    assert plain["choices"][0]["text"] == full[:cut]
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["aiohicache"]["token_ids"] == ids[:end]
    assert plain["usage"]["completion_tokens"] == end
    assert streamed_text(events) == (full[:cut], ids[:end], "stop")
    assert not any(stop in e["choices"][0]["text"] for e in events)


async def test_streamed_text_that_may_start_a_stop_string_is_held_back_until_it_does_not(
        ) -> None:
    """A token whose text ends like a stop string begins is not sent until the next tokens
    show it is not one; all of it is sent in the end."""
    ids = await greedy()
    plain, events = await complete(stop=f"<{ids[3]}>NOT A TOKEN")
    full = WordTokenizer().decode(ids)
    assert plain["choices"][0]["text"] == full
    assert plain["choices"][0]["finish_reason"] == "length"
    assert events[3]["choices"][0]["text"] == ""  # held: it could start the stop string
    assert streamed_text(events) == (full, ids, "length")


async def test_a_stop_string_in_the_first_token_gives_empty_text() -> None:
    ids = await greedy()
    plain, events = await complete(stop=f"<{ids[0]}>")
    assert plain["choices"][0]["text"] == "" and plain["aiohicache"]["token_ids"] == ids[:1]
    assert streamed_text(events) == ("", ids[:1], "stop")


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], [""], "", [1], {"x": 1},
                                  ["x" * 1025], True])
async def test_bad_stop_values_get_a_400_naming_the_field(stop: object) -> None:
    """``stop`` is a string or at most 4 of them (OpenAI's bound), none empty."""
    plain, _ = await complete(stop=stop)
    assert plain["status"] == 400 and plain["error"]["message"].startswith("stop:")


async def test_a_bad_ignore_eos_is_a_400() -> None:
    plain, _ = await complete(ignore_eos="yes")
    assert plain["status"] == 400 and plain["error"]["message"].startswith("ignore_eos:")


async def test_the_engine_yields_the_end_last_and_says_why_it_stopped() -> None:
    """`Engine.generate` without the server: the end-of-sequence token is the last one
    yielded and `Usage.finish_reason` is ``"stop"`` (``"length"`` with `ignore_eos`)."""
    ids = await greedy()
    for ignore, want, reason in ((False, ids[:ids.index(ids[1]) + 1], "stop"),
                                 (True, ids, "length")):
        async with engine(eos=ids[1]) as eng:
            usage = Usage(prompt_tokens=len(PROMPT))
            params = SamplingParams(max_tokens=MAX, ignore_eos=ignore)
            got = [t async for t in eng.generate(PROMPT, params, usage)]
        assert got == want and usage.finish_reason == reason
        assert usage.completion_tokens == len(want)


def test_the_default_tiny_model_has_no_end_of_sequence_token() -> None:
    """Its text is noise: a completion runs to its length (LlamaConfig's default id 2 would
    have ended one wherever byte 2 came up)."""
    from aiohicache.serve import ByteTokenizer
    eng = Engine(tiny_llama(seed=5, **MODEL), ByteTokenizer(), EngineConfig())
    assert eng.eos_token_ids == frozenset()


def test_the_text_held_back_is_the_longest_tail_that_begins_a_stop_string() -> None:
    """What a stream holds back, against the definition (every tail length of every stop),
    on random texts over a small alphabet, where overlaps are common."""
    import random

    from aiohicache.serve.app import _Text
    rng = random.Random(7)
    for _ in range(3000):
        stops = tuple("".join(rng.choices("ab<>", k=rng.randint(1, 6)))
                      for _ in range(rng.randint(1, 4)))
        text = _Text(WordTokenizer(), stops)
        text._text = "".join(rng.choices("ab<>", k=rng.randint(0, 12)))
        text._shown = rng.randint(0, len(text._text))
        rest = len(text._text) - text._shown
        want = max((k for s in stops for k in range(1, min(len(s) - 1, rest) + 1)
                    if text._text.endswith(s[:k])), default=0)
        assert text._held() == want, (stops, text._text, text._shown)
