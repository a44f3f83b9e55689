"""Transfers: bit-exact page round trips device -> host -> device for every layout and spec."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from aiohicache import ConfigError, CpuTransferEngine, KVSpec, TransferError, TransferHandle
from aiohicache._native import REQUIRED
from aiohicache.errors import PageError
from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer import _cpu, _native
from aiohicache.transfer._base import record_fence, write_after
from aiohicache.transfer._copy import CopyPlan, copy_pages

SPECS = {
    "mha-bf16": KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bf16"),
    "mla-576B": KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, dtype="fp8"),
    "mla-656B": KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=144, dtype="fp8"),
}


@pytest.fixture(params=["native", "numpy"])
def copier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU engine with the C page copier (`_pagecopy.c`), and with numpy copies."""
    if request.param == "numpy":
        monkeypatch.setattr(_cpu, "native_copier", lambda *_: None)
    elif _native._MODULE is None and not REQUIRED:
        pytest.skip("the native page copier is not built here (CI requires it)")
    return str(request.param)


def random_fill(pool: DevicePool | HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = pool.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("order", ["contiguous", "random"])
@pytest.mark.parametrize("inline_bytes", [0, 1 << 30], ids=["thread", "inline"])
async def test_round_trip_device_host_device_is_bit_exact(
        layout: str, page_size: int, spec_name: str, order: str, inline_bytes: int,
        copier: str) -> None:
    spec = SPECS[spec_name]
    dev = DevicePool(spec, num_pages=12, page_size=page_size)
    host = HostPool(spec, num_pages=20, page_size=page_size, layout=layout)  # type: ignore[arg-type]
    random_fill(dev, 1)
    random_fill(host, 2)
    rng = np.random.default_rng(3)
    src = np.arange(2, 10) if order == "contiguous" else rng.permutation(12)[:8]
    mid = np.arange(5, 13) if order == "contiguous" else rng.permutation(20)[:8]
    back = np.arange(0, 8) if order == "contiguous" else rng.permutation(12)[:8]
    expected = dev.data[:, :, src].clone()
    untouched_host = np.setdiff1d(np.arange(20), mid)
    host_before = host.data.clone()
    engine = CpuTransferEngine(dev, host, inline_bytes=inline_bytes)
    try:
        await engine.write(src, mid).wait()
        await engine.load(mid, back).wait()
    finally:
        await engine.aclose()
    assert torch.equal(dev.data[:, :, back].view(torch.uint8), expected.view(torch.uint8))
    for p in untouched_host:  # guard: pages not named are not written
        before = host_before[p] if layout == "page_first" else host_before[:, :, p]
        after = host.data[p] if layout == "page_first" else host.data[:, :, p]
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))


@pytest.mark.usefixtures("copier")
async def test_a_load_on_the_copy_thread_reports_each_layer_then_finishes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int | str] = []
    layer_done, finish = TransferHandle._layer_done, TransferHandle._finish

    def record_layer(handle: TransferHandle, layer: int) -> None:
        seen.append(layer)
        layer_done(handle, layer)

    def record_finish(handle: TransferHandle, exc: BaseException | None = None) -> None:
        seen.append("finished")
        finish(handle, exc)
    monkeypatch.setattr(TransferHandle, "_layer_done", record_layer)
    monkeypatch.setattr(TransferHandle, "_finish", record_finish)
    spec = SPECS["mha-bf16"]
    engine = CpuTransferEngine(DevicePool(spec, num_pages=8, page_size=4),
                               HostPool(spec, num_pages=8, page_size=4), inline_bytes=0)
    try:
        await engine.load(np.arange(4), np.arange(4)).wait()
        assert seen == [*range(spec.num_layers), "finished"]
        seen.clear()
        await engine.write(np.arange(4), np.arange(4)).wait()
        assert seen == ["finished"]  # writes report only the whole copy
    finally:
        await engine.aclose()


