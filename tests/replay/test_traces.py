"""Trace loaders and the synthetic generator: tokens, prefix sharing, interleaving, bad input."""

from __future__ import annotations

import gzip
import itertools
import json
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiohicache import ConfigError
from aiohicache.replay import Request, load_agentic, load_mooncake, load_trace, synthetic
from aiohicache.replay.traces import stream_mooncake

DATA = Path(__file__).resolve().parents[3] / "shared/data"
MOONCAKE = DATA / "mooncake/conversation_trace.jsonl"
AGENTIC = DATA / "kv-cache-tester/kv_cache_tester_60traces.jsonl.gz"


def make_request(ids: tuple[int, ...], length: int, block_size: int = 4) -> Request:
    return Request(arrival=0.0, input_length=length, output_length=1, block_size=block_size,
                   hash_ids=ids)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def mooncake_line(ts: int = 0, length: int = 600, ids: list[int] | None = None) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": length, "output_length": 7,
            "hash_ids": [0, 1] if ids is None else ids}


def agentic_line(trace: str, t: float, ids: list[int], extra: int = 0) -> dict[str, Any]:
    return {"trace": trace, "sub": None, "t": t, "type": "n", "think_time": 0.0, "api_time": 1.0,
            "input_length": 4 * len(ids) + extra, "output_length": 3, "block_size": 4,
            "hash_ids": ids}


# -- Request ----------------------------------------------------------------------------------


def test_tokens_are_blocks_of_hash_ids() -> None:
    tokens = make_request((3, 9), 8).tokens()
    assert tokens.dtype == np.int64
    assert tokens.tolist() == [12, 13, 14, 15, 36, 37, 38, 39]


def test_partial_last_block_is_truncated() -> None:
    assert make_request((3, 9), 5).tokens().tolist() == [12, 13, 14, 15, 36]
    assert make_request((7,), 1).tokens().tolist() == [28]


@pytest.mark.parametrize(("a", "b", "shared_tokens"), [
    pytest.param((1, 2, 3), (1, 2, 4), 8, id="diverge-third"),
    pytest.param((1, 2, 3), (1, 2, 3), 12, id="same"),
    pytest.param((1, 2), (2, 1), 0, id="swapped"),
    pytest.param((5, 6, 7), (5,), 4, id="prefix"),
])
def test_prefix_shared_exactly_as_far_as_ids_agree(a: tuple[int, ...], b: tuple[int, ...],
                                                     shared_tokens: int) -> None:
    ta, tb = make_request(a, 4 * len(a)).tokens(), make_request(b, 4 * len(b)).tokens()
    n = min(len(ta), len(tb))
    differ = np.flatnonzero(ta[:n] != tb[:n])
    assert (differ[0] if len(differ) else n) == shared_tokens


def test_tokens_are_deterministic_and_fresh() -> None:
    request = make_request((4, 1, 8), 10, block_size=4)
    first = request.tokens()
    first[:] = -1
    again = request.tokens()
    assert again.tolist() == [16, 17, 18, 19, 4, 5, 6, 7, 32, 33]
    big = make_request(tuple(range(100, 400)), 300 * 512 - 1, block_size=512).tokens()
    assert big.tolist() == [h * 512 + i for h in range(100, 400) for i in range(512)][:-1]


@pytest.mark.parametrize(("fields", "names"), [
    pytest.param({"input_length": 9}, "input_length=9", id="too-long"),
    pytest.param({"input_length": 4}, "input_length=4", id="too-short"),
    pytest.param({"input_length": 0}, "input_length", id="zero"),
    pytest.param({"hash_ids": ()}, "input_length", id="no-ids"),
    pytest.param({"hash_ids": (1, -2)}, "hash_ids", id="negative-id"),
    pytest.param({"hash_ids": (2**62, 1)}, "overflow", id="huge-id"),
    pytest.param({"block_size": 0}, "block_size", id="block-size"),
    pytest.param({"output_length": -1}, "output_length", id="output"),
    pytest.param({"arrival": -1.0}, "arrival", id="arrival"),
    pytest.param({"arrival": float("nan")}, "arrival", id="arrival-nan"),
])
def test_request_rejects_bad_fields(fields: dict[str, Any], names: str) -> None:
    args: dict[str, Any] = {"arrival": 0.0, "input_length": 6, "output_length": 0,
                            "block_size": 4, "hash_ids": (1, 2)}
    with pytest.raises(ConfigError, match=names):
        Request(**{**args, **fields})


