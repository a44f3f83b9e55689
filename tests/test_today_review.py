"""Review of today's request bookkeeping: where a context's `allocate` continues after a
commit (`Request._keep_tail`), and the rule it keeps (docs/api.md, "Allocation, leases
and commit"): leased slots belong to the caller until a commit inserts them or `free`
returns them; an `allocate` never hands out a slot the caller still holds.
"""

from __future__ import annotations

from tests.conftest import make_cache, make_tokens

PS = 4


async def test_a_freed_partial_page_leased_again_by_cache_allocate_is_not_continued() -> None:
    """A context's allocate(6) leaves its mark on its last page P (2 slots handed out). The
    caller frees P's slots; `HiCache.allocate(4)` leases P again, all 4 slots handed out,
    and a commit adopts P as its partial tail. The context must not continue P after slot 2
    (the stale mark): slots 2 and 3 are the caller's, from `HiCache.allocate`."""
    cache = make_cache(device_pages=3)
    async with cache:
        prompt = make_tokens(6, seed=21)
        async with cache.fetch(prompt) as hit:
            slots = await hit.allocate(6)
            spare = await cache.allocate(PS)  # the pool's third page, given back below
            cache.free(slots[PS:])  # the caller gives back the partial page
            again = await cache.allocate(PS)  # the only free page: the one just freed
            assert again[0] == slots[PS]
            await hit.commit(prompt[:5], slots.new_tensor([*slots[:PS].tolist(),
                                                           int(again[0])]))
            cache.free(spare)
            more = await hit.allocate(2)
            held = set(again[1:].tolist()) & set(more.tolist())
            assert not held, f"slots {sorted(held)} handed out again while still held"
        cache.check_invariants()
        assert cache.stats().device_pages_leased == 0
