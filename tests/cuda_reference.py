"""Executes the CUDA copy paths' launch arguments on CPU memory, byte for byte.

`run_kernel` applies `KernelLaunch` arguments with the index arithmetic of
``kernels/page_copy.cu`` (flat VEC-byte units, item-major, negative id = skip);
`run_direct` applies `Copy2D` calls as ``cudaMemcpy2DAsync`` would. Both read and write pools
through their real addresses, so the strides, bases and splits the engine computes are checked
against the CPU engine without a GPU. What they cannot check is CUDA itself: that is what the
`gpu` tests are for.
"""

from __future__ import annotations

import numpy as np
import torch

from aiohicache.transfer.geometry import Copy2D, KernelLaunch

__all__ = ("Memory", "run_direct", "run_kernel")


class Memory:
    """Byte views of some tensors, addressed by `data_ptr()` as the engine addresses them."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._regions = [(t.data_ptr(), t.view(torch.uint8).reshape(-1).numpy())
                         for t in tensors]

    def view(self, address: int, nbytes: int) -> np.ndarray:
        for base, data in self._regions:
            if base <= address and address + nbytes <= base + len(data):
                return data[address - base:address - base + nbytes]
        raise AssertionError(f"{nbytes} bytes at {address:#x} are outside every region")

    def units(self, addresses: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(region bytes as width-byte rows, row index of each address)."""
        lo, hi = int(addresses.min()), int(addresses.max()) + width
        for base, data in self._regions:
            if base <= lo and hi <= base + len(data):
                assert ((addresses - base) % width == 0).all(), "misaligned access"
                return data.reshape(-1, width), (addresses - base) // width
        raise AssertionError(f"accesses {lo:#x}..{hi:#x} are outside every region")


def run_kernel(memory: Memory, launch: KernelLaunch, src_pages: np.ndarray,
               dst_pages: np.ndarray) -> None:
    """What one launch of ``copy_pages_v{width}`` does (src/dst_pages: the whole arrays)."""
    width = launch.width
    unit = np.arange(launch.units, dtype=np.int64)
    item, within = np.divmod(unit, launch.units_per_chunk)
    layers = launch.layer_end - launch.layer_begin
    i, rest = np.divmod(item, launch.num_kv * layers)
    kv, layer = np.divmod(rest, layers)
    layer = layer + launch.layer_begin
    sp = src_pages[launch.start + i]
    dp = dst_pages[launch.start + i]
    keep = (sp >= 0) & (dp >= 0)
    if not keep.any():
        return
    s, d = launch.src, launch.dst
    src_addr = s.base + sp * s.page + kv * s.kv + layer * s.layer + within * width
    dst_addr = d.base + dp * d.page + kv * d.kv + layer * d.layer + within * width
    src_rows, src_idx = memory.units(src_addr[keep], width)
    dst_rows, dst_idx = memory.units(dst_addr[keep], width)
    dst_rows[dst_idx] = src_rows[src_idx]


def run_direct(memory: Memory, copies: list[Copy2D]) -> None:
    """What the ``cudaMemcpy2DAsync`` calls do, in order."""
    for c in copies:
        assert c.width <= c.spitch and c.width <= c.dpitch, "pitch narrower than a row"
        for row in range(c.height):
            memory.view(c.dst + row * c.dpitch, c.width)[:] = \
                memory.view(c.src + row * c.spitch, c.width)
