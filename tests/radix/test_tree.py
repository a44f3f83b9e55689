"""RadixTree: page-granular match with splits, insert/dedup, pins, and exact eviction order."""

from __future__ import annotations

import numpy as np
import pytest

from aiohicache import InvariantError
from aiohicache.memory import PageAllocator
from aiohicache.radix import DeviceState, HostState, PendingOp, RadixTree

PS = 2


def make_tree(device: int = 16, host: int = 16, eviction: str = "lru") -> RadixTree:
    tree = RadixTree(page_size=PS, device_alloc=PageAllocator(device, name="device"),
                     host_alloc=PageAllocator(host, name="host"),
                     eviction=eviction)  # type: ignore[arg-type]
    tree.device_eviction_order = []
    return tree


def put(tree: RadixTree, tokens: list[int]) -> None:
    """Insert `tokens` (whole pages) with freshly allocated device pages."""
    match = tree.match(tuple(tokens), touch=False)
    pages = tree.device_alloc.alloc(len(tokens) // PS - match.num_device_pages)
    assert pages is not None
    all_pages = np.concatenate([match.device_pages(), pages])
    res = tree.insert(tuple(tokens), all_pages, start_page=match.num_device_pages)
    for dup in res.duplicate_pages:
        tree.device_alloc.free(dup)
    tree.check()


def backup(tree: RadixTree, tokens: list[int]) -> None:
    """Give every node on the path of `tokens` a settled host copy (as write-through does)."""
    op = PendingOp()
    for node in tree.match(tuple(tokens), touch=False).path:
        if not node.on_host:
            assert tree.begin_write(node, op)
    for node in op.nodes:
        tree.end_write(node)
    tree.check()


def test_match_on_empty_tree_finds_nothing() -> None:
    tree = make_tree()
    m = tree.match((1, 2, 3, 4))
    assert m.path == [] and m.num_device_pages == 0


def test_match_is_page_granular_and_ignores_a_partial_tail() -> None:
    tree = make_tree()
    put(tree, [1, 2, 3, 4, 5, 6])
    assert tree.match((1, 2, 3, 4, 5)).num_device_pages == 2
    assert tree.match((1, 2, 3, 9, 5, 6)).num_device_pages == 1
    assert tree.match((1, 9)).num_device_pages == 0


def test_match_inside_a_node_splits_it_at_the_page_boundary() -> None:
    tree = make_tree()
    put(tree, [1, 2, 3, 4, 5, 6])
    (node,) = tree.match((1, 2, 3, 4, 5, 6), touch=False).path
    pages = node.device_pages.tolist()
    m = tree.match((1, 2, 3, 4, 7, 7))
    assert [len(n.key) for n in m.path] == [4]
    assert m.device_pages().tolist() == pages[:2]
    assert tree.num_nodes == 2
    full = tree.match((1, 2, 3, 4, 5, 6), touch=False)
    assert full.device_pages().tolist() == pages
    tree.check()


def test_insert_shares_the_common_prefix_and_branches() -> None:
    tree = make_tree()
    put(tree, [1, 2, 3, 4])
    put(tree, [1, 2, 5, 6])
    assert tree.num_nodes == 3
    assert tree.device_alloc.num_used == 3


def test_insert_reports_pages_of_a_prefix_inserted_meanwhile_as_duplicates() -> None:
    tree = make_tree()
    put(tree, [1, 2, 3, 4])
    mine = tree.device_alloc.alloc(2)
    res = tree.insert((1, 2, 3, 4), mine, start_page=0)
    assert [d.tolist() for d in res.duplicate_pages] == [mine.tolist()]
    assert res.new_nodes == []


def test_insert_revives_a_host_only_node_with_fresh_device_pages() -> None:
    tree = make_tree()
    put(tree, [1, 2, 3, 4])
    backup(tree, [1, 2, 3, 4])
    tree.evict_device(2)
    (node,) = tree.match((1, 2, 3, 4), touch=False).path
    assert node.device_state is DeviceState.ABSENT and node.host_state is HostState.RESIDENT
    fresh = tree.device_alloc.alloc(2)
    res = tree.insert((1, 2, 3, 4), fresh, start_page=0)
    assert res.new_nodes == [node] and node.device_pages.tolist() == fresh.tolist()
    tree.check()


def test_lru_evicts_least_recently_used_leaves_first_in_exact_order() -> None:
    tree = make_tree()
    seqs = {first: (first, first, first + 1, first + 1) for first in (10, 20, 30, 40)}
    for seq in seqs.values():
        put(tree, list(seq))
    ids = {first: tree.match(seq, touch=False).path[0].id for first, seq in seqs.items()}
    tree.match(seqs[30])
    tree.match(seqs[10])
    tree.evict_device(8)
    assert tree.device_eviction_order == [ids[20], ids[40], ids[30], ids[10]]
    assert tree.device_alloc.num_used == 0 and tree.num_nodes == 0


def test_eviction_frees_children_before_parents() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2])
    put(tree, [1, 1, 3, 3])
    parent = tree.match((1, 1), touch=False).path[0]
    a = tree.match((1, 1, 2, 2), touch=False).path[1]
    b = tree.match((1, 1, 3, 3), touch=False).path[1]
    tree.match((1, 1, 2, 2))  # a is now more recent than b
    tree.evict_device(3)
    assert tree.device_eviction_order == [b.id, a.id, parent.id]


