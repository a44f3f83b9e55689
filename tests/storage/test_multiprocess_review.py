"""Separate OS processes sharing one L3 (a file-store directory, a Redis server): a page one
process reads is exactly a page some process wrote under that key, or a miss, while others
write the same and other keys, evict, compact, delete, restart and are killed mid-call.

Every payload names itself: its first bytes hold the version and writer it was made with,
the rest is a hash of (key, version, writer), so a torn, mixed or foreign page fails the
check wherever it is read. Keys each worker alone writes ("owned") also catch an older
version served after a newer write of it completed.

Workers are Python processes running `_worker` (see `WORKER`). Most file-store workers arm
a SIGKILL of themselves at their n-th segment write, journal append, unlink, rename or
truncate, before, after or halfway through its bytes (seeded, so a seed replays the same
crash points, the threads' interleaving aside); the parent SIGKILLs others (and every
Redis worker it picks) at a seeded moment.

``AIOHICACHE_STRESS=N`` runs the stresses N times as long (a longer local run).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiohicache.storage import FileBackend, PageFormat
from aiohicache.storage.base import HEADER_SIZE

PAYLOAD = 512
FMT = PageFormat.make(namespace="multiprocess", spec_fingerprint="mha-L2-2x8-bf16",
                      page_size=4, payload_bytes=PAYLOAD)
OBJECT = HEADER_SIZE + PAYLOAD
REPO = Path(__file__).resolve().parents[2]
STRESS = max(1, int(os.environ.get("AIOHICACHE_STRESS", "1") or "1"))

SHARED_KEYS = 40
"""Keys every worker writes, reads and deletes."""
OWNED_KEYS = 6
"""Keys per worker slot that only that slot writes (others read and delete them)."""
_TAG = struct.Struct("<QI")


# ---------------------------------------------------------------------------- self-naming pages

def make_payload(key: str, version: int, writer: int) -> bytes:
    """A page of `key` that names its version and writer; the rest derives from all three."""
    tag = _TAG.pack(version, writer)
    return tag + hashlib.shake_128(key.encode() + tag).digest(PAYLOAD - _TAG.size)


def check_payload(key: str, data: bytes) -> int:
    """The version `data` names, if it is a page some writer made for `key`; else -1."""
    version, writer = _TAG.unpack_from(data)
    return version if data == make_payload(key, version, writer) else -1


def make_keys(num: int, *, seed: int) -> list[str]:
    return [hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).hexdigest()
            for i in range(num)]


def shared_keys() -> list[str]:
    return make_keys(SHARED_KEYS, seed=901)


def owned_keys(slot: int) -> list[str]:
    return make_keys(OWNED_KEYS, seed=1000 + slot)


# ---------------------------------------------------------------------------- the worker

@dataclass
class Plan:
    """What one worker process does (passed as JSON)."""

    kind: str
    """``file`` or ``redis``."""
    where: str
    """The store directory, or the Redis URL."""
    slot: int
    gen: int
    seed: int
    ops: int
    slots: int
    floors: dict[str, int] = field(default_factory=dict)
    """Owned key -> the newest version of it a write completed (earlier generations)."""
    die_at: list[Any] | None = None
    """``[call name, n, how]``: SIGKILL itself at the n-th such call (file store only)."""
    store: dict[str, Any] = field(default_factory=dict)
    """FileBackend keywords."""


def _arm_crash(name: str, nth: int, how: str) -> None:
    """SIGKILL this process at the `nth` call of ``os.<name>`` (on any thread): ``before``
    it, ``after`` it, or ``half`` (half its bytes written, for writes)."""
    import threading
    real = getattr(os, name)
    count = [0]
    lock = threading.Lock()

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            count[0] += 1
            hit = count[0] == nth
        if not hit:
            return real(*args, **kwargs)
        if how == "before":
            die()
        if how == "half" and name == "write":
            fd, data = args
            os.write(fd, bytes(data)[:max(1, len(data) // 2)])
            die()
        if how == "half" and name == "pwritev":
            fd, iov, offset = args
            flat = b"".join(bytes(part) for part in iov)
            os.pwrite(fd, flat[:max(1, len(flat) // 2)], offset)
            die()
        result = real(*args, **kwargs)
        die()
        return result
    setattr(os, name, hooked)


async def _file_worker(plan: Plan, rng: random.Random) -> None:
    async with FileBackend(plan.where, FMT, **plan.store) as store:
        await _work(plan, rng, store)


async def _redis_worker(plan: Plan, rng: random.Random) -> None:
    from aiohicache.storage.redis import RedisBackend
    async with RedisBackend(plan.where, FMT, key_prefix="mp:") as store:
        await _work(plan, rng, store)


async def _work(plan: Plan, rng: random.Random, store: Any) -> None:
    """Random writes, reads, deletes and looks; every hit checked; a completed write of an
    owned key reported as ``W key version``; a bad read reported as ``BAD ...`` (exit 3)."""
    mine, shared = owned_keys(plan.slot), shared_keys()
    everyone = shared + [k for s in range(plan.slots) for k in owned_keys(s)]
    floors = dict(plan.floors)
    writer = plan.slot * 1000 + plan.gen
    next_version = (plan.gen + 1) << 32
    for _ in range(plan.ops):
        roll = rng.random()
        if roll < 0.4:
            keys = list(dict.fromkeys(rng.sample(shared + mine, rng.randint(1, 6))))
            versions = []
            for _k in keys:
                next_version += 1
                versions.append(next_version)
            data = [make_payload(k, v, writer) for k, v in zip(keys, versions, strict=True)]
            stored = await store.set_from(keys, [memoryview(d) for d in data])
            for k, v, ok in zip(keys, versions, stored, strict=True):
                if ok and k in mine:
                    floors[k] = v
                    _say(f"W {k} {v}")
        elif roll < 0.8:
            keys = rng.sample(everyone, rng.randint(1, 8))
            bufs = [bytearray(PAYLOAD) for _ in keys]
            hits = await store.get_into(keys, [memoryview(b) for b in bufs])
            for k, b, hit in zip(keys, bufs, hits, strict=True):
                if not hit:
                    continue
                version = check_payload(k, bytes(b))
                if version < 0:
                    _say(f"BAD torn-or-foreign {k}")
                    sys.exit(3)
                if k in mine and version < floors.get(k, 0):
                    _say(f"BAD older {k} {version} < {floors[k]}")
                    sys.exit(3)
        elif roll < 0.9:
            others = [k for k in everyone if k not in mine]
            await store.delete(rng.sample(others, rng.randint(1, 3)))
        else:
            await store.exists(rng.sample(everyone, rng.randint(1, 4)))


def _say(line: str) -> None:
    """One line to the parent, at once (a SIGKILL must not eat what was said before)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _worker(argv: list[str]) -> None:
    plan = Plan(**json.loads(argv[0]))
    rng = random.Random(plan.seed)
    if plan.die_at is not None:
        _arm_crash(*plan.die_at)
    asyncio.run(_file_worker(plan, rng) if plan.kind == "file" else _redis_worker(plan, rng))
    _say("DONE")


