"""A randomized stress of 2-3 `RedisBackend` instances (`RedisClusterBackend` in cluster mode)
sharing one real redis-server that it starts itself (a cluster of 3 primaries + 3 replicas
in cluster mode; never a server on 6379), not collected by pytest. Several tasks per
instance write (each a new version), delete, read and look, in random batches, with random
cancellation (tiny timeouts), small pools (down to one connection), pipelines of one page to
all of a batch, retries 0-2; instances are closed and reopened, sometimes with calls in
flight. In half the runs a plain client plants another key's object, or a flipped or cut
one, behind the backends' backs (a delete, as far as the model goes: a miss). In some runs
the server is paused (SIGSTOP/SIGCONT; a primary in cluster mode, shorter than the node
timeout) or, one server only, killed and restarted on the same port (its pages are lost).

A model of which versions each read may legally serve reports foreign or torn bytes, an
older version served after a newer write (or a delete) completed, pages lost with no fault
to excuse it, a write refused, an exception that is not a `StorageError` (or `ClosedError`
once closed), a call that ran past the bound its timeouts set (a hang), objects counted
corrupt where none was planted (a reply read by the wrong command shows there), and
connections left in use once no call is in flight (or open after `aclose`).

    .venv/bin/python -m tests.storage.stress_redis SEED SECONDS [cluster]
    NOCANCEL=5 ...   # no cancellation
    MIDWAY=0 ...   # never close an instance with calls in flight (default: 1 span in 5)
    FAULT=none|pause|kill ...   # force the fault mode (else drawn by the seed)

A command cancelled, or timed out, after it reached the server may still be applied by it
afterwards (it is in the server's socket buffer, or asyncio is still flushing it): the model
lets such an operation land until the server has been running `GRACE_S` since it returned
(and since the last pause ended, for any operation a pause overlapped).

It found two problems (tests in test_redis_races.py and test_cluster.py): `aclose` under
calls in flight (an AttributeError from redis-py, a connection reopened after the close),
and the cluster's look at ``INFO memory`` taking connections past `max_connections` (a node
lost). A third, a call waiting forever beside a free connection (a lost wake-up in
redis-py's pool), came from reading redis-py while writing it; no seed had hit it.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import anyio
import anyio.to_thread
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from aiohicache import ClosedError
from aiohicache import _redis_server as server_module
from aiohicache._redis_server import LocalCluster, RedisServer, RedisServerError
from aiohicache.storage.base import decode_page
from aiohicache.storage.errors import StorageError
from aiohicache.storage.redis import RedisBackend, RedisClusterBackend
from tests.storage.conftest import FMT, PAYLOAD, make_keys, make_page

NOCANCEL = float(os.environ.get("NOCANCEL", "0")) or None
MIDWAY = float(os.environ.get("MIDWAY", "0.2"))
GRACE_S = 0.3
SEQ = [0]


def tick() -> int:
    SEQ[0] += 1
    return SEQ[0]


@dataclass
class Op:
    kind: str  # "w" / "d"
    begin: int
    version: int = -1
    end: int | None = None  # None: may still land
    status: str = "inflight"  # ok / uncertain


@dataclass
class World:
    ops: dict[str, list[Op]] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unsettled: list[tuple[Op, float]] = field(default_factory=list)
    lost_before: int = 0
    """Pages written before this tick may be lost (a server killed meanwhile)."""
    paused: bool = False
    resumed_at: float = -1e9
    resume_tick: int = 0
    """The tick the last pause ended (an op begun before it may have overlapped one)."""
    max_pause_s: float = 0.0
    refusals_ok: bool = False
    raw: Any = None
    """A plain client that plants foreign and flipped objects (None: this run plants none)."""
    """A cluster's lost node costs its pages of a write (False), not a StorageError."""
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


W = World()


def finish(op: Op, ok: bool, returned_at: float) -> None:
    """Record how `op` ended: an ok op overlapped by no pause ends now; any other may still
    land until the server has run `GRACE_S` (the settler ends it)."""
    op.status = "ok" if ok else "uncertain"
    if ok and op.begin > W.resume_tick and not W.paused:
        op.end = tick()
    else:
        W.unsettled.append((op, returned_at))


