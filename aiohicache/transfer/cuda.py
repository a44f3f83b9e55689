"""The CUDA transfer engine: page copies on dedicated streams, completion as awaitables.

- Loads (host -> device) and writes (device -> host) each have their own CUDA stream, so a
  backup never queues behind a load and both overlap the forward pass on the compute stream.
- ``backend="kernel"`` launches the page-index kernels of ``kernels/page_copy.cu`` with a CTA
  budget; ``backend="direct"`` uses the copy engines (no SMs), one 2-D copy per run of pages
  consecutive on both sides and per (kv, layer).
- A load records one CUDA event per layer. `TransferHandle.wait_layer` resolves through a
  waiter thread per stream (see `_waiter`), and `TransferHandle.layer_event` gives the event
  itself, so a compute stream can wait on it on the GPU without any host sync.
- Before a write the write stream waits for the producer stream (the caller's current stream
  at submission, or the one given): KV the forward pass is still writing is never copied.
  Loads do not wait: pages handed out by the cache are not in use by queued GPU work.

CuPy is imported when an engine is built, never by ``import aiohicache``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import numpy as np
import torch

from ..errors import ClosedError, ConfigError
from ..memory import DevicePool, HostPool, PageIds
from . import kernels
from ._waiter import EventWaiter
from .base import TransferHandle
from .geometry import Geometry, coalesce, direct_copies, kernel_launches, layer_spans

__all__ = ("CudaTransferEngine",)

log = logging.getLogger(__name__)

Backend = Literal["kernel", "direct"]


class _Stream:
    """A CuPy-created stream, its torch alias, and the thread that awaits its events."""

    def __init__(self, cp: Any, device: torch.device, name: str) -> None:
        with cp.cuda.Device(device.index):
            self.cupy = cp.cuda.Stream(non_blocking=True)
        self.torch = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
            self.cupy.ptr, device=device)
        self.waiter = EventWaiter(name)


class CudaTransferEngine:
    """Copies pages between a CUDA `DevicePool` and a pinned `HostPool`.

    Args:
        backend: ``"kernel"`` (copy kernels, `ctas` SMs at most) or ``"direct"`` (copy engines).
        ctas: CTA budget of one kernel launch: the SMs a copy may take from the forward pass.
        threads: threads per CTA (a multiple of 32, at most 1024).
        producer_stream: the stream whose work a write waits for; default: the current
            stream when the write is submitted.

    Raises:
        ConfigError: the device pool is not on CUDA, the host pool is not pinned, CuPy is
            missing, or a parameter is out of range.
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *,
                 backend: Backend = "kernel", ctas: int = 4, threads: int = 512,
                 producer_stream: torch.cuda.Stream | None = None) -> None:
        _check_args(device_pool, host_pool, backend, ctas, threads)
        cp = kernels.cupy()
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.backend = backend
        self.ctas = ctas
        self.producer_stream = producer_stream
        self.device = torch.device("cuda", device_pool.device.index
                                   if device_pool.device.index is not None
                                   else torch.cuda.current_device())
        self.geometry = Geometry.of(device_pool, host_pool)
        self._cp = cp
        self._host_base = _host_alias(cp, self.device, self.geometry, backend)
        self.width = self.geometry.vector_width(self._host_base)
        self._kernels = kernels.CopyKernels(self.device.index, threads=threads) \
            if backend == "kernel" else None
        self._max_pitch = int(cp.cuda.runtime.deviceGetAttribute(
            cp.cuda.runtime.cudaDevAttrMaxPitch, self.device.index))
        self._load = _Stream(cp, self.device, "aiohicache-load-waiter")
        self._write = _Stream(cp, self.device, "aiohicache-write-waiter")
        self._closed = False

    @property
    def load_stream(self) -> torch.cuda.Stream:
        """The stream loads run on (torch's view of it)."""
        return self._load.torch

    @property
    def write_stream(self) -> torch.cuda.Stream:
        """The stream writes (backups to the host) run on."""
        return self._write.torch

    def __repr__(self) -> str:
        return (f"<CudaTransferEngine {self.backend} {self.device} ctas={self.ctas} "
                f"v{self.width}>")

    def load(self, host_pages: PageIds, device_pages: PageIds) -> TransferHandle:
        return self._submit(self._load, host_pages, device_pages, to_device=True)

    def write(self, device_pages: PageIds, host_pages: PageIds) -> TransferHandle:
        return self._submit(self._write, device_pages, host_pages, to_device=False)

    def _submit(self, stream: _Stream, src: PageIds, dst: PageIds, *,
                to_device: bool) -> TransferHandle:
        if self._closed:
            raise ClosedError("transfer engine is closed")
        handle = TransferHandle.for_pages(self.device_pool, len(src))
        src = np.ascontiguousarray(src, dtype=np.int64)
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        try:
            events, keepalive = self._enqueue(stream, src, dst, to_device)
        except Exception as exc:  # a launch error is the copy's error, reported the same way
            log.exception("could not enqueue a page copy")
            asyncio.get_running_loop().call_soon(handle._finish, exc)
            return handle
        handle._events = events if to_device else [events[-1]] * handle.num_layers
        stream.waiter.watch(events, on_event=handle._layer_done if to_device else _ignore,
                            on_done=handle._finish, keepalive=keepalive)
        return handle

    def _enqueue(self, stream: _Stream, src: PageIds, dst: PageIds,
                 to_device: bool) -> tuple[list[torch.cuda.Event], object]:
        """Put the copy on `stream`: fence, (page ids,) copies, events. Returns the events
        and what must live until the last of them."""
        layers = self.geometry.num_layers
        with torch.cuda.device(self.device):
            if not to_device:
                producer = self.producer_stream or torch.cuda.current_stream(self.device)
                stream.torch.wait_stream(producer)
            ids = self._upload(stream, src, dst) if self._kernels is not None else None
            events = []
            runs = coalesce(src, dst) if ids is None else []
            for span in layer_spans(layers, to_device=to_device):
                self._copy(stream, span, to_device, ids, runs, len(src))
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(stream.torch)
                events.append(event)
        return events, ids

    def _upload(self, stream: _Stream, src: PageIds, dst: PageIds) -> torch.Tensor:
        """Both page-id arrays to device memory, ordered on `stream` (no host sync)."""
        packed = torch.from_numpy(np.concatenate([src, dst])).pin_memory()
        with torch.cuda.stream(stream.torch):
            return packed.to(self.device, non_blocking=True)

    def _copy(self, stream: _Stream, layers: tuple[int, int], to_device: bool,
              ids: torch.Tensor | None, runs: list[tuple[int, int, int]], n: int) -> None:
        if ids is not None:
            assert self._kernels is not None
            base = ids.data_ptr()
            for launch in kernel_launches(self.geometry, n, to_device=to_device,
                                          width=self.width, layers=layers,
                                          host_base=self._host_base):
                src_ids, dst_ids = (base, base + 8 * n)
                self._kernels.launch(launch, src_ids, dst_ids, ctas=self.ctas,
                                     stream=stream.cupy)
            return
        runtime = self._cp.cuda.runtime
        for c in direct_copies(self.geometry, runs, to_device=to_device, layers=layers,
                               max_pitch=self._max_pitch):
            runtime.memcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height,
                                  runtime.memcpyDefault, stream.cupy.ptr)

    async def aclose(self) -> None:
        """Wait for submitted copies, then stop the waiter threads.

        Cancellation: the threads still finish the copies they wait for, then stop.
        """
        if self._closed:
            return
        self._closed = True
        for stream in (self._load, self._write):
            await stream.waiter.aclose()


