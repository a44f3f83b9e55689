"""One request's state and its operations, each written once and run by an executor.

Every operation is a synchronous state change that returns a `Plan` (its result and the
copies it planned); `FetchContext` (api.py) hands it to the cache's executor and awaits that
one call. See `_executor` for how an operation runs with one rank and with TP.
"""

from __future__ import annotations

import math
import time
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from ._core import Core
from ._executor import AGAIN, Op, Plan
from ._invariants import concat_pages
from ._tokens import Tokens
from .controller import Controller, LoadJob, PrefetchJob
from .controller._l3_parts import OFFLOAD_HASH_TOKENS, PageKeys
from .errors import CapacityError, ClosedError, ConfigError
from .memory import PageIds
from .radix import DeviceState, Match, Node
from .transfer._base import record_fence

if TYPE_CHECKING:
    from .controller import StorageTier

__all__ = ("Request", "alloc_op")


def alloc_op(core: Core, num_pages: int, owner: int, *,
             last_used: int | None = None) -> Plan[PageIds]:
    """Lease `num_pages` device pages to `owner`, evicting as needed (`last_used`: slots of
    the last page handed out, as `Leases.lease`); AGAIN while copies in flight may still
    free some (write-backs in progress free their pages when they settle)."""
    ctl = core.check_op()
    pages = ctl.alloc_device(num_pages)
    if pages is None:
        if ctl.demoting_pages or not ctl.idle:
            return AGAIN  # type: ignore[no-any-return]
        raise CapacityError(f"cannot allocate {num_pages} device pages: "
                            f"{core.tree.device_alloc.num_free} free and the rest pinned or "
                            "in flight")
    core.leases.lease(pages, owner, last_used=last_used)
    return Plan(pages)


