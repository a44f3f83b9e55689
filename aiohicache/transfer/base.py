"""The `TransferEngine` protocol and `TransferHandle`, the awaitable result of a copy.

An engine copies whole pages between the device pool and the host pool on its own "streams"
(a CUDA stream, or a worker thread for the CPU engine): submission returns a handle at once,
and copies on one stream complete in submission order. The handle resolves per layer, so a
forward pass can start on layer 0 while later layers are still in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ..errors import TransferError
from ..memory import DevicePool, HostPool, PageIds

__all__ = ("TransferEngine", "TransferHandle", "record_fence", "write_after")


class TransferHandle:
    """Completion of one submitted copy, awaitable whole or per layer.

    The producer side (`_layer_done`, `_finish`) must be called on the event loop; engines
    that complete on other threads hop over with ``loop.call_soon_threadsafe``. Waiting on a
    handle never cancels it: many requests may await one shared load.
    """

    __slots__ = ("_callbacks", "_done", "_events", "_layers", "_loop", "nbytes", "num_layers",
                 "seconds", "started")

    def __init__(self, *, num_layers: int, nbytes: int) -> None:
        self._loop = asyncio.get_running_loop()
        self.num_layers = num_layers
        self.nbytes = nbytes
        self._layers = [self._loop.create_future() for _ in range(num_layers)]
        self._done = self._loop.create_future()
        self._callbacks: list[Callable[[TransferHandle], None]] = []
        self._events: Sequence[object] | None = None  # set by engines that record CUDA events
        self.started = time.perf_counter()
        self.seconds = 0.0
        """From submission until the copy settled (seen on the loop); for metrics."""

    @classmethod
    def for_pages(cls, pool: DevicePool, num_pages: int) -> TransferHandle:
        """The handle of a copy of `num_pages` whole pages of `pool`'s layout (all layers)."""
        spec = pool.spec
        return cls(num_layers=spec.num_layers,
                   nbytes=num_pages * pool.page_size * spec.bytes_per_token)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<TransferHandle {self.nbytes} bytes, {self.num_layers} layers, {state}>"

    def done(self) -> bool:
        return self._done.done()

    def layer_done(self, layer: int) -> bool:
        return self._layers[layer].done()

    def exception(self) -> BaseException | None:
        return self._done.exception() if self._done.done() else None

    def layer_event(self, layer: int) -> object | None:
        """The CUDA event recorded after `layer` of this copy, or None (CPU engine).

        ``stream.wait_event(handle.layer_event(i))`` orders later work on a compute stream
        after the layer's copy on the GPU, with no host sync.
        """
        return self._events[layer] if self._events is not None else None

    async def wait_layer(self, layer: int) -> None:
        """Wait until `layer` is in place.

        Raises:
            TransferError: the copy failed.

        Cancellation: cancels only this wait, never the copy.
        """
        await asyncio.shield(self._layers[layer])

    async def wait(self) -> None:
        """Wait until every layer is in place. Cancellation: as `wait_layer`."""
        await asyncio.shield(self._done)

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call `fn(handle)` on the event loop once the copy settles (at once if it has)."""
        if self._done.done():
            self._loop.call_soon(fn, self)
        else:
            self._callbacks.append(fn)

    # producer side -------------------------------------------------------------------------

    def _layer_done(self, layer: int) -> None:
        if not self._layers[layer].done():
            self._layers[layer].set_result(None)

    def _finish(self, exc: BaseException | None = None) -> None:
        if self._done.done():
            return
        self.seconds = time.perf_counter() - self.started
        if exc is not None:
            err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
            err.__cause__ = exc if err is not exc else None
            for fut in self._layers:
                if not fut.done():
                    fut.set_exception(err)
                    fut.exception()  # mark retrieved: an unawaited layer is not an error
            self._done.set_exception(err)
            self._done.exception()
        else:
            for layer in range(self.num_layers):
                self._layer_done(layer)
            self._done.set_result(None)
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


@runtime_checkable
class TransferEngine(Protocol):
    """Moves pages between one `DevicePool` and one `HostPool`.

    Copies must read the source only after the caller's earlier writes to it: the CPU engine
    gets this for free; the CUDA engine makes its stream wait on the producer's stream.

    Optional (the built-in engines have both; `record_fence` and `write_after` cope with
    engines that do not): ``fence()`` records, at the caller's point in its stream, what a
    later copy must wait for (None where nothing is needed), and ``load``/``write`` take
    ``fences=`` (a sequence of them). A negative page id skips its pair; an id past its pool
    raises `PageError` before anything is copied.
    """

    device_pool: DevicePool
    host_pool: HostPool

    def load(self, host_pages: PageIds, device_pages: PageIds) -> TransferHandle:
        """Start copying host pages into device pages (H2D), layer by layer, in order."""
        ...

    def write(self, device_pages: PageIds, host_pages: PageIds) -> TransferHandle:
        """Start copying device pages into host pages (D2H), all layers."""
        ...

    async def aclose(self) -> None:
        """Let submitted copies finish, then release the engine's resources."""
        ...


def record_fence(engine: TransferEngine) -> object | None:
    """``engine.fence()`` if the engine has one: call it where the KV to be copied was
    produced (at `commit`, on the task that ran the forward pass), keep the result with the
    write, and pass it to `write_after`."""
    fence = getattr(engine, "fence", None)
    return fence() if fence is not None else None


def write_after(engine: TransferEngine, device_pages: PageIds, host_pages: PageIds,
                fences: Sequence[object | None]) -> TransferHandle:
    """``engine.write`` ordered after `fences` (those of `record_fence`; None entries are
    dropped, and an engine is passed ``fences=`` only when one is left)."""
    real = [f for f in fences if f is not None]
    if not real:
        return engine.write(device_pages, host_pages)
    return engine.write(device_pages, host_pages, fences=real)  # type: ignore[call-arg]
