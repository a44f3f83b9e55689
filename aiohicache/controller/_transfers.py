"""The controller: plans transfers on the tree, runs them through workers, settles them.

Three workers share one task group:

- the load worker takes load-back jobs from a bounded channel, merges what is queued into one
  host->device copy and launches it;
- the write worker does the same for device->host copies (write-through and write-back);
- the settle worker applies finished copies to the tree at one point, `settle()`, in
  submission order, so every tree mutation caused by a transfer happens there and nowhere else.

With tensor parallelism (`tp=True`) the settle worker only reports news: the consensus tick
reads `local_done()` from every rank and calls `apply_done()` with the agreed (MIN) counts, and
planned jobs are launched at once (`launch_now`) so every rank settles them in the same order.

Planning (`plan_load`, `plan_write_through`, `alloc_device`) is synchronous: it mutates the
tree and the allocators before any await, then the job goes to a worker.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._concurrency import Pulse, Signal, supervise
from ..config import HiCacheConfig
from ..errors import TPError, TransferError, WorkerError
from ..memory import PageIds
from ..radix import DeviceState, Match, Node, RadixTree
from ..transfer import TransferEngine, TransferHandle
from ..transfer._base import write_after
from ._jobs import LoadJob, TransferCounters, WriteJob, _concat, _Job, leading_done, take_queued
from ._storage_tier import StorageTier

__all__ = ("Controller",)

log = logging.getLogger(__name__)


J = TypeVar("J", bound=_Job)


class Controller:
    """Owns the tree's transfers: planning, the worker task group and settling."""

    def __init__(self, config: HiCacheConfig, tree: RadixTree, engine: TransferEngine, *,
                 storage: StorageTier | None = None, tp: bool = False) -> None:
        self.config = config
        self.tree = tree
        self.engine = engine
        self.storage = storage
        self.counters = TransferCounters()
        self.failure: BaseException | None = None
        self.tp = tp
        self.kick: Callable[[], None] = lambda: None  # TP: tells the consensus tick of news
        self._load_tx, self._load_rx = anyio.create_memory_object_stream[LoadJob](
            config.transfer.max_inflight_loads)
        self._write_tx, self._write_rx = anyio.create_memory_object_stream[WriteJob](
            config.transfer.max_inflight_writes)
        self._loads: deque[LoadJob] = deque()    # launched, in launch order
        self._writes: deque[WriteJob] = deque()
        self._queued = 0                          # jobs sent but not yet launched
        self._unsettled: dict[int, _Job] = {}     # every planned job until it settles
        self._wakeup = Signal()                  # a copy finished: settle
        self._settled = Pulse()                  # fired by every settle that applied something
        self._room = Pulse()                     # fired when a worker empties its channel
        self.demoting_pages = 0                   # device pages freed when write-backs settle

    # ------------------------------------------------------------------ state

    @property
    def pending_loads(self) -> int:
        """Load jobs planned and not yet settled (queued or in flight)."""
        return sum(isinstance(j, LoadJob) for j in self._unsettled.values())

    @property
    def pending_writes(self) -> int:
        """Write jobs planned and not yet settled (queued or in flight)."""
        return sum(isinstance(j, WriteJob) for j in self._unsettled.values())

    @property
    def idle(self) -> bool:
        return not self._loads and not self._writes and self._queued == 0

    def inflight_jobs(self) -> list[_Job]:
        """Every planned job not yet settled (queued or launched)."""
        return list(self._unsettled.values())

    def check_healthy(self) -> None:
        if isinstance(self.failure, TPError):
            raise type(self.failure)(str(self.failure)) from self.failure
        if self.failure is not None:
            raise WorkerError(f"the cache failed and refuses work: {self.failure!r}") \
                from self.failure

    # ------------------------------------------------------------------ planning (sync)

    def plan_load(self, match: Match) -> LoadJob | None:
        """Mark the host-only tail of `match` LOADING, as far as device pages allow.

        The caller has pinned the device prefix. Loads are page-granular: when the device
        cannot hold the whole tail, the node that does not fit is split and its head loaded.
        """
        tail = match.host_nodes
        if not tail or match.num_host_pages * self.tree.page_size < max(
                1, self.config.transfer.load_back_threshold):
            return None
        for node in tail:  # keep host eviction (write-back staging) off what we load
            self.tree.protect_host(node)
        job, staged = LoadJob(), self._write_back_op()
        try:
            self._begin_loads(tail, job, staged)
        finally:
            for node in tail:
                if node.alive:
                    self.tree.release_host(node)
        self._submit_staged(staged)
        if not job.nodes:
            return None
        job.seal()
        return job

    def _begin_loads(self, tail: list[Node], job: LoadJob, staged: WriteJob | None) -> None:
        for node in tail:
            if self.tree.begin_load(node, job, write_back=staged):
                continue
            room = self.tree.device_alloc.num_free
            if 0 < room < node.num_pages:
                head = self.tree.split(node, room)  # head inherits plan_load's host pin
                self.tree.begin_load(head, job)
                self.tree.release_host(head)
            break

    def plan_write_through(self, last: Node | None) -> WriteJob | None:
        """Start write-through for nodes on the path to `last` that reached the hit threshold."""
        if self.config.transfer.write_policy == "write_back" or last is None:
            return None
        job: WriteJob | None = None
        threshold = self.config.transfer.hit_threshold
        for node in reversed(last.path_to_root()):
            if node.on_host:
                continue
            if node.device_state is not DeviceState.RESIDENT or node.hit_count < threshold:
                break
            job = job or WriteJob()
            if not self.tree.begin_write(node, job):
                break
        if job is None or not job.nodes:
            return None
        job.seal()
        return job

    def alloc_device(self, num_pages: int) -> PageIds | None:
        """Device pages for new KV, evicting (or, in write-back mode, staging) leaves."""
        staged = self._write_back_op()
        pages = self.tree.alloc_device(num_pages, write_back=staged)
        self._submit_staged(staged)
        return pages

    def _write_back_op(self) -> WriteJob | None:
        return WriteJob(demote=True) if self.config.transfer.write_policy == "write_back" else None

    def _submit_staged(self, staged: WriteJob | None) -> None:
        if staged is None or not staged.nodes:
            return
        staged.seal()
        self.demoting_pages += staged.num_pages
        if self.tp:
            self.launch_now(staged)
            return
        self._unsettled[id(staged)] = staged
        self._queued += 1
        try:
            self._write_tx.send_nowait(staged)
        except anyio.WouldBlock:
            # NOTE: staging happens inside sync planning, which cannot wait; launch directly
            # so the staged pages are never stranded (the channel bound is advisory here).
            self._queued -= 1
            self._launch_writes([staged])

    # ------------------------------------------------------------------ submission (async)

    def launch_now(self, job: _Job | None) -> None:
        """Launch a planned job at once, bypassing the channels (TP: launch order = plan order,
        which is the same on every rank, so settling in launch order is too)."""
        if job is None:
            return
        self._unsettled[id(job)] = job
        if isinstance(job, LoadJob):
            self._launch_loads([job])
        else:
            self._launch_writes([job])

    async def submit_load(self, job: LoadJob) -> None:
        """Queue a planned load, waiting while the channel is full (backpressure).

        Cancellation: the job is launched at once, past the channel, and the cancellation
        propagates without waiting for room.
        """
        await self._send(self._load_tx, job)

    async def submit_write(self, job: WriteJob) -> None:
        """Queue a planned write; like `submit_load`."""
        await self._send(self._write_tx, job)

    async def submit_all(self, jobs: Sequence[_Job]) -> None:
        """Queue planned jobs in order (see `submit_load`).

        Cancellation: this job and every later one are launched at once, past the channels,
        so no planned node is stranded; then the cancellation propagates.
        """
        for i, job in enumerate(jobs):
            try:
                if isinstance(job, LoadJob):
                    await self.submit_load(job)
                elif isinstance(job, WriteJob):
                    await self.submit_write(job)
            except BaseException:
                for rest in jobs[i + 1:]:
                    self.launch_now(rest)
                raise

    async def _send(self, tx: MemoryObjectSendStream[J], job: J) -> None:
        # The job's nodes are already in a transitional state: it must reach a worker even if
        # the caller is cancelled, or they would stay LOADING/WRITING for ever. send_nowait
        # either queues it or not (anyio's send() may deliver and still raise Cancelled), so
        # a cancelled wait for room knows the job is ours to launch.
        self._queued += 1
        self._unsettled[id(job)] = job
        try:
            while True:
                try:
                    tx.send_nowait(job)
                    return
                except anyio.WouldBlock:
                    await self._room.wait()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._launch_unqueued(job)  # closing: nobody else will launch it; aclose() drains
        except BaseException:
            self._launch_unqueued(job)  # cancelled while waiting for room
            raise

    def _launch_unqueued(self, job: _Job) -> None:
        self._queued -= 1
        launch = self._launch_loads if isinstance(job, LoadJob) else self._launch_writes
        launch([job])

    # ------------------------------------------------------------------ workers

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run the workers until cancelled; a crashing worker is restarted a few times."""
        async with anyio.create_task_group() as tg:
            if self.storage is not None:
                self.storage.start(tg)  # prefetch and backup tasks live in this group
            tg.start_soon(self._supervise, "load", self._load_worker)
            tg.start_soon(self._supervise, "write", self._write_worker)
            tg.start_soon(self._supervise, "settle", self._settle_worker, 0)
            task_status.started()

    async def _supervise(self, name: str, worker: Callable[[], Awaitable[None]],
                         max_restarts: int | None = None) -> None:
        """Run `worker`, restarting it after a crash up to `max_restarts` times (default:
        the config's), then fail the cache.

        The settle worker gets no restart: a crash inside `settle` leaves a job half applied
        (nodes LOADING/WRITING for good), so the cache must stop serving, visibly.
        """
        limit = self.config.transfer.max_worker_restarts if max_restarts is None else max_restarts

        def restarted() -> None:
            self.counters.worker_restarts += 1
        await supervise(f"{name} worker", worker, limit=limit, on_restart=restarted,
                        on_give_up=self.fail)

    def fail(self, exc: BaseException) -> None:
        """Stop serving for good: later calls raise; waiters for settles and operations
        waiting for news (an allocate waiting for write-backs) wake up and raise."""
        if self.failure is None:
            self.failure = exc
        self._settled.fire()
        self.kick()

    async def _load_worker(self) -> None:
        await self._drain_channel(self._load_rx, self._launch_loads, self._loads)

    async def _write_worker(self) -> None:
        await self._drain_channel(self._write_rx, self._launch_writes, self._writes)

    async def _drain_channel(self, rx: MemoryObjectReceiveStream[J],
                             launch: Callable[[list[J]], None], inflight: deque[J]) -> None:
        limit = self.config.transfer.max_inflight_loads if rx is self._load_rx \
            else self.config.transfer.max_inflight_writes
        async for job in rx:
            batch = [job, *take_queued(rx)]  # merge whatever else is queued into one copy
            self._queued -= len(batch)
            try:
                self._room.fire()  # wake senders waiting for room
                launch(batch)
            except Exception as exc:
                self._launch_failed(batch, inflight, exc)
                raise  # the supervisor restarts this worker, or fails the cache
            while len(inflight) > limit:  # backpressure: the channel fills behind us
                await self.wait_settled()

    def _launch_failed(self, batch: Sequence[_Job], inflight: deque[Any],
                       exc: Exception) -> None:
        """A worker crashed holding `batch`: the jobs it did not launch count as failed
        copies (fatal, as any failed copy: their pages' content is unknown).

        NOTE: left alone, they were in no channel and in flight nowhere: their nodes stayed
        LOADING/WRITING for good, `ready()` and `drain()` waited for ever, and the restarted
        worker never saw them.
        """
        lost = [job for job in batch if job.handle is None]
        if not lost:
            return

        def never_launched(src: PageIds, dst: PageIds) -> TransferHandle:
            raise TransferError(f"the copy was never launched: its worker crashed ({exc!r})")
        self._launch(lost, inflight, never_launched)

    def _launch_loads(self, batch: Sequence[_Job]) -> None:
        self._launch(batch, self._loads, self.engine.load)
        self.counters.load_merges += len(batch) - 1

    def _launch_writes(self, batch: Sequence[_Job]) -> None:
        fences = [job.fence for job in batch if isinstance(job, WriteJob)]
        self._launch(batch, self._writes,
                     lambda src, dst: write_after(self.engine, src, dst, fences))
        self.counters.write_merges += len(batch) - 1

    def _launch(self, batch: Sequence[_Job], inflight: deque[Any],
                start: Callable[[PageIds, PageIds], TransferHandle]) -> None:
        src = _concat([j.src for j in batch])
        dst = _concat([j.dst for j in batch])
        try:
            handle = start(src, dst)
        except Exception as exc:
            handle = TransferHandle(num_layers=1, nbytes=0)
            handle._finish(exc)
        handle.add_done_callback(lambda _: self._wakeup.set())
        for job in batch:
            job.handle = handle
            job.copy_pages = len(src)  # NOTE: each job timed its share, not the whole copy
            if not job.launched.done():
                job.launched.set_result(None)
            inflight.append(job)

    async def _settle_worker(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self.tp:  # with TP, the consensus tick settles what every rank finished
                self.settle()
            self.kick()  # tell the executor: waiting operations may finish now

    # ------------------------------------------------------------------ the completion point

    def settle(self) -> None:
        """Apply finished copies to the tree, oldest first. THE point where transfers mutate
        state (with TP, `apply_done` is called by the consensus tick instead)."""
        self.apply_done(*self.local_done())

    def local_done(self) -> tuple[int, int]:
        """Launched loads and writes finished here, counted from the oldest (no gaps)."""
        return leading_done(self._loads), leading_done(self._writes)

    def apply_done(self, num_loads: int, num_writes: int) -> None:
        """Settle the `num_loads` oldest loads and `num_writes` oldest writes."""
        for _ in range(num_loads):
            self._settle_load(self._loads.popleft())
        for _ in range(num_writes):
            self._settle_write(self._writes.popleft())
        if num_loads or num_writes:
            self._settled.fire()

    def _settle_load(self, job: LoadJob) -> None:
        assert job.handle is not None
        del self._unsettled[id(job)]
        if self._record_failure(job.handle):
            return
        for node in job.nodes:
            self.tree.end_load(node)
        self.counters.loads += 1
        self.counters.loaded_bytes += job.num_pages * self.config.page_bytes
        self.counters.histograms.observe_load(job.num_pages * self.config.page_bytes,
                                              job.seconds)

    def _settle_write(self, job: WriteJob) -> None:
        assert job.handle is not None
        del self._unsettled[id(job)]
        if job.demote:  # settled either way: nobody may wait for these pages any more
            self.demoting_pages -= job.num_pages
        if self._record_failure(job.handle):
            return
        for node in job.nodes:
            self.tree.end_write(node, demote=job.demote)
        if self.storage is not None:
            self.storage.queue_backup(job.nodes)
        self.counters.writes += 1
        self.counters.written_bytes += job.num_pages * self.config.page_bytes
        self.counters.histograms.observe_store(job.num_pages * self.config.page_bytes,
                                               job.seconds)

    def _record_failure(self, handle: TransferHandle) -> bool:
        # A failed copy between L1 and L2 leaves KV of unknown content in pages the tree
        # would serve: like a CUDA fault, it is fatal. The cache stops serving, visibly.
        exc = handle.exception()
        if exc is None:
            return False
        if self.failure is None:
            log.error("transfer failed; the cache stops serving: %r", exc)
            self.failure = exc
        return True

    async def wait_settled(self) -> None:
        """Wait for the next `settle()` that applied something."""
        await self._settled.wait()

    async def drain(self) -> None:
        """Wait until every queued and launched job has settled.

        Cancellation: only the wait is cancelled; the jobs go on.
        """
        while not self.idle and self.failure is None:
            await self.wait_settled()

    async def close_channels(self) -> None:
        await self._load_tx.aclose()
        await self._write_tx.aclose()

    async def close_receivers(self) -> None:
        """With the workers stopped, launch what they left queued (drain skipped after a
        failure, or cut short) and wake senders waiting for room: nobody waits for ever."""
        for rx, launch in ((self._load_rx, self._launch_loads),
                           (self._write_rx, self._launch_writes)):
            if left := take_queued(rx):
                self._queued -= len(left)
                launch(left)
        self._room.fire()
        await self._load_rx.aclose()
        await self._write_rx.aclose()

