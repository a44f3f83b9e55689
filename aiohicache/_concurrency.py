"""Cancellation helpers shared by the async layers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import anyio

__all__ = ("Signal", "finish_then_cancel", "pulse")

T = TypeVar("T")


async def finish_then_cancel(aw: Awaitable[T]) -> T:
    """Await `aw` to completion even if the caller is cancelled meanwhile.

    Work whose half-done state would corrupt the cache (queueing a planned transfer, closing)
    runs in its own task; a cancellation of the caller is held back until that task is done
    and then re-raised. Unlike ``asyncio.shield`` alone, the caller does not return early, so
    when it sees the cancellation the work has happened. Works for ``task.cancel()``,
    ``asyncio.timeout`` and anyio cancel scopes alike.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    # The anyio shield keeps anyio scopes from re-delivering their cancellation on every
    # loop turn (they re-raise it at the caller's next checkpoint); the loop below absorbs
    # native task.cancel() / asyncio.timeout cancellations, which the shield does not stop.
    with anyio.CancelScope(shield=True):
        result, cancelled = await _await_through_cancels(task)
    if cancelled:
        raise asyncio.CancelledError
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


def pulse(event: anyio.Event) -> anyio.Event:
    """Wake everyone waiting on `event`; return a fresh one for the next waiters."""
    event.set()
    return anyio.Event()
