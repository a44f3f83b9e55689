"""Review of the serve layer's endings and chat: stop strings, end of sequence, the output
they leave cached, chat deltas, the byte tokenizer's text and chat rendering off the loop.

Every request here is checked to leave the cache as it found it: no device page leased,
invariants intact.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp

from aiohicache.hf import tiny_llama
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, running_server
from tests.serve.test_chat import word_tokenizer

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
PAGE = 16
USER = " ".join(f"w{100 + i}" for i in range(20))
"""A user message of 20 words: its prompt is 22 tokens (a page and 6)."""


@asynccontextmanager
async def served(tokenizer: Any = None, eos: int | None = None) -> AsyncIterator[
        tuple[Engine, str, aiohttp.ClientSession]]:
    """An engine over the tiny model, its server and a client; on the way out, the cache
    holds no lease and its invariants hold."""
    model = tiny_llama(seed=5, **MODEL)
    model.generation_config.eos_token_id = eos
    eng = Engine(model, tokenizer or ByteTokenizer(),
                 EngineConfig(page_size=PAGE, device_tokens=2048, host_tokens=8192))
    async with eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        yield eng, url, session
        assert eng.cache is not None
        assert eng.cache.stats().device_pages_leased == 0
        eng.cache.check_invariants()


async def post(session: aiohttp.ClientSession, url: str, path: str,
               body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def events(session: aiohttp.ClientSession, url: str, path: str,
                 body: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed events of a request, less ``[DONE]`` (which must end it)."""
    async with session.post(f"{url}{path}", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        lines = [line.strip() async for line in resp.content if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


async def answer(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 stream: bool) -> tuple[str, list[int]]:
    """The chat's answer text and its generated ids, streamed or not."""
    if not stream:
        got = await post(session, url, "/v1/chat/completions", body)
        return got["choices"][0]["message"]["content"], got["aiohicache"]["token_ids"]
    chunks = await events(session, url, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, [i for c in chunks for i in c["token_ids"]]


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


# ------------------------------------------------------------------ the output's commit


@pytest.mark.parametrize(("ending", "stream"), [
    ("length", False), ("eos", False), ("stop", False), ("stop", True)])
async def test_a_next_turn_quoting_the_answer_hits_its_kv_however_the_answer_ended(
        ending: str, stream: bool) -> None:
    """The generated tokens' KV is cached whatever ended the answer (its length, the
    model's end of sequence, a stop string): a next turn quoting the answer is served all
    its whole pages. It was not when a stop string ended the answer (the generator was
    closed before its commit): the next turn computed the answer again. The KV cached is
    the KV of the tokens fed to the model, so it is never wrong for another text: a turn
    quoting the answer cut before the stop string hits only up to where it diverges."""
    tok = word_tokenizer()
    first = [{"role": "user", "content": USER}]
    body: dict[str, Any] = {"messages": first, "max_tokens": 16, "temperature": 0}
    async with served(tok) as (_, url, session):  # the free answer, to pick the ending
        _, ids = await answer(session, url, body, False)
    assert len(ids) == 16
    eos = None
    if ending == "eos":
        eos = next(t for i, t in enumerate(ids) if i >= 12 and t not in ids[:i])
    elif ending == "stop":
        k = next(i for i in range(12, 16) if ids[i] not in ids[:i])
        body["stop"] = tok.decode(ids[k - 1:k + 1])  # across a token boundary
    async with served(tok, eos) as (eng, url, session):
        text, got = await answer(session, url, body, stream)
        assert (ending == "length") == (len(got) == 16)
        turn2 = [*first, {"role": "assistant", "content": text},
                 {"role": "user", "content": "w7 w8"}]
        second = await post(session, url, "/v1/chat/completions",
                            {"messages": turn2, "max_tokens": 1})
        assert eng.metrics.running == 0
    prompt1 = tok.apply_chat_template(first, add_generation_prompt=True, return_dict=False)
    prompt2 = tok.apply_chat_template(turn2, add_generation_prompt=True, return_dict=False)
    assert len(prompt1) == 22
    shared = common(prompt2, [*prompt1, *got[:-1]])  # the last token was never fed
    assert shared // PAGE * PAGE > len(prompt1) // PAGE * PAGE  # the answer fills a page
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= shared // PAGE * PAGE, f"the {ending} answer's KV was not cached"


async def test_a_stop_string_ends_the_request_with_no_decode_step_past_it() -> None:
    """Ending at a stop string runs no forward pass past the token that completed it: the
    engine counts the tokens up to it, no more."""
    tok = word_tokenizer()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": USER}],
                            "max_tokens": 16, "temperature": 0}
    async with served(tok) as (eng, url, session):
        _, ids = await answer(session, url, body, False)
        before = eng.metrics.generated_tokens
        got = await post(session, url, "/v1/chat/completions",
                         {**body, "stop": tok.decode(ids[4:6])})
        assert got["aiohicache"]["token_ids"] == ids[:6]
        assert got["usage"]["completion_tokens"] == 6
        assert got["choices"][0]["finish_reason"] == "stop"
        assert eng.metrics.generated_tokens - before == 6


# ------------------------------------------------------------------ chat stream shapes


async def test_a_streamed_chat_names_the_role_in_its_first_delta_only() -> None:
    """Only the first chunk's delta carries ``role``; each later one only ``content``. The
    first was told by ``token is first``: CPython keeps one object for each int up to 256,
    so a later token equal to the first (a byte here) sent the role again."""
    body = {"messages": [{"role": "user", "content": "Say 79"}], "max_tokens": 11,
            "temperature": 0}
    async with served() as (_, url, session):
        chunks = await events(session, url, "/v1/chat/completions", body)
    ids = [i for c in chunks for i in c["token_ids"]]
    assert ids[0] < 257 and ids[0] in ids[1:]  # the case: the first token comes again
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert [d for d in deltas[1:] if "role" in d] == []


# ------------------------------------------------------------------ the byte tokenizer


def byte_text(ids: list[int]) -> str:
    """What the byte tokenizer's text of `ids` is: each run of bytes as UTF-8 (bad bytes as
    U+FFFD), each id past 255 as ``<id>``."""
    out, run = "", b""
    for i in ids:
        if i < 256:
            run += bytes([i])
        else:
            out, run = out + run.decode(errors="replace") + f"<{i}>", b""
    return out + run.decode(errors="replace")


def test_the_byte_tokenizers_text_of_a_sequence_is_its_parts_texts() -> None:
    """An id past 255 turned the whole sequence's bytes but printable ASCII into
    ``<byte>``: the text of a sequence was not the texts of its parts joined."""
    tok = ByteTokenizer()
    assert tok.decode([10, 300]) == "\n<300>" == tok.decode([10]) + tok.decode([300])
    assert tok.decode([0xC3, 0xA9, 300, 0xC3, 0xA9]) == "é<300>é"
    assert tok.decode(list(b"hi")) == "hi" and tok.decode([]) == ""


async def test_the_tiny_models_text_is_its_bytes_and_its_large_ids_streamed_or_not() -> None:
    """The default model's completion mixes bytes and ids past 255: its text is each
    token's text in turn, streamed or not. The streamed pieces were differences of decoded
    windows that did not extend each other: a control byte then a large id read
    ``"\\x1622><406>"``."""
    body = {"prompt": "Tell me about 4", "max_tokens": 8, "temperature": 0}
    async with served() as (_, url, session):
        plain = await post(session, url, "/v1/completions", body)
        chunks = await events(session, url, "/v1/completions", body)
    ids = plain["aiohicache"]["token_ids"]
    assert ids[0] < 32 <= 256 <= ids[1]  # the case: a control byte, then a large id
    assert plain["choices"][0]["text"] == byte_text(ids)
    assert "".join(c["choices"][0]["text"] for c in chunks) == byte_text(ids)


# ------------------------------------------------------------------ rendering off the loop


async def test_a_chat_of_many_short_messages_is_rendered_off_the_event_loop() -> None:
    """A chat is rendered and tokenized on a thread once it is long, counted in messages as
    well as characters: a template takes about 7 us a message, and a 1 MiB body of empty
    messages (34k) held the loop for 0.22 s because their text summed to nothing."""
    tok = word_tokenizer()
    real, on_loop = tok.apply_chat_template, []

    def spy(*args: Any, **kwargs: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)
    tok.apply_chat_template = spy
    many = [{"role": "user", "content": ""}] * 2000
    async with served(tok) as (_, url, session):
        got = await post(session, url, "/v1/chat/completions",
                         {"messages": many, "max_tokens": 1})
        assert got["usage"]["prompt_tokens"] == 2001
        few = await post(session, url, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 1})
        assert few["usage"]["prompt_tokens"] == 3
    assert on_loop == [False, True]  # a short chat still renders inline (no thread hop)


# ------------------------------------------------------------------ fields that move the end


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("field", "value", "neutral"), [
    ("stop_token_ids", [65], []), ("min_tokens", 4, 0),
    ("include_stop_str_in_output", True, False)])
