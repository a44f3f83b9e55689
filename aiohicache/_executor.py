"""Executors: how a request operation runs, so each request path is written once.

A request operation is a synchronous function ``fn(op) -> Plan | AGAIN``: it changes the
cache state at once and returns the copies it planned (or AGAIN: it cannot finish yet, e.g.
the pool frees pages only when a write-back settles). The executor decides *when* it runs
and how its copies start:

- `LocalExecutor` (one rank) runs it now, re-runs it whenever the cache has news (a copy
  settled, a prefetch finished) or its deadline passes, then queues its copies on the
  controller's channels (backpressure, merging).
- `TickExecutor` (tensor parallelism) hands it to the consensus tick, which runs it on every
  rank at the same agreed point and launches its copies there, in the same order everywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio

from ._concurrency import Pulse
from .controller import AGAIN, Consensus, Controller, Op, _Job

__all__ = ("AGAIN", "Executor", "LocalExecutor", "Op", "Plan", "TickExecutor")

T = TypeVar("T")


@dataclass(slots=True)
class Plan(Generic[T]):
    """What an operation did: its `result`, and the copies it planned (to start now)."""

    result: T
    jobs: list[_Job] = field(default_factory=list)



class Executor(Protocol):
    async def call(self, fn: Callable[[Op], Plan[T]],
                   undo: Callable[[T], None] | None = None) -> T:
        """Run the operation `fn` and start its copies; return its result.

        Cancellation: an operation that has run stays done and its copies start; `undo`
        (if given) then reverses its effect on the caller's behalf, and the cancellation
        propagates.
        """

    def post(self, fn: Callable[[], None]) -> None:
        """Run a release nobody waits for (with TP: at the next tick)."""

    async def abandon(self, fn: Callable[[Op], Plan[T]],
                      undo: Callable[[T], None] | None = None) -> None:
        """The call to `fn` was cancelled before it reached the executor: with TP, make it
        and cancel it (the ranks the cancellation reached later have made it); else nothing."""


class LocalExecutor:
    """Runs operations on this event loop, as soon as they can finish."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._news = Pulse()

    def kick(self) -> None:
        """Something changed that may let a waiting operation finish."""
        self._news.fire()

    async def call(self, fn: Callable[[Op], Plan[T]],
                   undo: Callable[[T], None] | None = None) -> T:
        op = Op(fn, undo)
        while True:
            seen = self._news.generation  # a kick while `fn` runs is not missed
            plan = fn(op)
            if plan is not AGAIN:
                break
            await self._wait(seen, op)
        try:
            await self.controller.submit_all(plan.jobs)
        except BaseException:
            if undo is not None:
                undo(plan.result)
            raise
        return plan.result

    async def _wait(self, seen: int, op: Op) -> None:
        """Until news or `op.deadline`; past the deadline the operation must finish."""
        left = math.inf if op.deadline is None else op.deadline - time.monotonic()
        with anyio.move_on_after(left):
            await self._news.wait(since=seen)
        if op.deadline is not None and time.monotonic() >= op.deadline:
            op.stop = True

    def post(self, fn: Callable[[], None]) -> None:
        fn()

    async def abandon(self, fn: Callable[[Op], Plan[T]],
                      undo: Callable[[T], None] | None = None) -> None:
        return


class TickExecutor:
    """Runs operations through the consensus tick: on every rank, at the same point."""

    def __init__(self, consensus: Consensus, controller: Controller) -> None:
        self.consensus = consensus
        self.controller = controller

    def _at_tick(self, fn: Callable[[Op], Plan[T]]) -> Callable[[Op], Any]:
        def at_tick(op: Op) -> Any:
            plan = fn(op)
            if plan is AGAIN:
                return AGAIN
            for job in plan.jobs:  # launch order = plan order, the same on every rank
                self.controller.launch_now(job)
            return plan.result
        return at_tick

    async def call(self, fn: Callable[[Op], Plan[T]],
                   undo: Callable[[T], None] | None = None) -> T:
        result: T = await self.consensus.call(self._at_tick(fn), undo)
        return result

    async def abandon(self, fn: Callable[[Op], Plan[T]],
                      undo: Callable[[T], None] | None = None) -> None:
        if not self.consensus.finished.done():
            await self.consensus.withdraw(self.consensus.submit(self._at_tick(fn), undo))

    def post(self, fn: Callable[[], None]) -> None:
        if self.consensus.finished.done():  # no more ticks: nothing to agree with
            fn()
            return
        ran = False

        def at_tick(op: Op) -> None:
            nonlocal ran
            ran = True
            fn()

        def unless_ran(_: object) -> None:
            if not ran:  # the tick failed first: releases still happen, here
                fn()
        self.consensus.post(at_tick).future.add_done_callback(unless_ran)
