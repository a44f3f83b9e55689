"""The L3 tier in the cache: prefetch from storage into host pages, back host pages up to it.

`StorageTier` sits beside the controller and owns everything that talks to a
`StorageBackend` for a `HiCache`:

- **Keys.** Every node carries per-page keys (`Node.hashes`), chained from a root that names
  the namespace, KV spec, page size, host layout and TP shard (`storage.keys`).
- **Prefetch (L3 -> L2).** A fetch whose tokens run past the L1+L2 match by at least
  `prefetch_threshold` asks the backend how many of the following pages it has (one batched
  ``exists``), reserves host pages (at most `prefetch_host_fraction` of the pool for all
  prefetches together), reads them (``get_into``) and inserts the leading pages that arrived
  verified as host-only nodes; they are then loaded back like any L2 hit. Concurrent fetches
  of the same pages share one prefetch; a prefix L3 did not have is not asked for again for
  `storage_miss_ttl` seconds (the negative cache: at most `storage_miss_max_entries` prefixes,
  the oldest forgotten first). The fetch waits per `prefetch_policy`; a prefetch it stops
  waiting for still completes and serves later requests.
- **Backup (L2 -> L3).** When a write-through settles, nodes with enough hits are queued for
  backup, never on a request's path; backups run concurrently under
  `backup_max_inflight_bytes`, and each page's result is recorded (`Node.stored`).
- **Re-check.** A store may drop pages on its own after they were stored (its byte budget,
  Redis ``maxmemory``, another instance's delete), and a prefix this instance keeps hot in
  L1/L2 is never read from L3 by it: the first pages a store's LRU drops. So a node hit
  while its pages are marked stored is checked again (one ``exists``, in the background) at
  most every `L3_RECHECK_SECONDS`; pages found gone lose their mark and are backed up again.
  Single-rank only (a TP rank's answer would need the tick's agreement).
- **Failures.** A backend error or a page that fails its checksum is a miss. Repeated errors
  open a breaker: L3 is bypassed for `storage_cooldown` seconds while L1/L2 keep serving, and
  `stats()` shows it.
- **Tensor parallelism.** Each rank stores its own shard (the rank is in the key root); MLA KV
  is replicated, so its keys carry no rank and each page is written by one rank, picked by the
  page's key. The I/O runs per rank, but every decision that changes the tree is a *proposal*
  (pages present, pages arrived, pages stored) that the consensus tick reduces with MIN and
  applies on every rank in the same order (`tp_proposals` / `tp_apply`); the breaker and the
  clock of the negative cache are agreed the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from .._histogram import TransferHistograms
from ..config import HiCacheConfig
from ..errors import HiCacheError
from ..memory import HostPool, PageIds
from ..radix import HostState, Node, RadixTree
from ..radix._tree import Tokens
from ..storage import StorageBackend
from ..storage.factory import backend_from_url
from ..storage.faults import Breaker
from ._l3_parts import (
    PageKeys,
    PrefetchJob,
    StorageCounters,
    _Backup,
    _MissCache,
    _PageBuffers,
    page_format,
)
from ._storage_tp import TPResults

__all__ = ("PrefetchJob", "StorageCounters", "StorageTier", "page_format")

log = logging.getLogger(__name__)

L3_RECHECK_SECONDS = 30.0
"""How often at most a node hit in L1/L2 has its pages marked stored checked against L3."""
L3_RECHECK_MAX_NODES = 64
"""Nodes waiting for their re-check at most; more are left for a later hit. Bounds the
``exists`` calls, which run one at a time."""


class StorageTier(TPResults):
    """Prefetch and backup for one cache (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, tree: RadixTree, host_pool: HostPool, *,
                 tp: bool = False) -> None:
        self.config = config
        self.tp = tp
        self.kick: Callable[[], None] = lambda: None
        """Tells the executor of news: a prefetch ended, a proposal is ready for the tick."""
        self.tree = tree
        self.host_pool = host_pool
        self.fmt = page_format(config)
        page_keys = PageKeys(config)
        self.root = page_keys.root
        self.keys = page_keys.keys
        self.hash_pages = page_keys.hash_pages
        self.backend: StorageBackend = backend_from_url(config.l3.backend, self.fmt)  # type: ignore[arg-type]
        # An object passed in is the caller's to close; a store made from a URL is ours.
        self._owns_backend = isinstance(config.l3.backend, str)
        self.breaker = Breaker(failures_to_open=config.l3.failures_to_open,
                               cooldown_s=config.l3.cooldown)
        self.counters = StorageCounters()
        self.histograms = TransferHistograms()
        """Bytes and seconds of each L3 read (load, L3 -> L2) and write (store, L2 -> L3)."""
        self.reserved_host: dict[int, PageIds] = {}  # prefetch id -> host pages not in tree
        self._inflight: dict[tuple[bytes, bytes], PrefetchJob] = {}  # (first, last key)
        self._misses = _MissCache(ttl=config.l3.miss_ttl,
                                  max_entries=config.l3.miss_max_entries)
        self._backing_up: list[_Backup] = []
        self._backing_nodes: set[int] = set()  # ids of the nodes in `_backing_up`
        self._backup_bytes = 0
        self._backup_room = anyio.Event()
        self._rechecks: dict[int, Node] = {}  # node id -> node, waiting or being re-checked
        self._tg: TaskGroup | None = None
        self._changed = anyio.Event()
        # TP: jobs waiting for the tick to agree on their phase, in plan order (same on all ranks)
        self._counting: list[PrefetchJob] = []
        self._reading: list[PrefetchJob] = []
        self.agreed_now = 0.0          # TP: the tick's clock (MAX of the ranks' wall clocks)
        self.agreed_bypass = False     # TP: some rank's breaker is open
        tree.on_split.append(self._on_split)

    # ------------------------------------------------------------------ prefetch

    def start(self, tg: TaskGroup) -> None:
        self._tg = tg

    def check_loop(self) -> None:
        """Raise `ConfigError` if the backend (or one it wraps) cannot run on this event
        loop (a Redis store under trio), before the cache starts: else every L3 call
        failed, logged as a bug, and the cache ran degraded for good."""
        backend: object = self.backend
        while backend is not None:
            check = getattr(backend, "check_loop", None)
            if callable(check):
                check()
            backend = getattr(backend, "inner", None)

    def _now(self) -> float:
        return self.agreed_now if self.tp else time.monotonic()

    def _allow(self) -> bool:
        return not self.agreed_bypass if self.tp else self.breaker.allow()

    def plan_prefetch(self, tokens: Tokens, path: list[Node],
                      hashed: list[bytes] | None = None) -> PrefetchJob | None:
        """A prefetch for the pages after `path` (the L1+L2 match), or None; `hashed` as
        for `keys`.

        Joins a running prefetch of the same pages (single flight).
        """
        ps, cfg = self.config.page_size, self.config
        matched = sum(n.num_pages for n in path)
        tail_pages = len(tokens) // ps - matched
        if self._tg is None or tail_pages * ps < max(cfg.l3.prefetch_threshold, 1):
            return None
        # NOTE: L3 pages join L2 only under a host copy of their prefix (host residency is
        # prefix-closed): ask from the end of the match's host-backed head, so the nodes on
        # the device only after it get their host copy too. Asked from the end of the match,
        # the pages after such a node were read, then thrown away.
        host = next((i for i, n in enumerate(path) if not n.on_host), len(path))
        start = sum(n.num_pages for n in path[:host])
        keys = self.keys(tokens, path, hashed)
        first = keys[start]
        # NOTE: a join or a negative hit asks the backend nothing: decided before the
        # breaker is asked, so neither takes its half-open probe nor counts as a success
        if (job := self._covering(keys, start)) is not None:
            return job
        # NOTE: a miss is remembered by the first page past the match: `first` may be a page
        # of a device-only prompt, and its miss hid every other continuation's L3 pages
        if self._misses.hit(keys[matched], self._now()):
            self.counters.negative_hits += 1
            return None
        if not self._allow():
            self.counters.bypassed += 1
            return None
        job = PrefetchJob(tokens[:len(tokens) // ps * ps], start, keys, matched)
        # NOTE: the whole head, not only its host-only nodes: a node on both tiers may be
        # evicted from the device meanwhile, and then its host copy by our own reservation,
        # and the pages read after it had nothing to join (read, then thrown away)
        job.held = path[:host]
        for node in job.held:
            self.tree.protect_host(node)
        self._inflight[first, keys[-1]] = job
        if self.tp:
            self._counting.append(job)
            self._tg.start_soon(self._prefetch_tp, job)
        else:
            self._tg.start_soon(self._prefetch, job)
        return job

    def _covering(self, keys: list[bytes], start: int) -> PrefetchJob | None:
        """A prefetch in flight of every page of `keys` from `start` on (its keys hold our
        last key: the same prefix; it may end there). NOTE: sharing by the first page asked
        for joined a prefetch of another continuation (a shared system prompt, then another
        question), and our pages in L3 were missed."""
        last, n = keys[-1], len(keys)
        if (job := self._inflight.get((keys[start], last))) is not None:
            return job
        return next((j for j in self._inflight.values() if j.start_page <= start
                     and len(j.keys) >= n and j.keys[n - 1] == last), None)

    def wait_seconds(self, num_tokens: int) -> float:
        """How long a fetch of `num_tokens` waits for its prefetch (0: not at all)."""
        policy = self.config.l3.prefetch_policy
        if policy == "best_effort":
            return 0.0
        if policy == "wait_complete":
            return math.inf
        return self.config.l3.prefetch_timeout(num_tokens)

    async def _prefetch(self, job: PrefetchJob) -> None:
        """Task: exists -> reserve host pages -> get_into -> insert what arrived.

        Cancellation (cache closing): reserved pages are freed; nothing is inserted.
        """
        try:
            if self._on_count(job, await self._count_present(job)):
                assert job.reserved is not None
                self._on_arrived(job, await self._read(job, job.reserved))
            else:
                # NOTE: no read follows (too few pages, or no host room for them): the exists
                # was the call, and it answered; a half-open breaker's probe stayed undecided
                self.breaker.record_success()
        except Exception as exc:  # any failure of a prefetch is a miss, never a crash
            self._fail("prefetch", exc)
        finally:
            self._finish(job)

    async def _prefetch_tp(self, job: PrefetchJob) -> None:
        """Task (TP): the same phases, each result proposed to and applied by the tick.

        A failure here proposes 0 (a miss on this rank makes it a miss on all).
        Cancellation (cache closing): reserved pages are freed; nothing is inserted.
        """
        try:
            answered = await self._propose(job, self._count_present(job))
            if job.reserved is not None and not job.done.is_set():
                await self._propose(job, self._read(job, job.reserved))
            elif answered:
                # NOTE: no read follows the agreed count: this rank's exists was the call.
                # Recorded only where its own count was short, a rank whose store had the
                # pages (another's had not) left a half-open breaker's probe undecided
                self.breaker.record_success()
        finally:
            if not job.done.is_set():  # cancelled before the tick finished it
                self._finish(job)

    async def _propose(self, job: PrefetchJob, work: Awaitable[int]) -> bool:
        """Propose `work`'s result (0 if it failed: a miss here is a miss on every rank) and
        wait for the tick to apply the agreed one; whether `work` succeeded."""
        ok = True
        try:
            job.proposal = await work
        except Exception as exc:
            self._fail("prefetch", exc)
            job.proposal, ok = 0, False
        self.kick()
        if not self.tp_stopped:  # else no tick will agree: `_prefetch_tp` finishes the job
            await job.agreed.wait()
        job.agreed = anyio.Event()
        return ok

    async def _count_present(self, job: PrefetchJob) -> int:
        tail = [k.hex() for k in job.keys[job.start_page:]]
        # NOTE: its success is recorded by the caller, only where no read follows (the
        # read's outcome is the prefetch's): recorded before every read, it reset the
        # failures in a row, and a store whose reads all failed while EXISTS answered
        # (replies over its output buffer limit) never opened the breaker
        count: int = await self.backend.exists(tail)
        return count

    def _on_count(self, job: PrefetchJob, count: int) -> bool:
        """Sync: L3 has `count` pages; reserve host pages for them. False: nothing to read."""
        if count * self.config.page_size < max(self.config.l3.prefetch_threshold, 1):
            self.counters.prefetch_misses += 1
            self._misses.add(job.keys[job.miss_page], self._now())
            return False
        # NOTE: at least a page: an L2 of one page had a budget of none (L3 never read)
        budget = max(1, int(self.host_pool.num_pages * self.config.l3.prefetch_host_fraction))
        held = sum(len(p) for p in self.reserved_host.values())
        count = min(count, budget - held)
        if count <= 0:
            return False
        job.reserved = self.tree.alloc_host(count)
        if job.reserved is None and self.tree.host_alloc.num_free:
            # NOTE: the leading pages that fit (evicting did what it could): all or nothing,
            # a host full of pages the device also holds turned every prefetch away
            job.reserved = self.tree.host_alloc.alloc(self.tree.host_alloc.num_free)
        if job.reserved is None:
            return False
        self.reserved_host[id(job)] = job.reserved
        return True

    async def _read(self, job: PrefetchJob, pages: PageIds) -> int:
        """Read the job's pages into the reserved host `pages`; how many leading ones arrived.

        Cancellation: the pages are left reserved (the caller frees them, never inserted),
        and only once nothing writes them any more: the backend writes no buffer after its
        call ends, and a scatter in flight runs to its end first.
        """
        keys = [k.hex() for k in job.keys[job.start_page:job.start_page + len(pages)]]
        buffers = _PageBuffers(self.host_pool, pages)
        start = time.perf_counter()
        ok = await self.backend.get_into(keys, buffers.views)
        arrived = next((i for i, good in enumerate(ok) if not good), len(ok))
        await buffers.scatter(arrived)
        self.histograms.observe_load(arrived * self.config.page_bytes,
                                     time.perf_counter() - start)
        self.breaker.record_success()
        return arrived

    def _on_arrived(self, job: PrefetchJob, arrived: int) -> None:
        """Sync: the first `arrived` reserved pages hold verified KV; insert them."""
        pages, job.reserved = job.reserved, None
        assert pages is not None
        self.reserved_host.pop(id(job), None)
        end = (job.start_page + arrived) * self.config.page_size
        nodes: list[Node] = []
        unused: list[PageIds] = []
        if arrived:
            nodes, unused = self.tree.insert_host(job.tokens[:end], pages[:arrived],
                                                  start_page=job.start_page, hashes=job.keys)
        for spare in [*unused, pages[arrived:]]:
            if len(spare):
                self.tree.host_alloc.free(spare)
        job.inserted = sum(n.num_pages for n in nodes)
        self.counters.prefetches += bool(job.inserted)  # "prefetches that inserted pages"
        self.counters.prefetched_pages += job.inserted

    def _finish(self, job: PrefetchJob) -> None:
        """Sync: the prefetch is over; unpin, free what was not inserted, wake the waiters."""
        self._inflight.pop((job.keys[job.start_page], job.keys[-1]), None)
        for node in job.held:
            self.tree.release_host(node)
        job.held = []
        if job.reserved is not None:
            self.reserved_host.pop(id(job), None)
            self.tree.host_alloc.free(job.reserved)
            job.reserved = None
        job.done.set()
        self._signal()

    # ------------------------------------------------------------------ backup

    def on_hits(self, path: list[Node]) -> None:
        """`path` was just matched (a hit each): back up the host copies that are due now
        (see `queue_backup`; those still being written are picked when the write settles).

        NOTE: not only at the hit that reaches `backup_threshold`: a backup bypassed while
        the breaker was open, or failed, was then never sent again, and other instances
        recomputed that prefix for ever."""
        self.queue_backup(path)
        if not self.tp and self._tg is not None:
            self._recheck_due(path)

    def _recheck_due(self, path: list[Node]) -> None:
        """Queue for a re-check the nodes of `path` marked stored longer than
        `L3_RECHECK_SECONDS` ago (the first hit after they were marked starts the clock).

        NOTE: a node kept in L1/L2 is never read from L3 here, so nothing else would notice
        the store dropped it (its LRU drops exactly such pages first), and `queue_backup`
        skips pages marked stored: other instances missed this hot prefix for as long as
        this one kept it in memory."""
        now, interval = time.monotonic(), L3_RECHECK_SECONDS
        start = not self._rechecks
        for node in path:
            # (the test most nodes fail first: this runs at every hit, for every node)
            if now - node.checked_at < interval or node.stored is None:
                continue
            if not node.checked_at:
                node.checked_at = now
            elif node.id not in self._rechecks and any(node.stored):
                if len(self._rechecks) >= L3_RECHECK_MAX_NODES:
                    break  # still due at its next hit
                node.checked_at = now
                self._rechecks[node.id] = node
        if start and self._rechecks and self._tg is not None:
            self._tg.start_soon(self._recheck)

    async def _recheck(self) -> None:
        """Task: ask L3 for the queued nodes' pages, one node at a time; mark the pages it
        lost not stored and back them up again. A failure or an open breaker ends the round
        (the nodes are due again at a later hit).

        Cancellation (closing): the nodes left are forgotten; the tree is unchanged.
        """
        try:
            while self._rechecks and self.breaker.state.value == "closed":
                node = next(iter(self._rechecks.values()))
                keys = list(node.hashes or ())
                # (no success recorded: an answered EXISTS says nothing of the reads, see
                # `_count_present`; and no probe is taken, the breaker being closed)
                present = await self.backend.exists([k.hex() for k in keys])
                del self._rechecks[node.id]
                self._on_rechecked(node, keys[present:])
        except Exception as exc:  # a failed re-check is a miss: the marks stay
            self._fail("recheck", exc)
        finally:
            self._rechecks.clear()
            self._signal()

    def _on_rechecked(self, node: Node, lost: list[bytes]) -> None:
        """Sync: L3 lacks the pages with keys `lost` (from the first one it lacks on: pages
        after a hole serve no prefetch, and writing one again costs only the write)."""
        if not lost or not node.alive or node.stored is None or node.hashes is None:
            return
        gone = set(lost)  # by key: the node may have been split meanwhile
        stored = [s and key not in gone for s, key in zip(node.stored, node.hashes,
                                                          strict=True)]
        if stored != node.stored:
            self.tree.mark_stored(node, stored)
            node.backup_hits = 0  # the store took them once: not a refusal to back off from
            self.queue_backup([node])

    def queue_backup(self, nodes: list[Node]) -> None:
        """Back up the settled host copies of `nodes` that are due, later: not all in L3,
        not being backed up, `backup_threshold` hits, and twice the hits of the last try
        (a store that keeps failing or refusing is not asked again on every hit)."""
        threshold = self.config.l3.backup_threshold
        picked = [n for n in nodes if n.alive and n.host_state is HostState.RESIDENT
                  and n.hashes is not None and n.hit_count >= max(threshold, 2 * n.backup_hits)
                  and n.id not in self._backing_nodes and not all(n.stored or ())]
        if not picked or self._tg is None:
            return
        if not self._allow():  # tried again at a later hit: a bypass asks the store nothing
            self.counters.bypassed += 1
            return
        for node in picked:
            node.backup_hits = node.hit_count
            self._backing_nodes.add(node.id)
            self.tree.protect_host(node)  # its host pages stay put until the copy is done
        backup = _Backup(picked)
        self._backing_up.append(backup)
        self._tg.start_soon(self._backup, backup)

    async def _backup(self, backup: _Backup) -> None:
        """Task: store the nodes' pages. Cancellation: the pins are released."""
        nbytes = len(backup.keys) * self.config.page_bytes
        ok: list[bool] = [False] * len(backup.keys)
        try:
            while self._backup_bytes and self._backup_bytes + nbytes > \
                    self.config.l3.backup_max_inflight_bytes:
                await self._backup_room.wait()
            self._backup_bytes += nbytes
            try:
                ok = await self._store(backup)
            finally:
                self._backup_bytes -= nbytes
                self._backup_room.set()
                self._backup_room = anyio.Event()
        except Exception as exc:  # a failed backup loses nothing: the host copy stays
            self._fail("backup", exc)
        except BaseException:  # cancelled (closing): no tick will settle it, release here
            self._on_stored(backup, ok, cancelled=True)
            raise
        if self.tp and not self.tp_stopped:  # the tick applies the prefix every rank stored
            backup.proposal = next((i for i, good in enumerate(ok) if not good), len(ok))
            self.kick()
        else:
            self._on_stored(backup, ok)

    async def _store(self, backup: _Backup) -> list[bool]:
        """Write the backup's pages (TP with MLA: only those this rank writes); per-page
        results, True for a page another rank writes.

        Cancellation: returns (and the caller unpins the pages) only once nothing reads them
        any more: a gather in flight runs to its end first, and so do the backend's reads.
        """
        pages, keys = backup.pages, backup.keys
        mine = [self._writes(k) for k in keys]
        ok = [True] * len(keys)
        pick = [i for i, m in enumerate(mine) if m]
        if pick:
            start = time.perf_counter()
            buffers = _PageBuffers(self.host_pool, pages[pick])
            await buffers.gather()
            done = await self.backend.set_from([keys[i].hex() for i in pick], buffers.views)
            for i, good in zip(pick, done, strict=True):
                ok[i] = bool(good)
            stored = sum(map(bool, done))  # refused pages moved no bytes into L3
            self.histograms.observe_store(stored * self.config.page_bytes,
                                          time.perf_counter() - start)
            self.breaker.record_success()
        else:  # another rank writes these (MLA): nothing was asked of the backend
            self.breaker.release()
        return ok

    def _writes(self, key: bytes) -> bool:
        """Whether this rank writes the page with `key` (MLA pages: one rank, by the key)."""
        if self.config.spec.kind != "mla" or self.config.tp.size == 1:
            return True
        return int.from_bytes(key[:8], "little") % self.config.tp.size == self.config.tp.rank

    def _on_stored(self, backup: _Backup, ok: list[bool], *, cancelled: bool = False) -> None:
        """Sync: record which pages are in L3, release the pins. Pages of a `cancelled`
        backup not known stored count as skipped: the store refused none of them."""
        done = {key for key, good in zip(backup.keys, ok, strict=True) if good}
        for node in backup.nodes:
            if node.alive and node.hashes is not None:
                was = node.stored or [False] * node.num_pages
                self.tree.mark_stored(node, [bool(a) or key in done for a, key in zip(
                    was, node.hashes, strict=True)])
        for key in done:  # stored now: a negative-cache entry for it would hide a real hit
            self._misses.discard(key)
        self.counters.backed_up_pages += sum(ok)
        if cancelled:
            self.counters.backups_skipped += len(ok) - sum(ok)
        else:
            self.counters.backup_failed_pages += len(ok) - sum(ok)
        self._backing_up.remove(backup)
        for node in backup.nodes:
            self._backing_nodes.discard(node.id)
            self.tree.release_host(node)
        self._signal()

    def _on_split(self, node: Node, upper: Node) -> None:
        if node.id in self._backing_nodes:
            self._backing_nodes.add(upper.id)
        for group in self.backup_holds():
            if any(n is node for n in group):
                group.append(upper)

    def backup_holds(self) -> list[list[Node]]:
        """Node groups whose host pages a backup or prefetch holds (for invariant checks)."""
        return [*(b.nodes for b in self._backing_up),
                *(job.held for job in self._inflight.values())]

    # ------------------------------------------------------------------ health

    @property
    def idle(self) -> bool:
        return not self._inflight and not self._backing_up and not self._rechecks

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
        self.kick()  # a fetch waiting for this prefetch (or for host pages) may go on

    async def drain(self) -> None:
        """Wait until no prefetch or backup is in flight. Cancellation: only the wait."""
        while not self.idle:
            await self._changed.wait()

    def _fail(self, what: str, exc: Exception) -> None:
        self.counters.errors += 1
        self.breaker.record_failure()
        extra = {"tier": "L3", "event": "l3_failure", "op": what, "error": type(exc).__name__,
                 "breaker": self.breaker.state.value}
        if isinstance(exc, HiCacheError | OSError):
            log.warning("L3 %s failed (a miss): %r", what, exc, extra=extra)
        else:  # not a backend failure: a bug, made loud, but still only a miss
            log.exception("L3 %s failed unexpectedly (a miss)", what, extra=extra)

    @property
    def degraded(self) -> bool:
        return self.breaker.state.value != "closed"

    async def aclose(self) -> None:
        """Close the backend if the cache built it from a URL (objects passed in are not)."""
        if self._owns_backend:
            await self.backend.aclose()
