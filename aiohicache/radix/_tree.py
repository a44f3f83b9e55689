"""The radix tree over token pages: match, insert, pin, evict. Synchronous and I/O-free.

Every method mutates the tree and the two page allocators to a consistent state before it
returns; the async controller then moves bytes according to what the method reported. Only the
event loop calls the tree, so it takes no lock (design rule 1).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..errors import InvariantError
from ..memory import PageAllocator, PageIds
from ._node import DeviceState, HostState, Node, PendingOp
from ._policy import EvictionPolicy, PolicyName, make_policy

__all__ = ("Eviction", "InsertResult", "Match", "RadixTree")

Tokens = npt.NDArray[np.int64]
"""Token ids as a 1-D int64 array: compared in bulk without copies (slices are views)."""


@dataclass(slots=True)
class Match:
    """What `RadixTree.match` found for a token sequence.

    `path` lists the matched nodes root-down. Because device residency is prefix-closed, the
    first `num_device_nodes` of them are on the device (settled or loading) and the rest are
    host-only.
    """

    path: list[Node]
    num_device_nodes: int
    page_size: int

    @property
    def device_nodes(self) -> list[Node]:
        return self.path[:self.num_device_nodes]

    @property
    def host_nodes(self) -> list[Node]:
        return self.path[self.num_device_nodes:]

    @property
    def last_device_node(self) -> Node | None:
        return self.path[self.num_device_nodes - 1] if self.num_device_nodes else None

    @property
    def last_node(self) -> Node | None:
        return self.path[-1] if self.path else None

    @property
    def num_device_pages(self) -> int:
        return sum(n.num_pages for n in self.device_nodes)

    @property
    def num_host_pages(self) -> int:
        return sum(n.num_pages for n in self.host_nodes)

    def device_pages(self) -> PageIds:
        parts = [n.device_pages for n in self.device_nodes if n.device_pages is not None]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class InsertResult:
    """What `RadixTree.insert` did: nodes now holding the caller's pages, and duplicates."""

    last_node: Node | None
    new_nodes: list[Node] = field(default_factory=list)
    duplicate_pages: list[PageIds] = field(default_factory=list)


@dataclass(slots=True)
class Eviction:
    """Pages a device eviction freed now, and nodes staged to the host (write-back)."""

    freed_pages: int = 0
    write_backs: list[Node] = field(default_factory=list)