# ---------------------------------------------------------------------------- the parent

WORKER = """
import importlib.util, sys, types
# NOTE: the package's __init__ imports torch (3-6 s a process here); a worker needs the
# storage only, so the package is stood in for by a bare one over the same directory
spec = importlib.util.find_spec("aiohicache")
pkg = types.ModuleType("aiohicache")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["aiohicache"] = pkg
from tests.storage.test_multiprocess_review import _worker
_worker(sys.argv[1:])
"""

_CALLS = ("pwritev", "write", "unlink", "rename", "ftruncate")


@dataclass
class Run:
    """Several worker slots over one store, each restarted when it ends or is killed."""

    kind: str
    where: str
    seed: int
    slots: int = 3
    store: dict[str, Any] = field(default_factory=dict)
    crash_rate: float = 0.7
    floors: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    generations: int = 0
    killed: int = 0
    kill_after: list[float | None] = field(default_factory=list)
    """Seconds after its start the parent SIGKILLs each generation (None: never)."""

    def plan(self, slot: int, rng: random.Random) -> Plan:
        die = None
        if self.kind == "file" and rng.random() < self.crash_rate:
            die = [rng.choice(_CALLS), rng.randint(1, 150), rng.choice(["before", "after",
                                                                        "half"])]
        self.generations += 1
        self.kill_after.append(rng.uniform(0.5, 2.5) if rng.random() < self.crash_rate
                               else None)
        return Plan(self.kind, self.where, slot, self.generations, rng.randrange(1 << 30),
                    rng.randint(40, 300), self.slots, dict(self.floors), die, self.store)

    def start(self, plan: Plan) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(plan.__dict__)], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def take(self, proc: subprocess.Popen[str]) -> None:
        out, err = proc.communicate()
        for line in out.splitlines():
            if line.startswith("W "):
                _, key, version = line.split()
                self.floors[key] = max(self.floors.get(key, 0), int(version))
            elif line.startswith("BAD"):
                self.problems.append(line)
        if proc.returncode == -signal.SIGKILL:
            self.killed += 1
        elif proc.returncode != 0:
            self.problems.append(f"worker exit {proc.returncode}: {err[-3000:]}")

    def run(self, seconds: float) -> None:
        rng = random.Random(self.seed)
        procs: list[subprocess.Popen[str] | None] = []
        ends: list[float] = []
        for slot in range(self.slots):
            procs.append(self.start(self.plan(slot, rng)))
            ends.append(time.monotonic() + (self.kill_after[-1] or 1e9))
        deadline = time.monotonic() + seconds
        while any(p is not None for p in procs):
            time.sleep(0.01)
            for slot, proc in enumerate(procs):
                if proc is None:
                    continue
                if proc.poll() is None:
                    if time.monotonic() > ends[slot]:
                        proc.kill()  # mid-call, wherever it is (the file store: also armed)
                    continue
                self.take(proc)
                procs[slot] = None
                if time.monotonic() < deadline:
                    procs[slot] = self.start(self.plan(slot, rng))
                    ends[slot] = time.monotonic() + (self.kill_after[-1] or 1e9)


