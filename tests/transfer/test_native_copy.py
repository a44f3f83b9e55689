"""The C page copier (`_pagecopy.c`) writes exactly the bytes the numpy copies write, and
refuses what would reach outside the pools."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from aiohicache import ConfigError, CpuTransferEngine, KVSpec
from aiohicache._native import REQUIRED
from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer import _native
from aiohicache.transfer._copy import CopyPlan
from aiohicache.transfer._cpu import copy_layer, word_views

pytestmark = pytest.mark.skipif(_native._MODULE is None and not REQUIRED,
                                reason="the native page copier is not built here (CI requires it)")

SPECS = {
    "mha-bf16": KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bf16"),
    "mla-576B": KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, dtype="fp8"),
    "mla-656B": KVSpec.mla(num_layers=4, kv_lora_rank=512, rope_dim=144, dtype="fp8"),
}
DEVICE_PAGES, HOST_PAGES = 23, 31


def pools(spec: KVSpec, page_size: int, layout: str, seed: int) -> tuple[DevicePool, HostPool]:
    dev = DevicePool(spec, num_pages=DEVICE_PAGES, page_size=page_size)
    host = HostPool(spec, num_pages=HOST_PAGES, page_size=page_size, layout=layout)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    for pool in (dev, host):
        raw = pool.data.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return dev, host


def page_ids(kind: str, rng: np.random.Generator, *, src_pages: int,
             dst_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of one copy: one run, several runs, scattered, scattered with skips, or
    with destinations repeated (the last pair wins, in both copies)."""
    n = int(rng.integers(1, min(src_pages, dst_pages) + 1))
    if kind == "run":
        a, b = rng.integers(0, src_pages - n + 1), rng.integers(0, dst_pages - n + 1)
        return np.arange(a, a + n), np.arange(b, b + n)
    src = rng.choice(src_pages, n, replace=False)
    dst = rng.choice(dst_pages, n, replace=False)
    if kind == "runs":  # sorted ids: runs of various lengths on both sides
        src, dst = np.sort(src), np.sort(dst)
    if kind == "repeats":
        dst = rng.choice(max(1, n // 2), n)
    if kind == "skips":
        src[rng.random(n) < 0.3] = -1
        dst[rng.random(n) < 0.2] = -int(rng.integers(1, 1 << 40))
    return src.astype(np.int64), dst.astype(np.int64)


def numpy_copy(dev: DevicePool, host: HostPool, src: np.ndarray, dst: np.ndarray, *,
               to_device: bool, layers: tuple[int, int]) -> None:
    plan = CopyPlan.build(src, dst)
    for layer in range(*layers):
        copy_layer(word_views(dev), word_views(host), plan, layer, to_device=to_device)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("kind", ["run", "runs", "scattered", "skips", "repeats"])
def test_native_and_numpy_copies_write_the_same_bytes(layout: str, page_size: int,
                                                      spec_name: str, kind: str) -> None:
    spec = SPECS[spec_name]
    rng = np.random.default_rng([page_size, len(kind), len(spec_name), len(layout)])
    native_pools, numpy_pools = pools(spec, page_size, layout, 7), pools(spec, page_size, layout, 7)
    copier = _native.native_copier(*native_pools)
    assert copier is not None
    for step in range(6):
        to_device = bool(step % 2)
        src, dst = page_ids(kind, rng, src_pages=HOST_PAGES if to_device else DEVICE_PAGES,
                            dst_pages=DEVICE_PAGES if to_device else HOST_PAGES)
        lo = int(rng.integers(0, spec.num_layers))
        hi = int(rng.integers(lo, spec.num_layers + 1))
        layers = (0, spec.num_layers) if step < 2 else (lo, hi)
        copier.copy(src, dst, to_device, *layers, bool(step % 3))
        numpy_copy(*numpy_pools, src, dst, to_device=to_device, layers=layers)
        for mine, theirs in zip(native_pools, numpy_pools, strict=True):
            assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8)), step


