"""The token comparisons the tree's hot path uses agree with their plain definitions.

`common_tokens` finds the first mismatch from one compare pass and a count (no second
search); `same_tokens` counts differences instead of calling ``.all()``. Both must give what
the element-by-element definition gives, at every length and mismatch position.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiohicache.radix._results import common_tokens, same_tokens


def _naive_common(key: list[int], tokens: list[int], pos: int, end: int | None) -> int:
    stop = len(tokens) if end is None else end
    n = 0
    while n < len(key) and pos + n < stop and key[n] == tokens[pos + n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(20))
def test_common_tokens_is_the_length_of_the_shared_run(seed: int) -> None:
    """For random keys and token runs (equal, diverging anywhere, shorter or longer than the
    key, with and without `end`), `common_tokens` is the number of leading equal tokens."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        key = rng.integers(0, 4, int(rng.integers(1, 40)), dtype=np.int64)
        pos = int(rng.integers(0, 5))
        tokens = np.concatenate([rng.integers(0, 4, pos), key[:int(rng.integers(0, 45))],
                                 rng.integers(0, 4, int(rng.integers(0, 5)))]).astype(np.int64)
        if pos >= len(tokens):
            continue
        end = None if rng.random() < 0.5 else int(rng.integers(pos, len(tokens) + 1))
        assert common_tokens(key, tokens, pos, end) == _naive_common(
            key.tolist(), tokens.tolist(), pos, end)


def test_common_tokens_full_match_and_first_token_mismatch() -> None:
    """A key repeated whole counts all of it; a mismatch at the first token counts zero."""
    key = np.arange(32, dtype=np.int64)
    assert common_tokens(key, np.arange(64, dtype=np.int64), 0) == 32
    assert common_tokens(key, np.arange(1, 33, dtype=np.int64), 0) == 0
    assert common_tokens(key, np.arange(20, dtype=np.int64), 0) == 20  # tokens run out


@pytest.mark.parametrize(("a", "b", "same"), [
    ([], [], True), ([1], [1], True), ([1, 2, 3], [1, 2, 3], True), ([1, 2, 3], [1, 2, 4], False),
    ([1, 2, 3], [1, 2], False), ([9, 2, 3], [1, 2, 3], False)])
def test_same_tokens_is_equal_length_and_contents(a: list[int], b: list[int], same: bool) -> None:
    """Equal length and equal tokens, nothing else; a Python bool, as before."""
    assert same_tokens(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) is same
