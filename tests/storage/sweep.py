"""What the cancellation sweeps of the stores share: the pages stored before a swept call,
the call itself, and the check of every page after it (tests/test_cancel_sweep_review2.py,
tests/storage/test_cancel_sweep_cluster_review.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiohicache.storage import StorageBackend
from tests.test_cancel_sweep_review import How, Outcome, run_cancelled_at

from .conftest import FMT, SENTINEL, make_keys, make_page, page_views, read_pages

OLD = make_keys(6, seed=31)
"""Stored (version 0) before the swept call; it overwrites, deletes or reads the first
three, never touches the last three."""
NEW = make_keys(5, seed=32)
"""Absent before the swept call; `set_from` writes them (version 1)."""
TOUCHED, UNTOUCHED = OLD[:3], OLD[3:]


def new_pages(keys: list[str]) -> list[memoryview]:
    return [memoryview(make_page(key, version=1)) for key in keys]


def swept_call(op: str, backend: StorageBackend, buffers: list[bytearray],
               ) -> Coroutine[Any, Any, Any]:
    if op == "set_from":
        return backend.set_from([*TOUCHED, *NEW], new_pages([*TOUCHED, *NEW]))
    if op == "get_into":
        return backend.get_into([*OLD, *NEW], [memoryview(b) for b in buffers])
    if op == "exists":
        return backend.exists([*OLD, *NEW])
    if op == "delete":
        return backend.delete(TOUCHED)
    return backend.aclose()


async def assert_pages_whole_or_missed(backend: StorageBackend, op: str, where: str) -> None:
    """Every page reads back as one of the versions written under its key, or misses
    (only where the swept call may have removed it): never torn, never another key's."""
    got = dict(zip([*OLD, *NEW], await read_pages(backend, [*OLD, *NEW]), strict=True))
    for key, page in got.items():
        versions = {0} if key in OLD else set()
        if op == "set_from" and key in [*TOUCHED, *NEW]:
            versions.add(1)
        may_miss = (op == "delete" and key in TOUCHED) or (op == "set_from" and key in NEW)
        if page is None:
            assert may_miss or not versions, f"{where}: {key[:8]} lost"
        else:
            assert page in {make_page(key, version=v) for v in versions}, \
                f"{where}: {key[:8]} reads a page never written under it"
    assert backend.stats().corrupt == 0, f"{where}: torn or misplaced objects"


def cancelled_or_done(outcome: Outcome, where: str) -> None:
    assert outcome.result in ("cancelled", "completed"), \
        f"{where}: {outcome.result}: {outcome.error!r}"


async def cancel_and_check(backend: StorageBackend, op: str, at: int | None, how: How,
                           where: str, *, settle: float) -> Outcome:
    """Store `OLD`, run `op` on `backend` cancelled at `at` (see `run_cancelled_at`), then
    check that it was cancelled or done, wrote no buffer in the `settle` seconds after, and
    (unless it closed the backend) left every page whole or missed."""
    buffers = [bytearray([SENTINEL]) * FMT.payload_bytes for _ in [*OLD, *NEW]]
    assert await backend.set_from(OLD, page_views(OLD)) == [True] * len(OLD)
    outcome = await run_cancelled_at(swept_call(op, backend, buffers), at, how)
    cancelled_or_done(outcome, where)
    seen = [bytes(b) for b in buffers]
    await asyncio.sleep(settle)  # a copy still running would land now
    assert [bytes(b) for b in buffers] == seen, f"{where}: written after the call"
    if op != "aclose":
        await assert_pages_whole_or_missed(backend, op, where)
    return outcome