def test_a_page_id_past_its_pool_copies_nothing() -> None:
    dev, host = pools(SPECS["mha-bf16"], 4, "page_first", 1)
    before = dev.data.clone(), host.data.clone()
    copier = _native.native_copier(dev, host)
    assert copier is not None
    with pytest.raises(IndexError, match="pair 2: page 3 -> 31 is outside"):
        copier.copy(np.array([0, 1, 3]), np.array([5, 6, HOST_PAGES]), False, 0, 3, False)
    with pytest.raises(IndexError, match="pair 1"):
        copier.copy(np.array([0, HOST_PAGES]), np.array([1, 2]), True, 0, 3, True)
    for pool, old in zip((dev, host), before, strict=True):
        assert torch.equal(pool.data.view(torch.uint8), old.view(torch.uint8))


@pytest.mark.parametrize(("src", "dst", "layers", "error", "match"), [
    (np.array([0, 1], dtype=np.int32), np.array([0, 1]), (0, 3), TypeError, "src: must be"),
    (np.array([0, 1]), np.array([[0, 1]]), (0, 3), TypeError, "dst: must be"),
    (np.array([0.0, 1.0]), np.array([0, 1]), (0, 3), TypeError, "int64"),
    (np.array([0, 1, 2]), np.array([0, 1]), (0, 3), ValueError, "same length"),
    (np.array([0, 1]), np.array([0, 1]), (2, 1), ValueError, r"layers: \[2, 1\)"),
    (np.array([0, 1]), np.array([0, 1]), (0, 4), ValueError, "inside"),
    (np.array([0, 1]), np.array([0, 1]), (-1, 2), ValueError, "inside"),
])
def test_bad_arguments_are_refused(src: np.ndarray, dst: np.ndarray, layers: tuple[int, int],
                                   error: type[Exception], match: str) -> None:
    copier = _native.native_copier(*pools(SPECS["mha-bf16"], 4, "layer_first", 1))
    assert copier is not None
    with pytest.raises(error, match=match):
        copier.copy(src, dst, False, *layers, False)


def test_a_pool_described_past_its_bytes_is_refused() -> None:
    assert _native._MODULE is not None
    page_copier = _native._MODULE.PageCopier
    dev, host = np.zeros(2048, np.uint8), np.zeros(2048, np.uint8)
    fits = (0, 512, 1024, 2048, 2)  # offset, page, kv, layer strides, pages: the last chunk
    # (page 1, kv 1) ends at 512 + 1024 + 512 = 2048 bytes
    page_copier(dev, fits, host, fits, 512, 2, 1)
    for side, match in [((1, 512, 1024, 2048, 2), "device: chunks reach past"),
                        ((0, 512, 1024, 2048, 3), "device: chunks reach past"),
                        ((0, 1 << 62, 1 << 62, 0, 4), "device: chunks reach past"),
                        ((0, -512, 1024, 2048, 2), "device: offset, strides and pages"),
                        ((0, 512, 1024, 2048, -1), "device: offset, strides and pages")]:
        with pytest.raises(ValueError, match=match):
            page_copier(dev, side, host, fits, 512, 2, 1)
    with pytest.raises(ValueError, match="host: chunks reach past"):
        page_copier(dev, fits, host, (0, 1024, 1024, 2048, 2), 512, 2, 1)
    with pytest.raises(BufferError, match="not writable"):
        page_copier(bytes(2048), fits, host, fits, 512, 2, 1)  # read-only
    empty = page_copier(dev, fits, np.zeros(0, np.uint8), (0, 512, 1024, 2048, 0), 512, 2, 1)
    with pytest.raises(IndexError, match="outside the pools"):
        empty.copy(np.array([0]), np.array([0]), False, 0, 1, False)
    empty.copy(np.array([0]), np.array([-1]), False, 0, 1, False)  # skipped: nothing to check
    with pytest.raises(ValueError, match=">= 1"):
        page_copier(dev, fits, host, fits, 0, 2, 1)
    copier = page_copier(dev, fits, host, fits, 512, 2, 1)
    with pytest.raises(RuntimeError, match="already initialised"):
        copier.__init__(dev, fits, host, fits, 512, 2, 1)


