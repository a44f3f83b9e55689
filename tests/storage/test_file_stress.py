"""A few seconds of the randomized sharing stress on every run (`stress_sharing.py`: 2-3
`FileBackend` instances sharing a directory, tiny segments compacted all the time, journal
merges a few entries a turn, random writes, deletes, reads, restarts; with and without
cancellation). Its model of what each read may serve reports another key's or a torn page,
an older version served after a newer write or delete was seen, a page lost that was
stored, and anything raised: any of them fails the run.

It runs in a subprocess of its own: the stress patches the store's module constants.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("seed", "cancel"), [(1, True), (2, False), (3, True)])
def test_instances_sharing_a_directory_serve_only_what_they_may(seed: int,
                                                                 cancel: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not cancel:
        env["NOCANCEL"] = "5"
    out = subprocess.run([sys.executable, "-m", "tests.storage.stress_sharing", str(seed),
                          "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = out.stdout.splitlines()[0]
    assert summary.startswith(f"seed={seed} ") and int(summary.split("ops=")[1].split()[0]) > 100
    assert summary.endswith(" problems=0"), out.stdout
