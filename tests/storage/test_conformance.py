"""What every `StorageBackend` must do: the L3 contract, as tests.

Each test runs on every backend in `conftest.BACKENDS`, clean and wrapped in a
`FaultyBackend`. Clean, results are exact. Faulty, only correct-or-miss is asked: a call may
raise `StorageError` or report False, but a page reported read holds exactly the bytes that
were written (`Case.get` checks it on every read). A buffer whose read was not reported is
not used: it may hold a rejected object's bytes, but an absent key's buffer is untouched.
`case.store.backend` is never faulty: tests set up and inspect through it.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest
import xxhash

from aiohicache import ClosedError, ConfigError
from aiohicache.storage import PageFormat, StorageBackend, encode_header
from aiohicache.storage.base import HEADER_SIZE

from .conftest import FMT, PAYLOAD, SENTINEL, Case, OpenCase, make_keys, make_page


def pages_of(keys: list[str], *, version: int = 0) -> list[bytes]:
    return [make_page(key, version=version) for key in keys]


async def setup(case: Case, keys: list[str], *, version: int = 0) -> None:
    """Store pages for `keys` directly (never faulty)."""
    await case.set(keys, pages_of(keys, version=version), via=case.store.backend)


def assert_correct_or_miss(case: Case, keys: list[str], got: list[bytes | None], *,
                           version: int = 0) -> None:
    """Every page read is the one written; clean, every page was read."""
    for key, page in zip(keys, got, strict=True):
        assert page is None or page == make_page(key, version=version), f"wrong KV for {key}"
    if not case.faulty:
        assert None not in got


# ---------------------------------------------------------------------------- reads and writes

async def test_round_trip_is_bit_exact(case: Case) -> None:
    keys = make_keys(16)
    stored = await case.set(keys, pages_of(keys))
    # What landed is whole: read back without faults, each key is exact, or absent where
    # its write failed.
    landed = await case.get(keys, via=case.store.backend)
    for key, ok, page in zip(keys, stored, landed, strict=True):
        assert page in ((make_page(key),) if ok else (None, make_page(key)))
    assert_correct_or_miss(case, keys, await case.get(keys))


async def test_exists_counts_leading_hits_and_stops_at_the_first_miss(case: Case) -> None:
    keys = make_keys(8)
    await setup(case, keys[:3] + keys[4:6])  # keys[3] is the hole
    found = await case.exists(keys)
    if not case.faulty:
        assert found == 3
    assert found is None or found <= 3
    assert await case.exists(keys[4:]) in ((2,) if not case.faulty else (None, 0, 1, 2))
    assert await case.exists([]) in ((0,) if not case.faulty else (None, 0))


async def test_get_of_absent_keys_misses_and_leaves_buffers_untouched(case: Case) -> None:
    keys = make_keys(4)
    buffers = [bytearray([SENTINEL]) * PAYLOAD for _ in keys]
    hits = await case.guard(case.backend.get_into(keys, [memoryview(b) for b in buffers]),
                            [False] * 4)
    assert hits == [False] * 4
    assert buffers == [bytearray([SENTINEL]) * PAYLOAD] * 4
    stats = case.store.backend.stats()
    assert stats.pages_read == 0
    if not case.faulty:
        assert stats.misses == 4


async def test_a_batch_may_partly_hit(case: Case) -> None:
    keys = make_keys(6)
    await setup(case, keys[::2])
    got = await case.get(keys)
    assert all(page is None for page in got[1::2])
    assert_correct_or_miss(case, keys[::2], got[::2])


async def test_overwrite_replaces_the_object(case: Case) -> None:
    keys = make_keys(3)
    await setup(case, keys)
    stored = await case.set(keys, pages_of(keys, version=1))
    landed = await case.get(keys, via=case.store.backend)
    for key, ok, page in zip(keys, stored, landed, strict=True):
        new, old = make_page(key, version=1), make_page(key)
        assert page in ((new,) if ok else (new, old))


async def test_empty_batches_do_nothing(case: Case) -> None:
    backend = case.store.backend
    assert await backend.exists([]) == 0
    assert await backend.get_into([], []) == []
    assert await backend.set_from([], []) == []
    assert await backend.delete([]) == 0


async def test_stats_count_pages_and_bytes(case: Case) -> None:
    if case.faulty:
        pytest.skip("counts are exact only without faults")
    keys = make_keys(5)
    await case.set(keys[:3], pages_of(keys[:3]))
    await case.get(keys)
    await case.exists(keys)
    stats = case.backend.stats()
    assert (stats.pages_written, stats.bytes_written) == (3, 3 * PAYLOAD)
    assert (stats.pages_read, stats.bytes_read, stats.misses) == (3, 3 * PAYLOAD, 2)
    assert (stats.exists_calls, stats.corrupt, stats.errors) == (1, 0, 0)


async def test_stats_report_the_budget_and_the_bytes_held(open_case: OpenCase) -> None:
    size = HEADER_SIZE + PAYLOAD
    keys = make_keys(3)
    for budget in (8 * size, None):
        async with open_case(capacity_bytes=budget) as case:
            await setup(case, keys)
            for stats in (case.store.backend.stats(), case.backend.stats()):
                if case.store.has_capacity:
                    assert (stats.capacity_bytes, stats.used_bytes) == (budget, 3 * size)
                else:  # the server's own budget: maxmemory (none on the test servers)
                    assert stats.capacity_bytes is None
                    assert stats.used_bytes is not None and stats.used_bytes > 0


# ---------------------------------------------------------------------------- integrity

async def test_a_corrupted_object_is_a_counted_miss_and_is_removed(case: Case) -> None:
    keys = make_keys(3)
    await setup(case, keys)
    await case.store.corrupt(keys[1])
    got = await case.get(keys)
    assert got[1] is None
    assert_correct_or_miss(case, keys[::2], got[::2])
    if case.faulty:
        return
    assert case.backend.stats().corrupt == 1
    assert await case.exists(keys) == 1  # removed: exists no longer counts a page it can't serve
    await case.set(keys[1:2], pages_of(keys[1:2]))  # the next write repairs it
    assert await case.get(keys[1:2]) == [make_page(keys[1])]


async def test_an_object_renamed_or_copied_to_another_key_is_a_counted_miss(
        case: Case) -> None:
    # NOTE: storage binds no object to its name (a file copied or renamed, Redis RENAME or
    # COPY); served unchecked, such an object is one prefix's KV for another's tokens.
    a, b, c, d = keys = make_keys(4)
    await setup(case, keys)
    await _swap(case, a, b)
    await case.store.copy_raw(c, d)  # d holds c's object; c keeps its own
    got = await case.get(keys)
    assert got[0] is None and got[1] is None and got[3] is None, "another key's page served"
    assert_correct_or_miss(case, [c], got[2:3])
    if case.faulty:
        return
    assert case.backend.stats().corrupt == 3
    assert await case.get([a, b, d]) == [None] * 3  # removed: no longer there to reject
    await case.set(keys, pages_of(keys))  # the next backup repairs them
    assert await case.get(keys) == pages_of(keys)


async def _swap(case: Case, a: str, b: str) -> None:
    """Swap the stored objects of `a` and `b` behind the backend's back (three renames)."""
    [spare] = make_keys(1, seed=77)
    await case.store.rename_raw(a, spare)
    await case.store.rename_raw(b, a)
    await case.store.rename_raw(spare, b)


