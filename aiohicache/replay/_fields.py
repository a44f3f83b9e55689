"""Reading trace files: lines to JSON records, and checked fields of a record.

Every error is a `ConfigError` whose message names the place (``file:line``) and the field,
so a user can fix the trace without reading this code.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any

from ..errors import ConfigError

Record = dict[str, Any]
PathLike = str | os.PathLike[str]


def check(cond: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `cond`."""
    if not cond:
        raise ConfigError(message)


def records(path: PathLike, *, limit: int | None) -> Iterator[tuple[str, Record]]:
    """``("file:line", object)`` for each non-blank line, the first `limit` of them."""
    limit = check_limit(limit)
    try:
        with _open(os.fspath(path)) as lines:
            yield from _parse_lines(os.fspath(path), lines, limit)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:  # zlib: bad data
        raise ConfigError(f"{os.fspath(path)}: cannot read trace: {exc}") from exc


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parse_lines(name: str, lines: IO[str], limit: int | None) -> Iterator[tuple[str, Record]]:
    count = 0
    for lineno, line in enumerate(lines, start=1):
        if count == limit:
            return
        parsed = numbered_record(name, lineno, line)
        if parsed is not None:
            count += 1
            yield parsed


def numbered_record(name: str, lineno: int, line: str) -> tuple[str, Record] | None:
    """A trace line's record and where it is (``path:line``); None for a blank line."""
    if not line.strip():
        return None
    where = f"{name}:{lineno}"
    return where, _parse_line(where, line)


def _parse_line(where: str, line: str) -> Record:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from exc
    except RecursionError:  # NOTE: json's parser recurses per nesting level
        raise ConfigError(f"{where}: not JSON: nested too deeply") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    return record


@contextlib.contextmanager
def at(where: str) -> Iterator[None]:
    """Prefix a `ConfigError` raised inside with ``file:line``."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def check_limit(limit: int | None) -> int | None:
    check(limit is None or limit >= 0, f"limit must be None or >= 0, got {limit!r}")
    return limit


def _field(record: Record, name: str) -> Any:
    if name not in record:
        raise ConfigError(f"missing field {name!r}")
    return record[name]


def int_field(record: Record, name: str) -> int:
    value = _field(record, name)
    check(type(value) is int, f"field {name!r} must be an integer, got {value!r}")
    return int(value)


def number_field(record: Record, name: str) -> float:
    value = _field(record, name)
    check(type(value) in (int, float) and math.isfinite(value),
          f"field {name!r} must be a finite number, got {value!r}")
    return float(value)


def str_field(record: Record, name: str) -> str:
    value = _field(record, name)
    check(isinstance(value, str), f"field {name!r} must be a string, got {value!r}")
    return str(value)


def ids_field(record: Record) -> tuple[int, ...]:
    value: Sequence[Any] = _field(record, "hash_ids")
    check(isinstance(value, list) and all(type(h) is int and h >= 0 for h in value),
          "field 'hash_ids' must be a list of integers >= 0")
    return tuple(value)
