"""The one way aiohicache checks a number or a choice it was handed.

Every check raises `ConfigError` (or the error the caller names) with a message that starts
with the name of the argument, so a user reading ``page_size: must be an int in 1..256, got 0``
knows which knob to turn. `bool` is refused wherever an int or a number is asked for: ``True``
is an int to Python, never a page count to a user.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from .errors import ConfigError

__all__ = ("check_choice", "check_int", "check_number")


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None,
              numpy_ok: bool = False, error: type[Exception] = ConfigError) -> int:
    """Return `value` as an int if it is one within ``low..high`` (both inclusive).

    `numpy_ok` admits numpy integer scalars (allocator counts computed with numpy).
    """
    if _is_int(value, numpy_ok) and (low is None or value >= low) and (  # type: ignore[operator]
            high is None or value <= high):  # type: ignore[operator]
        return int(value)  # type: ignore[call-overload,no-any-return]
    raise error(f"{name}: must be {_int_bound(low, high)}, got {value!r}")


def check_number(name: str, value: object, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False,
                 error: type[Exception] = ConfigError) -> float:
    """Return `value` as a float if it is a finite int or float within its bounds.

    ``low_open=True`` makes `low` exclusive (``> low``); `high` is always inclusive.
    """
    if not isinstance(value, bool) and isinstance(value, int | float) and _finite(value):
        above = low is None or (value > low if low_open else value >= low)
        if above and (high is None or value <= high):
            return float(value)
    raise error(f"{name}: must be {_number_bound(low, high, low_open)}, got {value!r}")


def check_choice(name: str, value: object, allowed: Collection[object], *,
                 error: type[Exception] = ConfigError) -> None:
    """Raise unless `value` is one of `allowed`, and of its type.

    NOTE: of its type, not only equal: a numpy array compared with a name is an array
    (``in`` raised ValueError for two or more elements), and a 0-d one passed as the name
    and failed later, where the value was used as one (iterated, hashed).
    """
    if not any(isinstance(value, type(a)) and value == a for a in allowed):
        raise error(f"{name}: must be one of {tuple(allowed)}, got {value!r}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range (10**400): no finite number
        return False


def _is_int(value: object, numpy_ok: bool) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if numpy_ok:
        import numpy as np  # only the allocator asks; keep numpy out of the plain path

        return isinstance(value, np.integer)
    return False


def _int_bound(low: int | None, high: int | None) -> str:
    if high is not None:
        return f"an int in {low if low is not None else '-inf'}..{high}"
    if low == 1:
        return "a positive int"
    return "an int" if low is None else f"an int >= {low}"


def _number_bound(low: float | None, high: float | None, low_open: bool) -> str:
    if high is not None:
        left = "(" if low_open else "["
        return f"a finite number in {left}{low}, {high}]"
    if low is None:
        return "a finite number"
    return f"a finite number {'>' if low_open else '>='} {low:g}"
