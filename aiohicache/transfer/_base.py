"""The `TransferEngine` protocol and `TransferHandle`, the awaitable result of a copy.

An engine copies whole pages between the device pool and the host pool on its own "streams"
(a CUDA stream, or a worker thread for the CPU engine): submission returns a handle at once,
and copies on one stream complete in submission order. The handle resolves per layer, so a
forward pass can start on layer 0 while later layers are still in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import anyio

from .._concurrency import LoopBridge, Promise
from ..errors import TransferError
from ..memory import DevicePool, HostPool, PageIds

__all__ = ("TransferEngine", "TransferHandle", "record_fence", "write_after")


class TransferHandle:
    """Completion of one submitted copy, awaitable whole or per layer.

    The producer side (`_layer_done`, `_finish`) must be called on the event loop; engines
    that complete on other threads hop over with `bridge` (a `LoopBridge`). Waiting on a
    handle never cancels it: many requests may await one shared load.

    Layers complete in order, so progress is one counter; an event is made only for a layer
    someone waits on before it is in place (most waits find their layer done, and a model
    has up to ~100 layers: an event per layer per copy would be most of the handle's cost).
    """

    __slots__ = ("_callbacks", "_done", "_error", "_events", "_layers_done", "_waiters",
                 "bridge", "nbytes", "num_layers", "seconds", "started")

    def __init__(self, *, num_layers: int, nbytes: int) -> None:
        self.bridge = LoopBridge()
        self.num_layers = num_layers
        self.nbytes = nbytes
        self._layers_done = 0
        self._waiters: dict[int, anyio.Event] = {}
        # NOTE: not `Promise[None]()`: calling a subscripted generic goes through typing's
        # alias call (it sets `__orig_class__`), half of this constructor's time
        self._done: Promise[None] = Promise()  # its event is made only if someone waits
        self._error: TransferError | None = None
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
        return layer < self._layers_done or self.done()

    def exception(self) -> BaseException | None:
        return self._error

    def layer_event(self, layer: int) -> object | None:
        """The CUDA event recorded after `layer` of this copy, or None (CPU engine).

        ``stream.wait_event(handle.layer_event(i))`` orders later work on a compute stream
        after the layer's copy on the GPU, with no host sync.
        """
        return self._events[layer] if self._events is not None else None

    async def wait_layer(self, layer: int) -> None:
        """Wait until `layer` is in place.

        Raises:
            TransferError: the copy failed before `layer` was in place.

        Cancellation: cancels only this wait, never the copy.
        """
        if layer >= self._layers_done:
            if not self.done():
                await self._waiters.setdefault(layer, anyio.Event()).wait()
            if self._error is not None and layer >= self._layers_done:
                raise self._error

    async def wait(self) -> None:
        """Wait until every layer is in place. Cancellation: as `wait_layer`."""
        await self._done.settled()
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call `fn(handle)` on the event loop once the copy settles (soon, if it has)."""
        if self.done():
            self.bridge.call_soon(fn, self)
        else:
            self._callbacks.append(fn)

    # producer side -------------------------------------------------------------------------

    def _layer_done(self, layer: int) -> None:
        if layer >= self._layers_done and not self.done():
            self._layers_done = layer + 1
            for waiting in [w for w in self._waiters if w <= layer]:
                self._waiters.pop(waiting).set()

    def _finish(self, exc: BaseException | None = None) -> None:
        if self.done():
            return
        self.seconds = time.perf_counter() - self.started
        if exc is not None:
            err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
            err.__cause__ = exc if err is not exc else None
            self._error = err
        else:
            self._layers_done = self.num_layers
        self._done.set_result(None)
        for event in self._waiters.values():
            event.set()
        self._waiters.clear()
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
