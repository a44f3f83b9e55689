"""Review of today's changes (serve, hf adapter): each test is what the code must do."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")

from transformers import PreTrainedModel

from aiohicache import ConfigError, HiCache
from aiohicache.hf import HFAdapter, tiny_llama
from tests.test_hf import (  # noqa: F401  (an autouse fixture)
    SMALL,
    config_for,
    one_compute_thread,
    tokens_of,
)
from tests.test_hf_misuse_review import assert_cached_kv, decoded


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_llama(seed=1, **SMALL)


async def test_two_prefills_at_once_in_one_context_one_refused_clearly(
        llama: PreTrainedModel) -> None:
    """One prefill per context: two at once, the second is refused before its pass as a
    second after the first (``hit: prefilled already``-like), and the first's output still
    commits exactly."""
    prompt = tokens_of(10, seed=21)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            results = await asyncio.gather(adapter.prefill(hit, prompt),
                                           adapter.prefill(hit, prompt),
                                           return_exceptions=True)
            outs = [r for r in results if not isinstance(r, BaseException)]
            errors = [r for r in results if isinstance(r, BaseException)]
            assert len(outs) == 1 and len(errors) == 1
            assert isinstance(errors[0], ConfigError)
            assert str(errors[0]).startswith("hit: prefilled already")
            fed, _ = await decoded(adapter, outs[0], 3)
            await adapter.commit_decoded(hit, outs[0], [*prompt, *fed])
        assert await assert_cached_kv(cache, llama, [*prompt, *fed], [10, 1, 1, 1]) == 12
        cache.check_invariants()
