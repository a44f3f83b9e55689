"""Render replay results: a table for people, JSON for machines, a hit-ratio curve."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ..errors import ConfigError
from .runner import ReplayResult

__all__ = ("PLOT_FORMATS", "check_plot_path", "format_policies", "format_result", "format_sweep",
           "plot_sweep", "result_to_dict", "to_json")


def _tokens(n: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_result(r: ReplayResult, *, title: str = "") -> str:
    """The replay table: what each tier served, what moved, how fast it ran."""
    def pct(n: int) -> str:
        return f"{100 * n / r.prompt_tokens:6.2f} %" if r.prompt_tokens else "     -"

    rows = [
        ("requests", f"{r.requests:,}", ""),
        ("prompt tokens", f"{r.prompt_tokens:,}", ""),
        ("served from L1 (device)", f"{r.l1_tokens:,}", pct(r.l1_tokens)),
        ("served from L2 (host)", f"{r.l2_tokens:,}", pct(r.l2_tokens)),
        ("served from L3 (storage)", f"{r.l3_tokens:,}", pct(r.l3_tokens)),
        ("recomputed", f"{r.recomputed_tokens:,}", pct(r.recomputed_tokens)),
        ("hit ratio", f"{r.hit_ratio:.4f}", "(L1+L2+L3) / prompt tokens"),
        ("requests not cached", f"{r.not_inserted:,}", "new KV larger than unpinned L1"),
        ("moved L2 -> L1 (load-back)", _bytes(r.bytes_h2d),
         f"model-equivalent {_bytes(r.model_bytes_h2d)}"),
        ("moved L1 -> L2 (write)", _bytes(r.bytes_d2h),
         f"model-equivalent {_bytes(r.model_bytes_d2h)}"),
        ("moved L3 -> L2 (prefetch)", _bytes(r.bytes_l3_read),
         f"model-equivalent {_bytes(r.bytes_l3_read * r.kv_scale)}"),
        ("moved L2 -> L3 (backup)", _bytes(r.bytes_l3_written),
         f"model-equivalent {_bytes(r.bytes_l3_written * r.kv_scale)}"),
        ("L1 <-> L2 throughput", f"{r.transfer_gbps:.2f} GB/s", "bytes moved / wall time"),
        ("L2 <-> L3 throughput", f"{r.storage_gbps:.2f} GB/s", "bytes moved / wall time"),
        ("event-loop lag p50/p99/max", f"{r.lag.p50_ms:.2f} / {r.lag.p99_ms:.2f} / "
         f"{r.lag.max_ms:.2f} ms", f"{r.lag.samples} samples"),
        *([("idle-loop floor p50/p99/max", f"{r.lag_floor.p50_ms:.2f} / "
            f"{r.lag_floor.p99_ms:.2f} / {r.lag_floor.max_ms:.2f} ms",
            "same probe, idle loop, right after")] if r.lag_floor is not None else []),
        ("wall time", f"{r.wall_seconds:.2f} s", ""),
        ("requests/s", f"{r.requests_per_second:,.0f}", ""),
    ]
    l3 = {None: "no L3", "tmp": "L3 file store in a temporary directory"}.get(
        r.storage, f"L3 {r.storage}")
    head = (f"L1 {_tokens(r.device_tokens)} tokens, L2 {_tokens(r.host_tokens)} tokens, {l3}, "
            f"{r.bytes_per_token} B/token (model bytes / {r.kv_scale})")
    width = max(len(k) for k, _, _ in rows)
    lines = [title, head, ""] if title else [head, ""]
    lines += [f"  {k:<{width}}  {v:>22}  {note}".rstrip() for k, v, note in rows]
    return "\n".join(lines)


def result_to_dict(r: ReplayResult) -> dict[str, object]:
    out = dataclasses.asdict(r)
    out.update(hit_ratio=r.hit_ratio, requests_per_second=r.requests_per_second,
               transfer_gbps=r.transfer_gbps, storage_gbps=r.storage_gbps)
    return out


def to_json(results: Sequence[ReplayResult], *, listed: bool = False) -> str:
    """One replay's object, or a list of them: several, or `listed` (a sweep, whatever its
    length, so a script reads its rows the same way)."""
    items = [result_to_dict(r) for r in results]
    return json.dumps(items[0] if len(items) == 1 and not listed else items, indent=2)


def format_sweep(results: Sequence[ReplayResult]) -> str:
    """The hit-ratio curve over L1 capacity, one line per replay; with several eviction
    policies, a first column names each line's and `format_policies` follows."""
    policies = _policies(results)
    width = max(len("eviction"), *map(len, policies)) if len(policies) > 1 else 0

    def lead(text: str) -> str:
        return f"  {text:<{width}} " if width else "  "

    lines = [lead("eviction") + "L1 tokens   L2 tokens   L1 hit   L2 hit   L3 hit   hit ratio"
             "   requests/s",
             lead("-" * 8) + "---------   ---------   ------   ------   ------   ---------"
             "   ----------"]
    for r in results:
        l1 = r.l1_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        l2 = r.l2_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        l3 = r.l3_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        lines.append(lead(r.eviction) + f"{_tokens(r.device_tokens):>9}   "
                     f"{_tokens(r.host_tokens):>9}   {l1:6.4f}   {l2:6.4f}   {l3:6.4f}   "
                     f"{r.hit_ratio:9.4f}   {r.requests_per_second:10,.0f}")
    if len(policies) > 1:
        lines += ["", format_policies(results)]
    return "\n".join(lines)


def _policies(results: Sequence[ReplayResult]) -> list[str]:
    return list(dict.fromkeys(r.eviction for r in results))


