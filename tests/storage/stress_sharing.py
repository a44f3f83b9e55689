"""A randomized stress of 2-3 `FileBackend` instances sharing one directory (not collected
by pytest): tiny segments that roll and compact constantly, merges a few entries a turn,
lanes rolled for touches, random writes (each a new version), deletes, reads and looks from
several tasks, random cancellation and restarts. A model of which versions each read may
legally serve reports torn or foreign bytes (never seen), older versions and lost pages.

    .venv/bin/python -m tests.storage.stress_sharing SEED SECONDS [MERGE_CHUNK]
    NOCANCEL=5 ...   # no cancellation

It found seven races (each now a test in test_file_races.py or test_file_binding.py, see
docs/storage.md); see there for the runs since. Never another key's bytes, before or
after: the page checks hold. `test_file_stress.py` runs three seeds of 3 s in CI; a store
with problems is kept (its path printed), else removed.
"""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from aiohicache.storage import FileBackend, _file, _file_upkeep
from aiohicache.storage._file_index import SegmentIndex
from tests.storage.conftest import FMT, PAYLOAD, make_keys, make_page

NOCANCEL = float(os.environ.get('NOCANCEL', '0')) or None
SEQ = [0]
def tick() -> int:
    SEQ[0] += 1
    return SEQ[0]


@dataclass
class Op:
    kind: str  # "w" / "d"
    gen: int
    begin: int
    version: int = -1
    end: int | None = None
    status: str = "inflight"  # ok / uncertain
    known: int = 0


@dataclass
class Slot:
    store: FileBackend
    gen: int
    known: int = 0  # ops completed before this seq are merged


GENS = [0]
ops: dict[str, list[Op]] = {}
versions = {}
problems: list[str] = []
scan_seq: dict[int, int] = {}
store_slot: dict[int, Slot] = {}


def install_patches(chunk: int, apply_sleep: float) -> None:
    _file_upkeep._MERGE_CHUNK = chunk
    _file_upkeep._TOUCH_FLUSH = 4
    _file._TOUCH_FLUSH = 4
    real_apply = SegmentIndex.apply

    def slow_apply(self, entry):  # type: ignore[no-untyped-def]
        if random.random() < 0.3:
            time.sleep(apply_sleep)
        return real_apply(self, entry)
    SegmentIndex.apply = slow_apply  # type: ignore[method-assign]
    real_read_since = _file_upkeep._read_since

    def read_since(root, read_to, skip):  # type: ignore[no-untyped-def]
        at = SEQ[0]
        scan, order = real_read_since(root, read_to, skip)
        scan_seq[id(scan)] = at
        return scan, order
    _file_upkeep._read_since = read_since
    real_merge = _file_upkeep._FileUpkeep._merge

    async def merge(self, scan, before, order):  # type: ignore[no-untyped-def]
        at = scan_seq.pop(id(scan), 0)
        await real_merge(self, scan, before, order)
        slot = store_slot.get(id(self))
        if slot is not None and slot.store is self:
            slot.known = max(slot.known, at)
    _file_upkeep._FileUpkeep._merge = merge


def sees(x: Op, slot: Slot, read_begin: int) -> bool:
    return (x.gen == slot.gen and x.end < read_begin) or x.end < slot.known


def legal(key: str, slot: Slot, read_begin: int) -> set[int]:
    """Versions that may be served by `slot` for a read begun at read_begin."""
    out = set()
    kops = ops.get(key, [])
    for w in kops:
        if w.kind != "w":
            continue
        superseded = False
        for x in kops:
            if x is w or x.status != "ok" or x.end is None or w.end is None or \
                    x.begin <= w.end or not sees(x, slot, read_begin):
                continue
            if x.kind == "w" or x.gen == w.gen or w.end < x.known:
                superseded = True
                break
        if not superseded:
            out.add(w.version)
    return out