def _ignore(_: int) -> None:
    pass


def _check_args(device_pool: DevicePool, host_pool: HostPool, backend: str, ctas: int,
                threads: int) -> None:
    if device_pool.device.type != "cuda":
        raise ConfigError(f"device pool: the CUDA engine needs a CUDA pool, got "
                          f"{device_pool.device}")
    if not host_pool.pinned:
        raise ConfigError("host pool: the CUDA engine needs a pinned pool "
                          "(HostPool(..., pin_memory=True))")
    if backend not in ("kernel", "direct"):
        raise ConfigError(f"backend: must be 'kernel' or 'direct', got {backend!r}")
    if isinstance(ctas, bool) or not isinstance(ctas, int) or not 1 <= ctas <= 1024:
        raise ConfigError(f"ctas: must be an int in 1..1024, got {ctas!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not (
            32 <= threads <= 1024 and threads % 32 == 0):
        raise ConfigError(f"threads: must be a multiple of 32 in 32..1024, got {threads!r}")


def _host_alias(cp: Any, device: torch.device, geometry: Geometry, backend: str) -> int | None:
    """The address kernels use for the registered host pool (its own, on unified addressing).

    The copy engines take host addresses as they are; a kernel may only use them where the
    device says so (every x86-64 Linux system with unified addressing).
    """
    if backend != "kernel":
        return None
    runtime = cp.cuda.runtime
    if not runtime.deviceGetAttribute(runtime.cudaDevAttrCanUseHostPointerForRegisteredMem,
                                      device.index):
        raise ConfigError(f"{device} cannot use host pointers of registered memory in kernels; "
                          "use io_backend='direct'")
    return geometry.host.base
