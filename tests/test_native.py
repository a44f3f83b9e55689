"""Loading the optional C extensions: used where built and current, else the Python twin."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from aiohicache import _native
from aiohicache._native import load_extension, stale


def test_a_module_older_than_its_source_is_stale(tmp_path: Path) -> None:
    built, source = tmp_path / "_spanread.so", tmp_path / "_spanread.c"
    built.write_bytes(b"")
    assert not stale(built, source)  # a wheel: no source beside it
    source.write_text("")
    os.utime(built, (1_000, 1_000))
    os.utime(source, (2_000, 2_000))
    assert stale(built, source)
    os.utime(built, (3_000, 3_000))
    assert not stale(built, source)


def test_an_extension_that_is_not_built_is_not_used_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("aiohicache.test")
    with caplog.at_level(logging.INFO, logger="aiohicache.test"):
        assert load_extension("aiohicache.transfer._no_such_ext", logger=logger,
                              fallback="numpy copies instead") is None
    assert "aiohicache.transfer._no_such_ext is not built; numpy copies instead" in caplog.text


def test_a_stale_extension_is_not_used_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    package = tmp_path / "stale_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_ext.py").write_text("VALUE = 1\n")  # stands in for the built module
    (package / "_ext.c").write_text("/* newer */\n")
    os.utime(package / "_ext.py", (1_000, 1_000))
    monkeypatch.syspath_prepend(str(tmp_path))
    logger = logging.getLogger("aiohicache.test")
    with caplog.at_level(logging.WARNING, logger="aiohicache.test"):
        assert load_extension("stale_pkg._ext", logger=logger, fallback="Python runs") is None
    assert "_ext.py is older than _ext.c; rebuild it" in caplog.text
    os.utime(package / "_ext.py", None)  # rebuilt: newer than its source again
    assert load_extension("stale_pkg._ext", logger=logger, fallback="Python runs") is not None


def test_aiohicache_native_0_turns_every_extension_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "ENABLED", False)
    assert load_extension("aiohicache.transfer._pagecopy", logger=logging.getLogger("t"),
                          fallback="") is None
