"""Where a page's bytes are: the byte-stride description both CUDA copy paths launch from.

Every pool layout is affine in (page, kv, layer): the KV of one page for one (kv, layer) pair
is one *chunk* of ``page_size * row_bytes`` contiguous bytes at
``base + page * page_stride + kv * kv_stride + layer * layer_stride``. `Side` holds those
numbers for one pool, read off the tensors themselves, so the kernel and the copy-engine path
need no per-layout code. This module is pure Python (no CUDA): its arithmetic is tested on
the CPU against the reference engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, PageError
from ..memory import DevicePool, HostPool, PageIds

__all__ = ("MAX_CHUNKS", "UNROLL", "VECTOR_WIDTHS", "Copy2D", "Geometry", "KernelLaunch",
           "Side", "check_copy", "check_page_ids", "coalesce", "direct_copies", "group_shift",
           "kernel_launches", "layer_spans")

VECTOR_WIDTHS = (16, 8, 4, 2, 1)
"""Bytes per access of the kernel variants ``copy_pages_v16`` .. ``copy_pages_v1``."""
UNROLL = {16: 4, 8: 8, 4: 16, 2: 16, 1: 16}
"""Loads in flight per lane of each variant (kernels/page_copy.cu): 64 B per lane."""
MAX_CHUNKS = 1 << 31
"""The kernel counts chunks in 32 bits: one launch moves fewer than this many."""
PCIE_BYTES = 128
"""A group's one access should cover a PCIe read of this size where the chunk allows."""


