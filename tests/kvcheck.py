"""KV a test can check: what a forward pass would write, and whether the cache serves exactly it.

The K/V of token ``i`` in a real model depends on the token, its position and every token
before it. `KVChecker` writes values with the same dependence: the value of token ``i`` for
one layer and K or V is a hash of (``tokens[:i + 1]``, ``i``, layer, k/v), so the same token
at another position, or after another prefix, gets different KV, and a page served for the
wrong prefix or at the wrong offset is caught. Values are integers 0..250 (plus the column
within the row, mod 251), exact in bf16, fp16, fp32 and uint8; leased slots nobody computed
can be filled with `POISON` (255), which no token's KV ever equals.

    kv = KVChecker(cache)
    async with cache.fetch(tokens) as hit:
        await kv.verify_prefix(hit, tokens)      # awaits hit.ready(), then checks every slot
        slots = await hit.allocate(len(tokens) - hit.num_cached_tokens)
        kv.fill(slots, tokens, hit.num_cached_tokens)
        await hit.commit(tokens, slots)
        await kv.verify_after_commit(hit, tokens)

A failure is an `AssertionError` naming the token, position, slot, layer and K/V that differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from aiohicache import FetchContext, HiCache
from aiohicache.controller import LoadJob
from aiohicache.radix import DeviceState

__all__ = ("POISON", "KVChecker", "kv_codes")

Tokens = Sequence[int] | npt.NDArray[np.integer]

POISON = 255
"""The value of slots that hold no token's KV (leased, not computed): outside 0..250."""

_MOD = 251
_P = (1 << 31) - 1  # prime: the prefix hash is a polynomial mod _P (products fit in int64)
_BASE = 1_000_003
_EXACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)
_powers: npt.NDArray[np.int64] = np.ones(1, dtype=np.int64)


