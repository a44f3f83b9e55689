"""`Core`: the collaborators every request operation works on, made once by `HiCache`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ._concurrency import LoopBridge, current_loop
from ._leases import Leases
from ._pins import Pins
from ._stats import Counters
from .config import HiCacheConfig
from .errors import ClosedError, LoopError
from .memory import DevicePool, HostPool
from .radix import RadixTree

if TYPE_CHECKING:
    from ._executor import Executor
    from .controller import Consensus, Controller, StorageTier
    from .controller._l3_parts import PageKeys

__all__ = ("Core",)


@dataclass(eq=False)
class Core:
    """State shared by the face (`HiCache`, `FetchContext`) and the request operations.

    The pools, tree, leases, pins and counters exist from construction; the controller and
    the executor from the moment the cache is opened.
    """

    config: HiCacheConfig
    device_pool: DevicePool
    host_pool: HostPool
    tree: RadixTree
    storage: StorageTier | None
    leases: Leases = field(init=False)
    pins: Pins = field(init=False)
    counters: Counters = field(default_factory=Counters)
    controller: Controller | None = None
    executor: Executor | None = None
    tp: Consensus | None = None
    calls_crc: int = 0
    """TP: CRC of every fetched token sequence, in agreed order (part of the digest; kept
    only when there is a TP group to compare it with)."""
    dropped: list[object] = field(default_factory=list)
    """TP: requests of contexts dropped without exiting; kept, with their pin and leases
    (`FetchContext.__del__`: a release would run at another point on each rank)."""
    abandoned: int = 0
    """Contexts entered and never exited, released (or kept, TP) when collected: the
    testing plugin fails the test that left one (their leases were gone by its check)."""
    page_keys: PageKeys | None = None
    """An events subscriber's page keys without L3 (`_request.page_keys`), made once."""
    state: Literal["new", "open", "closing", "closed"] = "new"
    loop: object | None = None
    """The event loop that opened the cache (`current_loop`): its workers run there only."""
    bridge: LoopBridge | None = None
    """Calls onto that loop from anywhere (a garbage-collected context's release)."""
    thread: int | None = None
    """The thread that runs that loop (`threading.get_ident`)."""

    def __post_init__(self) -> None:
        self.leases = Leases(self.device_pool.allocator, self.config.page_size)
        self.pins = Pins(self.tree)

    def check_loop(self) -> None:
        """Raise `LoopError` unless called on the loop that opened the cache (or before).

        NOTE: on another loop the workers never run (a load or write-back queued there
        waits for ever) and the cache's state changes race the loop's thread.
        """
        if self.loop is None or (running := current_loop()) is self.loop:
            return
        # a sync call (`free`) on the loop's own thread between two of its runs races nothing
        if running is None and threading.get_ident() == self.thread:
            return
        raise LoopError("the cache was opened on another event loop (or this is another "
                        "thread): call it only from the loop that opened it (a cache "
                        "cannot move between loops, e.g. across asyncio.run calls or "
                        "from a session-scoped fixture into a test's own loop)")

    def check_open(self) -> Controller:
        """The controller of an open, healthy cache on its loop; else `ClosedError`,
        `WorkerError` or `LoopError`."""
        self.check_loop()
        if self.state != "open":
            raise ClosedError(f"the cache is {self.state}")
        ctl = self.open_controller()
        ctl.check_healthy()
        return ctl

    def check_op(self) -> Controller:
        """`check_open` for a request operation. NOTE: with TP it runs at a tick, which may
        come after this rank's `aclose` was called (the state says "closing" at once) yet
        before the close in the op log: only the agreed close refuses it, on every rank."""
        if self.tp is None:
            return self.check_open()
        if self.tp.closing:
            raise ClosedError("the cache is closing")
        ctl = self.open_controller()
        ctl.check_healthy()
        return ctl

    def open_controller(self) -> Controller:
        if self.controller is None:
            raise ClosedError("the cache is not open: use 'async with HiCache(config)'")
        return self.controller

    def run(self) -> Executor:
        assert self.executor is not None, "the cache is open"
        return self.executor

    def digest(self) -> tuple[int, ...]:
        """Cheap numbers that equal caches share; the TP tick compares them across ranks."""
        return (self.device_pool.allocator.num_free, self.host_pool.allocator.num_free,
                self.tree.num_nodes, self.leases.count, self.counters.requests, self.calls_crc)
