"""The typed groups of HiCacheConfig and of CacheStats: what each component receives, and one
validation that names the flat knob however the value was given."""

from __future__ import annotations

import dataclasses

import pytest

from aiohicache import (
    ConfigError,
    HiCache,
    HiCacheConfig,
    StorageConfig,
    StorageStats,
    TPConfig,
    TPStats,
    TransferConfig,
)
from aiohicache._validate import check_choice, check_int, check_number
from tests.conftest import SPEC_MHA, make_config, make_tokens


def test_a_flat_config_carries_its_groups() -> None:
    cfg = make_config(tp_rank=1, tp_size=2, storage="memory://", prefetch_threshold=8,
                      storage_miss_ttl=1.5, transfer_ctas=8, write_policy="write_back")
    assert cfg.tp == TPConfig(rank=1, size=2)
    assert cfg.l3.backend == "memory://" and cfg.l3.prefetch_threshold == 8
    assert cfg.l3.miss_ttl == 1.5
    assert cfg.transfer.ctas == 8 and cfg.transfer.write_policy == "write_back"


def test_replace_recomputes_the_groups() -> None:
    cfg = dataclasses.replace(make_config(tp_rank=1, tp_size=2), tp_rank=0)
    assert cfg.tp.rank == 0


def test_build_from_groups_equals_the_flat_config() -> None:
    grouped = HiCacheConfig.build(
        spec=SPEC_MHA, page_size=4, device_pages=16, host_pages=64,
        tp=TPConfig(rank=1, size=2, timeout=5.0),
        l3=StorageConfig(backend="memory://", miss_ttl=2.0, failures_to_open=3),
        transfer=TransferConfig(max_inflight_loads=7))
    flat = make_config(tp_rank=1, tp_size=2, tp_timeout=5.0, storage="memory://",
                       storage_miss_ttl=2.0, storage_failures_to_open=3, max_inflight_loads=7)
    assert grouped == flat and grouped.l3 == flat.l3 and grouped.tp == flat.tp


def test_a_field_given_flat_and_in_a_group_is_refused() -> None:
    with pytest.raises(ConfigError, match="tp_size: given both"):
        HiCacheConfig.build(spec=SPEC_MHA, device_pages=16, tp_size=2, tp=TPConfig(size=2))


@pytest.mark.parametrize(("make", "field"), [
    (lambda: TPConfig(rank=2, size=2), "tp_rank"),
    (lambda: TPConfig(timeout=0), "tp_timeout"),
    (lambda: StorageConfig(miss_ttl=-1), "storage_miss_ttl"),
    (lambda: StorageConfig(prefetch_host_fraction=0), "prefetch_host_fraction"),
    (lambda: StorageConfig(backend=object()), "storage"),
    (lambda: TransferConfig(ctas=True), "transfer_ctas"),
    (lambda: TransferConfig(max_inflight_writes=0), "max_inflight_writes"),
])
def test_a_group_names_the_flat_field_in_its_error(make: object, field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):
        make()  # type: ignore[operator]


def test_the_validation_helper_refuses_bools_nans_and_out_of_range_values() -> None:
    assert check_int("n", 3, low=1, high=3) == 3
    for bad in (True, 0, 4, 2.0, "2", None):
        with pytest.raises(ConfigError, match="^n: must be an int in 1..3"):
            check_int("n", bad, low=1, high=3)
    assert check_number("x", 0.5, low=0, low_open=True) == 0.5
    for bad in (float("nan"), float("inf"), 0, False):
        with pytest.raises(ConfigError, match="^x: must be a finite number > 0"):
            check_number("x", bad, low=0, low_open=True)
    with pytest.raises(ConfigError, match=r"^mode: must be one of \('a', 'b'\), got 'c'"):
        check_choice("mode", "c", ("a", "b"))


async def test_storage_stats_are_typed_and_still_readable_by_name() -> None:
    async with HiCache(make_config(storage="memory://", prefetch_threshold=4)) as cache:
        tokens = make_tokens(16)
        async with cache.fetch(tokens) as hit:
            await hit.commit(tokens, await hit.allocate(16))
        st = cache.stats().storage
        assert isinstance(st, StorageStats)
        assert st.breaker == "closed" and st["breaker"] == "closed"
        assert st.get("errors") == st.errors == 0 and st.get("no such", 7) == 7
        assert set(st.keys()) >= {"prefetches", "backed_up_pages", "corrupt", "used_bytes"}
        with pytest.raises(KeyError):
            st["no such"]


def test_tp_stats_are_typed() -> None:
    stats = TPStats(ticks=2, tick_us_mean=3.5)
    assert stats["ticks"] == 2 and stats.as_dict() == {"ticks": 2, "tick_us_mean": 3.5}