def _forgeries(key: str) -> dict[str, bytes]:
    page = make_page(key)
    other_ns = PageFormat.make(namespace="other-model", spec_fingerprint="mha-L2-2x8-bf16",
                               page_size=4, payload_bytes=PAYLOAD)
    other_spec = PageFormat.make(namespace="conformance", spec_fingerprint="mha-L2-2x8-fp8",
                                 page_size=4, payload_bytes=PAYLOAD)
    other_page = PageFormat.make(namespace="conformance", spec_fingerprint="mha-L2-2x8-bf16",
                                 page_size=8, payload_bytes=PAYLOAD)
    longer = PageFormat(FMT.namespace_id, FMT.spec_id, PAYLOAD + 1)
    good = encode_header(FMT, key, page) + page
    return {
        "other namespace": encode_header(other_ns, key, page) + page,
        "other spec": encode_header(other_spec, key, page) + page,
        "other page size": encode_header(other_page, key, page) + page,
        "other payload size": encode_header(longer, key, page + b"\0") + page + b"\0",
        "other key": encode_header(FMT, make_keys(1, seed=5)[0], page) + page,
        "format version 1 (no key)": _version_1_header(page) + page,
        "truncated": good[:-1],
        "extended": good + b"\0",
        "header only": good[:HEADER_SIZE],
        "bad magic": b"XXXX" + good[4:],
        "empty": b"",
    }


