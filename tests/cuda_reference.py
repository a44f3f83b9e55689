"""Executes the CUDA copy paths' launch arguments on CPU memory, byte for byte.

- `HostKernel` compiles the real ``kernels/page_copy.cu`` as host C++ with g++ (through the
  shim ``tests/page_copy_host.cpp``) and runs its grid thread by thread: the kernel's own
  index arithmetic, on the packed `CopyParams` the engine launches with.
- `run_kernel` is a numpy re-implementation of the same arithmetic (used where g++ is
  missing, and as a second opinion): chunks item-major, negative id = skip.
- `run_direct` applies `Copy2D` calls as ``cudaMemcpy2DAsync`` would.

All of them read and write pools through their real addresses, so the strides, bases, splits
and packing the engine computes are checked against the CPU engine without a GPU. What they
cannot check is CUDA itself: that is what the `gpu` tests are for.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from aiohicache.transfer import _cuda_kernels as kernels
from aiohicache.transfer._geometry import Copy2D

__all__ = ("HostKernel", "Memory", "host_kernel", "run_direct", "run_kernel")

SHIM = Path(__file__).with_name("page_copy_host.cpp")
KERNELS = Path(__file__).parent.parent / "kernels"


class Memory:
    """Byte views of some tensors, addressed by `data_ptr()` as the engine addresses them."""

    def __init__(self, *tensors: torch.Tensor | np.ndarray) -> None:
        self._regions = [(t.data_ptr(), t.view(torch.uint8).reshape(-1).numpy())
                         if isinstance(t, torch.Tensor)
                         else (t.ctypes.data, t.view(np.uint8).reshape(-1)) for t in tensors]

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


def run_kernel(memory: Memory, width: int, params: np.ndarray) -> None:
    """What one launch of ``copy_pages_v{width}`` with packed `params` does (numpy).

    The page ids are read through `memory` at the addresses the params hold.
    """
    p = {name: int(params[name][0]) for name in kernels.PARAMS_DTYPE.names or ()}
    n, upc = p["num_chunks"], p["units_per_chunk"]
    if n == 0:
        return
    chunk = np.arange(n, dtype=np.int64)
    i, rest = np.divmod(chunk, p["num_kv"] * p["layers"])
    kv, layer = np.divmod(rest, p["layers"])
    layer = layer + p["layer_begin"]
    pages = int(i.max()) + 1
    sp = memory.view(p["src_pages"], 8 * pages).view(np.int64)[i]
    dp = memory.view(p["dst_pages"], 8 * pages).view(np.int64)[i]
    keep = (sp >= 0) & (dp >= 0)
    if not keep.any():
        return
    within = np.arange(upc, dtype=np.int64) * width
    src = p["src"] + sp * p["src_page"] + kv * p["src_kv"] + layer * p["src_layer"]
    dst = p["dst"] + dp * p["dst_page"] + kv * p["dst_kv"] + layer * p["dst_layer"]
    src_rows, src_idx = memory.units((src[keep, None] + within).reshape(-1), width)
    dst_rows, dst_idx = memory.units((dst[keep, None] + within).reshape(-1), width)
    dst_rows[dst_idx] = src_rows[src_idx]


def run_direct(memory: Memory, copies: list[Copy2D]) -> None:
    """What the ``cudaMemcpy2DAsync`` calls do, in order."""
    for c in copies:
        assert c.width <= c.spitch and c.width <= c.dpitch, "pitch narrower than a row"
        for row in range(c.height):
            memory.view(c.dst + row * c.dpitch, c.width)[:] = \
                memory.view(c.src + row * c.spitch, c.width)


class HostKernel:
    """``kernels/page_copy.cu`` built as a host shared library (g++) and run on the CPU."""

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self._lib.aiohicache_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                                ctypes.c_void_p]
        self._lib.aiohicache_launch.restype = ctypes.c_int
        self._lib.aiohicache_params_size.restype = ctypes.c_uint
        self._lib.aiohicache_stored_bytes.restype = ctypes.c_ulonglong
        size = self._lib.aiohicache_params_size()
        assert size == kernels.PARAMS_DTYPE.itemsize, \
            f"CopyParams is {size} bytes in C++, {kernels.PARAMS_DTYPE.itemsize} in numpy"

    @property
    def stored_bytes(self) -> int:
        """Bytes stored by `__stcs` (the 16/8/4-byte variants) since the library loaded."""
        return int(self._lib.aiohicache_stored_bytes())

    def launch(self, width: int, grid: int, threads: int, params: np.ndarray) -> None:
        assert params.dtype == kernels.PARAMS_DTYPE and params.flags.c_contiguous
        rc = self._lib.aiohicache_launch(width, grid, threads, params.ctypes.data)
        assert rc == 0, f"no kernel for width {width}"


_HOST_KERNEL: HostKernel | None = None


def host_kernel() -> HostKernel | None:
    """The page-copy kernel as host code, built once per session; None without g++."""
    global _HOST_KERNEL
    if _HOST_KERNEL is not None:
        return _HOST_KERNEL
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    text = (KERNELS / "page_copy.cu").read_bytes() + SHIM.read_bytes()
    tag = hashlib.sha256(text).hexdigest()[:16]
    library = Path(tempfile.gettempdir()) / f"aiohicache-page-copy-{tag}.so"
    if not library.exists():
        tmp = library.with_suffix(f".{id(text)}.tmp")
        subprocess.run([gxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror",
                        "-Wno-unknown-pragmas", "-I", str(KERNELS), str(SHIM), "-o", str(tmp)],
                       check=True)
        tmp.replace(library)
    _HOST_KERNEL = HostKernel(library)
    return _HOST_KERNEL