async def settler(stop: anyio.Event) -> None:
    while not stop.is_set() or W.unsettled:
        await anyio.sleep(0.01)
        if W.paused:
            continue
        now = time.monotonic()
        keep = []
        for op, at in W.unsettled:
            if now - max(at, W.resumed_at) > GRACE_S:
                op.end = tick()
            else:
                keep.append((op, at))
        W.unsettled = keep


# ---------------------------------------------------------------------- the model


def legal(key: str, read_begin: int) -> set[int]:
    """Versions a read begun at `read_begin` may serve: each write not superseded by an op
    that began after it ended and ended before the read began."""
    out = set()
    kops = W.ops.get(key, [])
    for w in kops:
        if w.kind != "w":
            continue
        superseded = any(
            x is not w and x.status == "ok" and x.end is not None and w.end is not None
            and x.begin > w.end and x.end < read_begin for x in kops)
        if not superseded:
            out.add(w.version)
    return out


def due(key: str, read_begin: int) -> int | None:
    """The version a read must serve (a hit), or None where a miss is allowed."""
    kops = W.ops.get(key, [])
    if not kops:
        return None
    last = max(kops, key=lambda o: o.begin)
    if last.kind != "w" or last.status != "ok" or last.end is None or \
            last.end >= read_begin or last.begin <= W.lost_before:
        return None
    if any(o is not last and (o.end is None or o.end > last.begin) for o in kops):
        return None
    return last.version


def version_of(key: str, buf: bytearray) -> int | None:
    data = bytes(buf)
    return next((v for v in range(1, W.versions.get(key, 0) + 1)
                 if make_page(key, version=v) == data), None)


# ---------------------------------------------------------------------- operations


def cancel_after(rng: random.Random, *choices: float) -> float:
    return NOCANCEL or rng.choice(choices)


async def do_write(b: RedisBackend, keys: list[str], rng: random.Random) -> None:
    recs = []
    bufs = []
    for k in keys:
        W.versions[k] = W.versions.get(k, 0) + 1
        op = Op("w", tick(), W.versions[k])
        W.ops.setdefault(k, []).append(op)
        recs.append(op)
        bufs.append(memoryview(make_page(k, version=op.version)))
    res = None
    try:
        with anyio.move_on_after(cancel_after(rng, 1e-4, 1e-3, 5e-3, 5.0, 5.0, 5.0)):
            res = await b.set_from(keys, bufs)
    finally:
        at = time.monotonic()
        for i, op in enumerate(recs):
            ok = res is not None and res[i]
            if res is not None and not res[i]:
                if not W.refusals_ok:
                    W.problems.append(f"write refused {keys[i][:8]} v{op.version}")
                W.count("refused")
            finish(op, ok, at)


async def do_delete(b: RedisBackend, keys: list[str], rng: random.Random) -> None:
    recs = []
    for k in keys:
        op = Op("d", tick())
        W.ops.setdefault(k, []).append(op)
        recs.append(op)
    res = None
    try:
        with anyio.move_on_after(cancel_after(rng, 1e-4, 1e-3, 5.0, 5.0, 5.0)):
            res = await b.delete(keys)
    finally:
        at = time.monotonic()
        for op in recs:
            finish(op, res is not None, at)
    if res is not None and not (isinstance(res, int) and 0 <= res <= len(keys)):
        W.problems.append(f"DELETE returned {res!r} for {len(keys)} keys")


async def do_read(b: RedisBackend, keys: list[str], rng: random.Random) -> None:
    begin = tick()
    bufs = [bytearray(b"\xee" * PAYLOAD) for _ in keys]
    res = None
    with anyio.move_on_after(cancel_after(rng, 1e-4, 1e-3, 5e-3, 5.0, 5.0, 5.0)):
        res = await b.get_into(keys, [memoryview(x) for x in bufs])
    if res is None:  # NOTE: a copy begun runs to its end: each buffer is as left, or a hit
        res = [bytes(buf) != b"\xee" * PAYLOAD for buf in bufs]
        check_read(keys, res, bufs, begin, "CANCELLED ", misses=False)
        return
    check_read(keys, res, bufs, begin, "")


