"""The package's optional C extensions: whether one can be used here.

``pip install`` builds them where a C compiler and Python's headers are (pyproject's
``ext-modules``, all optional). Each has a Python twin that gives the same results more
slowly; ``AIOHICACHE_NATIVE=0`` turns every extension off, and CI sets
``AIOHICACHE_REQUIRE_NATIVE=1`` so that tests fail rather than skip where one did not build.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = ("ENABLED", "REQUIRED", "load_extension", "stale")

ENABLED: Final = os.environ.get("AIOHICACHE_NATIVE", "1") != "0"
REQUIRED: Final = os.environ.get("AIOHICACHE_REQUIRE_NATIVE") == "1"


def load_extension(module: str, *, logger: logging.Logger, fallback: str) -> ModuleType | None:
    """The extension `module` (a dotted name), if it is built, not turned off, and not
    older than its ``.c`` source; else None, saying so (`fallback`: what runs instead)."""
    if not ENABLED:
        return None
    try:
        extension = importlib.import_module(module)
    except ImportError:
        logger.info("%s is not built; %s", module, fallback)
        return None
    built = Path(extension.__file__ or "")
    source = built.with_name(module.rpartition(".")[2] + ".c")
    if stale(built, source):
        logger.warning("%s is older than %s; rebuild it (make install, or pip install -e .). "
                       "Until then %s", built.name, source.name, fallback)
        return None
    return extension


def stale(built: Path, source: Path) -> bool:
    """Whether `source` changed after `built` was built from it. NOTE: in a checkout (an
    editable install) a pull can change the source under a built module; a wheel holds no
    source, so there is nothing to compare."""
    return source.exists() and source.stat().st_mtime > built.stat().st_mtime
