"""Review of the transformers adapter's layer check: the pool holds every position's K/V, so
a model is served only when every layer of the cache transformers builds for it (and the
one a pass leaves) is exactly a full-attention `DynamicLayer`; any other is a `ConfigError`
naming the layers and their classes, before a request runs where the config shows it.

`layer_types` alone did not show it: transformers 5.24 infers sliding layers from a
``sliding_window`` (also beside ``use_sliding_window=False``) or an ``attention_chunk_size``
when a config has no ``layer_types``, and empty `DummyLayer` ones from KV sharing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from aiohicache import ConfigError, HiCache
from aiohicache.hf import HFAdapter
from tests.test_hf import (  # noqa: F401  (a fixture)
    check,
    config_for,
    one_compute_thread,
    prefill_and_decode,
    tokens_of,
)
from tests.test_hf_models_review import assert_prefill_refused

SMALL: dict[str, Any] = {
    "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "attn_implementation": "sdpa"}


def llama(cls: type[LlamaForCausalLM] = LlamaForCausalLM, **fields: Any) -> PreTrainedModel:
    torch.manual_seed(7)
    return cls(LlamaConfig(**SMALL, **fields)).eval()


def mistral(**fields: Any) -> PreTrainedModel:
    torch.manual_seed(3)
    return MistralForCausalLM(MistralConfig(**SMALL, **fields)).eval()


@pytest.mark.parametrize("make", [
    lambda: llama(attention_chunk_size=12),
    lambda: mistral(sliding_window=None, attention_chunk_size=12),
    lambda: llama(sliding_window=12, use_sliding_window=False),
], ids=["llama-chunked", "mistral-chunked", "llama-window-unused"])
async def test_a_config_that_makes_sliding_layers_without_layer_types_is_refused(
        make: Any) -> None:
    """Without ``layer_types`` transformers builds `DynamicSlidingWindowLayer`s from an
    ``attention_chunk_size`` or a ``sliding_window`` (whatever ``use_sliding_window`` says),
    and the adapter's `PoolCache` is such a cache: it was accepted. A hit past the window then
    crashed the pass (a RuntimeError: the placeholder kept 11 of 16 prefix tokens), and
    `commit_decoded` of 8 of 14 fed tokens read positions 7-10 from the window as positions
    4-7 and committed them: the next turn hit that page, logits 0.19 off recomputation."""
    model = make()
    async with HiCache(config_for(model)) as cache:
        with pytest.raises(ConfigError, match=r"layers \[0, 1\] DynamicSlidingWindowLayer "
                                              r"\(a sliding window of 12 tokens\)"):
            HFAdapter(model, cache)


async def test_a_kv_sharing_config_of_full_layers_is_refused_when_the_adapter_is_made() -> None:
    """Gemma 4 with full-attention layers only, one head size and KV sharing (its last
    layers read an earlier layer's KV) passed `kv_spec` and ``layer_types``; transformers
    gives its shared layers a `DummyLayer`, so every request was refused only after a whole
    forward pass ("never passed their KV"): a server that started and failed each request."""
    torch.manual_seed(1)
    model = Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32,
        layer_types=["full_attention"] * 4, num_kv_shared_layers=2,
        attn_implementation="sdpa")).eval()
    async with HiCache(config_for(model)) as cache:
        with pytest.raises(ConfigError, match=r"layers \[2, 3\] DummyLayer"):
            HFAdapter(model, cache)


async def test_a_config_changed_to_slide_after_the_adapter_was_made_commits_nothing() -> None:
    """The adapter checked the config once; the `PoolCache` of each prefill is built from the
    config as it is then. Given a chunk size since, it was built of sliding layers and served
    and committed as above: it is refused, and nothing is committed."""
    model = llama()
    prompt = tokens_of(18, seed=8)
    async with HiCache(config_for(model)) as cache:
        adapter = HFAdapter(model, cache)
        model.config.attention_chunk_size = 12
        with pytest.raises(ConfigError, match=r"its cache has layers \[0, 1\] Dynamic"):
            async with cache.fetch(prompt) as hit:
                await adapter.prefill(hit, prompt)
        assert cache.stats().device_pages_leased == 0
        async with cache.fetch(prompt) as hit:
            assert hit.num_cached_tokens == 0
        cache.check_invariants()


class Swapping(LlamaForCausalLM):
    """A Llama whose forward swaps each full-attention layer of the cache it is given for a
    sliding one of 12 tokens (carrying its KV over), as a model installing its own cache
    layers does: in every pass, or in decode steps (one token) only."""

    swap_in_prefill = True

    def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> Any:
        if self.swap_in_prefill or input_ids.shape[1] == 1:
            for i, layer in enumerate(cache.layers):
                if type(layer) is DynamicLayer:
                    swapped = DynamicSlidingWindowLayer(sliding_window=12)
                    if layer.get_seq_length():
                        swapped.update(layer.keys, layer.values)
                    cache.layers[i] = swapped
        return super().forward(input_ids=input_ids, cache=cache, **kwargs)


async def test_a_pass_that_swaps_the_cache_layers_for_sliding_ones_commits_nothing() -> None:
    """Its layers still handed their KV to `PoolCache.update`, so the prefill committed, and
    the cache it returned for decoding was a sliding one (see the first test): a pass that
    leaves the cache with a layer other than a full-attention one is a `ConfigError` naming
    it, and nothing is committed."""
    model = llama(Swapping)
    prompt = tokens_of(18, seed=8)
    async with HiCache(config_for(model)) as cache:
        adapter = HFAdapter(model, cache)
        await assert_prefill_refused(adapter, cache, prompt, r"left the cache with layers "
                                     r"\[0, 1\] DynamicSlidingWindowLayer")


async def test_decode_steps_that_swap_in_sliding_layers_commit_no_decoded_kv() -> None:
    """Decoded on past its window, the swapped layers held the last 11 of 14 tokens;
    `commit_decoded` of the first 8 read rows 4-7 of that window (positions 7-10) as
    positions 4-7 and committed them: the next turn was served that page, logits 0.19 off
    recomputation. It is a `ConfigError` naming the layers; nothing past the prompt is
    committed, and the prompt still hits exactly."""
    model = llama(Swapping)
    model.swap_in_prefill = False
    prompt = tokens_of(6, seed=9)
    async with HiCache(config_for(model)) as cache:
        adapter = HFAdapter(model, cache)
        async with cache.fetch(prompt) as hit:
            out, seq = await prefill_and_decode(adapter, hit, prompt, steps=8)
            assert out.past_key_values.get_seq_length() == 14
            with pytest.raises(ConfigError, match=r"decoded on has layers \[0, 1\] "
                                                  r"DynamicSlidingWindowLayer"):
                await adapter.commit_decoded(hit, out, seq[:8])
            assert hit.num_cached_tokens == 4  # the prompt's whole page
        tiers = await check(adapter, [*seq[:8], 1], [6])  # no swap: a pass of 5 tokens
        assert tiers["L1"] == 4
        cache.check_invariants()
