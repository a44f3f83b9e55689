"""The CPU transfer engine: page copies on two worker threads that play the CUDA streams.

Loads and writes each run on their own single-thread executor, so copies of one direction
complete in submission order (like a stream) and the event loop only submits and collects.
A copy is one call into the C copier (`_pagecopy.c`, via `_native.native_copier`), which
lets go of the GIL on the copy threads; where it is not built, numpy copies by a `CopyPlan`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import anyio.to_thread
import torch

from ..errors import ClosedError, ConfigError
from ..memory import DevicePool, HostPool, PageIds
from ._base import TransferHandle
from ._copy import CopyPlan, as_words, copy_pages
from ._geometry import Geometry, check_copy, layer_spans
from ._native import native_copier

__all__ = ("CpuTransferEngine", "copy_layer", "numpy_layers", "word_views")

log = logging.getLogger(__name__)


class _Stream:
    """One worker thread; work runs in submission order.

    NOTE: the thread runs torch single-threaded. Per-layer copies are small, and torch's
    intra-op pool stalls for milliseconds when a sibling thread is descheduled (measured on a
    shared 2-core machine: a 1 MiB copy took 6-7 ms with 2 threads, 11-64 us with 1).
    """

    def __init__(self, name: str) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                           initializer=torch.set_num_threads, initargs=(1,))
        self.pending = 0  # submitted to the thread, not yet finished (event loop only)

    def retire(self, _: TransferHandle) -> None:
        self.pending -= 1


class CpuTransferEngine:
    """Copies pages between a CPU `DevicePool` and a `HostPool` off the event loop.

    Raises:
        ConfigError: the pools differ in spec or page size (whichever copier is used), or the
            device pool is not in CPU memory (use `CudaTransferEngine`).
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *,
                 inline_bytes: int = 1 << 20) -> None:
        if device_pool.data.device.type != "cpu":  # numpy failed at the first copy
            raise ConfigError(f"CpuTransferEngine: the device pool is on "
                              f"{device_pool.data.device}; it copies CPU pools only (use "
                              "CudaTransferEngine)")
        Geometry.of(device_pool, host_pool)  # the numpy copies would move mismatched bytes
        self.device_pool = device_pool
        self.inline_bytes = inline_bytes
        """Copies up to this size run on the event loop when their stream is idle. A copy of
        1 MiB takes 60-130 µs in C (contiguous to every page scattered; numpy: 0.4-0.9 ms);
        on a loaded 2-core machine handing it to a thread costs more (waking the thread,
        waking the loop back): the full-trace replay ran 654-718 requests/s at 1 MiB,
        523-609 at 128 KiB and 443-485 with every copy on the thread (docs/performance.md)."""
        self.host_pool = host_pool
        # NOTE: once: `TransferHandle.for_pages` walks the spec's properties at every copy
        self._num_layers = device_pool.spec.num_layers
        self._page_bytes = device_pool.page_size * device_pool.spec.bytes_per_token
        # Views are built once: per-copy Python work on the copy threads holds the GIL
        # that the event loop needs.
        self._device_words = word_views(device_pool)
        self._host_words = word_views(host_pool)
        self._native = native_copier(device_pool, host_pool)
        """The C copier (`_pagecopy.c`), or None: numpy copies by a `CopyPlan` instead."""
        self._load = _Stream("aiohicache-load")
        self._write = _Stream("aiohicache-write")
        self._closed = False

    def fence(self) -> None:
        """No fence is needed: a copy here runs after everything the caller did before."""
        return None

    def load(self, host_pages: PageIds, device_pages: PageIds, *,
             fences: Sequence[object] = ()) -> TransferHandle:
        """Copy host pages into device pages, layer by layer. A negative id skips its pair.

        Raises:
            PageError: an id is past its pool (nothing is copied).
        """
        return self._submit(self._load, host_pages, device_pages, to_device=True)

    def write(self, device_pages: PageIds, host_pages: PageIds, *,
              fences: Sequence[object] = ()) -> TransferHandle:
        """Copy device pages into host pages, all layers; ids as for `load`."""
        return self._submit(self._write, device_pages, host_pages, to_device=False)

    def _submit(self, stream: _Stream, src: PageIds, dst: PageIds, *,
                to_device: bool) -> TransferHandle:
        if self._closed:
            raise ClosedError("transfer engine is closed")
        src, dst = check_copy(self.device_pool.num_pages, self.host_pool.num_pages, src, dst,
                              to_device=to_device)
        handle = TransferHandle(num_layers=self._num_layers, nbytes=len(src) * self._page_bytes)
        if handle.nbytes <= self.inline_bytes and stream.pending == 0:
            # idle stream: order is kept
            self._layers(src, dst, to_device)(0, self.device_pool.spec.num_layers, False)
            handle.bridge.call_soon(handle._finish, None)
            return handle
        stream.pending += 1
        handle.add_done_callback(stream.retire)
        stream.executor.submit(self._run, src.copy(), dst.copy(), handle, to_device)
        return handle

    def _layers(self, src: PageIds, dst: PageIds,
                to_device: bool) -> Callable[[int, int, bool], None]:
        """``copy(lo, hi, release_gil)``: copies layers ``[lo, hi)`` of this job; the C
        copier lets go of the GIL for it if asked, numpy only for large slices."""
        native = self._native
        if native is not None:
            return lambda lo, hi, release: native.copy(src, dst, to_device, lo, hi, release)
        return numpy_layers(self._device_words, self._host_words, src, dst,
                            to_device=to_device)

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        """Worker thread: copy (a load layer by layer, reporting each layer to the loop)."""
        try:
            copy = self._layers(src, dst, to_device)
            for lo, hi in layer_spans(self.device_pool.spec.num_layers, to_device=to_device):
                copy(lo, hi, True)
                if to_device:
                    handle.bridge.call_soon(handle._layer_done, lo)
        except Exception as exc:  # reported through the handle, never lost
            log.exception("page copy failed")
            handle.bridge.call_soon(handle._finish, exc)
            return
        handle.bridge.call_soon(handle._finish, None)

    async def aclose(self) -> None:
        """Wait for submitted copies, then stop the worker threads.

        Cancellation: the threads are still shut down; the copies they run complete.
        """
        if self._closed:
            return
        self._closed = True
        for stream in (self._load, self._write):  # both stop after their queues, even if
            stream.executor.shutdown(wait=False)  # the wait below is cancelled
        for stream in (self._load, self._write):
            await anyio.to_thread.run_sync(stream.executor.shutdown, abandon_on_cancel=False)


