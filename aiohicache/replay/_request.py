"""`Request`: one request of a trace, its prompt named by block hash ids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._fields import check

_MAX_TOKEN = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: a prompt named by block hash ids, and its timing.

    Block hash id ``h`` stands for the tokens ``h * block_size + arange(block_size)``, so
    equal ids mean equal content and prompts share a prefix exactly as far as their id lists
    agree. The last block may be partial: ``input_length`` is exact.

    Raises:
        ConfigError: a field is out of range, or ``input_length`` does not fit the blocks.
    """

    arrival: float
    """Seconds since the start of the trace."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Tokens the request decodes."""
    block_size: int
    """Tokens per hash id."""
    hash_ids: tuple[int, ...]
    """One id per block of the prompt, the last one possibly partial."""
    session: str | None = None
    """The conversation or agent session the request belongs to, where the trace says."""

    def __post_init__(self) -> None:
        check(math.isfinite(self.arrival) and self.arrival >= 0,
              f"arrival must be a finite number >= 0, got {self.arrival!r}")
        check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        check(self.output_length >= 0, f"output_length must be >= 0, got {self.output_length}")
        check(self.input_length >= 1, f"input_length must be >= 1, got {self.input_length}")
        self._check_blocks()

    def _check_blocks(self) -> None:
        num, size = len(self.hash_ids), self.block_size
        check((num - 1) * size < self.input_length <= num * size,
              f"input_length={self.input_length} does not fit {num} hash_ids of {size} "
              f"tokens (expected {(num - 1) * size + 1}..{num * size})")
        check(min(self.hash_ids) >= 0, "hash_ids must be >= 0")
        check(max(self.hash_ids) <= (_MAX_TOKEN - size) // size,
              "hash_ids too large: token ids would overflow int64")

    @property
    def num_full_blocks(self) -> int:
        """Blocks of the prompt that are whole (a partial last block is not counted)."""
        return self.input_length // self.block_size

    def tokens(self) -> npt.NDArray[np.int64]:
        """The prompt's token ids, a new int64 array of ``input_length`` entries."""
        # Token i is hash_ids[b] * block_size + i % block_size with b = i // block_size,
        # that is (hash_ids[b] - b) * block_size + i: one repeat and one add, which beats a
        # broadcast (blocks x block_size) add by about a third.
        num_blocks, size = len(self.hash_ids), self.block_size
        shift = np.array(self.hash_ids, dtype=np.int64)
        shift -= _arange(num_blocks)
        shift *= size
        tokens = np.repeat(shift, size)[:self.input_length]
        tokens += _arange(self.input_length)
        return tokens


_ARANGE: npt.NDArray[np.int64] = np.arange(0, dtype=np.int64)


def _arange(n: int) -> npt.NDArray[np.int64]:
    """A read-only view of ``arange(n)``, from a shared array grown by doubling."""
    global _ARANGE
    if len(_ARANGE) < n:
        grown = np.arange(max(n, 2 * len(_ARANGE), 1 << 16), dtype=np.int64)
        grown.flags.writeable = False
        _ARANGE = grown
    return _ARANGE[:n]
