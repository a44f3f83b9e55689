"""KVSpec and HiCacheConfig: derived sizes, defaults, and a ConfigError naming every bad field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aiohicache import ConfigError, HiCacheConfig, HiCacheError, KVSpec
from tests.conftest import SPEC_MHA, make_config


def test_mha_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    spec = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16")
    assert spec.row_bytes == 8 * 128 * 2
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072


def test_mla_bytes_per_token_is_one_latent_row_per_layer() -> None:
    spec = KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert spec.num_kv == 1
    assert spec.row_bytes == 576 * 2
    assert spec.bytes_per_token == 61 * 1152


@pytest.mark.parametrize(("name", "dtype"), [
    ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp8", torch.float8_e4m3fn),
    ("torch.float32", torch.float32), (torch.float8_e5m2, torch.float8_e5m2)])
def test_dtype_names_and_aliases(name: str | torch.dtype, dtype: torch.dtype) -> None:
    assert KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1, dtype=name).dtype == dtype


def test_fp8_row_of_656_bytes_is_representable() -> None:
    spec = KVSpec.mla(num_layers=1, kv_lora_rank=512, rope_dim=144, dtype="fp8")
    assert spec.row_bytes == 656


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_layers": 0, "num_kv_heads": 1, "head_dim": 1}, "num_layers"),
    ({"num_layers": 1, "num_kv_heads": -2, "head_dim": 1}, "num_kv_heads"),
    ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 1.5}, "head_dim"),
    ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "int4"}, "dtype"),
    ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": torch.complex64}, "dtype"),
    ({"num_layers": True, "num_kv_heads": 1, "head_dim": 1}, "num_layers"),
])
def test_bad_mha_spec_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        KVSpec.mha(**kwargs)  # type: ignore[arg-type]


def test_bad_mla_spec_names_the_field() -> None:
    with pytest.raises(ConfigError, match="^rope_dim:"):
        KVSpec.mla(num_layers=1, kv_lora_rank=8, rope_dim=-1)
    with pytest.raises(ConfigError, match="^kv_lora_rank:"):
        KVSpec.mla(num_layers=1, kv_lora_rank=0, rope_dim=4)


def test_config_defaults_and_derived_values() -> None:
    cfg = HiCacheConfig(spec=SPEC_MHA, device_pages=10)
    assert cfg.page_size == 16 and cfg.device == "cpu" and cfg.host_layout == "page_first"
    assert cfg.host_capacity_pages == 20  # host_ratio 2.0
    assert cfg.page_bytes == 16 * SPEC_MHA.bytes_per_token
    assert cfg.hit_threshold == 1
    assert cfg.resolved_io_backend == "cpu"
    assert make_config(write_policy="write_through_selective").hit_threshold == 2
    assert make_config(write_through_threshold=5).hit_threshold == 5


def test_host_capacity_from_bytes_rounds_down_to_pages() -> None:
    page = make_config().page_bytes
    cfg = make_config(host_pages=None, host_bytes=10 * page + page // 2)
    assert cfg.host_capacity_pages == 10


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        HiCacheConfig(SPEC_MHA, 16)  # type: ignore[misc]


@pytest.mark.parametrize(("overrides", "field"), [
    ({"page_size": 0}, "page_size"),
    ({"page_size": 257}, "page_size"),
    ({"device_pages": -1}, "device_pages"),
    ({"device": "tpu"}, "device"),
    ({"host_pages": -1}, "host_pages"),
    ({"host_pages": False}, "host_pages"),
    ({"host_pages": 0.0}, "host_pages"),
    ({"host_pages": None, "host_bytes": 1}, "host_bytes"),
    ({"host_pages": None, "host_ratio": float("nan")}, "host_ratio"),
    ({"host_layout": "page_head"}, "host_layout"),
    ({"write_policy": "write_around"}, "write_policy"),
    ({"write_through_threshold": 0}, "write_through_threshold"),
    ({"load_back_threshold": -1}, "load_back_threshold"),
    ({"io_backend": "kernel"}, "io_backend"),
    ({"io_backend": "dma"}, "io_backend"),
    ({"eviction": "random"}, "eviction"),
    ({"namespace": ""}, "namespace"),
    ({"max_inflight_loads": 0}, "max_inflight_loads"),
    ({"max_worker_restarts": -1}, "max_worker_restarts"),
    ({"spec": "llama"}, "spec"),
])
def test_every_bad_config_value_raises_config_error_naming_it(
        overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:") as info:
        make_config(**overrides)
    assert isinstance(info.value, HiCacheError) and isinstance(info.value, ValueError)
