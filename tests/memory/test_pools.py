"""Pool sizes the machine cannot hold are a ConfigError naming the field, before allocating."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from aiohicache import ConfigError, HiCache, HiCacheConfig, KVSpec, PageError
from aiohicache.memory import DevicePool, HostPool

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=16, dtype="fp16")


def test_a_device_pool_larger_than_memory_names_device_pages() -> None:
    with pytest.raises(ConfigError, match=r"^device_pages: 1,000,000,000,000,000 pages need "
                                          r"[0-9,]+ bytes of host memory; this process may use "
                                          r"[0-9,]+ bytes \(RAM, or its cgroup's limit\)$"):
        DevicePool(SPEC, num_pages=10**15, page_size=16)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_host_pool_larger_than_memory_names_host_pages(layout: str) -> None:
    with pytest.raises(ConfigError, match=r"^host_pages: .* bytes .* bytes"):
        HostPool(SPEC, num_pages=10**15, page_size=16, layout=layout)  # type: ignore[arg-type]


@pytest.mark.parametrize(("sizes", "field"), [
    ({"device_pages": 10**15}, "device_pages"),
    ({"device_pages": 8, "host_pages": 10**15}, "host_pages"),
    ({"device_pages": 8, "host_bytes": 10**16}, "host_pages"),
    ({"device_pages": 10**12, "host_ratio": 1000.0}, "device_pages"),
])
def test_an_absurd_cache_is_refused_before_anything_is_allocated(
        sizes: dict[str, int], field: str) -> None:
    config = HiCacheConfig(spec=SPEC, page_size=16, **sizes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"^{field}: "):
        HiCache(config)


def test_the_bookkeeping_of_many_tiny_pages_counts_too() -> None:
    tiny = KVSpec.mla(num_layers=1, kv_lora_rank=1, rope_dim=0, dtype="fp16")  # 2-byte pages
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ConfigError, match="^host_pages: "):  # KV 0.4x RAM, page ids 1.8x
        HostPool(tiny, num_pages=ram // 5, page_size=1)


def test_pools_that_fit_are_made() -> None:
    pool = HostPool(SPEC, num_pages=4, page_size=16)
    assert pool.nbytes == 4 * 16 * SPEC.bytes_per_token
    assert DevicePool(SPEC, num_pages=4, page_size=16).nbytes == pool.nbytes


@pytest.mark.parametrize(("pool", "pages_field"), [(DevicePool, "device_pages"),
                                                   (HostPool, "host_pages")])
@pytest.mark.parametrize("sizes", [{"page_size": 0}, {"page_size": -1}, {"page_size": True},
                                   {"page_size": 4.0}, {"num_pages": -1}, {"num_pages": True}])
def test_pool_sizes_that_are_not_counts_are_refused_by_name(
        pool: type[DevicePool | HostPool], pages_field: str, sizes: dict[str, object]) -> None:
    """A page of 0 tokens would make a pool that holds nothing and a slot map that divides
    by zero; each bad size is a ConfigError naming its field, as `HiCacheConfig` does."""
    field = "page_size" if "page_size" in sizes else pages_field
    with pytest.raises(ConfigError, match=f"^{field}: must be "):
        pool(SPEC, **{"num_pages": 4, "page_size": 4, **sizes})  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_page_tensor_is_that_page_and_refuses_ids_outside_the_pool(layout: str) -> None:
    pool = HostPool(SPEC, num_pages=3, page_size=2, layout=layout)  # type: ignore[arg-type]
    pool.data.copy_(torch.arange(pool.data.numel()).view_as(pool.data))
    for page in range(3):  # [num_kv, num_layers, page_size, *row], from the layer views
        expected = torch.stack([torch.stack([pool.layer_view(kv, layer)[page]
                                             for layer in range(SPEC.num_layers)])
                                for kv in range(SPEC.num_kv)])
        assert torch.equal(pool.page_tensor(page), expected)
    for bad in (-1, 3, 1.0):  # -1 used to wrap around to the last page
        with pytest.raises(PageError, match="^page: "):
            pool.page_tensor(bad)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_a_cuda_pool_larger_than_the_gpu_names_device_pages() -> None:
    total = torch.cuda.mem_get_info()[1]
    pages = total // (16 * SPEC.bytes_per_token) + 1  # more than the GPU, less than host RAM
    with pytest.raises(ConfigError, match=r"^device_pages: .* cuda"):
        DevicePool(SPEC, num_pages=pages, page_size=16, device="cuda")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_slots_to_pages_accepts_only_whole_pages_in_order(page_size: int) -> None:
    pool = DevicePool(KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=4, dtype="fp32"),
                      num_pages=32, page_size=page_size)
    pages = np.array([5, 3, 31, 0], dtype=np.int64)
    slots = pool.page_slots(pages)
    assert pool.slots_to_pages(slots).tolist() == [5, 3, 31, 0]
    assert pool.slots_to_pages(torch.from_numpy(slots)).tolist() == [5, 3, 31, 0]
    if page_size > 1:  # a trailing partial page counts as its page
        assert pool.slots_to_pages(slots[:-1]).tolist() == [5, 3, 31, 0]
    bad = [slots + 1, np.r_[slots, [32 * page_size]], np.r_[[-page_size] * page_size, slots]]
    if page_size > 1:  # (with one slot per page, these are whole pages too)
        swapped = slots.copy()
        swapped[[0, 1]] = swapped[[1, 0]]
        bad += [slots[1:], slots[::-1].copy(), swapped]
    for wrong in bad:
        with pytest.raises(ConfigError, match="^slots:"):
            pool.slots_to_pages(wrong)


def test_a_cgroup_memory_limit_bounds_what_a_pool_may_take(tmp_path: Path) -> None:
    """In a container the process gets its cgroup's memory limit, not the machine's RAM: a
    pool between the two passed the check and then had the process OOM-killed. cgroup v2
    (``memory.max``, "max" for none) and v1 (``memory.limit_in_bytes``, a huge number for
    none) are both read, at the process's own cgroup path."""
    from aiohicache.memory._pools import _cgroup_limit
    own = tmp_path / "cgroup"
    v2 = tmp_path / "fs" / "kubepods" / "pod1"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("2147483648\n")
    own.write_text("0::/kubepods/pod1\n")
    assert _cgroup_limit(str(tmp_path / "fs"), str(own)) == 2 << 30
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_limit(str(tmp_path / "fs"), str(own)) is None
    v1 = tmp_path / "fs" / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1073741824\n")
    own.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/kubepods/pod1\n")
    assert _cgroup_limit(str(tmp_path / "fs"), str(own)) == 1 << 30
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "none"
    assert _cgroup_limit(str(tmp_path / "fs"), str(own)) is None
    assert _cgroup_limit(str(tmp_path / "none"), str(tmp_path / "missing")) is None


def test_a_pool_over_the_cgroup_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host pool that fits the machine but not the container is a `ConfigError` naming
    the field, before anything is allocated."""
    from aiohicache.memory import _pools
    monkeypatch.setattr(_pools, "_cgroup_limit", lambda: 1 << 20)  # a 1 MiB container
    with pytest.raises(ConfigError, match=r"^device_pages: .* this process may use "
                                          r"1,048,576 bytes"):
        DevicePool(SPEC, num_pages=4096, page_size=16)
