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
  `storage_miss_ttl` seconds. The fetch waits per `prefetch_policy`; a prefetch it stops
  waiting for still completes and serves later requests.
- **Backup (L2 -> L3).** When a write-through settles, nodes with enough hits are queued for
  backup, never on a request's path; backups run concurrently under
  `backup_max_inflight_bytes`, and each page's result is recorded (`Node.stored`).
- **Failures.** A backend error or a page that fails its checksum is a miss. Repeated errors
  open a breaker: L3 is bypassed for `storage_cooldown` seconds while L1/L2 keep serving, and
  `stats()` shows it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import anyio
import numpy as np
import torch
from anyio.abc import TaskGroup

from .config import HiCacheConfig
from .errors import HiCacheError
from .memory import HostPool, PageIds
from .radix import HostState, Node, RadixTree
from .radix._tree import Tokens
from .storage import PageFormat, StorageBackend, chain_keys, namespace_root
from .storage.factory import backend_from_url
from .storage.faults import Breaker

__all__ = ("PrefetchJob", "StorageCounters", "StorageTier", "page_format")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StorageCounters:
    """L3 counters for `HiCache.stats()` (pages unless named)."""

    prefetches: int = 0
    prefetched_pages: int = 0
    prefetch_misses: int = 0
    negative_hits: int = 0
    backed_up_pages: int = 0
    backup_failed_pages: int = 0
    backups_skipped: int = 0
    errors: int = 0
    bypassed: int = 0


class PrefetchJob:
    """One prefetch of the pages ``start_page..`` of `tokens`; `done` gives pages inserted."""

    __slots__ = ("done", "held", "inserted", "keys", "start_page", "tokens")

    def __init__(self, tokens: Tokens, start_page: int, keys: list[bytes]) -> None:
        self.tokens = tokens
        self.start_page = start_page
        self.keys = keys
        self.inserted = 0
        self.held: list[Node] = []
        """Host-only nodes of the match, pinned so reserving host pages cannot evict them."""
        self.done: anyio.Event = anyio.Event()


def page_format(config: HiCacheConfig) -> PageFormat:
    """The `PageFormat` a cache with `config` stores and expects in L3 (build backend
    objects passed as ``config.storage`` with it)."""
    return PageFormat.make(namespace=f"{config.namespace}|tp={config.tp_rank}/{config.tp_size}",
                           spec_fingerprint=f"{config.spec.fingerprint()}|{config.host_layout}",
                           page_size=config.page_size, payload_bytes=config.page_bytes)