def test_lfu_evicts_least_hit_first() -> None:
    tree = make_tree(eviction="lfu")
    for first in (10, 20, 30):
        put(tree, [first, first])
    ids = [tree.match((f, f), touch=False).path[0].id for f in (10, 20, 30)]
    for _ in range(3):
        tree.match((10, 10))
    tree.match((30, 30))
    tree.evict_device(3)
    assert tree.device_eviction_order == [ids[1], ids[2], ids[0]]


def test_pinned_prefix_is_not_evicted() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2])
    put(tree, [5, 5])
    pinned = tree.match((1, 1, 2, 2)).last_device_node
    tree.lock(pinned)
    ev = tree.evict_device(10)
    assert ev.freed_pages == 1
    assert tree.match((1, 1, 2, 2), touch=False).num_device_pages == 2
    tree.unlock(pinned)
    assert tree.evict_device(10).freed_pages == 2
    with pytest.raises(InvariantError):
        tree.unlock(pinned)


def test_eviction_of_a_backed_up_leaf_demotes_it_to_host() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2])
    backup(tree, [1, 1, 2, 2])
    tree.evict_device(2)
    m = tree.match((1, 1, 2, 2))
    assert m.num_device_nodes == 0 and m.num_host_pages == 2
    assert tree.host_alloc.num_used == 2 and tree.device_alloc.num_used == 0
    tree.check()


def test_host_eviction_deletes_host_only_leaves_lru() -> None:
    tree = make_tree()
    for first in (10, 20):
        put(tree, [first, first])
        backup(tree, [first, first])
    tree.evict_device(2)
    tree.match((10, 10))
    assert tree.evict_host(1) == 1
    assert tree.match((20, 20), touch=False).path == []
    assert tree.match((10, 10), touch=False).num_host_pages == 1
    tree.check()


def test_write_back_eviction_stages_to_host_and_frees_device_when_settled() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2])
    op = PendingOp()
    ev = tree.evict_device(2, write_back=op)
    (node,) = ev.write_backs
    assert ev.freed_pages == 0 and node.host_state is HostState.WRITING
    assert tree.device_alloc.num_used == 2
    tree.check()
    tree.end_write(node, demote=True)
    assert node.device_state is DeviceState.ABSENT and tree.device_alloc.num_used == 0
    tree.check()


def test_load_marks_loading_then_resident() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2])
    backup(tree, [1, 1, 2, 2])
    tree.evict_device(2)
    (node,) = tree.match((1, 1, 2, 2)).host_nodes
    op = PendingOp()
    assert tree.begin_load(node, op)
    assert node.device_state is DeviceState.LOADING and node.host_ref == 1
    assert tree.match((1, 1, 2, 2)).num_device_nodes == 1  # loading counts as device prefix
    tree.evict_device(2)
    assert node.device_state is DeviceState.LOADING  # never evicted mid-load
    tree.end_load(node)
    assert node.device_state is DeviceState.RESIDENT and node.host_ref == 0
    tree.check()


