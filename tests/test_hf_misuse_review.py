"""Review of the transformers adapter under misuse: no call of the public adapter API puts
KV into the cache that the model would not compute for those tokens.

Each hit is checked against the model itself: logits ``torch.equal`` to `recompute` (the
same forward calls, the prefix kept in the model's own `DynamicCache`), or the pool's KV
equal to a `DynamicCache` filled by the same calls.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, PreTrainedModel

from aiohicache import ClosedError, ConfigError, HiCache
from aiohicache.hf import HFAdapter, Prefill, cache_kwarg, forward, layer_kv, tiny_llama
from tests.test_cancel_sweep_review import run_cancelled_at
from tests.test_hf import (  # noqa: F401  (an autouse fixture)
    SMALL,
    config_for,
    one_compute_thread,
    recompute,
    tokens_of,
)


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_llama(seed=1, **SMALL)


def reference(model: PreTrainedModel, tokens: list[int], chunks: list[int]) -> DynamicCache:
    """The model's own cache after forward calls over `chunks` tokens of `tokens`."""
    past, start = DynamicCache(config=model.config), 0
    with torch.no_grad():
        for n in chunks:
            model(torch.tensor([tokens[start:start + n]]), use_cache=True,
                  **{cache_kwarg(model): past})
            start += n
    return past


async def assert_cached_kv(cache: HiCache, model: PreTrainedModel, tokens: list[int],
                           chunks: list[int]) -> int:
    """Every layer's K and V that the cache serves for `tokens` equal the model's own for
    the forward calls over `chunks`; returns how many tokens it serves."""
    want = reference(model, tokens, chunks)
    async with cache.fetch([*tokens, 0]) as hit:
        await hit.ready()
        idx, pool = hit.device_indices, cache.device_pool
        for layer in range(len(want.layers)):
            keys, values = layer_kv(want, layer)
            assert torch.equal(pool.k_buffer(layer)[idx].transpose(0, 1),
                               keys[0, :, :len(idx)]), f"layer {layer}'s K"
            assert torch.equal(pool.v_buffer(layer)[idx].transpose(0, 1),
                               values[0, :, :len(idx)]), f"layer {layer}'s V"
        return len(idx)


async def decoded(adapter: HFAdapter, out: Prefill, steps: int) -> tuple[list[int], int]:
    """Decode greedily `steps` tokens after `out`: the tokens fed, and the next one (whose
    KV is not computed)."""
    fed, token = [], int(out.logits[0, -1].argmax())
    for _ in range(steps):
        fed.append(token)
        token = int((await adapter.decode(out.past_key_values, token)).argmax())
    return fed, token


async def test_commit_decoded_refuses_tokens_other_than_those_fed(
        llama: PreTrainedModel) -> None:
    """`commit_decoded` trusted the tokens it was given: a sampled token replaced after it
    was fed (a caller's post-processing, an edited turn) was committed with the fed token's
    KV, and the next turn quoting it was served KV the model never computed for it (its
    logits 0.05 off). The adapter knows what was fed (`PoolCache.tokens`): a mismatch is a
    ConfigError naming the position, and nothing is written."""
    prompt = tokens_of(10, seed=6)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 2)
            swapped = [*prompt, fed[0], (fed[1] + 1) % 500]
            with pytest.raises(ConfigError, match=r"^tokens: position 11 is .* fed"):
                await adapter.commit_decoded(hit, out, swapped)
            assert out.past_key_values.tokens == [*prompt, *fed]
        turn = [*swapped, 5, 6]
        async with cache.fetch(turn) as hit:
            got = await adapter.prefill(hit, turn, all_logits=True)
        assert got.num_reused_tokens == 8  # the prompt's pages, not the swapped one's
        assert torch.equal(got.logits, recompute(llama, turn, 8, [10]))
        cache.check_invariants()


async def test_commit_decoded_refuses_a_cache_fed_outside_the_adapter(
        llama: PreTrainedModel) -> None:
    """A pass the adapter did not see (the model called directly on the cache) leaves KV of
    tokens it cannot check: refused, not committed as whatever tokens the caller names.
    Passes through `hf.forward` (the serving engine's) are recorded and committed."""
    prompt = tokens_of(10, seed=7)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            first = int(out.logits[0, -1].argmax())
            second = int(forward(llama, [first], out.past_key_values)[0, -1].argmax())
            await adapter.commit_decoded(hit, out, [*prompt, first])  # recorded: committed
            with torch.no_grad():
                llama(torch.tensor([[second]]), use_cache=True,
                      **{cache_kwarg(llama): out.past_key_values})
            with pytest.raises(ConfigError, match=r"^past: holds the KV of 12 tokens, 11"):
                await adapter.commit_decoded(hit, out, [*prompt, first, 99])
        assert await assert_cached_kv(cache, llama, [*prompt, first], [10, 1]) == 8
        cache.check_invariants()