def _base_powers(n: int) -> npt.NDArray[np.int64]:
    """``_BASE ** j mod _P`` for j < n (grown on demand, kept for later calls)."""
    global _powers
    if len(_powers) < n:
        out = np.empty(max(n, 2 * len(_powers)), dtype=np.int64)
        out[:len(_powers)] = _powers
        for j in range(len(_powers), len(out)):
            out[j] = out[j - 1] * _BASE % _P
        _powers = out
    return _powers[:n]


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer (array arithmetic wraps mod 2**64, as intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def kv_codes(tokens: Tokens, num_kv: int, num_layers: int) -> npt.NDArray[np.int64]:
    """The KV code (0..250) of every token: shape ``(num_kv, num_layers, len(tokens))``.

    Code ``[kv, layer, i]`` hashes the prefix ``tokens[:i + 1]`` (a polynomial over its
    token ids, so it covers the ids and their order), the position ``i``, the layer and K/V.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    n = len(ids)
    prefix = np.cumsum((ids % _P) * _base_powers(n) % _P) % _P  # n < 2**32: no overflow
    pos = np.arange(n, dtype=np.uint64)
    base = _mix(prefix.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                ^ pos * np.uint64(0xD6E8FEB86659FD93))
    which = np.arange(num_kv * num_layers, dtype=np.uint64).reshape(num_kv, num_layers, 1)
    codes = _mix(base[None, None, :] ^ (which + np.uint64(1)) * np.uint64(0xA24BAED4963EE407))
    return (codes % np.uint64(_MOD)).astype(np.int64)


class KVChecker:
    """Writes and verifies position- and prefix-dependent KV in one cache's device pool.

    Args:
        cache: the cache whose `device_pool` the forward pass writes and attention reads.
    """

    def __init__(self, cache: HiCache) -> None:
        pool = cache.device_pool
        assert pool.spec.dtype in _EXACT_DTYPES, (
            f"KVChecker needs a dtype holding 0..255 exactly, not {pool.spec.dtype}")
        self.cache = cache
        self.page_size = pool.page_size
        self._num_kv, self._num_layers = pool.spec.num_kv, pool.spec.num_layers
        # [kv, layer, slot, row]: a view, so writes land in the pool
        self._slots = pool.data.view(self._num_kv, self._num_layers, pool.num_slots, -1)
        self._cols = torch.arange(self._slots.shape[-1], dtype=torch.int64)

    # ------------------------------------------------------------------ writing

    def expected(self, tokens: Tokens, start_pos: int, num: int) -> torch.Tensor:
        """KV of ``tokens[start_pos:start_pos + num]`` as the pool stores it:
        ``(num_kv, num_layers, num, row)`` in the pool's dtype."""
        assert start_pos >= 0 and start_pos + num <= len(tokens), (
            f"positions {start_pos}..{start_pos + num} outside {len(tokens)} tokens")
        codes = kv_codes(tokens[:start_pos + num], self._num_kv, self._num_layers)
        codes_t = torch.from_numpy(np.ascontiguousarray(codes[:, :, start_pos:]))
        rows = (codes_t[..., None] + self._cols) % _MOD
        return rows.to(self._slots.dtype).to(self._slots.device)

    def fill(self, slots: torch.Tensor, tokens: Tokens, start_pos: int = 0) -> None:
        """Write what a forward pass writes for ``tokens[start_pos:start_pos + len(slots)]``
        (positions from `start_pos`) into `slots`."""
        if len(slots):
            self._slots[:, :, slots.to(self._slots.device)] = self.expected(
                tokens, start_pos, len(slots))

    def poison(self, slots: torch.Tensor) -> None:
        """Mark `slots` as holding no token's KV (for leased slots nobody computes)."""
        if len(slots):
            self._slots[:, :, slots.to(self._slots.device)] = POISON

    # ------------------------------------------------------------------ checking

    def verify(self, slots: torch.Tensor, tokens: Tokens, start_pos: int = 0, *,
               what: str = "slots") -> None:
        """Assert `slots` hold exactly the KV of ``tokens[start_pos:start_pos + len(slots)]``.

        Raises:
            AssertionError: naming the first token, position, slot, layer and K/V that differ.
        """
        if not len(slots):
            return
        idx = slots.to(self._slots.device)
        got = self._slots[:, :, idx]
        want = self.expected(tokens, start_pos, len(slots))
        if torch.equal(got, want):
            return
        bad = (got != want).any(dim=-1).nonzero()  # rows (kv, layer, i), in that order
        kv, layer, i = (int(v) for v in bad[bad[:, 2].argmin()])  # the earliest position
        pos = start_pos + i
        found = got[kv, layer, i, 0].item()
        note = " (poison: a leased slot nobody computed)" if found == POISON else (
            " (never written)" if not got[kv, layer, i].any() else "")
        raise AssertionError(
            f"wrong KV in {what}: token {int(tokens[pos])} at position {pos} (slot "
            f"{int(slots[i])}), layer {layer}, {'KV'[kv] if self._num_kv == 2 else 'latent'}: "
            f"got {found}, want {want[kv, layer, i, 0].item()}{note}; "
            f"{len(bad)} of {got.shape[0] * got.shape[1] * got.shape[2]} rows differ")

    def check_hit_shape(self, hit: FetchContext, tokens: Tokens) -> int:
        """Assert the context's cached prefix is well formed for `tokens`; return its length."""
        n = hit.num_cached_tokens
        assert n % self.page_size == 0, f"num_cached_tokens {n} is not whole pages"
        assert 0 <= n <= len(tokens), f"num_cached_tokens {n} > {len(tokens)} tokens"
        assert len(hit.device_indices) >= n, (
            f"{len(hit.device_indices)} device indices for {n} cached tokens")
        return n

    async def verify_prefix(self, hit: FetchContext,
                            tokens: Tokens | None = None) -> None:
        """Await ``hit.ready()``, then assert that ``device_indices[:num_cached_tokens]`` hold
        exactly the KV of ``tokens[:num_cached_tokens]`` (`tokens` defaults to the context's
        own; pass the request's to check those too)."""
        toks = hit.tokens if tokens is None else tokens
        await hit.ready()
        n = self.check_hit_shape(hit, toks)
        self.check_landed(hit.device_indices[:n])
        self.verify(hit.device_indices[:n], toks, 0, what="the cached prefix")

    def check_landed(self, slots: torch.Tensor) -> None:
        """Assert no load into `slots` is still copying: after ``ready()`` the KV is there.

        The KV check alone cannot always see a missed wait (a page reloaded into the slots it
        was evicted from still holds the right bytes, and the CPU engine's small copies finish
        quickly); a load whose copy has not finished is a missed wait whatever the bytes.
        """
        pages = set((slots[::self.page_size] // self.page_size).tolist())
        for node in self.cache.tree.iter_nodes():
            op = node.load_op
            if node.device_state is DeviceState.LOADING and isinstance(op, LoadJob) \
                    and node.device_pages is not None and not op.done() \
                    and pages.intersection(node.device_pages.tolist()):
                raise AssertionError(
                    f"ready() returned, but the load of device pages "
                    f"{sorted(pages.intersection(node.device_pages.tolist()))} of the cached "
                    f"prefix ({node!r}) is still copying")

    async def verify_after_commit(self, hit: FetchContext, tokens: Tokens,
                                  tail: torch.Tensor | None = None) -> None:
        """After ``hit.commit(tokens, ...)``: the whole pages of `tokens` are the cached
        prefix and hold their KV (after ``hit.ready()``), and `tail`, the slots of the partial
        last page if any, holds the KV of the tokens after them."""
        full = len(tokens) // self.page_size * self.page_size
        assert hit.num_cached_tokens == full, (
            f"after committing {len(tokens)} tokens, num_cached_tokens is "
            f"{hit.num_cached_tokens}, not {full}")
        await self.verify_prefix(hit, tokens)
        if tail is not None:
            assert len(tail) == len(tokens) - full, (
                f"{len(tail)} tail slots for {len(tokens) - full} tokens past the last page")
            self.verify(tail, tokens, full, what="the partial last page")
