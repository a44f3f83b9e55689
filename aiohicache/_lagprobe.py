"""Event-loop lag: how late a short sleep on the loop wakes up while other work runs.

    async with LoopLagProbe() as probe:
        ...work whose effect on the loop we want to see...
    print(probe.summary())    # LagSummary(samples=..., p50_ms=..., p99_ms=..., max_ms=...)
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Self

import anyio
import numpy as np
from anyio.abc import TaskGroup

from ._validate import check_number

__all__ = ("GcPauses", "LagSummary", "LoopLagProbe", "Stall", "StallSampler", "idle_floor",
           "quiet_runtime")


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
        self._interval = check_number("interval", interval, low=0, low_open=True)
        self._lags: list[float] = []  # seconds
        self._due: float | None = None  # perf_counter() at which the current sleep should end
        self._task = _Background("aiohicache-lag-probe")

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LoopLagProbe {state}, {len(self._lags)} samples>"

    @property
    def running(self) -> bool:
        return self._task.running

    @property
    def num_samples(self) -> int:
        return len(self._lags)

    async def __aenter__(self) -> Self:
        if self._task.running:
            raise RuntimeError("the probe is already running")
        await self._task.start(self._run)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        """Stop sampling.

        Cancellation: the probe task is cancelled first and waited for (it ends at once),
        so it never outlives the block.
        """
        if self._task.running:
            self._record_overdue()
        await self._task.stop(exc)

    async def _run(self) -> None:
        clock, interval = time.perf_counter, self._interval
        while True:
            self._due = due = clock() + interval
            await anyio.sleep(interval)
            if self._due is None:
                # The block ended while this wake-up was already queued (a cancel scope
                # cancels a task at its next wait): `__aexit__` has accounted for it.
                return
            # Timers may fire a hair early (within the loop's clock resolution): clamp at 0.
            self._lags.append(max(0.0, clock() - due))
            self._due = None

    def _record_overdue(self) -> None:
        """At the end of the block: count the sleep in progress if it is already late."""
        due, self._due = self._due, None
        if due is not None and (late := time.perf_counter() - due) > 0:
            self._lags.append(late)

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


@dataclass(frozen=True, slots=True)
class Stall:
    """One time the loop thread held on to one callback for longer than the threshold."""

    ms: float
    """How long the loop had not come back to the probe when the stack was taken."""
    stack: tuple[str, ...]
    """``file:line function`` of the loop thread, innermost last (the project's frames and
    the one that called into a library; ``"gc"`` marks a collection)."""


class StallSampler:
    """Finds where loop stalls come from: a watchdog thread looks at the loop every
    `poll` seconds and, when the loop has not run its heartbeat for `threshold` seconds,
    records the loop thread's stack (`sys._current_frames`). Garbage collections that take
    longer than `threshold` are recorded too, with the stack that triggered them.

        async with StallSampler(threshold=0.002) as sampler:
            ...
        print(sampler.report())   # the most frequent stacks, with total and max stall

    A diagnosis tool (``aiohicache replay --stalls MS``): the watchdog
    takes the GIL every `poll`, so it adds a little lag of its own.
    """

    __slots__ = ("_beat", "_gc_start", "_loop_thread", "_poll", "_stop", "_task", "_thread",
                 "_threshold", "stalls")

    def __init__(self, threshold: float = 0.002, poll: float = 0.0005) -> None:
        self._threshold, self._poll = threshold, poll
        self._beat = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task = _Background("aiohicache-stall-beat")
        self._loop_thread = threading.get_ident()
        self._gc_start: float | None = None
        self.stalls: list[Stall] = []

    async def __aenter__(self) -> Self:
        self._loop_thread = threading.get_ident()
        self._beat = time.perf_counter()
        await self._task.start(self._heartbeat)
        self._thread = threading.Thread(target=self._watch, name="aiohicache-stall-watch",
                                        daemon=True)
        self._thread.start()
        gc.callbacks.append(self._gc_callback)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        """Stop watching. Cancellation: the heartbeat task is cancelled and waited for."""
        gc.callbacks.remove(self._gc_callback)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # at most one `poll`: it waits on `_stop`
        await self._task.stop(exc)

    async def _heartbeat(self) -> None:
        clock, poll = time.perf_counter, self._poll
        while True:
            self._beat = clock() + poll  # when the loop should be back
            await anyio.sleep(poll)

    def _watch(self) -> None:
        sampled_beat = None
        while not self._stop.wait(self._poll):
            beat = self._beat
            late = time.perf_counter() - beat
            # One sample per stall, taken once it is already longer than the threshold.
            if late > self._threshold and beat != sampled_beat and self._gc_start is None:
                frame = sys._current_frames().get(self._loop_thread)
                if frame is not None:
                    sampled_beat = beat
                    self.stalls.append(Stall(ms=late * 1e3, stack=_stack(frame)))

    def _gc_callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            took = time.perf_counter() - self._gc_start
            self._gc_start = None
            if took > self._threshold:
                frame = sys._getframe(1)
                self.stalls.append(Stall(ms=took * 1e3, stack=(
                    *_stack(frame), f"gc gen {info.get('generation')}")))

    def report(self, top: int = 12) -> str:
        """The `top` stacks by total stall time: count, total and max ms, then the stack."""
        groups: dict[tuple[str, ...], list[float]] = {}
        for stall in self.stalls:
            groups.setdefault(stall.stack, []).append(stall.ms)
        rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
        lines = [f"{len(self.stalls)} stalls > {self._threshold * 1e3:g} ms"]
        for stack, ms in rows:
            lines.append(f"  {len(ms):>5} x  total {sum(ms):8.1f} ms  max {max(ms):7.1f} ms")
            lines.extend(f"        {entry}" for entry in stack[-8:])
        return "\n".join(lines)


def _stack(frame: FrameType | None) -> tuple[str, ...]:
    """The stack of `frame`, outermost first, without the event loop's own frames."""
    entries = []
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if "asyncio" not in name or "aiohicache" in name:
            short = name.rsplit("site-packages/", 1)[-1].rsplit("/work/main/", 1)[-1]
            entries.append(f"{short}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(reversed(entries))


SWITCH_INTERVAL = 0.0005
"""Seconds a thread may hold the GIL while another waits for it (CPython's default: 0.005)."""


@contextlib.contextmanager
def quiet_runtime(switch_interval: float = SWITCH_INTERVAL) -> Iterator[None]:
    """Process settings that keep the loop's stalls short, as a server sets them after start-up
    (`docs/performance.md`); restored on exit.

    - ``gc.freeze()`` after one collection: otherwise each full collection walks every object
      torch and numpy made at import (about 70-130 ms on a 2-core VM); not if the process
      froze objects before (its freeze is left as it is);
    - ``sys.setswitchinterval(switch_interval)``: every GIL release on the loop thread (a
      torch call, a large hash, a read) lets a worker thread running Python (the file store,
      the copy threads' page bookkeeping) keep the GIL for up to this long before the loop
      gets it back: 5 ms by default, which was the loop-lag p99;
    - no automatic full (generation 2) collection: what the run creates is still tracked
      (the file store's index holds one tuple per page), and a full pass over it took
      10-70 ms; young generations are still collected, and one full collection runs on exit.
    """
    old_switch, old_threshold = sys.getswitchinterval(), gc.get_threshold()
    # NOTE: gc has one frozen set: unfreezing it on exit would also undo a freeze the
    # process made before (a server's, after its start-up), so that one is left as it is
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.collect()
        gc.freeze()
    sys.setswitchinterval(switch_interval)
    gc.set_threshold(old_threshold[0], old_threshold[1], 1 << 30)
    try:
        yield
    finally:
        sys.setswitchinterval(old_switch)
        gc.set_threshold(*old_threshold)
        if ours:
            gc.unfreeze()
        gc.collect()


async def idle_floor(seconds: float) -> LagSummary:
    """The probe's lag while the loop has nothing else to do: what the machine (timers, other
    processes on the cores) costs, measured beside a run to compare against it."""
    async with LoopLagProbe() as probe:
        await anyio.sleep(seconds)
    return probe.summary()


class _Background:
    """One task that runs beside an ``async with`` block of the task that starts it, in a
    task group entered by `start` and left by `stop` (an ``__aenter__``/``__aexit__`` pair
    of that same task, so the cancel scopes nest)."""

    __slots__ = ("_name", "_tg")

    def __init__(self, name: str) -> None:
        self._name = name
        self._tg: TaskGroup | None = None

    @property
    def running(self) -> bool:
        return self._tg is not None

    async def start(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        tg.start_soon(fn, name=self._name)
        self._tg = tg

    async def stop(self, exc: BaseException | None) -> None:
        """Cancel the task and wait for it; never swallows the block's exception.

        NOTE: the block's exception is handed to the task group only when it is a
        cancellation (anyio's scopes account for it); any other is left to propagate as
        itself, where the task group would wrap it in an exception group.
        """
        tg, self._tg = self._tg, None
        if tg is None:
            return
        tg.cancel_scope.cancel()
        cancel = exc if isinstance(exc, anyio.get_cancelled_exc_class()) else None
        await tg.__aexit__(type(cancel) if cancel else None, cancel,
                           cancel.__traceback__ if cancel else None)