class RadixTree:
    """A page-granular radix tree whose nodes record device and host residency.

    Eviction order: each tier has an `EvictionPolicy` (``eviction`` names one for both
    tiers, or a pair: device, host) that keeps its candidates in lazy min-heaps, e.g. keyed
    by ``(last_access, id)`` (LRU) or ``(hit_count, last_access, id)`` (LFU). Entries go stale
    when a node's key changes or it stops being a candidate; the policy's `pop` discards
    those, and the heaps are rebuilt when stale entries outnumber live nodes. Push and pop
    are O(log n); nothing scans the tree.
    """

    def __init__(self, *, page_size: int, device_alloc: PageAllocator,
                 host_alloc: PageAllocator,
                 eviction: PolicyName | tuple[PolicyName, PolicyName] = "lru") -> None:
        self.page_size = page_size
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc
        self._ids = itertools.count(1)
        self.root = Node(id=0, parent=None, key=np.empty(0, dtype=np.int64))
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self.on_split: list[Callable[[Node, Node], None]] = []
        """Called as ``hook(node, upper)`` when a node holding host refs is split."""
        self.on_residency: list[Callable[[Node, str, bool], None]] = []
        """Called as ``hook(node, "device" | "host", present)`` when a node gains or loses a
        tier (KV events; aiohicache.events). Splits move no page between tiers: not called."""
        self._num_nodes = 0
        device, host = (eviction, eviction) if isinstance(eviction, str) else eviction
        self.device_policy = make_policy(device, capacity=device_alloc.capacity,
                                         page_size=page_size)
        self.host_policy = make_policy(host, capacity=host_alloc.capacity, page_size=page_size)
        self._counting = self._learning = False
        self._policies_changed()
        self.device_evicted_pages = 0
        self.host_evicted_pages = 0
        self.device_eviction_order: list[int] | None = None  # node ids, when tracing

    # ------------------------------------------------------------------ queries

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, tokens: Tokens | Sequence[int], *, touch: bool = True) -> Match:
        """Find the longest cached page-aligned prefix of `tokens`.

        A match that ends inside a node splits it at the page boundary, so `path` covers
        exactly the matched pages. With `touch`, matched nodes count a hit and become the most
        recently used.
        """
        tokens = as_token_array(tokens)
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

    def _tell_misses(self, tokens: Tokens, path: list[Node], num_device: int) -> None:
        """Show each tier's policy the pages it lacked: after the device part of the match
        (device), after the whole match (host)."""
        pos = 0
        for i, (policy, end) in enumerate(((self.device_policy, num_device),
                                           (self.host_policy, len(path)))):
            pos += sum(len(n.key) for n in path[num_device if i else 0:end])
            if policy.learns_from_misses:
                policy.on_miss(path[end - 1] if end else self.root, tokens, pos)

    def _step(self, node: Node, tokens: Tokens, pos: int) -> Node | None:
        """The child of `node` that matches `tokens` from `pos`, split to the matching pages
        when the match ends inside it; None when no child starts with the next page. After a
        split, the next step finds no child: the mismatching page starts the lower part."""
        child = node.children.get(tokens[pos:pos + self.page_size].tobytes())
        if child is not None and not _same(tokens[pos:pos + len(child.key)], child.key):
            child = self._split(child, self._common_pages(child.key, tokens, pos))
        return child

    def _common_pages(self, key: Tokens, tokens: Tokens, pos: int) -> int:
        span = min(len(key), len(tokens) - pos)
        differ = np.flatnonzero(key[:span] != tokens[pos:pos + span])
        first = int(differ[0]) if len(differ) else span
        # >= 1: the first page matched through the child's dict key
        return max(1, first // self.page_size)

    def _touch(self, nodes: list[Node], *, hit: bool) -> None:
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock
            if hit:
                self._count_hit(node)
        for node in nodes:
            self._offer(node)

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Tokens | Sequence[int], pages: PageIds, *,
               start_page: int = 0, hashes: list[bytes] | None = None) -> InsertResult:
        """Insert `tokens` (whole pages) whose KV sits in device `pages` (one per page).

        Pages before `start_page` are the caller's matched prefix and already belong to the
        tree. From `start_page` on, pages of a prefix someone else inserted meanwhile are
        reported as duplicates (the caller frees them), except that a host-only node takes the
        caller's fresh device pages. What is left becomes a new leaf. The result lists every
        node that now holds the caller's pages.
        """
        ps, tokens = self.page_size, as_token_array(tokens)
        assert len(tokens) == len(pages) * ps, "tokens and pages disagree"
        res = InsertResult(last_node=None)
        node, pos = self.root, 0
        while pos < len(tokens) and (child := self._step(node, tokens, pos)) is not None:
            self._adopt_or_drop(child, pages, pos // ps, start_page, res)
            pos += len(child.key)
            node = child
        if pos < len(tokens):
            leaf = self._add_leaf(node, tokens[pos:].copy(), pages[pos // ps:])
            if hashes is not None:
                leaf.hashes = hashes[pos // ps:]
                leaf.stored = [False] * leaf.num_pages
            res.new_nodes.append(leaf)
            node = leaf
        res.last_node = node if node is not self.root else None
        for new in res.new_nodes:
            self._count_hit(new)
        self._touch(node.path_to_root()[::-1], hit=False)
        return res

    def _adopt_or_drop(self, node: Node, pages: PageIds, first: int, start: int,
                       res: InsertResult) -> None:
        theirs = pages[first:first + node.num_pages]
        if first + node.num_pages <= start:
            return  # the caller's own matched prefix
        if first < start:
            raise InvariantError("insert: a node straddles the caller's matched prefix")
        if not node.on_device and node.parent is not None and (
                node.parent is self.root or node.parent.on_device):
            self._set_device(node, theirs.copy(), DeviceState.RESIDENT)
            res.new_nodes.append(node)
        else:
            res.duplicate_pages.append(theirs)

    def insert_host(self, tokens: Tokens, host_pages: PageIds, *, start_page: int,
                    hashes: list[bytes]) -> tuple[list[Node], list[PageIds]]:
        """Add host-only pages (fetched from L3) for ``tokens`` pages ``start_page..``.

        `tokens` covers whole pages; `host_pages` holds pages ``start_page`` on. Returns the
        new nodes and the host pages not adopted (the caller frees them): pages of a prefix
        that is present already, or everything when the prefix before `start_page` is gone
        or has no host copy (host residency must stay prefix-closed).
        """
        ps, tokens = self.page_size, as_token_array(tokens)
        node, pos = self.root, 0
        while pos < len(tokens) and (child := self._step(node, tokens, pos)) is not None:
            pos += len(child.key)
            node = child
        first = pos // ps
        if first < start_page or pos >= len(tokens) or not (
                node is self.root or node.on_host):
            return [], [host_pages]
        leaf = Node(id=next(self._ids), parent=node, key=tokens[pos:].copy(),
                    hashes=hashes[first:len(tokens) // ps],
                    stored=[True] * (len(tokens) // ps - first))
        node.children[leaf.key[:ps].tobytes()] = leaf
        self._num_nodes += 1
        self._set_host(leaf, host_pages[first - start_page:].copy(), HostState.RESIDENT)
        self._touch(leaf.path_to_root()[::-1], hit=False)
        return [leaf], [host_pages[:first - start_page]]

    def _add_leaf(self, parent: Node, key: Tokens, pages: PageIds) -> Node:
        leaf = Node(id=next(self._ids), parent=parent, key=key)
        parent.children[key[:self.page_size].tobytes()] = leaf
        self._num_nodes += 1
        self._set_device(leaf, pages.copy(), DeviceState.RESIDENT)
        return leaf

    def split(self, node: Node, num_pages: int) -> Node:
        """Cut `node` after `num_pages` pages; return the new upper part (node keeps the rest)."""
        return self._split(node, num_pages)

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut `node` after `num_pages` pages; return the new upper part (node keeps the rest)."""
        ps, cut = self.page_size, num_pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_pages < node.num_pages
        upper = Node(id=next(self._ids), parent=parent, key=node.key[:cut].copy(),
                     device_state=node.device_state, host_state=node.host_state,
                     lock_ref=node.lock_ref, host_ref=node.host_ref, hit_count=node.hit_count,
                     last_access=node.last_access, load_op=node.load_op, write_op=node.write_op)
        if node.device_pages is not None:
            upper.device_pages, node.device_pages = (node.device_pages[:num_pages].copy(),
                                                     node.device_pages[num_pages:].copy())
        if node.host_pages is not None:
            upper.host_pages, node.host_pages = (node.host_pages[:num_pages].copy(),
                                                 node.host_pages[num_pages:].copy())
        if node.hashes is not None:
            upper.hashes, node.hashes = node.hashes[:num_pages], node.hashes[num_pages:]
        if node.stored is not None:
            upper.stored, node.stored = node.stored[:num_pages], node.stored[num_pages:]
        for op in {id(o): o for o in (node.load_op, node.write_op) if o is not None}.values():
            op.nodes.append(upper)
        if node.host_ref:  # whoever protects node's host pages now protects upper's too
            for hook in self.on_split:
                hook(node, upper)
        node.key = node.key[cut:].copy()  # no views: a view would keep the old key alive
        node.parent = upper
        upper.children[node.key[:ps].tobytes()] = node
        upper.device_children, upper.host_children = int(node.on_device), int(node.on_host)
        parent.children[upper.key[:ps].tobytes()] = upper
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------ state changes

    def _count_hit(self, node: Node) -> None:
        if self._counting:  # the node may change class: its pages leave, then join again
            self._account(node, -1)
            node.hit_count += 1
            self._account(node, 1)
        else:
            node.hit_count += 1

    def _account(self, node: Node, sign: int) -> None:
        if node.device_pages is not None:
            self.device_policy.on_resident(node, sign * len(node.device_pages))
        if node.host_pages is not None:
            self.host_policy.on_resident(node, sign * len(node.host_pages))

    def _set_device(self, node: Node, pages: PageIds | None, state: DeviceState) -> None:
        was = node.on_device
        if self._counting:
            self.device_policy.on_resident(node, _num(pages) - _num(node.device_pages))
        node.device_pages, node.device_state = pages, state
        assert (pages is None) == (state is DeviceState.ABSENT)
        if node.parent is not None and was != node.on_device:
            node.parent.device_children += 1 if node.on_device else -1
            self._offer(node.parent)
        self._offer(node)
        if self.on_residency and was != node.on_device:
            for hook in self.on_residency:
                hook(node, "device", node.on_device)

    def _set_host(self, node: Node, pages: PageIds | None, state: HostState) -> None:
        was = node.on_host
        if self._counting:
            self.host_policy.on_resident(node, _num(pages) - _num(node.host_pages))
        node.host_pages, node.host_state = pages, state
        assert (pages is None) == (state is HostState.ABSENT)
        if node.parent is not None and was != node.on_host:
            node.parent.host_children += 1 if node.on_host else -1
            self._offer(node.parent)
        self._offer(node)
        if self.on_residency and was != node.on_host:
            for hook in self.on_residency:
                hook(node, "host", node.on_host)

    def lock(self, node: Node | None) -> None:
        """Pin `node` and its ancestors on the device."""
        for n in node.path_to_root() if node is not None else ():
            n.lock_ref += 1

    def unlock(self, node: Node | None) -> None:
        for n in node.path_to_root() if node is not None else ():
            if n.lock_ref <= 0:
                raise InvariantError(f"unlock: {n!r} is not locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._offer(n)

    def protect_host(self, node: Node) -> None:
        node.host_ref += 1

    def release_host(self, node: Node) -> None:
        if node.host_ref <= 0:
            raise InvariantError(f"release_host: {node!r} is not protected")
        node.host_ref -= 1
        if node.host_ref == 0:
            self._offer(node)

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
        while out.freed_pages + staged < num_pages:
            node = self.device_policy.pop(self._device_candidate)
            if node is None:
                break
            if write_back is None or not self._stageable(node):
                self._trim(node, min(num_pages - out.freed_pages - staged,
                                     self.device_policy.tail_run(node)))
            if self.device_eviction_order is not None:
                self.device_eviction_order.append(node.id)
            if write_back is not None and self._stage_write_back(node, write_back):
                out.write_backs.append(node)
                staged += node.num_pages
            else:
                self._evict_device_node(node, out=out)
        return out

    def _trim(self, node: Node, need: int) -> None:
        """Evict page-granular: leave only the last `need` pages in `node` (its head splits
        off as the parent, a candidate with the same recency and hits)."""
        if 0 < need < node.num_pages:
            self._split(node, node.num_pages - need)

    def _stageable(self, node: Node) -> bool:
        # Whole nodes only: a trimmed tail's new parent is not on the host, so it could not
        # be staged (host residency must stay prefix-closed).
        return not node.on_host and (node.parent is self.root or (
            node.parent is not None and node.parent.on_host))

    def _stage_write_back(self, node: Node, op: PendingOp) -> bool:
        return self._stageable(node) and self.begin_write(node, op)

    def _evict_device_node(self, node: Node, *, out: Eviction) -> None:
        pages = node.device_pages
        assert pages is not None
        self.device_policy.on_evict(node)
        self.device_alloc.free(pages)
        self.device_evicted_pages += len(pages)
        out.freed_pages += len(pages)
        self._set_device(node, None, DeviceState.ABSENT)
        if not node.on_host:
            self._delete(node)

    def evict_host(self, num_pages: int) -> int:
        """Free `num_pages` host pages from host-only leaves, in the host policy's order,
        page-granular."""
        freed = 0
        while freed < num_pages:
            node = self.host_policy.pop(self._host_candidate)
            if node is None:
                break
            self._trim(node, min(num_pages - freed, self.host_policy.tail_run(node)))
            assert node.host_pages is not None
            self.host_policy.on_evict(node)
            self.host_alloc.free(node.host_pages)
            freed += len(node.host_pages)
            self.host_evicted_pages += len(node.host_pages)
            self._set_host(node, None, HostState.ABSENT)
            self._delete(node)
        return freed

    def _delete(self, node: Node) -> None:
        assert not node.children and not node.on_device and not node.on_host
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[:self.page_size].tobytes()]
        node.alive = False
        self._num_nodes -= 1
        self._offer(parent)

    def _device_candidate(self, node: Node) -> bool:
        return (node.alive and node.device_state is DeviceState.RESIDENT
                and node.device_children == 0 and node.lock_ref == 0
                and node.host_state is not HostState.WRITING)

    def _host_candidate(self, node: Node) -> bool:
        return (node.alive and node.host_state is HostState.RESIDENT and not node.on_device
                and not node.children and node.host_ref == 0 and node.parent is not None)

    def _offer(self, node: Node) -> None:
        """Queue `node` with the policy of each tier it is now an eviction candidate of."""
        if node.parent is None:
            return
        if self._device_candidate(node):
            self.device_policy.push(node)
        if self._host_candidate(node):
            self.host_policy.push(node)
        if (self.device_policy.num_entries + self.host_policy.num_entries
                > 4 * self._num_nodes + 1024):
            self._compact()

    def _compact(self) -> None:
        nodes = list(self.iter_nodes())
        self.device_policy.rebuild(n for n in nodes if self._device_candidate(n))
        self.host_policy.rebuild(n for n in nodes if self._host_candidate(n))

    def set_policies(self, *, device: EvictionPolicy | None = None,
                     host: EvictionPolicy | None = None) -> None:
        """Replace a tier's eviction policy (e.g. with `Belady`, which no name builds).

        The new policy learns what the tier holds and queues its candidates: O(n), once.
        """
        self.device_policy = device or self.device_policy
        self.host_policy = host or self.host_policy
        self._policies_changed()
        for policy, pages in ((device, "device_pages"), (host, "host_pages")):
            if policy is not None and policy.counts_pages:
                for node in self.iter_nodes():
                    policy.on_resident(node, _num(getattr(node, pages)))
        self._compact()

    def _policies_changed(self) -> None:
        policies = (self.device_policy, self.host_policy)
        self._counting = any(p.counts_pages for p in policies)
        self._learning = any(p.learns_from_misses for p in policies)

    # ------------------------------------------------------------------ checks

    def fingerprint(self, *, pages: bool = False) -> str:
        """A digest of the tree's shape and tier states, stable across processes (equal trees
        give equal values). With `pages`, page ids and ref counts count too (TP ranks agree
        on those as well)."""
        items: list[str] = []
        for n in self.iter_nodes():
            item: list[object] = [len(n.path_to_root()), n.key.tobytes(), n.device_state.value,
                                  n.host_state.value]
            if pages:
                item += [_page_bytes(n.device_pages), _page_bytes(n.host_pages), n.lock_ref,
                         n.host_ref, n.hit_count, n.last_access]
            items.append(repr(item))
        h = hashlib.blake2b(digest_size=16)
        for text in sorted(items):
            h.update(text.encode())
        return h.hexdigest()

    def check(self) -> None:
        """Raise `InvariantError` if the tree's structure or tier states are inconsistent."""
        seen_device: set[int] = set()
        seen_host: set[int] = set()
        count = 0
        for node in self.iter_nodes():
            count += 1
            self._check_node(node)
            _claim(seen_device, node.device_pages, f"device pages of {node!r}")
            _claim(seen_host, node.host_pages, f"host pages of {node!r}")
        if count != self._num_nodes:
            raise InvariantError(f"node count {self._num_nodes} but {count} reachable")
        for policy, pred, tier in ((self.device_policy, self._device_candidate, "on_device"),
                                   (self.host_policy, self._host_candidate, "on_host")):
            queued = policy.queued()
            for node in self.iter_nodes():
                if pred(node) and node.id not in queued:
                    raise InvariantError(f"eviction candidate {node!r} is not queued")
            problem = policy.problem(n for n in self.iter_nodes() if getattr(n, tier))
            if problem:
                raise InvariantError(problem)

    def _check_node(self, node: Node) -> None:
        problem = self._node_problem(node)
        if problem:
            raise InvariantError(f"{node!r}: {problem}")

    def _node_problem(self, node: Node) -> str:
        """The first broken invariant of `node`, or "" (messages built only on failure)."""
        ps, parent = self.page_size, node.parent
        if parent is None or parent.children.get(node.key[:ps].tobytes()) is not node:
            return "not linked from its parent"
        kids = node.children.values()
        checks = (
            (len(node.key) == node.num_pages * ps and node.num_pages > 0,
             "key length disagrees with its pages"),
            ((node.device_pages is None) == (not node.on_device), "device state vs pages"),
            ((node.host_pages is None) == (not node.on_host), "host state vs pages"),
            (node.on_device or node.on_host, "holds KV in no tier"),
            (all(p is None or len(p) == node.num_pages
                 for p in (node.device_pages, node.host_pages)), "page counts differ"),
            (parent is self.root or parent.on_device or not node.on_device,
             "device residency not prefix-closed"),
            (parent is self.root or parent.on_host or not node.on_host,
             "host residency not prefix-closed"),
            (node.device_children == sum(c.on_device for c in kids), "device child count"),
            (node.host_children == sum(c.on_host for c in kids), "host child count"),
            (node.lock_ref >= sum(c.lock_ref for c in kids), "lock_ref below its children's"),
            ((node.device_state is DeviceState.LOADING) == (node.load_op is not None),
             "LOADING iff owned by a load"),
            ((node.host_state is HostState.WRITING) == (node.write_op is not None),
             "WRITING iff owned by a write"),
        )
        return next((message for ok, message in checks if not ok), "")


def as_token_array(tokens: Tokens | Sequence[int]) -> Tokens:
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
        return tokens
    return np.asarray(tokens, dtype=np.int64)


def _same(a: Tokens, b: Tokens) -> bool:
    return len(a) == len(b) and bool((a == b).all())


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantError(message)


def _claim(seen: set[int], pages: PageIds | None, what: str) -> None:
    if pages is None:
        return
    ids = set(pages.tolist())
    if len(ids) != len(pages) or ids & seen:
        raise InvariantError(f"{what} are referenced twice")
    seen |= ids


def _num(pages: PageIds | None) -> int:
    return 0 if pages is None else len(pages)


def _page_bytes(pages: PageIds | None) -> bytes:
    return b"-" if pages is None else pages.tobytes()
