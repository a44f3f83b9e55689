"""Review of the day's serve changes (`EngineConfig.cache_options`, ``--cache-option``, an L3
with no L2 refused): a server's cache settings are refused when they are given, before a
model loads, with the option named; and every setting the docs list can be given.

`aiohicache serve` builds its `EngineConfig` before it loads the model (a checkpoint takes
minutes) so that a bad setting is a usage error at once; what only the engine or the cache
checks comes after the load.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from click.testing import CliRunner

import aiohicache.serve
from aiohicache import ConfigError
from aiohicache.cli import cli
from aiohicache.serve import EngineConfig


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """`aiohicache serve` may not load a model: a setting refused after the load fails."""

    def load_model(*args: Any, **kwargs: Any) -> Any:
        raise ConfigError("model: loaded (the settings passed every check before the load)")

    monkeypatch.setattr(aiohicache.serve, "load_model", load_model)


@pytest.mark.parametrize("options", [{"tp_size": 2}, {"tp_size": 2, "tp_rank": 1}])
def test_an_engine_is_one_rank_so_its_cache_takes_no_tp_options(
        options: dict[str, int]) -> None:
    """An engine runs its cache in one process, with no `TPGroup`: ``tp_size`` 2 passed
    `EngineConfig` and `Engine` and failed only as the engine opened (``tp_group: ...``, a
    field nobody gave), after the model had loaded."""
    with pytest.raises(ConfigError, match="cache_options: 'tp_(size|rank)' is set by the engine"):
        EngineConfig(cache_options=options)


@pytest.mark.parametrize(("options", "field"), [
    ({"prefetch_threshold": -1}, "prefetch_threshold"),
    ({"eviction": "bogus"}, "eviction"),
    ({"write_policy": "write_sometimes"}, "write_policy"),
])
def test_a_bad_cache_option_value_is_refused_by_the_engine_config(
        options: dict[str, Any], field: str) -> None:
    """The values are checked with the names, when the config is made (they were checked
    only by `Engine`, once a model was loaded)."""
    with pytest.raises(ConfigError, match=f"cache_options: {field}: "):
        EngineConfig(cache_options=options)


def test_an_l3_with_no_l2_is_refused_by_the_engine_config() -> None:
    """L3 is read into L2 and written from it: ``host_tokens`` 0 with a store is refused by
    `EngineConfig`, as the other tier errors are (the cache refused it only in `Engine`)."""
    with pytest.raises(ConfigError, match="storage: .*host_tokens 0 leaves no L2"):
        EngineConfig(host_tokens=0, storage="memory://")
    EngineConfig(host_tokens=0, storage="memory://", use_cache=False)  # no cache: no tiers
    EngineConfig(host_tokens=0)  # one tier


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(("args", "hint", "message"), [
    (["--cache-option", "tp_size=2"], "--cache-option", "'tp_size' is set by the engine"),
    (["--cache-option", "eviction=bogus"], "--cache-option", "eviction: must be one of"),
    (["--cache-option", "prefetch_threshold=-1"], "--cache-option", "prefetch_threshold"),
    (["--l2", "0", "--l3", "memory://"], "--l3", "--l2 0 leaves no L2"),
    (["--served-model-name", " "], "--served-model-name", "must be a name (not empty)"),
])
def test_the_serve_command_refuses_cache_settings_before_it_loads_the_model(
        args: list[str], hint: str, message: str) -> None:
    """Each is a usage error naming the option, before the model loads (they came after
    it: a bad value named only the `HiCacheConfig` field, ``tp_size`` as ``tp_group``)."""
    result = CliRunner().invoke(cli, ["serve", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert "loaded" not in result.output, result.output
    assert f"'{hint}'" in result.output and message in result.output, result.output


def test_cache_options_as_the_serve_command_reads_them_reach_the_cache_config() -> None:
    """``eviction`` is a name or an ``(L1, L2)`` pair (docs/api.md); ``--cache-option``
    reads a value as JSON, which has lists, not tuples: ``eviction=["arc","lru"]`` was
    refused (``got ['arc', 'lru']``, after the model loaded), so a server could not have one
    policy per tier. The pair reaches `HiCacheConfig` as the tuple it takes."""
    from aiohicache.cli import _cache_options
    from aiohicache.hf import tiny_llama
    from aiohicache.serve import cache_config

    options = _cache_options(None, None, ('eviction=["arc","lru"]',  # type: ignore[arg-type]
                                          "prefetch_threshold=64"))
    config = cache_config(tiny_llama(vocab_size=64, hidden_size=16, num_layers=1,
                                     num_heads=2, num_kv_heads=1),
                          EngineConfig(namespace="n", cache_options=options))
    assert config.eviction == ("arc", "lru") and config.prefetch_threshold == 64


# -- the L3 breaker: a prefetch's exists is its only call when no read follows --------------


async def test_a_probe_whose_exists_answered_closes_the_breaker_when_no_read_follows() -> None:
    """A half-open breaker lets one call through; its outcome decides. A prefetch whose
    `exists` answered is that outcome when no read follows: here L3 has the prompt's next
    pages but the host pool has no page for them (its two pages are the matched head, which
    the prefetch itself protects), so nothing is read. The exists counted as a success only
    where the count was under the threshold: the probe was never decided, every L3 call
    (backups included) was bypassed for another cool-down, and health said degraded, while
    the store answered."""
    import asyncio

    from aiohicache import HiCache
    from aiohicache.controller import page_format
    from aiohicache.storage.faults import FaultyBackend
    from aiohicache.storage.memory import MemoryBackend
    from tests.conftest import make_config, make_tokens, prefill

    l3 = {"prefetch_policy": "wait_complete", "prefetch_threshold": 8, "device_pages": 16}
    inner = MemoryBackend(page_format(make_config(**l3)))
    prompt = make_tokens(16)
    async with HiCache(make_config(storage=inner, host_pages=32, **l3)) as first:
        await prefill(first, prompt)  # L3 holds its 4 pages
        await first.drain()
    faulty = FaultyBackend(inner, seed=0)
    config = make_config(storage=faulty, host_pages=2, storage_failures_to_open=1,
                         storage_cooldown=0.05, **l3)
    async with HiCache(config) as cache:
        tier = cache.storage
        assert tier is not None
        await prefill(cache, prompt[:8])  # the head: L1, and L2's two pages
        await cache.drain()
        faulty.error_rate = 1.0
        async with cache.fetch(make_tokens(12, seed=1)):
            pass  # its exists fails: the breaker opens
        assert tier.breaker.state == "open"
        faulty.error_rate = 0.0
        await asyncio.sleep(0.06)
        assert tier.breaker.state == "half_open"
        calls = inner.stats().exists_calls
        async with cache.fetch(prompt) as hit:  # the probe: L3 has 2 more pages, no room
            assert hit.num_cached_tokens == 8
        assert inner.stats().exists_calls == calls + 1  # the store answered
        assert tier.breaker.state == "closed"
        assert cache.stats().health == "ok"


async def test_an_l2_of_one_page_still_reads_from_l3() -> None:
    """The prefetch budget is a fraction of L2 (half by default), at least one page: an L2
    of one page had a budget of none, so L3 was opened and never read (a config the L3
    check accepts)."""
    from aiohicache import HiCache
    from aiohicache.controller import page_format
    from aiohicache.storage.memory import MemoryBackend
    from tests.conftest import make_config, make_tokens, prefill

    l3 = {"prefetch_policy": "wait_complete", "prefetch_threshold": 1, "device_pages": 16}
    store = MemoryBackend(page_format(make_config(**l3)))
    prompt = make_tokens(12)
    async with HiCache(make_config(storage=store, host_pages=32, **l3)) as first:
        await prefill(first, prompt)  # L3 holds its 3 pages
        await first.drain()
    async with HiCache(make_config(storage=store, host_pages=1, **l3)) as cache, \
            cache.fetch(prompt) as hit:
        assert hit.num_storage_hit_tokens == 4  # one page: all the L2 there is