async def test_vllm_fields_that_move_the_end_are_refused_by_name_unless_neutral(
        path: str, field: str, value: object, neutral: object) -> None:
    """vLLM's and SGLang's fields for where a completion ends, beside `ignore_eos`, are
    not implemented: refused by name (as OpenAI's are) unless at the value that asks for
    nothing. They were ignored: ``stop_token_ids`` got a 200 that ran past its token."""
    body: dict[str, Any] = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2}
    async with served() as (_, url, session):
        async with session.post(f"{url}{path}", json={**body, field: value}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"].startswith(f"{field}:")
        await post(session, url, path, {**body, field: neutral})


# ------------------------------------------------------------------ cancellation


async def test_a_request_a_stop_string_ends_leaks_nothing_wherever_it_is_cancelled() -> None:
    """A consumer that ends a generation at a stop string (`Usage.finish_reason` set to
    ``"stop"``, then the next step, which caches the output) and is cancelled at any loop
    turn after, the commit's included, leaves no lease, no running request and the cache's
    invariants; left alone, it ends with no decode step past its stop."""
    from aiohicache.serve import SamplingParams, Usage
    prompt = ByteTokenizer().encode("a prompt of two pages and a bit more, to be cached!")
    async with served() as (eng, _, _):
        assert eng.cache is not None
        turns = 0
        while True:
            usage, stopped = Usage(prompt_tokens=len(prompt)), asyncio.Event()

            async def consume(usage: Usage = usage, stopped: asyncio.Event = stopped,
                              ) -> list[int]:
                got: list[int] = []
                async for token in eng.generate(prompt, SamplingParams(max_tokens=9), usage):
                    got.append(token)
                    if len(got) == 5:
                        usage.finish_reason = "stop"  # as the server does at a stop string
                        stopped.set()
                return got
            task = asyncio.create_task(consume())
            await stopped.wait()
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                done = False
            else:
                done = True
                assert len(got) == 5 and usage.completion_tokens == 5
            assert eng.cache.stats().device_pages_leased == 0
            assert eng.metrics.running == 0
            eng.cache.check_invariants()
            if done:
                break
            turns += 1
        assert turns > 2  # the commit took loop turns: each was a cancellation point