# -- Mooncake ---------------------------------------------------------------------------------


def test_load_mooncake(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        mooncake_line(1500, 600, [0, 1]), "", mooncake_line(4000, 512, [0])])
    requests = load_mooncake(path)
    assert requests == [
        Request(arrival=0.0, input_length=600, output_length=7, block_size=512, hash_ids=(0, 1)),
        Request(arrival=2.5, input_length=512, output_length=7, block_size=512, hash_ids=(0,))]
    assert load_mooncake(path, limit=1) == requests[:1]
    assert load_mooncake(path, limit=0) == []


@pytest.mark.parametrize(("line", "message"), [
    pytest.param("{not json", "not JSON", id="json"),
    pytest.param("[1, 2]", "expected a JSON object", id="not-object"),
    pytest.param({"timestamp": 5, "input_length": 600, "output_length": 1}, "'hash_ids'",
                 id="missing"),
    pytest.param(mooncake_line(5, 2000), "input_length=2000", id="length-lies"),
    pytest.param({**mooncake_line(5), "hash_ids": [0, "x"]}, "'hash_ids'", id="id-type"),
    pytest.param({**mooncake_line(5), "input_length": 600.0}, "'input_length'", id="float"),
    pytest.param(mooncake_line(-5), "backwards", id="time-backwards"),
])
def test_mooncake_bad_line_names_file_and_line(tmp_path: Path, line: Any, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [mooncake_line(0), line])
    with pytest.raises(ConfigError, match=rf"bad\.jsonl:2: .*{message}"):
        load_mooncake(path)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    for name in ("absent.jsonl", "absent.jsonl.gz"):
        with pytest.raises(ConfigError, match=r"absent\.jsonl"):
            load_trace(str(tmp_path / name))


def test_corrupt_gzip_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(b"this is not gzip")
    with pytest.raises(ConfigError, match=r"broken\.jsonl\.gz"):
        load_agentic(path)


# -- agentic sessions --------------------------------------------------------------------------


@pytest.fixture
def three_sessions(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "s.jsonl.gz", [
        agentic_line("a", 0.0, [100, 101]), agentic_line("a", 25.0, [100, 101, 102]),
        agentic_line("b", 0.0, [200]), agentic_line("b", 5.0, [200, 201]),
        agentic_line("b", 40.0, [200, 201, 202]),
        agentic_line("c", 0.0, [300], extra=3),
    ])


def summary(requests: list[Request]) -> list[tuple[str | None, float]]:
    return [(r.session, r.arrival) for r in requests]


def test_agentic_interleave_by_arrival(three_sessions: Path) -> None:
    requests = load_agentic(three_sessions, session_gap=10.0)
    # a starts at 0, b at 10, c at 20; each keeps its own t offsets; merged by arrival.
    assert summary(requests) == [("a", 0.0), ("b", 10.0), ("b", 15.0), ("c", 20.0),
                                 ("a", 25.0), ("b", 50.0)]
    assert summary(load_agentic(three_sessions, session_gap=10.0, limit=2)) == [
        ("a", 0.0), ("b", 10.0)]


def test_agentic_arrival_ties_go_to_lower_session(three_sessions: Path) -> None:
    requests = load_agentic(three_sessions, session_gap=0.0)
    assert summary(requests) == [("a", 0.0), ("b", 0.0), ("c", 0.0), ("b", 5.0),
                                 ("a", 25.0), ("b", 40.0)]


