"""Event-loop lag: how late a short sleep on the loop wakes up while other work runs.

    async with LoopLagProbe() as probe:
        ...work whose effect on the loop we want to see...
    print(probe.summary())    # LagSummary(samples=..., p50_ms=..., p99_ms=..., max_ms=...)
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import numpy as np

from .errors import ConfigError

__all__ = ("GcPauses", "LagSummary", "LoopLagProbe")


@dataclass(frozen=True, slots=True)
class LagSummary:
    """Wake-up delays of the probe's sleeps, in milliseconds (all 0.0 when `samples` is 0)."""

    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float


class LoopLagProbe:
    """Samples event-loop lag: a task sleeps `interval` seconds in a loop and records how much
    later than asked each sleep returned.

    A sample is ``actual - expected`` wake-up time, measured with `time.perf_counter` (not
    ``loop.time()``, which uvloop caches per loop iteration). A delay shows that something
    held the loop, or the GIL, or the CPU, for that long. Timers and thread wake-ups add a
    floor: an idle loop on a 2-core VM shows about 0.07 ms at p50 and 0.3 ms at p99.

    Use it as an async context manager; the probe runs while the block runs. A sleep that is
    overdue when the block ends counts with the delay so far, so a stall just before the end
    is not lost.
    """

    __slots__ = ("_due", "_interval", "_lags", "_task")

    def __init__(self, interval: float = 0.001) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not (
                math.isfinite(interval) and interval > 0):
            raise ConfigError(f"interval: must be a finite number of seconds > 0, "
                              f"got {interval!r}")
        self._interval = float(interval)
        self._lags: list[float] = []  # seconds
        self._due: float | None = None  # perf_counter() at which the current sleep should end
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LoopLagProbe {state}, {len(self._lags)} samples>"

    @property
    def running(self) -> bool:
        return self._task is not None

    @property
    def num_samples(self) -> int:
        return len(self._lags)

    async def __aenter__(self) -> Self:
        if self._task is not None:
            raise RuntimeError("the probe is already running")
        self._task = asyncio.create_task(self._run(), name="aiohicache-lag-probe")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        """Stop sampling.

        Cancellation: the probe task is cancelled first, so it never outlives the block; if
        this wait is cancelled, the task still ends on the loop's next iteration.
        """
        task, self._task = self._task, None
        if task is None:
            return
        self._record_overdue()
        task.cancel()
        # asyncio.wait, not `await task`: the task's CancelledError is ours to expect, while
        # a cancellation of this coroutine must still propagate.
        await asyncio.wait([task])

    async def _run(self) -> None:
        clock, interval = time.perf_counter, self._interval
        while True:
            self._due = clock() + interval
            await asyncio.sleep(interval)
            # Timers may fire a hair early (within the loop's clock resolution): clamp at 0.
            self._lags.append(max(0.0, clock() - self._due))
            self._due = None

    def _record_overdue(self) -> None:
        if self._due is not None and (late := time.perf_counter() - self._due) > 0:
            self._lags.append(late)
            self._due = None

    def summary(self) -> LagSummary:
        """p50, p99 and max of the samples so far (callable while running)."""
        if not self._lags:
            return LagSummary(samples=0, p50_ms=0.0, p99_ms=0.0, max_ms=0.0)
        ms = np.asarray(self._lags) * 1e3
        p50, p99 = np.percentile(ms, [50, 99])
        return LagSummary(samples=len(ms), p50_ms=float(p50), p99_ms=float(p99),
                          max_ms=float(ms.max()))


class GcPauses:
    """Records how long each garbage collection takes while the ``with`` block runs.

    Collections run on whichever thread allocates, and stop every thread that needs the GIL:
    a long one shows up as loop lag, and this tells it apart from other causes.
    """

    __slots__ = ("_pauses", "_start")

    def __init__(self) -> None:
        self._pauses: list[float] = []  # seconds
        self._start: float | None = None

    def __enter__(self) -> Self:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._pauses.append(time.perf_counter() - self._start)
            self._start = None

    @property
    def count(self) -> int:
        return len(self._pauses)

    @property
    def max_ms(self) -> float:
        return max(self._pauses, default=0.0) * 1e3
