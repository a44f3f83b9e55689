"""The transfer test matrix shared by the CPU plan tests and the `gpu` tests.

dtypes {bf16, fp16, fp8} x page {1, 16, 64, 256} x {MHA, MLA with 576-element rows, MLA with
656-element rows} (576 B and 656 B rows at fp8) x host layout x direction x index order; the
CPU engine's page copy is the reference every path is compared with.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from aiohicache import KVSpec
from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer._copy import CopyPlan
from aiohicache.transfer._cpu import copy_layer, word_views

DTYPES = ["bf16", "fp16", "fp8"]
PAGE_SIZES = [1, 16, 64, 256]
MODELS = ["mha", "mla-576", "mla-656"]
LAYOUTS: list[Literal["layer_first", "page_first"]] = ["layer_first", "page_first"]
ORDERS = ["contiguous", "random"]
NUM_LAYERS = 3
DEVICE_PAGES = 7
HOST_PAGES = 9
COPY_PAGES = 5


def spec(model: str, dtype: str) -> KVSpec:
    if model == "mha":
        return KVSpec.mha(num_layers=NUM_LAYERS, num_kv_heads=2, head_dim=16, dtype=dtype)
    rope = {"mla-576": 64, "mla-656": 144}[model]
    return KVSpec.mla(num_layers=NUM_LAYERS, kv_lora_rank=512, rope_dim=rope, dtype=dtype)


def random_fill(pool: DevicePool | HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = pool.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen).to(raw.device))


def page_pairs(order: str, *, to_device: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) page ids of one copy: runs on both sides, or scattered."""
    rng = np.random.default_rng(seed)
    host_n, dev_n = HOST_PAGES, DEVICE_PAGES
    if order == "contiguous":
        host = np.arange(3, 3 + COPY_PAGES)
        dev = np.arange(1, 1 + COPY_PAGES)
    else:
        host = rng.choice(host_n, COPY_PAGES, replace=False)
        dev = rng.choice(dev_n, COPY_PAGES, replace=False)
    host, dev = host.astype(np.int64), dev.astype(np.int64)
    return (host, dev) if to_device else (dev, host)


def cpu_pools(model: str, dtype: str, page_size: int,
              layout: Literal["layer_first", "page_first"]) -> tuple[DevicePool, HostPool]:
    s = spec(model, dtype)
    dev = DevicePool(s, num_pages=DEVICE_PAGES, page_size=page_size)
    host = HostPool(s, num_pages=HOST_PAGES, page_size=page_size, layout=layout)
    random_fill(dev, 1)
    random_fill(host, 2)
    return dev, host


ODD_ROWS = [  # (heads, head_dim, dtype, page_size, widest vector)
    (2, 16, "bf16", 1, 16), (1, 4, "fp8", 2, 8), (2, 1, "fp16", 1, 4), (2, 3, "fp8", 2, 4),
    (2, 3, "fp8", 1, 2), (1, 3, "fp8", 1, 1), (1, 3, "fp8", 16, 16)]
ODD_PAIRS = (np.array([5, 0, 2]), np.array([1, 3, 4]))  # host -> device page ids


def odd_row_pools(heads: int, head_dim: int, dtype: str,
                  page_size: int) -> tuple[DevicePool, HostPool]:
    """CPU pools of 6 pages whose rows are not multiples of 16 bytes (most of them)."""
    s = KVSpec.mha(num_layers=2, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    dev = DevicePool(s, num_pages=6, page_size=page_size)
    host = HostPool(s, num_pages=6, page_size=page_size, layout="page_first")
    random_fill(dev, 1)
    random_fill(host, 2)
    return dev, host


def reference_copy(dev: DevicePool, host: HostPool, src: np.ndarray, dst: np.ndarray, *,
                   to_device: bool) -> None:
    """The CPU engine's copy of every layer, in place (blocking)."""
    plan = CopyPlan.build(src, dst)
    dev_words, host_words = word_views(dev), word_views(host)
    for layer in range(dev.spec.num_layers):
        copy_layer(dev_words, host_words, plan, layer, to_device=to_device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)))
