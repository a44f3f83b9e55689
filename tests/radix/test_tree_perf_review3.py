"""What int32 keys in the radix tree must keep.

The tree keeps token ids as int32 while every id it was given fits (half the bytes to
compare, copy and fault in), and widens every key to int64 for good when one does not; the
API's door (`as_tokens`) hands it int32 ids where they fit. An id must never wrap: 2**32 + k
read as int32 is k, and a match on it would serve k's KV. A widened tree must evict, hit and
fingerprint exactly as if it had been wide all along (its children's dicts and ARC's ghosts
are keyed by key bytes), and keys must stay the tree's own copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from aiohicache._tokens import as_tokens
from aiohicache.memory import PageAllocator
from aiohicache.radix import ARC, HostState, PendingOp, RadixTree
from aiohicache.storage.keys import chain_keys
from tests.conftest import make_cache, prefill

PS = 4
BIG = 2**40
"""An offset that puts every id beyond int32."""


def _tree(eviction: str = "lru", *, device: int = 64, host: int = 0) -> RadixTree:
    return RadixTree(page_size=PS, device_alloc=PageAllocator(device),
                     host_alloc=PageAllocator(host), eviction=eviction)  # type: ignore[arg-type]


def _put(tree: RadixTree, tokens: Any) -> None:
    pages = tree.device_alloc.alloc(len(tokens) // PS)
    assert pages is not None
    tree.insert(tokens, pages)


@pytest.mark.parametrize(("start", "offset"), [(0, 2**32), (0, -(2**32)), (0, BIG << 8),
                                               (2**31 - 8 * PS, 2**32), (-(2**31), 2**32)])
@pytest.mark.parametrize("big_first", [False, True])
def test_ids_beyond_int32_never_match_the_ids_they_would_wrap_to(start: int, offset: int,
                                                                  big_first: bool) -> None:
    """Ids that equal others modulo 2**32 are other tokens: each sequence matches only its
    own pages, whichever came first (a wrapped id would serve the other sequence's KV)."""
    tree = _tree()
    small = np.arange(start, start + 8 * PS, dtype=np.int64)  # (int32's ends included)
    big = small + offset
    first, second = (big, small) if big_first else (small, big)
    _put(tree, first)
    assert tree.match(second).num_device_pages == 0
    _put(tree, second)
    for seq in (small, big):
        match = tree.match(seq)
        assert match.num_device_pages == 8
        assert np.concatenate([n.key for n in match.path]).tolist() == seq.tolist()
    assert tree.key_dtype == np.int64
    tree.check()


def _serve(tree: RadixTree, seq: np.ndarray, write_back: bool) -> int:
    """One request as `bench tree` serves it; with `write_back`, device victims are staged
    to the host and settled at once (two tiers: demotions, loads of host-only nodes by the
    insert, host eviction)."""
    match = tree.match(seq)
    matched, full = match.num_device_pages, len(seq) // PS
    last = match.last_device_node
    tree.lock(last)
    op = PendingOp() if write_back else None
    pages = tree.alloc_device(full - matched, write_back=op)
    if pages is None and op is not None:
        for node in op.nodes:
            if node.host_state is HostState.WRITING:
                tree.end_write(node, demote=True)
        pages = tree.alloc_device(full - matched)
    if pages is not None and full > matched:
        res = tree.insert(seq[:full * PS], np.concatenate([match.device_pages(), pages]),
                          start_page=matched, under=last)
        for dup in res.duplicate_pages:
            tree.device_alloc.free(dup)
    elif pages is not None:
        tree.device_alloc.free(pages)
    tree.unlock(last)
    return sum(n.num_pages for n in match.path)


def _replay(eviction: str, write_back: bool, odd_one: int) -> tuple[Any, ...]:
    """Growing conversations over a small device (and host), with one request of ids from
    `odd_one` on, shared with no other, half-way; what the tiers did."""
    tree = _tree(eviction, device=48, host=96 if write_back else 0)
    tree.device_eviction_order = []
    rng = np.random.default_rng(7)
    bases = [rng.integers(0, 1 << 20, 40 * PS) for _ in range(6)]
    hits = []
    for i in range(300):
        seq = bases[rng.integers(6)][:rng.integers(1, 40) * PS + rng.integers(PS)]
        if i == 150:
            seq = np.arange(odd_one, odd_one + 9 * PS, dtype=np.int64)
        hits.append(_serve(tree, seq, write_back))
    tree.check()
    state: tuple[Any, ...] = (tree.device_eviction_order, hits, tree.device_evicted_pages,
                              tree.host_evicted_pages, tree.num_nodes)
    for policy in (tree.device_policy, tree.host_policy):
        if isinstance(policy, ARC):
            state += (policy.target, list(policy.ghost_pages), policy.recent_pages)
    return state


@pytest.mark.parametrize("eviction", ["lru", "lfu", "arc"])
@pytest.mark.parametrize("write_back", [False, True])
def test_a_tree_widened_half_way_evicts_and_hits_as_one_that_never_was(
        eviction: str, write_back: bool) -> None:
    """One request of ids beyond int32 half-way widens the tree; eviction order, hits,
    evicted pages and ARC's state (ghosts found again after the widening) are those of the
    same replay whose odd request has ids that fit."""
    wide = _replay(eviction, write_back, odd_one=BIG)
    narrow = _replay(eviction, write_back, odd_one=1 << 30)
    assert wide == narrow
    assert len(wide[0]) > 100  # (evictions before and after the widening)
    if eviction == "arc":
        assert wide[5] != ARC.START * 48  # the target moved: ghosts were found


def test_a_widened_tree_fingerprints_as_the_same_tree_with_int32_keys() -> None:
    """Fingerprints (TP ranks compare them) read the ids, not the key dtype."""
    trees = [_tree(), _tree()]
    for tree in trees:
        _put(tree, np.arange(8 * PS) * 3)
        _put(tree, np.arange(5 * PS) * 3)
    assert trees[1].keys([BIG]).tolist() == [BIG]  # (converting ids widens the tree)
    assert [t.key_dtype for t in trees] == [np.int32, np.int64]
    assert trees[0].fingerprint(pages=True) == trees[1].fingerprint(pages=True)
    trees[1].check()


@pytest.mark.parametrize("kind", ["int64", "int32", "list", "tensor"])
def test_keys_are_int32_and_the_trees_own(kind: str) -> None:
    """Ids that fit are kept as int32 whatever the caller passed, in arrays the caller does
    not hold: editing its tokens afterwards changes nothing in the tree."""
    tree = _tree()
    ids = np.arange(6 * PS, dtype=np.int64) + 1000
    given: Any = {"int64": ids.copy(), "int32": ids.astype(np.int32), "list": ids.tolist(),
                  "tensor": torch.from_numpy(ids.copy())}[kind]
    _put(tree, given)
    _put(tree, np.concatenate([ids[:2 * PS], ids[:4 * PS] + 7]))  # a split: two nodes
    given[:] = -1 if kind != "list" else [-1] * len(given)
    nodes = list(tree.iter_nodes())
    assert len(nodes) == 3 and all(n.key.dtype == np.int32 for n in nodes)
    assert tree.match(ids).num_device_pages == 6
    tree.check()


def test_a_widened_tree_copies_the_ids_it_is_given() -> None:
    """In a widened tree an int64 tensor's ids are still copied: numpy may read the tensor's
    memory without a copy, and a key that is the caller's buffer changes with it."""
    tree = _tree()
    tree.keys([BIG])
    assert tree.key_dtype == np.int64
    ids = torch.arange(6 * PS, dtype=torch.int64) + BIG
    _put(tree, ids)
    ids[:] = 0
    assert tree.match(np.arange(6 * PS) + BIG).num_device_pages == 6
    assert tree.match(np.zeros(6 * PS, dtype=np.int64)).num_device_pages == 0
    tree.check()


@pytest.mark.parametrize("make", [
    lambda ids: ids,
    lambda ids: np.array(ids, dtype=np.int64),
    lambda ids: torch.tensor(ids, dtype=torch.int64),
], ids=["list", "numpy-int64", "torch-int64"])
async def test_the_cache_serves_ids_beyond_int32_as_their_own_tokens(make: Any) -> None:
    """Through the API: the door keeps int64 where an id does not fit int32, and a prompt of
    2**32 + k is a miss after k's prompt was cached, then hits its own KV (not k's)."""
    small = list(range(100, 100 + 8 * PS))
    big = [i + 2**32 for i in small]
    assert as_tokens(make(small)).dtype == np.int32
    assert as_tokens(make(big)).dtype == np.int64
    assert as_tokens(make(big)).tolist() == big
    cache = make_cache()
    async with cache:
        kv_small = await prefill(cache, small)
        async with cache.fetch(make(big)) as hit:
            assert hit.num_cached_tokens == 0
        kv_big = await prefill(cache, big)
        async with cache.fetch(make(big)) as hit:
            assert hit.num_cached_tokens == 8 * PS
        assert not torch.equal(kv_small, kv_big)
        assert torch.equal(await prefill(cache, small), kv_small)
        cache.check_invariants()


def test_l3_page_keys_of_int32_ids_are_those_of_the_same_ids_as_int64() -> None:
    """Page keys hash ids as little-endian int64 whatever the array's dtype: objects stored
    before (int64 requests) are found again from int32 requests."""
    ids = np.arange(8 * PS, dtype=np.int64) * 977
    root = b"r" * 16
    assert chain_keys(root, ids.astype(np.int32), PS) == chain_keys(root, ids, PS)