def due(key: str, slot: Slot, read_begin: int) -> int | None:
    """The version that must be served (a hit), or None if a miss is allowed."""
    kops = ops.get(key, [])
    if not kops:
        return None
    last = max(kops, key=lambda o: o.begin)
    if last.kind != "w" or last.status != "ok" or last.end is None or last.end >= read_begin:
        return None
    if any(o is not last and (o.end is None or o.end > last.begin) for o in kops):
        return None
    if last.gen == slot.gen or last.end < slot.known:
        return last.version
    return None


async def do_write(slot: Slot, keys: list[str], rng: random.Random) -> None:
    store = slot.store
    recs = []
    bufs = []
    for k in keys:
        versions[k] = versions.get(k, 0) + 1
        v = versions[k]
        op = Op("w", slot.gen, tick(), v)
        ops.setdefault(k, []).append(op)
        recs.append(op)
        bufs.append(memoryview(make_page(k, version=v)))
    res = None
    with anyio.move_on_after(NOCANCEL or rng.choice([1e-4, 1e-3, 5e-3, 1.0, 1.0, 1.0])):
        res = await store.set_from(keys, bufs)
    end = tick()
    for i, op in enumerate(recs):
        op.end = end
        if res is None:
            op.status = "uncertain"
        elif res[i]:
            op.status = "ok"
        else:
            problems.append(f"write refused {keys[i]} v{op.version}")
            op.status = "uncertain"


async def do_delete(slot: Slot, keys: list[str], rng: random.Random) -> None:
    recs = []
    for k in keys:
        op = Op("d", slot.gen, tick(), known=slot.known)
        ops.setdefault(k, []).append(op)
        recs.append(op)
    res = None
    with anyio.move_on_after(NOCANCEL or rng.choice([1e-4, 1e-3, 1.0, 1.0, 1.0])):
        res = await slot.store.delete(keys)
    end = tick()
    for op in recs:
        op.end = end
        op.status = "ok" if res is not None else "uncertain"


async def do_read(slot: Slot, keys: list[str], rng: random.Random) -> None:
    begin = tick()
    snap_known = slot.known
    bufs = [bytearray(b"\xee" * PAYLOAD) for _ in keys]
    res = None
    with anyio.move_on_after(NOCANCEL or rng.choice([1e-4, 1e-3, 1.0, 1.0, 1.0, 1.0])):
        res = await slot.store.get_into(keys, [memoryview(b) for b in bufs])
    if res is None:
        return
    s2 = Slot(slot.store, slot.gen, snap_known)
    for k, hit, buf in zip(keys, res, bufs, strict=True):
        ok = legal(k, s2, begin)
        if hit:
            got = next((v for v in range(1, versions.get(k, 0) + 1)
                        if make_page(k, version=v) == bytes(buf)), None)
            if got is None:
                problems.append(f"FOREIGN/TORN bytes for {k[:8]} gen{slot.gen}")
            elif got not in ok:
                problems.append(f"ILLEGAL version {k[:8]} v{got} legal={sorted(ok)} "
                                f"gen{slot.gen} begin={begin} known={snap_known} "
                                f"ops={_recent(ops[k])}")
        else:
            want = due(k, s2, begin)
            if want is not None:
                problems.append(f"LOST {k[:8]} v{want} gen{slot.gen} begin={begin} "
                                f"ops={_recent(ops[k])}")


async def do_exists(slot: Slot, keys: list[str], rng: random.Random) -> None:
    begin = tick()
    s2 = Slot(slot.store, slot.gen, slot.known)
    n = None
    with anyio.move_on_after(NOCANCEL or rng.choice([1e-4, 1.0, 1.0])):
        n = await slot.store.exists(keys[:1])
    if n is None:
        return
    if n == 0 and due(keys[0], s2, begin) is not None:
        problems.append(f"EXISTS-LOST {keys[0][:8]} gen{slot.gen}")


