"""The tensor-parallel consensus tick: how the ranks of one model make identical decisions.

Every rank runs its own `HiCache` over its shard of the KV. The ranks' trees, allocators and
counters must stay identical, yet their copies, reads and writes finish at different times.
So with ``tp_size > 1`` nothing changes the cache state except the *tick*:

- Request-path calls (fetch, allocate, commit, free, leaving a fetch context) are *ops*: the
  caller's coroutine appends a function to this rank's op log and awaits its result. The
  serving framework issues the same calls in the same order on every rank (as any TP scheduler
  does), so the logs are equal; they only grow at different speeds.
- One task per rank, the ticker, issues one collective per tick: a MIN all-reduce of a
  fixed-shape int64 vector (`_Layout`). It holds, per rank: the op log length, completed
  loads/writes counted from the oldest, prefetch and backup results (-1: not yet), prefetch stop
  votes, a failure flag, the breaker, a clock, and a digest of the state (MAX entries travel
  negated). The reduction is what every rank has: the ticker applies exactly that, in a fixed
  order, then runs the agreed number of ops from its log. State only changes there, so every
  rank goes through the same sequence of states.
- Whether a rank ticks again is decided from agreed values only (work in flight, ops some rank
  has queued), so all ranks issue the same number of collectives; no other code issues one.

See docs/tensor-parallel.md for the argument that this cannot deadlock.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from .._concurrency import Promise, Signal, finish_then_cancel
from .._stats import TPStats
from ..config import HiCacheConfig
from ..distributed import TPGroup
from ..errors import DivergenceError, HiCacheError, RankTimeoutError, TPError, WorkerError
from ._l3_parts import TP_SLOTS
from ._storage_tier import StorageTier
from ._transfers import Controller

__all__ = ("AGAIN", "Consensus", "Op")

log = logging.getLogger(__name__)

AGAIN: Any = object()
"""Returned by an op that cannot finish yet: it runs again at every tick until it does."""


class Op:
    """One request-path call in the op log; `fn(op)` runs at a tick and returns its result."""

    __slots__ = ("deadline", "fn", "future", "lazy", "stop", "submitted", "undo")

    def __init__(self, fn: Callable[[Op], Any], undo: Callable[[Any], None] | None, *,
                 lazy: bool = False) -> None:
        self.fn = fn
        self.undo = undo
        self.lazy = lazy
        """Nobody waits for it (a release): it rides along with the next tick."""
        self.future: Promise[Any] = Promise()
        self.deadline: float | None = None
        """Local monotonic time after which this rank votes to stop waiting (set by `fn`)."""
        self.stop = False
        """Set by the tick once any rank voted to stop: `fn` must then finish."""
        self.submitted = time.monotonic()


class _Layout:
    """Where each field sits in the tick vector (all reduced by MIN; MAX ones negated)."""

    TICK, NEG_TICK, OPS, NEG_OPS, LOADS, WRITES, NEG_FAILED, NEG_CLOCK, NEG_BYPASS = range(9)
    DIGEST = 9
    DIGEST_LEN = 6
    NEG_DIGEST = DIGEST + DIGEST_LEN
    CONFIG = NEG_DIGEST + DIGEST_LEN
    CONFIG_LEN = 3
    NEG_CONFIG = CONFIG + CONFIG_LEN
    STORAGE = NEG_CONFIG + CONFIG_LEN
    STOPS = STORAGE + 3 * TP_SLOTS
    SIZE = STOPS + TP_SLOTS


class Consensus:
    """The op log and the ticker of one TP cache (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, group: TPGroup, controller: Controller,
                 storage: StorageTier | None, digest: Callable[[], tuple[int, ...]]) -> None:
        self.config = config
        self.group = group
        self.controller = controller
        self.storage = storage
        self._digest = digest
        self._config = config_fingerprint(config, storage is not None)
        self._log: deque[Op] = deque()      # submitted, not yet run
        self._waiting: list[Op] = []        # ran, returned AGAIN; run again every tick
        self._news = Signal()
        self._urgent = 0                    # ops in the log that someone waits for
        self.ticks = 0
        self.tick_seconds = 0.0             # time spent in the collective, for stats
        self.closing = False
        self.finished: Promise[None] = Promise()
        self.on_tick: list[Callable[[int], None]] = []
        """Observers called after every applied tick with its number (tests, tracing)."""
        controller.kick = self.kick
        if storage is not None:
            storage.kick = self.kick

    # ------------------------------------------------------------------ the op log

    def kick(self) -> None:
        """Something happened that the next tick should report."""
        self._news.set()

    def submit(self, fn: Callable[[Op], Any], undo: Callable[[Any], None] | None = None, *,
               lazy: bool = False) -> Op:
        if self.finished.done():
            raise self._closed_error()
        op = Op(fn, undo, lazy=lazy)
        self._log.append(op)
        if not lazy:
            self._urgent += 1
            self.kick()
        return op

    async def call(self, fn: Callable[[Op], Any],
                   undo: Callable[[Any], None] | None = None) -> Any:
        """Run `fn` at the tick that every rank reaches with it in its log; return its result.

        Cancellation: the op still runs on every rank (the logs must stay equal). A cancelled
        caller's op is followed in the log by one that undoes it (`undo(result)`), or drops it
        if it is still waiting, so a cancellation issued at the same point on every rank leaves
        the same state everywhere; the cancellation propagates once a tick has run that
        (`withdraw`).
        """
        op = self.submit(fn, undo)
        try:
            return await op.future.wait()
        except anyio.get_cancelled_exc_class():
            await self.withdraw(op)
            raise

    async def withdraw(self, op: Op) -> None:
        """Undo (or drop) `op` by an op queued now, and wait until a tick has run that one.

        NOTE: the wait runs through cancellations: the caller's next calls read state that
        `op` changed (a context's cached pages, its partial page) without a tick, so when the
        caller goes on, `op` must have run on this rank as on every other one, wherever
        between the ticks the cancellation landed on each.
        """
        if self.finished.done():
            return
        cancel = self.submit(lambda _: self._cancel(op))
        await finish_then_cancel(cancel.future.settled())

    def post(self, fn: Callable[[Op], Any], *, lazy: bool = True) -> Op:
        """Queue `fn` without waiting for it (errors are logged: the caller has gone on).

        A lazy op starts no tick of its own: it runs, in log order, at the next tick that
        something else starts (releases between scheduler steps cost no extra collective).
        """
        op = self.submit(fn, lazy=lazy)
        op.future.add_done_callback(_log_failure)
        return op

    def _cancel(self, op: Op) -> None:
        if op in self._waiting:
            self._waiting.remove(op)
            op.future.cancel()
        elif op.future.done() and not op.future.cancelled() and op.future.exception() is None \
                and op.undo is not None:
            op.undo(op.future.result())

    def _run(self, op: Op) -> bool:
        """Run `op`; False if it must run again at the next tick."""
        try:
            result = op.fn(op)
        except Exception as exc:
            if not op.future.done():
                op.future.set_exception(exc)
            return True
        if result is AGAIN:
            return False
        if not op.future.done():
            op.future.set_result(result)
        return True

    # ------------------------------------------------------------------ the ticker

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
                  ) -> None:
        """The ticker task: tick while any rank has work, until closed or failed."""
        task_status.started()
        busy = False
        try:
            while True:
                await self._wait_for_news(busy)
                busy = await self.tick()
                if self.closing and not busy:
                    break
        except TPError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug: fail visibly, never leave callers waiting
            log.exception("the consensus tick failed")
            self._fail(WorkerError(f"the consensus tick failed: {exc!r}"))
        finally:
            if not self.finished.done():
                self.finished.set_result(None)
            self._fail_all(self._closed_error())
            if self.storage is not None:
                self.storage.tp_stop()

    async def _wait_for_news(self, busy: bool) -> None:
        if busy:  # some rank has work in flight: tick at least every interval
            with anyio.move_on_after(self.config.tp.tick_interval):
                await self._news.wait()
            self._news.clear()
            return
        # Idle everywhere: only a call of our own that someone awaits starts a tick (a late
        # completion signal must not, or this rank would wait alone in the collective).
        while not self._urgent:
            await self._news.wait()
            self._news.clear()

    async def tick(self) -> bool:
        """One consensus tick: reduce, check, apply. Returns whether work remains anywhere."""
        local = self._vector()
        start = time.perf_counter()
        agreed = await self.group.all_reduce_min(local)
        self.tick_seconds += time.perf_counter() - start
        self._check(agreed)
        self._apply(agreed)
        self._check_lagging()
        self.ticks += 1
        for observer in self.on_tick:
            observer(self.ticks)
        return self._busy(agreed)

    def _vector(self) -> np.ndarray:
        L = _Layout
        v = np.full(L.SIZE, -1, dtype=np.int64)
        v[L.TICK], v[L.NEG_TICK] = self.ticks, -self.ticks
        v[L.OPS], v[L.NEG_OPS] = len(self._log), -len(self._log)
        v[L.LOADS], v[L.WRITES] = self.controller.local_done()
        v[L.NEG_FAILED] = -int(self._failed_here())
        v[L.NEG_CLOCK] = -int(time.time() * 1000)
        digest = self._digest()
        v[L.DIGEST:L.DIGEST + L.DIGEST_LEN] = digest
        v[L.NEG_DIGEST:L.NEG_DIGEST + L.DIGEST_LEN] = [-d for d in digest]
        v[L.CONFIG:L.NEG_CONFIG] = self._config
        v[L.NEG_CONFIG:L.STORAGE] = [-c for c in self._config]
        if self.storage is not None:
            v[L.NEG_BYPASS] = -int(self.storage.tp_local_bypass())
            v[L.STORAGE:L.STOPS] = self.storage.tp_proposals()
        now = time.monotonic()
        v[L.STOPS:] = 0
        for i, (_, deadline) in enumerate(self._voters()):
            v[L.STOPS + i] = -int(now >= deadline)
        return v

    def _failed_here(self) -> bool:
        """This rank failed, or one of its copies finished with an error. NOTE: reported
        before that copy is settled (which records the failure on this rank only), so every
        rank refuses work from the same tick on."""
        ctl = self.controller
        return ctl.failure is not None or any(
            job.handle is not None and job.handle.exception() is not None
            for job in ctl.inflight_jobs())

    def _voters(self) -> list[tuple[Op, float]]:
        """The oldest waiting ops with a deadline: one stop-vote slot each."""
        return [(op, op.deadline) for op in self._waiting if op.deadline is not None][:TP_SLOTS]

    def _check(self, agreed: np.ndarray) -> None:
        L = _Layout
        if agreed[L.TICK] != -agreed[L.NEG_TICK]:
            raise DivergenceError(f"ranks are at different ticks ({agreed[L.TICK]}.."
                                  f"{-agreed[L.NEG_TICK]}): a collective was issued elsewhere")
        differ = [name for i, name in enumerate(_CONFIG_GROUPS)
                  if agreed[L.CONFIG + i] != -agreed[L.NEG_CONFIG + i]]
        if differ:
            raise DivergenceError(
                f"rank {self.group.rank}: the ranks' configs differ in {', '.join(differ)}: "
                "every rank of a TP group needs the same page size, capacities, policies and "
                "storage settings (free to differ: tp_rank, device, the storage location, "
                "io_backend, transfer_ctas, tp_timeout, tp_tick_interval, "
                "max_worker_restarts, and host_layout for MHA; docs/tensor-parallel.md)")
        low = agreed[L.DIGEST:L.DIGEST + L.DIGEST_LEN]
        high = -agreed[L.NEG_DIGEST:L.NEG_DIGEST + L.DIGEST_LEN]
        if not np.array_equal(low, high):
            raise DivergenceError(
                f"rank {self.group.rank}: cache states differ across ranks at tick {self.ticks} "
                f"(digest min {low.tolist()} max {high.tolist()}): the ranks' request-path "
                "calls were not the same sequence")

    def _check_lagging(self) -> None:
        """A rank that ticks but never makes our call is as bad as one that is gone."""
        oldest = next((op for op in self._log if not op.lazy), None)
        if oldest is not None and time.monotonic() - oldest.submitted > self.group.timeout:
            raise RankTimeoutError(
                f"rank {self.group.rank}/{self.group.size}: a call made here "
                f"{time.monotonic() - oldest.submitted:.1f} s ago was not made by every "
                "rank within the consensus tick timeout (a rank is stuck or its calls differ)")

    def _apply(self, agreed: np.ndarray) -> None:
        L, ctl = _Layout, self.controller
        ctl.apply_done(int(agreed[L.LOADS]), int(agreed[L.WRITES]))
        if agreed[L.NEG_FAILED] < 0 and ctl.failure is None:
            ctl.failure = WorkerError("a transfer failed on a rank of the group; every rank "
                                      "stops serving so the ranks stay identical")
        if self.storage is not None:
            self.storage.agreed_now = -int(agreed[L.NEG_CLOCK]) / 1000
            self.storage.agreed_bypass = bool(agreed[L.NEG_BYPASS] < 0)
            self.storage.tp_apply([int(x) for x in agreed[L.STORAGE:L.STOPS]])
        for i, (op, _) in enumerate(self._voters()):
            op.stop = op.stop or bool(agreed[L.STOPS + i] < 0)
        self._waiting = [op for op in self._waiting if not self._run(op)]
        for _ in range(int(agreed[L.OPS])):
            op = self._log.popleft()
            self._urgent -= not op.lazy
            if not self._run(op):
                self._waiting.append(op)

    def _busy(self, agreed: np.ndarray) -> bool:
        """Whether any rank has work left: computed from agreed state only, so every rank
        reaches the same answer and issues the same number of collectives."""
        L = _Layout
        if -agreed[L.NEG_OPS] > agreed[L.OPS] or self._waiting:
            return True
        if self.controller.inflight_jobs():
            return True
        return self.storage is not None and not self.storage.idle

    # ------------------------------------------------------------------ closing and failure

    def close_op(self, _op: Op) -> None:
        """The op that closes: after it, the ranks tick until no work is left, then stop."""
        self.closing = True

    def _fail(self, exc: HiCacheError) -> None:
        log.error("tensor-parallel consensus failed; the cache stops serving: %s", exc)
        if self.controller.failure is None or not isinstance(self.controller.failure, TPError):
            self.controller.failure = exc
        self._fail_all(exc)

    def _fail_all(self, exc: HiCacheError) -> None:
        for op in [*self._waiting, *self._log]:
            if not op.future.done():
                op.future.set_exception(exc)
        self._waiting.clear()
        self._log.clear()
        self._urgent = 0

    def _closed_error(self) -> HiCacheError:
        failure = self.controller.failure
        if isinstance(failure, HiCacheError):
            return type(failure)(str(failure))
        return TPError("the consensus tick has stopped (the cache is closed)")

    def stats(self) -> TPStats:
        return TPStats(ticks=self.ticks, tick_us_mean=(
            self.tick_seconds / self.ticks * 1e6 if self.ticks else math.nan))