class StorageTier:
    """Prefetch and backup for one cache (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, tree: RadixTree, host_pool: HostPool) -> None:
        self.config = config
        self.tree = tree
        self.host_pool = host_pool
        ps = config.page_size
        self.fmt = page_format(config)
        self.root = namespace_root(namespace=config.namespace,
                                   spec_fingerprint=config.spec.fingerprint(), page_size=ps,
                                   layout=config.host_layout, tp_rank=config.tp_rank,
                                   tp_size=config.tp_size)
        self.backend: StorageBackend = backend_from_url(config.storage, self.fmt)  # type: ignore[arg-type]
        self._owns_backend = isinstance(config.storage, str)  # an object passed in is the caller's
        self.breaker = Breaker(failures_to_open=config.storage_failures_to_open,
                               cooldown_s=config.storage_cooldown)
        self.counters = StorageCounters()
        self.reserved_host: dict[int, PageIds] = {}  # prefetch id -> host pages not in tree
        self._inflight: dict[bytes, PrefetchJob] = {}
        self._misses: dict[bytes, float] = {}
        self._backing_up: list[list[Node]] = []
        self._backup_bytes = 0
        self._backup_room = anyio.Event()
        self._tg: TaskGroup | None = None
        self._changed = anyio.Event()

    # ------------------------------------------------------------------ keys

    def keys(self, tokens: Tokens, path: list[Node]) -> list[bytes]:
        """Keys of every whole page of `tokens`, reusing those of the matched `path`."""
        known: list[bytes] = []
        for node in path:
            if node.hashes is None:
                break
            known.extend(node.hashes)
        prev = known[-1] if known else self.root
        start = len(known) * self.config.page_size
        return known + chain_keys(prev, tokens[start:], self.config.page_size)

    # ------------------------------------------------------------------ prefetch

    def start(self, tg: TaskGroup) -> None:
        self._tg = tg

    def plan_prefetch(self, tokens: Tokens, path: list[Node]) -> PrefetchJob | None:
        """A prefetch for the pages after `path` (the L1+L2 match), or None.

        Joins a running prefetch of the same pages (single flight).
        """
        ps, cfg = self.config.page_size, self.config
        start = sum(n.num_pages for n in path)
        tail_pages = len(tokens) // ps - start
        if self._tg is None or tail_pages * ps < max(cfg.prefetch_threshold, 1):
            return None
        if not self.breaker.allow():
            self.counters.bypassed += 1
            return None
        keys = self.keys(tokens, path)
        first = keys[start]
        if (job := self._inflight.get(first)) is not None:
            return job
        if self._misses.get(first, 0.0) > time.monotonic():
            self.counters.negative_hits += 1
            self.breaker.record_success()  # nothing was asked: release a half-open probe
            return None
        job = PrefetchJob(tokens[:len(tokens) // ps * ps], start, keys)
        job.held = [n for n in path if not n.on_device]
        for node in job.held:
            self.tree.protect_host(node)
        self._inflight[first] = job
        self._tg.start_soon(self._prefetch, job)
        return job

    async def wait(self, job: PrefetchJob, num_tokens: int) -> None:
        """Wait for `job` as the policy says. Cancellation: only the wait stops."""
        policy = self.config.prefetch_policy
        if policy == "best_effort":
            return
        timeout = math.inf if policy == "wait_complete" else \
            self.config.prefetch_timeout(num_tokens)
        with anyio.move_on_after(timeout):
            await job.done.wait()

    async def _prefetch(self, job: PrefetchJob) -> None:
        """Task: exists -> reserve host pages -> get_into -> insert what arrived.

        Cancellation (cache closing): reserved pages are freed; nothing is inserted.
        """
        first = job.keys[job.start_page]
        reserved: PageIds | None = None
        try:
            count = await self._count_present(job)
            reserved = self._reserve(job, count)
            if reserved is not None:
                arrived = await self._read(job, reserved)
                pages, reserved = reserved, None
                self._insert(job, pages, arrived)
        except Exception as exc:  # any failure of a prefetch is a miss, never a crash
            self._fail("prefetch", exc)
        finally:
            del self._inflight[first]
            for node in job.held:
                self.tree.release_host(node)
            job.held = []
            job.done.set()
            self._signal()
            if reserved is not None:
                self._unreserve(job, reserved)

    async def _count_present(self, job: PrefetchJob) -> int:
        tail = [k.hex() for k in job.keys[job.start_page:]]
        count = await self.backend.exists(tail)
        self.breaker.record_success()
        if count * self.config.page_size < max(self.config.prefetch_threshold, 1):
            self.counters.prefetch_misses += 1
            self._misses[job.keys[job.start_page]] = time.monotonic() + \
                self.config.storage_miss_ttl
            return 0
        return count

    def _reserve(self, job: PrefetchJob, count: int) -> PageIds | None:
        budget = int(self.host_pool.num_pages * self.config.prefetch_host_fraction)
        held = sum(len(p) for p in self.reserved_host.values())
        count = min(count, budget - held)
        if count <= 0:
            return None
        pages = self.tree.alloc_host(count)
        if pages is not None:
            self.reserved_host[id(job)] = pages
        return pages

    def _unreserve(self, job: PrefetchJob, pages: PageIds) -> None:
        self.reserved_host.pop(id(job), None)
        self.tree.host_alloc.free(pages)

    async def _read(self, job: PrefetchJob, pages: PageIds) -> int:
        keys = [k.hex() for k in job.keys[job.start_page:job.start_page + len(pages)]]
        with _PageBuffers(self.host_pool, pages, fill=False) as buffers:
            ok = await self.backend.get_into(keys, buffers.views)
            arrived = next((i for i, good in enumerate(ok) if not good), len(ok))
            buffers.flush(arrived)
        self.breaker.record_success()
        return arrived

    def _insert(self, job: PrefetchJob, pages: PageIds, arrived: int) -> None:
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
        self.counters.prefetches += 1
        self.counters.prefetched_pages += job.inserted

    # ------------------------------------------------------------------ backup

    def queue_backup(self, nodes: list[Node]) -> None:
        """Back up the settled host copies of `nodes` (those with enough hits), later."""
        picked = [n for n in nodes if n.alive and n.host_state is HostState.RESIDENT
                  and n.hashes is not None and n.hit_count >= self.config.backup_threshold
                  and not all(n.stored or ())]
        if not picked or self._tg is None:
            return
        if not self.breaker.allow():
            self.counters.bypassed += 1
            return
        for node in picked:
            self.tree.protect_host(node)  # its host pages stay put until the copy is done
        self._backing_up.append(picked)
        self._tg.start_soon(self._backup, picked)

    async def _backup(self, nodes: list[Node]) -> None:
        """Task: store the nodes' pages. Cancellation: the pins are released."""
        nbytes = sum(n.num_pages for n in nodes) * self.config.page_bytes
        try:
            while self._backup_bytes and self._backup_bytes + nbytes > \
                    self.config.backup_max_inflight_bytes:
                await self._backup_room.wait()
            self._backup_bytes += nbytes
            try:
                await self._store(nodes)
            finally:
                self._backup_bytes -= nbytes
                self._backup_room.set()
                self._backup_room = anyio.Event()
        except Exception as exc:  # a failed backup loses nothing: the host copy stays
            self._fail("backup", exc)
        finally:
            self._backing_up.remove(nodes)
            for node in nodes:
                self.tree.release_host(node)
            self._signal()

    async def _store(self, nodes: list[Node]) -> None:
        pages = np.concatenate([n.host_pages for n in nodes if n.host_pages is not None])
        keys = [k.hex() for n in nodes for k in (n.hashes or ())]
        with _PageBuffers(self.host_pool, pages, fill=True) as buffers:
            ok = await self.backend.set_from(keys, buffers.views)
        self.breaker.record_success()
        at = 0
        for node in nodes:
            done = ok[at:at + node.num_pages]
            at += node.num_pages
            node.stored = [bool(a) or bool(b) for a, b in zip(
                node.stored or [False] * node.num_pages, done, strict=True)]
        for key, good in zip(keys, ok, strict=True):
            if good:  # stored now: a negative-cache entry for it would hide a real hit
                self._misses.pop(bytes.fromhex(key), None)
        self.counters.backed_up_pages += sum(ok)
        self.counters.backup_failed_pages += len(ok) - sum(ok)

    def backup_holds(self) -> list[list[Node]]:
        """Node groups whose host pages a backup or prefetch holds (for invariant checks)."""
        return [*self._backing_up, *(job.held for job in self._inflight.values())]

    # ------------------------------------------------------------------ health

    @property
    def idle(self) -> bool:
        return not self._inflight and not self._backing_up

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def drain(self) -> None:
        """Wait until no prefetch or backup is in flight. Cancellation: only the wait."""
        while not self.idle:
            await self._changed.wait()

    def _fail(self, what: str, exc: Exception) -> None:
        self.counters.errors += 1
        self.breaker.record_failure()
        if isinstance(exc, HiCacheError | OSError):
            log.warning("L3 %s failed (a miss): %r", what, exc)
        else:  # not a backend failure: a bug, made loud, but still only a miss
            log.exception("L3 %s failed unexpectedly (a miss)", what)

    @property
    def degraded(self) -> bool:
        return self.breaker.state.value != "closed"

    async def aclose(self) -> None:
        """Close the backend if the cache built it from a URL (objects passed in are not)."""
        if self._owns_backend:
            await self.backend.aclose()


