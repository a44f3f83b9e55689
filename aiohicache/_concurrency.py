"""The concurrency vocabulary of the package, on top of anyio.

Everything async in aiohicache waits on anyio primitives (events, task groups, memory object
streams, cancel scopes), so the cache runs under asyncio and, without CUDA or Redis, under
trio. Three things anyio does not offer are built here once, for both backends:

- `LoopBridge`: the one way a thread hands a completion to the event loop;
- `Promise`: a one-shot result that many tasks can await without cancelling it;
- `Detached`: a task that outlives the call that started it (the cache's workers run from
  ``__aenter__`` to ``aclose``, which users may call from different tasks).

Blocking calls with no thread of their own go through ``anyio.to_thread.run_sync``; work for
a dedicated thread (an executor whose single thread orders its calls) through
`run_in_thread`, which comes back over the same `LoopBridge`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ("Detached", "LoopBridge", "Promise", "Pulse", "Signal", "current_loop",
           "finish_then_cancel", "run_in_thread", "submit_to_thread", "supervise")

T = TypeVar("T")
log = logging.getLogger(__name__)


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False  # trio (anyio's only other backend) runs no asyncio loop
    return True


def current_loop() -> object | None:
    """The event loop running in this thread (asyncio's loop, or trio's run token: one per
    run), or None outside any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")  # only a trio run can be current if trio is not imported
    if trio is None:
        return None
    try:
        token: object = trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None
    return token


class LoopBridge:
    """Calls from worker threads (copy threads, CUDA event waiters, executors) onto the loop.

    Made on the loop's thread; `call_soon` may then be called from any thread, the loop's
    own included. Quiet once the loop is gone: an abandoned loop has nobody left to tell.
    """

    __slots__ = ("_call", "_local", "_thread")

    def __init__(self) -> None:
        self._call: Callable[..., object]
        self._local: Callable[..., object]
        if _on_asyncio():
            loop = asyncio.get_running_loop()
            self._call, self._local = loop.call_soon_threadsafe, loop.call_soon
        else:
            import trio  # only reached under trio, so trio is installed

            self._call = self._local = trio.lowlevel.current_trio_token().run_sync_soon
        self._thread = threading.get_ident()

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        # NOTE: from the loop's own thread (an inline copy finishing, a done callback) the
        # loop needs no wake-up: `call_soon_threadsafe` wrote to its self-pipe each time, a
        # write and a read syscall per finished copy. Same queue, same order.
        try:
            if threading.get_ident() == self._thread:
                self._local(fn, *args)
            else:
                self._call(fn, *args)
        except RuntimeError:  # asyncio: loop closed; trio: RunFinishedError
            log.debug("event loop closed before a thread's completion arrived")


def submit_to_thread(executor: Executor, fn: Callable[..., T], *args: object) -> Promise[T]:
    """Start ``fn(*args)`` on `executor` now; its result arrives over the `LoopBridge`."""
    promise: Promise[T] = Promise()
    bridge = LoopBridge()

    def settle(future: Future[T]) -> None:
        if future.cancelled():  # still queued when the executor shut down (cancel_futures)
            promise.set_exception(RuntimeError(f"{fn!r} never ran: its executor shut down"))
        elif (exc := future.exception()) is not None:
            promise.set_exception(exc)
        else:
            promise.set_result(future.result())

    future = executor.submit(fn, *args)
    future.add_done_callback(lambda f: bridge.call_soon(settle, f))
    return promise


