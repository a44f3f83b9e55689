"""Awaiting CUDA events from the event loop: one waiter thread per stream.

Events recorded on one stream complete in order, so a single thread can take them off a
queue and block on each in turn (``event.synchronize()`` releases the GIL and, for events
created with ``blocking=True``, sleeps instead of spinning), then hand the news to the event
loop through the package's one thread bridge (`LoopBridge`). The loop never polls and
never blocks; the cost is one thread per stream and one thread hop per event.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio.to_thread

from .._concurrency import LoopBridge

__all__ = ("EventWaiter", "Synchronizable")

log = logging.getLogger(__name__)


class Synchronizable(Protocol):
    """What the waiter blocks on: a CUDA event (torch or CuPy) or anything alike."""

    def synchronize(self) -> object: ...


@dataclass(slots=True)
class _Watch:
    events: Sequence[Synchronizable]
    on_event: Callable[[int], None]
    on_done: Callable[[BaseException | None], None]
    bridge: LoopBridge
    keepalive: object
    """Buffers the copy reads until its last event (page-id arrays): freed after it."""


class EventWaiter:
    """A thread that waits for the events of one stream, in submission order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Watch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def watch(self, events: Sequence[Synchronizable], *, on_event: Callable[[int], None],
              on_done: Callable[[BaseException | None], None], keepalive: object = None) -> None:
        """After each event, call ``on_event(i)`` on the running loop; after the last (or on
        the first error), ``on_done(exc)``. Events must be in their stream's order."""
        if self._closed:
            raise RuntimeError("event waiter is closed")
        self._queue.put(_Watch(events, on_event, on_done, LoopBridge(), keepalive))

    async def aclose(self) -> None:
        """Wait for the watched events, then stop the thread (idempotent).

        Cancellation: the thread still finishes its queue and stops; only the wait ends.
        """
        self.close()
        await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    def close(self) -> None:
        """Take no more watches; the thread stops once it has waited for those queued."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _run(self) -> None:
        while (watch := self._queue.get()) is not None:
            error: BaseException | None = None
            try:
                for i, event in enumerate(watch.events):
                    event.synchronize()
                    watch.bridge.call_soon(watch.on_event, i)
            except Exception as exc:  # a CUDA fault: reported through on_done, never lost
                log.exception("waiting for a copy failed")
                error = exc
            watch.bridge.call_soon(watch.on_done, error)
