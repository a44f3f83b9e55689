"""Radix-tree bookkeeping per request: match + allocate (evicting) + insert, no I/O.

The cost the event loop pays per request before any byte moves, measured on a trace so the
tree has a realistic shape. Compared with the design target (80 µs/request on the Mooncake
conversation trace, 10M-token capacity, page 16).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._tokens import as_tokens
from ..memory import PageAllocator
from ..radix import PolicyName, RadixTree
from ..replay.traces import Request

__all__ = ("TreeResult", "bench_tree", "format_tree")


@dataclass(frozen=True, slots=True)
class TreeResult:
    requests: int
    capacity_tokens: int
    page_size: int
    us_per_request: float
    hit_ratio: float
    nodes: int
    eviction: str = "lru"


def bench_tree(requests: Sequence[Request], *, capacity_tokens: int, page_size: int,
               eviction: PolicyName = "lru") -> TreeResult:
    """Replay `requests` on a bare `RadixTree` (one tier) and time the bookkeeping only.

    Token arrays are built before the clock starts, as the API's door hands them to the tree
    (`as_tokens`: int32 where every id fits): the trace format, not the tree, decides their
    cost. `eviction` names the tier's policy (`make_policy`), so the policies' own
    cost per request can be compared on the same trace.
    """
    tokens = [as_tokens(r.tokens()) for r in requests]
    tree = RadixTree(page_size=page_size,
                     device_alloc=PageAllocator(capacity_tokens // page_size),
                     host_alloc=PageAllocator(0), eviction=eviction)
    hits = 0
    start = time.perf_counter()
    for seq in tokens:
        hits += _serve(tree, seq, page_size)
    elapsed = time.perf_counter() - start
    total = sum(len(t) for t in tokens)
    return TreeResult(len(tokens), capacity_tokens, page_size, elapsed / len(tokens) * 1e6,
                      hits / total if total else 0.0, tree.num_nodes, eviction)


def _serve(tree: RadixTree, seq: np.ndarray, page_size: int) -> int:
    """One request as the controller serves it: match and pin, allocate, insert under the
    pinned prefix (`_request.commit_op`: ``under=`` its pin), unpin."""
    match = tree.match(seq)
    matched = match.num_device_pages
    full = len(seq) // page_size
    last = match.last_device_node
    tree.lock(last)
    pages = tree.alloc_device(full - matched)
    if pages is not None and full > matched:
        res = tree.insert(seq[:full * page_size], np.concatenate([match.device_pages(), pages]),
                          start_page=matched, under=last)
        for dup in res.duplicate_pages:
            tree.device_alloc.free(dup)
    elif pages is not None:
        tree.device_alloc.free(pages)
    tree.unlock(last)
    return matched * page_size


def format_tree(r: TreeResult) -> str:
    verdict = "ok" if r.us_per_request <= 80 else "MISSED"
    return (f"radix-tree bookkeeping (match + allocate/evict + insert), {r.requests:,} requests,"
            f" capacity {r.capacity_tokens:,} tokens, page {r.page_size}, eviction {r.eviction}\n"
            f"  {r.us_per_request:.1f} us/request   target <= 80 us: {verdict}\n"
            f"  hit ratio {r.hit_ratio:.4f}, {r.nodes:,} nodes at the end")