def test_a_copier_whose_init_failed_copies_nothing() -> None:
    assert _native._MODULE is not None
    dev, host = np.zeros(2048, np.uint8), np.zeros(2048, np.uint8)
    fits, too_far = (0, 512, 1024, 2048, 2), (0, 512, 1024, 2048, 3)
    copier = _native._MODULE.PageCopier.__new__(_native._MODULE.PageCopier)
    with pytest.raises(RuntimeError, match="not initialised"):
        copier.copy(np.array([0]), np.array([1]), False, 0, 1, False)
    with pytest.raises(ValueError, match="host: chunks reach past"):
        copier.__init__(dev, fits, host, too_far, 512, 2, 1)
    with pytest.raises(RuntimeError, match="not initialised"):  # not the refused geometry
        copier.copy(np.array([0]), np.array([2]), False, 0, 1, False)
    copier.__init__(dev, fits, host, fits, 512, 2, 1)  # a good one still can be given
    dev[:512] = 7
    copier.copy(np.array([0]), np.array([1]), False, 0, 1, False)
    assert (host[512:1024] == 7).all() and not host[:512].any()


def test_overlapping_pools_are_refused() -> None:
    assert _native._MODULE is not None
    memory = np.zeros(4096, np.uint8)
    side = (0, 512, 1024, 2048, 2)
    with pytest.raises(ValueError, match="overlap"):
        _native._MODULE.PageCopier(memory[:2048], side, memory[1024:3072], side, 512, 2, 1)
    _native._MODULE.PageCopier(memory[:2048], side, memory[2048:], side, 512, 2, 1)


def test_pools_of_another_spec_or_page_size_are_refused() -> None:
    dev, _ = pools(SPECS["mha-bf16"], 4, "page_first", 1)
    _, other_page = pools(SPECS["mha-bf16"], 16, "page_first", 1)
    _, other_spec = pools(SPECS["mla-576B"], 4, "page_first", 1)
    for host in (other_page, other_spec):
        with pytest.raises(ConfigError, match="spec and page size"):
            _native.native_copier(dev, host)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_two_threads_copy_through_one_copier_at_once(layout: str) -> None:
    spec = SPECS["mha-bf16"]
    native_pools, numpy_pools = pools(spec, 16, layout, 5), pools(spec, 16, layout, 5)
    copier = _native.native_copier(*native_pools)
    assert copier is not None
    loads = (np.arange(10), np.arange(10))           # host 0..9 -> device 0..9
    writes = (np.arange(10, 20), np.arange(10, 20))  # device 10..19 -> host 10..19
    threads = [threading.Thread(target=lambda ids=ids, to_device=to_device: [
        copier.copy(*ids, to_device, 0, spec.num_layers, True) for _ in range(50)])
        for ids, to_device in ((loads, True), (writes, False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    numpy_copy(*numpy_pools, *loads, to_device=True, layers=(0, spec.num_layers))
    numpy_copy(*numpy_pools, *writes, to_device=False, layers=(0, spec.num_layers))
    for mine, theirs in zip(native_pools, numpy_pools, strict=True):
        assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8))


def test_the_copier_keeps_the_pools_bytes_alive() -> None:
    dev, host = pools(SPECS["mha-bf16"], 4, "page_first", 3)
    expected = dev.data[:, :, 2].clone()
    copier = _native.native_copier(dev, host)
    assert copier is not None
    host_bytes = host.data  # the test keeps one side to read back; the copier, both
    del dev, host
    copier.copy(np.array([2]), np.array([5]), False, 0, 3, True)
    assert torch.equal(host_bytes[5].view(torch.uint8), expected.view(torch.uint8))


def test_the_native_copier_is_there_where_ci_requires_it() -> None:
    if REQUIRED:
        engine = CpuTransferEngine(*pools(SPECS["mha-bf16"], 4, "page_first", 1))
        assert engine._native is not None, "the CPU engine does not use the C copier"


def test_aiohicache_native_0_copies_with_numpy() -> None:
    code = ("from aiohicache.transfer import _native; from aiohicache.transfer._cpu import "
            "CpuTransferEngine; print(_native._MODULE)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AIOHICACHE_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"
