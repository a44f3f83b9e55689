"""Review of the request bookkeeping (`_request`, `_context`, `_leases`): what a context's
`allocate` hands out after a commit that covered only part of what it had allocated.

The rule (docs/api.md, "Allocation, leases and commit"): leased slots belong to the caller
until a commit inserts them or `free` returns them; an `allocate` after a commit that ended
mid-page continues in the free rest of that page. A slot the caller still holds is not free.
"""

from __future__ import annotations

from aiohicache.testing import KVOracle
from tests.conftest import make_cache, make_tokens

PS = 4


async def test_an_allocate_after_a_partial_commit_never_hands_out_slots_still_held() -> None:
    """allocate(10) for a prompt (pages P0, P1, P2), commit of its first 6 tokens (a chunk
    of a chunked prefill): P0 joins the tree, the slots of tokens 6..9 (on P1 and P2) are
    still the caller's. The commit moved the context's mark back to P1 (2 slots used), so
    the next allocate handed out P1's slots 6 and 7 again: the new tokens' KV overwrote the
    prompt's, and the commit of the whole prompt served the other tokens' KV."""
    cache = make_cache()
    async with cache:
        kv = KVOracle(cache)
        prompt = make_tokens(10, seed=7)
        async with cache.fetch(prompt) as hit:
            slots = await hit.allocate(10)
            kv.fill(slots, prompt)
            await hit.commit(prompt[:6], slots[:6])  # the first chunk
            assert hit.num_cached_tokens == PS
            extra = [*prompt, 501, 502]
            more = await hit.allocate(2)  # two more tokens, while 6..9 are still held
            held = set(slots[6:].tolist()) & set(more.tolist())
            assert not held, f"slots {sorted(held)} handed out again while still held"
            kv.fill(more, extra, 10)
            await hit.commit(extra, slots[PS:].new_tensor([*slots[PS:].tolist(),
                                                          *more.tolist()]))
            await kv.check_hit(hit, extra)
        cache.check_invariants()
        assert cache.stats().device_pages_leased == 0
        assert await kv.prefill(extra) == 3 * PS


async def test_a_commit_ending_on_a_page_keeps_continuing_the_last_page_allocated() -> None:
    """allocate(10) (P0, P1, P2; 2 slots of P2 used), commit of 8 tokens: P2 is still the
    context's, with 2 free slots; the next allocate(2) continues it rather than leasing a
    fresh page beside it (and never hands out slots 8, 9)."""
    cache = make_cache()
    async with cache:
        kv = KVOracle(cache)
        prompt = make_tokens(10, seed=8)
        async with cache.fetch(prompt) as hit:
            slots = await hit.allocate(10)
            kv.fill(slots, prompt)
            await hit.commit(prompt[:8], slots[:8])
            more = await hit.allocate(2)
            assert more.tolist() == [int(slots[9]) + 1, int(slots[9]) + 2]
            assert cache.stats().device_pages_leased == 1
            extra = [*prompt, 601, 602]
            kv.fill(more, extra, 10)
            await hit.commit(extra, slots[8:].new_tensor([*slots[8:].tolist(),
                                                         *more.tolist()]))
            await kv.check_hit(hit, extra)
        cache.check_invariants()
        assert cache.stats().device_pages_leased == 0


async def test_a_decode_commit_does_not_walk_the_prefix_it_already_holds() -> None:
    """Each commit of a decode adds a node of one page under the last: the tree's insert
    walked from the root, comparing every node of the context's pinned prefix again, so a
    commit 3,000 pages into a sequence held the loop about 35 ms (quadratic in its length).
    It starts at the pinned node: the steps a commit takes stay the same however long the
    sequence grew."""
    cache = make_cache(device_pages=96, host_pages=8)
    async with cache:
        kv = KVOracle(cache)
        tokens = make_tokens(PS, seed=9)
        tree = cache.tree
        steps = [0]  # [the fetch's], then one count per commit
        real_step = tree._step

        def counted(node: object, toks: object, pos: int) -> object:
            steps[-1] += 1
            return real_step(node, toks, pos)  # type: ignore[arg-type]
        tree._step = counted  # type: ignore[method-assign]
        async with cache.fetch(tokens) as hit:
            slots = await hit.allocate(PS)
            kv.fill(slots, tokens)
            for page in range(64):
                steps.append(0)
                await hit.commit(tokens, slots)
                tokens = [*tokens, *make_tokens(PS, seed=100 + page)]
                slots = await hit.allocate(PS)
                kv.fill(slots, tokens, len(tokens) - PS)
            assert hit.num_cached_tokens == 64 * PS
            assert max(steps[2:]) <= 1, f"steps per commit: {steps[1:]}"
            await kv.check_hit(hit, tokens[:64 * PS])
        cache.check_invariants()


async def test_a_page_from_cache_allocate_is_continued_after_its_last_slot_handed_out() -> None:
    """Slots leased by `HiCache.allocate` and committed in part: the context adopts the
    committed tail page, and its next `allocate` continues that page only after the last
    slot `HiCache.allocate` handed out. It continued after the committed tokens, handing
    out slots the caller still held (tokens 6 and 7 here) for new tokens."""
    cache = make_cache()
    async with cache:
        kv = KVOracle(cache)
        prompt = make_tokens(10, seed=11)
        async with cache.fetch(prompt) as hit:
            slots = await cache.allocate(10)
            kv.fill(slots, prompt)
            await hit.commit(prompt[:6], slots[:6])
            more = await hit.allocate(2)
            held = set(slots[6:].tolist()) & set(more.tolist())
            assert not held, f"slots {sorted(held)} handed out again while still held"
            cache.free(slots[8:])  # the caller gives back the page it will not use
        cache.check_invariants()
        assert cache.stats().device_pages_leased == 0
        # the usual case still continues in place: allocate the prompt, commit all of it
        prompt = make_tokens(6, seed=12)
        async with cache.fetch(prompt) as hit:
            slots = await cache.allocate(6)
            kv.fill(slots, prompt)
            await hit.commit(prompt, slots)
            more = await hit.allocate(1)
            assert more.tolist() == [int(slots[5]) + 1]
        cache.check_invariants()
