"""Transfers: bit-exact page round trips device -> host -> device for every layout and spec."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from aiohicache import CpuTransferEngine, KVSpec, TransferError, TransferHandle
from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer._copy import CopyPlan, copy_pages

SPECS = {
    "mha-bf16": KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bf16"),
    "mla-576B": KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, dtype="fp8"),
    "mla-656B": KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=144, dtype="fp8"),
}


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
        layout: str, page_size: int, spec_name: str, order: str, inline_bytes: int) -> None:
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
