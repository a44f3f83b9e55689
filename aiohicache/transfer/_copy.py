"""Page copies between two ``(num_pages, page_size, *row)`` views, on the CPU.

The strategy is chosen once per copy (`CopyPlan`): contiguous runs become slice copies
(fresh allocations are mostly contiguous, the common case), destination runs become gathers
straight into place, and anything else is one numpy row assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..memory import PageIds

__all__ = ("CopyPlan", "as_words", "copy_pages")

@dataclass(slots=True, frozen=True)
class CopyPlan:
    """The page ids of one copy, prepared once and reused for every layer.

    Pairs with a negative id on either side are dropped (skipped, as the CUDA kernel skips
    them); the caller has checked ids against the pools (`geometry.check_page_ids`). Ids are
    sorted by destination. Three strategies, cheapest first:
    - `runs`: both sides advance by one: one slice copy per run;
    - `dst_runs`: destinations form runs: one row gather per run, assigned into the run (no
      scatter pass);
    - otherwise a gather of whole rows, then one fancy assignment.
    """

    src: torch.Tensor
    dst: torch.Tensor
    src_np: PageIds
    dst_np: PageIds
    runs: list[tuple[int, int, int]] | None
    """(src start, dst start, length) when both sides form few contiguous runs."""
    dst_runs: list[tuple[int, int, int]] | None
    """(dst start, lo, hi): pages ``src[lo:hi]`` go to ``dst_start ..`` in order."""

    @classmethod
    def build(cls, src: PageIds, dst: PageIds, *, row_bytes: int | None = None) -> CopyPlan:
        """The plan for copying pages `src` into `dst`, whose rows (one page of one layer's
        K or V) are `row_bytes` long: runs are used only where they average at least
        `_RUN_BYTES` (None: where they average 4 pages)."""
        assert len(src) == len(dst)
        src = np.ascontiguousarray(src, dtype=np.int64)
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        if len(src) and (src.min() < 0 or dst.min() < 0):
            keep = (src >= 0) & (dst >= 0)
            src, dst = src[keep], dst[keep]
        max_runs = max(1, len(src) // 4 if row_bytes is None
                       else len(src) * row_bytes // _RUN_BYTES)
        runs = _runs(src, dst, max_runs)
        dst_runs = None
        if runs is None:
            order = np.argsort(dst, kind="stable")
            src, dst = src[order], dst[order]
            dst_runs = _dst_runs(dst, max_runs)
        return cls(torch.from_numpy(src), torch.from_numpy(dst), src, dst, runs, dst_runs)

    def __len__(self) -> int:
        return len(self.src)


_RUN_BYTES = 16 << 10
"""Runs are copied one numpy call each only if they average at least this many bytes; below
it one gather of every row costs less (512 pages, `python` one-off script: 256-byte rows in
runs of 8 pages 104 µs as slices vs 26 µs as one gather, runs of 64 pages 20 vs 24 µs;
4 KiB rows in runs of 8 141 vs 172 µs; 32 KiB rows: slices win at any run length)."""


def _runs(src: PageIds, dst: PageIds, max_runs: int) -> list[tuple[int, int, int]] | None:
    n = len(src)
    if n == 0:
        return []
    # Slices, not np.diff (its Python wrapper costs more than the arithmetic here); the run
    # starts are read back with one tolist each (a plan is built for every copy, ~10k in a
    # full-trace replay).
    breaks = (np.flatnonzero((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)) + 1)
    if len(breaks) + 1 > max_runs:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], n]
    firsts = zip(src[starts].tolist(), dst[starts].tolist(), strict=True)
    return [(s, d, e - b) for (s, d), b, e in zip(firsts, starts, ends, strict=True)]


def _dst_runs(dst: PageIds, max_runs: int) -> list[tuple[int, int, int]] | None:
    n = len(dst)
    breaks = np.flatnonzero(np.diff(dst) != 1) + 1
    if len(breaks) + 1 > max_runs:
        return None  # short runs: per-call overhead would dominate
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(dst[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def as_words(view: torch.Tensor) -> torch.Tensor:
    """`view` as ``(num_pages, words)`` of the widest integer type that divides a page.

    Copies move bytes, never values: this keeps them exact for every dtype (fp8 included,
    which several torch index kernels do not implement) and lets them move 8 bytes at a time.
    """
    flat = view.flatten(1)
    nbytes = flat.shape[1] * flat.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0 and flat.element_size() <= dtype.itemsize:
            return flat.view(torch.uint8).view(dtype)
    return flat.view(torch.uint8)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, plan: CopyPlan) -> None:
    """Copy pages ``plan.src`` of `src` into pages ``plan.dst`` of `dst` (same row shape).

    Both are CPU tensors of a dtype numpy has (the engine passes `as_words` views). The
    copies run through numpy views: a slice copy costs ~0.5 us of call overhead against
    ~3 us for torch's ``copy_``. Once the allocators fragment (a long replay), a copy of 500
    pages has ~80 runs, and one torch call per run made copies 5-8x slower than their bytes.
    Gathers index the rows (not ``np.take``, which first copies a strided source: the whole
    pool view of the page-first host layout).
    """
    s, d = src.numpy(), dst.numpy()
    if plan.runs is not None:
        for a, b, n in plan.runs:
            d[b:b + n] = s[a:a + n]
    elif plan.dst_runs is not None:
        src_np = plan.src_np
        for start, lo, hi in plan.dst_runs:
            d[start:start + hi - lo] = s[src_np[lo:hi]]
    else:
        d[plan.dst_np] = s[plan.src_np]
