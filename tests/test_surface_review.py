"""Review of the user-facing surfaces (CLI, serve, replay): bad input is one clear error line
or a 4xx, never a traceback or a 500, and the replay's ``opt`` is an upper bound of the online
policies on the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aiohicache import CapacityError, HiCache, HiCacheConfig, KVSpec
from aiohicache.cli import cli
from aiohicache.errors import ConfigError
from aiohicache.replay import Request, load_trace
from aiohicache.replay.runner import MODELS, ReplayConfig, replay

TINY = ["--no-progress", "--model", "tiny", "--kv-scale", "1", "--page-size", "16",
        "--l3", "none"]
"""A replay that allocates next to nothing."""


def _error_line(args: list[str]) -> str:
    """The one error line of a refused command: exit 2, no traceback."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "Traceback" not in result.output, result.output
    return last


# -- eviction: a request that cannot fit evicts nothing; opt is an upper bound -----------------


async def test_an_allocate_that_cannot_fit_beside_its_own_prefix_evicts_nothing() -> None:
    """A request whose new pages fit the pool, but not beside the prefix it has pinned, used to
    evict every other unpinned device page and then raise CapacityError anyway: one too-long
    prompt wiped L1 (with no L2, that KV was simply gone) and gained nothing."""
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=4, dtype="fp16")
    config = HiCacheConfig(spec=spec, page_size=4, device_pages=8, host_pages=0)
    other, prefix = list(range(1000, 1016)), list(range(12))  # 4 and 3 pages
    async with HiCache(config) as cache:
        for tokens in (other, prefix):
            async with cache.fetch(tokens) as hit:
                await hit.commit(tokens, await hit.allocate(len(tokens)))
        longer = prefix + list(range(100, 124))  # its 3 cached pages + 6 new: 9 > 8
        async with cache.fetch(longer) as hit:
            assert hit.num_cached_tokens == 12
            with pytest.raises(CapacityError):
                await hit.allocate(24)
        async with cache.fetch(other) as hit:
            assert hit.num_device_hit_tokens == 16  # still cached: nothing was evicted for it
        cache.check_invariants()


_BEATS_OPT = [(64, (622, 1027)), (29, (93,)), (90, (957, 1039)), (154, (622, 1040, 1041, 1042)),
              (19, (957,)), (176, (93, 1051, 1052, 1053))]
"""(input_length, hash_ids) of a trace (48-token blocks) that LRU served better than OPT: the
fourth request, long but with more of it cached under OPT, fit the pool's size check and
flushed L1 before failing; under LRU it failed the check up front."""


@pytest.mark.parametrize("online", ["lru", "lfu", "arc"])
async def test_opt_is_never_beaten_by_an_online_policy_on_the_same_replay(online: str) -> None:
    """``opt`` (Belady's MIN) is the replay's upper bound: an online policy serving more hits
    on the same sequential run means a replay's evictions are not what the policy chose."""
    requests = [Request(arrival=0.0, input_length=n, output_length=0, block_size=48,
                        hash_ids=ids) for n, ids in _BEATS_OPT]
    hits = {}
    for eviction in (online, "opt"):
        config = ReplayConfig(spec=MODELS["tiny"], device_tokens=128, host_tokens=0,
                              page_size=16, eviction=eviction)
        hits[eviction] = (await replay(config, requests)).l1_tokens
    assert hits["opt"] >= hits[online], hits


# -- trace files: a corrupt one is a usage error, not a traceback ------------------------------


def _corrupt_gzip(path: Path) -> str:
    """A gzip file whose header is fine and whose deflate data is not (a reserved block
    type): what a damaged download looks like past its first bytes."""
    path.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff\x07" + bytes(16))
    return str(path)


def test_a_trace_with_corrupt_compressed_data_is_a_config_error(tmp_path: Path) -> None:
    """zlib's error (not an OSError, unlike a bad header or a truncated file) escaped
    `load_trace` as itself, so every command printed a traceback."""
    path = _corrupt_gzip(tmp_path / "damaged.jsonl.gz")
    with pytest.raises(ConfigError, match=r"damaged\.jsonl\.gz: cannot read trace"):
        load_trace(path)


@pytest.mark.parametrize("command", [["replay"], ["bench", "tree"]])
def test_commands_refuse_a_trace_with_corrupt_compressed_data_in_one_line(
        tmp_path: Path, command: list[str]) -> None:
    path = _corrupt_gzip(tmp_path / "damaged.jsonl.gz")
    extra = TINY if command == ["replay"] else []
    line = _error_line([*command, path, *extra])
    assert "damaged.jsonl.gz" in line


def _deep_line(tmp_path: Path) -> str:
    """A Mooncake trace whose second line is JSON nested deeper than the parser recurses."""
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(good) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    return str(path)


def test_a_trace_line_nested_too_deep_is_a_config_error_naming_the_line(
        tmp_path: Path) -> None:
    """json.loads raises RecursionError, not JSONDecodeError, on deep nesting: it escaped the
    parser's ``file:line: not JSON`` as a traceback."""
    with pytest.raises(ConfigError, match=r"deep\.jsonl:2: "):
        load_trace(_deep_line(tmp_path))


@pytest.mark.parametrize("time_mode", ["fast", "timestamps"])
def test_replay_refuses_a_trace_line_nested_too_deep_in_one_line(tmp_path: Path,
                                                                 time_mode: str) -> None:
    line = _error_line(["replay", _deep_line(tmp_path), *TINY, "--time", time_mode])
    assert "deep.jsonl:2" in line


# -- serve --------------------------------------------------------------------------------------


pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp  # noqa: E402

from aiohicache.hf import tiny_llama  # noqa: E402
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, running_server  # noqa: E402

_MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
          "num_kv_heads": 2}


def _engine() -> Engine:
    return Engine(tiny_llama(seed=5, **_MODEL), ByteTokenizer(),
                  EngineConfig(page_size=16, device_tokens=2048, host_tokens=8192))


async def _post(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, Any]:
    async with session.post(f"{url}/v1/completions", data=data,
                            headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
async def test_a_tiny_positive_temperature_samples_greedily_not_a_500(
        temperature: float) -> None:
    """0 < temperature <= 2 is accepted, but logits / temperature overflowed to inf for a
    small one, softmax gave NaN and torch.multinomial raised: a 500 for a valid request.
    Such a temperature is greedy in the limit, so it must answer as temperature 0 does."""
    async with _engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        body = {"prompt": "hello", "max_tokens": 3}
        greedy = await _post(session, url, json.dumps({**body, "temperature": 0}).encode())
        status, got = await _post(session, url,
                                  json.dumps({**body, "temperature": temperature}).encode())
        assert status == 200, got
        assert got["aiohicache"]["token_ids"] == greedy[1]["aiohicache"]["token_ids"]
        assert eng.cache is not None and eng.cache.stats().device_pages_leased == 0


async def test_a_request_body_nested_too_deep_gets_a_400() -> None:
    """A malformed body is the client's error (400 naming the body), not the server's: deep
    nesting raised RecursionError out of the JSON parser, answered 500 with a logged
    traceback."""
    async with _engine() as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        status, got = await _post(session, url,
                                  b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
        assert status == 400 and "JSON" in got["error"]["message"], (status, got)

