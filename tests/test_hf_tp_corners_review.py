"""Review of the transformers adapter's corners and of tensor-parallel agreement.

Adapter: a cache cropped by its user (`DynamicCache.crop`, as speculative decoding and
rollbacks do), reset, fed around the adapter, or used as a batch; what `commit_decoded`
commits must be exactly the KV the model computes for those tokens (each hit checked against
recomputation, logits ``torch.equal``), or it is a ConfigError naming what is wrong.

TP (`TPGroup.local`, every rank on this loop): the L3 breaker's probe is decided alike on
every rank, and misuse (one rank's context used from two tasks) fails clearly, never hangs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, PreTrainedModel

from aiohicache import ConfigError, HiCache, HiCacheConfig
from aiohicache.controller import page_format
from aiohicache.distributed import TPGroup
from aiohicache.errors import TPError
from aiohicache.hf import HFAdapter, cache_kwarg, forward, tiny_llama
from aiohicache.storage import MemoryBackend, StorageBackend
from aiohicache.storage.faults import FaultyBackend
from tests.conftest import fill_kv, make_config, make_tokens, prefill
from tests.test_hf import (  # noqa: F401  (an autouse fixture)
    SMALL,
    config_for,
    one_compute_thread,
    recompute,
    tokens_of,
)
from tests.test_hf_misuse_review import assert_cached_kv, decoded
from tests.tp.test_local import on_ranks, opened, serve, tp_caches

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_llama(seed=1, **SMALL)


def feed_directly(model: PreTrainedModel, past: Any, tokens: list[int]) -> None:
    """A pass the adapter does not see (as `model.generate` makes on a given cache)."""
    with torch.no_grad():
        model(torch.tensor([tokens]), use_cache=True, **{cache_kwarg(model): past})


def replay(model: PreTrainedModel, passes: list[list[int] | int]) -> torch.Tensor:
    """The logits of the last of `passes` run on the model's own `DynamicCache`: each a
    forward pass over those tokens, or (an int) a crop to that many tokens."""
    past = DynamicCache(config=model.config)
    logits = torch.empty(0)
    with torch.no_grad():
        for step in passes:
            if isinstance(step, int):
                past.crop(step - past.get_seq_length())
            else:
                logits = model(torch.tensor([step]), use_cache=True,
                               **{cache_kwarg(model): past}).logits
    return logits


# ------------------------------------------------------------------------------ crop


async def test_commit_decoded_after_a_crop_commits_what_the_cache_still_holds(
        llama: PreTrainedModel) -> None:
    """Speculative decoding feeds draft tokens, then crops the rejected ones off the cache
    (`DynamicCache.crop`) and feeds the correction. `commit_decoded` refused every commit
    after that ("holds the KV of 13 tokens, 15 of them fed"): the tokens it had recorded
    still counted the cropped ones. A crop drops them from the record too; the tokens the
    cache holds are committed, and served exactly."""
    prompt = tokens_of(10, seed=21)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            first = int(out.logits[0, -1].argmax())
            drafts = [first, 7, 8, 9]
            forward(llama, drafts, out.past_key_values, all_logits=True)  # verify the drafts
            out.past_key_values.crop(-2)  # two accepted, two rejected
            assert out.past_key_values.tokens == [*prompt, first, 7]
            nxt = int((await adapter.decode(out.past_key_values, 30)).argmax())
            await adapter.commit_decoded(hit, out, [*prompt, first, 7, 30])
            assert (hit.num_cached_tokens, out.num_committed_tokens) == (12, 13)
            await adapter.commit_decoded(hit, out, [*prompt, first, 7, 30])  # nothing new
        assert await assert_cached_kv(cache, llama, [*prompt, *drafts], [10, 4]) == 12
        turn = [*prompt, first, 7, 30, nxt, 1]
        async with cache.fetch(turn) as hit:
            got = await adapter.prefill(hit, turn, all_logits=True)
        assert got.num_reused_tokens == 12
        assert torch.equal(got.logits, replay(llama, [prompt, drafts, 12, [30, nxt, 1]]))
        cache.check_invariants()


async def test_a_crop_then_passes_around_the_adapter_never_commit_their_kv_as_the_cropped_tokens(
        llama: PreTrainedModel) -> None:
    """Cropped, the cache held fewer tokens than the adapter had recorded; passes made
    around the adapter (the model called on the cache, as `model.generate` does) then made
    the counts equal again, and `commit_decoded` committed their KV under the cropped
    tokens: the next turn was served KV the model never computed for it. The record keeps
    only the tokens it knows at their positions: the unknown ones are refused."""
    prompt = tokens_of(10, seed=22)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 3)
            out.past_key_values.crop(-3)
            feed_directly(llama, out.past_key_values, [5, 6, 7])
            with pytest.raises(ConfigError, match=r"^past: holds the KV of 13 tokens, 10 of"):
                await adapter.commit_decoded(hit, out, [*prompt, *fed])
            forward(llama, [8], out.past_key_values)  # after unknown ones: not known either
            with pytest.raises(ConfigError, match=r"^past: holds the KV of 14 tokens, 10 of"):
                await adapter.commit_decoded(hit, out, [*prompt, *fed, 8])
            out.past_key_values.crop(-4)  # back to the known tokens: they commit
            forward(llama, [fed[0]], out.past_key_values)
            await adapter.commit_decoded(hit, out, [*prompt, fed[0]])
        assert await assert_cached_kv(cache, llama, [*prompt, *fed], [10, 1, 1, 1]) == 8
        turn = [*prompt, *fed, 9]
        async with cache.fetch(turn) as hit:
            got = await adapter.prefill(hit, turn, all_logits=True)
        assert torch.equal(got.logits, recompute(llama, turn, got.num_reused_tokens, [10, 1]))
        cache.check_invariants()


async def test_a_crop_below_the_committed_tokens_then_a_commit_names_the_position(
        llama: PreTrainedModel) -> None:
    """Cropped below what `commit_decoded` had committed and decoded on, the new branch was
    dropped unsaid when no longer than the committed tokens (the call returned as if done),
    and refused by the context's commit only after its KV was written. Now a ConfigError
    naming the first position that differs, before anything is written; the committed
    branch stays exact."""
    prompt = tokens_of(10, seed=23)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 4)
            await adapter.commit_decoded(hit, out, [*prompt, *fed])
            out.past_key_values.crop(-2)
            other = (fed[2] + 1) % 500
            forward(llama, [other, 3], out.past_key_values)
            branch = [*prompt, fed[0], fed[1], other, 3]
            for tokens in (branch, [*branch, 4][:-1], branch[:13]):
                with pytest.raises(ConfigError, match=r"^tokens: position 12 is .* committed"):
                    await adapter.commit_decoded(hit, out, tokens)
            await adapter.commit_decoded(hit, out, [*prompt, *fed[:2]])  # a prefix: no-op
            assert out.num_committed_tokens == 14
        assert await assert_cached_kv(cache, llama, [*prompt, *fed], [10, 1, 1, 1, 1]) == 12
        cache.check_invariants()


async def test_a_reset_cache_fed_around_the_adapter_is_refused(
        llama: PreTrainedModel) -> None:
    """`DynamicCache.reset` empties the cache; the adapter's record kept the tokens, and as
    many tokens fed around it made the counts equal: their KV was committed under the
    prompt's decoded tokens (positions 8..11 joined the tree). A reset empties the record."""
    prompt = tokens_of(10, seed=24)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 2)
            out.past_key_values.reset()
            feed_directly(llama, out.past_key_values, tokens_of(12, seed=25))
            with pytest.raises(ConfigError, match=r"^past: holds the KV of 12 tokens, 0 of"):
                await adapter.commit_decoded(hit, out, [*prompt, *fed])
        async with cache.fetch([*prompt, *fed, 0]) as hit:
            assert hit.num_cached_tokens == 8  # the prompt's pages only
        assert await assert_cached_kv(cache, llama, prompt, [10]) == 8
        cache.check_invariants()