def _version_1_header(page: bytes) -> bytes:
    """The header of format version 1, which bound no key: what a store may still hold."""
    return struct.pack("<4sHH16s16sQQQ", b"AHKV", 1, HEADER_SIZE, FMT.namespace_id,
                       FMT.spec_id, len(page), xxhash.xxh3_64_intdigest(page), 0)


async def test_an_object_of_another_format_or_shape_is_a_miss(case: Case) -> None:
    keys = make_keys(11)
    forged = [_forgeries(key) for key in keys]
    kinds = list(forged[0])
    for key, kind, table in zip(keys, kinds, forged, strict=True):
        await case.store.put_raw(key, table[kind])
    assert await case.get(keys) == [None] * len(keys), kinds
    if not case.faulty:
        assert case.backend.stats().corrupt == len(keys)


# ---------------------------------------------------------------------------- delete

async def test_delete_removes_and_counts_what_existed(case: Case) -> None:
    keys = make_keys(4)
    await setup(case, keys[:3])
    removed = await case.guard(case.backend.delete(keys[1:]), None)  # keys[3]: never stored
    if not case.faulty:
        assert removed == 2
        assert case.backend.stats().pages_deleted == 2
    if removed is not None:
        assert await case.get(keys[1:3], via=case.store.backend) == [None, None]
    assert await case.get(keys[:1], via=case.store.backend) == [make_page(keys[0])]


# ---------------------------------------------------------------------------- concurrency

async def test_concurrent_batches_keep_every_page_whole(case: Case) -> None:
    shared = make_keys(8, seed=99)  # every writer also writes these (the same bytes)
    batches = [make_keys(16, seed=seed) + shared for seed in range(8)]

    async def writer_then_reader(keys: list[str]) -> None:
        await case.set(keys, pages_of(keys))
        assert_correct_or_miss(case, keys, await case.get(keys))

    async with asyncio.TaskGroup() as tg:
        for keys in batches:
            tg.create_task(writer_then_reader(keys))


async def test_cancelling_a_write_mid_batch_leaves_whole_objects_or_none(
        open_case: OpenCase) -> None:
    keys = make_keys(32)
    async with open_case(latency=(0.0, 0.2)) as case:
        with anyio.move_on_after(0.01) as scope:
            await case.backend.set_from(keys, [memoryview(p) for p in pages_of(keys)])
        assert scope.cancelled_caught
        # NOTE: the direct read, not the faulty one: what is on storage must be whole.
        landed = await case.get(keys, via=case.store.backend)
        assert any(page is None for page in landed), "the batch finished before the cancel"
        for key, page in zip(keys, landed, strict=True):
            assert page in (None, make_page(key)), f"torn object under {key}"


@pytest.mark.parametrize("how", ["task.cancel", "asyncio.timeout", "anyio.CancelScope"])
async def test_cancelling_a_read_mid_batch_writes_no_buffer(open_case: OpenCase,
                                                           how: str) -> None:
    keys = make_keys(32)
    buffers = [bytearray([SENTINEL]) * PAYLOAD for _ in keys]
    async with open_case(latency=(0.0, 0.2)) as case:
        await setup(case, keys)
        read = case.backend.get_into(keys, [memoryview(b) for b in buffers])
        await _cancel_after(read, 0.01, how)
        assert all(buf == bytearray([SENTINEL]) * PAYLOAD for buf in buffers)
        # and the storage is as it was
        assert await case.get(keys, via=case.store.backend) == pages_of(keys)


