"""Costs a performance A/B of the request path found: what the cache must not do on a hit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiohicache import HiCache, HiCacheConfig, KVSpec
from aiohicache.controller import _l3_parts


async def test_an_all_l1_hit_of_a_long_prompt_hashes_nothing_for_a_subscriber(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An events subscriber without L3: the tree holds the page keys of a cached prompt. A
    fetch of 8,192 tokens or more hashed the whole prompt on a thread anyway: an all-L1 hit of
    16k tokens went from 0.8 to 2.0 ms."""
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bf16")
    config = HiCacheConfig(spec=spec, page_size=16, device_pages=1024, host_pages=1024)
    tokens = np.arange(1, 16385, dtype=np.int64)
    async with HiCache(config) as cache, cache.events():
        async with cache.fetch(tokens) as hit:
            await hit.commit(tokens, await hit.allocate(len(tokens)))
        await cache.drain()
        hashed: list[int] = []
        real = _l3_parts.chain_keys

        def counting(prev: bytes, toks: np.ndarray, ps: int) -> list[bytes]:
            hashed.append(len(toks))
            return real(prev, toks, ps)
        monkeypatch.setattr(_l3_parts, "chain_keys", counting)
        async with cache.fetch(tokens) as hit:
            assert hit.num_device_hit_tokens == len(tokens)
            await hit.commit(tokens, torch.empty(0, dtype=torch.int64))
        assert hashed == [], f"an all-L1 hit hashed {sum(hashed)} tokens"
