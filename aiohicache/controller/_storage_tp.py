"""The tensor-parallel half of `StorageTier`: its results as proposals for the consensus tick.

Each rank does its own L3 I/O, but a result that changes the tree (how many pages L3 has, how
many arrived, which were stored) is only applied once every rank has it: the tick reduces the
proposals with MIN and `tp_apply` applies the leading agreed ones, on every rank in the same
order. Kept apart from the I/O so the single-rank path reads without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._l3_parts import TP_SLOTS, PrefetchJob, _Backup, _leading

if TYPE_CHECKING:
    from ..storage.faults import Breaker

__all__ = ("TPResults",)


class TPResults:
    """Mixed into `StorageTier`, which provides the queues and the ``_on_*`` steps."""

    _counting: list[PrefetchJob]
    _reading: list[PrefetchJob]
    _backing_up: list[_Backup]
    breaker: Breaker
    tp_stopped = False
    """The tick has stopped for good (closed or failed): nothing more will be agreed."""

    def _on_count(self, job: PrefetchJob, count: int) -> bool:
        raise NotImplementedError

    def _on_arrived(self, job: PrefetchJob, arrived: int) -> None:
        raise NotImplementedError

    def _on_stored(self, backup: _Backup, ok: list[bool]) -> None:
        raise NotImplementedError

    def _finish(self, job: PrefetchJob) -> None:
        raise NotImplementedError

    def tp_proposals(self) -> list[int]:
        """This rank's results for the tick: `TP_SLOTS` each of prefetch counts, prefetch
        arrivals and backups, oldest first, -1 where not ready (so MIN waits for every rank)."""
        out: list[int] = []
        for queue in (self._counting, self._reading, self._backing_up):
            got = [-1 if item.proposal is None else item.proposal for item in queue[:TP_SLOTS]]
            out.extend(got + [-1] * (TP_SLOTS - len(got)))
        return out

    def tp_apply(self, agreed: list[int]) -> None:
        """Apply the results every rank has (the leading agreed slots of each queue)."""
        counts, arrived, stored = (agreed[i * TP_SLOTS:(i + 1) * TP_SLOTS] for i in range(3))
        for value in _leading(counts):
            job = self._counting.pop(0)
            job.proposal = None
            if self._on_count(job, value):
                self._reading.append(job)
            else:
                self._finish(job)
            job.agreed.set()
        for value in _leading(arrived):
            job = self._reading.pop(0)
            job.proposal = None
            self._on_arrived(job, value)
            self._finish(job)
            job.agreed.set()
        for value in _leading(stored):
            backup = self._backing_up[0]
            self._on_stored(backup, [i < value for i in range(len(backup.keys))])

    def tp_stop(self) -> None:
        """The tick has stopped: prefetches waiting for agreement end as misses (their
        tasks free what they hold once their I/O is over), and backups apply this rank's
        own results, so nothing waits for a tick that will not come (`drain` returns)."""
        self.tp_stopped = True
        for job in [*self._counting, *self._reading]:
            job.agreed.set()
        for backup in list(self._backing_up):
            if (done := backup.proposal) is not None:
                self._on_stored(backup, [i < done for i in range(len(backup.keys))])

    def tp_local_bypass(self) -> bool:
        """This rank's breaker is open (the tick ORs it over the ranks)."""
        return self.breaker.state.value == "open"
