"""`aiohicache replay`: a real cache replays traces; single-tier hits equal the oracle's."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from aiohicache import ConfigError, HiCache
from aiohicache._lagprobe import LagSummary
from aiohicache.cli import cli
from aiohicache.replay import Request, load_trace, stream_trace, synthetic
from aiohicache.replay._result import Timing, make_result
from aiohicache.replay.report import format_result, to_json
from aiohicache.replay.runner import (
    MODELS,
    ReplayConfig,
    ReplayResult,
    _run_timed,
    parse_capacity,
    replay,
    scaled_spec,
)
from aiohicache.replay.traces import BUNDLED_MOONCAKE
from tests.oracle import PrefixLRU


@pytest.mark.parametrize(("page_size", "num_requests", "capacity"), [
    (64, 600, 200_000), (64, 600, 1_000_000), (16, 200, 150_000), (256, 2000, 2_000_000)])
def test_single_tier_replay_hits_equal_the_independent_oracle(
        page_size: int, num_requests: int, capacity: int) -> None:
    requests = load_trace("mooncake", limit=num_requests)
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=capacity, host_tokens=0,
                          page_size=page_size)
    result = asyncio.run(replay(config, requests))
    oracle = PrefixLRU(capacity // page_size, page_size=page_size)
    expected = sum(oracle.serve(r.tokens().tolist(), slot_pages=True) for r in requests)
    assert result.l1_tokens == expected
    assert result.l2_tokens == 0 and result.prompt_tokens == sum(r.input_length for r in requests)


def ever_cached_hits(requests: list[Request], capacity: int, page_size: int
                     ) -> tuple[int, int]:
    """(L1 hit tokens, L1+L2+L3 hit tokens) of a replay whose L2 and L3 keep every page L1
    ever held: L1 is the single-tier oracle (every page a request uses ends up on the
    device, computed or loaded back), and the rest hits the longest prefix of pages L1 held
    at some time before. Pages are named by a hash chain of their tokens."""
    oracle, ever = PrefixLRU(capacity // page_size, page_size=page_size), set()
    l1 = total = 0
    for request in requests:
        tokens = request.tokens().tolist()
        names, name = [], 0
        for k in range(len(tokens) // page_size):
            name = hash((name, tuple(tokens[k * page_size:(k + 1) * page_size])))
            names.append(name)
        total += page_size * next((k for k, n in enumerate(names) if n not in ever),
                                  len(names))
        hit = oracle.serve(tokens, slot_pages=True)
        l1 += hit
        if -(-(len(tokens) - hit) // page_size) <= capacity // page_size - hit // page_size:
            ever.update(names)  # the oracle inserted the request's whole pages
    return l1, total


@pytest.mark.parametrize(("page_size", "l3"), [(64, None), (256, "memory://")])
async def test_l1_equals_the_single_tier_oracle_and_all_tiers_every_page_ever_cached(
        page_size: int, l3: str | None) -> None:
    """Independent of the cache: with L2 (and L3) large enough to keep every page, L1 serves
    what one tier of its size would, and L1+L2(+L3) every page L1 ever held before."""
    requests = load_trace("mooncake", limit=300)
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=100_000, page_size=page_size,
                          host_tokens=10_000_000 if l3 is None else 150_000, storage=l3)
    result = await replay(config, requests)
    l1, total = ever_cached_hits(requests, 100_000, page_size)
    assert result.l1_tokens == l1
    assert result.l1_tokens + result.l2_tokens + result.l3_tokens == total
    assert (result.l3_tokens > 0) == (l3 is not None)


async def test_two_tiers_serve_at_least_what_one_tier_does() -> None:
    requests = load_trace("mooncake", limit=500)
    one = await replay(ReplayConfig(spec=MODELS["tiny"], device_tokens=200_000,
                                    host_tokens=0), requests)
    two = await replay(ReplayConfig(spec=MODELS["tiny"], device_tokens=200_000,
                                    host_tokens=1_000_000), requests)
    assert two.l2_tokens > 0 and two.bytes_h2d > 0 and two.bytes_d2h > 0
    assert two.hit_ratio > one.hit_ratio


async def test_concurrent_and_timestamped_replays_complete_with_sane_counts() -> None:
    requests = synthetic(num_sessions=12, turns_per_session=4, num_system_prompts=2,
                         system_prompt_tokens=512, turn_tokens=128, output_tokens=64,
                         arrival_rate=200.0)
    for cfg in (ReplayConfig(spec=MODELS["tiny"], device_tokens=20_000, host_tokens=80_000,
                             concurrency=8),
                ReplayConfig(spec=MODELS["tiny"], device_tokens=20_000, host_tokens=80_000,
                             time_mode="timestamps", speedup=50.0, concurrency=8)):
        r = await replay(cfg, requests)
        assert r.requests == len(requests)
        assert r.l1_tokens + r.l2_tokens + r.recomputed_tokens == r.prompt_tokens
        assert r.hit_ratio > 0.3  # shared system prompts and growing histories


def test_kv_scale_divides_bytes_per_token_and_keeps_rows_usable() -> None:
    spec = MODELS["llama3-8b"]
    for scale in (1, 2, 32, 512, 4096):
        assert scaled_spec(spec, scale).bytes_per_token * scale == spec.bytes_per_token
    with pytest.raises(ConfigError, match="^kv_scale:"):
        scaled_spec(spec, 3)


@pytest.mark.parametrize(("text", "tokens"), [
    ("512k", 512_000), ("10.24M", 10_240_000), ("2000", 2000), ("1GiB", 2**30 // 1024),
    ("2GB", 2 * 10**9 // 1024),
    # decimal, not binary floating point: 16.016 * 1000 is 16015.999999999998 as floats
    ("16.016k", 16_016), ("1.001k", 1001), ("64.064k", 64_064), ("2.049kB", 2)])
def test_capacities_in_tokens_or_bytes(text: str, tokens: int) -> None:
    assert parse_capacity(text, bytes_per_token=1024, field_name="l1") == tokens


def test_byte_capacities_are_exact_decimal_multiples() -> None:
    assert parse_capacity("1.001kB", bytes_per_token=1, field_name="l1") == 1001
    assert parse_capacity("16.016kB", bytes_per_token=16, field_name="l1") == 1001


def test_an_l3_password_is_not_printed() -> None:
    """The L3 URL shows in the table's header and the JSON: without its user and password,
    as everywhere else a storage URL is shown."""
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=1024, host_tokens=1024,
                          storage="redis://admin:hunter2@cache-host:6379/0?password=hunter3")
    cache_config = config.cache_config()
    lag = LagSummary(samples=0, p50_ms=0.0, p99_ms=0.0, max_ms=0.0)
    result = make_result(config, cache_config, HiCache(cache_config).stats(),
                         Timing(1.0, lag, lag), 0)
    shown = format_result(result) + to_json([result])
    assert "hunter" not in shown and "admin" not in shown
    assert "cache-host:6379/0" in shown


def test_bad_capacity_names_the_option() -> None:
    with pytest.raises(ConfigError, match="^l2:"):
        parse_capacity("lots", bytes_per_token=1, field_name="l2")


def test_cli_replay_prints_the_table() -> None:
    result = CliRunner().invoke(cli, ["replay", "--limit", "200", "--no-progress",
                                      "--model", "tiny", "--kv-scale", "1"])
    assert result.exit_code == 0, result.output
    for row in ("served from L1", "served from L2", "served from L3", "recomputed",
                "hit ratio", "L2 <-> L3 throughput", "event-loop lag", "requests/s"):
        assert row in result.output


def test_cli_replay_json_and_sweep_with_plot(tmp_path: object) -> None:
    png = f"{tmp_path}/curve.png"
    result = CliRunner().invoke(cli, ["replay", "--limit", "200", "--json", "--model", "tiny",
                                      "--kv-scale", "1", "--l2", "0", "--page-size", "16",
                                      "--sweep", "50k,200k", "--plot", png])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["device_tokens"] for r in rows] == [50_000, 200_000]
    assert rows[0]["hit_ratio"] <= rows[1]["hit_ratio"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_replay_json_of_a_sweep_is_a_list_even_of_one() -> None:
    """A script reads a sweep's rows the same way whatever the number of capacities."""
    result = CliRunner().invoke(cli, ["replay", "--limit", "20", "--json", "--model", "tiny",
                                      "--kv-scale", "1", "--l2", "0", "--l3", "none",
                                      "--page-size", "16", "--sweep", "50k"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert isinstance(rows, list) and [r["device_tokens"] for r in rows] == [50_000]


def test_cli_replay_rejects_bad_options_clearly() -> None:
    result = CliRunner().invoke(cli, ["replay", "--l1", "plenty", "--no-progress"])
    assert result.exit_code == 2 and "l1:" in result.output
    result = CliRunner().invoke(cli, ["replay", "no/such/trace.jsonl", "--no-progress"])
    assert result.exit_code == 2


def _usage_error_line(args: list[str]) -> str:
    """The one error line of a usage error (exit 2, no traceback)."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: "), result.output
    return last


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://x", "unknown URL scheme 'ftp'"), ("memory://x", "memory URLs take nothing"),
    ("redis://h:notaport/0", "port 'notaport'"), ("file://otherhost/dir", "'otherhost'"),
    ("redis://h:1/db", "database number")])
def test_cli_replay_rejects_a_bad_l3_url_as_a_usage_error(url: str, why: str) -> None:
    line = _usage_error_line(["replay", "--l3", url, "--limit", "1", "--no-progress",
                              "--model", "tiny", "--kv-scale", "1"])
    assert "'--l3'" in line and why in line


@pytest.mark.parametrize("sweep", [",,", "", " ", "50k,,200k", "50k,"])
def test_cli_replay_rejects_blank_sweep_items(sweep: str) -> None:
    line = _usage_error_line(["replay", "--sweep", sweep, "--limit", "1", "--no-progress",
                              "--model", "tiny", "--kv-scale", "1"])
    assert "'--sweep'" in line


def test_cli_replay_rejects_a_cache_larger_than_the_machine() -> None:
    line = _usage_error_line(["replay", "--l1", "100000000G", "--limit", "1",
                              "--no-progress", "--model", "tiny", "--kv-scale", "1"])
    assert "device_pages" in line


async def test_settled_sequential_replays_are_deterministic() -> None:
    requests = load_trace("mooncake", limit=300)
    config = ReplayConfig(spec=MODELS["llama3-8b"], kv_scale=64, device_tokens=300_000,
                          host_tokens=1_000_000)  # 2 KiB/token: copies go to the threads
    first, second = [await replay(config, requests) for _ in range(2)]
    assert (first.l1_tokens, first.l2_tokens, first.bytes_h2d, first.bytes_d2h) == (
        second.l1_tokens, second.l2_tokens, second.bytes_h2d, second.bytes_d2h)


async def test_replay_with_a_file_l3_serves_from_all_three_tiers() -> None:
    requests = load_trace("mooncake", limit=600)
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=100_000, host_tokens=2_000_000,
                          page_size=256, storage="tmp")
    r = await replay(config, requests)
    assert r.l1_tokens > 0 and r.l2_tokens > 0 and r.l3_tokens > 0
    assert r.bytes_l3_written > 0 and r.bytes_l3_read > 0
    assert r.l1_tokens + r.l2_tokens + r.l3_tokens + r.recomputed_tokens == r.prompt_tokens


# -- streaming the trace (issue 15 item 4) ----------------------------------------------------


def _bundled_lines(limit: int) -> list[str]:
    source = resources.files("aiohicache.replay") / "data" / BUNDLED_MOONCAKE
    return source.read_text(encoding="utf-8").splitlines(keepends=True)[:limit]


async def test_a_timestamped_replay_serves_before_its_trace_is_written(tmp_path: Path) -> None:
    """The trace is a pipe: the test writes its first line, waits until the replay has served
    that request, and only then writes the rest. A replay that loaded the trace first would
    never serve anything (fail_after)."""
    lines = _bundled_lines(60)
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    first_served = anyio.Event()
    served_before_rest: list[int] = []
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=2_000_000, host_tokens=0,
                          time_mode="timestamps", speedup=1e4)

    def progress(n: int) -> None:
        first_served.set()

    async def feed() -> None:
        pipe = await anyio.to_thread.run_sync(open, fifo, "w")  # until the replay opens it
        try:
            await anyio.to_thread.run_sync(_write, pipe, lines[:1])
            await first_served.wait()
            served_before_rest.append(1)
            await anyio.to_thread.run_sync(_write, pipe, lines[1:])
        finally:
            pipe.close()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            result = await replay(config, stream_trace(str(fifo)), progress=progress)
    assert served_before_rest == [1]
    listed = load_trace("mooncake", limit=60)
    assert result.requests == 60
    assert result.prompt_tokens == sum(r.input_length for r in listed)


async def test_arrival_times_count_from_the_first_request_read() -> None:
    """A timed replay starts its clock when the first request is in hand: the time a trace
    takes to load (a .jsonl.gz is read whole first) was taken out of the first arrivals,
    and requests meant to be 0.3 s apart started together."""
    started: list[float] = []

    async def serve(request: Request) -> bool:
        started.append(anyio.current_time())
        return True

    async def slow_to_load() -> AsyncIterator[Request]:
        await anyio.sleep(0.5)  # the whole trace being read
        for arrival in (0.0, 0.3):
            yield Request(arrival=arrival, input_length=4, output_length=0, block_size=4,
                          hash_ids=(1,))

    config = ReplayConfig(spec=MODELS["tiny"], time_mode="timestamps", speedup=1.0)
    await _run_timed(serve, slow_to_load(), config)
    assert started[1] - started[0] >= 0.25, started


def _write(pipe: Any, lines: list[str]) -> None:
    pipe.writelines(lines)
    pipe.flush()


async def test_a_streamed_trace_replays_to_the_same_numbers_as_a_loaded_one(
        tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(_bundled_lines(300)))
    config = ReplayConfig(spec=MODELS["llama3-8b"], kv_scale=64, device_tokens=300_000,
                          host_tokens=1_000_000)
    loaded = await replay(config, load_trace(str(path)))
    streamed = await replay(config, stream_trace(str(path)))
    assert _numbers(streamed) == _numbers(loaded)


def _numbers(r: ReplayResult) -> tuple[int, ...]:
    return (r.requests, r.prompt_tokens, r.l1_tokens, r.l2_tokens, r.l3_tokens,
            r.recomputed_tokens, r.bytes_h2d, r.bytes_d2h)


def test_cli_timestamped_replay_streams_a_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(_bundled_lines(50)))
    result = CliRunner().invoke(cli, ["replay", str(path), "--time", "timestamps",
                                      "--speedup", "1000", "--no-progress", "--json",
                                      "--model", "tiny", "--kv-scale", "1", "--l3", "none"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["requests"] == 50


def test_cli_timestamped_replay_reports_a_bad_line_as_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(_bundled_lines(3)) + "not json\n")
    line = _usage_error_line(["replay", str(path), "--time", "timestamps", "--speedup",
                              "1000", "--no-progress", "--model", "tiny", "--kv-scale", "1",
                              "--l3", "none"])
    assert f"{path}:4: not JSON" in line


def test_cli_replay_stalls_reports_stacks_on_stderr() -> None:
    result = CliRunner().invoke(cli, ["replay", "--limit", "50", "--no-progress", "--json",
                                      "--model", "tiny", "--kv-scale", "1", "--l3", "none",
                                      "--stalls", "0.5"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 50
    assert "stalls > 0.5 ms" in result.stderr