async def worker(slot: Slot, pool: list[str], rng: random.Random, stop: float) -> None:
    while time.monotonic() < stop:
        keys = rng.sample(pool, rng.randint(1, 6))
        r = rng.random()
        try:
            if r < 0.35:
                await do_write(slot, keys, rng)
            elif r < 0.5:
                await do_delete(slot, keys, rng)
            elif r < 0.9:
                await do_read(slot, keys, rng)
            else:
                await do_exists(slot, keys, rng)
        except Exception as exc:
            problems.append(f"RAISED {type(exc).__name__}: {exc}")
        await asyncio.sleep(0)


async def open_slot(root: Path, rng: random.Random, touch_limit: int) -> Slot:
    store = FileBackend(root, FMT, segment_bytes=rng.choice([3, 5, 8]) * 600,
                        refresh_interval=rng.choice([0.0, 0.001, 0.01]),
                        max_concurrency=rng.choice([1, 2, 4]))
    GENS[0] += 1
    slot = Slot(store, GENS[0])
    store_slot[id(store)] = slot
    at = tick()
    await store._start()
    store._appender.touch_limit = touch_limit
    slot.known = at
    return slot


async def instance_life(root: Path, pool: list[str], rng: random.Random, stop: float,
                        touch_limit: int) -> None:
    slot = await open_slot(root, rng, touch_limit)
    while time.monotonic() < stop:
        span = min(stop, time.monotonic() + rng.uniform(0.3, 1.5))
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(worker, slot, pool, random.Random(rng.random()), span)
        if time.monotonic() < stop and rng.random() < 0.6:
            await slot.store.aclose()
            slot = await open_slot(root, rng, touch_limit)
    await slot.store.aclose()


async def final_check(root: Path, pool: list[str]) -> None:
    slot = await open_slot(root, random.Random(0), 1 << 20)
    try:
        await do_read(slot, pool, random.Random(1).__class__(2))
    finally:
        await slot.store.aclose()


async def main(seed: int, seconds: float) -> None:
    rng = random.Random(seed)
    install_patches(int(sys.argv[3]) if len(sys.argv) > 3 else 4, 2e-5)
    root = Path(tempfile.mkdtemp(prefix="stress"))
    pool = make_keys(24, seed=seed)
    stop = time.monotonic() + seconds
    async with anyio.create_task_group() as tg:
        for _ in range(rng.choice([2, 3])):
            tg.start_soon(instance_life, root, pool, random.Random(rng.random()), stop,
                          rng.choice([200, 1000, 4000]))
    # final: fresh instance, no cancel
    slot = await open_slot(root, rng, 1 << 20)
    try:
        begin = tick()
        bufs = [bytearray(PAYLOAD) for _ in pool]
        res = await slot.store.get_into(pool, [memoryview(b) for b in bufs])
        for k, hit, buf in zip(pool, res, bufs, strict=True):
            ok = legal(k, slot, begin)
            if hit:
                got = next((v for v in range(1, versions.get(k, 0) + 1)
                            if make_page(k, version=v) == bytes(buf)), None)
                if got not in ok:
                    problems.append(f"FINAL illegal {k[:8]} v{got} legal={sorted(ok)}")
            elif due(k, slot, begin) is not None:
                problems.append(f"FINAL lost {k[:8]}")
    finally:
        await slot.store.aclose()
    logs, segs = await anyio.to_thread.run_sync(_sizes, root)
    nops = sum(len(v) for v in ops.values())
    print(f"seed={seed} ops={nops} logs={logs} segs={segs} problems={len(problems)}")  # noqa: T201
    for p in problems[:15]:
        print("  ", p[:600])  # noqa: T201
    if problems:
        print(f"   the store is kept in {root}")  # noqa: T201
    else:
        await anyio.to_thread.run_sync(shutil.rmtree, root)


def _recent(history: list[Op]) -> list[tuple[object, ...]]:
    return [(o.kind, o.gen, o.begin, o.version, o.end, o.status) for o in history[-6:]]


def _sizes(root: Path) -> tuple[int, int]:
    return (sum(p.stat().st_size for p in root.glob("*.log")), len(list(root.glob("*.seg"))))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
