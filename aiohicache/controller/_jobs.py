"""Planned copies between L1 and L2: load and write jobs, and the transfer counters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream

from .._concurrency import Promise
from .._histogram import TransferHistograms
from ..memory import PageIds
from ..radix import PendingOp
from ..transfer import TransferHandle

__all__ = ("LoadJob", "TransferCounters", "WriteJob", "_Job", "_concat", "leading_done",
           "take_queued")

T = TypeVar("T")


class _Job(PendingOp):
    """A planned copy: its nodes are in a transitional state until `settle()` applies it."""

    __slots__ = ("copy_pages", "dst", "handle", "launched", "src")

    def __init__(self) -> None:
        super().__init__()
        self.src: PageIds = np.empty(0, dtype=np.int64)
        self.dst: PageIds = np.empty(0, dtype=np.int64)
        self.handle: TransferHandle | None = None
        self.launched: Promise[None] = Promise()
        self.copy_pages = 0
        """Pages of the whole copy this job was launched in (its own and those merged with
        it): the job's share of the copy's duration is ``num_pages / copy_pages``."""

    @property
    def seconds(self) -> float:
        """This job's share of its copy's duration, by pages: the shares of a merged copy
        add up to its duration once (each job observed the whole of it before)."""
        assert self.handle is not None
        share = self.num_pages / self.copy_pages if self.copy_pages else 1.0
        return self.handle.seconds * share

    @property
    def num_pages(self) -> int:
        return len(self.src)

    def done(self) -> bool:
        return self.handle is not None and self.handle.done()

    async def launched_handle(self) -> TransferHandle:
        """The copy's handle, once a worker has launched it. Cancellation: only the wait."""
        if self.handle is None:
            await self.launched.wait()
        assert self.handle is not None
        return self.handle

    async def wait_layer(self, layer: int) -> None:
        """Wait until `layer` of this job's pages is in place. Cancellation: only the wait."""
        await (await self.launched_handle()).wait_layer(layer)

    async def wait(self) -> None:
        await (await self.launched_handle()).wait()


class LoadJob(_Job):
    """Host->device copy of host-only nodes (now LOADING). src: host pages, dst: device."""

    __slots__ = ()

    def seal(self) -> None:
        self.src = _concat([n.host_pages for n in self.nodes])
        self.dst = _concat([n.device_pages for n in self.nodes])


class WriteJob(_Job):
    """Device->host copy of device nodes (now WRITING). src: device pages, dst: host.

    With `demote` (write-back), the nodes' device pages are freed once the copy settles.
    """

    __slots__ = ("demote", "fence")

    def __init__(self, *, demote: bool = False) -> None:
        super().__init__()
        self.demote = demote
        self.fence: object | None = None
        """Recorded where the KV was produced (`commit`): the copy waits for it (CUDA)."""

    def seal(self) -> None:
        self.src = _concat([n.device_pages for n in self.nodes])
        self.dst = _concat([n.host_pages for n in self.nodes])


def _concat(parts: Sequence[PageIds | None]) -> PageIds:
    arrays = [p for p in parts if p is not None]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class TransferCounters:
    """Running totals the controller keeps for `HiCache.stats()`."""

    loaded_bytes: int = 0
    written_bytes: int = 0
    loads: int = 0
    writes: int = 0
    load_merges: int = 0
    write_merges: int = 0
    worker_restarts: int = 0
    histograms: TransferHistograms = field(default_factory=TransferHistograms)
    """Bytes and seconds of each settled load (L2 -> L1) and write (L1 -> L2)."""


def leading_done(jobs: Iterable[_Job]) -> int:
    """How many of `jobs`, from the oldest, are done (with no unfinished one between)."""
    count = 0
    for job in jobs:
        if not job.done():
            break
        count += 1
    return count


def take_queued(rx: MemoryObjectReceiveStream[T]) -> list[T]:
    """Everything queued in `rx` now, oldest first, without waiting."""
    items: list[T] = []
    while True:
        try:
            items.append(rx.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return items
