"""Page copies between two ``(num_pages, page_size, *row)`` views, on the CPU.

Two strategies, chosen per call:
- runs: where source and destination ids both advance by one, a whole run is one slice copy
  (fresh allocations are mostly contiguous, so this is the common case);
- gather/scatter: scattered ids go through a small scratch buffer in chunks that stay in the
  CPU cache, so the bytes cross main memory about once each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..memory import PageIds

__all__ = ("CopyPlan", "Scratch", "as_words", "copy_pages")

_CHUNK_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class CopyPlan:
    """The page ids of one copy, prepared once and reused for every layer."""

    src: torch.Tensor
    dst: torch.Tensor
    runs: list[tuple[int, int, int]] | None
    """(src start, dst start, length) when the ids form few contiguous runs."""

    @classmethod
    def build(cls, src: PageIds, dst: PageIds) -> CopyPlan:
        assert len(src) == len(dst)
        return cls(torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64)),
                   torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64)),
                   _runs(src, dst))

    def __len__(self) -> int:
        return len(self.src)


def _runs(src: PageIds, dst: PageIds) -> list[tuple[int, int, int]] | None:
    n = len(src)
    if n == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    if len(breaks) + 1 > max(1, n // 4):
        return None
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class Scratch:
    """A per-thread staging buffer for gather/scatter (never shared between threads)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, like: torch.Tensor, pages: int) -> torch.Tensor:
        shape = (pages, *like.shape[1:])
        numel = int(np.prod(shape))
        if self._buf is None or self._buf.dtype != like.dtype or self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._buf[:numel].view(shape)


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


def copy_pages(src: torch.Tensor, dst: torch.Tensor, plan: CopyPlan, scratch: Scratch) -> None:
    """Copy pages ``plan.src`` of `src` into pages ``plan.dst`` of `dst`."""
    if plan.runs is not None:
        for s, d, n in plan.runs:
            dst[d:d + n].copy_(src[s:s + n])
        return
    page_bytes = src[0].numel() * src.element_size()
    chunk = max(1, _CHUNK_BYTES // max(1, page_bytes))
    for lo in range(0, len(plan), chunk):
        sidx, didx = plan.src[lo:lo + chunk], plan.dst[lo:lo + chunk]
        tmp = scratch.get(src, len(sidx))
        torch.index_select(src, 0, sidx, out=tmp)
        dst.index_copy_(0, didx, tmp)
