"""Shared fixtures: every async test runs on the default asyncio loop and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import uvloop

from aiohicache import HiCache, HiCacheConfig, KVSpec


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine (run `make test-gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SPEC_MHA = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bf16")
SPEC_MLA = KVSpec.mla(num_layers=3, kv_lora_rank=16, rope_dim=4, dtype="fp16")


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until `predicate()` holds (threads move it along; the test's
    timeout bounds the wait)."""
    while not predicate():  # noqa: ASYNC110 -- progress happens on threads: no event to await
        await asyncio.sleep(0)


def make_config(**overrides: Any) -> HiCacheConfig:
    """A small CPU cache config; keyword arguments override fields."""
    fields: dict[str, Any] = {"spec": SPEC_MHA, "page_size": 4, "device_pages": 16,
                              "host_pages": 64}
    fields.update(overrides)
    return HiCacheConfig(**fields)


def make_cache(**overrides: Any) -> HiCache:
    return HiCache(make_config(**overrides))


def make_tokens(n: int, *, seed: int = 0) -> list[int]:
    """Deterministic token ids; different seeds share no prefix."""
    return [seed * 1_000_003 + i for i in range(n)]


def fill_kv(cache: HiCache, slots: torch.Tensor, tokens: list[int]) -> None:
    """Write KV that encodes (token, layer, kv) into `slots`, as a forward pass would."""
    pool = cache.device_pool
    spec = cache.config.spec
    t = torch.tensor(tokens, dtype=torch.float64, device=pool.device)
    for layer in range(spec.num_layers):
        for kv in range(spec.num_kv):
            rows = pool.data[kv, layer].view(pool.num_slots, -1)
            val = (t * 0.5 + layer * 7 + kv * 3) % 251
            rows[slots] = val[:, None].to(rows.dtype).expand(-1, rows.shape[1])


def read_kv(cache: HiCache, slots: torch.Tensor) -> torch.Tensor:
    """All layers' KV at `slots`, as one tensor for exact comparison."""
    pool = cache.device_pool
    return torch.stack([pool.data[kv, layer].view(pool.num_slots, -1)[slots]
                        for kv in range(pool.spec.num_kv)
                        for layer in range(pool.spec.num_layers)])


async def prefill(cache: HiCache, tokens: list[int]) -> torch.Tensor:
    """Fetch `tokens`, compute (fill) the missing KV, commit; return the KV of all tokens."""
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        new = len(tokens) - hit.num_cached_tokens
        if new:
            slots = await hit.allocate(new)
            fill_kv(cache, slots, tokens[hit.num_cached_tokens:])
            await hit.commit(tokens, slots)
        full = hit.num_cached_tokens
        return read_kv(cache, hit.device_indices[:full])
