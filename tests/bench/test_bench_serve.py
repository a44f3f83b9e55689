"""`aiohicache bench serve`: trace sessions as token ids, driven over HTTP, cache vs none."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from click.testing import CliRunner

from aiohicache.bench.serve import drive, format_serve, sessions_from_trace
from aiohicache.cli import cli
from aiohicache.hf import tiny_llama
from aiohicache.replay import Request
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, running_server


def request(arrival: float, ids: tuple[int, ...], length: int,
            session: str | None = None) -> Request:
    return Request(arrival=arrival, input_length=length, output_length=4, block_size=64,
                   hash_ids=ids, session=session)


def test_sessions_keep_the_traces_prefix_sharing_in_token_ids() -> None:
    trace = [request(0.0, (1, 2, 3), 180, "a"), request(1.0, (7, 8), 128, "b"),
             request(2.0, (1, 2, 3, 4), 250, "a")]
    sessions = sessions_from_trace(trace, block_tokens=4, vocab_size=1000)
    (a1, a2), (b1,) = sessions
    assert (len(a1), len(a2), len(b1)) == (12, 16, 8)  # 180 tokens of 64-token blocks: 12
    assert a2[:12] == a1 and b1[:4] != a1[:4]  # equal ids, equal tokens; others differ
    assert all(0 <= t < 1000 for t in a2)
    # Mooncake has no session ids: the first two blocks name a session
    mooncake = [request(0.0, (0, 5, 6), 192), request(1.0, (0, 9), 128),
                request(2.0, (0, 5, 6, 7), 256)]
    assert [len(s) for s in sessions_from_trace(mooncake, block_tokens=1,
                                                vocab_size=100)] == [2, 1]


async def test_the_workload_over_http_hits_with_the_cache_and_recomputes_without() -> None:
    trace = [request(float(i), tuple(range(100 * s, 100 * s + 3 + i)), 64 * (3 + i), str(s))
             for s in range(3) for i in range(3)]
    sessions = sessions_from_trace(trace, block_tokens=8, vocab_size=512)
    results = []
    for use_cache in (True, False):
        model = tiny_llama(seed=3, vocab_size=512, hidden_size=64, num_layers=2)
        config = EngineConfig(page_size=8, device_tokens=1024, use_cache=use_cache)
        async with Engine(model, ByteTokenizer(), config) as eng, running_server(eng) as url:
            results.append(await drive(url, sessions, name="cache" if use_cache else "none",
                                       concurrency=2, max_tokens=2))
    cached, none = results
    assert len(cached.samples) == len(none.samples) == 9
    # each session's later turns extend its first: 2 of 3 turns hit all but one new block
    assert cached.hit_ratio() == cached.hit_ratio("L1") == pytest.approx(
        (24 + 32) * 3 / ((24 + 32 + 40) * 3))
    assert none.hit_ratio() == 0.0
    assert all(s.completion_tokens == 2 and 0 < s.ttft <= s.latency for s in cached.samples)
    table = format_serve(results, title="t")
    assert "TTFT p50" in table and "x lower with the cache" in table


def test_the_command_runs_both_servers_and_reports_side_by_side() -> None:
    out = CliRunner().invoke(cli, ["bench", "serve", "--requests", "3", "--concurrency", "2",
                                   "--block-tokens", "2", "--max-tokens", "1", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert [m["mode"] for m in report["modes"]] == ["cache", "no cache"]
    assert all(m["requests"] == 3 for m in report["modes"])
    assert report["modes"][1]["hit_ratio"] == 0.0
