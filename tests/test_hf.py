"""The transformers adapter: prefix KV from L1, L2 and L3 gives the logits recomputation gives."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    DynamicCache,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from aiohicache import ConfigError, HiCache, HiCacheConfig
from aiohicache.hf import HFAdapter, cache_kwarg, kv_spec, tiny_llama

SMALL = {"vocab_size": 500, "hidden_size": 64, "num_layers": 3, "num_heads": 4,
         "num_kv_heads": 2}


@pytest.fixture(autouse=True)
def one_compute_thread() -> Any:
    """Bit-identical logits need one reduction order: torch's intra-op thread count is
    process-wide, and the CPU engine's copy threads set it to 1 when they start (mid-test,
    between a cached run and its recomputation). Pin it for both sides of the comparison."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_llama(seed=1, **SMALL)


def qwen2() -> PreTrainedModel:
    torch.manual_seed(2)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")).eval()


def mistral() -> PreTrainedModel:
    torch.manual_seed(3)
    return MistralForCausalLM(MistralConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=None,
        attn_implementation="sdpa")).eval()


def config_for(model: PreTrainedModel, **overrides: Any) -> HiCacheConfig:
    fields: dict[str, Any] = {"spec": kv_spec(model.config, model.dtype), "page_size": 4,
                              "device_pages": 12, "host_pages": 64}
    fields.update(overrides)
    return HiCacheConfig(**fields)


def recompute(model: PreTrainedModel, tokens: list[int], num_prefix: int,
              chunks: list[int] | None = None) -> torch.Tensor:
    """Logits of ``tokens[num_prefix:]`` with the prefix's KV recomputed in the model's own
    `DynamicCache`, never leaving it.

    The prefix is computed in the forward calls that first computed the cached KV: `chunks`
    lengths (default: one call over all of `tokens`), then cut to `num_prefix`. Float32 GEMMs
    over a different number of rows round differently, so only the same calls can be
    bit-identical; what the cache adds (pool, L2, L3 and back) must change no bit.
    """
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        if num_prefix:
            start = 0
            for n in chunks or [len(tokens)]:
                model(torch.tensor([tokens[start:start + n]]), use_cache=True,
                      **{cache_kwarg(model): past})
                start += n
            past.crop(num_prefix - past.get_seq_length())  # negative: tokens to drop
        out = model(torch.tensor([tokens[num_prefix:]]), use_cache=True,
                    **{cache_kwarg(model): past})
    logits: torch.Tensor = out.logits
    return logits


def tokens_of(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=gen).tolist()


async def run(adapter: HFAdapter, tokens: list[int]) -> tuple[torch.Tensor, int, dict[str, int]]:
    """Prefill `tokens`; return all computed logits, the reused count and where hits came from."""
    async with adapter.cache.fetch(tokens) as hit:
        tiers = {"L1": hit.num_device_hit_tokens, "L2": hit.num_host_hit_tokens,
                 "L3": hit.num_storage_hit_tokens}
        out = await adapter.prefill(hit, tokens, all_logits=True)
    return out.logits, out.num_reused_tokens, tiers


async def check(adapter: HFAdapter, tokens: list[int],
                chunks: list[int] | None = None) -> dict[str, int]:
    """Prefill `tokens` through the cache; assert its logits equal `recompute`'s (the cached
    prefix was computed by forward calls over `chunks` tokens; default one over the first
    request's prompt, which `tokens` extends)."""
    logits, reused, tiers = await run(adapter, tokens)
    assert torch.equal(logits, recompute(adapter.model, tokens, reused, chunks))
    return tiers


def test_kv_spec_reads_llama_qwen_and_mistral_configs(llama: PreTrainedModel) -> None:
    assert kv_spec(llama.config) == HiCacheConfig(
        spec=kv_spec(llama.config), device_pages=1).spec
    spec = kv_spec(llama.config)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (
        3, 2, 16, torch.float32)
    q = kv_spec(Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                            num_hidden_layers=24), "bf16")
    assert (q.num_layers, q.num_kv_heads, q.head_dim, q.dtype) == (24, 2, 64, torch.bfloat16)
    m = kv_spec(MistralConfig(head_dim=128, num_key_value_heads=8, num_hidden_layers=32))
    assert (m.num_kv_heads, m.head_dim) == (8, 128)


async def test_l1_hit_logits_equal_recomputation(llama: PreTrainedModel) -> None:
    prompt = tokens_of(22, seed=1)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        assert (await check(adapter, prompt))["L1"] == 0  # a miss: everything computed
        tiers = await check(adapter, [*prompt, 7, 8, 9], [22])
        assert tiers == {"L1": 20, "L2": 0, "L3": 0}
        cache.check_invariants()


async def test_l2_hit_logits_equal_recomputation(llama: PreTrainedModel) -> None:
    prompt = tokens_of(23, seed=2)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        await check(adapter, prompt)
        await cache.drain()
        for seed in (10, 11, 12):  # 3 x 5 pages on a 12-page device: the prompt goes to L2
            await check(adapter, tokens_of(20, seed))
            await cache.drain()
        tiers = await check(adapter, [*prompt, 1], [23])
        assert tiers == {"L1": 0, "L2": 20, "L3": 0}
        cache.check_invariants()


