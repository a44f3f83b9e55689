"""`TPGroup`: the collective a tensor-parallel cache agrees through.

A cache with ``tp_size > 1`` issues exactly one collective per consensus tick, an element-wise
MIN all-reduce of a fixed-shape int64 vector (`all_reduce_min`), always from the same task.
The call runs on one dedicated thread so the event loop never blocks on the network, and it is
bounded by a timeout so a dead or stuck rank becomes a `RankTimeoutError` on the others rather
than a hang.

    import torch.distributed as dist
    dist.init_process_group("gloo", ...)          # or "nccl" for the model, see below
    group = TPGroup.new(timeout=60.0)             # a dedicated gloo group for the cache
    cache = HiCache(HiCacheConfig(..., tp_rank=group.rank, tp_size=group.size), tp_group=group)

The vector is a few hundred bytes of host integers: a CPU (gloo) group is the right transport
even when the model's collectives use NCCL, and it keeps the tick off the GPU streams.
`TPGroup.single()` is the no-op group of one rank; it needs no torch.distributed at all.
`TPGroup.local(n)` gives n ranks that live in one event loop (one cache each): the same
consensus without processes, for testing a TP serving loop in an ordinary async test.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import torch

from ._concurrency import Promise, run_in_thread
from .errors import ConfigError, RankTimeoutError, TPError

__all__ = ("TPGroup",)

Vector = npt.NDArray[np.int64]


class TPGroup:
    """A torch.distributed process group seen as an awaitable MIN all-reduce.

    Create it with `new` (a fresh gloo group over the default world), `from_group` (a group you
    made) or `single` (one rank, no torch.distributed). Use one `TPGroup` per cache: its ticks
    must not interleave with other collectives on the same group.
    """

    def __init__(self, *, rank: int, size: int, group: Any = None, timeout: float = 60.0) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"rank/size: rank {rank} is not in a group of {size}")
        if not timeout > 0:
            raise ConfigError(f"timeout: must be above 0, got {timeout!r}")
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._group = group
        self._broken: TPError | None = None
        # One thread: collectives on a group must be issued in the same order on every rank.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiohicache-tp") \
            if size > 1 else None

    def __repr__(self) -> str:
        return f"<TPGroup rank {self.rank}/{self.size}>"

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one rank: every all-reduce returns its input."""
        return cls(rank=0, size=1)

    @classmethod
    def local(cls, size: int, *, timeout: float = 60.0) -> list[TPGroup]:
        """`size` ranks in this event loop; rank r's cache takes element r."""
        hub = _LocalHub(size, timeout)
        return [_LocalGroup(hub, rank=r, size=size, timeout=timeout) for r in range(size)]

    @classmethod
    def new(cls, *, timeout: float = 60.0) -> TPGroup:
        """A new gloo group over all ranks of the initialised default process group.

        Collective itself: every rank must call it, in the same order as other group creations.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("tp_group: torch.distributed is not initialised "
                              "(call dist.init_process_group first)")
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group,
                   timeout=timeout)

    @classmethod
    def from_group(cls, group: Any, *, timeout: float = 60.0) -> TPGroup:
        """Wrap an existing process group (gloo, or NCCL with the current CUDA device set)."""
        import torch.distributed as dist

        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group,
                   timeout=timeout)

    async def all_reduce_min(self, values: Vector) -> Vector:
        """The element-wise MIN of `values` over all ranks (MAX: pass and read back negated).

        Raises:
            RankTimeoutError: a rank did not join within `timeout` seconds, or went away.
            TPError: the group failed earlier; it cannot be used again.

        Cancellation: the collective cannot be recalled from the other ranks, so a cancelled
        call breaks the group (later calls raise `TPError`) once the thread has given up.
        """
        if self.size == 1:
            return values.copy()
        if self._broken is not None:
            raise TPError(f"{self!r} is broken: {self._broken}") from self._broken
        if self._thread is None:  # closed by a cache that used the group before (a restart)
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiohicache-tp")
        try:
            return await run_in_thread(self._thread, self._reduce, values.copy())
        except TPError as exc:
            self._broken = exc
            raise
        except anyio.get_cancelled_exc_class():
            self._broken = TPError("a consensus tick was cancelled mid-collective")
            raise

    def _reduce(self, values: Vector) -> Vector:
        import torch.distributed as dist

        tensor = torch.from_numpy(values)
        if self._group is not None and dist.get_backend(self._group) == "nccl":
            tensor = tensor.cuda()
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group,
                                   async_op=True)
            assert work is not None
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # gloo reports timeouts and dead peers as RuntimeError
            raise RankTimeoutError(
                f"rank {self.rank}/{self.size}: a consensus tick did not complete within "
                f"{self.timeout:g} s (another rank is dead, stuck, or stopped ticking): "
                f"{str(exc).splitlines()[0][:300]}") from exc
        result: Vector = tensor.cpu().numpy()
        return result

    def close(self) -> None:
        """Stop the collective thread (the process group itself stays the caller's); a
        later all-reduce (a new cache over this group) starts a new one."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None


class _LocalHub:
    """The rendezvous of `TPGroup.local` ranks: round k completes when all have sent round k."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self.rounds: dict[int, tuple[list[Vector], Promise[Vector]]] = {}


class _LocalGroup(TPGroup):
    def __init__(self, hub: _LocalHub, *, rank: int, size: int, timeout: float) -> None:
        super().__init__(rank=rank, size=size, timeout=timeout)
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        self._hub = hub
        self._round = 0

    async def all_reduce_min(self, values: Vector) -> Vector:
        if self._broken is not None:
            raise TPError(f"{self!r} is broken: {self._broken}") from self._broken
        hub, key = self._hub, self._round
        self._round += 1
        if key not in hub.rounds:
            hub.rounds[key] = ([], Promise())
        sent, done = hub.rounds[key]
        sent.append(values.copy())
        if len(sent) == hub.size:
            del hub.rounds[key]
            done.set_result(np.minimum.reduce(sent))
        try:
            with anyio.fail_after(self.timeout):
                return (await done.wait()).copy()
        except TimeoutError:
            self._broken = RankTimeoutError(
                f"rank {self.rank}/{self.size}: a consensus tick did not complete within "
                f"{self.timeout:g} s (another rank is dead, stuck, or stopped ticking)")
            raise self._broken from None
