"""The cancellation sweep on `RedisClusterBackend`: `set_from`, `get_into`, `exists`,
`delete`, `aclose` (and entering the backend) cancelled at each await point (``Task.cancel``,
an anyio cancel scope, an expiring ``asyncio.timeout``; see `run_cancelled_at` in
``tests/test_cancel_sweep_review.py``), on a healthy cluster and on one with a primary hung
(SIGSTOP: its circuit opens, probes, is cancelled mid-probe). After each cancelled call:

- every page reads back as written or misses (never another key's page, never torn), on
  the same backend and on a new one;
- every node's semaphore (`max_connections` per node) is whole again, and as many calls at
  once as it allows all complete;
- no circuit is left probing: once the hung node answers, a call after the cool-down
  reaches it and serves its pages;
- once the backend is closed, no node holds a connection more than before.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Literal

import anyio
import pytest
from redis.asyncio import Redis

from aiohicache._redis_server import LocalCluster
from aiohicache.storage.redis import RedisClusterBackend
from tests.test_cancel_sweep_review import Outcome, run_cancelled_at

from .conftest import FMT, SENTINEL, make_page, page_views, read_pages
from .redis_server import running_cluster, shared_cluster
from .sweep import (
    NEW,
    OLD,
    UNTOUCHED,
    assert_pages_whole_or_missed,
    cancel_and_check,
    cancelled_or_done,
    swept_call,
)

How = Literal["task", "scope", "timeout"]
LIMIT = 2
"""`max_connections` per node here: few, so a slot not given back shows."""
POINTS = 12
"""Await points swept per call at most (spread over the whole call)."""


def spread(count: int, *, first: int = 1) -> list[int]:
    """At most `POINTS` of the await points ``first..count``, spread evenly, both ends in."""
    points = list(range(first, count + 1))
    if len(points) <= POINTS:
        return points
    step = (len(points) - 1) / (POINTS - 1)
    return sorted({points[round(i * step)] for i in range(POINTS)})


def backend_of(url: str, prefix: str, **options: Any) -> RedisClusterBackend:
    """In batches of two pages (so each call suspends often), `LIMIT` connections a node."""
    return RedisClusterBackend(url, FMT, key_prefix=prefix, max_batch=2, inline_bytes=0,
                               max_connections=LIMIT, **options)


async def node_clients(cluster: LocalCluster) -> dict[int, int]:
    """The clients connected to each node (this look's own connection not counted)."""
    counts = {}
    for node in cluster.nodes:
        async with Redis(host="127.0.0.1", port=node.port, socket_timeout=5) as raw:
            counts[node.port] = len(await raw.client_list()) - 1
    return counts


def assert_slots_whole(backend: RedisClusterBackend, where: str) -> None:
    """Every node's `max_connections` semaphore has all its slots back."""
    taken = {name: LIMIT - sem.value for name, sem in backend._node_slots.items()
             if sem.value != LIMIT}
    assert not taken, f"{where}: node slots never given back: {taken}"


async def assert_serves_at_full_width(backend: RedisClusterBackend, where: str) -> None:
    """`LIMIT` reads at once, twice over, all complete (a slot never given back hangs
    them), each page right."""
    with anyio.fail_after(10):
        for _ in range(2):
            async with anyio.create_task_group() as tg:
                for _ in range(LIMIT):
                    tg.start_soon(read_pages, backend, UNTOUCHED)
    assert await read_pages(backend, UNTOUCHED) == [make_page(k) for k in UNTOUCHED], where


# ------------------------------------------------------------------------------ healthy

@pytest.mark.parametrize("how", ["task", "scope", "timeout"])
@pytest.mark.parametrize("op", ["set_from", "get_into", "exists", "delete", "aclose"])
async def test_a_call_cancelled_anywhere_leaves_pages_whole_and_nothing_held(
        op: str, how: How) -> None:
    """A call on a healthy cluster cancelled at each await point: no buffer is written
    after it ended, each page reads as written or misses (here and on a new backend), every
    node's slots are given back and `LIMIT` calls at once are served; once closed, no node
    holds more connections than before."""
    cluster = shared_cluster()

    async def run(at: int | None) -> Outcome:
        where = f"{op}, {how} cancel at {at}"
        prefix = f"csweep:{os.urandom(6).hex()}:"
        before = await node_clients(cluster)
        async with backend_of(cluster.url(), prefix) as backend:
            outcome = await cancel_and_check(backend, op, at, how, where, settle=0.02)
            assert_slots_whole(backend, where)
            if op != "aclose":
                await assert_serves_at_full_width(backend, where)
        async with backend_of(cluster.url(), prefix) as second:
            await assert_pages_whole_or_missed(second, op, where)
            await second.delete([*OLD, *NEW])
        after = await node_clients(cluster)
        grown = {port: after[port] - n for port, n in before.items() if after[port] > n}
        assert not grown, f"{where}: connections left open (port: how many): {grown}"
        return outcome

    base = await run(None)
    assert base.result == "completed", base
    for at in spread(base.suspensions, first=0 if how == "task" else 1):
        await run(at)


async def test_an_entry_cancelled_anywhere_leaves_no_connection_open() -> None:
    """``async with RedisClusterBackend(...)`` cancelled at each await point of its entry
    (reading the slot map, the commands, PING and INFO to each primary): the backend is
    closed, and no node holds more connections than before.

    (redis-py's cluster client closes nothing while it is still to read its slot map: an
    entry cancelled after the map was read but before the commands were left each
    connection it had opened, one to a seed or to every primary.)"""
    cluster = shared_cluster()

    async def enter() -> None:
        async with backend_of(cluster.url(), "csweep:entry:"):
            pass

    async def run(at: int | None) -> Outcome:
        before = await node_clients(cluster)
        outcome = await run_cancelled_at(enter(), at, "task")
        cancelled_or_done(outcome, f"entry cancelled at {at}")
        await asyncio.sleep(0.02)  # a close still under way
        after = await node_clients(cluster)
        grown = {port: after[port] - n for port, n in before.items() if after[port] > n}
        assert not grown, f"entry cancelled at {at}: connections left open: {grown}"
        return outcome

    base = await run(None)
    for at in range(1, base.suspensions + 1):
        await run(at)


# ------------------------------------------------------------------------------ a hung node

TIMEOUT = 0.4
"""The backend's `socket_timeout` here."""
COOLDOWN = 0.3
"""Its `node_cooldown`."""


@pytest.mark.slow
@pytest.mark.parametrize("op", ["get_into", "set_from", "exists", "delete"])
async def test_a_call_cancelled_anywhere_with_a_node_hung_leaves_no_circuit_stuck(
        op: str) -> None:
    """One primary of three hung: a call cancelled at each await point (by turns
    ``Task.cancel``, an anyio scope, an ``asyncio.timeout``), while it waits for the hung
    node, probes it after the cool-down or is served by the others: no probe is left in
    flight, every node's slots are given back, the other nodes' pages read as written or
    miss. Once the node answers again, a call after the cool-down reaches it (its circuit
    closes) and every page is served; once closed, no connection is left."""
    hows: list[How] = ["task", "scope", "timeout"]
    with running_cluster(LocalCluster(replicas=0)) as cluster:
        before = await node_clients(cluster)
        victim = cluster.nodes[1]
        async with backend_of(cluster.url(), "csweep:hung:", socket_timeout=TIMEOUT,
                              node_cooldown=COOLDOWN) as backend:
            assert await backend.set_from(OLD, page_views(OLD)) == [True] * len(OLD)
            victim.pause()
            try:
                buffers = [bytearray([SENTINEL]) * FMT.payload_bytes for _ in [*OLD, *NEW]]
                base = await run_cancelled_at(swept_call(op, backend, buffers), None, "task")
                assert base.result == "completed", base
                for n, at in enumerate(spread(base.suspensions + 2)):
                    how, where = hows[n % 3], f"{op}, {hows[n % 3]} cancel at {at}"
                    await asyncio.sleep(COOLDOWN * (n % 2))  # every other one: a probe
                    call = swept_call(op, backend, buffers)
                    cancelled_or_done(await run_cancelled_at(call, at, how), where)
                    assert not backend._circuits._probing, f"{where}: a probe left in flight"
                    assert_slots_whole(backend, where)
            finally:
                victim.resume()
            cluster.wait_ok(cluster.nodes)
            await asyncio.sleep(COOLDOWN + 0.1)
            await read_pages(backend, OLD)  # the probe
            assert not backend._circuits.failing(), "the node answers, its circuit open"
            await assert_pages_whole_or_missed(backend, op, f"{op}, after")
            assert await read_pages(backend, UNTOUCHED) == [make_page(k) for k in UNTOUCHED]
            await assert_serves_at_full_width(backend, f"{op}, after")
        after = await node_clients(cluster)
        grown = {port: after[port] - n for port, n in before.items() if after[port] > n}
        assert not grown, f"{op}: connections left open (port: how many): {grown}"