WordViews = list[list[torch.Tensor]]


def numpy_layers(device: WordViews, host: WordViews, src: PageIds, dst: PageIds, *,
                 to_device: bool) -> Callable[[int, int, bool], None]:
    """The numpy copy of one job, planned once: ``copy(lo, hi, _)`` copies layers
    ``[lo, hi)`` (the GIL is let go of only inside numpy's large slice copies)."""
    rows = device[0][0]  # one page of one layer's K or V: what a copy moves per page id
    plan = CopyPlan.build(src, dst, row_bytes=rows.shape[1] * rows.element_size())

    def copy(lo: int, hi: int, _: bool) -> None:
        for layer in range(lo, hi):
            copy_layer(device, host, plan, layer, to_device=to_device)
    return copy


def word_views(pool: DevicePool | HostPool) -> WordViews:
    """Per layer, per K/V tensor: the pool's pages as integer words (see `as_words`)."""
    return [[as_words(pool.layer_view(kv, layer)) for kv in range(pool.spec.num_kv)]
            for layer in range(pool.spec.num_layers)]


def copy_layer(device: WordViews, host: WordViews, plan: CopyPlan, layer: int, *,
               to_device: bool) -> None:
    """Copy one layer's pages (K and V, or the MLA latent) between the pools; blocking."""
    for dev, hst in zip(device[layer], host[layer], strict=True):
        if to_device:
            copy_pages(hst, dev, plan)
        else:
            copy_pages(dev, hst, plan)
