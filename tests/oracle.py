"""An independent single-tier prefix LRU simulator: the reference the cache is checked against.

It imports nothing from aiohicache on purpose. It keeps a prefix tree at page granularity
(a page is named by its whole prefix, interned as ``(parent page, label)``) and follows
these rules for each request, exactly:

1. Match the longest run of leading full pages that are all cached; hit tokens are the
   matched pages times ``page_size``. Touch the matched pages (a new tick).
2. ``need`` = the request's full pages minus the matched ones. If ``need`` exceeds
   ``capacity - matched``, nothing is inserted. Otherwise evict until ``need`` pages are
   free: always a leaf (a cached page with no cached child) that is not one of this
   request's matched pages, the smallest ``last_access`` first, the deepest first on ties.
3. Insert the ``need`` new pages, then touch all of the request's full pages with one new
   tick (so new and matched pages share the newest tick).

Eviction candidates live in a lazy min-heap keyed by ``(last_access, -depth, page)``: an
entry is stale once its page is evicted, gains a cached child or is touched again, and is
dropped when popped. The heap is rebuilt when stale entries outnumber live pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

_Entry = tuple[int, int, int]  # (last_access, -depth, page)

_ROOT = -1


class PrefixLRU:
    """A page-granular prefix-tree LRU cache of ``capacity`` pages (None: unbounded).

    Args:
        capacity: pages the cache holds; ``None`` for an infinite cache.
        page_size: tokens per page (only used by `serve`, which works on tokens).
        record: keep the evicted pages, in order, in `evictions` (as page ids).
    """

    def __init__(self, capacity: int | None, *, page_size: int = 1, record: bool = False) -> None:
        self.capacity = capacity
        self.page_size = page_size
        self.used = 0
        self.evictions: list[int] | None = [] if record else None
        self._tick = 0
        self._ids: dict[tuple[int, Hashable], int] = {}
        self._parent: list[int] = []
        self._label: list[Hashable] = []
        self._depth: list[int] = []
        self._last: list[int] = []
        self._num_children: list[int] = []  # cached children only
        self._cached: list[bool] = []
        self._heap: list[_Entry] = []

    # -- requests -------------------------------------------------------------------------

    def serve(self, tokens: Sequence[int], *, slot_pages: bool = False) -> int:
        """Serve one request of `tokens`; return its hit tokens (whole matched pages).

        With `slot_pages`, the request works as a serving engine's does: it needs device
        slots for every token it computes, a trailing partial page included, so eviction
        frees ``ceil(computed tokens / page_size)`` pages although only whole pages are
        inserted. If that many cannot be freed, every unpinned page is evicted trying, and
        nothing is inserted (unless it exceeds the whole capacity: then nothing changes).
        """
        ps = self.page_size
        labels = [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) // ps * ps, ps)]
        path = self._path(labels)
        if not slot_pages:
            return self._serve(path) * ps
        return self._serve_with_slots(path, len(tokens)) * ps

    def _serve_with_slots(self, path: list[int], num_tokens: int) -> int:
        cached, ps = self._cached, self.page_size
        matched = 0
        while matched < len(path) and cached[path[matched]]:
            matched += 1
        pin_tick = self._touch(path[:matched])
        slots = -(-(num_tokens - matched * ps) // ps)
        if self.capacity is not None and slots:
            if slots > self.capacity:
                return matched
            if slots > self.capacity - matched:  # cannot fit beside the pinned prefix
                self._evict(self.used - matched, pin_tick)
                return matched
            self._evict(slots - (self.capacity - self.used), pin_tick)
        for page in path[matched:]:
            self._insert(page)
        self._touch(path)
        return matched

    def serve_blocks(self, hash_ids: Sequence[Hashable], num_full_blocks: int) -> int:
        """Serve a request given as block hash ids, one page each; return its hit pages.

        Only the first `num_full_blocks` ids are cacheable pages (a partial last block is
        not). Ids are labels under their parent page, so prefix-chained ids are not needed.
        """
        return self._serve(self._path(hash_ids[:num_full_blocks]))

    def _path(self, labels: Sequence[Hashable]) -> list[int]:
        """Page ids of the pages named by `labels` from the root, interning new ones."""
        ids = self._ids
        path: list[int] = []
        parent = _ROOT
        for label in labels:
            page = ids.get((parent, label))
            if page is None:
                page = ids[parent, label] = self._new_page(parent, label)
            path.append(page)
            parent = page
        return path

    def _new_page(self, parent: int, label: Hashable) -> int:
        self._parent.append(parent)
        self._label.append(label)
        self._depth.append(1 if parent == _ROOT else self._depth[parent] + 1)
        self._last.append(0)
        self._num_children.append(0)
        self._cached.append(False)
        return len(self._parent) - 1

    def _serve(self, path: list[int]) -> int:
        cached = self._cached
        matched = 0
        while matched < len(path) and cached[path[matched]]:
            matched += 1
        pin_tick = self._touch(path[:matched])
        need = len(path) - matched
        if self.capacity is not None:
            if need > self.capacity - matched:
                return matched
            self._evict(need - (self.capacity - self.used), pin_tick)
        for page in path[matched:]:
            self._insert(page)
        self._touch(path)
        return matched

    # -- tree -----------------------------------------------------------------------------

    def _touch(self, pages: list[int]) -> int:
        """Give `pages` a new tick; offer those that are leaves to the heap; return the tick."""
        self._tick += 1
        for page in pages:
            self._last[page] = self._tick
        if pages and self._num_children[pages[-1]] == 0:  # only the deepest can be a leaf
            self._offer(pages[-1])
        return self._tick

    def _insert(self, page: int) -> None:
        assert not self._cached[page] and self._num_children[page] == 0
        self._cached[page] = True
        self.used += 1
        parent = self._parent[page]
        if parent != _ROOT:
            assert self._cached[parent]
            self._num_children[parent] += 1

    def _evict(self, num_pages: int, pin_tick: int) -> None:
        """Evict `num_pages` leaves; pages touched at `pin_tick` (this request's) are kept."""
        pinned: list[_Entry] = []
        while num_pages > 0:
            entry = heapq.heappop(self._heap)  # IndexError: nothing evictable (a bug)
            last, _, page = entry
            if not self._is_candidate(page, last):
                continue
            if last == pin_tick:
                pinned.append(entry)
                continue
            self._remove(page)
            num_pages -= 1
        for entry in pinned:
            heapq.heappush(self._heap, entry)

    def _remove(self, page: int) -> None:
        self._cached[page] = False
        self.used -= 1
        if self.evictions is not None:
            self.evictions.append(page)
        parent = self._parent[page]
        if parent != _ROOT:
            self._num_children[parent] -= 1
            if self._num_children[parent] == 0:
                self._offer(parent)

    def _is_candidate(self, page: int, last: int) -> bool:
        return (self._cached[page] and self._num_children[page] == 0
                and self._last[page] == last)

    def _offer(self, page: int) -> None:
        heapq.heappush(self._heap, (self._last[page], -self._depth[page], page))
        if len(self._heap) > 2 * self.used + 1024:
            self._compact()

    def _compact(self) -> None:
        self._heap = [(self._last[p], -self._depth[p], p) for p in range(len(self._cached))
                      if self._cached[p] and self._num_children[p] == 0]
        heapq.heapify(self._heap)

    # -- inspection -----------------------------------------------------------------------

    def prefix(self, page: int) -> tuple[Hashable, ...]:
        """The labels from the root down to `page` (hash ids, or one token tuple a page)."""
        labels: list[Hashable] = []
        while page != _ROOT:
            labels.append(self._label[page])
            page = self._parent[page]
        return tuple(reversed(labels))

    def tokens_of(self, page: int) -> tuple[int, ...]:
        """All tokens up to and including `page` (for pages made by `serve`)."""
        return tuple(t for label in self.prefix(page) for t in label)  # type: ignore[attr-defined]

    def cached_prefixes(self) -> set[tuple[Hashable, ...]]:
        """The prefix of every cached page (for exact state assertions in tests)."""
        return {self.prefix(p) for p in range(len(self._cached)) if self._cached[p]}

    def check(self) -> None:
        """Assert the tree's invariants: prefix closure, child counts, usage, capacity."""
        counts = [0] * len(self._cached)
        for page, is_cached in enumerate(self._cached):
            parent = self._parent[page]
            if is_cached and parent != _ROOT:
                assert self._cached[parent], "a cached page's parent is not cached"
                counts[parent] += 1
        assert counts == self._num_children
        assert self.used == sum(self._cached)
        assert self.capacity is None or self.used <= self.capacity
