"""Page keys: deterministic, prefix-closed, and different for every cache identity.

Keys name objects on disk and in Redis, so their format is part of the storage format: the
known-answer test below fails if it ever changes (bump the format version when it must).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiohicache import ConfigError
from aiohicache.storage import chain_keys, namespace_root
from aiohicache.storage._common import KEY_PATTERN, check_keys

IDENTITY: dict[str, Any] = {"namespace": "llama-3-8b", "spec_fingerprint": "mha-L32-8x128-bf16",
                            "page_size": 16, "layout": "page_first", "tp_rank": 0,
                            "tp_size": 1}
ROOT = namespace_root(**IDENTITY)


def tokens(num: int, *, start: int = 0) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.arange(start, start + num, dtype=np.int64)


def test_keys_are_deterministic_16_byte_digests_valid_as_storage_keys() -> None:
    keys = chain_keys(ROOT, tokens(64), 16)
    assert keys == chain_keys(ROOT, tokens(64), 16)
    assert len(keys) == 4 and all(len(key) == 16 for key in keys)
    assert all(KEY_PATTERN.fullmatch(key.hex()) for key in keys)
    assert len(set(keys)) == 4


def test_the_key_format_is_pinned() -> None:
    assert ROOT.hex() == "484073be939a560d241271951f6db0ab"
    assert [k.hex() for k in chain_keys(ROOT, tokens(32), 16)] == [
        "6d26c66410ca6c1f58fd8e4116d6572c", "5a8d6defbcd3c6143b6b0aadaec4b789"]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(page_size: int) -> None:
    full = chain_keys(ROOT, tokens(10 * page_size), page_size)
    for pages in range(11):
        assert chain_keys(ROOT, tokens(pages * page_size), page_size) == full[:pages]


def test_a_partial_last_page_has_no_key() -> None:
    assert chain_keys(ROOT, tokens(16 + 15), 16) == chain_keys(ROOT, tokens(16), 16)
    assert chain_keys(ROOT, tokens(15), 16) == []


def test_a_changed_token_changes_its_page_key_and_every_later_one() -> None:
    before = tokens(64)
    after = before.copy()
    after[20] = 999_999  # in page 1 of 4
    old, new = chain_keys(ROOT, before, 16), chain_keys(ROOT, after, 16)
    assert old[0] == new[0]
    assert all(o != n for o, n in zip(old[1:], new[1:], strict=True))


def test_chaining_continues_from_the_last_page_key() -> None:
    first = chain_keys(ROOT, tokens(32), 16)
    rest = chain_keys(first[-1], tokens(32, start=32), 16)
    assert first + rest == chain_keys(ROOT, tokens(64), 16)


def test_token_dtype_does_not_matter_only_values() -> None:
    as_int32 = np.arange(64, dtype=np.int32)
    assert chain_keys(ROOT, as_int32, 16) == chain_keys(ROOT, tokens(64), 16)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "other"), [
    ("namespace", "llama-3-70b"), ("spec_fingerprint", "mha-L32-8x128-fp8"),
    ("page_size", 32), ("layout", "layer_first"), ("tp_rank", 1), ("tp_size", 2),
])
def test_every_identity_field_changes_the_root_and_so_every_key(field: str,
                                                                other: object) -> None:
    root = namespace_root(**{**IDENTITY, field: other})
    assert root != ROOT
    assert set(chain_keys(root, tokens(64), 16)).isdisjoint(chain_keys(ROOT, tokens(64), 16))


GOOD = "0123456789abcdef"


@pytest.mark.parametrize("bad", [
    "0123456789abcde",  # 15 characters
    "0" * 129,
    "0123456789ABCDEF",  # upper case
    "0123456789abcdeg",
    "01234567\n9abcdef",
    "0123456789abcdé0",  # not ASCII
    b"0123456789abcdef",  # not a str
    None,
])
def test_check_keys_names_the_first_bad_key_of_a_batch(bad: object) -> None:
    with pytest.raises(ConfigError, match="16-128 lowercase hex") as info:
        check_keys([GOOD, GOOD * 8, bad, "x"])  # type: ignore[list-item]
    assert repr(bad) in str(info.value)


def test_check_keys_passes_valid_batches() -> None:
    check_keys([])
    check_keys([GOOD, GOOD * 8, "f" * 16, GOOD[::-1] * 3])