async def test_generate_twice_on_the_prefill_cache_matches_and_commits_only_known_tokens(
        llama: PreTrainedModel) -> None:
    """`model.generate` reusing the prefill's cache across two calls generates what it does
    on the model's own `DynamicCache` (the cache is a plain one once detached). Its passes
    bypass the adapter, so their tokens are unknown to it: committing them is a ConfigError
    saying so. The tokens fed through the adapter before them were refused too (the whole
    record was distrusted once the counts differed); they are known, and now commit,
    exactly."""
    prompt = tokens_of(10, seed=26)
    kw = cache_kwarg(llama)

    def generate(past: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
        out: torch.Tensor = llama.generate(ids, max_new_tokens=n, do_sample=False,
                                           **{kw: past})
        return out

    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            first = int(out.logits[0, -1].argmax())
            second = int((await adapter.decode(out.past_key_values, first)).argmax())
            past = out.past_key_values
            once = generate(past, torch.tensor([[*prompt, first, second]]), 3)
            twice = generate(past, torch.cat([once, torch.tensor([[5]])], 1), 2)
            own = DynamicCache(config=llama.config)
            feed_directly(llama, own, prompt)
            feed_directly(llama, own, [first])
            want = generate(own, torch.cat([generate(own, torch.tensor(
                [[*prompt, first, second]]), 3), torch.tensor([[5]])], 1), 2)
            assert torch.equal(twice, want)
            with pytest.raises(ConfigError, match=r"^past: holds the KV of 17 tokens, 11 of"):
                await adapter.commit_decoded(hit, out, twice[0, :-1].tolist())
            await adapter.commit_decoded(hit, out, [*prompt, first])
        assert await assert_cached_kv(cache, llama, [*prompt, first], [10, 1]) == 8
        cache.check_invariants()


# ------------------------------------------------------------------------------ TP: L3 breaker

L3: dict[str, Any] = {"prefetch_policy": "wait_complete", "prefetch_threshold": 8,
                      "device_pages": 16, "host_pages": 32}


def tp_l3_config(rank: int, store: StorageBackend, **overrides: Any) -> HiCacheConfig:
    return make_config(tp_rank=rank, tp_size=2, tp_timeout=5.0, storage=store,
                       **{**L3, **overrides})


def rank_store(rank: int) -> MemoryBackend:
    """An L3 store of TP rank `rank`'s shard (its page format names the shard)."""
    return MemoryBackend(page_format(make_config(tp_rank=rank, tp_size=2, **L3)))


def tp_l3_caches(stores: list[StorageBackend], **overrides: Any) -> list[HiCache]:
    groups = TPGroup.local(2, timeout=5.0)
    return [HiCache(tp_l3_config(r, store, **overrides), tp_group=groups[r])
            for r, store in enumerate(stores)]


async def test_tp_a_half_open_breakers_probe_is_decided_when_the_ranks_counts_differ() -> None:
    """Under TP each rank asks its own store how many pages it has; the tick agrees on the
    least. The exists counted as a success only where this rank's own count was under the
    threshold (no read would follow): a rank whose store had the pages while another's did
    not proposed its count, the ranks agreed on too few, no read followed, and that rank's
    half-open breaker's probe was never decided. It stayed half-open for good: health said
    degraded while the store answered, and one later error bypassed L3 on every rank. The
    probe's outcome is now recorded wherever no read follows the agreed count."""
    prompt = make_tokens(16)
    full = rank_store(0)
    fill = tp_l3_caches([full, rank_store(1)])
    async with opened(fill):
        await on_ranks(fill, lambda r, c: prefill(c, prompt))
        await on_ranks(fill, lambda r, c: c.drain())
    assert full.stats().pages_written == 4  # rank 0's shard of the prompt is in its store

    faulty = FaultyBackend(full, seed=0)
    caches = tp_l3_caches([faulty, rank_store(1)], storage_failures_to_open=1,
                          storage_cooldown=0.05)
    async with opened(caches):
        tier = caches[0].storage
        assert tier is not None
        faulty.error_rate = 1.0
        await on_ranks(caches, lambda r, c: prefill(c, make_tokens(12, seed=1)))
        assert tier.breaker.state == "open"  # rank 0's exists failed
        faulty.error_rate = 0.0
        await asyncio.sleep(0.06)
        assert tier.breaker.state == "half_open"
        calls = full.stats().exists_calls
        hits = await on_ranks(caches, lambda r, c: fetched(c, prompt))
        assert hits == [0, 0]  # rank 1's store lost its pages: a miss on every rank
        assert full.stats().exists_calls == calls + 1  # the probe: rank 0's store answered
        assert tier.breaker.state == "closed"
        assert [c.stats().health for c in caches] == ["ok", "ok"]


async def fetched(cache: HiCache, tokens: list[int]) -> int:
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        return hit.num_cached_tokens


async def test_commit_decoded_of_one_prefill_from_two_tasks_is_refused_and_commits_later(
        llama: PreTrainedModel) -> None:
    """Two `commit_decoded` of one prefill at once (misuse: two tasks on one request) each
    leased from the same partial page's end: one was refused with a misleading error ("slots:
    need one slot per token", or "tokens: must be a prefix or an extension", by the
    interleaving), and the prefill could keep the other's count and stale slots, so every
    later call was refused too ("hit: holds 16 committed tokens, the prefill 12"): the output
    was never cached. The second is now a ConfigError saying so, nothing written; once the
    first is done, the next commits."""
    prompt = tokens_of(10, seed=27)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 8)
            first, second = await asyncio.gather(
                adapter.commit_decoded(hit, out, [*prompt, *fed[:3]]),
                adapter.commit_decoded(hit, out, [*prompt, *fed[:6]]), return_exceptions=True)
            assert first is None
            assert isinstance(second, ConfigError)
            assert str(second).startswith("prefill: another `commit_decoded` of it is under way")
            assert (hit.num_cached_tokens, out.num_committed_tokens) == (12, 13)
            await adapter.commit_decoded(hit, out, [*prompt, *fed])
            assert hit.num_cached_tokens == 16
        assert await assert_cached_kv(cache, llama, [*prompt, *fed], [10, *[1] * 8]) == 16
        cache.check_invariants()