class _PageBuffers:
    """Byte views of host pages for a backend; a staging copy when pages aren't contiguous.

    page_first pages are contiguous, so backends read and write the pool directly. For
    layer_first a page is spread over layers: it is gathered into (`fill`) or scattered from
    (`flush`) a staging buffer.
    """

    def __init__(self, pool: HostPool, pages: PageIds, *, fill: bool) -> None:
        self.pool, self.pages = pool, pages
        self.direct = pool.layout == "page_first"
        if self.direct:
            raw = [pool.data[int(p)].view(torch.uint8).reshape(-1) for p in pages]
        else:
            self.staging = torch.empty((len(pages), pool.spec.num_kv, pool.spec.num_layers,
                                        pool.page_size, *pool.spec.row_shape),
                                       dtype=pool.spec.dtype)
            if fill:
                self.staging.copy_(pool.data[:, :, torch.from_numpy(pages)].permute(
                    2, 0, 1, 3, *range(4, pool.data.dim())))
            raw = [self.staging[i].view(torch.uint8).reshape(-1) for i in range(len(pages))]
        self.views = [t.numpy().data for t in raw]

    def flush(self, count: int) -> None:
        """Move the first `count` staged pages into the pool (layer_first only)."""
        if self.direct or count == 0:
            return
        idx = torch.from_numpy(self.pages[:count])
        self.pool.data[:, :, idx] = self.staging[:count].permute(
            1, 2, 0, 3, *range(4, self.staging.dim()))

    def __enter__(self) -> _PageBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.views = []