async def test_commit_decoded_refuses_a_prefill_of_another_context(
        llama: PreTrainedModel) -> None:
    """The prefill's partial page belongs to the context it ran in. Given to a new context of
    the same prompt after the old one exited (same committed count, so it passed), the
    decoded KV was written into that page's slots, freed and meanwhile leased and committed
    by another prompt: that prompt was then served the decoded tokens' KV (logits 0.16
    off). Now refused before anything is written."""
    prompt, other = tokens_of(10, seed=8), tokens_of(12, seed=9)
    async with HiCache(config_for(llama, device_pages=6)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 1)
        async with cache.fetch(other) as taken:  # gets the freed partial page
            await adapter.prefill(taken, other)
            assert set(out.tail_slots.tolist()) <= set(taken.device_indices.tolist())
        async with cache.fetch(prompt) as again:
            assert again.num_cached_tokens == 8
            with pytest.raises(ConfigError) as refused:
                await adapter.commit_decoded(again, out, [*prompt, *fed])
        async with cache.fetch(other) as hit:
            got = await adapter.prefill(hit, other, all_logits=True)
        assert torch.equal(got.logits, recompute(llama, other, got.num_reused_tokens))
        assert await assert_cached_kv(cache, llama, other, [12]) == 12
        assert str(refused.value).startswith("hit: not the context")  # before any write
        cache.check_invariants()


async def test_a_second_model_on_one_cache_is_refused(llama: PreTrainedModel) -> None:
    """Pages are matched by tokens alone: a second model of the same KV shape (a fine-tune,
    another seed) adapted to the cache was served the first one's KV (logits 0.4 off). A
    cache holds one model's KV: another model is a ConfigError; more adapters of the same
    model (another executor) are fine."""
    other = tiny_llama(seed=2, **SMALL)
    prompt = tokens_of(18, seed=3)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        with pytest.raises(ConfigError, match=r"^cache: it holds the KV of another model"):
            HFAdapter(other, cache)
        HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            await adapter.prefill(hit, prompt)
    async with HiCache(config_for(other)) as cache:  # its own cache: fine
        second = HFAdapter(other, cache)
        async with cache.fetch([*prompt, 1]) as hit:
            got = await second.prefill(hit, [*prompt, 1], all_logits=True)
        assert got.num_reused_tokens == 0
        assert torch.equal(got.logits, recompute(other, [*prompt, 1], 0))


@pytest.mark.parametrize("how", ["task", "steps"])
async def test_commit_decoded_cancelled_anywhere_then_called_again_commits_exactly(
        llama: PreTrainedModel, how: str) -> None:
    """A `commit_decoded` cancelled after its `allocate` had taken the rest of the partial
    page; called again, it allocated the slots after those (a page's middle) and its commit
    was refused ("slots: must cover whole pages in order"): the output was never cached.
    Cancelled at each of its suspensions (or loop turns), a next call commits, and the
    cache serves exactly the model's KV."""
    prompt = tokens_of(25, seed=10)  # 6 pages and one token
    runs = 0
    for at in range(12):
        async with HiCache(config_for(llama)) as cache:
            adapter = HFAdapter(llama, cache)
            async with cache.fetch(prompt) as hit:
                out = await adapter.prefill(hit, prompt)
                fed, _ = await decoded(adapter, out, 4)
                outcome = await run_cancelled_at(
                    adapter.commit_decoded(hit, out, [*prompt, *fed[:2]]), at, how)
                assert outcome.result in ("cancelled", "completed"), outcome
                runs += outcome.result == "cancelled"
                await adapter.commit_decoded(hit, out, [*prompt, *fed])
                assert hit.num_cached_tokens == 28
            await cache.drain()
            assert cache.stats().device_pages_leased == 0
            assert await assert_cached_kv(cache, llama, [*prompt, *fed], [25, 1, 1, 1, 1]) == 28
            cache.check_invariants()
    assert runs >= 2  # the sweep cancelled calls at several points


