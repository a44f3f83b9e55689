"""Smoke test of ``bench storage --quick``: it runs, reports both sections, cleans up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from aiohicache.bench.storage import QUICK, bench_storage, format_report, run_storage_bench
from aiohicache.cli import cli
from aiohicache.errors import ConfigError


def test_the_quick_bench_reports_both_sections() -> None:
    report = run_storage_bench(True)
    assert "bench storage (quick)" in report
    assert "1. FileBackend vs one raw sequential file" in report
    assert "2. Page keys: chain_keys over 65,536 int64 tokens" in report
    assert len([line for line in report.splitlines() if " write " in line]) == 1
    assert all(len(line) <= 100 for line in report.splitlines())


def test_the_bench_removes_its_directory_and_echoes_each_section(tmp_path: Path) -> None:
    shown: list[str] = []
    report = bench_storage(QUICK, directory=str(tmp_path), echo=shown.append)
    assert list(tmp_path.iterdir()) == []
    assert report.directory.startswith(str(tmp_path))
    assert shown[0].startswith("aiohicache bench storage") and "\n1. " in shown[0]
    assert shown[1].startswith("2. Page keys")
    assert format_report(report) == "\n".join(shown)
    assert [row.op for row in report.speed] == ["write", "read"]
    assert all(row.gbps > 0 and row.ratio > 0 for row in report.speed)


def test_calls_in_flight_are_a_size_of_the_bench(tmp_path: Path) -> None:
    sizes = dataclasses.replace(QUICK, in_flight=3)
    report = bench_storage(sizes, directory=str(tmp_path))
    assert "bench storage (quick)" in format_report(report)
    assert "32 pages per call, 3 calls in flight" in format_report(report)
    assert all(row.gbps > 0 for row in report.speed)
    assert "1 call in flight" in run_storage_bench(True)


def test_no_call_in_flight_is_refused() -> None:
    with pytest.raises(ConfigError, match="in_flight must be >= 1, got 0"):
        run_storage_bench(True, in_flight=0)


def test_the_command_takes_calls_in_flight() -> None:
    result = CliRunner().invoke(cli, ["bench", "storage", "--quick", "--in-flight", "2"])
    assert result.exit_code == 0, result.output
    assert "2 calls in flight" in result.output
    refused = CliRunner().invoke(cli, ["bench", "storage", "--quick", "--in-flight", "0"])
    assert refused.exit_code == 2 and "--in-flight" in refused.output