def check_read(keys: list[str], res: list[bool], bufs: list[bytearray], begin: int,
               tag: str, *, misses: bool = True) -> None:
    for k, hit, buf in zip(keys, res, bufs, strict=True):
        if hit:
            W.count("hits")
            got = version_of(k, buf)
            ok = legal(k, begin)
            if got is None:
                W.problems.append(f"{tag}FOREIGN/TORN bytes for {k[:8]}")
            elif got not in ok:
                W.problems.append(f"{tag}ILLEGAL version {k[:8]} v{got} legal={sorted(ok)} "
                                  f"begin={begin} ops={_recent(W.ops[k])}")
        elif misses:
            W.count("misses")
            if bytes(buf) != b"\xee" * PAYLOAD:
                W.problems.append(f"{tag}a miss wrote its buffer {k[:8]}")
            want = due(k, begin)
            if want is not None:
                W.problems.append(f"{tag}LOST {k[:8]} v{want} begin={begin} "
                                  f"ops={_recent(W.ops[k])}")


async def do_exists(b: RedisBackend, keys: list[str], rng: random.Random) -> None:
    begin = tick()
    n = None
    with anyio.move_on_after(cancel_after(rng, 1e-4, 1e-3, 5.0, 5.0)):
        n = await b.exists(keys[:1])
    if n is None:
        return
    if n not in (0, 1):
        W.problems.append(f"EXISTS returned {n!r} for one key")
    elif n == 0 and due(keys[0], begin) is not None:
        W.problems.append(f"EXISTS-LOST {keys[0][:8]} ops={_recent(W.ops[keys[0]])}")


# ---------------------------------------------------------------------- instances


@dataclass
class Instance:
    backend: RedisBackend
    bound_s: float
    """No call may take longer (its timeouts, retries, pipelines and a pool shared by the
    instance's workers allow this much)."""
    closing: bool = False


def open_instance(url: str, cluster: bool, rng: random.Random, workers: int) -> Instance:
    settings: dict[str, Any] = dict(
        max_batch=rng.choice([2, 4, 128]),
        max_pipeline_bytes=rng.choice([600, 2000, 4 << 20]),
        max_connections=rng.choice([1, 2, 4]),
        retries=rng.choice([0, 1, 2]),
        inline_bytes=rng.choice([0, 1 << 20]),
        socket_timeout=rng.choice([0.2, 0.5, 1.0]),
        connect_timeout=rng.choice([0.2, 0.5]))
    cls = RedisClusterBackend if cluster else RedisBackend
    backend = cls(url, FMT, **settings)
    pipelines = 6 // min(settings["max_batch"], max(1, settings["max_pipeline_bytes"] // 576))
    attempt = settings["connect_timeout"] + 3 * settings["socket_timeout"]
    per_call = (pipelines + 3) * (settings["retries"] + 1) * attempt
    bound = per_call * (1 + workers / settings["max_connections"]) + W.max_pause_s + 1.0
    return Instance(backend, bound)


async def do_plant(b: RedisBackend, keys: list[str], rng: random.Random) -> None:
    """Put another key's object (as ``COPY`` would), or the key's own with a byte flipped,
    under `keys[0]`, behind the backend's back: a delete, as far as reads may tell."""
    if W.raw is None:
        return await do_read(b, keys, rng)
    dst = keys[0]
    op = Op("d", tick())
    W.ops.setdefault(dst, []).append(op)
    ok = False
    try:
        src = keys[-1] if len(keys) > 1 else dst
        blob = await W.raw.get(b.key_prefix + src)
        if blob is None:  # nothing to plant: a delete, then, as the model has it
            await W.raw.delete(b.key_prefix + dst)
        else:
            # NOTE: one planted before under src may be dst's own: it is cut short, never
            # flipped (a second flip would restore it)
            if decode_page(FMT, src, blob) is None:
                blob = blob[:-1]
            elif src == dst:
                blob = blob[:-1] + bytes([blob[-1] ^ 0xFF])
            await W.raw.set(b.key_prefix + dst, blob)
            W.count("planted")
        ok = True
    except Exception as exc:  # the server paused or killed: the object may be planted
        W.count(f"plant_failed:{type(exc).__name__}")
    finally:
        finish(op, ok, time.monotonic())


