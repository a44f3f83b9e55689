"""Smoke test of ``bench storage --quick``: it runs, reports both sections, cleans up."""

from __future__ import annotations

from pathlib import Path

from aiohicache.bench.storage import QUICK, bench_storage, format_report, run_storage_bench


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
