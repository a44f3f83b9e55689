"""`KVOracle`: KV a test writes like a forward pass would, and checks on every hit.

The value a token gets, per layer and K/V (or MLA latent), is a code derived from the whole
prefix up to it and its position: the same token after another prefix, or at another
position, gets other KV, so a page served for the wrong prefix, at the wrong offset, from
the wrong layer, or half-loaded is caught. Codes are integers 0..250 (plus the column within
the row, mod 251): exact in float32, float16, bfloat16 and uint8.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from .. import FetchContext, HiCache

__all__ = ("KVOracle", "kv_code")

_EXACT = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_MOD = 251
_PRIME = np.uint64(0x100000001B3)


def kv_code(tokens: Sequence[int], num_rows: int) -> npt.NDArray[np.int64]:
    """``[num_rows, len(tokens)]`` codes 0..250: row ``r`` (a layer and K/V) of token ``i``
    hashes ``tokens[:i + 1]`` (order included) with ``i`` and ``r``. Wrapping uint64
    arithmetic, vectorized."""
    ids = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        weights = np.cumprod(np.full(len(ids), _PRIME, dtype=np.uint64))
        prefix = np.cumsum((ids + np.uint64(1)) * weights, dtype=np.uint64)
        base = _scramble(prefix ^ np.arange(len(ids), dtype=np.uint64) * np.uint64(0x9E37))
        rows = np.arange(1, num_rows + 1, dtype=np.uint64)[:, None] * np.uint64(0xC2B2AE35)
        return (_scramble(base[None, :] + rows) % np.uint64(_MOD)).astype(np.int64)


def _scramble(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """murmur3's 64-bit finalizer."""
    x = (x ^ (x >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
    x = (x ^ (x >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


class KVOracle:
    """Writes and checks prefix-dependent KV in one cache's device pool.

        kv = KVOracle(cache)
        hit = await kv.prefill(tokens)     # fetch, check the hit, compute the rest, commit

    Args:
        cache: an open cache with a dtype that holds 0..255 exactly.
    """

    def __init__(self, cache: HiCache) -> None:
        spec = cache.config.spec
        if spec.dtype not in _EXACT:
            raise ValueError(f"KVOracle needs float32/16, bfloat16 or uint8 KV, not "
                             f"{spec.dtype}")
        self.cache = cache
        self.hits_checked = 0
        """Cached tokens whose KV was checked, over all `prefill` calls."""
        pool = cache.device_pool
        self._buffers = [pool.kv_buffer(layer) for layer in range(spec.num_layers)] \
            if spec.kind == "mla" else \
            [buf(layer) for layer in range(spec.num_layers) for buf in (pool.k_buffer,
                                                                        pool.v_buffer)]

    def expected(self, tokens: Sequence[int], start: int, num: int) -> list[torch.Tensor]:
        """The KV of ``tokens[start:start + num]``, one ``[num, *row]`` tensor per buffer.

        Raises:
            ValueError: `tokens` end before ``start + num``.
        """
        if not 0 <= start <= start + num <= len(tokens):  # else a reshape's shape error
            raise ValueError(f"tokens: {len(tokens)} of them, {num} slots from position "
                             f"{start} need {start + num}")
        codes = torch.from_numpy(kv_code(tokens[:start + num], len(self._buffers))[:, start:])
        out = []
        for row_codes, buf in zip(codes, self._buffers, strict=True):
            width = buf[0].numel()
            values = (row_codes[:, None] + torch.arange(width)) % _MOD
            out.append(values.view(num, *buf.shape[1:]).to(buf.dtype))
        return out

    def fill(self, slots: torch.Tensor, tokens: Sequence[int], start: int = 0) -> None:
        """Write the KV a forward pass computes for ``tokens[start:start + len(slots)]``."""
        for buf, values in zip(self._buffers, self.expected(tokens, start, len(slots)),
                               strict=True):
            buf[slots.to(buf.device)] = values.to(buf.device)

    def verify(self, slots: torch.Tensor, tokens: Sequence[int], start: int = 0) -> None:
        """Assert `slots` hold the KV of ``tokens[start:start + len(slots)]``.

        Raises:
            AssertionError: naming the first position, slot and buffer that differ.
        """
        if not len(slots):
            return
        for b, (buf, want) in enumerate(zip(self._buffers, self.expected(
                tokens, start, len(slots)), strict=True)):
            got = buf[slots.to(buf.device)].cpu()
            bad = (got != want).reshape(len(slots), -1).any(dim=1).nonzero()
            if len(bad):
                i = int(bad[0])
                raise AssertionError(
                    f"wrong KV at position {start + i} (token {int(tokens[start + i])}, slot "
                    f"{int(slots[i])}) in {self._name(b)}; {len(bad)} of {len(slots)} "
                    f"tokens differ")

    async def check_hit(self, hit: FetchContext, tokens: Sequence[int]) -> int:
        """Await ``hit.ready()``, then assert its cached prefix holds the KV of `tokens`;
        return the cached token count."""
        await hit.ready()
        n = hit.num_cached_tokens
        self.verify(hit.device_indices[:n], tokens)
        self.hits_checked += n
        return n

    async def prefill(self, tokens: Sequence[int]) -> int:
        """One request as a model runs it: fetch `tokens`, check every cached token, write
        the KV of the rest into leased slots, commit. Returns the cached token count."""
        async with self.cache.fetch(list(tokens)) as hit:
            cached = await self.check_hit(hit, tokens)
            if cached < len(tokens):
                slots = await hit.allocate(len(tokens) - cached)
                self.fill(slots, tokens, cached)
                await hit.commit(list(tokens), slots)
        return cached

    def _name(self, index: int) -> str:
        if self.cache.config.spec.kind == "mla":
            return f"layer {index} (latent)"
        return f"layer {index // 2} {'KV'[index % 2]}"