class Request:
    """What one fetch context holds: its tokens, pin, leases, cached prefix and loads."""

    _owner_ids = iter(range(1, 2**63))

    def __init__(self, core: Core, tokens: Tokens) -> None:
        self.core = core
        tokens.flags.writeable = False  # shown as `FetchContext.tokens`: commits check it
        self.tokens = tokens
        self.owner = next(Request._owner_ids)
        self.pin: int | None = None
        self.releasing = False  # TP: left; the pin goes at the next tick
        self.released = False  # the release ran (TP: at its tick): its ops are refused
        self.entered = False
        self.pages: PageIds = np.empty(0, dtype=np.int64)  # device pages of the cached prefix
        self.jobs: list[LoadJob] = []  # loads the cached prefix waits for
        self.leases: list[PageIds] = []
        self.tail: tuple[int, int, int] | None = None
        """The leased page being filled: (page, slots handed out, its lease's serial)."""
        self.num_device_hit_tokens = self.num_host_hit_tokens = 0
        self.num_storage_hit_tokens = 0
        self._prefetching: PrefetchJob | None = None
        self._storage_pages = self._pre_storage_pages = 0
        self.hashed: list[bytes] | None = None
        """L3 keys of the whole pages of `tokens`, hashed off the loop (long prompts only)."""

    @property
    def num_cached_tokens(self) -> int:
        return len(self.pages) * self.core.config.page_size

    def check_active(self) -> None:
        self.core.check_loop()
        if self.pin is None:
            raise ClosedError("the fetch context is not active (use it inside 'async with')")

    def check_unreleased(self) -> None:
        """`check_active` for an op: with TP, leaving the context (at once) may come before
        the tick that runs an op queued earlier, on some ranks only; its release runs after
        every such op, on all of them."""
        if self.released:
            raise ClosedError("the fetch context was left")

    # ------------------------------------------------------------------ enter

    def enter_op(self, op: Op) -> Plan[None]:
        """Match, ask L3 for what follows (waiting per policy: AGAIN), pin, plan the loads."""
        core = self.core
        ctl, storage = core.check_op(), core.storage
        if self._prefetching is None:
            if core.tp is not None:  # only the TP digest reads it: not on every request
                # NOTE: the id width too: int32 ids where they fit, so 32 small ids and 16
                # past int32 are the same bytes and two prompts
                crc = zlib.crc32(b"%d" % self.tokens.itemsize, core.calls_crc)
                core.calls_crc = zlib.crc32(self.tokens.data, crc)  # no copy
            match = core.tree.match(self.tokens)
            if storage is not None:
                storage.on_hits(match.path)
            job = storage.plan_prefetch(self.tokens, match.path, self.hashed) \
                if storage else None
            if job is None:
                return self._plan_enter(match, ctl)
            assert storage is not None
            self._prefetching = job
            # NOTE: our own L1+L2 match, not the prefetch's start: a prefetch joined in flight
            # may start before pages we had in L2, and those were counted as L3 hits
            self._pre_storage_pages = sum(n.num_pages for n in match.path)
            wait = storage.wait_seconds(len(self.tokens) - job.start_page * ctl.tree.page_size)
            if wait and not job.done.is_set():
                op.deadline = None if math.isinf(wait) else time.monotonic() + wait
                return AGAIN  # type: ignore[no-any-return]
        elif not (self._prefetching.done.is_set() or op.stop):
            return AGAIN  # type: ignore[no-any-return]
        return self._plan_enter(self._after_prefetch(self._prefetching), ctl)

    def _after_prefetch(self, job: PrefetchJob) -> Match:
        if job.done.is_set():
            self._storage_pages = job.inserted
        return self.core.tree.match(self.tokens, touch=False)

    def _plan_enter(self, match: Match, ctl: Controller) -> Plan[None]:
        self.pin = self.core.pins.pin(self, match.last_device_node)
        try:
            load = ctl.plan_load(match)
            self._adopt(match, load)
            write = ctl.plan_write_through(match.last_device_node)
        except BaseException:
            self.release_op()
            raise
        return Plan(None, [j for j in (load, write) if j is not None])

    def _adopt(self, match: Match, job: LoadJob | None) -> None:
        """Record the device prefix (resident, loading, and our own loads) and pin it."""
        nodes = match.device_nodes + (job.nodes if job is not None else [])
        if job is not None:
            self.jobs.append(job)
            self.core.pins.repin(self.owner, nodes[-1])
        self.join_loads(match.device_nodes)
        self.pages = concat_pages([n.device_pages for n in nodes])
        self._count_hits(match)

    def _count_hits(self, match: Match) -> None:
        ps, cached = self.core.config.page_size, self.num_cached_tokens
        resident = sum(n.num_pages for n in match.device_nodes
                       if n.device_state is DeviceState.RESIDENT) * ps
        self.num_device_hit_tokens = resident
        # Tokens past what L1+L2 matched before the prefetch came from L3.
        beyond = cached - max(resident, self._pre_storage_pages * ps)
        self.num_storage_hit_tokens = max(0, min(self._storage_pages * ps, beyond))
        self.num_host_hit_tokens = cached - resident - self.num_storage_hit_tokens
        c = self.core.counters
        c.requests += 1
        c.prompt_tokens += len(self.tokens)
        c.device_hit_tokens += resident
        c.host_hit_tokens += self.num_host_hit_tokens
        c.storage_hit_tokens += self.num_storage_hit_tokens

    def join_loads(self, nodes: list[Node]) -> None:
        """Depend on the loads still filling `nodes`: `ready`/`layer_ready` wait for them."""
        known = {id(job) for job in self.jobs}
        for node in nodes:
            op = node.load_op
            if node.device_state is DeviceState.LOADING and isinstance(op, LoadJob) \
                    and id(op) not in known:
                known.add(id(op))
                self.jobs.append(op)

    # ------------------------------------------------------------------ allocate

    def holds(self, tail: tuple[int, int, int] | None) -> bool:
        """Whether `tail`'s page is still this context's, in the lease `tail` names.

        NOTE: the owner alone is not enough: a page freed with `HiCache.free` comes back to
        this context in another lease, every slot handed out, when another `allocate` of it
        leases the page while one that took the old rest waits; continued at the old mark
        (given back by the waiting one, cancelled), slots the caller held went out again.
        """
        return tail is not None and self.core.leases.holds(tail[0], self.owner, tail[2])

    def take_tail(self, num_tokens: int) -> tuple[torch.Tensor | None, int]:
        """Slots from the rest of the partial page this context still leases; tokens left."""
        ps = self.core.config.page_size
        if not self.holds(self.tail):
            self.tail = None  # the partial page was freed (and maybe re-leased): start afresh
        if self.tail is None:
            return None, num_tokens
        page, used, serial = self.tail
        take = min(num_tokens, ps - used)
        head = torch.arange(page * ps + used, page * ps + used + take, dtype=torch.int64)
        # taken now, even if new pages must still be leased: another allocate of this
        # context running meanwhile must not get these slots too
        self.tail = (page, used + take, serial) if used + take < ps else None
        return head, num_tokens - take

    def lease_op(self, num_pages: int) -> Plan[PageIds]:
        """`alloc_op` for this context: the pages join its leases as they are leased, so its
        release frees them whenever it runs; refused once the context has been released."""
        self.check_unreleased()
        # NOTE: the pages this context holds (its pinned prefix, its leases) cannot be evicted
        # for it: asking past the rest evicted every other unpinned page, then failed anyway.
        # Checked here, at the tick with TP: every rank sees the same leases.
        # (`leases` still lists pages given back with `HiCache.free` or by a cancelled
        # allocate: only those still held count)
        leased = concat_pages(self.leases)
        held = len(self.pages) + self.core.leases.num_held(leased, self.owner)
        capacity = self.core.tree.device_alloc.capacity
        if num_pages + held > capacity:
            raise CapacityError(f"asked for {num_pages} device pages; the pool has {capacity}, "
                                f"{held} of them held by this request")
        plan = alloc_op(self.core, num_pages, self.owner)
        if plan is not AGAIN:
            self.leases.append(plan.result)
        return plan

    def took_pages(self, pages: PageIds, num_tokens: int) -> None:
        """`allocate` leased `pages` for `num_tokens` (after the partial page, if any)."""
        ps, last = self.core.config.page_size, int(pages[-1])
        self.tail = (last, num_tokens % ps, int(self.core.leases.serial[last])) \
            if num_tokens % ps else None

    # ------------------------------------------------------------------ commit

    def commit_op(self, toks: Tokens, pages: PageIds) -> Plan[None]:
        """Insert `toks` (KV after the cached prefix in `pages`); plan the write-through."""
        core = self.core
        ctl = core.check_op()
        self.check_unreleased()
        ps = core.config.page_size
        num_full = len(toks) // ps
        new_full = num_full - len(self.pages)
        all_pages = np.concatenate([self.pages, pages[:new_full]])
        # again here: with TP this runs at a tick, after any free the caller queued before it
        core.leases.check_owner(pages, self.owner)
        keys = page_keys(core)
        hashes = keys.keys(toks[:num_full * ps], self._path(), self.hashed) \
            if keys is not None else None
        # Insert before the leases end: if it raises, the pages are still leased, not lost.
        res = core.tree.insert(toks[:num_full * ps], all_pages, start_page=len(self.pages),
                               hashes=hashes, under=core.pins.node(self.owner))
        if core.storage is not None:  # a host-only node taking our pages counted a hit too
            core.storage.on_hits(res.new_nodes)
        core.leases.release(pages[:new_full], free=False)
        self.leases = [kept for p in self.leases if len(kept := core.leases.owned(p, self.owner))]
        for dup in res.duplicate_pages:
            core.device_pool.allocator.free(dup)
        self._keep_tail(toks, pages[new_full:])
        core.pins.repin(self.owner, res.last_node)
        if res.last_node is not None:
            # A page another request is loading replaced ours as a duplicate: our prefix now
            # reads that load's pages, so `ready`/`layer_ready` must wait for it.
            self.join_loads(res.last_node.path_to_root())
            self.pages = concat_pages([n.device_pages
                                       for n in reversed(res.last_node.path_to_root())])
        if len(toks) > len(self.tokens):
            toks.flags.writeable = False
            self.tokens = toks
        write = ctl.plan_write_through(res.last_node)
        if write is None:
            return Plan(None)
        write.fence = record_fence(ctl.engine)  # the copy waits for the KV just produced
        return Plan(None, [write])

    def _keep_tail(self, toks: Tokens, tail: PageIds) -> None:
        """The partial tail page stays leased, now to this context, so decoding goes on.

        The next `allocate` continues after the last slot handed out, never before: of this
        context's own pages, `allocate` handed out every slot but the free rest of its last
        page (`self.tail`), which a commit of fewer tokens than allocated leaves where it is.
        NOTE: set from the commit alone, a chunk's commit moved it back, and the next
        allocate handed out the slots of the chunk's uncommitted tokens again.
        """
        ps, leases = self.core.config.page_size, self.core.leases
        mark, self.tail = self.tail, None
        if not self.holds(mark):
            # NOTE: checked before adopting: a page freed since and leased again by
            # `HiCache.allocate` became ours by the adoption below, and the stale mark
            # handed out its slots the caller still held
            mark = None
        if len(tail):
            adopted = tail[leases.owner[tail] != self.owner]
            leases.owner[adopted] = self.owner
            if len(adopted):
                self.leases.append(adopted)
            page, used = int(tail[0]), len(toks) % ps
            if len(adopted):  # from `HiCache.allocate`: its slots handed out, all but a rest
                used = max(used, int(leases.handed[page]))
            else:  # our own page: handed out whole unless it is the mark's
                used = max(used, mark[1]) if mark is not None and mark[0] == page else ps
            if used < ps:
                self.tail = (page, used, int(leases.serial[page]))
                return
        if mark is not None:
            self.tail = mark  # the last page allocate handed out is still ours, uncommitted

    def _path(self) -> list[Node]:
        """The pinned prefix's nodes, root first."""
        node = self.core.pins.node(self.owner)
        return node.path_to_root()[::-1] if node is not None else []

    def check_commit(self, toks: Tokens, slots: torch.Tensor) -> PageIds:
        """The pages of `slots`, after checking `toks` and `slots` fit this context."""
        cached, common = self.num_cached_tokens, min(len(toks), len(self.tokens))
        if len(toks) < cached or not np.array_equal(toks[:common], self.tokens[:common]):
            raise ConfigError("tokens: must be a prefix or an extension of the fetched tokens, "
                              "and cover the cached prefix")
        if not isinstance(slots, torch.Tensor) or len(slots) != len(toks) - cached:
            raise ConfigError(f"slots: need one slot per token after the cached prefix "
                              f"({len(toks) - cached}), got "
                              f"{len(slots) if isinstance(slots, torch.Tensor) else slots!r}")
        pages = self.core.device_pool.slots_to_pages(slots)
        self.core.leases.check_owner(pages, self.owner)
        return pages

    def nothing_new(self, toks: Tokens, slots: torch.Tensor) -> bool:
        """A commit of exactly the cached prefix: nothing to insert."""
        return (len(slots) == 0 and len(toks) // self.core.config.page_size == len(self.pages)
                and self.tail is None)

    # ------------------------------------------------------------------ release

    def release_op(self) -> None:
        """Unpin and free the leases not committed, now (runs once; later calls do nothing)."""
        pin, self.pin = self.pin, None
        self._release(pin)

    def release(self) -> None:
        """Leave: the release runs now, or (TP) at the next tick; either way the context is
        inactive at once. The leases are taken when it runs: pages an allocate of this
        context leased before then (another task's, still waiting for its tick) go too."""
        pin, self.pin = self.pin, None
        self.releasing = pin is not None

        def run() -> None:
            self.releasing = False
            self._release(pin)
        executor = self.core.executor
        if executor is None:
            run()
        else:
            executor.post(run)

    def _release(self, pin: int | None) -> None:
        """Unpin, free the leases not committed; from now on `lease_op` refuses."""
        self.released = True
        leases, self.leases = self.leases, []
        if pin is not None:
            self.core.pins.unpin(pin)
        for pages in leases:
            self.core.leases.release_owned(pages, self.owner)


