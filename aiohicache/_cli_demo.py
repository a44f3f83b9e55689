"""``aiohicache demo``: a short end-to-end tour of the cache on CPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import click
import torch

from ._cli_common import loop_option, run
from .api import FetchContext, HiCache
from .config import HiCacheConfig, KVSpec


@click.command()
@loop_option
def demo(loop: str) -> None:
    """A short end-to-end tour on CPU.

    Shows fetch/allocate/commit, write-through, eviction, load-back with layer_ready, and
    stats().
    """
    run(_demo, click.echo, loop=loop)


_DEMO_SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=4, dtype="fp16")


async def _demo(echo: Callable[[str], None]) -> None:
    """Three prompts of three pages on a device of eight pages: the third evicts the first,
    whose next fetch loads it back from the host layer by layer.

    Cancellation: the cache closes (shielded); nothing else is left running.
    """
    config = HiCacheConfig(spec=_DEMO_SPEC, page_size=4, device_pages=6, host_pages=32)
    a, b, c = (list(range(base, base + 12)) for base in (100, 200, 300))
    echo(f"KV spec {config.spec.fingerprint()}, page {config.page_size} tokens, device "
         f"{config.device_pages} pages, host {config.host_capacity_pages} pages, "
         f"{config.write_policy}\n")
    async with HiCache(config) as cache:
        echo("1. prompt A: a miss; allocate slots, compute its KV, commit")
        await _prefill(cache, a, echo)
        await cache.drain()
        echo(f"   write-through settled: {cache.stats().host_pages_used} host pages used\n")
        echo("2. prompt A again: every token is on the device (L1 hit)")
        await _prefill(cache, a, echo)
        echo("\n3. prompts B and C: the device has 6 pages, so C evicts A (LRU) to host-only")
        for tokens in (b, c):
            await _prefill(cache, tokens, echo)
            await cache.drain()
        echo(f"   {cache!r}\n")
        echo("4. prompt A once more: an L2 hit, loaded back while we wait layer by layer")
        await _load_back(cache, a, echo)
        await cache.drain()
        echo(f"   B, now the least recently used, went to host-only to make room: {cache!r}")
        cache.check_invariants()
        echo("\n5. stats()")
        echo(_format_stats(cache))


async def _prefill(cache: HiCache, tokens: list[int], echo: Callable[[str], None]) -> None:
    async with cache.fetch(tokens) as hit:
        new = len(tokens) - hit.num_cached_tokens
        echo(f"   fetch: {hit.num_device_hit_tokens} L1 + {hit.num_host_hit_tokens} L2 "
             f"cached of {len(tokens)} tokens")
        if new == 0:
            return
        slots = await hit.allocate(new)
        _compute_kv(cache, slots, tokens[hit.num_cached_tokens:])
        await hit.commit(tokens, slots)
        writing = "" if cache.controller.idle else "; write-through to the host started"
        echo(f"   allocate({new}) -> slots {slots.tolist()}; commit{writing}")


async def _load_back(cache: HiCache, tokens: list[int], echo: Callable[[str], None]) -> None:
    async with cache.fetch(tokens) as hit:
        echo(f"   fetch: {hit.num_device_hit_tokens} L1 + {hit.num_host_hit_tokens} L2 "
             f"cached of {len(tokens)} tokens")
        for layer in range(cache.config.spec.num_layers):
            await hit.layer_ready(layer)
            same = _check_kv(cache, hit, layer)
            echo(f"   layer_ready({layer}): K/V of layer {layer} on the device, "
                 f"{'identical to' if same else 'DIFFERENT from'} what was computed")


def _expected_kv(tokens: list[int], layer: int, kv: int) -> torch.Tensor:
    """Stand-in KV of a forward pass: a value per (token, layer, K/V), exact in fp16."""
    values = torch.tensor(tokens, dtype=torch.float32) % 997 + layer * 10 + kv
    return values.to(_DEMO_SPEC.dtype)


def _compute_kv(cache: HiCache, slots: torch.Tensor, tokens: list[int]) -> None:
    pool = cache.device_pool
    for layer in range(_DEMO_SPEC.num_layers):
        for kv, buf in enumerate((pool.k_buffer(layer), pool.v_buffer(layer))):
            buf[slots] = _expected_kv(tokens, layer, kv)[:, None, None].expand(
                -1, *buf.shape[1:])


def _check_kv(cache: HiCache, hit: FetchContext, layer: int) -> bool:
    pool, slots = cache.device_pool, hit.device_indices
    tokens = list(hit.tokens[:len(slots)])
    return all(torch.equal(buf[slots][:, 0, 0], _expected_kv(tokens, layer, kv))
               for kv, buf in enumerate((pool.k_buffer(layer), pool.v_buffer(layer))))


def _format_stats(cache: HiCache) -> str:
    stats = cache.stats()
    items = [(f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats)]
    items.append(("hit_ratio", f"{stats.hit_ratio:.2f}"))
    return "\n".join(f"   {name:<22} {value}" for name, value in items)