async def _cancel_after(call: Awaitable[Any], delay: float, how: str) -> None:
    """Start `call`, cancel it after `delay` seconds the way `how` says; the cancellation must
    reach the call (it must not finish first)."""
    if how == "task.cancel":
        task = asyncio.ensure_future(call)
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    elif how == "asyncio.timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(delay):
                await call
    else:
        with anyio.move_on_after(delay) as scope:
            await call
        assert scope.cancelled_caught


# ---------------------------------------------------------------------------- persistence, budget

async def test_a_second_instance_serves_what_the_first_stored(case: Case) -> None:
    if case.store.reopen is None:
        pytest.skip("this backend's storage does not outlive the instance")
    keys = make_keys(8)
    stored = await case.set(keys, pages_of(keys))
    async with case.store.reopen() as second:
        assert await second.exists(keys) >= [*stored, False].index(False)
        got = await case.get(keys, via=second)
    for key, ok, page in zip(keys, stored, got, strict=True):
        assert page in ((make_page(key),) if ok else (None, make_page(key)))


async def test_the_budget_evicts_the_least_recently_used(open_case: OpenCase) -> None:
    keys = make_keys(5)
    async with open_case(capacity_bytes=4 * (HEADER_SIZE + PAYLOAD)) as case:
        if not case.store.has_capacity:
            pytest.skip("this backend has no byte budget")
        for key in keys[:4]:
            await case.set([key], [make_page(key)])
        await case.get(keys[:1])  # keys[0] is now the most recently used
        await case.set(keys[4:], pages_of(keys[4:]))  # evicts keys[1]
        await _expect_evicted(case, keys, [1])


async def test_a_batch_is_evicted_from_its_tail(open_case: OpenCase) -> None:
    keys = make_keys(6)
    async with open_case(capacity_bytes=4 * (HEADER_SIZE + PAYLOAD)) as case:
        if not case.store.has_capacity:
            pytest.skip("this backend has no byte budget")
        await case.set(keys[:4], pages_of(keys[:4]))  # one prefix chain: keys[3] is its tail
        await case.set(keys[4:5], pages_of(keys[4:5]))  # evicts keys[3]
        await case.get(keys[:2])  # reads too: keys[0] the most recent, then keys[1]; keys[2]
        #                           is now the oldest (then keys[4])
        await case.set(keys[5:], pages_of(keys[5:]))  # evicts keys[2]
        await _expect_evicted(case, keys, [2, 3])


async def _expect_evicted(case: Case, keys: list[str], evicted: list[int]) -> None:
    """Exactly `evicted` are gone (clean); faulty: at most the budget is held, all correct."""
    got = await case.get(keys, via=case.store.backend)
    assert sum(page is not None for page in got) <= 4
    assert all(page in (None, make_page(k)) for k, page in zip(keys, got, strict=True))
    if not case.faulty:
        assert [i for i, page in enumerate(got) if page is None] == evicted
        assert case.backend.stats().evicted_pages == len(evicted)


async def test_an_object_larger_than_the_budget_is_not_stored(open_case: OpenCase) -> None:
    async with open_case(capacity_bytes=HEADER_SIZE + PAYLOAD - 1) as case:
        if not case.store.has_capacity:
            pytest.skip("this backend has no byte budget")
        keys = make_keys(1)
        assert await case.store.backend.set_from(keys, [memoryview(make_page(keys[0]))]) \
            == [False]
        assert await case.get(keys) == [None]


# ---------------------------------------------------------------------------- misuse

BAD_KEYS = ["../../etc/passwd", "0123456789ABCDEF", "0123456789abcdeg", "abc", "a" * 129,
            "0123456789abcdef\n", "0123456789abcdef/x", "", 1234]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
async def test_a_bad_key_raises_config_error_naming_it(case: Case, bad: Any) -> None:
    keys = [*make_keys(1), bad]
    buffers = [memoryview(bytearray(PAYLOAD)) for _ in keys]
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: case.backend.exists(keys), lambda: case.backend.get_into(keys, buffers),
        lambda: case.backend.set_from(keys, buffers), lambda: case.backend.delete(keys)]
    for call in calls:
        with pytest.raises(ConfigError, match="key") as info:
            await call()
        assert repr(bad) in str(info.value)
    assert await case.exists(make_keys(1)) in (0, None)  # nothing was written