def every_key(slots: int) -> list[str]:
    return shared_keys() + [k for s in range(slots) for k in owned_keys(s)]


async def check_store(backend: Any, run: Run) -> int:
    """Read every key through `backend`: each hit must be a page made for its key, and an
    owned key's no older than its newest completed write. The hits."""
    keys = every_key(run.slots)
    bufs = [bytearray(PAYLOAD) for _ in keys]
    hits = await backend.get_into(keys, [memoryview(b) for b in bufs])
    for key, buf, hit in zip(keys, bufs, hits, strict=True):
        if hit:
            version = check_payload(key, bytes(buf))
            assert version >= 0, f"a torn or foreign page served for {key}"
            assert version >= run.floors.get(key, 0), f"an older version served for {key}"
    return sum(hits)


# ---------------------------------------------------------------------------- file store

SMALL_STORE: dict[str, Any] = {"segment_bytes": 8 * OBJECT, "capacity_bytes": 32 * OBJECT,
               "max_concurrency": 2, "refresh_interval": 0.0}
"""Segments of 8 pages and a budget of 32 (of 58 keys): every few writes evict, seal and
compact, in every process."""


@pytest.mark.parametrize("seed", [11, 12])
def test_processes_killed_at_random_points_leave_only_right_pages_or_misses(
        tmp_path: Path, seed: int) -> None:
    """Three worker processes, restarted as they end; most arm a SIGKILL of themselves at a
    seeded write, journal append, unlink or rename (before, after or mid-bytes). Live
    workers check every hit; then a fresh instance reads every key, and the directory holds
    no temp segment nor a segment without a journal."""
    run = Run("file", str(tmp_path), seed, store=SMALL_STORE)
    run.run(3.0 * STRESS)
    assert not run.problems, run.problems
    assert run.killed > 0 and run.generations > run.slots  # some restarted

    async def verify() -> None:
        async with FileBackend(tmp_path, FMT, **SMALL_STORE) as fresh:
            await check_store(fresh, run)
            stats = fresh.stats()
            assert stats.used_bytes is not None and stats.capacity_bytes is not None
            assert stats.used_bytes <= stats.capacity_bytes
    asyncio.run(verify())
    names = os.listdir(tmp_path)
    assert not [n for n in names if n.endswith(".tmp")], names
    segs = {n[:-4] for n in names if n.endswith(".seg")}
    logs = {n[:-4] for n in names if n.endswith(".log")}
    assert segs <= logs, f"segments without a journal: {segs - logs}"