def test_agentic_round_robin(three_sessions: Path) -> None:
    requests = load_agentic(three_sessions, interleave="round_robin")
    assert [r.session for r in requests] == ["a", "b", "c", "a", "b", "b"]
    assert {r.arrival for r in requests} == {0.0}
    assert [len(r.hash_ids) for r in requests] == [2, 1, 2, 3, 2, 3]


def test_agentic_partial_block_gets_a_fresh_id(three_sessions: Path) -> None:
    requests = load_agentic(three_sessions)
    (c,) = [r for r in requests if r.session == "c"]
    assert c.input_length == 7 and c.hash_ids == (300, 301)  # 301: above every id in the file
    assert all(r.hash_ids == tuple(range(r.hash_ids[0], r.hash_ids[0] + len(r.hash_ids)))
               for r in requests if r.session != "c")


def test_agentic_shared_ids_are_namespaced_per_session(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "clash.jsonl.gz", [
        agentic_line("x", 0.0, [1, 2]), agentic_line("y", 0.0, [1, 2]),
        agentic_line("x", 1.0, [1, 2, 3]), agentic_line("y", 1.0, [1, 5]),
    ])
    x1, y1, x2, y2 = load_agentic(path, session_gap=0.0)
    assert not set(x1.hash_ids + x2.hash_ids) & set(y1.hash_ids + y2.hash_ids)
    assert x2.hash_ids[:2] == x1.hash_ids and y2.hash_ids[:1] == y1.hash_ids[:1]
    assert y2.hash_ids[1] != y1.hash_ids[1]


@pytest.mark.parametrize(("line", "message"), [
    pytest.param({**agentic_line("a", 9.0, [1]), "input_length": 3}, "hash_ids", id="ids"),
    pytest.param(agentic_line("a", 1.0, [1]), "backwards", id="t-backwards"),
    pytest.param({**agentic_line("a", 9.0, [1]), "trace": 7}, "'trace'", id="trace"),
])
def test_agentic_bad_line_names_file_and_line(tmp_path: Path, line: Any, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl.gz", [agentic_line("a", 2.0, [1]), line])
    with pytest.raises(ConfigError, match=rf"bad\.jsonl\.gz:2: .*{message}"):
        load_agentic(path)


def test_agentic_rejects_bad_arguments(three_sessions: Path) -> None:
    with pytest.raises(ConfigError, match="interleave"):
        load_agentic(three_sessions, interleave="random")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="session_gap"):
        load_agentic(three_sessions, session_gap=-1.0)
    with pytest.raises(ConfigError, match="limit"):
        load_agentic(three_sessions, limit=-1)


@pytest.mark.skipif(not AGENTIC.exists(), reason="shared agentic trace is not here")
def test_agentic_real_trace() -> None:
    requests = load_trace(str(AGENTIC))
    assert len(requests) == 1034
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    owner: dict[int, str | None] = {}
    for r in requests:
        assert r.block_size == 64
        for h in r.hash_ids:
            assert owner.setdefault(h, r.session) == r.session  # no block crosses sessions
    by_session: defaultdict[str | None, list[Request]] = defaultdict(list)
    for r in requests:
        by_session[r.session].append(r)
    assert len(by_session) == 60
    first = by_session["trace_0002"]
    assert first[1].hash_ids[:first[0].num_full_blocks] == first[0].hash_ids[:-1]


# -- synthetic ---------------------------------------------------------------------------------


SMALL = {"num_sessions": 5, "turns_per_session": 3, "num_system_prompts": 2,
         "system_prompt_tokens": 64, "turn_tokens": 20, "output_tokens": 10, "block_size": 16}


