"""PageAllocator: O(k) alloc/free, contiguous reuse, and loud failure on misuse."""

from __future__ import annotations

import numpy as np
import pytest

from aiohicache import ConfigError, PageError
from aiohicache.memory import PageAllocator


def test_fresh_allocator_hands_out_ascending_pages() -> None:
    alloc = PageAllocator(8)
    assert alloc.alloc(3).tolist() == [0, 1, 2]
    assert alloc.alloc(2).tolist() == [3, 4]
    assert (alloc.num_used, alloc.num_free, alloc.capacity) == (5, 3, 8)


def test_freed_run_is_reused_first_and_in_order() -> None:
    alloc = PageAllocator(8)
    run = alloc.alloc(4)
    alloc.alloc(2)
    alloc.free(run)
    assert alloc.alloc(4).tolist() == run.tolist()


def test_alloc_beyond_free_returns_none_and_takes_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1


def test_alloc_zero_is_empty_and_negative_is_an_error() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(0).tolist() == []
    with pytest.raises(ConfigError, match="^n:"):
        alloc.alloc(-1)


def test_capacity_must_be_a_non_negative_int() -> None:
    with pytest.raises(ConfigError, match="^capacity:"):
        PageAllocator(-1)
    assert PageAllocator(0).alloc(1) is None  # an absent tier


def test_double_free_is_detected_and_frees_nothing() -> None:
    alloc = PageAllocator(8)
    pages = alloc.alloc(4)
    alloc.free(pages[:2])
    with pytest.raises(PageError, match="not allocated"):
        alloc.free(pages)  # pages 0, 1 are already free
    assert alloc.num_free == 6  # 2, 3 still allocated: nothing was freed by the bad call
    assert alloc.is_used(pages[2:]).all()


def test_foreign_ids_are_detected() -> None:
    alloc = PageAllocator(8)
    alloc.alloc(8)
    with pytest.raises(PageError, match="foreign"):
        alloc.free([8])
    with pytest.raises(PageError, match="foreign"):
        alloc.free([-1])


@pytest.mark.parametrize("num", [20, 100])  # past the one-by-one check; past the set check
@pytest.mark.parametrize(("bad", "error"), [(-1, "foreign"), (-(2**40), "foreign"),
                                            (256, "foreign"), (2**40, "foreign"),
                                            ("free", "not allocated"), ("repeat", "twice")])
def test_a_long_free_with_one_bad_id_raises_and_frees_nothing(num: int, bad: object,
                                                              error: str) -> None:
    alloc = PageAllocator(256)
    pages = alloc.alloc(200)
    assert pages is not None
    alloc.free(pages[150:])  # 50 free pages to name
    ids = pages[:num].copy()
    ids[num // 2] = pages[160] if bad == "free" else ids[0] if bad == "repeat" else bad
    with pytest.raises(PageError, match=error):
        alloc.free(ids)
    assert alloc.num_used == 150
    assert alloc.is_used(pages[:150]).all()


@pytest.mark.parametrize("ids", [[0.9], np.array([0.5, 1.7]), [True], np.arange(20) + 0.5],
                         ids=["float", "floats", "bool", "long-floats"])
def test_ids_that_are_not_integers_are_refused_and_free_nothing(ids: object) -> None:
    """A float or bool id would be cast to another page (0.9 to 0), freeing a page someone
    still holds."""
    alloc = PageAllocator(32)
    pages = alloc.alloc(24)
    with pytest.raises(PageError, match="integers"):
        alloc.free(ids)  # type: ignore[arg-type]
    assert alloc.num_used == 24 and alloc.is_used(pages).all()


def test_repeated_id_in_one_free_is_detected() -> None:
    alloc = PageAllocator(8)
    alloc.alloc(4)
    with pytest.raises(PageError, match="twice"):
        alloc.free([1, 1])
    assert alloc.num_used == 4


def test_free_of_nothing_is_a_no_op() -> None:
    alloc = PageAllocator(2)
    alloc.free(np.empty(0, dtype=np.int64))
    assert alloc.num_free == 2


def test_used_and_free_partition_the_pool() -> None:
    alloc = PageAllocator(16)
    rng = np.random.default_rng(0)
    held: list[np.ndarray] = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(int(rng.integers(len(held)))))
        else:
            got = alloc.alloc(int(rng.integers(1, 4)))
            if got is not None:
                held.append(got)
        used = set(alloc.used_pages().tolist())
        free = set(alloc.free_pages().tolist())
        assert not used & free and len(used | free) == 16
        assert used == {int(p) for arr in held for p in arr}
