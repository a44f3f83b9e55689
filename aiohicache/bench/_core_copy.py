"""Section 1 of ``bench core``: CPU page copy (gather/scatter) against one contiguous copy of
the same bytes, each timed back to back with its baseline; numpy's copy (`copy_pages`) and the
C copier (`_pagecopy.c`, where built) side by side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..memory import DevicePool, HostPool, PageIds
from ..transfer._cpu import numpy_layers, word_views
from ..transfer._native import native_copier
from ._core_sizes import GB, CoreSizes, spec_of

Direction = Literal["D2H", "H2D"]
Pattern = Literal["contiguous", "random"]
Copier = Literal["numpy", "native"]


@dataclass(frozen=True, slots=True)
class CopyRow:
    """One case of section 1: GB/s of the page copy and its ratio to a contiguous copy."""

    page_size: int
    layout: str
    direction: Direction
    pattern: Pattern
    copier: Copier
    nbytes: int
    gbps: float
    """Bytes over the median time of the page copy."""
    baseline_gbps: float
    """Bytes over the median time of the contiguous copy paired with it."""
    ratio: float
    """Median over runs of (contiguous time / page copy time), each pair run back to back."""
    runs: int


def bench_copy(sizes: CoreSizes) -> list[CopyRow]:
    """Section 1, synchronous: every page size x host layout x pattern x direction."""
    spec = spec_of(sizes.num_layers)
    rows: list[CopyRow] = []
    for page_size in sizes.page_sizes:
        num_pages = max(1, sizes.copy_tokens // page_size)
        device = DevicePool(spec, num_pages=num_pages, page_size=page_size)
        for layout in ("layer_first", "page_first"):
            host = HostPool(spec, num_pages=num_pages, page_size=page_size, layout=layout)
            rows += _copy_cases(device, host, sizes.copy_reps)
            del host  # free it before the next layout is allocated
    return rows


def _copy_cases(device: DevicePool, host: HostPool, reps: int) -> Iterator[CopyRow]:
    n = device.num_pages
    rng = np.random.default_rng(0)
    patterns: dict[Pattern, tuple[PageIds, PageIds]] = {
        "contiguous": (np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)),
        "random": (rng.permutation(n).astype(np.int64), rng.permutation(n).astype(np.int64)),
    }
    copiers: list[Copier] = ["numpy", "native"] if native_copier(device, host) else ["numpy"]
    for pattern, (device_ids, host_ids) in patterns.items():
        for direction in ("D2H", "H2D"):
            for copier in copiers:
                ids = (host_ids, device_ids) if direction == "H2D" else (device_ids, host_ids)
                pages = _page_copy(device, host, *ids, to_device=direction == "H2D",
                                   copier=copier)
                yield _copy_case(device, host, direction, pattern, copier, pages, reps)


def _page_copy(device: DevicePool, host: HostPool, src_ids: PageIds, dst_ids: PageIds, *,
               to_device: bool, copier: Copier) -> Callable[[], None]:
    """One whole copy, all layers, as the CPU engine runs it with this copier."""
    layers = device.spec.num_layers
    native = native_copier(device, host) if copier == "native" else None
    if native is not None:
        return lambda: native.copy(src_ids, dst_ids, to_device, 0, layers, False)
    copy = numpy_layers(word_views(device), word_views(host), src_ids, dst_ids,
                        to_device=to_device)
    return lambda: copy(0, layers, False)


def _copy_case(device: DevicePool, host: HostPool, direction: Direction, pattern: Pattern,
               copier: Copier, pages: Callable[[], None], reps: int) -> CopyRow:
    src, dst = device.data.view(-1), host.data.view(-1)
    if direction == "H2D":
        src, dst = dst, src

    def contiguous() -> None:
        dst.copy_(src)

    t_pages, t_base = _paired_times(pages, contiguous, reps)
    nbytes = device.nbytes
    return CopyRow(page_size=device.page_size, layout=host.layout, direction=direction,
                   pattern=pattern, copier=copier, nbytes=nbytes,
                   gbps=nbytes / float(np.median(t_pages)) / GB,
                   baseline_gbps=nbytes / float(np.median(t_base)) / GB,
                   ratio=float(np.median(t_base / t_pages)), runs=len(t_pages))


def _paired_times(fn: Callable[[], None], base: Callable[[], None], reps: int, *,
                  budget: float = 2.0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Times of `fn` and of `base`, run back to back up to `reps` times within `budget`
    seconds; a case whose warm-up alone overruns the budget reports the warm-up, so one
    pathologically slow case cannot stall the whole run."""
    # NOTE: a shared VM's memory bandwidth swings by 5x for seconds at a time. Timing each run
    # next to its baseline and taking the median of the pair ratios keeps the ratio honest
    # even when the absolute GB/s are not.
    warm = (_timed(fn), _timed(base))  # scratch buffers, page faults, caches
    times = [] if sum(warm) < budget else [warm]
    start = time.perf_counter()
    while not times or (len(times) < reps and time.perf_counter() - start < budget):
        times.append((_timed(fn), _timed(base)))
    pairs = np.array(times)
    return pairs[:, 0], pairs[:, 1]


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