async def test_cancelled_requests_leave_exact_kv_and_the_next_request_is_exact(
        llama: PreTrainedModel) -> None:
    """A request (prefill over a cached prefix, decode, two `commit_decoded`) cancelled at
    each of its suspensions: what it committed is the model's KV, nothing stays leased, and
    the same request run again gets the same tokens and commits exact KV. (Found nothing.)"""
    base = tokens_of(20, seed=11)
    prompt = [*base, *tokens_of(5, seed=12)]
    result: dict[str, Any] = {}

    async def request(adapter: HFAdapter) -> list[int]:
        async with adapter.cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            result["reused"] = out.num_reused_tokens
            seq, token = [*prompt], int(out.logits[0, -1].argmax())
            for step in range(3):
                seq.append(token)
                token = int((await adapter.decode(out.past_key_values, token)).argmax())
                if step:
                    await adapter.commit_decoded(hit, out, seq)
        return seq

    async def opened(cache: HiCache) -> HFAdapter:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(base) as hit:
            await adapter.prefill(hit, base)
        return adapter

    async with HiCache(config_for(llama)) as cache:
        seq = await request(await opened(cache))
    chunks = [20, 5, 1, 1, 1]
    for at in range(8):
        async with HiCache(config_for(llama)) as cache:
            adapter = await opened(cache)
            outcome = await run_cancelled_at(request(adapter), at, "task")
            assert outcome.result in ("cancelled", "completed"), outcome
            await cache.drain()
            assert cache.stats().device_pages_leased == 0
            kept = await assert_cached_kv(cache, llama, seq, chunks)
            assert await request(adapter) == seq
            reused = result["reused"]
            # its KV: the cancelled run's committed pages, then this run's (computed over
            # them: `reused` tokens, the prompt's rest, one token a step)
            want = reference(llama, seq, chunks)
            want.crop(reused - want.get_seq_length())
            with torch.no_grad():
                start = reused
                for n in [25 - reused, 1, 1, 1]:
                    llama(torch.tensor([seq[start:start + n]]), use_cache=True,
                          **{cache_kwarg(llama): want})
                    start += n
            async with cache.fetch([*seq, 0]) as hit:
                await hit.ready()
                idx, pool = hit.device_indices, cache.device_pool
                assert len(idx) == 28
                first = reference(llama, seq, chunks)
                for layer in range(len(want.layers)):
                    expect = torch.cat([layer_kv(first, layer)[0][0, :, :kept],
                                        layer_kv(want, layer)[0][0, :, kept:28]], dim=1)
                    assert torch.equal(pool.k_buffer(layer)[idx].transpose(0, 1), expect)
            cache.check_invariants()


async def test_a_replaced_token_in_a_later_commit_is_refused_too(
        llama: PreTrainedModel) -> None:
    """A second `commit_decoded` checks the new tokens as the first did; the first's
    commit stays exact."""
    prompt = tokens_of(9, seed=13)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 6)
            await adapter.commit_decoded(hit, out, [*prompt, *fed[:3]])
            with pytest.raises(ConfigError, match="position 13"):
                await adapter.commit_decoded(hit, out, [*prompt, *fed[:4], fed[4] ^ 1])
            await adapter.commit_decoded(hit, out, [*prompt, *fed[:5]])
        assert await assert_cached_kv(cache, llama, [*prompt, *fed[:5]],
                                      [9, 1, 1, 1, 1, 1]) == 12
        cache.check_invariants()


async def test_commit_decoded_after_its_context_ended_writes_nothing(
        llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed `commit_decoded` keeps the slots it leased in the prefill (so a next call
    commits). Called again after the context's block ended, it needed no new slot and wrote
    the decoded KV into those slots, freed on exit and meanwhile another prompt's committed
    pages, before its commit raised: that prompt was served the decoded tokens' KV. Now it
    raises `ClosedError` before anything is written."""
    prompt, other = tokens_of(10, seed=11), tokens_of(12, seed=12)
    async with HiCache(config_for(llama, device_pages=5)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 4)
            with monkeypatch.context() as patch:
                patch.setattr(adapter, "_store_decoded", _raise_oserror)
                with pytest.raises(OSError):
                    await adapter.commit_decoded(hit, out, [*prompt, *fed])
        async with cache.fetch(other) as taken:  # gets the freed slots
            await adapter.prefill(taken, other)
            assert set(out.tail_slots.tolist()) & set(taken.device_indices.tolist())
        with pytest.raises(ClosedError):
            await adapter.commit_decoded(hit, out, [*prompt, *fed])
        assert await assert_cached_kv(cache, llama, other, [12]) == 12
        cache.check_invariants()


def _raise_oserror(*_: object) -> None:
    raise OSError("the decoded KV's copy failed")


async def test_a_second_prefill_in_one_context_is_refused_clearly(
        llama: PreTrainedModel) -> None:
    """A second `prefill` in a context whose first one completed leased the slots after the
    partial page's (a page's middle) and was refused after its whole pass, as "slots: must
    cover whole pages in order". One prefill per context: a `ConfigError` saying so, before
    any pass, and the first prefill's output still commits."""
    prompt = tokens_of(10, seed=13)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            with pytest.raises(ConfigError, match=r"^hit: prefilled already"):
                await adapter.prefill(hit, prompt)
            fed, _ = await decoded(adapter, out, 3)
            await adapter.commit_decoded(hit, out, [*prompt, *fed])
        assert await assert_cached_kv(cache, llama, [*prompt, *fed], [10, 1, 1, 1]) == 12
        cache.check_invariants()
