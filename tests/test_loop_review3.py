"""Review (third pass): work that grew with a request or a trace ran on the event loop in one
stretch. As in ``test_loop_review.py``, each test counts the work done on the loop thread
(not wall time: this shared 2-core VM's own floor is 10+ ms), and each failed before its fix:

- `replay --time timestamps` of a kv-cache-tester trace (``.jsonl.gz``) read and parsed the
  whole file on the loop of the replay it feeds, after its cache had opened (the shared
  60-session file: 290 ms of the loop thread's CPU in one turn, before the replay's lag
  probe had started, so it never reported it);
- `aiohicache serve` tokenized a text prompt on the loop: with a fast HF tokenizer a
  103k-token prompt held it, and every other request's cache work and tokens, 125-175 ms
  of the loop thread's CPU (after: about 1 ms).
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp

from aiohicache.errors import ConfigError
from aiohicache.hf import tiny_llama
from aiohicache.replay import _fields, load_trace, stream_trace
from aiohicache.replay.runner import MODELS, ReplayConfig, replay
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, running_server


def _agentic_trace(path: Path, sessions: int, turns: int) -> Path:
    """A kv-cache-tester file: `sessions` sessions of `turns` growing prompts (64-token
    blocks), 100 ms apart."""
    lines = []
    for t in range(turns):
        for s in range(sessions):
            ids = [s * 1000 + b for b in range(4 * (t + 1))]
            lines.append(json.dumps({
                "trace": f"s{s}", "t": 0.1 * t, "input_length": 64 * len(ids) + 10,
                "output_length": 8, "block_size": 64, "hash_ids": ids, "think_time": 0.0,
                "api_time": 0.0}))
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def _lines_parsed_on_loop(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[trace lines parsed on the calling (loop) thread], wherever from."""
    loop_thread, count, real = threading.get_ident(), [0], _fields._parse_line

    def parse(where: str, line: str) -> Any:
        if threading.get_ident() == loop_thread:
            count[0] += 1
        return real(where, line)
    monkeypatch.setattr(_fields, "_parse_line", parse)
    return count


async def test_a_timed_replay_of_a_gzip_trace_does_not_parse_it_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole ``.jsonl.gz`` file is read before its first request (its sessions
    interleave): on a thread, not on the loop the replay's cache runs on. The replay
    serves every request, as one of the loaded trace does."""
    path = _agentic_trace(tmp_path / "agentic.jsonl.gz", sessions=40, turns=50)
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=200_000, host_tokens=0,
                          page_size=64, time_mode="timestamps", speedup=1e4)
    listed = load_trace(str(path), limit=60)
    on_loop = _lines_parsed_on_loop(monkeypatch)
    result = await replay(config, stream_trace(str(path), limit=60))
    assert on_loop[0] == 0, f"{on_loop[0]} of 2,000 trace lines parsed on the loop"
    assert result.requests == 60
    assert result.prompt_tokens == sum(r.input_length for r in listed)


async def test_a_bad_line_of_a_streamed_gzip_trace_is_still_a_config_error(
        tmp_path: Path) -> None:
    """Read on a thread, a bad line is raised as itself, naming ``file:line``."""
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"trace": "a", "t": 0}\nnot json\n'))
    with pytest.raises(ConfigError, match=r"bad\.jsonl\.gz:1: missing field"):
        async for _ in stream_trace(str(path)):
            pass


# -- serve --------------------------------------------------------------------------------


class _LoopCountingTokenizer(ByteTokenizer):
    """Bytes as tokens; counts the characters it encodes on the loop thread."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()
        self.on_loop = 0
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        if threading.get_ident() == self.loop_thread:
            self.on_loop += len(text)
        self.encoded.append(len(text))
        return super().encode(text)


async def test_a_long_text_prompt_is_not_tokenized_on_the_loop() -> None:
    """A 20k-character prompt is tokenized on a thread (a short one may stay on the loop);
    it is served as its token ids are."""
    tokenizer = _LoopCountingTokenizer()
    model = tiny_llama(seed=5, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2)
    engine = Engine(model, tokenizer, EngineConfig(page_size=16, device_tokens=32768,
                                                   host_tokens=0))
    text = "".join(chr(97 + (i * 7) % 26) for i in range(20_000))
    async with engine, running_server(engine) as url, aiohttp.ClientSession() as session:
        answers = [await _complete(session, url, prompt)
                   for prompt in (text, list(text.encode()), "hello")]
    assert tokenizer.encoded == [20_000, 5]
    assert tokenizer.on_loop <= 4096, f"{tokenizer.on_loop} characters tokenized on the loop"
    by_text, by_ids, short = answers
    assert by_text["aiohicache"]["token_ids"] == by_ids["aiohicache"]["token_ids"]
    assert by_text["usage"]["prompt_tokens"] == 20_000
    assert by_ids["usage"]["prompt_tokens"] == 20_000
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] > 19_000
    assert short["usage"]["prompt_tokens"] == 5


async def _complete(session: aiohttp.ClientSession, url: str,
                    prompt: str | Sequence[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
    return data
