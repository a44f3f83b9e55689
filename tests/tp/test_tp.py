"""Tensor parallelism on CPU: 2 and 4 real processes over gloo, as a TP server runs them.

Each rank (tests/tp/worker.py) has its own random copy delays and storage latency, errors and
corrupt pages, yet makes the same calls: after every consensus tick all ranks must report the
same tree (pages and ref counts included) and the same shared stats, every hit must return
exactly the KV that was committed, and a rank that dies or stalls must make the others fail
with a clear error within the timeout, not hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(tmp_path: Path, size: int, *, stuck: int | None = None,
              **args: Any) -> list[dict[str, Any]]:
    """Start `size` worker processes, wait for them (killing rank `stuck` once the others
    are done), return their reports by rank."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.tp.worker",
         json.dumps({**args, "rank": r, "size": size, "port": port, "out": str(tmp_path)})],
        cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": str(r)})  # hashes differ by rank
        for r in range(size)]
    try:
        for r, p in enumerate(procs):
            if r != stuck:
                p.wait(timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    reports = []
    for r in range(size):
        path = tmp_path / f"rank{r}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"rank": r})
    return reports


def assert_ranks_agree(reports: list[dict[str, Any]]) -> None:
    for rep in reports:
        assert "crash" not in rep, rep["crash"]
        assert "error" not in rep, f"rank {rep['rank']}: {rep['error']}: {rep['message']}"
        assert rep["invariants"] == "ok"
        assert rep["wrong_kv"] == 0, f"rank {rep['rank']} served wrong KV"
    first = reports[0]
    assert len(first["ticks"]) > 20
    for rep in reports[1:]:
        assert len(rep["ticks"]) == len(first["ticks"]), "ranks ran different numbers of ticks"
        for mine, theirs in zip(rep["ticks"], first["ticks"], strict=True):
            assert mine == theirs, f"rank {rep['rank']} differs from rank 0 after tick {mine[0]}"
        assert rep["final"] == first["final"]
        assert rep["fingerprint"] == first["fingerprint"]


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_stay_identical_under_random_delays_and_faults(tmp_path: Path, size: int) -> None:
    reports = run_ranks(tmp_path, size, seed=size, steps=25 if size == 2 else 15)
    assert_ranks_agree(reports)
    final = reports[0]["final"]
    # The workload really exercised every path: hits on all three tiers, evictions, L3.
    assert final["device_hit_tokens"] > 0 and final["host_hit_tokens"] > 0
    assert final["host_evicted_pages"] > 0 and final["backed_up_pages"] > 0
    assert final["prefetches"] > 0
    assert sum(r["storage_errors"] for r in reports) > 0, "no storage fault was injected"
    assert all(r["checked_tokens"] > 0 for r in reports)


def test_write_back_and_wait_complete(tmp_path: Path) -> None:
    reports = run_ranks(tmp_path, 2, seed=7, steps=20, write_policy="write_back",
                        prefetch_policy="wait_complete", device_pages=24)
    assert_ranks_agree(reports)
    final = reports[0]["final"]
    assert final["writes"] > 0 and final["device_evicted_pages"] > 0  # staged write-backs
    assert final["host_hit_tokens"] > 0


def test_mla_pages_are_written_once_and_read_by_every_rank(tmp_path: Path) -> None:
    store = tmp_path / "store"
    reports = run_ranks(tmp_path, 2, seed=3, steps=20, mla=True, storage=f"file://{store}",
                        storage_errors=0.0, storage_corrupt=0.0, revisit=True, batch=2,
                        device_pages=40, host_pages=16, prefetch_policy="wait_complete")
    assert_ranks_agree(reports)
    final = reports[0]["final"]
    assert final["storage_hit_tokens"] > 0  # each rank read pages the other one wrote
    files = [p for p in store.rglob("*") if p.is_file()]
    assert 0 < len(files) <= final["backed_up_pages"]  # one object per page, not per rank


@pytest.mark.parametrize("scenario", ["kill", "stall"])
def test_a_dead_or_stuck_rank_fails_the_others_cleanly(tmp_path: Path, scenario: str) -> None:
    timeout = 4.0
    start = time.time()
    reports = run_ranks(tmp_path, 3, seed=11, steps=12, scenario=scenario, die_at=4,
                        tp_timeout=timeout, stuck=2)
    survivors = reports[:2]
    for rep in survivors:
        assert "crash" not in rep, rep["crash"]
        assert rep["error"] == "RankTimeoutError", rep
        assert "consensus tick" in rep["message"]
        assert rep["invariants"] == "ok" and rep["wrong_kv"] == 0
        assert rep["closed_state"] == "closed"
        assert rep["error_at"] - start < 120
    if scenario == "kill":
        died = float((tmp_path / "died_at").read_text())
        assert all(rep["error_at"] - died < timeout + 10 for rep in survivors)


def test_ranks_that_make_different_calls_stop_with_divergence_error(tmp_path: Path) -> None:
    reports = run_ranks(tmp_path, 2, seed=5, steps=10, scenario="diverge", die_at=3,
                        tp_timeout=5.0)
    for rep in reports:
        assert "crash" not in rep, rep["crash"]
        assert rep["error"] in ("DivergenceError", "RankTimeoutError"), rep
    assert any(rep["error"] == "DivergenceError" for rep in reports)
