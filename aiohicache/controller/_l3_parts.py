"""The storage tier's parts: its jobs, counters, negative cache and page buffers."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import anyio.to_thread
import numpy as np
import torch

from .._concurrency import finish_then_cancel
from ..config import HiCacheConfig
from ..memory import HostPool, PageIds
from ..radix import Node
from ..radix._tree import Tokens
from ..storage import PageFormat, chain_keys, namespace_root

__all__ = ("OFFLOAD_HASH_TOKENS", "TP_SLOTS", "PageKeys", "PrefetchJob", "StorageCounters",
           "page_format", "shard")

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
    """Pages of backups `aclose` cancelled (not refused by the store: not failed)."""
    errors: int = 0
    bypassed: int = 0


class PrefetchJob:
    """One prefetch of the pages ``start_page..`` of `tokens`; `done` gives pages inserted."""

    __slots__ = ("agreed", "done", "held", "inserted", "keys", "miss_page", "proposal",
                 "reserved", "start_page", "tokens")

    def __init__(self, tokens: Tokens, start_page: int, keys: list[bytes],
                 miss_page: int) -> None:
        self.tokens = tokens
        self.start_page = start_page
        self.keys = keys
        self.miss_page = miss_page
        """The first page past the L1+L2 match: the negative cache's key when L3 has too
        few pages (not `start_page`, which may be a device-only page of a shared prompt)."""
        self.inserted = 0
        self.held: list[Node] = []
        """Host-only nodes of the match, pinned so reserving host pages cannot evict them."""
        self.done: anyio.Event = anyio.Event()
        self.reserved: PageIds | None = None
        """Host pages reserved for the read, not yet in the tree."""
        self.proposal: int | None = None
        """TP: this rank's result of the current phase, waiting for the tick."""
        self.agreed: anyio.Event = anyio.Event()


class _Backup:
    """Host pages of `nodes` going to L3; `proposal` (TP) is the count of leading pages done.

    Keys and pages are taken when the backup is queued: a node may be split meanwhile (its
    upper part then joins `nodes`, see `StorageTier._on_split`), but its pages stay put.
    """

    __slots__ = ("keys", "nodes", "pages", "proposal")

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.keys = [k for n in nodes for k in (n.hashes or ())]
        self.pages = np.concatenate([n.host_pages for n in nodes if n.host_pages is not None])
        self.proposal: int | None = None


TP_SLOTS = 8
"""Prefetches (per phase) and backups whose results one consensus tick can agree on."""



class _MissCache:
    """The negative cache: the first page key of each prefix L3 lacked, with when it missed.

    An OrderedDict, oldest first. `add` moves its key to the end, then drops from the front
    the entries that are no longer live and the oldest past `max_entries`: O(1) amortised,
    never more than `max_entries`. With one TTL and a clock that does not go back, oldest is
    first to expire, so no expired entry outlives the next `add`.

    An entry is live for `ttl` seconds from its miss; one from the future (TP's agreed wall
    clock stepped back) counts as expired. Lookups never mutate: it changes only in steps
    every TP rank runs in the same order with the agreed clock (`_on_count`, `_on_stored`),
    so the ranks' copies stay identical.
    """

    __slots__ = ("_since", "max_entries", "ttl")

    def __init__(self, *, ttl: float, max_entries: int) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._since: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._since)

    def hit(self, key: bytes, now: float) -> bool:
        """Whether `key` missed within the last `ttl` seconds."""
        since = self._since.get(key)
        return since is not None and self._live(since, now)

    def add(self, key: bytes, now: float) -> None:
        """Record that L3 lacked `key` at `now`, then prune."""
        self._since.pop(key, None)
        if self.ttl > 0:
            self._since[key] = now
        self._prune(now)

    def discard(self, key: bytes) -> None:
        self._since.pop(key, None)

    def _live(self, since: float, now: float) -> bool:
        return 0 <= now - since < self.ttl

    def _prune(self, now: float) -> None:
        since = self._since
        while since and (len(since) > self.max_entries
                         or not self._live(next(iter(since.values())), now)):
            since.popitem(last=False)


def shard(config: HiCacheConfig) -> tuple[int, int]:
    """The (rank, size) naming this rank's L3 objects: MLA KV is the same on every rank, so
    its objects are shared by all ranks (and by caches of any TP size)."""
    return (0, 1) if config.spec.kind == "mla" else (config.tp.rank, config.tp.size)


def page_format(config: HiCacheConfig) -> PageFormat:
    """The `PageFormat` a cache with `config` stores and expects in L3 (build backend
    objects passed as ``config.storage`` with it)."""
    rank, size = shard(config)
    return PageFormat.make(namespace=f"{config.namespace}|tp={rank}/{size}",
                           spec_fingerprint=f"{config.spec.fingerprint()}|{config.host_layout}",
                           page_size=config.page_size, payload_bytes=config.page_bytes)


