"""Review of the replay tool and the Redis test-server helper: each test is a rule a replay
must keep for its numbers to be true, or the helper for its tests to be sound."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aiohicache import ConfigError, HiCache, _redis_server
from aiohicache._lagprobe import LagSummary
from aiohicache._redis_server import RedisServer
from aiohicache.cli import cli
from aiohicache.replay import Request, load_agentic, report
from aiohicache.replay._result import Timing, make_result
from aiohicache.replay.runner import MODELS, ReplayConfig, replay

PAGE = 16
free_port = _redis_server._free_port


def one_request(*ids: int) -> Request:
    return Request(arrival=0.0, input_length=len(ids) * PAGE, output_length=1,
                   block_size=PAGE, hash_ids=ids)


def l3_config(url: str, eviction: str = "lru") -> ReplayConfig:
    """Tiers of 32 and 64 pages; prompts of 20 pages are above the prefetch threshold."""
    return ReplayConfig(spec=MODELS["tiny"], device_tokens=32 * PAGE, host_tokens=64 * PAGE,
                        page_size=PAGE, storage=url, eviction=eviction)


# -- a replay against a persistent L3 (--l3 file:///dir, redis://) ------------------------------


async def test_a_replay_starts_with_an_empty_l3_whatever_an_earlier_replay_stored(
        tmp_path: Path) -> None:
    """Rows of a sweep, or policies compared side by side, replay one after another against
    the same ``--l3`` URL: each must start from an empty L3, or every row after the first is
    served pages the ones before it stored and its hit ratio is not the one it claims."""
    url = f"file://{tmp_path}"
    requests = [one_request(*range(20))]
    first = await replay(l3_config(url), requests)
    second = await replay(l3_config(url), requests)
    assert first.l3_tokens == 0
    assert (second.l3_tokens, second.hit_ratio) == (first.l3_tokens, first.hit_ratio)


async def test_opt_is_never_served_pages_another_replay_stored_under_other_content(
        tmp_path: Path) -> None:
    """``opt`` renames a trace's blocks by prefix (dense ids from 0), so its token ids name
    other content than an LRU replay's: a first request with nothing in common with anything
    replayed before is no hit, whatever the L3 holds."""
    url = f"file://{tmp_path}"
    await replay(l3_config(url), [one_request(*range(20))])
    result = await replay(l3_config(url, eviction="opt"), [one_request(*range(100, 120))])
    assert result.l3_tokens == 0 and result.hit_ratio == 0.0


# -- kv-cache-tester traces ---------------------------------------------------------------------


def agentic_file(path: Path, lines: list[dict[str, Any]]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_agentic_sessions_of_other_block_sizes_are_refused_not_shared(tmp_path: Path) -> None:
    """Hash id h of a block of B tokens is the tokens h*B .. h*B+B-1, so with two block sizes
    disjoint ids can name the same tokens: here session b (32-token blocks 20..39) would be
    served all of session a's KV (64-token blocks 10..19) though they share nothing. A trace
    with more than one block size is refused, naming the line, instead of replayed wrong."""
    path = agentic_file(tmp_path / "t.jsonl.gz", [
        {"trace": "a", "t": 0.0, "input_length": 640, "output_length": 1, "block_size": 64,
         "hash_ids": list(range(10, 20))},
        {"trace": "b", "t": 0.0, "input_length": 640, "output_length": 1, "block_size": 32,
         "hash_ids": list(range(20, 40))}])
    with pytest.raises(ConfigError, match=r"t\.jsonl\.gz:2: .*block_size 32.*64"):
        load_agentic(path)


# -- the Redis test-server helper ---------------------------------------------------------------


def test_a_redis_server_never_takes_another_servers_port_for_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A free port can be taken between choosing it and binding it, by another test
    process's redis-server: the new server then fails to bind and exits, but the port still
    answers PING. `start` must see that the answer is not its own process's and try another
    port, or the test talks to (and flushes) another process's server while its own is gone."""
    with RedisServer() as other:
        ports = iter([other.port])
        monkeypatch.setattr(_redis_server, "_free_port",
                            lambda: next(ports, None) or free_port())
        with RedisServer() as mine:
            assert mine.port != other.port
            assert mine.running


# -- what the report claims ------------------------------------------------------------------


def test_a_single_tier_replay_claims_no_l3(tmp_path: Path) -> None:
    """L3 is read into L2 and written from it: with ``--l2 0`` there is none, so the report
    must not say the replay had one (the default ``--l3 tmp`` made a store no page ever
    reached); ``--l3 none`` stays valid (docs/replay.md's single-tier commands), and an L3
    store given with ``--l2 0`` is a usage error, as other options that would have no effect
    are."""
    args = ["replay", "--limit", "5", "--json", "--model", "tiny", "--kv-scale", "1",
            "--page-size", "16", "--l2", "0"]
    for extra in ([], ["--l3", "none"]):
        result = CliRunner().invoke(cli, [*args, *extra])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["storage"] is None
    result = CliRunner().invoke(cli, [*args, "--l3", f"file://{tmp_path}"])
    assert result.exit_code == 2 and "'--l3'" in result.output, result.output


def test_the_plot_names_every_tier_its_hit_ratio_counts() -> None:
    """The curve is `hit_ratio`, (L1 + L2 + L3) / prompt tokens: with an L3 (the default
    ``--l3 tmp``) its label must not say "L1 + L2"."""
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=1024, host_tokens=4096,
                          page_size=PAGE, storage="tmp")
    cache_config = config.cache_config()
    lag = LagSummary(samples=0, p50_ms=0.0, p99_ms=0.0, max_ms=0.0)
    result = dataclasses.replace(
        make_result(config, cache_config, HiCache(cache_config).stats(), Timing(1.0, lag, lag),
                    0), prompt_tokens=100, l1_tokens=10, l2_tokens=20, l3_tokens=30)
    plt = report._pyplot()
    fig = report._draw(plt, [result], "")
    try:
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)
    assert labels == ["L1 + L2 + L3 hit ratio", "L1 hit ratio"]


def test_a_gzipped_mooncake_trace_is_read_as_mooncake(tmp_path: Path) -> None:
    """A ``.jsonl.gz`` holds a Mooncake trace as often as kv-cache-tester sessions: its
    first record says which. It was always read as sessions ("missing field 'trace'")."""
    from aiohicache.replay import load_mooncake, load_trace
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
             {"timestamp": 500, "input_length": 1536, "output_length": 4,
              "hash_ids": [1, 2, 3]}]
    plain, packed = tmp_path / "m.jsonl", tmp_path / "m.jsonl.gz"
    plain.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(plain.read_text())
    assert load_trace(str(packed)) == load_mooncake(plain) == load_trace(str(plain))
    assert len(load_trace(str(packed), limit=1)) == 1
    sessions = agentic_file(tmp_path / "s.jsonl.gz", [
        {"trace": "a", "t": 0, "input_length": 128, "output_length": 1, "block_size": 64,
         "hash_ids": [10, 11]}])
    assert len(load_trace(str(sessions))) == 1


def test_a_redis_server_start_interrupted_leaves_no_server_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or any exception) while `start` waits for the server to answer ends the
    process and removes its directory. It left the server running (and its port taken)
    for the rest of the test session."""
    spawned: list[int] = []

    def interrupted(port: int, password: str | None) -> int | None:
        spawned.append(port)
        raise KeyboardInterrupt

    monkeypatch.setattr(_redis_server, "_pid_on", interrupted)
    server = RedisServer()
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
        assert spawned and not server.running
        assert server._proc is None and server._dir is None
    finally:
        server.stop()  # (before the fix: the server left running)
