"""Review of the CUDA transfer path: what can be proven without a GPU, and one GPU check.

- The page-copy kernels must launch with every CTA size the engine accepts (``threads`` up to
  1024): the cubin the engine compiles is read for each variant's register count.
- `CudaTransferEngine.aclose` must wait for copies in flight on every call, also on one made
  after a cancelled call (its only caller then unpins the host pool the copies read).
"""

from __future__ import annotations

import asyncio
import struct
import threading
import types

import numpy as np
import pytest
import torch

from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer import _cuda_kernels as kernels
from aiohicache.transfer._cuda import CudaTransferEngine
from aiohicache.transfer._waiter import EventWaiter
from tests import transfer_matrix as tm
from tests.transfer.test_cuda_plan import needs_nvrtc

REGISTERS_PER_CTA = 64 * 1024
"""32-bit registers one CTA may use on every architecture CUDA 12 and 13 support."""
EIATTR_REGCOUNT = 0x2F
"""The ``.nv.info`` attribute holding a kernel's registers per thread."""


def register_counts(cubin: bytes) -> list[int]:
    """Registers per thread of every kernel in an ELF cubin (its ``.nv.info`` sections)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize)
               for i in range(count)]
    strtab = headers[names_at][4]
    counts = []
    for name_at, _, _, _, offset, size, *_ in headers:
        name = cubin[strtab + name_at:cubin.index(b"\0", strtab + name_at)]
        if not name.startswith(b".nv.info"):
            continue
        at, end = offset, offset + size
        while at < end:  # entries: format, attribute, then a value or (size, bytes)
            fmt, attr = cubin[at], cubin[at + 1]
            length = struct.unpack_from("<H", cubin, at + 2)[0] if fmt == 4 else 0
            if attr == EIATTR_REGCOUNT:
                counts.append(struct.unpack_from("<I", cubin, at + 8)[0])
            at += 4 + length
    return counts


@needs_nvrtc
@pytest.mark.parametrize("threads", [256, 512, 640, 800, 1024])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_variant_launches_with_every_cta_size_the_engine_accepts(
        arch: str, threads: int) -> None:
    """CudaTransferEngine takes ``threads`` up to 1024 (docs/cuda.md: "may be raised to
    1024"). A kernel needing more than 64 registers per thread cannot launch a 1024-thread
    CTA (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES): every copy would fail and the cache stop
    serving. The 4/2/1-byte variants (odd rows) took 72-96 registers."""
    counts = register_counts(kernels.nvrtc_check(arch=arch, threads=threads))
    assert len(counts) == len(kernels.kernel_names())
    most = REGISTERS_PER_CTA // threads
    assert max(counts) <= most, (f"{arch}: registers per thread {sorted(counts)}; a CTA of "
                                 f"{threads} threads has {most} each")


class ThreadEvent:
    """Stands in for a CUDA event: `synchronize()` blocks until the test sets it."""

    def __init__(self) -> None:
        self._set = threading.Event()

    def set(self) -> None:
        self._set.set()

    def synchronize(self) -> None:
        assert self._set.wait(10)


async def test_aclose_after_a_cancelled_aclose_still_waits_for_copies_in_flight() -> None:
    """HiCache unpins the host pool once `engine.aclose()` returns: a second call that
    returns at once while a copy is still in flight lets the GPU read unpinned memory."""
    engine = object.__new__(CudaTransferEngine)  # no GPU here: only what aclose uses
    engine._closed = False
    engine._load = types.SimpleNamespace(waiter=EventWaiter("review-load"))  # type: ignore[assignment]
    engine._write = types.SimpleNamespace(waiter=EventWaiter("review-write"))  # type: ignore[assignment]
    copy = ThreadEvent()
    settled: list[BaseException | None] = []
    engine._load.waiter.watch([copy], on_event=lambda i: None, on_done=settled.append)
    first = asyncio.ensure_future(engine.aclose())
    await asyncio.sleep(0.01)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.ensure_future(engine.aclose())
    try:
        await asyncio.sleep(0.05)
        assert not second.done(), "aclose returned with a copy still in flight"
    finally:
        copy.set()
        await asyncio.wait_for(second, 5)
    assert settled == [None]


@pytest.mark.gpu
async def test_odd_rows_copy_with_1024_threads_per_cta() -> None:
    """The GPU side of the register test: a 4-byte-vector copy with 1024-thread CTAs."""
    ref_dev, ref_host = tm.odd_row_pools(2, 3, "fp8", 2)  # 6-byte rows: copy_pages_v4
    dev = DevicePool(ref_dev.spec, num_pages=ref_dev.num_pages, page_size=ref_dev.page_size,
                     device="cuda")
    host = HostPool(ref_host.spec, num_pages=ref_host.num_pages,
                    page_size=ref_host.page_size, layout=ref_host.layout, pin_memory=True)
    dev.data.view(torch.uint8).copy_(ref_dev.data.view(torch.uint8))
    host.data.view(torch.uint8).copy_(ref_host.data.view(torch.uint8))
    src, dst = tm.ODD_PAIRS
    tm.reference_copy(ref_dev, ref_host, src, dst, to_device=True)
    engine = CudaTransferEngine(dev, host, backend="kernel", threads=1024)
    try:
        assert engine.width == 4
        await engine.load(np.asarray(src), np.asarray(dst)).wait()
        assert tm.same_bytes(dev.data, ref_dev.data)
    finally:
        await engine.aclose()
        host.close()