_CONFIG_GROUPS = ("pages and capacities (page_size, device_pages, host pages, spec layers, "
                  "tp_size)",
                  "policies (eviction, write_policy, thresholds, max_inflight_*)",
                  "storage (present or not, prefetch_*, storage_*, backup_*; MLA: namespace, "
                  "spec, host_layout)")


def config_fingerprint(config: HiCacheConfig, has_storage: bool) -> list[int]:
    """One number per group of `_CONFIG_GROUPS`: the settings every rank's decisions depend
    on. NOTE: a difference there changes no state digest at once (a policy acts only when it
    evicts), so the ranks would drift apart later, far from the cause; the first tick names it.
    """
    c, s, t = config, config.l3, config.transfer
    groups = (
        (c.page_size, c.device_pages, c.host_capacity_pages, c.spec.kind, c.spec.num_layers,
         c.tp_size),
        (c.eviction, t.write_policy, t.hit_threshold, t.load_back_threshold,
         t.max_inflight_loads, t.max_inflight_writes),
        (has_storage, s.prefetch_policy, s.prefetch_threshold, s.prefetch_timeout_base,
         s.prefetch_timeout_per_1k_tokens, s.prefetch_timeout_max, s.prefetch_host_fraction,
         s.miss_ttl, s.miss_max_entries, s.backup_threshold, s.backup_max_inflight_bytes,
         s.failures_to_open, s.cooldown, _shared_page_identity(config, has_storage)),
    )
    return [int.from_bytes(hashlib.blake2b(repr(g).encode(), digest_size=7).digest(), "little")
            for g in groups]


def _shared_page_identity(config: HiCacheConfig, has_storage: bool) -> tuple[str, ...]:
    """What names an L3 page that every rank reads: MLA ranks share their pages (one rank
    writes each), so their keys must be equal. NOTE: ranks differing in `host_layout` (or
    namespace) chained other keys: each found only the pages it wrote itself, and a prefetch
    (MIN over the ranks) found almost nothing, silently. MHA ranks read their own shard."""
    if not has_storage or config.spec.kind != "mla":
        return ()
    return (config.namespace, config.spec.fingerprint(), config.host_layout)


def _log_failure(future: Promise[Any]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("a queued cache call failed: %r", exc)