# ---------------------------------------------------------------------------- reclaiming lanes

KILLED_AFTER_MAKING_A_LANE = """
import importlib.util, os, signal, sys, types
spec = importlib.util.find_spec("aiohicache")
pkg = types.ModuleType("aiohicache")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["aiohicache"] = pkg
from aiohicache.storage import _appender
_appender._create_segment(sys.argv[1])
os.kill(os.getpid(), signal.SIGKILL)
"""


def segment_files(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.endswith(".seg"))


async def read_back(backend: FileBackend, keys: list[str]) -> list[bool]:
    bufs = [bytearray(PAYLOAD) for _ in keys]
    hits = await backend.get_into(keys, [memoryview(b) for b in bufs])
    return [hit and check_payload(k, bytes(b)) == 1 for k, b, hit in zip(keys, bufs, hits,
                                                                           strict=True)]


async def test_lanes_of_closed_and_killed_readers_are_reclaimed(tmp_path: Path) -> None:
    """A process that only reads journals its reads (touches) into a lane that holds no
    record; one killed right after making its lane leaves it empty. Only the instance that
    made such a lane ever compacted it, so each reader that ever ran left a segment and a
    journal for good (a directory of short-lived readers grew a pair of files and up to a
    lane's touches per run, each read again by every start). The next instance to start
    takes the lock-free ones for garbage, and its writes compact them away; every page is
    still served."""
    keys = make_keys(8, seed=77)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as writer:  # one segment
        assert await writer.set_from(keys, [memoryview(make_payload(k, 1, 0)) for k in keys])
    for _ in range(4):
        async with FileBackend(tmp_path, FMT) as reader:
            assert await read_back(reader, keys) == [True] * 8
    killed = await anyio.run_process(
        [sys.executable, "-c", KILLED_AFTER_MAKING_A_LANE, str(tmp_path)], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(segment_files(tmp_path)) == 6  # the data, 4 readers' lanes, the killed one
    extra = make_keys(6, seed=78)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as nxt:
        for key in extra:  # each write a chance to compact one
            assert await nxt.set_from([key], [memoryview(make_payload(key, 1, 0))])
        assert len(segment_files(tmp_path)) == 2  # the data and this instance's lane
        assert nxt.stats().extra["segments"] == 2
        assert await read_back(nxt, keys + extra) == [True] * 14
    async with FileBackend(tmp_path, FMT) as again:
        assert await read_back(again, keys + extra) == [True] * 14


# ---------------------------------------------------------------------------- Redis

def test_processes_killed_mid_call_on_one_redis_server_leave_only_right_pages(
        tmp_path: Path) -> None:
    """Three worker processes on one Redis server of the test's own, SIGKILLed by the parent
    at random moments and restarted: live workers check every hit, then a fresh backend
    reads every key."""
    from aiohicache._redis_server import RedisServer
    from aiohicache.storage.redis import RedisBackend
    with RedisServer() as server:
        for seed in (21, 22, 23):  # NOTE: on a loaded machine a run may end before a kill
            run = Run("redis", server.url(), seed)
            run.run(3.0 * STRESS)
            assert not run.problems, run.problems
            if run.killed:
                break
        assert run.killed > 0 and run.generations > run.slots  # some restarted

        async def verify() -> None:
            async with RedisBackend(server.url(), FMT, key_prefix="mp:") as fresh:
                assert await check_store(fresh, run) > 0
        asyncio.run(verify())