OPS: list[tuple[float, Callable[..., Awaitable[None]]]] = [
    (0.35, do_write), (0.5, do_delete), (0.87, do_read), (0.95, do_exists), (1.0, do_plant)]


async def worker(inst: Instance, pool: list[str], rng: random.Random, stop: float) -> None:
    while time.monotonic() < stop:
        keys = rng.sample(pool, rng.randint(1, 6))
        r = rng.random()
        op = next(fn for p, fn in OPS if r < p)
        started = time.monotonic()
        hard = max(3 * inst.bound_s, 20.0)
        try:
            with anyio.move_on_after(hard) as scope:
                await op(inst.backend, keys, rng)
            if scope.cancelled_caught:
                W.problems.append(f"HANG {op.__name__} cancelled after {hard:.1f} s "
                                  f"({inst.backend!r})")
        except ClosedError:
            if not inst.closing:
                W.problems.append(f"ClosedError from an open instance ({op.__name__})")
            return
        except StorageError as exc:
            W.count(f"storage_errors:{type(exc.__cause__).__name__}")
        except Exception as exc:
            W.problems.append(f"RAISED {op.__name__}: {type(exc).__name__}: {exc}")
        took = time.monotonic() - started
        if took > inst.bound_s:
            W.problems.append(f"SLOW {op.__name__} {took:.2f} s > bound {inst.bound_s:.2f} s")
        W.count(op.__name__)
        await asyncio.sleep(0)


def in_use(backend: RedisBackend) -> int:
    """Connections taken from the pool and not given back."""
    client: Any = backend._client
    if isinstance(backend, RedisClusterBackend):
        return sum(len(n._connections) - len(n._free)
                   for n in client.nodes_manager.nodes_cache.values())
    return len(client.connection_pool._in_use_connections)


def connected(backend: RedisBackend) -> int:
    client: Any = backend._client
    if isinstance(backend, RedisClusterBackend):
        conns = [c for n in client.nodes_manager.nodes_cache.values() for c in n._connections]
    else:
        pool = client.connection_pool
        conns = [*pool._available_connections, *pool._in_use_connections]
    return sum(1 for c in conns if c.is_connected)


async def instance_life(url: str, cluster: bool, pool: list[str], rng: random.Random,
                        stop: float) -> None:
    workers = rng.choice([2, 3, 4])
    inst = open_instance(url, cluster, rng, workers)
    while time.monotonic() < stop:
        span = min(stop, time.monotonic() + rng.uniform(0.3, 1.5))
        close_midway = rng.random() < MIDWAY
        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(worker, inst, pool, random.Random(rng.random()), span)
            if close_midway:
                await anyio.sleep(rng.uniform(0.05, 0.3))
                inst.closing = True
                await inst.backend.aclose()
                W.count("closed_midway")
        if not close_midway:
            leaked = in_use(inst.backend)
            if leaked:
                W.problems.append(f"LEAK {leaked} connections in use with no call in flight "
                                  f"({inst.backend!r})")
        await close(inst)
        inst = open_instance(url, cluster, rng, workers)
    await close(inst)


async def close(inst: Instance) -> None:
    inst.closing = True
    await inst.backend.aclose()
    open_left = connected(inst.backend)
    if open_left:
        W.problems.append(f"OPEN {open_left} connections after aclose ({inst.backend!r})")
    corrupt = inst.backend.stats().corrupt
    if corrupt and W.raw is None:
        W.problems.append(f"CORRUPT {corrupt} objects rejected ({inst.backend!r})")


# ---------------------------------------------------------------------- faults


async def pauses(servers: list[RedisServer], rng: random.Random, stop: float,
                 longest: float) -> None:
    while time.monotonic() < stop - longest - 0.5:
        await anyio.sleep(rng.uniform(0.3, 1.5))
        server = rng.choice(servers)
        W.paused = True
        server.pause()
        W.count("pauses")
        try:
            await anyio.sleep(rng.uniform(0.02, longest))
        finally:
            server.resume()
            W.paused = False
            W.resume_tick = tick()
            W.resumed_at = time.monotonic()


