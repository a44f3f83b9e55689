"""Review of the transformers adapter: tests that failed before their fix."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    FalconConfig,
    FalconForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from aiohicache import ConfigError, HiCache, HiCacheConfig
from aiohicache.hf import HFAdapter, kv_spec, tiny_llama
from tests.test_hf import SMALL, one_compute_thread  # noqa: F401  (an autouse fixture)


def config_for(model: PreTrainedModel, **overrides: Any) -> HiCacheConfig:
    fields: dict[str, Any] = {"spec": kv_spec(model.config, model.dtype), "page_size": 4,
                              "device_pages": 12, "host_pages": 64}
    fields.update(overrides)
    return HiCacheConfig(**fields)


def tokens_of(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=gen).tolist()


class Held(ThreadPoolExecutor):
    """Runs a forward pass only once the test lets it (`release`); `entered` says one is
    waiting."""

    def __init__(self) -> None:
        super().__init__(1)
        self.entered, self.release = threading.Event(), threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def held() -> Any:
            self.entered.set()
            self.release.wait(10)
            return fn(*args, **kwargs)
        return super().submit(held)


async def test_a_cancelled_prefill_of_a_miss_stops_its_forward_at_the_next_layer() -> None:
    """The docstring says a cancelled prefill's pass stops at its next layer; with no cached
    prefix (a miss: no layer gated) it ran every layer of the whole prompt on, the caller
    waiting for it (a client gone, a server stopping: seconds of a long prompt's prefill)."""
    model = tiny_llama(seed=1, **SMALL)
    layers_run: list[int] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: layers_run.append(i))
    prompt = tokens_of(22, seed=1)
    with Held() as pool:
        async with HiCache(config_for(model)) as cache:
            adapter = HFAdapter(model, cache, executor=pool)

            async def request() -> None:
                async with cache.fetch(prompt) as hit:
                    assert hit.num_cached_tokens == 0
                    await adapter.prefill(hit, prompt)

            task = asyncio.create_task(request())
            await asyncio.to_thread(pool.entered.wait, 10)
            task.cancel()
            await asyncio.sleep(0.01)
            pool.release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert layers_run == [0]  # it stopped at the first layer's KV, not after all 3
            assert cache.stats().device_pages_leased == 0
            cache.check_invariants()
            async with cache.fetch(prompt) as hit:  # nothing committed, the cache still works
                assert hit.num_cached_tokens == 0
                out = await adapter.prefill(hit, prompt)
            assert out.num_prompt_tokens == 22


def falcon_multi_query() -> PreTrainedModel:
    """Falcon-7B's layout: one KV head (``multi_query``), which its config does not say in
    the fields `kv_spec` reads (it reads ``num_attention_heads`` KV heads)."""
    torch.manual_seed(4)
    config = FalconConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, multi_query=True,
                          new_decoder_architecture=False)
    config._attn_implementation = "sdpa"
    model = FalconForCausalLM(config)
    model.train(False)
    return model


async def test_a_model_whose_kv_is_not_the_specs_shape_is_a_config_error() -> None:
    """The one KV head was broadcast into the spec's four, unsaid, and committed; every later
    hit on it then crashed the forward with a RuntimeError (the server: a 500 for every
    request with a cached prefix). Misuse is a ConfigError, and nothing is cached."""
    model = falcon_multi_query()
    prompt = tokens_of(22, seed=2)
    async with HiCache(config_for(model)) as cache:
        adapter = HFAdapter(model, cache)
        with pytest.raises(ConfigError, match="KV of shape"):
            async with cache.fetch(prompt) as hit:
                await adapter.prefill(hit, prompt)
        async with cache.fetch(prompt) as hit:
            assert hit.num_cached_tokens == 0  # nothing of the broadcast KV was committed
        assert cache.stats().device_pages_leased == 0
        cache.check_invariants()


def llama_with_rope(rope: dict[str, Any]) -> PreTrainedModel:
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, rope_parameters=rope)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.train(False)
    return model


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
     "long_factor": [4.0] * 8, "original_max_position_embeddings": 16},
], ids=["dynamic-ntk", "longrope"])
async def test_a_model_whose_rope_rescales_with_the_sequence_length_is_refused(
        rope: dict[str, Any]) -> None:
    """Dynamic NTK and longrope (Phi-3/3.5-mini-128k, Phi-4-mini) pick every position's
    frequencies by the pass's longest position: a prefix cached by a short prompt, served to
    a prompt past the original length, is KV the model never computes for it (the tiny
    model's last logits were 4e-4 / 1e-3 off a cold pass, rounding is 1e-7), and the other
    way round. Their KV is not a function of the prefix: refused, as a sliding window is."""
    model = llama_with_rope(rope)
    async with HiCache(config_for(model)) as cache:
        with pytest.raises(ConfigError, match="RoPE"):
            HFAdapter(model, cache)


async def test_a_fixed_rope_scaling_is_accepted() -> None:
    model = llama_with_rope({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    async with HiCache(config_for(model)) as cache:
        HFAdapter(model, cache)