async def test_buffers_must_match_keys_and_page_size(case: Case) -> None:
    keys = make_keys(2)
    page = memoryview(bytearray(PAYLOAD))
    for buffers in ([page], [page, memoryview(bytearray(PAYLOAD - 1))]):
        for call in (case.backend.get_into, case.backend.set_from):
            with pytest.raises(ConfigError, match="buffers"):
                await call(keys, buffers)


async def test_buffers_to_fill_must_not_overlap(case: Case) -> None:
    keys = make_keys(3)
    await case.set(keys, [make_page(k) for k in keys], via=case.store.backend)
    block = bytearray(3 * PAYLOAD)
    whole = memoryview(block)
    for overlapping in ([whole[:PAYLOAD], whole[PAYLOAD:2 * PAYLOAD], whole[:PAYLOAD]],
                        [whole[:PAYLOAD], whole[PAYLOAD:2 * PAYLOAD], whole[1:PAYLOAD + 1]]):
        with pytest.raises(ConfigError, match="buffers: 0 and 2 overlap"):
            await case.backend.get_into(keys, overlapping)
        assert block == bytearray(3 * PAYLOAD)  # nothing was read
    # adjacent is not overlapping, and writes may share a source
    assert await case.get(keys, via=case.store.backend) == [make_page(k) for k in keys]
    await case.set(keys[1:], [make_page(keys[0])] * 2, via=case.store.backend)


@pytest.mark.parametrize("what", ["strided", "fortran-order", "not a buffer"])
async def test_buffers_must_be_contiguous_byte_buffers(case: Case, what: str) -> None:
    keys = make_keys(2)
    bad: object = {"strided": memoryview(bytearray(2 * PAYLOAD))[::2],
                   "fortran-order": memoryview(np.zeros((PAYLOAD // 4, 4), np.uint8,
                                                        order="F")),
                   "not a buffer": [0] * PAYLOAD}[what]
    good = memoryview(bytearray(PAYLOAD))
    for call in (case.backend.get_into, case.backend.set_from):
        with pytest.raises(ConfigError, match=r"buffers\[1\]: must be a C-contiguous"):
            await call(keys, [good, bad])  # type: ignore[list-item]


async def test_buffers_to_fill_must_be_writable(case: Case) -> None:
    """A read-only buffer is bad input, not a failing disk (no error counted)."""
    keys = make_keys(2)
    await setup(case, keys)
    errors = case.store.backend.stats().errors
    with pytest.raises(ConfigError, match=r"buffers\[1\]: is read-only"):
        await case.backend.get_into(keys, [memoryview(bytearray(PAYLOAD)),
                                           memoryview(bytes(PAYLOAD))])
    assert case.store.backend.stats().errors == errors


async def test_a_key_twice_in_one_write_keeps_its_last_buffer(case: Case) -> None:
    """As a dict (and Redis) would: here, in another instance and after a restart alike."""
    keys = make_keys(3)
    twice = [keys[0], keys[1], keys[0], keys[2]]
    pages = [make_page(keys[0]), make_page(keys[1]), make_page(keys[0], version=1),
             make_page(keys[2])]
    assert await case.set(twice, pages, via=case.store.backend) == [True] * 4
    want = [make_page(keys[0], version=1), make_page(keys[1]), make_page(keys[2])]
    assert await case.get(keys, via=case.store.backend) == want
    if case.store.reopen is not None:
        async with case.store.reopen() as second:
            assert await case.get(keys, via=second) == want


async def test_a_closed_backend_raises_closed_error(case: Case) -> None:
    backend: StorageBackend = case.store.backend
    await backend.aclose()
    await backend.aclose()  # idempotent
    keys = make_keys(1)
    page = [memoryview(bytearray(PAYLOAD))]
    for call in (lambda: backend.exists(keys), lambda: backend.get_into(keys, page),
                 lambda: backend.set_from(keys, page), lambda: backend.delete(keys)):
        with pytest.raises(ClosedError):
            await call()
