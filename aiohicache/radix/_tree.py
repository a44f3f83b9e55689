"""The radix tree over token pages: match, insert, pin, evict. Synchronous and I/O-free.

Every method mutates the tree and the two page allocators to a consistent state before it
returns; the async controller then moves bytes according to what the method reported. Only the
event loop calls the tree, so it takes no lock (design rule 1). Node state and the eviction
queues live in the base class (`_state.TreeState`), what the queries return in `_results`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvariantError
from ..memory import PageAllocator, PageIds
from ._node import DeviceState, HostState, Node, PendingOp
from ._results import (
    Eviction,
    InsertResult,
    Keys,
    Match,
    Tokens,
    as_ids,
    common_tokens,
    compact,
    held_bytes,
    page_bytes,
    same_tokens,
)
from ._state import TreeState

__all__ = ("Eviction", "InsertResult", "Keys", "Match", "RadixTree", "Tokens")


class RadixTree(TreeState):
    """A page-granular radix tree whose nodes record device and host residency.

    Eviction order: each tier has an `EvictionPolicy` (``eviction`` names one for both
    tiers, or a pair: device, host) that keeps its candidates in lazy min-heaps (see
    `TreeState`). Push and pop are O(log n); nothing scans the tree.
    """

    def match(self, tokens: Keys | Sequence[int], *, touch: bool = True) -> Match:
        """Find the longest cached page-aligned prefix of `tokens`.

        A match that ends inside a node splits it at the page boundary, so `path` covers
        exactly the matched pages. With `touch`, matched nodes count a hit and become the most
        recently used.

        NOTE: `tokens` are read as given (int64 ids compared with int32 keys exactly): a
        conversion to keys read and wrote all of them, where the match reads its prefix.
        """
        tokens = as_ids(tokens)
        path: list[Node] = []
        node, pos, end = self.root, 0, len(tokens) - len(tokens) % self.page_size
        while pos < end and (child := self._step(node, tokens, pos)) is not None:
            path.append(child)
            pos += len(child.key)
            node = child
        num_device = 0
        while num_device < len(path) and path[num_device].on_device:
            num_device += 1
        if touch:
            self._touch(path, hit=True)
            if self._learning:
                self._tell_misses(tokens, path, num_device)
        return Match(path, num_device, self.page_size)

    def _tell_misses(self, tokens: Keys, path: list[Node], num_device: int) -> None:
        """Show each tier's policy the pages it lacked: after the device part of the match
        (device), after the whole match (host)."""
        pos = 0
        for i, (policy, end) in enumerate(((self.device_policy, num_device),
                                           (self.host_policy, len(path)))):
            pos += sum(len(n.key) for n in path[num_device if i else 0:end])
            if policy.learns_from_misses:
                policy.on_miss(path[end - 1] if end else self.root, tokens, pos)

    def _step(self, node: Node, tokens: Keys, pos: int) -> Node | None:
        """The child of `node` that matches `tokens` from `pos`, split to the matching pages
        when the match ends inside it; None when no child starts with the next page. After a
        split, the next step finds no child: the mismatching page starts the lower part."""
        child = node.children.get(page_bytes(tokens[pos:pos + self.page_size],
                                             self.key_dtype))
        if child is not None:
            # NOTE: one pass finds both whether the whole key matches and, if not, where
            # it stops (a match, then a second pass for the split, read the key twice)
            common = common_tokens(child.key, tokens, pos)
            if common < len(child.key):
                if common < self.page_size:  # ids beyond int32 keys, wrapped to its page
                    return None
                child = self._split(child, common // self.page_size)
        return child

    def keyed_prefix(self, tokens: Keys | Sequence[int]) -> int:
        """How many leading tokens of `tokens` whole nodes hold with their page keys; read
        only (no split, no touch: a match ending inside a node stops before it)."""
        node, pos, tokens = self.root, 0, as_ids(tokens)
        while (child := node.children.get(page_bytes(tokens[pos:pos + self.page_size],
                                                     self.key_dtype))) is not None \
                and child.hashes is not None \
                and same_tokens(tokens[pos:pos + len(child.key)], child.key):
            pos += len(child.key)
            node = child
        return pos

    def _touch(self, nodes: list[Node], *, hit: bool) -> None:
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock
            if hit:
                self._count_hit(node)
        for node in nodes:
            self._offer(node)

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Keys | Sequence[int], pages: PageIds, *,
               start_page: int = 0, hashes: list[bytes] | None = None,
               under: Node | None = None) -> InsertResult:
        """Insert `tokens` (whole pages) whose KV sits in device `pages` (one per page).

        Pages before `start_page` are the caller's matched prefix and already belong to the
        tree; `under`, if given, is its deepest node (pinned by the caller, so still where
        the match left it): the walk starts there instead of at the root. From `start_page`
        on, pages of a prefix someone else inserted meanwhile are reported as duplicates (the
        caller frees them), except that a host-only node takes the caller's fresh device
        pages. What is left becomes a new leaf. The result lists every node that now holds
        the caller's pages.

        NOTE: from the root, every commit of a decode compared each node of its prefix again
        (a node per page): 12 us a node, 35 ms a commit 3,000 pages into a sequence.
        NOTE: only the tokens after the caller's prefix are converted to keys (`keys`), and
        the new leaf keeps the converted ones: no second copy.
        """
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "tokens and pages disagree"
        res = InsertResult(last_node=None)
        node, start = self._insert_start(under, pages, start_page)
        rest, fresh = self._keys(tokens[start:])
        pos = 0  # in `rest`
        while pos < len(rest) and (child := self._step(node, rest, pos)) is not None:
            self._adopt_or_drop(child, pages, (start + pos) // ps, start_page, res)
            pos += len(child.key)
            node = child
        if pos < len(rest):
            first = (start + pos) // ps
            leaf = self._add_leaf(node, compact(rest[pos:]) if fresh else rest[pos:].copy(),
                                  pages[first:], None if hashes is None else hashes[first:])
            res.new_nodes.append(leaf)
            node = leaf
        res.last_node = node if node is not self.root else None
        for new in res.new_nodes[:-1] if pos < len(rest) else res.new_nodes:
            self._count_hit(new)  # (a new leaf, the last, was made with its hit)
        self._touch(node.path_to_root()[::-1], hit=False)
        return res

    def _insert_start(self, under: Node | None, pages: PageIds,
                      start_page: int) -> tuple[Node, int]:
        """Where `insert` starts walking: the root, or `under` once checked to hold the
        caller's prefix (its `start_page` pages, the caller's own)."""
        if under is None:
            return self.root, 0
        path = under.path_to_root()
        if sum([n.num_pages for n in path]) != start_page or under.device_pages is None \
                or not same_tokens(under.device_pages,
                                   pages[start_page - under.num_pages:start_page]):
            raise InvariantError("insert: the caller's matched prefix is not where "
                                 "these tokens lead (tokens changed since the match?)")
        return under, start_page * self.page_size

    def _adopt_or_drop(self, node: Node, pages: PageIds, first: int, start: int,
                       res: InsertResult) -> None:
        theirs = pages[first:first + node.num_pages]
        if first + node.num_pages <= start:  # the caller's own matched prefix
            if node.device_pages is None or not same_tokens(node.device_pages, theirs):
                raise InvariantError("insert: the caller's matched prefix is not where "
                                     "these tokens lead (tokens changed since the match?)")
            return
        if first < start:
            raise InvariantError("insert: a node straddles the caller's matched prefix")
        if not node.on_device and node.parent is not None and (
                node.parent is self.root or node.parent.on_device):
            self._set_device(node, theirs.copy(), DeviceState.RESIDENT)
            res.new_nodes.append(node)
        else:
            res.duplicate_pages.append(theirs)

    def insert_host(self, tokens: Keys | Sequence[int], host_pages: PageIds, *, start_page: int,
                    hashes: list[bytes]) -> tuple[list[Node], list[PageIds]]:
        """Add host-only pages (fetched from L3) for ``tokens`` pages ``start_page..``.

        `tokens` covers whole pages; `host_pages` holds pages ``start_page`` on. A node from
        `start_page` on that is on the device only gets its host copy from these pages (the
        same keys: the same KV); the pages after the last node become a host-only leaf.
        Returns the nodes given host pages and the host pages not adopted (the caller frees
        them): pages of a prefix already on the host, or everything when the prefix before
        `start_page` is gone or has no host copy (host residency must stay prefix-closed).
        """
        ps, tokens = self.page_size, self.keys(tokens)
        used = np.zeros(len(host_pages), dtype=bool)
        nodes: list[Node] = []
        node, pos = self.root, 0
        while pos < len(tokens) and (child := self._step(node, tokens, pos)) is not None:
            first = pos // ps
            if not child.on_host:
                if first < start_page or not (node is self.root or node.on_host):
                    break
                own = slice(first - start_page, first - start_page + child.num_pages)
                self._adopt_host_copy(child, host_pages[own], hashes[first:])
                used[own] = True
                nodes.append(child)
            pos += len(child.key)
            node = child
        else:
            first = pos // ps
            if first >= start_page and pos < len(tokens) and (
                    node is self.root or node.on_host):
                nodes.append(self._add_host_leaf(node, tokens[pos:],
                                                 host_pages[first - start_page:],
                                                 hashes[first:len(tokens) // ps]))
                used[first - start_page:] = True
        if nodes:
            self._touch(nodes[-1].path_to_root()[::-1], hit=False)
        return nodes, [host_pages[~used]]

    def _adopt_host_copy(self, node: Node, pages: PageIds, hashes: list[bytes]) -> None:
        """Give a device-only `node` its host copy from L3 `pages` (`hashes` from its first
        page on): the same keys, so the same KV; in L3, so stored."""
        self._set_host(node, pages.copy(), HostState.RESIDENT)
        if node.hashes is None:
            node.hashes = hashes[:node.num_pages]
        self.mark_stored(node, [True] * node.num_pages)

    def _add_host_leaf(self, parent: Node, key: Keys, pages: PageIds,
                       hashes: list[bytes]) -> Node:
        """A host-only leaf of L3 `pages` under `parent` (whole pages: `key` and `hashes`)."""
        leaf = Node(id=next(self._ids), parent=parent, key=key.copy(), hashes=hashes,
                    last_access=self._clock + 1)
        parent.children[leaf.key[:self.page_size].tobytes()] = leaf
        self._num_nodes += 1
        self._set_host(leaf, pages.copy(), HostState.RESIDENT)
        self.mark_stored(leaf, [True] * len(hashes))
        return leaf

    def _add_leaf(self, parent: Node, key: Keys, pages: PageIds,
                  hashes: list[bytes] | None) -> Node:
        # NOTE: its keys before it is made resident: the residency hooks (the events hub)
        # read them, and hashed them again on the loop when they came after
        # NOTE: queued with the recency and first hit `insert` gives it next: queued as
        # never used (key 0), each leaf left an entry ahead of every node, and the next
        # eviction popped all of them (100k nodes made since the last: 370 ms of the loop)
        leaf = Node(id=next(self._ids), parent=parent, key=key, hashes=hashes,
                    stored=None if hashes is None else [False] * len(hashes),
                    last_access=self._clock + 1, hit_count=1)
        parent.children[key[:self.page_size].tobytes()] = leaf
        self._num_nodes += 1
        self._set_device(leaf, pages.copy(), DeviceState.RESIDENT)
        return leaf

    def split(self, node: Node, num_pages: int) -> Node:
        """Cut `node` after `num_pages` pages; return the new upper part (node keeps the rest)."""
        return self._split(node, num_pages)

    def _split(self, node: Node, num_pages: int, *, dropped: bool = False) -> Node:
        """Cut `node` after `num_pages` pages; return the new upper part (node keeps the rest).

        `dropped`: node leaves the tree right after (an eviction's trimmed tail), so its key
        and pages stay views of the old ones (nothing outlives it holding them but an
        eviction policy's ghost, which keeps its key `compact`).
        """
        ps, cut = self.page_size, num_pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_pages < node.num_pages
        head, tail = _halves(node.key, cut, dropped=dropped)
        upper = Node(id=next(self._ids), parent=parent, key=head,
                     device_state=node.device_state, host_state=node.host_state,
                     lock_ref=node.lock_ref, host_ref=node.host_ref, hit_count=node.hit_count,
                     last_access=node.last_access, load_op=node.load_op, write_op=node.write_op,
                     backup_hits=node.backup_hits)
        if node.device_pages is not None:
            upper.device_pages, node.device_pages = _cut(node.device_pages, num_pages, dropped)
        if node.host_pages is not None:
            upper.host_pages, node.host_pages = _cut(node.host_pages, num_pages, dropped)
        if node.hashes is not None:
            upper.hashes, node.hashes = node.hashes[:num_pages], node.hashes[num_pages:]
        if node.stored is not None:
            upper.stored, node.stored = node.stored[:num_pages], node.stored[num_pages:]
        if node.load_op is not None or node.write_op is not None:  # (rare: skip the dict)
            for op in {id(o): o for o in (node.load_op, node.write_op)
                       if o is not None}.values():
                op.nodes.append(upper)
        if node.host_ref:  # whoever protects node's host pages now protects upper's too
            for hook in self.on_split:
                hook(node, upper)
        node.key = tail
        node.parent = upper
        upper.children[node.key[:ps].tobytes()] = node
        upper.device_children, upper.host_children = int(node.on_device), int(node.on_host)
        parent.children[upper.key[:ps].tobytes()] = upper
        self._num_nodes += 1
        return upper

    def begin_load(self, node: Node, op: PendingOp, *,
                   write_back: PendingOp | None = None) -> bool:
        """Give host-only `node` device pages and mark it LOADING (op owns it until settled).

        Returns False when the device cannot free enough pages; the node is unchanged then
        (eviction may have happened).
        """
        assert node.host_state is HostState.RESIDENT and not node.on_device
        pages = self.alloc_device(node.num_pages, write_back=write_back)
        if pages is None:
            return False
        self._set_device(node, pages, DeviceState.LOADING)
        node.load_op = op
        self.protect_host(node)
        op.nodes.append(node)
        return True

    def end_load(self, node: Node) -> None:
        assert node.device_state is DeviceState.LOADING
        node.load_op = None
        self.release_host(node)
        self._set_device(node, node.device_pages, DeviceState.RESIDENT)

    def begin_write(self, node: Node, op: PendingOp) -> bool:
        """Give device-resident `node` host pages and mark it WRITING.

        Returns False, changing nothing, when the host cannot free enough pages.
        """
        assert node.on_device and not node.on_host
        assert node.parent is self.root or (node.parent is not None and node.parent.on_host)
        pages = self.alloc_host(node.num_pages)
        if pages is None:
            return False
        self._set_host(node, pages, HostState.WRITING)
        node.write_op = op
        op.nodes.append(node)
        return True

    def end_write(self, node: Node, *, demote: bool = False) -> None:
        """Settle a write; with `demote` (write-back) free the device copy if it is unpinned."""
        assert node.host_state is HostState.WRITING
        node.write_op = None
        self._set_host(node, node.host_pages, HostState.RESIDENT)
        if demote and self._device_candidate(node):
            self._evict_device_node(node, out=Eviction())

    # ------------------------------------------------------------------ allocation & eviction

    def alloc_device(self, num_pages: int, *,
                     write_back: PendingOp | None = None) -> PageIds | None:
        """Allocate device pages, evicting unpinned leaves if needed.

        With a `write_back` op, leaves without a host copy are staged to the host instead of
        dropped; their pages free up later, so this call may still return None.
        """
        pages = self.device_alloc.alloc(num_pages)
        if pages is None:
            self.evict_device(num_pages - self.device_alloc.num_free, write_back=write_back)
            pages = self.device_alloc.alloc(num_pages)
        return pages

    def alloc_host(self, num_pages: int) -> PageIds | None:
        pages = self.host_alloc.alloc(num_pages)
        if pages is None:
            self.evict_host(num_pages - self.host_alloc.num_free)
            pages = self.host_alloc.alloc(num_pages)
        return pages

    def evict_device(self, num_pages: int, *, write_back: PendingOp | None = None) -> Eviction:
        """Free `num_pages` device pages if unpinned leaves allow, in the device policy's
        order, page-granular.

        A leaf with a host copy is demoted to host-only. Without one it is deleted, or, given a
        `write_back` op, staged to the host: it becomes WRITING under that op and its device
        pages are freed when the write settles (`end_write(demote=True)`); staged pages count
        towards `num_pages`.
        """
        out = Eviction()
        staged = 0
        frees: list[PageIds] = []
        while out.freed_pages + staged < num_pages:
            node = self.device_policy.pop(self._device_candidate)
            if node is None:
                break
            # a whole node is staged to the host; one evicted outright (no write-back, or
            # the host had no room) is trimmed first to the pages still needed
            staging = write_back is not None and self._stage_write_back(node, write_back)
            if not staging:
                self._trim(node, min(num_pages - out.freed_pages - staged,
                                     self.device_policy.tail_run(node)),
                           dropped=not node.on_host)
            if self.device_eviction_order is not None:
                self.device_eviction_order.append(node.id)
            if staging:
                out.write_backs.append(node)
                staged += node.num_pages
            else:
                self._evict_device_node(node, out=out, frees=frees)
        _free_all(self.device_alloc, frees)
        return out

    def _trim(self, node: Node, need: int, *, dropped: bool) -> None:
        """Evict page-granular: leave only the last `need` pages in `node` (its head splits
        off as the parent, a candidate with the same recency and hits). `dropped`: node is
        deleted once evicted (see `_split`).

        NOTE: the tail's own copies of its key and pages were dropped a moment later (about
        3 % of `bench tree`); a tail that stays (host-only) still gets them.
        """
        if 0 < need < node.num_pages:
            self._split(node, node.num_pages - need, dropped=dropped)

    def _stageable(self, node: Node) -> bool:
        # Whole nodes only: a trimmed tail's new parent is not on the host, so it could not
        # be staged (host residency must stay prefix-closed).
        return not node.on_host and (node.parent is self.root or (
            node.parent is not None and node.parent.on_host))

    def _stage_write_back(self, node: Node, op: PendingOp) -> bool:
        return self._stageable(node) and self.begin_write(node, op)

    def _evict_device_node(self, node: Node, *, out: Eviction,
                           frees: list[PageIds] | None = None) -> None:
        """Evict `node` from the device; its pages are freed now, or added to `frees`."""
        pages = node.device_pages
        assert pages is not None
        self.device_policy.on_evict(node)
        if frees is None:
            self.device_alloc.free(pages)
        else:
            frees.append(pages)
        self.device_evicted_pages += len(pages)
        out.freed_pages += len(pages)
        self._set_device(node, None, DeviceState.ABSENT)
        if not node.on_host:
            self._delete(node)

    def evict_host(self, num_pages: int) -> int:
        """Free `num_pages` host pages from host-only leaves, in the host policy's order,
        page-granular."""
        freed = 0
        frees: list[PageIds] = []
        while freed < num_pages:
            node = self.host_policy.pop(self._host_candidate)
            if node is None:
                break
            self._trim(node, min(num_pages - freed, self.host_policy.tail_run(node)),
                       dropped=True)
            assert node.host_pages is not None
            self.host_policy.on_evict(node)
            frees.append(node.host_pages)
            freed += len(node.host_pages)
            self.host_evicted_pages += len(node.host_pages)
            self._set_host(node, None, HostState.ABSENT)
            self._delete(node)
        _free_all(self.host_alloc, frees)
        return freed


def _free_all(alloc: PageAllocator, frees: list[PageIds]) -> None:
    """Free the pages of every node an eviction took, with one allocator call.

    NOTE: the allocator checks every free (range, allocated, no repeats) at a few µs per
    call whatever its size; an eviction of many small nodes paid that per node (9 % of a
    two-tier replay's loop time). Nothing allocates during an eviction, so freeing at its
    end is the same.
    """
    if frees:
        alloc.free(frees[0] if len(frees) == 1 else np.concatenate(frees))


def _halves(key: Keys, cut: int, *, dropped: bool = False) -> tuple[Keys, Keys]:
    """`key` cut at `cut`: the shorter side copied, the longer a view of `key` while the
    buffer it keeps alive is at most twice its size (else copied too). `dropped`: the tail
    is about to go, so it stays a view and the head is kept as a longer side would be.

    NOTE: eviction trims a few pages off long nodes again and again; copying both sides
    copied the whole key each time (up to 2.4 ms of loop per split on the conversation
    trace's long prompts). A view alone would let the key of a node trimmed down to a few
    pages keep its whole first buffer alive; copying once the buffer is twice the view
    bounds that at 2x, and the copies, halving each time, cost O(1) per token trimmed.
    """
    if dropped:
        head = key[:cut]
        return (head.copy() if held_bytes(key) > 2 * head.nbytes else head), key[cut:]
    head_longer = cut * 2 >= len(key)
    longer = key[:cut] if head_longer else key[cut:]
    if held_bytes(key) > 2 * longer.nbytes:
        longer = longer.copy()
    shorter = (key[cut:] if head_longer else key[:cut]).copy()
    return (longer, shorter) if head_longer else (shorter, longer)


def _cut(pages: PageIds, num_pages: int, dropped: bool) -> tuple[PageIds, PageIds]:
    """`pages` cut after `num_pages`: copies; if `dropped`, the lower part a view, and the
    upper one too while its buffer is at most twice its size (as `_halves` keeps a key)."""
    upper, lower = pages[:num_pages], pages[num_pages:]
    if not dropped:
        return upper.copy(), lower.copy()
    return (upper.copy() if held_bytes(pages) > 2 * upper.nbytes else upper), lower
