"""`aiohicache serve`'s cache namespace: a digest of what makes a model's KV (its weights,
every buffer and its config), taken off the event loop.

A review found the first version of it hashing `model.state_dict()`: the parameters and the
*persistent* buffers only.
A Llama's rotary frequencies (`rotary_emb.inv_freq`) are a non-persistent buffer, and what
else shapes the KV (RoPE theta and scaling, its attention scaling) lives in the config. Two
servers of one checkpoint run with other RoPE settings (a long-context variant of a model
is often that: the same weights, another ``rope_parameters``) compute other K for the same
tokens, yet got one namespace: sharing an L3, each served the other's KV.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import anyio
import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel

from aiohicache.hf import forward, layer_kv, tiny_llama
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, cache_config
from aiohicache.serve import engine as engine_mod
from aiohicache.serve.engine import SamplingParams, Usage

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
PROMPT = [(3 * 7919 + i * 31) % 512 for i in range(320)]


def same_weights_other_rope(model: PreTrainedModel, theta: float) -> PreTrainedModel:
    """`model`'s very weights, with another RoPE theta (as a long-context variant)."""
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": theta}
    other = LlamaForCausalLM(config)
    other.load_state_dict(model.state_dict())
    other.train(False)
    return other


def prompt_kv(model: PreTrainedModel) -> torch.Tensor:
    past = DynamicCache(config=model.config)
    forward(model, PROMPT[:64], past)
    return layer_kv(past, 0)[0]


def test_one_checkpoint_with_other_rope_settings_gets_another_namespace() -> None:
    a = tiny_llama(seed=5, **MODEL)
    b = same_weights_other_rope(a, 1_000_000.0)
    assert not torch.equal(prompt_kv(a), prompt_kv(b))  # their KV for one prompt differ
    ns_a = cache_config(a, EngineConfig()).namespace
    ns_b = cache_config(b, EngineConfig()).namespace
    assert ns_a != ns_b, "two models whose KV differ share one namespace (and L3 pages)"


async def test_servers_of_one_checkpoint_with_other_rope_settings_miss_each_others_pages(
        tmp_path: Path) -> None:
    """End to end: the second server got 319 prompt tokens of the first one's KV from L3
    (K rotated with the other theta: wrong for it)."""
    fields: dict[str, Any] = {"page_size": 16, "device_tokens": 2048, "host_tokens": 8192,
                              "storage": f"file://{tmp_path}"}
    a = tiny_llama(seed=5, **MODEL)
    b = same_weights_other_rope(a, 1_000_000.0)

    async def cached(model: PreTrainedModel) -> int:
        async with Engine(model, ByteTokenizer(), EngineConfig(**fields)) as eng:
            usage = Usage(prompt_tokens=len(PROMPT))
            async for _ in eng.generate(PROMPT, SamplingParams(max_tokens=1), usage):
                pass
            assert eng.cache is not None
            await eng.cache.drain()  # backed up to L3
            return usage.cached_tokens
    assert await cached(a) == 0
    assert await cached(b) == 0, "served another model's KV from the shared L3"


async def test_the_weights_digest_is_not_taken_on_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`weights_namespace` reads every byte of the weights (about 0.1 s a GB by its own
    note; 1.6 s for an 8B bf16 model, more from a GPU): made in `Engine.__init__`, it ran
    on the loop of whoever builds an engine inside a coroutine, as `aiohicache.serve`'s own
    usage example does."""
    real, on_loop = engine_mod.weights_namespace, []

    def spy(model: PreTrainedModel) -> str:
        try:
            anyio.get_current_task()
            on_loop.append(True)  # an anyio task of this thread: the loop is blocked
        except RuntimeError:
            on_loop.append(threading.current_thread() is threading.main_thread())
        return real(model)
    monkeypatch.setattr(engine_mod, "weights_namespace", spy)
    async with Engine(tiny_llama(seed=5, **MODEL), ByteTokenizer(),
                      EngineConfig(page_size=16, device_tokens=2048, host_tokens=0)) as eng:
        assert eng.cache is not None
    assert on_loop == [False], "the weights were hashed on the event loop"