async def test_l3_hit_logits_equal_recomputation(llama: PreTrainedModel, tmp_path: Path) -> None:
    cfg = config_for(llama, storage=f"file://{tmp_path}", prefetch_policy="wait_complete",
                     prefetch_threshold=4)
    prompt = tokens_of(26, seed=3)
    async with HiCache(cfg) as first:
        await check(HFAdapter(llama, first), prompt)
        await first.drain()
    async with HiCache(cfg) as second:  # a new process's cache: only L3 has the prompt
        tiers = await check(HFAdapter(llama, second), prompt)
        assert tiers == {"L1": 0, "L2": 0, "L3": 24}
        second.check_invariants()


@pytest.mark.parametrize("make", [qwen2, mistral], ids=["qwen2", "mistral"])
async def test_qwen_and_mistral_shaped_models_hit_exactly(make: Any) -> None:
    model = make()
    prompt = tokens_of(18, seed=4)
    async with HiCache(config_for(model)) as cache:
        adapter = HFAdapter(model, cache)
        await check(adapter, prompt)
        assert (await check(adapter, [*prompt, 3], [18]))["L1"] == 16


async def test_a_prompt_cached_whole_recomputes_only_its_last_token(
        llama: PreTrainedModel) -> None:
    prompt = tokens_of(16, seed=5)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        await check(adapter, prompt)
        logits, reused, tiers = await run(adapter, prompt)
        assert (reused, tiers["L1"], logits.shape[1]) == (15, 16, 1)
        assert torch.equal(logits, recompute(llama, prompt, 15))
        assert cache.stats().device_pages_leased == 0


async def prefill_and_decode(adapter: HFAdapter, hit: Any, prompt: list[int], *,
                             steps: int) -> tuple[Any, list[int]]:
    """Prefill `prompt` through `hit`, then decode greedily `steps` tokens: the prefill's
    output and the sequence (the prompt, the first token, the decoded ones)."""
    out = await adapter.prefill(hit, prompt)
    seq = [*prompt, int(out.logits[0, -1].argmax())]
    for _ in range(steps):
        seq.append(int((await adapter.decode(out.past_key_values, seq[-1])).argmax()))
    return out, seq


async def test_decoded_tokens_are_committed_for_the_next_turn(llama: PreTrainedModel) -> None:
    prompt = tokens_of(10, seed=6)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out, seq = await prefill_and_decode(adapter, hit, prompt, steps=5)
            await adapter.commit_decoded(hit, out, seq[:-1])
            assert hit.num_cached_tokens == 12
        turn2 = [*seq, 42, 43]
        # its KV came from a 10-token prefill and five 1-token decode steps
        tiers = await check(adapter, turn2, [10, 1, 1, 1, 1, 1])
        assert tiers["L1"] == 12  # the prompt and the decoded tokens, whole pages
        cache.check_invariants()


async def test_decoded_tokens_are_copied_into_the_pool_on_the_executor(
        llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """`commit_decoded` copied every layer's K/V of the decoded tokens on the event loop
    (2k tokens of a Llama-8B-sized spec on CPU: about 90 ms)."""
    prompt = tokens_of(10, seed=7)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out, seq = await prefill_and_decode(adapter, hit, prompt, steps=3)
            pool, threads = type(cache.device_pool), set()
            k_buffer = pool.k_buffer

            def watched(self: Any, layer: int) -> torch.Tensor:
                threads.add(threading.current_thread().name)
                return k_buffer(self, layer)

            with monkeypatch.context() as patch:
                patch.setattr(pool, "k_buffer", watched)
                await adapter.commit_decoded(hit, out, seq[:-1])
            assert threads and threading.main_thread().name not in threads
            assert hit.num_cached_tokens == 12
        await check(adapter, [*seq, 42], [10, 1, 1, 1])
        cache.check_invariants()


async def test_a_cancelled_prefill_stops_its_forward_and_leaks_nothing(
        llama: PreTrainedModel) -> None:
    entered, release = threading.Event(), threading.Event()

    class Held(ThreadPoolExecutor):
        """Runs forward passes only once the test lets them."""

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            def held() -> Any:
                entered.set()
                release.wait(10)
                return fn(*args, **kwargs)
            return super().submit(held)

    prompt = tokens_of(22, seed=7)
    with Held(1) as pool:
        async with HiCache(config_for(llama)) as cache:
            adapter = HFAdapter(llama, cache, executor=pool)
            release.set()
            await check(adapter, prompt)
            release.clear()
            entered.clear()

            async def request() -> None:
                async with cache.fetch([*prompt, 1, 2]) as hit:
                    await adapter.prefill(hit, [*prompt, 1, 2])

            task = asyncio.create_task(request())
            await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            await asyncio.sleep(0.01)
            assert not task.done()  # waits for the forward pass: it writes into leased slots
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert cache.stats().device_pages_leased == 0
            cache.check_invariants()
            await check(adapter, [*prompt, 1, 2], [22])  # and the cache still serves exactly


async def test_a_sliding_window_model_without_layer_types_is_refused() -> None:
    """Mistral-7B-v0.1 sets `sliding_window` and no `layer_types`: it was accepted, and a
    hit longer than the window crashed the prefill (a review)."""
    torch.manual_seed(3)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=16,
        attn_implementation="sdpa")).eval()
    async with HiCache(config_for(model)) as cache:
        with pytest.raises(ConfigError, match="sliding window of 16 tokens"):
            HFAdapter(model, cache)


async def test_a_cache_of_another_shape_is_refused(llama: PreTrainedModel) -> None:
    cfg = config_for(llama, spec=kv_spec(llama.config, "bf16"))
    async with HiCache(cfg) as cache:
        with pytest.raises(ConfigError, match="spec"):
            HFAdapter(llama, cache)