@pytest.mark.usefixtures("copier")
async def test_load_reports_layers_in_order_and_then_done() -> None:
    spec = SPECS["mha-bf16"]
    dev = DevicePool(spec, num_pages=8, page_size=4)
    host = HostPool(spec, num_pages=8, page_size=4)
    engine = CpuTransferEngine(dev, host)
    try:
        handle = engine.load(np.arange(4), np.arange(4))
        for layer in range(spec.num_layers):
            await handle.wait_layer(layer)
            assert handle.layer_done(layer)
        await handle.wait()
        assert handle.done() and handle.exception() is None
        assert handle.nbytes == 4 * 4 * spec.bytes_per_token
    finally:
        await engine.aclose()


def test_copy_plan_coalesces_contiguous_runs_only() -> None:
    src = np.array([0, 1, 2, 3, 7, 8, 9, 10])
    dst = np.array([4, 5, 6, 7, 0, 1, 2, 3])
    assert CopyPlan.build(src, dst).runs == [(0, 4, 4), (7, 0, 4)]
    scattered = CopyPlan.build(np.array([5, 1, 3, 0]), np.array([0, 1, 2, 3]))
    assert scattered.runs is None


@pytest.mark.parametrize(("row_bytes", "uses_runs"), [
    (None, True),      # no row size given: runs of 4 pages or more
    (256, False),      # 2 KiB per run: one gather costs less than a call per run
    (2 << 10, True),   # 16 KiB per run
    (32 << 10, True),  # big rows: runs of any length
])
def test_runs_are_used_only_where_they_average_enough_bytes(row_bytes: int | None,
                                                            uses_runs: bool) -> None:
    src = np.r_[np.arange(0, 8), np.arange(20, 28)]  # two runs of 8 pages
    dst = np.arange(16)
    plan = CopyPlan.build(src, dst, row_bytes=row_bytes)
    assert (plan.runs is not None) == uses_runs
    pages = torch.arange(32 * 4, dtype=torch.int64).reshape(32, 4)
    out = torch.zeros(16, 4, dtype=torch.int64)
    copy_pages(pages, out, plan)
    assert torch.equal(out, pages[torch.from_numpy(src)])


@pytest.mark.parametrize(("num_src", "num_dst", "n"), [
    (50, 40, 30),   # scattered destinations: row assignment
    (50, 40, 40),   # every destination once, shuffled: gathers into destination runs
    (50, 400, 40),  # sparse destinations
])
def test_scattered_copies_match_an_index_reference(num_src: int, num_dst: int, n: int) -> None:
    src = torch.randn(num_src, 4, 8)
    dst = torch.zeros(num_dst, 4, 8)
    rng = np.random.default_rng(0)
    s, d = rng.permutation(num_src)[:n], rng.permutation(num_dst)[:n]
    copy_pages(src, dst, CopyPlan.build(s, d))
    ref = torch.zeros(num_dst, 4, 8)
    ref[torch.from_numpy(d)] = src[torch.from_numpy(s)]
    assert torch.equal(dst, ref)


def test_shuffled_full_destination_uses_destination_runs() -> None:
    plan = CopyPlan.build(np.random.default_rng(1).permutation(16), np.arange(16))
    assert plan.runs is None and plan.dst_runs == [(0, 0, 16)]


async def test_handle_failure_raises_transfer_error_to_every_waiter() -> None:
    handle = TransferHandle(num_layers=2, nbytes=0)
    waiters = [asyncio.ensure_future(handle.wait_layer(1)), asyncio.ensure_future(handle.wait())]
    await asyncio.sleep(0)
    handle._finish(OSError("link down"))
    for w in waiters:
        with pytest.raises(TransferError, match="link down"):
            await w


async def test_cancelling_one_waiter_does_not_cancel_the_transfer() -> None:
    handle = TransferHandle(num_layers=1, nbytes=0)
    first = asyncio.ensure_future(handle.wait())
    second = asyncio.ensure_future(handle.wait())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    handle._finish()
    await second
    assert handle.done()