def test_synthetic_histories_grow_by_reply_and_turn() -> None:
    requests = synthetic(**SMALL)
    assert len(requests) == 15
    assert [r.session for r in requests[:6]] == ["s0", "s1", "s2", "s3", "s4", "s0"]
    assert [r.input_length for r in requests[::5]] == [84, 114, 144]
    for s in range(5):
        turns = requests[s::5]
        for prev, cur in itertools.pairwise(turns):
            assert cur.hash_ids[:len(prev.hash_ids)] == prev.hash_ids
            assert (cur.tokens()[:prev.input_length] == prev.tokens()).all()


def test_synthetic_sessions_share_only_their_system_prompt() -> None:
    requests = synthetic(**SMALL)
    last = requests[-5:]  # every session's longest prompt
    for a in last:
        for b in last:
            if a is b:
                continue
            shared = set(a.hash_ids) & set(b.hash_ids)
            same_prompt = a.hash_ids[:4] == b.hash_ids[:4]  # 64 tokens = 4 whole blocks
            assert shared == (set(a.hash_ids[:4]) if same_prompt else set())
    assert len({r.hash_ids[:4] for r in last}) == 2


def test_synthetic_unaligned_system_prompt_shares_whole_blocks_only() -> None:
    requests = synthetic(**{**SMALL, "system_prompt_tokens": 40, "num_system_prompts": 1})
    a, b = requests[0], requests[1]
    assert a.hash_ids[:2] == b.hash_ids[:2] and a.hash_ids[2] != b.hash_ids[2]


def test_synthetic_is_deterministic_from_seed() -> None:
    args: dict[str, Any] = {**SMALL, "num_sessions": 40, "arrival_rate": 10.0}
    assert synthetic(**args, seed=3) == synthetic(**args, seed=3)
    assert synthetic(**args, seed=3) != synthetic(**args, seed=4)


def test_synthetic_arrivals() -> None:
    assert {r.arrival for r in synthetic(**SMALL)} == {0.0}
    arrivals = [r.arrival for r in synthetic(**{**SMALL, "num_sessions": 200},
                                             arrival_rate=50.0)]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert len(arrivals) / arrivals[-1] == pytest.approx(50.0, rel=0.15)


@pytest.mark.parametrize("override", [
    {"num_sessions": 0}, {"turn_tokens": 0}, {"block_size": 0}, {"num_system_prompts": 0},
    {"arrival_rate": 0.0}, {"arrival_rate": float("inf")},
], ids=str)
def test_synthetic_rejects_bad_arguments(override: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(override))):
        synthetic(**{**SMALL, **override})


# -- load_trace and the bundled slice -----------------------------------------------------------


def test_bundled_mooncake_slice() -> None:
    assert resources.files("aiohicache.replay").joinpath("data/LICENSE-APACHE").is_file()
    requests = load_trace("mooncake")
    assert len(requests) == 2000
    assert requests[0].hash_ids == tuple(range(14)) and requests[0].input_length == 6758
    assert load_trace("mooncake", limit=10) == requests[:10]
    if MOONCAKE.exists():
        assert load_mooncake(MOONCAKE, limit=2000) == requests


def test_load_trace_dispatch(tmp_path: Path, three_sessions: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [mooncake_line(0), mooncake_line(10)])
    assert len(load_trace(str(path))) == 2
    assert len(load_trace(str(three_sessions))) == 6
    default = load_trace("synthetic")
    assert len(default) == 512 and load_trace("synthetic", limit=3) == default[:3]
    with pytest.raises(ConfigError, match="unknown trace"):
        load_trace("sharegpt")


async def test_stream_mooncake_yields_what_load_mooncake_loads(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": 1000 * i, "input_length": 600,
                                          "output_length": 8, "hash_ids": [i, i + 1]})
                              for i in range(5)) + "\n\n")
    streamed = [r async for r in stream_mooncake(path, limit=4)]
    assert streamed == load_mooncake(path, limit=4)
    assert [r.arrival for r in streamed] == [0.0, 1.0, 2.0, 3.0]
