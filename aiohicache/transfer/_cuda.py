"""The CUDA transfer engine: page copies on dedicated streams, completion as awaitables.

- Loads (host -> device) and writes (device -> host) each have their own CUDA stream, so a
  backup never queues behind a load and both overlap the forward pass on the compute stream.
- ``backend="kernel"`` launches the page-index kernels of ``kernels/page_copy.cu`` with a CTA
  budget; ``backend="direct"`` uses the copy engines (no SMs), one 2-D copy per run of pages
  consecutive on both sides and per (kv, layer).
- A load records one CUDA event per layer. `TransferHandle.wait_layer` resolves through a
  waiter thread per stream (see `_waiter`), and `TransferHandle.layer_event` gives the event
  itself, so a compute stream can wait on it on the GPU without any host sync.
- Fences. A copy waits on the GPU for the work it must follow: the `fences` passed to
  `load`/`write` (events from `fence()`, recorded where the KV was produced, e.g. at commit),
  or, without fences, an event recorded at submission on the producer stream (the one
  given, else the caller's current stream). So a write never copies KV the forward pass is
  still writing, and a load never overwrites pages that queued work (a zero-fill, attention
  on re-allocated pages) still touches.
- Page ids are checked on the host before anything is enqueued (`check_page_ids`).
- Per layer the host does one ``cuLaunchKernel`` of a pre-packed struct (`LaunchTable`) and
  one event record; layer events are recycled once their copy has settled.

CuPy is imported when an engine is built, never by ``import aiohicache``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from .._validate import check_int
from ..errors import ClosedError, ConfigError
from ..memory import DevicePool, HostPool, PageIds
from . import _cuda_kernels as kernels
from ._base import TransferHandle
from ._geometry import Geometry, check_copy, coalesce, direct_copies, layer_spans
from ._waiter import EventWaiter

__all__ = ("CudaTransferEngine",)

log = logging.getLogger(__name__)

Backend = Literal["kernel", "direct"]


Fence = torch.cuda.Event
"""What `CudaTransferEngine.fence` returns and `load`/`write` take: a recorded CUDA event."""


class _Stream:
    """A CuPy-created stream, its torch alias, the thread that awaits its events, and the
    events it reuses."""

    def __init__(self, cp: Any, device: torch.device, name: str) -> None:
        with cp.cuda.Device(device.index):
            self.cupy = cp.cuda.Stream(non_blocking=True)
        self.torch = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
            self.cupy.ptr, device=device)
        self.ptr: int = self.cupy.ptr
        self.waiter = EventWaiter(name)
        # NOTE: one event serves every submission-time fence: the stream's wait captures the
        # event's state when it is issued, so recording it again later is harmless.
        self.fence = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._free: list[torch.cuda.Event] = []

    def events(self, n: int) -> list[torch.cuda.Event]:
        """`n` blocking events (the waiter sleeps on them), reused once settled."""
        take = self._free[-n:] if n else []
        del self._free[len(self._free) - len(take):]
        return take + [torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                       for _ in range(n - len(take))]

    def recycle(self, events: Sequence[torch.cuda.Event]) -> None:
        self._free.extend(events)


class CudaTransferEngine:
    """Copies pages between a CUDA `DevicePool` and a pinned `HostPool`.

    Args:
        backend: ``"kernel"`` (copy kernels, `ctas` SMs at most) or ``"direct"`` (copy engines).
        ctas: CTA budget of one kernel launch: the SMs a copy may take from the forward pass.
        threads: threads per CTA (a multiple of 32, at most 1024).
        producer_stream: the stream a copy submitted without fences waits for, and where
            `fence()` records; default: the caller's current stream at that moment.

    Raises:
        ConfigError: the device pool is not on CUDA, the host pool is not pinned, CuPy is
            missing, the driver is older than CuPy or NVRTC, or a parameter is out of range.
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *,
                 backend: Backend = "kernel", ctas: int = 4, threads: int = 512,
                 producer_stream: torch.cuda.Stream | None = None) -> None:
        _check_args(device_pool, host_pool, backend, ctas, threads)
        cp = kernels.cupy()
        kernels.check_cuda(cp)  # a CUDA 12 driver under cupy-cuda13x fails here, clearly
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
        self._tables = {to_device: kernels.LaunchTable(
            self.geometry, to_device=to_device, width=self.width, ctas=ctas, threads=threads,
            host_base=self._host_base) for to_device in (True, False)} \
            if backend == "kernel" else {}
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

    def fence(self) -> Fence:
        """An event recorded now on the producer stream (default: the caller's current
        stream). Pass it to `write` (or `load`) to order that copy after the work queued
        before this call, e.g. the forward pass that wrote the KV being committed."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.producer_stream or torch.cuda.current_stream(self.device))
        return event

    def load(self, host_pages: PageIds, device_pages: PageIds, *,
             fences: Sequence[Fence] = ()) -> TransferHandle:
        """Copy host pages into device pages, layer by layer, after `fences` (or, without
        any, after the work queued so far on the producer stream)."""
        return self._submit(self._load, host_pages, device_pages, fences, to_device=True)

    def write(self, device_pages: PageIds, host_pages: PageIds, *,
              fences: Sequence[Fence] = ()) -> TransferHandle:
        """Copy device pages into host pages, all layers, after `fences` (see `load`)."""
        return self._submit(self._write, device_pages, host_pages, fences, to_device=False)

    def _submit(self, stream: _Stream, src: PageIds, dst: PageIds, fences: Sequence[Fence],
                *, to_device: bool) -> TransferHandle:
        if self._closed:
            raise ClosedError("transfer engine is closed")
        src, dst = check_copy(self.device_pool.num_pages, self.host_pool.num_pages, src, dst,
                              to_device=to_device)
        handle = TransferHandle.for_pages(self.device_pool, len(src))
        try:
            events, keepalive = self._enqueue(stream, src, dst, fences, to_device)
        except Exception as exc:  # a launch error is the copy's error, reported the same way
            log.exception("could not enqueue a page copy")
            handle.bridge.call_soon(handle._finish, exc)
            return handle
        handle._events = events if to_device else [events[-1]] * handle.num_layers

        def done(exc: BaseException | None) -> None:
            handle._events = None  # settled: `layer_event` is None, the events are reused
            stream.recycle(events)
            handle._finish(exc)

        stream.waiter.watch(events, on_event=handle._layer_done if to_device else _ignore,
                            on_done=done, keepalive=keepalive)
        return handle

    def _enqueue(self, stream: _Stream, src: PageIds, dst: PageIds, fences: Sequence[Fence],
                 to_device: bool) -> tuple[list[torch.cuda.Event], object]:
        """Put the copy on `stream`: fences, (page ids,) copies, events. Returns the events
        and what must live until the last of them."""
        spans = layer_spans(self.geometry.num_layers, to_device=to_device)
        with torch.cuda.device(self.device):
            for fence in fences:
                stream.torch.wait_event(fence)
            if not fences:
                stream.fence.record(self.producer_stream
                                    or torch.cuda.current_stream(self.device))
                stream.torch.wait_event(stream.fence)
            events = stream.events(len(spans))
            if self._kernels is not None:
                ids = self._upload(stream, src, dst)
                base, n = ids.data_ptr(), len(src)
                plan = self._tables[to_device].plan(n, base, base + 8 * n)
                for i, event in enumerate(events):
                    self._kernels.launch(plan, i, stream.ptr)
                    event.record(stream.torch)
                return events, ids
            runs = coalesce(src, dst)
            runtime = self._cp.cuda.runtime
            for span, event in zip(spans, events, strict=True):
                for c in direct_copies(self.geometry, runs, to_device=to_device, layers=span,
                                       max_pitch=self._max_pitch):
                    runtime.memcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height,
                                          runtime.memcpyDefault, stream.ptr)
                event.record(stream.torch)
        return events, None

    def _upload(self, stream: _Stream, src: PageIds, dst: PageIds) -> torch.Tensor:
        """Both page-id arrays to device memory, ordered on `stream` (no host sync)."""
        packed = torch.from_numpy(np.concatenate([src, dst])).pin_memory()
        with torch.cuda.stream(stream.torch):
            return packed.to(self.device, non_blocking=True)

    async def aclose(self) -> None:
        """Wait for submitted copies, then stop the waiter threads. Every call waits, also one
        after a cancelled call: returning early would let the caller unpin the host pool under
        copies still in flight.

        Cancellation: the threads still finish the copies they wait for, then stop.
        """
        self._closed = True
        for stream in (self._load, self._write):  # both stop, even if a wait is cancelled
            stream.waiter.close()
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
    check_int("ctas", ctas, low=1, high=1024)
    if check_int("threads", threads, low=32, high=kernels.MAX_THREADS) % 32:
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
