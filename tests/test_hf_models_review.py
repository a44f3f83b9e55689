"""Review of the transformers adapter across model architectures: a model is served exactly
(logits ``torch.equal`` to recomputation) or refused with a `ConfigError` naming why, before
a request runs (when the cache's spec is read, or when the adapter is made).

Swept over transformers 5.24's causal LMs, tiny random-weight configs: sliding, chunked,
linear, hybrid, conv and indexed layers are refused by their ``layer_types`` (Mistral-style
``sliding_window`` alone by that field); Llama, Qwen2/3, Mistral without a window, Phi-3,
GPT-2, GPT-NeoX, GPT-Neo (its local layers keep every token's KV, masked), Bloom (ALiBi),
Gemma and Gemma2/3 with full layers only (soft-capping) hit exactly from L1, L2 and L3,
across decode, a crop and a next turn. The tests below are those that failed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    DeepseekV3Config,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
    PreTrainedModel,
)

from aiohicache import ConfigError, HiCache
from aiohicache.hf import HFAdapter, kv_spec
from tests.test_hf import config_for, one_compute_thread, tokens_of  # noqa: F401  (a fixture)


def gpt1() -> PreTrainedModel:
    """OpenAI GPT (GPT-1): a causal LM whose forward takes no KV cache at all."""
    torch.manual_seed(6)
    return OpenAIGPTLMHeadModel(OpenAIGPTConfig(
        vocab_size=500, n_embd=64, n_layer=2, n_head=4, n_positions=128)).eval()


async def test_a_model_whose_forward_takes_no_kv_cache_is_refused() -> None:
    """GPT-1 was accepted: its forward swallowed the cache keyword (``**kwargs``), so a miss
    committed slots nothing had written (stale pool memory as the prompt's KV), and a hit ran
    only the suffix with no prefix at all: logits 0.57 off recomputation, unsaid."""
    model = gpt1()
    async with HiCache(config_for(model)) as cache:
        with pytest.raises(ConfigError, match="takes no KV cache"):
            HFAdapter(model, cache)


class CacheDropping(LlamaForCausalLM):
    """A Llama whose forward takes the cache and never hands it to its layers (as remote code
    or a wrapper that loses a keyword on its way down does)."""

    def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> Any:
        return super().forward(input_ids=input_ids, **kwargs)


async def test_a_pass_that_never_hands_its_kv_to_the_cache_commits_nothing() -> None:
    """Its prefill committed the leased slots though no layer had written them: the next
    request for the prompt was served that stale memory as its prefix's KV (and the model,
    fed only the suffix, other logits than recomputation). A pass whose layers never update
    the cache is a `ConfigError` naming them, and nothing is committed."""
    torch.manual_seed(7)
    model = CacheDropping(LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")).eval()
    prompt = tokens_of(18, seed=8)
    async with HiCache(config_for(model)) as cache:
        adapter = HFAdapter(model, cache)
        await assert_prefill_refused(adapter, cache, prompt, r"layers \[0, 1\].*never")


async def assert_prefill_refused(adapter: HFAdapter, cache: HiCache, prompt: list[int],
                                 match: str) -> None:
    """`adapter`'s prefill of `prompt` raises a `ConfigError` matching `match`, and nothing
    of it is committed, leased or left inconsistent."""
    with pytest.raises(ConfigError, match=match):
        async with cache.fetch(prompt) as hit:
            await adapter.prefill(hit, prompt)
    async with cache.fetch(prompt) as hit:
        assert hit.num_cached_tokens == 0
    assert cache.stats().device_pages_leased == 0
    cache.check_invariants()


def test_a_multi_head_latent_attention_config_is_refused_by_kv_spec() -> None:
    """DeepSeek-V2/V3 (and GLM-4.7-Flash, MiniCPM3, ...) got a per-head spec of their
    ``num_key_value_heads`` and rope dim; the adapter took it, and every request was then
    refused at the model's first layer (transformers caches MLA's latent: K the compressed
    KV, V the shared rope key, one head) as "kv_spec(config) does not describe this model",
    a server that started and answered each request with a 500."""
    config = DeepseekV3Config(
        vocab_size=500, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    with pytest.raises(ConfigError, match="latent attention"):
        kv_spec(config)


def test_a_config_whose_kv_shape_varies_by_layer_is_a_config_error() -> None:
    """Gemma 4's config sets ``head_dim`` per layer (``per_layer_config``): `kv_spec` raised
    transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError, from the engine's
    constructor) instead of a `ConfigError` naming the field."""
    with pytest.raises(ConfigError, match="head_dim.*per layer"):
        kv_spec(Gemma4TextConfig())
