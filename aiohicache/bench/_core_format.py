"""``bench core``'s text tables: each section's numbers next to its target."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._lagprobe import LagSummary
from ._core_copy import CopyRow
from ._core_lag import LagResult
from ._core_sizes import (
    FULL,
    GB,
    MIB,
    QUICK,
    TARGET_GBPS,
    TARGET_HIT_US,
    TARGET_MAX_MS,
    TARGET_P99_MS,
    TARGET_RATIO,
    CoreSizes,
    spec_of,
)

if TYPE_CHECKING:
    from .core import CoreReport, HitOverhead


def format_report(report: CoreReport) -> str:
    """All sections as plain text, as `run_core` echoes them."""
    sizes = report.sizes
    return "\n".join([format_machine(report.machine, sizes), format_copy(report.copy, sizes),
                      format_lag(report.loop, sizes), format_hits(report.hits)])


def format_machine(machine: dict[str, str | int], sizes: CoreSizes) -> str:
    mode = "quick" if sizes == QUICK else "full" if sizes == FULL else "custom"
    return (f"aiohicache {machine['aiohicache']} bench core ({mode})\n"
            f"  cpu: {machine['cpu']}, {machine['cpu_count']} cores, load average "
            f"{machine['load_avg_1min']} before the run (1 min)\n"
            f"  python {machine['python']}, torch {machine['torch']} "
            f"({machine['torch_threads']} threads), numpy {machine['numpy']}\n"
            f"  loop: {machine['loop']}; platform: {machine['platform']}\n")


def format_copy(rows: list[CopyRow], sizes: CoreSizes) -> str:
    spec = spec_of(sizes.num_layers)
    base = np.array([r.baseline_gbps for r in rows])
    head = [
        "1. CPU page copy (numpy's copy_pages; native: the C copier, _pagecopy.c) vs one",
        "   contiguous dst.copy_(src) of the same bytes",
        f"   KV: {spec.num_layers} layers x K/V x 8 heads x 128 x bf16 = "
        f"{spec.bytes_per_token // 1024} KiB/token; {rows[0].nbytes / MIB:.0f} MiB per copy",
        f"   contiguous copy: median {np.median(base):.1f} GB/s "
        f"(range {base.min():.1f}..{base.max():.1f}, shared-machine noise)",
        f"   ratio: median over {sizes.copy_reps} back-to-back pairs (fewer past 2 s a case) of",
        f"   contiguous time / page copy time; target >= {TARGET_RATIO} for page >= 16 "
        "('<' marks a miss)",
        "",
        "   page  layout       dir  copier  contiguous GB/s  ratio    random GB/s  ratio",
    ]
    cells: dict[tuple[int, str, str, str, str], CopyRow] = {
        (r.page_size, r.layout, r.direction, r.copier, r.pattern): r for r in rows}
    keys = dict.fromkeys((r.page_size, r.layout, r.direction, r.copier) for r in rows)
    lines = [_copy_line(cells, *key) for key in keys]
    return "\n".join(head + lines) + "\n"


def _copy_line(cells: dict[tuple[int, str, str, str, str], CopyRow], page_size: int,
               layout: str, direction: str, copier: str) -> str:
    parts = [f"   {page_size:>4}  {layout:<11}  {direction}  {copier:<6}"]
    for pattern in ("contiguous", "random"):
        row = cells[(page_size, layout, direction, copier, pattern)]
        miss = "<" if page_size >= 16 and row.ratio < TARGET_RATIO else " "
        parts.append(f"{row.gbps:>14.2f}  {row.ratio:>5.2f}{miss}")
    return "".join(parts)


def format_lag(res: LagResult, sizes: CoreSizes) -> str:
    moved = "ok" if res.gbps >= TARGET_GBPS else f"below the {TARGET_GBPS:.0f} GB/s premise"
    prompt_mib = sizes.prompt_tokens * spec_of(sizes.num_layers).bytes_per_token / MIB
    return "\n".join([
        "2. Event-loop lag while load-back and write-through run flat out (real HiCache)",
        f"   {sizes.readers} readers revisit old prompts (L2 hits: load-back), {sizes.writers} "
        f"writers insert new ones (write-through);",
        f"   {sizes.prompt_tokens} tokens ({prompt_mib:.0f} MiB) per prompt, page 16, device "
        f"{sizes.device_pages} / host {sizes.host_pages} pages, {sizes.lag_seconds:g} s",
        "",
        "                          samples   p50 ms   p99 ms   max ms   target: p99 <= "
        f"{TARGET_P99_MS:g} ms, max <= {TARGET_MAX_MS:g} ms",
        _lag_line("HiCache under load", res.lag, verdict=True),
        _lag_line("floor: 2 copy threads", res.floor, verdict=False),
        "",
        f"   moved: {res.loaded_bytes / GB:.2f} GB loaded + {res.written_bytes / GB:.2f} GB "
        f"written in {res.seconds:.2f} s = {res.gbps:.2f} GB/s ({moved})",
        f"   {res.requests} requests; tokens: {res.device_hit_tokens} L1 hit, "
        f"{res.host_hit_tokens} L2 hit, {res.miss_tokens} miss; {res.capacity_waits} "
        "allocations waited for a copy to free device pages",
        f"   loop thread busy {res.loop_busy:.0%}; gc frozen after warm-up: "
        f"{res.gc_collections} collections, longest {res.gc_max_ms:.1f} ms",
        "",
    ])


def _lag_line(name: str, lag: LagSummary, *, verdict: bool) -> str:
    ok = lag.p99_ms <= TARGET_P99_MS and lag.max_ms <= TARGET_MAX_MS
    # no samples: the probe never ran, and its zeros are no measurement to meet a target
    mark = ("no samples" if not lag.samples else "ok" if ok else "MISSED") if verdict else ""
    return (f"   {name:<22}{lag.samples:>8}  {lag.p50_ms:>7.3f}  {lag.p99_ms:>7.3f}  "
            f"{lag.max_ms:>7.3f}   {mark}").rstrip()


def format_hits(rows: list[HitOverhead]) -> str:
    head = [
        "3. fetch -> commit overhead of an all-L1 hit (fetch, commit with no new slots, exit)",
        "",
        "   prompt tokens  tokens as  requests  mean us  p50 us  p99 us  commit p50 us   "
        f"target: mean <= {TARGET_HIT_US:g} us",
    ]
    lines = [f"   {r.prompt_tokens:>13}  {r.tokens_as:<9}  {r.requests:>8}  {r.mean_us:>7.1f}  "
             f"{r.p50_us:>6.1f}  {r.p99_us:>6.1f}  {r.commit_p50_us:>13.1f}   "
             f"{'ok' if r.mean_us <= TARGET_HIT_US else 'MISSED'}" for r in rows]
    return "\n".join(head + lines) + "\n"
