"""Bad input to the ``aiohicache`` command: one error line naming what is wrong, no traceback,
and nothing half-written or silently ignored (``serve`` has its own tests)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import matplotlib.axes
import matplotlib.figure
import pytest
from click.testing import CliRunner, Result

from aiohicache.cli import cli
from aiohicache.replay import load_trace
from aiohicache.replay.report import plot_sweep
from aiohicache.replay.runner import MODELS, ReplayConfig, replay
from aiohicache.replay.traces import BUNDLED_MOONCAKE

TINY = ["--no-progress", "--model", "tiny", "--kv-scale", "1", "--page-size", "16"]
"""A replay that allocates next to nothing."""


def _trace(tmp_path: Path, lines: int) -> str:
    """The bundled trace's first `lines` lines, as a file."""
    source = resources.files("aiohicache.replay") / "data" / BUNDLED_MOONCAKE
    with source.open() as f:
        head = [next(f) for _ in range(lines)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(head))
    return str(path)


def _error_line(args: list[str], *, exit_code: int = 2) -> str:
    """The one error line of a refused command (no traceback, nothing printed before it)."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == exit_code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and "hit ratio" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: "), result.output
    return last


def _invoke(args: list[str]) -> Result:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


# -- replay --plot ---------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "why"), [
    ("missing/dir/plot.png", "No such file or directory"),
    ("trace.jsonl/plot.png", "Not a directory"),
    ("plot.txt", "not a .png, .svg or .pdf file"),
])
def test_replay_refuses_a_plot_it_cannot_write_before_replaying(tmp_path: Path, target: str,
                                                                 why: str) -> None:
    trace = _trace(tmp_path, 5)
    line = _error_line(["replay", trace, *TINY, "--l3", "none", "--sweep", "1k,2k",
                        "--plot", str(tmp_path / target)])
    assert "'--plot'" in line and why in line
    assert sorted(os.listdir(tmp_path)) == ["trace.jsonl"]


def test_replay_plot_needs_a_sweep(tmp_path: Path) -> None:
    line = _error_line(["replay", _trace(tmp_path, 5), *TINY, "--l3", "none",
                        "--plot", str(tmp_path / "plot.png")])
    assert "'--plot'" in line and "--sweep" in line
    assert not (tmp_path / "plot.png").exists()


async def test_a_plot_that_fails_midway_leaves_the_old_file_and_no_scrap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = await replay(ReplayConfig(spec=MODELS["tiny"], device_tokens=1024, host_tokens=0),
                          load_trace("mooncake", limit=3))
    path = tmp_path / "plot.png"
    path.write_bytes(b"the old plot")

    def half_written(self: Any, target: Any, **kwargs: Any) -> None:
        if isinstance(target, (str, os.PathLike)):
            Path(target).write_bytes(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_written)
    with pytest.raises(OSError, match="No space left"):
        plot_sweep([result], path)
    assert path.read_bytes() == b"the old plot"
    assert os.listdir(tmp_path) == ["plot.png"]


def test_the_plotted_curve_runs_in_capacity_order(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[list[int]] = []
    plot = matplotlib.axes.Axes.plot

    def recorded(self: Any, xs: list[int], *args: Any, **kwargs: Any) -> Any:
        drawn.append(list(xs))
        return plot(self, xs, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    _invoke(["replay", _trace(tmp_path, 5), *TINY, "--l3", "none", "--l2", "0",
             "--sweep", "4k,1k,2k", "--plot", str(tmp_path / "plot.png")])
    assert drawn == [[992, 2000, 4000]]  # whole pages of 16 tokens


# -- replay: traces, numbers, combinations ---------------------------------------------------


@pytest.mark.parametrize("time_mode", ["fast", "timestamps"])
def test_replay_of_an_empty_trace_is_a_usage_error(tmp_path: Path, time_mode: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    line = _error_line(["replay", str(empty), *TINY, "--l3", "none", "--time", time_mode])
    assert f"{empty}: no requests" in line


@pytest.mark.parametrize("stalls", ["nan", "inf"])
def test_replay_stalls_must_be_a_finite_number(stalls: str) -> None:
    line = _error_line(["replay", "--limit", "1", *TINY, "--stalls", stalls])
    assert "'--stalls'" in line and stalls in line


@pytest.mark.parametrize(("extra", "named"), [
    (["--speedup", "10"], "'--speedup'"),
    (["--dtype", "fp8"], "'--dtype'"),
    (["--layers", "2", "--kv-heads", "1", "--head-dim", "16"], "'--model'"),
    (["--no-settle", "--concurrency", "4"], "'--settle'"),
    (["--settle", "--time", "timestamps"], "'--settle'"),
    (["--l2", "0", "--write-policy", "write_back"], "'--write-policy'"),
    (["--l2", "0GiB", "--host-layout", "layer_first"], "'--host-layout'"),
    (["--prefetch-policy", "best_effort"], "'--prefetch-policy'"),
])
def test_replay_refuses_an_option_it_would_ignore(extra: list[str], named: str) -> None:
    line = _error_line(["replay", "--limit", "1", *TINY, "--l3", "none", *extra])
    assert named in line


@pytest.mark.parametrize(("extra", "named"), [
    (["--eviction", "lru,arc,lru"], "'--eviction'"),
    (["--eviction", "lru,lru:lru"], "'--eviction'"),
    (["--sweep", "1k,1000"], "'--sweep'"),
    (["--sweep", "1000,1007"], "'--sweep'"),  # both 62 pages of 16 tokens
])
def test_replay_refuses_the_same_policy_or_capacity_twice(extra: list[str], named: str) -> None:
    line = _error_line(["replay", "--limit", "1", *TINY, "--l3", "none", *extra])
    assert named in line


@pytest.mark.parametrize("small", ["0", "8"])
def test_replay_refuses_a_sweep_capacity_under_one_page_naming_the_sweep(small: str) -> None:
    line = _error_line(["replay", "--limit", "1", *TINY, "--l3", "none", "--sweep", f"1k,{small}"])
    assert f"'--sweep': '{small}' is less than one page (16 tokens)" in line


def test_replay_refuses_an_l3_it_cannot_open(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    for url, why in ((f"file://{a_file}", f"cannot open the file store {a_file}"),
                     ("redis://127.0.0.1:1/0", "connecting to 127.0.0.1:1")):
        line = _error_line(["replay", "--limit", "1", *TINY, "--l3", url])
        assert "'--l3'" in line and why in line


# -- bench -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["bench", "tree"], ["bench", "serve", "--requests", "1"]])
def test_bench_refuses_an_empty_trace(tmp_path: Path, command: list[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = _error_line([*command, str(empty)])
    assert f"{empty}: no requests" in line


def test_bench_serve_refuses_blocks_larger_than_the_traces(tmp_path: Path) -> None:
    line = _error_line(["bench", "serve", _trace(tmp_path, 3), "--requests", "1",
                        "--block-tokens", "513"])
    assert "'--block-tokens'" in line and "512" in line


@pytest.mark.parametrize(("capacity", "why"), [
    ("0", "less than one page"), ("15", "less than one page"),
    ("99999999999999999999999", "this process may use"),
])
def test_bench_tree_refuses_a_capacity_it_cannot_hold(tmp_path: Path, capacity: str,
                                                      why: str) -> None:
    line = _error_line(["bench", "tree", _trace(tmp_path, 3), "--page-size", "16",
                        "--capacity", capacity])
    assert "capacity:" in line and why in line


def test_bench_redis_without_redis_server_says_so(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    line = _error_line(["bench", "redis", "--quick"], exit_code=1)
    assert "'redis-server' not found on PATH" in line


def test_the_l3_check_does_not_read_a_file_stores_journals(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It opened the store, reading every journal (seconds for a big store, again for the
    replay, and past the check's 10 s for a very big one)."""
    from aiohicache import _cli_replay
    from aiohicache.storage import _journal

    def refuse(*args: object) -> None:
        raise AssertionError("read the journals")
    monkeypatch.setattr(_journal, "read_journals", refuse)
    anyio.run(_cli_replay._check_l3, f"file://{tmp_path}/store")
    assert (tmp_path / "store").is_dir()