def page_keys(core: Core) -> PageKeys | StorageTier | None:
    """Who names the tree's pages by their L3 keys: the L3 tier, else (hashing a long prompt's
    off the loop) an events subscriber's, if one is hooked into the tree; None: nobody.

    NOTE: the events hub names every page a residency change lists by its key, and a node
    that comes without them is hashed on the loop, in the tree's hook: a commit of a
    128k-token miss held it 10-20 ms. Hashed at the fetch, on a thread, they ride in the tree.
    """
    if core.storage is not None:
        return core.storage
    if not core.tree.on_residency:
        return None
    if core.page_keys is None:  # NOTE: once: making one (the root's hash) took 2.8 us a call
        core.page_keys = PageKeys(core.config)
    return core.page_keys


def fetch_keys(core: Core, tokens: Tokens) -> PageKeys | StorageTier | None:
    """`page_keys`, to hash `tokens`' keys at the fetch; None, for an events subscriber alone,
    when the tree holds the keys of all but a short tail (the commit hashes that on the loop).

    NOTE: hashing the whole prompt on a thread at every fetch made an all-L1 hit of a
    16k-token prompt 2.5 times slower (0.8 -> 2.0 ms); the tree knew every key. With L3 the
    prefetch needs them all; with TP every rank awaits alike.
    """
    keys = page_keys(core)
    if isinstance(keys, PageKeys) and core.tp is None and len(tokens) >= OFFLOAD_HASH_TOKENS \
            and len(tokens) - core.tree.keyed_prefix(tokens) < OFFLOAD_HASH_TOKENS:
        return None
    return keys

