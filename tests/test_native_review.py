"""Review of the two C extensions (`storage/_spanread.c`, `transfer/_pagecopy.c`) and their
Python wrappers: the package imports anew in one process, sizes that would overflow an
offset are refused before any arithmetic on them (checked under UBSan), and the wrappers
take an empty copy as the caller writes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from aiohicache import CpuTransferEngine, KVSpec
from aiohicache.memory import DevicePool, HostPool

ROOT = Path(__file__).parents[1]

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler for UBSan")


def run_python(code: str, *args: str,
               path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`code` with `args` in a fresh interpreter, the checkout (and `path`) importable."""
    paths = [str(ROOT)] if path is None else [str(ROOT), str(path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


_IMPORT_ANEW = """
import importlib, sys
from aiohicache.storage import _native
first = _native.SPAN_READER is not None
importlib.reload(_native)  # an editor's or notebook's reload
for name in [name for name in sys.modules if name.startswith("aiohicache")]:
    del sys.modules[name]  # a test runner's or dev server's fresh import
from aiohicache.storage import _native
print(first, _native.SPAN_READER is not None)
"""


def test_the_package_can_be_imported_anew_in_one_process() -> None:
    """Reloading the storage package (``importlib.reload``, or importing it again after its
    modules left ``sys.modules``) works and keeps the native reader: the extension outlives
    the import and is bound already, and binding the same hash functions again changes
    nothing (other functions are still refused: test_span_reader)."""
    out = run_python(_IMPORT_ANEW)
    assert out.returncode == 0, out.stderr
    first, again = out.stdout.split()
    assert again == first


def _ubsan_build(tmp_path: Path, source: str) -> Path:
    """`source` (a path under aiohicache/) built with UBSan into `tmp_path`, as a top-level
    module of its own name; the test is skipped where UBSan cannot be built."""
    name = Path(source).stem
    target = tmp_path / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    build = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-g", "-fsanitize=undefined",
         "-fno-sanitize-recover=all", f"-I{sysconfig.get_paths()['include']}",
         str(ROOT / "aiohicache" / source), "-o", str(target)],
        capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"no UBSan build here: {build.stderr[-300:]}")
    return tmp_path


_SPANS = """
import os, sys, _spanread
from aiohicache.storage import _native
from aiohicache.storage.base import PageFormat, encode_header, fixed_header, key_id
addresses = _native._xxh3_addresses()
if addresses is None:
    print("no xxhash"); sys.exit(0)
_spanread.bind(*addresses)
fmt = PageFormat.make(namespace="t", spec_fingerprint="t", page_size=1, payload_bytes=64)
key, page = "ab" * 8, bytes(range(64))
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
os.write(fd, encode_header(fmt, key, page) + page)
filled, dest = bytearray(1), bytearray(64)
_spanread.read_checked(fd, 0, 64, 4096, fixed_header(fmt), key_id(key), [dest], filled)
assert filled == b"\\1" and dest == page  # the sanitized build reads
for payload, offset, n in [(sys.maxsize, 0, 0), (sys.maxsize - 63, 0, 0),
                           (64, 2**63 - 200, 2), (64, 2**63 - 1, 1)]:
    dests = [bytearray(64) for _ in range(n)]
    try:
        _spanread.read_checked(fd, offset, payload, 4096, fixed_header(fmt), bytes(8 * n),
                               dests, bytearray(n))
    except ValueError as exc:
        print("refused:", exc)
    else:
        print("read", payload, offset, n)
"""


@needs_gcc
def test_a_span_whose_offsets_would_overflow_is_refused_before_reading(tmp_path: Path) -> None:
    """`read_checked` refuses a span whose last offset (offset + records * (64 + payload))
    does not fit a signed 64-bit offset, with ValueError, before computing any offset: a
    payload near ``sys.maxsize`` overflowed ``64 + payload`` (undefined behaviour, caught
    here by UBSan), and an offset near 2**63 overflowed the next record's offset."""
    out = run_python(_SPANS, str(tmp_path / "segment"),
                     path=_ubsan_build(tmp_path, "storage/_spanread.c"))
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "no xxhash":
        pytest.skip("xxhash's XXH3 functions are not usable here")
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("refused: ") for line in lines), lines


SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bf16")


@pytest.mark.parametrize("empty", [[], (), np.array([])], ids=["list", "tuple", "float"])
async def test_an_empty_copy_written_as_lists_copies_nothing(empty: object) -> None:
    """``load([], [])`` and ``write([], [])`` are copies of no pages, as the file store's
    ``get_into([], [])`` is a read of none: numpy makes ``[]`` a float64 array, which the
    id check refused as "float64 ids" although there is no id to misread."""
    dev = DevicePool(SPEC, num_pages=4, page_size=4)
    host = HostPool(SPEC, num_pages=4, page_size=4)
    for raw in (dev.data.view(torch.uint8), host.data.view(torch.uint8)):
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    before = dev.data.clone(), host.data.clone()
    engine = CpuTransferEngine(dev, host)
    try:
        await engine.load(empty, empty).wait()  # type: ignore[arg-type]
        await engine.write(empty, empty).wait()  # type: ignore[arg-type]
    finally:
        await engine.aclose()
    for data, old in zip((dev.data, host.data), before, strict=True):
        assert torch.equal(data.view(torch.uint8), old.view(torch.uint8))