# ------------------------------------------------------------------------------ TP: misuse


async def test_tp_one_context_used_from_two_tasks_on_one_rank_stops_every_rank() -> None:
    """Misuse: rank 0 allocates on one context from two tasks at once, rank 1 makes the
    same calls one after the other. Whether an allocate leases a page (an op) or takes the
    rest of the one before (none) depends on the timing, so the ranks' op logs differ.
    Every rank stops with a TP error within the timeout (no hang), and no rank serves
    afterwards: a later call raises on every rank. (Found fine; the misusing rank's error
    is a timeout that does not name the misuse.)"""
    caches = tp_caches(2, timeout=1.0)
    tokens = make_tokens(10)

    async def misuse(r: int, cache: HiCache) -> None:
        async with cache.fetch(tokens) as hit:
            if r == 0:
                await asyncio.gather(hit.allocate(2), hit.allocate(2))
            else:
                await hit.allocate(2)
                await hit.allocate(2)
            slots = await hit.allocate(6)
            fill_kv(cache, slots, tokens[4:])

    async with opened(caches):
        async with asyncio.timeout(10):
            outcomes = await asyncio.gather(*(misuse(r, c) for r, c in enumerate(caches)),
                                            return_exceptions=True)
            assert isinstance(outcomes[0], TPError)
            for cache in caches:
                with pytest.raises(TPError):
                    await serve(cache, make_tokens(8, seed=3))
                assert cache.stats().health == "failed"
