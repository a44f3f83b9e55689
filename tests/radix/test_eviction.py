"""Eviction policies: Belady's optimum (replay's ``opt``) against a brute-force optimum on
small traces, and ARC's classes, ghosts and adaptation, exactly."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from functools import cache
from itertools import combinations

import numpy as np
import pytest

from aiohicache import ConfigError, HiCacheConfig
from aiohicache.memory import PageAllocator
from aiohicache.radix import ARC, NEVER, Belady, RadixTree
from aiohicache.radix._node import Node
from aiohicache.replay import Request
from aiohicache.replay.belady import FutureUses
from aiohicache.replay.runner import MODELS, ReplayConfig, eviction_tiers, replay
from tests.conftest import make_config
from tests.oracle import PrefixLRU

Page = tuple[int, ...]
"""A page, named by every token up to its end."""


# -- brute force ------------------------------------------------------------------------------


def best_hits(prompts: Sequence[Sequence[int]], *, capacity: int, page_size: int,
              room_for_partial: bool) -> int:
    """The most hit tokens any eviction choices give a prefix cache of `capacity` pages.

    Shares no code with aiohicache. Per request: hits are the leading whole pages all cached;
    the other whole pages are inserted after evicting ANY set of cached pages outside the
    hit prefix (at least enough to make room) that leaves the cache prefix-closed. If they
    cannot fit beside the hit prefix, nothing is inserted and nothing evicted; with
    `room_for_partial` (a serving engine's allocate) room is made for every computed token,
    a partial last page included (only whole pages are inserted).
    """
    paths = [[tuple(p[:(k + 1) * page_size]) for k in range(len(p) // page_size)]
             for p in prompts]
    lengths = [len(p) for p in prompts]

    @cache
    def solve(i: int, cached: frozenset[Page]) -> int:
        if i == len(paths):
            return 0
        path = paths[i]
        hit = 0
        while hit < len(path) and path[hit] in cached:
            hit += 1
        pinned, new = set(path[:hit]), path[hit:]
        room = -(-(lengths[i] - hit * page_size) // page_size) if room_for_partial else len(new)
        if room > capacity - hit:
            return hit * page_size + solve(i + 1, cached)
        free = capacity - len(cached)
        victims = sorted(cached - pinned)
        best = -1
        for size in range(max(0, room - free), len(victims) + 1):
            for gone in combinations(victims, size):
                kept = cached - set(gone)
                if all(len(p) == page_size or p[:-page_size] in kept for p in kept):
                    best = max(best, solve(i + 1, kept | set(new)))
        return hit * page_size + best

    return solve(0, frozenset())


def random_requests(seed: int, *, block_size: int, num: int = 12) -> list[Request]:
    """Prompts that branch off earlier ones, from a tiny alphabet of hash ids (ids repeat
    under different parents), some with a partial last block."""
    rng = random.Random(seed)
    history: list[list[int]] = [[]]
    out: list[Request] = []
    while len(out) < num:
        base = rng.choice(history)
        ids = base[:rng.randint(0, len(base))] + [rng.randrange(3)
                                                 for _ in range(rng.randint(0, 3))]
        if not ids:
            continue
        history.append(ids)
        length = len(ids) * block_size - rng.randrange(block_size)
        out.append(Request(arrival=0.0, input_length=length, output_length=1,
                           block_size=block_size, hash_ids=tuple(ids)))
    return out


# -- Belady on the tree ------------------------------------------------------------------------


def belady_hits(requests: list[Request], *, capacity: int, page_size: int) -> int:
    """Hit tokens of a single-tier `RadixTree` under `Belady`, requests served one by one
    (match, allocate evicting, insert; nothing inserted if it cannot fit)."""
    future = FutureUses(requests, page_size)
    tree = RadixTree(page_size=page_size, device_alloc=PageAllocator(capacity),
                     host_alloc=PageAllocator(0))
    tree.set_policies(device=Belady(future.next_use, page_size))
    hits = 0
    for i, request in enumerate(future.requests):
        future.now = i
        tokens = request.tokens()
        full = len(tokens) // page_size
        match = tree.match(tokens)
        matched = match.num_device_pages
        hits += matched * page_size
        if full - matched > capacity - matched or full == matched:
            continue
        tree.lock(match.last_device_node)
        pages = tree.alloc_device(full - matched)
        tree.unlock(match.last_device_node)
        assert pages is not None
        tree.insert(tokens[:full * page_size], np.concatenate([match.device_pages(), pages]),
                    start_page=matched)
        tree.check()
    return hits


@pytest.mark.parametrize(("block_size", "page_size"), [(1, 1), (2, 2), (2, 1), (3, 2), (1, 2)])
@pytest.mark.parametrize("capacity", [1, 2, 3, 5])
def test_belady_on_the_tree_is_optimal(block_size: int, page_size: int, capacity: int) -> None:
    for seed in range(12):
        requests = random_requests(seed, block_size=block_size)
        prompts = [r.tokens().tolist() for r in requests]
        assert belady_hits(requests, capacity=capacity, page_size=page_size) == best_hits(
            prompts, capacity=capacity, page_size=page_size, room_for_partial=False), seed


def test_the_brute_force_beats_lru_on_some_of_these_traces() -> None:
    shortfalls = 0
    for seed in range(12):
        requests = random_requests(seed, block_size=1)
        prompts = [r.tokens().tolist() for r in requests]
        lru = PrefixLRU(4)
        hits = sum(lru.serve(p) for p in prompts)
        best = best_hits(prompts, capacity=4, page_size=1, room_for_partial=False)
        assert hits <= best
        shortfalls += hits < best
    assert shortfalls >= 3


@pytest.mark.parametrize(("block_size", "page_size"), [(2, 1), (3, 2)])
@pytest.mark.parametrize("capacity", [2, 4])
def test_replay_with_opt_is_optimal(block_size: int, page_size: int, capacity: int) -> None:
    """Through the real cache (fetch, allocate, commit) with one tier; pages of 2 tokens
    give prompts partial last pages, which take a slot but are not cached."""
    for seed in range(6):
        requests = random_requests(seed, block_size=block_size, num=8)
        config = ReplayConfig(spec=MODELS["tiny"], device_tokens=capacity * page_size,
                              host_tokens=0, page_size=page_size, eviction="opt")
        result = asyncio.run(replay(config, requests))
        prompts = [r.tokens().tolist() for r in requests]
        assert result.l1_tokens == best_hits(prompts, capacity=capacity, page_size=page_size,
                                             room_for_partial=True), seed


def test_belady_evicts_the_page_used_furthest_ahead_even_inside_a_node() -> None:
    # One request of 4 pages; later requests use its first 3 pages, then its first page.
    trace = [(0, 1, 2, 3), (9,), (0, 1, 2), (0,)]
    requests = [Request(arrival=0.0, input_length=len(ids), output_length=1, block_size=1,
                        hash_ids=ids) for ids in trace]
    future = FutureUses(requests, page_size=1)
    tree = RadixTree(page_size=1, device_alloc=PageAllocator(4), host_alloc=PageAllocator(0))
    tree.set_policies(device=Belady(future.next_use, 1))
    tree.device_eviction_order = []
    future.now = 0
    tree.insert(future.requests[0].tokens(), tree.device_alloc.alloc(4))
    future.now = 1
    tree.evict_device(2)  # page 3 is never used again, then page 2 (request 2)
    assert tree.num_nodes == 1 and tree.device_alloc.num_used == 2
    assert tree.match(future.requests[0].tokens(), touch=False).num_device_pages == 2
    tree.check()


def test_future_uses_name_pages_by_prefix_and_count_whole_pages_only() -> None:
    # Blocks of 4 tokens, pages of 2: request 1 has 7 tokens, so whole pages up to token 5.
    requests = [Request(arrival=0.0, input_length=8, output_length=1, block_size=4,
                        hash_ids=(7, 8)),
                Request(arrival=0.0, input_length=7, output_length=1, block_size=4,
                        hash_ids=(7, 8)),
                Request(arrival=0.0, input_length=8, output_length=1, block_size=4,
                        hash_ids=(5, 8))]
    future = FutureUses(requests, page_size=2)
    first, again, other = (r.tokens() for r in future.requests)
    assert (first[:7] == again).all() and first[4] != other[4]  # same prefix, same tokens
    future.now = 0
    assert future.next_use(int(first[1])) == 1
    assert future.next_use(int(first[5])) == 1  # tokens 4..5: a whole page of request 1
    assert future.next_use(int(first[7])) == NEVER  # tokens 6..7: not a whole page of 1
    future.now = 1
    assert future.next_use(int(first[1])) == NEVER  # request 2 has another first block


def test_opt_is_a_replay_only_policy() -> None:
    with pytest.raises(ConfigError, match="^eviction: 'opt'.*only a replay"):
        HiCacheConfig(spec=MODELS["tiny"], page_size=4, device_pages=8, eviction="opt")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^eviction: 'opt'.*concurrency 1"):
        ReplayConfig(eviction="opt", concurrency=4)
    with pytest.raises(ConfigError, match="^eviction: expected one of"):
        eviction_tiers("arc:lru:lfu")
    assert eviction_tiers("arc:opt") == ("arc", "opt")


# -- ARC ---------------------------------------------------------------------------------------

PS = 2


def arc_tree(device: int = 8) -> RadixTree:
    tree = RadixTree(page_size=PS, device_alloc=PageAllocator(device),
                     host_alloc=PageAllocator(0), eviction="arc")
    tree.device_eviction_order = []
    return tree


def serve(tree: RadixTree, tokens: list[int]) -> int:
    """One request on a single tier: match, allocate (evicting), insert; hit pages."""
    seq = np.array(tokens, dtype=np.int64)
    match = tree.match(seq)
    matched = match.num_device_pages
    if len(seq) // PS > matched:
        tree.lock(match.last_device_node)
        pages = tree.alloc_device(len(seq) // PS - matched)
        tree.unlock(match.last_device_node)
        assert pages is not None
        tree.insert(seq, np.concatenate([match.device_pages(), pages]), start_page=matched)
    tree.check()
    return matched


def arc(tree: RadixTree) -> ARC:
    assert isinstance(tree.device_policy, ARC)
    return tree.device_policy


def test_arc_counts_pages_hit_once_and_evicts_them_first_while_over_target() -> None:
    tree = arc_tree()
    serve(tree, [1, 1, 2, 2])           # a: class 0, 2 pages
    serve(tree, [3, 3])                 # b: class 0
    assert arc(tree).recent_pages == 3
    serve(tree, [1, 1, 2, 2])           # a is hit: class 1
    assert arc(tree).recent_pages == 1
    arc(tree).target = 0.0              # class 0 is over its target: it gives victims first
    a, b = (tree.match(s, touch=False).path[-1] for s in ((1, 1, 2, 2), (3, 3)))
    serve(tree, [4, 4, 5, 5, 6, 6, 7, 7])  # needs 4 pages, 5 free
    serve(tree, [8, 8, 9, 9])              # needs 2, 1 free: b, the LRU of class 0, leaves
    assert tree.device_eviction_order[0] == b.id and a.alive
    assert tree.match([1, 1, 2, 2], touch=False).num_device_pages == 2


def test_arc_ghost_hits_move_the_target_towards_the_class_that_missed() -> None:
    tree = arc_tree(device=4)
    serve(tree, [1, 1, 2, 2])
    serve(tree, [3, 3, 4, 4])           # both class 0; 4 of 4 pages used
    arc(tree).target = before = 1.0     # (it starts at 3/4 of the capacity)
    serve(tree, [5, 5, 6, 6])           # evicts [1 1 2 2] (LRU of class 0): a class-0 ghost
    assert arc(tree).ghost_pages == [2, 0]
    assert serve(tree, [1, 1, 2, 2]) == 0  # missed, and it was a ghost: class 0 gets room
    assert arc(tree).target == before + 2 * ARC.STEP
    assert arc(tree).ghost_pages[0] == 2  # [3 3 4 4] left for it, itself a ghost now


def test_arc_ghost_chain_follows_runs_evicted_from_the_tail() -> None:
    tree = arc_tree(device=4)
    serve(tree, [1, 1, 2, 2, 3, 3, 4, 4])
    tree.evict_device(1)
    tree.evict_device(1)                # two runs: page 4, then page 3 (each its own ghost)
    assert arc(tree).ghost_pages == [2, 0]
    arc(tree).target = 0.0
    serve(tree, [1, 1, 2, 2, 3, 3, 4, 4])
    assert arc(tree).ghost_pages == [0, 0] and arc(tree).target == 2 * ARC.STEP


@pytest.mark.parametrize("eviction", ["arc", ("arc", "lru"), ("lfu", "arc")])
def test_arc_keeps_the_cache_invariants_under_two_tier_traffic(
        eviction: str | tuple[str, str]) -> None:
    requests = random_requests(3, block_size=4, num=300)
    config = ReplayConfig(spec=MODELS["tiny"], device_tokens=64, host_tokens=160, page_size=2,
                          eviction=eviction if isinstance(eviction, str) else ":".join(eviction))
    result = asyncio.run(replay(config, requests))  # checks the cache's invariants at the end
    assert result.l1_tokens + result.l2_tokens > 0
    assert make_config(eviction=eviction).eviction == eviction


def test_trimming_long_nodes_page_by_page_keeps_key_memory_bounded() -> None:
    # a split keeps the longer half of a key as a view, and a view keeps its buffer alive:
    # trimming a long prompt down to a few pages must not hold the whole prompt's tokens
    page_size, num_pages, keep = 16, 256, 2
    tree = RadixTree(page_size=page_size, device_alloc=PageAllocator(num_pages + 8 * keep),
                     host_alloc=PageAllocator(0))
    rng = np.random.default_rng(0)
    kept: list[np.ndarray] = []
    for _ in range(8):
        tokens = rng.integers(0, 1 << 30, num_pages * page_size)
        pages = tree.alloc_device(num_pages)
        assert pages is not None
        tree.insert(tokens, pages)
        for prefix in kept:  # the older remainders are more recent than the new prompt
            tree.match(prefix)
        for _ in range(num_pages - keep):
            assert tree.evict_device(1).freed_pages == 1
        kept.append(tokens[:keep * page_size])
        assert tree.match(tokens[:keep * page_size]).num_device_pages == keep
    keys = [node.key for node in _nodes(tree.root) if node is not tree.root]
    live = sum(key.nbytes for key in keys)
    held = sum({id(k.base if k.base is not None else k): (k.base if k.base is not None
                                                          else k).nbytes
                for k in keys}.values())
    assert live == 8 * keep * page_size * tree.key_dtype.itemsize
    assert held <= 2 * live


def _nodes(node: Node) -> list[Node]:
    return [node, *(n for child in node.children.values() for n in _nodes(child))]