# --- page ids: negative skips, past the pool refused (as the CUDA engine) ------------------


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30], ids=["thread", "inline"])
@pytest.mark.parametrize("order", ["contiguous", "random"])
async def test_a_negative_page_id_skips_its_pair_instead_of_wrapping(
        inline_bytes: int, order: str, copier: str) -> None:
    spec = SPECS["mha-bf16"]
    dev = DevicePool(spec, num_pages=8, page_size=4)
    host = HostPool(spec, num_pages=8, page_size=4, layout="page_first")
    random_fill(dev, 1)
    random_fill(host, 2)
    dev_before, host_before = dev.data.clone(), host.data.clone()
    src = np.array([1, 2, -1, 4, 5]) if order == "contiguous" else np.array([6, -1, 0, 3, 7])
    dst = np.array([2, 3, 4, -3, 6]) if order == "contiguous" else np.array([1, 5, -1, 2, 7])
    keep = (src >= 0) & (dst >= 0)
    engine = CpuTransferEngine(dev, host, inline_bytes=inline_bytes)
    try:
        await engine.write(src, dst).wait()
        await engine.load(dst, src).wait()
    finally:
        await engine.aclose()
    written = set(dst[keep].tolist())
    for p in range(8):
        expect = dev_before[:, :, src[keep][dst[keep] == p][0]] if p in written \
            else host_before[p]
        assert torch.equal(host.data[p].view(torch.uint8), expect.view(torch.uint8)), p
    loaded = set(src[keep].tolist())
    for p in range(8):
        if p not in loaded:
            assert torch.equal(dev.data[:, :, p].view(torch.uint8),
                               dev_before[:, :, p].view(torch.uint8)), p


@pytest.mark.parametrize("ids", [np.array([(1 << 64) - 1], dtype=np.uint64),
                                 np.array([1.9])], ids=["uint64-past-int64", "float"])
async def test_page_ids_that_are_not_int64_integers_are_refused(ids: np.ndarray) -> None:
    """A uint64 id past int64 wrapped to a negative id, a skip: nothing was copied and
    nothing raised; a float was truncated (a review)."""
    spec = SPECS["mla-656B"]
    engine = CpuTransferEngine(DevicePool(spec, num_pages=4, page_size=2),
                               HostPool(spec, num_pages=4, page_size=2))
    try:
        with pytest.raises(PageError, match="need integers that fit int64"):
            engine.load(ids, np.array([0]))
        with pytest.raises(PageError, match="need integers that fit int64"):
            engine.write(np.array([0]), ids)
    finally:
        await engine.aclose()


@pytest.mark.parametrize("to_device", [True, False], ids=["load", "write"])
@pytest.mark.usefixtures("copier")
async def test_a_page_id_past_its_pool_is_refused_before_any_copy(to_device: bool) -> None:
    spec = SPECS["mla-656B"]
    dev = DevicePool(spec, num_pages=4, page_size=2)
    host = HostPool(spec, num_pages=6, page_size=2)
    random_fill(dev, 1)
    random_fill(host, 2)
    dev_before, host_before = dev.data.clone(), host.data.clone()
    engine = CpuTransferEngine(dev, host)
    try:
        with pytest.raises(PageError, match="device pool's 4 pages"):
            if to_device:
                engine.load(np.array([0, 1]), np.array([2, 4]))
            else:
                engine.write(np.array([0, 4]), np.array([2, 3]))
        with pytest.raises(PageError, match="host pool's 6 pages"):
            if to_device:
                engine.load(np.array([0, 6]), np.array([2, 3]))
            else:
                engine.write(np.array([0, 1]), np.array([1 << 40, 3]))
    finally:
        await engine.aclose()
    assert torch.equal(dev.data.view(torch.uint8), dev_before.view(torch.uint8))
    assert torch.equal(host.data.view(torch.uint8), host_before.view(torch.uint8))


