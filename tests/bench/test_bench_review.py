"""Review of the benchmarks: what a bench prints is what it measured, in the unit it names,
and a bench leaves nothing running behind it."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner

from aiohicache.bench import QUICK, _core_lag
from aiohicache.bench._core_format import format_lag
from aiohicache.cli import cli
from tests.test_cli import _trace

# -- bench tree --capacity ------------------------------------------------------------------


@pytest.mark.parametrize("capacity", ["64KiB", "1GB", "4 MiB"])
def test_bench_tree_refuses_a_capacity_in_bytes(tmp_path: Path, capacity: str) -> None:
    """The bare tree stores no KV, so a size in bytes has no token count: it was read as
    one byte a token ("64KiB" became "capacity 65,536 tokens" in the report)."""
    result = CliRunner().invoke(cli, ["bench", "tree", _trace(tmp_path, 3),
                                      "--capacity", capacity])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: capacity:") and "bytes" in last, result.output
    assert "us/request" not in result.output


def test_bench_tree_still_takes_tokens(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "tree", _trace(tmp_path, 3),
                                      "--capacity", "64k"])
    assert result.exit_code == 0, result.output
    assert "capacity 64,000 tokens" in result.output


# -- bench core, section 2 ------------------------------------------------------------------


def _idle_sizes() -> _core_lag.CoreSizes:
    """Section 2 with no readers or writers: the set-up runs, the measured run sends nothing."""
    return dataclasses.replace(QUICK, readers=0, writers=0, lag_seconds=0.05)


def test_section_2_reports_only_the_measured_runs_allocation_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`capacity_waits` is printed beside the measured run's requests; the waits of the
    set-up (inserting the old prompts) were added to it."""
    real = _core_lag.serve

    async def serve_that_waited_once(cache: object, tokens: list[int]) -> int:
        return 1 + await real(cache, tokens)  # type: ignore[arg-type]
    monkeypatch.setattr(_core_lag, "serve", serve_that_waited_once)
    result = anyio.run(_core_lag.bench_loop_lag, _idle_sizes())
    assert result.requests == 0
    assert result.capacity_waits == 0


def test_section_2_without_lag_samples_meets_no_target() -> None:
    """A probe that never ran summarises to zeros; they are not a p99 under 1 ms."""
    result = anyio.run(_core_lag.bench_loop_lag, _idle_sizes())
    assert result.lag.samples == 0
    line = next(x for x in format_lag(result, _idle_sizes()).splitlines()
                if "HiCache under load" in x)
    assert not line.endswith("ok"), line
    assert "no samples" in line


# -- bench serve: the server subprocess -----------------------------------------------------


def _fake_server(tmp_path: Path, body: str) -> Path:
    """An executable standing in for ``python -m aiohicache serve`` (its arguments ignored):
    writes its pid, then runs `body`."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n"
                      "import os, sys, time\n"
                      f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
                      f"{body}\n")
    script.chmod(0o755)
    return script


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


READY = "print('aiohicache serve: fake on http://127.0.0.1:9 (cache)', flush=True)"


def test_a_server_that_warns_before_it_is_ready_is_used(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A warning on stderr (a stale extension, a library's) came first: the first line was
    taken for the ready line, and reading "the rest of the output" for the error waited for
    a server that was up and never exits."""
    from aiohicache.bench.serve import server_process

    fake = _fake_server(tmp_path, "print('WARNING: something', file=sys.stderr, flush=True)\n"
                                  f"{READY}\ntime.sleep(8)")
    monkeypatch.setattr(sys, "executable", str(fake))
    with server_process([]) as url:
        assert url == "http://127.0.0.1:9"
    assert _gone(int((tmp_path / "pid").read_text()))


def test_what_the_server_prints_while_serving_never_blocks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the ready line nobody read the pipe: 64 KiB of warnings and the server stopped
    in its write, and the bench with it."""
    from aiohicache.bench.serve import server_process

    done = tmp_path / "done"
    fake = _fake_server(tmp_path, f"{READY}\n"
                                  "for _ in range(2048): print('w' * 511, file=sys.stderr)\n"
                                  f"open({str(done)!r}, 'w').close()\ntime.sleep(30)")
    monkeypatch.setattr(sys, "executable", str(fake))
    with server_process([]):
        deadline = time.monotonic() + 10
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.exists(), "the server is blocked writing to its output"
    assert _gone(int((tmp_path / "pid").read_text()))


def test_a_server_that_exits_before_it_is_ready_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiohicache.bench.serve import server_process

    fake = _fake_server(tmp_path, "print('Error: no such model', flush=True)\nsys.exit(2)")
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(RuntimeError, match="did not start:\nError: no such model"), \
            server_process([]):
        pass