async def kills(server: RedisServer, rng: random.Random, stop: float) -> None:
    while time.monotonic() < stop - 2.0:
        await anyio.sleep(rng.uniform(0.5, 2.0))
        port = server.port
        server.kill()
        W.count("kills")
        await anyio.sleep(rng.uniform(0.0, 0.5))
        try:
            with mock.patch.object(server_module, "_free_port", lambda port=port: port):
                await anyio.to_thread.run_sync(server.start)
        except RedisServerError as exc:
            W.problems.append(f"(harness) could not restart the server: {exc}")
            return
        finally:
            W.lost_before = tick()  # NOTE: after the restart: writes up to now may be lost


# ---------------------------------------------------------------------- main


async def final_check(url: str, cluster: bool, pool: list[str]) -> None:
    cls = RedisClusterBackend if cluster else RedisBackend
    async with cls(url, FMT) as b:
        begin = tick()
        bufs = [bytearray(b"\xee" * PAYLOAD) for _ in pool]
        res = await b.get_into(pool, [memoryview(x) for x in bufs])
        check_read(pool, res, bufs, begin, "FINAL ")


async def run(seed: int, seconds: float, cluster: bool, url: str,
              servers: list[RedisServer]) -> None:
    rng = random.Random(seed)
    fault = os.environ.get("FAULT") or rng.choice(["none", "none", "pause", "kill"])
    if cluster and fault == "kill":
        fault = "pause"  # NOTE: a failover may serve what a replica had: not modelled
    longest = 0.5 if cluster else rng.choice([0.3, 1.0, 2.5])  # cluster: under node timeout
    W.max_pause_s = longest if fault == "pause" else 0.0
    W.refusals_ok = cluster and fault != "none"
    pool = make_keys(24, seed=seed)
    if rng.random() < 0.5:
        W.raw = raw_client(servers, cluster)
    stop = time.monotonic() + seconds
    done = anyio.Event()
    async with anyio.create_task_group() as outer:
        outer.start_soon(settler, done)
        async with anyio.create_task_group() as tg:
            for _ in range(rng.choice([2, 3])):
                tg.start_soon(instance_life, url, cluster, pool, random.Random(rng.random()),
                              stop)
            if fault == "pause":
                tg.start_soon(pauses, servers, random.Random(rng.random()), stop, longest)
            elif fault == "kill":
                tg.start_soon(kills, servers[0], random.Random(rng.random()), stop)
        done.set()
    await final_check(url, cluster, pool)
    if W.raw is not None:
        await W.raw.aclose()
    nops = sum(len(v) for v in W.ops.values())
    counts = " ".join(f"{k}={v}" for k, v in sorted(W.counts.items()))
    print(f"seed={seed} mode={'cluster' if cluster else 'single'} fault={fault} "  # noqa: T201
          f"plant={W.raw is not None} ops={nops} "
          f"{counts} problems={len(W.problems)}")
    for p in W.problems[:15]:
        print("  ", p[:600])  # noqa: T201


def raw_client(servers: list[RedisServer], cluster: bool) -> Any:
    if cluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in servers],
                            socket_timeout=1.0, socket_connect_timeout=1.0)
    return Redis.from_url(servers[0].url(), socket_timeout=1.0, socket_connect_timeout=1.0)


def _recent(history: list[Op]) -> list[tuple[object, ...]]:
    return [(o.kind, o.begin, o.version, o.end, o.status) for o in history[-6:]]


def main() -> None:
    seed, seconds = int(sys.argv[1]), float(sys.argv[2])
    cluster = len(sys.argv) > 3 and sys.argv[3] == "cluster"
    if cluster:
        with LocalCluster() as local:
            primaries = local.primaries()
            asyncio.run(run(seed, seconds, True, local.url(), primaries))
    else:
        with RedisServer() as server:
            asyncio.run(run(seed, seconds, False, server.url(), [server]))
    sys.exit(1 if W.problems else 0)


if __name__ == "__main__":
    main()