@pytest.mark.parametrize("host_spec", [
    KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, dtype="fp16"),  # same bytes a row
    KVSpec.mha(num_layers=3, num_kv_heads=1, head_dim=32, dtype="bf16"),  # ... other heads
    SPECS["mha-bf16"],  # the same spec, another page size (below)
])
@pytest.mark.usefixtures("copier")
def test_pools_of_another_spec_or_page_size_are_refused(host_spec: KVSpec) -> None:
    """Either copier refuses them when the engine is made; the numpy one used to copy the
    bytes as they were (KV of one dtype or head split read as another's)."""
    dev = DevicePool(SPECS["mha-bf16"], num_pages=4, page_size=4)
    page_size = 8 if host_spec == dev.spec else 4
    with pytest.raises(ConfigError, match="^host pool: must hold the device pool's spec"):
        CpuTransferEngine(dev, HostPool(host_spec, num_pages=4, page_size=page_size))


# --- fences ---------------------------------------------------------------------------------


class FencedEngine(CpuTransferEngine):
    """Records the fences its writes were given."""

    def __init__(self, dev: DevicePool, host: HostPool) -> None:
        super().__init__(dev, host)
        self.given: list[tuple[object, ...]] = []
        self.made = 0

    def fence(self) -> object:  # type: ignore[override]
        self.made += 1
        return ("fence", self.made)

    def write(self, device_pages: np.ndarray, host_pages: np.ndarray, *,
              fences: Sequence[object] = ()) -> TransferHandle:
        self.given.append(tuple(fences))
        return super().write(device_pages, host_pages, fences=fences)


class PlainEngine(CpuTransferEngine):
    """An engine written before fences: `write` takes no keyword."""

    def write(self, device_pages: np.ndarray,  # type: ignore[override]
              host_pages: np.ndarray) -> TransferHandle:
        return super().write(device_pages, host_pages)


async def test_fences_recorded_at_commit_reach_the_write_and_engines_without_them_work() -> None:
    spec = SPECS["mha-bf16"]
    dev = DevicePool(spec, num_pages=4, page_size=2)
    host = HostPool(spec, num_pages=4, page_size=2)
    assert CpuTransferEngine(dev, host).fence() is None
    fenced = FencedEngine(dev, host)
    plain = PlainEngine(dev, host)
    try:
        first, second = record_fence(fenced), record_fence(fenced)
        await write_after(fenced, np.array([0]), np.array([1]), [first, None, second]).wait()
        await write_after(fenced, np.array([0]), np.array([1]), [None]).wait()
        assert fenced.given == [(("fence", 1), ("fence", 2)), ()]
        assert record_fence(plain) is None
        await write_after(plain, np.array([0]), np.array([1]), [record_fence(plain)]).wait()
    finally:
        await fenced.aclose()
        await plain.aclose()


# --- pool index helpers ---------------------------------------------------------------------


def test_slot_arithmetic_stays_in_numpy_and_index_tensors_come_from_it() -> None:
    dev = DevicePool(SPECS["mha-bf16"], num_pages=8, page_size=4)
    pages = np.array([5, 2], dtype=np.int64)
    slots = dev.page_slots(pages)
    assert isinstance(slots, np.ndarray) and slots.dtype == np.int64
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    tensor = dev.index_tensor(slots[:6])
    assert tensor.dtype == torch.int64 and tensor.device == dev.device
    assert tensor.tolist() == slots[:6].tolist()
    assert torch.equal(dev.pages_to_slots(pages), torch.from_numpy(slots))
    assert dev.slots_to_pages(slots[:6]).tolist() == [5, 2]  # numpy in: no device copy
    assert dev.slots_to_pages(slots[:6].astype(np.int32)).tolist() == [5, 2]
    with pytest.raises(ConfigError, match="whole pages"):
        dev.slots_to_pages(slots[1:])
    with pytest.raises(ConfigError, match="1-D"):
        dev.slots_to_pages(slots.reshape(2, 4))