def format_policies(results: Sequence[ReplayResult]) -> str:
    """Hit ratio by L1 capacity (rows) and eviction policy (columns); with ``lru`` and
    ``opt`` among them, each other policy's share of the LRU -> OPT gap it closes."""
    policies = _policies(results)
    by = {(r.eviction, r.device_tokens): r.hit_ratio for r in results}
    capacities = list(dict.fromkeys(r.device_tokens for r in results))
    judged = [p for p in policies if p not in ("lru", "opt")] \
        if {"lru", "opt"} <= set(policies) else []
    width = max(9, *map(len, policies))
    lines = ["  L1 tokens" + "".join(f"   {p:>{width}}" for p in policies)
             + "".join(f"   {p + ' closes':>{width + 7}}" for p in judged)]
    lines.append("  " + "-" * (len(lines[0]) - 2))
    for n in capacities:
        cells = "".join(f"   {by[p, n]:>{width}.4f}" if (p, n) in by else f"   {'-':>{width}}"
                        for p in policies)
        lines.append(f"  {_tokens(n):>9}{cells}"
                     + "".join(f"   {_closed(by, p, n):>{width + 7}}" for p in judged))
    return "\n".join(lines)


def _closed(by: dict[tuple[str, int], float], policy: str, n: int) -> str:
    """The share of the LRU -> OPT gap at capacity `n` that `policy` closes."""
    try:
        lru, opt, hit = by["lru", n], by["opt", n], by[policy, n]
    except KeyError:
        return "-"
    return f"{100 * (hit - lru) / (opt - lru):.1f} %" if opt - lru > 1e-9 else "-"


PLOT_FORMATS = ("png", "svg", "pdf")
"""Image formats `plot_sweep` writes: those matplotlib writes with no other program."""


def check_plot_path(path: str | Path) -> None:
    """Check, before a sweep runs, that `plot_sweep` can write `path`: matplotlib is there,
    the suffix is a format of `PLOT_FORMATS`, and a file can be made in its directory (made
    and removed: the only test that holds for root and for odd file systems alike).

    Raises:
        ConfigError: ``plot: ...`` saying which.
    """
    _pyplot()
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix not in PLOT_FORMATS:
        raise ConfigError(f"plot: {os.fspath(path)!r} is not a .png, .svg or .pdf file")
    try:
        with _scratch(Path(path)):
            pass
    except OSError as exc:
        raise ConfigError(f"plot: cannot write {os.fspath(path)!r}: {exc.strerror}") from None


def plot_sweep(results: Sequence[ReplayResult], path: str | Path, *, title: str = "") -> None:
    """Write the hit-ratio curve as an image (needs matplotlib: ``pip install
    aiohicache[plot]``), in the format the suffix names (PNG without one). The file is
    written whole or not at all: a failed write leaves what was at `path` before, and no
    scrap next to it.

    Raises:
        ConfigError: matplotlib is not installed.
        OSError: the file could not be written.
    """
    plt = _pyplot()
    fig = _draw(plt, results, title)
    target = Path(path)
    try:
        with _scratch(target) as f:
            fig.savefig(f, dpi=120, format=target.suffix.lower().removeprefix(".") or "png")
            f.close()
            os.replace(f.name, target)
    finally:
        plt.close(fig)


@contextlib.contextmanager
def _scratch(target: Path) -> Iterator[IO[bytes]]:
    """A new file next to `target`, removed unless the block moved it away (``os.replace``).

    NOTE: opened with ``open(..., "xb")``, not ``mkstemp``: the file gets the mode the
    umask gives, as a file written in place would, and not mkstemp's 0600.
    """
    name = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
    f = open(name, "xb")  # noqa: SIM115 -- closed below, or by the caller before a replace
    try:
        yield f
    finally:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _pyplot() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("plot: needs matplotlib (pip install 'aiohicache[plot]')") from exc
    return plt


def _curve_name(r: ReplayResult) -> str:
    """What the `hit_ratio` curve counts: every tier the replay had (L3 is read through L2)."""
    tiers = ["L1", *(["L2"] if r.host_tokens else []),
             *(["L3"] if r.host_tokens and r.storage is not None else [])]
    return f"{' + '.join(tiers)} hit ratio" if len(tiers) > 1 else "hit ratio"


def _draw(plt: Any, results: Sequence[ReplayResult], title: str) -> Any:
    """The figure: one curve per policy, in order of L1 capacity (a sweep may list its
    capacities in any order; drawn as given, the line would double back)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    policies = _policies(results)
    for policy in policies:
        mine = sorted((r for r in results if r.eviction == policy),
                      key=lambda r: r.device_tokens)
        xs = [r.device_tokens for r in mine]
        label = f"{policy}: " if len(policies) > 1 else ""
        line, = ax.plot(xs, [r.hit_ratio for r in mine], marker="o",
                        label=f"{label}{_curve_name(mine[0])}")
        if mine[0].host_tokens:
            ax.plot(xs, [r.l1_tokens / max(1, r.prompt_tokens) for r in mine], marker=".",
                    linestyle="--", color=line.get_color(), label=f"{label}L1 hit ratio")
    ax.set_xscale("log")
    ax.set_xlabel("L1 capacity (tokens)")
    ax.set_ylabel("token hit ratio")
    top = max((r.hit_ratio for r in results), default=1.0)
    ax.set_ylim(0, 1 if top > 0.8 else top + 0.1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title or "aiohicache replay: hit ratio vs L1 capacity")
    fig.tight_layout()
    return fig