async def run_in_thread(executor: Executor, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on `executor`, awaited without blocking the loop.

    Cancellation: only the wait ends; a call already running in the thread runs to its end.
    """
    return await submit_to_thread(executor, fn, *args).wait()


class _Dropped(Exception):
    """The result of a promise that was cancelled: nobody is waiting for it."""


class Promise(Generic[T]):
    """A one-shot result. `wait` is cancellable without cancelling the promise, so any
    number of tasks may wait on one shared result. Callbacks run at settlement, on the loop.

    The event behind `wait` is made by the first waiter: most promises (a job's launch, a
    consensus op) settle before anyone waits, and a request makes several.
    """

    __slots__ = ("_callbacks", "_cancelled", "_done", "_error", "_event", "_result")

    def __init__(self) -> None:
        self._event: anyio.Event | None = None
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._callbacks: list[Callable[[Promise[T]], object]] = []

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def set_result(self, value: T) -> None:
        self._result = value
        self._settle()

    def set_exception(self, exc: BaseException) -> None:
        self._error = exc
        self._settle()

    def cancel(self) -> None:
        """Drop the promise (nobody waits for it any more); its result is never set."""
        if not self.done():
            self._cancelled = True
            self.set_exception(_Dropped())

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    async def wait(self) -> T:
        """The result, once set (raises its exception). Cancellation: only the wait."""
        await self.settled()
        return self.result()

    async def settled(self) -> None:
        """Wait until it is settled, whichever way. Cancellation: only the wait."""
        if self._done:
            await anyio.lowlevel.checkpoint()  # a wait is a checkpoint, done or not
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()

    def add_done_callback(self, fn: Callable[[Promise[T]], object]) -> None:
        """Call `fn(promise)` when it settles (now, if it has)."""
        if self.done():
            fn(self)
        else:
            self._callbacks.append(fn)

    def _settle(self) -> None:
        if self._done:
            raise RuntimeError("promise already settled")
        self._done = True
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class Detached:
    """Runs ``fn(*args)`` in a task of its own that outlives the caller.

    `cancel` cancels it; `done` settles when it ends (with its exception, if it raised).
    asyncio runs it as a task; trio as a system task. Its errors go to `done`, never to the
    loop: a worker's failure is the cache's to report. On asyncio a KeyboardInterrupt or
    SystemExit also stops the loop, as from any task (a trio system task may not raise).
    """

    __slots__ = ("_scope", "_task", "done")

    def __init__(self, fn: Callable[..., Coroutine[Any, Any, object]], *args: object,
                 name: str) -> None:
        self._scope = anyio.CancelScope()
        self.done: Promise[None] = Promise()
        self._task: object = None  # asyncio keeps only weak references to tasks: hold it
        if _on_asyncio():
            self._task = asyncio.get_running_loop().create_task(self._main(fn, args),
                                                                name=name)
        else:
            import trio

            trio.lowlevel.spawn_system_task(self._main, fn, args, name=name)

    def cancel(self) -> None:
        self._scope.cancel()

    async def _main(self, fn: Callable[..., Coroutine[Any, Any, object]],
                    args: tuple[object, ...]) -> None:
        try:
            with self._scope:
                await fn(*args)
        except BaseException as exc:  # reported through `done`; see the class docstring
            self.done.set_exception(exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit) and _on_asyncio():
                raise
            return
        self.done.set_result(None)


async def supervise(name: str, worker: Callable[[], Awaitable[None]], *, limit: int,
                    on_restart: Callable[[], None],
                    on_give_up: Callable[[Exception], None]) -> None:
    """Run `worker`; after a crash restart it, up to `limit` times, then `on_give_up(exc)`.

    A worker that returns is done. Cancellation: cancels the worker; nothing is restarted.
    """
    restarts = 0
    while True:
        try:
            await worker()
            return
        except Exception as exc:
            if restarts >= limit:
                log.exception("%s crashed; the cache stops serving", name)
                on_give_up(exc)
                return
            restarts += 1
            on_restart()
            log.exception("%s crashed (restart %d)", name, restarts)


async def finish_then_cancel(aw: Awaitable[T]) -> T:
    """Await `aw` to completion even if the caller is cancelled meanwhile.

    Work whose half-done state would corrupt the cache (queueing a planned transfer, closing)
    runs to the end; a cancellation of the caller is held back until then and re-raised.
    Unlike a bare shield, the caller does not return early, so when it sees the cancellation
    the work has happened. Works for anyio cancel scopes, and on asyncio also for
    ``task.cancel()`` and ``asyncio.timeout``, which no anyio shield stops.
    """
    if not _on_asyncio():
        with anyio.CancelScope(shield=True):
            result = await aw
    else:
        # The anyio shield keeps anyio scopes from re-delivering their cancellation on every
        # loop turn; the loop below absorbs native cancellations, which the shield does not
        # stop.
        with anyio.CancelScope(shield=True):
            result, cancelled = await _await_through_cancels(asyncio.ensure_future(aw))
        if cancelled:
            raise asyncio.CancelledError
    await anyio.lowlevel.checkpoint_if_cancelled()  # an anyio scope's, held back until now
    return result


async def _await_through_cancels(task: asyncio.Future[T]) -> tuple[T, bool]:
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if not task.done():
                cancelled = True
                continue
            if task.cancelled():
                raise
            result = task.result()
            cancelled = True
            break
    return result, cancelled


class Signal:
    """A re-armable `anyio.Event`: `set` wakes every waiter, `clear` re-arms it.

    anyio's events are one-shot (no ``clear``); a worker that sleeps until "something
    happened" and then consumes it needs one it can re-arm.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class Pulse:
    """News for whoever is waiting: `fire` wakes every current waiter; later ones wait for
    the next fire. `generation` counts fires, so a caller that reads it, then checks its
    condition, then waits with ``since=`` cannot miss a fire in between.

    The event is made only when someone waits: most fires (a settle, a drained channel)
    find nobody waiting.
    """

    __slots__ = ("_event", "generation")

    def __init__(self) -> None:
        self._event: anyio.Event | None = None
        self.generation = 0

    def fire(self) -> None:
        self.generation += 1
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, since: int | None = None) -> None:
        """Until the next fire (or at once if one happened after generation `since`).

        Cancellation: only the wait.
        """
        if since is not None and since != self.generation:
            await anyio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()
