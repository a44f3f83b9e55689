"""What the second round of radix-tree bookkeeping cuts must keep.

An eviction's trimmed tail now keeps views of its node's key and pages (it is deleted right
after), so whatever outlives it must still hold compact keys: ARC's ghost, the head left in
the tree, a tail that stays as a host-only node. The page allocator now keeps one state array
(allocated, or free with a stamp) and its free stack top-first: a refused free must leave
every page as it was, and the stack must hand pages out as the LIFO it was.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiohicache import PageError
from aiohicache.memory import PageAllocator
from aiohicache.radix import ARC, PendingOp, RadixTree
from aiohicache.radix._results import held_bytes

PS = 4


def _tree(eviction: str, *, device: int = 64, host: int = 0) -> RadixTree:
    return RadixTree(page_size=PS, device_alloc=PageAllocator(device),
                     host_alloc=PageAllocator(host), eviction=eviction)  # type: ignore[arg-type]


def _put(tree: RadixTree, tokens: np.ndarray) -> None:
    pages = tree.device_alloc.alloc(len(tokens) // PS)
    assert pages is not None
    tree.insert(tokens, pages)


def _compact(key: np.ndarray) -> bool:
    return held_bytes(key) <= 2 * key.nbytes


def test_an_arc_ghost_of_a_trimmed_tail_keeps_only_about_its_own_tokens() -> None:
    """Two pages evicted off a 64-page node leave a ghost of those 2 pages' tokens, held
    without the rest of the node's key (a view would keep all 64 pages alive in the ghost)."""
    tree = _tree("arc")
    tokens = np.arange(64 * PS, dtype=np.int64)
    _put(tree, tokens)
    assert tree.evict_device(2).freed_pages == 2
    policy = tree.device_policy
    assert isinstance(policy, ARC)
    (ghost,) = policy._ghosts.values()
    assert ghost.key.tolist() == tokens[-2 * PS:].tolist()
    assert _compact(ghost.key)
    tree.check()


@pytest.mark.parametrize("eviction", ["lru", "lfu", "arc"])
@pytest.mark.parametrize("evicted", [1, 20, 40, 63])
def test_the_head_a_trim_leaves_is_compact_and_the_pages_add_up(eviction: str,
                                                               evicted: int) -> None:
    """Whatever share of a node is trimmed off, the part left in the tree holds its tokens
    and pages in buffers at most twice their size, and the pool gets back exactly the
    evicted pages."""
    tree = _tree(eviction)
    tokens = np.arange(64 * PS, dtype=np.int64)
    _put(tree, tokens)
    assert tree.evict_device(evicted).freed_pages == evicted
    (node,) = tree.root.children.values()
    assert node.key.tolist() == tokens[:(64 - evicted) * PS].tolist()
    assert _compact(node.key) and node.device_pages is not None
    assert held_bytes(node.device_pages) <= 2 * node.device_pages.nbytes
    assert sorted(tree.device_alloc.used_pages().tolist()) == node.device_pages.tolist()
    tree.check()


def test_a_trimmed_tail_that_stays_on_the_host_owns_compact_keys_and_pages() -> None:
    """A node with a host copy is demoted, not deleted, when evicted from the device: its
    trimmed tail stays in the tree (host-only), so it must not keep the whole node's buffers
    alive through views."""
    tree = _tree("lru", device=64, host=64)
    tokens = np.arange(64 * PS, dtype=np.int64)
    _put(tree, tokens)
    (node,) = tree.root.children.values()
    op = PendingOp()
    assert tree.begin_write(node, op)
    tree.end_write(node)
    assert tree.evict_device(2).freed_pages == 2
    head = tree.root.children[tree.keys(tokens[:PS]).tobytes()]
    (tail,) = head.children.values()
    assert tail.on_host and not tail.on_device and tail.host_pages is not None
    assert tail.key.tolist() == tokens[-2 * PS:].tolist()
    assert _compact(tail.key) and held_bytes(tail.host_pages) <= 2 * tail.host_pages.nbytes
    tree.check()


def test_a_parent_left_a_leaf_by_an_eviction_is_the_next_victim() -> None:
    """Evicting a node's only child makes the node a leaf: it is queued for eviction (the
    delete offers it only to the host tier now; the device offer came just before) and goes
    next, under every policy's check."""
    for eviction in ("lru", "lfu", "arc"):
        tree = _tree(eviction)
        tree.device_eviction_order = []
        _put(tree, np.arange(4 * PS, dtype=np.int64))
        parent = tree.match(np.arange(4 * PS, dtype=np.int64)).last_node
        longer = np.arange(8 * PS, dtype=np.int64)
        match = tree.match(longer)
        pages = tree.device_alloc.alloc(4)
        assert pages is not None and parent is not None
        tree.insert(longer, np.concatenate([match.device_pages(), pages]), start_page=4)
        (child,) = parent.children.values()
        assert tree.evict_device(4).freed_pages == 4
        tree.check()
        assert tree.evict_device(4).freed_pages == 4
        assert tree.device_eviction_order == [child.id, parent.id], eviction
        assert tree.num_nodes == 0


@pytest.mark.parametrize("num", [20, 100, 3000])
def test_a_free_refused_for_a_repeat_leaves_its_pages_allocated_and_freeable(num: int) -> None:
    """A long free with a repeated id raises and changes nothing: every page stays allocated,
    freeing them properly then works, and freeing them again is a double free."""
    alloc = PageAllocator(4096)
    pages = alloc.alloc(num)
    assert pages is not None
    with pytest.raises(PageError, match="twice"):
        alloc.free(np.concatenate([pages, pages[num // 3:num // 3 + 1]]))
    assert alloc.num_used == num and alloc.is_used(pages).all()
    assert alloc.used_pages().tolist() == sorted(pages.tolist())
    alloc.free(pages)
    assert alloc.num_used == 0 and not alloc.is_used(pages).any()
    with pytest.raises(PageError, match="not allocated"):
        alloc.free(pages)
    assert alloc.alloc(num).tolist() == pages.tolist()  # LIFO: the same run, in order


def test_the_free_stack_is_the_lifo_of_a_plain_list() -> None:
    """Random allocs and frees (short and long) against a list used as the stack: alloc takes
    its top n in push order, free pushes the ids so the same-sized alloc returns them as
    given, and `free_pages` lists it with its top last."""
    rng = np.random.default_rng(7)
    alloc, stack = PageAllocator(300), list(range(299, -1, -1))
    held: list[np.ndarray] = []
    for _ in range(2000):
        if rng.random() < 0.5 or not held:
            n = int(rng.integers(0, 90))
            got = alloc.alloc(n)
            if n > len(stack):
                assert got is None
                continue
            assert got is not None
            assert got.tolist() == stack[::-1][:n]
            del stack[len(stack) - n:]
            held.append(got)
        else:
            ids = held.pop(int(rng.integers(len(held))))
            alloc.free(ids)
            stack += ids[::-1].tolist()
        assert alloc.free_pages().tolist() == stack
        assert alloc.num_free == len(stack)