class _PageBuffers:
    """Byte views of host pages for a backend; a staging copy when pages aren't contiguous.

    page_first pages are contiguous, so backends read and write the pool directly. For
    layer_first a page is spread over layers: it is gathered into (`gather`) or scattered
    from (`scatter`) a staging buffer. NOTE: on a worker thread: a batch is many pages (up
    to `backup_max_inflight_bytes`), and copying it on the loop would stall every request.
    """

    def __init__(self, pool: HostPool, pages: PageIds) -> None:
        self.pool, self.pages = pool, pages
        self.direct = pool.layout == "page_first"
        # One numpy view of the whole buffer, then a row per page: slicing torch tensors page by
        # page cost ~10 us each, milliseconds on the loop for a batch of hundreds of pages.
        if self.direct:
            rows = pool.data.view(torch.uint8).reshape(pool.data.shape[0], -1).numpy()
            self.views = [rows[p].data for p in pages.tolist()]
        else:  # torch.empty only reserves memory: cheap on the loop
            self.staging = torch.empty((len(pages), pool.spec.num_kv, pool.spec.num_layers,
                                        pool.page_size, *pool.spec.row_shape),
                                       dtype=pool.spec.dtype)
            rows = self.staging.view(torch.uint8).reshape(len(pages), -1).numpy()
            self.views = [rows[i].data for i in range(len(pages))]

    async def gather(self) -> None:
        """Copy the pages into the staging buffer (layer_first only).

        Cancellation: the copy runs to its end, then the cancellation propagates (the
        caller's pins outlive every read of the pages).
        """
        if not self.direct:
            await _on_thread(_gather, self.pool, self.pages, self.staging)

    async def scatter(self, count: int) -> None:
        """Move the first `count` staged pages into the pool (layer_first only).

        Cancellation: the copy runs to its end, then the cancellation propagates (the
        caller frees the pages only after every write to them).
        """
        if not self.direct and count:
            await _on_thread(_scatter, self.pool, self.pages[:count], self.staging[:count])


async def _on_thread(fn: Callable[[HostPool, PageIds, torch.Tensor], None], pool: HostPool,
                     pages: PageIds, staging: torch.Tensor) -> None:
    """`fn(pool, pages, staging)` on a worker thread, run to its end even if the caller is
    cancelled meanwhile (torch copies release the GIL: the loop keeps running)."""
    await finish_then_cancel(anyio.to_thread.run_sync(fn, pool, pages, staging))


def _gather(pool: HostPool, pages: PageIds, staging: torch.Tensor) -> None:
    """Copy layer_first host `pages` into `staging`, one page after another (any thread)."""
    staging.copy_(pool.data[:, :, torch.from_numpy(pages)].permute(
        2, 0, 1, 3, *range(4, pool.data.dim())))


def _scatter(pool: HostPool, pages: PageIds, staging: torch.Tensor) -> None:
    """Copy the staged pages into layer_first host `pages` (any thread)."""
    pool.data[:, :, torch.from_numpy(pages)] = staging.permute(
        1, 2, 0, 3, *range(4, staging.dim()))


def _leading(agreed: list[int]) -> Iterator[int]:
    """The agreed values up to the first slot some rank has no result for."""
    for value in agreed:
        if value < 0:
            return
        yield value


OFFLOAD_HASH_TOKENS = 8192
"""From this many tokens a request's page keys are hashed off the loop (about 0.8 ms of
hashing on the 2-core VM; 100k tokens take 9.5 ms, which the loop would stall for)."""


class PageKeys:
    """The L3 keys of token pages: a chain of hashes from a root that names the namespace,
    KV spec, page size, host layout and TP shard (`storage.keys`)."""

    def __init__(self, config: HiCacheConfig) -> None:
        rank, size = shard(config)
        self.page_size = config.page_size
        self.root = namespace_root(namespace=config.namespace,
                                   spec_fingerprint=config.spec.fingerprint(),
                                   page_size=config.page_size, layout=config.host_layout,
                                   tp_rank=rank, tp_size=size)

    def keys(self, tokens: Tokens, path: list[Node],
             hashed: list[bytes] | None = None) -> list[bytes]:
        """Keys of every whole page of `tokens`, reusing those of the matched `path`, or of
        `hashed` (`hash_pages` of a prefix of these tokens: the fetched ones)."""
        if hashed is not None and len(hashed) >= len(tokens) // self.page_size:
            return hashed[:len(tokens) // self.page_size]
        known: list[bytes] = []
        for node in path:
            if node.hashes is None:
                break
            known.extend(node.hashes)
        if hashed is not None and len(hashed) > len(known):
            # NOTE: a commit that extends the fetched tokens (decoded ones with them) hashes
            # the extension only: from the path's keys, a 128k-token miss was hashed again
            # whole, on the loop (24 ms)
            known = list(hashed)
        prev = known[-1] if known else self.root
        start = len(known) * self.page_size
        return known + chain_keys(prev, tokens[start:], self.page_size)

    async def hash_pages(self, tokens: Tokens) -> list[bytes] | None:
        """The keys of all whole pages of `tokens`, hashed on a worker thread, for a prompt
        long enough that hashing it on the loop would stall it (~0.1 us a token); None for
        a shorter one (`keys` then hashes what the tree does not know yet, on the loop).

        Keys are a pure function of the tokens, so they stay right whatever the tree does
        meanwhile. Cancellation: delivered once the thread has finished hashing (anyio waits
        for it: about 0.1 us a token).
        """
        if len(tokens) < OFFLOAD_HASH_TOKENS:
            return None
        whole = tokens[:len(tokens) // self.page_size * self.page_size]
        return await anyio.to_thread.run_sync(chain_keys, self.root, whole, self.page_size)