def test_split_of_a_loading_node_keeps_both_halves_owned_by_the_op() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2, 3, 3])
    backup(tree, [1, 1, 2, 2, 3, 3])
    tree.evict_device(3)
    (node,) = tree.match((1, 1, 2, 2, 3, 3)).host_nodes
    op = PendingOp()
    tree.begin_load(node, op)
    tree.match((1, 1, 9, 9))  # splits the loading node
    assert len(op.nodes) == 2
    tree.check()
    for n in op.nodes:
        tree.end_load(n)
    tree.check()


def test_fingerprint_is_equal_for_equal_histories() -> None:
    a, b = make_tree(), make_tree()
    for tree in (a, b):
        put(tree, [1, 1, 2, 2])
        put(tree, [1, 1, 3, 3])
    assert a.fingerprint() == b.fingerprint()
    put(b, [4, 4])
    assert a.fingerprint() != b.fingerprint()


def test_eviction_is_page_granular_and_takes_the_tail_first() -> None:
    tree = make_tree()
    put(tree, [1, 1, 2, 2, 3, 3, 4, 4])
    ev = tree.evict_device(3)
    assert ev.freed_pages == 3 and tree.device_alloc.num_used == 1
    assert tree.match((1, 1, 2, 2, 3, 3, 4, 4), touch=False).num_device_pages == 1
    tree.check()


def test_bench_tree_runs_the_named_eviction_policy() -> None:
    from aiohicache.bench.tree import bench_tree, format_tree
    from aiohicache.replay import load_trace

    requests = load_trace("mooncake", limit=1000)
    lru, arc = (bench_tree(requests, capacity_tokens=1_000_000, page_size=16, eviction=name)
                for name in ("lru", "arc"))
    assert (lru.eviction, arc.eviction) == ("lru", "arc")
    assert lru.hit_ratio != arc.hit_ratio  # the policy reached the tree
    assert "eviction arc" in format_tree(arc)


def test_a_write_back_with_no_host_room_evicts_only_the_pages_needed() -> None:
    """Staging to the host failed (full, nothing there to evict) and the whole untrimmed
    leaf was dropped, however few pages were asked for (a review)."""
    dev, host = PageAllocator(8, name="d"), PageAllocator(2, name="h")
    tree = RadixTree(page_size=1, device_alloc=dev, host_alloc=host, eviction="lru")
    tree.insert(np.arange(6), dev.alloc(6))
    host.alloc(2)  # the host is full, and holds nothing of the tree
    ev = tree.evict_device(1, write_back=PendingOp())
    assert (ev.freed_pages, ev.write_backs, dev.num_free) == (1, [], 3)
    assert tree.match(tuple(range(6)), touch=False).num_device_pages == 5  # the head stays
    tree.check()


def test_stale_queue_entries_are_dropped_without_walking_the_tree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hits leave stale entries in the eviction queues; once they outnumbered the nodes, the
    queues were rebuilt by walking every node (193 ms of the loop at 100k nodes, recurring
    under steady traffic). They are now dropped a few per push and pop, and the eviction
    order stays exact LRU while that runs."""
    tree = make_tree(device=2 * 600)
    seqs = [(i, i, i + 1, i + 1) for i in range(0, 6000, 10)]  # 600 leaves of 2 pages
    for seq in seqs:
        put(tree, list(seq))
    monkeypatch.setattr(type(tree), "iter_nodes", walked)
    rng = np.random.default_rng(5)
    for i in rng.integers(0, len(seqs), 6000):  # stale entries: 10x the nodes
        tree.match(seqs[i])
    assert tree.device_policy.compacting or tree.device_policy.num_entries < 4 * 600 + 1024
    ids = {tree.match(seq, touch=False).path[0].id: seq for seq in seqs}
    by_recency = sorted(ids, key=lambda i: tree.match(ids[i], touch=False).path[0].last_access)
    tree.evict_device(2 * 600)
    assert tree.device_eviction_order == by_recency


def walked(self: object) -> None:
    raise AssertionError("walked every node of the tree")