@dataclass(frozen=True, slots=True)
class Side:
    """One pool as bytes: base address and the byte strides of page, kv and layer."""

    base: int
    page: int
    kv: int
    layer: int

    @classmethod
    def of(cls, pool: DevicePool | HostPool) -> Side:
        spec = pool.spec
        first = pool.layer_view(0, 0)
        size = first.element_size()
        kv = pool.layer_view(1, 0).data_ptr() - first.data_ptr() if spec.num_kv > 1 else 0
        layer = pool.layer_view(0, 1).data_ptr() - first.data_ptr() if spec.num_layers > 1 else 0
        return cls(first.data_ptr(), first.stride(0) * size, kv, layer)

    def chunk(self, page: int, kv: int, layer: int) -> int:
        """Address of the chunk of (page, kv, layer)."""
        return self.base + page * self.page + kv * self.kv + layer * self.layer

    def rebased(self, base: int) -> Side:
        """The same strides from another base (the device alias of registered host memory)."""
        return Side(base, self.page, self.kv, self.layer)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Both pools of one engine, and what a copy between them moves."""

    device: Side
    host: Side
    num_kv: int
    num_layers: int
    chunk_bytes: int

    @classmethod
    def of(cls, device_pool: DevicePool, host_pool: HostPool) -> Geometry:
        if device_pool.spec != host_pool.spec or device_pool.page_size != host_pool.page_size:
            raise ConfigError("host pool: must hold the device pool's spec and page size")
        for pool in (device_pool, host_pool):
            view = pool.layer_view(0, 0)
            if not view[:1].is_contiguous():  # a slice: a pool may have no pages (one tier)
                raise ConfigError("pools: a page of one (kv, layer) must be contiguous")
        spec = device_pool.spec
        chunk = device_pool.page_size * spec.row_bytes
        return cls(Side.of(device_pool), Side.of(host_pool), spec.num_kv, spec.num_layers, chunk)

    def vector_width(self, host_base: int | None = None) -> int:
        """The widest access dividing every address the kernel forms (see kernels/*.cu)."""
        host = self.host if host_base is None else self.host.rebased(host_base)
        numbers = (self.chunk_bytes, self.device.base, self.device.page, self.device.kv,
                   self.device.layer, host.base, host.page, host.kv, host.layer)
        return next(w for w in VECTOR_WIDTHS if all(n % w == 0 for n in numbers))


def layer_spans(num_layers: int, *, to_device: bool) -> list[tuple[int, int]]:
    """The layer ranges a copy is issued in: one per layer for loads (each gets its own
    completion event, so layer 0 is usable first), all at once for writes."""
    if to_device:
        return [(layer, layer + 1) for layer in range(num_layers)]
    return [(0, num_layers)]


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """The arguments of one ``copy_pages_v{width}`` launch over pages ``[start, stop)``.

    `src`/`dst` are the sides in copy direction; the page-id arrays are passed separately
    (they live in device memory). A group of ``1 << group_shift`` lanes copies one chunk at
    a time (see kernels/page_copy.cu).
    """

    width: int
    src: Side
    dst: Side
    start: int
    stop: int
    num_kv: int
    layer_begin: int
    layer_end: int
    units_per_chunk: int
    group_shift: int

    @property
    def num_pages(self) -> int:
        return self.stop - self.start

    @property
    def num_chunks(self) -> int:
        return self.num_pages * self.num_kv * (self.layer_end - self.layer_begin)

    @property
    def units(self) -> int:
        return self.num_chunks * self.units_per_chunk

    @property
    def unroll(self) -> int:
        return UNROLL[self.width]

    def grid(self, ctas: int, threads: int) -> int:
        """CTAs to launch: the budget, or fewer when the chunks cannot use them all."""
        return max(1, min(ctas, -(-(self.num_chunks << self.group_shift) // threads)))


def group_shift(units_per_chunk: int, width: int) -> int:
    """log2 of the lanes that copy one chunk together.

    Enough lanes that one pass of UNROLL loads covers the chunk (at most a warp), and at
    least enough that one access of the group spans `PCIE_BYTES` (or the whole chunk).
    """
    need = -(-units_per_chunk // UNROLL[width])
    floor = min(PCIE_BYTES // width, units_per_chunk)
    lanes = min(32, max(need, floor, 1))
    return (lanes - 1).bit_length()


def kernel_launches(geometry: Geometry, num_pages: int, *, to_device: bool, width: int,
                    layers: tuple[int, int], host_base: int | None = None) -> list[KernelLaunch]:
    """The launches copying `num_pages` page pairs over `layers`, split to fit `MAX_CHUNKS`."""
    host = geometry.host if host_base is None else geometry.host.rebased(host_base)
    src, dst = (host, geometry.device) if to_device else (geometry.device, host)
    begin, end = layers
    units_per_chunk = geometry.chunk_bytes // width
    if units_per_chunk >= 1 << 30:
        raise ConfigError(f"a chunk of {units_per_chunk} {width}-byte units is too large")
    shift = group_shift(units_per_chunk, width)
    per_page = geometry.num_kv * (end - begin)
    step = max(1, (MAX_CHUNKS - 1) // per_page)
    return [KernelLaunch(width, src, dst, lo, min(lo + step, num_pages), geometry.num_kv,
                         begin, end, units_per_chunk, shift)
            for lo in range(0, num_pages, step)]


@dataclass(frozen=True, slots=True)
class Copy2D:
    """One ``cudaMemcpy2DAsync``: `height` rows of `width` bytes, each side at its pitch."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def check_page_ids(src: PageIds, dst: PageIds, *, src_pages: int, dst_pages: int,
                   src_name: str, dst_name: str) -> tuple[PageIds, PageIds]:
    """Both id arrays as contiguous int64, checked against the pools before any copy.

    A negative id skips its pair (every engine); an id at or past its pool's page count
    would read or write outside the pool, so it is refused here, on the host.

    Raises:
        PageError: the arrays differ in length, hold something other than integers, or an
            id is past its pool.
    """
    src, dst = _as_ids(src), _as_ids(dst)
    if src.ndim != 1 or src.shape != dst.shape:
        raise PageError(f"page ids: need two 1-D arrays of one length, got shapes "
                        f"{src.shape} and {dst.shape}")
    for ids, limit, name in ((src, src_pages, src_name), (dst, dst_pages, dst_name)):
        # (a ufunc reduce: `ndarray.max` goes through numpy's Python wrappers, per copy)
        if len(ids) and (top := int(np.maximum.reduce(ids))) >= limit:
            raise PageError(f"page ids: {top} is past the {name}'s {limit} pages")
    return src, dst


def _as_ids(ids: PageIds) -> PageIds:
    """`ids` as contiguous int64; refused if a cast would change one (a float, or a uint64
    past int64, which would wrap to a negative id: a skip, not an error)."""
    arr = np.asarray(ids)
    if arr.size == 0:  # NOTE: numpy makes `[]` float64: no ids, not float ones
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu" or (arr.dtype == np.uint64 and arr.size
                                      and int(arr.max()) > np.iinfo(np.int64).max):
        raise PageError(f"page ids: need integers that fit int64, got {arr.dtype} ids")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_copy(device_pages: int, host_pages: int, src: PageIds, dst: PageIds, *,
               to_device: bool) -> tuple[PageIds, PageIds]:
    """`check_page_ids` for a copy between a device pool and a host pool of these sizes."""
    if to_device:
        return check_page_ids(src, dst, src_pages=host_pages, dst_pages=device_pages,
                              src_name="host pool", dst_name="device pool")
    return check_page_ids(src, dst, src_pages=device_pages, dst_pages=host_pages,
                          src_name="device pool", dst_name="host pool")


def coalesce(src: PageIds, dst: PageIds) -> list[tuple[int, int, int]]:
    """Runs ``(src start, dst start, length)`` where both sides advance by one page.

    Pairs with a negative id on either side are skipped, as the kernel skips them.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    keep = (src >= 0) & (dst >= 0)
    src, dst = src[keep], dst[keep]
    if len(src) == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def direct_copies(geometry: Geometry, runs: list[tuple[int, int, int]], *, to_device: bool,
                  layers: tuple[int, int], max_pitch: int) -> Iterator[Copy2D]:
    """The copy-engine calls for `runs`: one 2-D copy per run and (kv, layer).

    A run of pages is `height` chunks spaced one page stride apart on each side, which is
    what a 2-D copy moves in one call; where both strides equal the chunk (layer_first host),
    the run is one contiguous block. Pitches above the device's limit fall back to one call
    per page.
    """
    g = geometry
    src, dst = (g.host, g.device) if to_device else (g.device, g.host)
    per_page = max(src.page, dst.page) > max_pitch
    for layer in range(*layers):
        for kv in range(g.num_kv):
            for s, d, n in runs:
                if not per_page:
                    yield Copy2D(dst.chunk(d, kv, layer), dst.page, src.chunk(s, kv, layer),
                                 src.page, g.chunk_bytes, n)
                    continue
                for i in range(n):
                    yield Copy2D(dst.chunk(d + i, kv, layer), g.chunk_bytes,
                                 src.chunk(s + i, kv, layer), g.chunk_bytes, g.chunk_bytes, 1)
