"""Sizes a replay is given: model bytes scaled down to fit a laptop, capacities as text."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from .._validate import check_int
from ..config import KVSpec
from ..errors import ConfigError


def scaled_spec(spec: KVSpec, kv_scale: int) -> KVSpec:
    """`spec` with bytes per token divided by `kv_scale`.

    Lets a laptop replay production capacities in tokens: tier sizes in tokens, hit ratios
    and page counts stay those of the model; bytes shrink by `kv_scale`. Layers go first
    (fewer, wider copies stay efficient), then the row narrows; at least 16 bytes per row
    are kept where the scale allows.

    Raises:
        ConfigError: `kv_scale` does not divide layers x row width.
    """
    check_int("kv_scale", kv_scale, low=1)
    if kv_scale == 1:
        return spec
    layers, width = spec.num_layers, spec.row_elems
    if (layers * width) % kv_scale:
        raise ConfigError(f"kv_scale: {kv_scale} does not divide layers x row width "
                          f"({layers} x {width}) of {spec.fingerprint()}")
    layer_div = math.gcd(layers, kv_scale)
    row_div = kv_scale // layer_div
    if width % row_div:
        raise ConfigError(f"kv_scale: {kv_scale} cannot be split between {layers} layers and "
                          f"a row of {width}")
    layers, width = layers // layer_div, width // row_div
    if spec.kind == "mha":
        return KVSpec.mha(num_layers=layers, num_kv_heads=1, head_dim=width, dtype=spec.dtype)
    return KVSpec.mla(num_layers=layers, kv_lora_rank=width, rope_dim=0, dtype=spec.dtype)


_TOKENS = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*(tok|tokens)?\s*$")
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?[bB]\s*$")
_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_capacity(text: str, *, bytes_per_token: int, field_name: str) -> int:
    """Tokens from ``"512k"``, ``"10.24M"``, ``"2000"`` (tokens) or ``"4GiB"``, ``"1.5GB"``.

    Raises:
        ConfigError: the text is neither form.
    """
    # NOTE: Decimal, not float: "16.016k" is 16,016 tokens, where floats make 16015.99...
    m = _TOKENS.match(text)
    if m:
        return int(Decimal(m.group(1)) * _SI[m.group(2).lower()])
    m = _BYTES.match(text)
    if m:
        unit = (m.group(2) or "").lower()
        scale = _IEC.get(unit) or _SI[unit]
        return int(Decimal(m.group(1)) * scale) // bytes_per_token
    raise ConfigError(f"{field_name}: {text!r} is neither tokens (512k, 10M) nor bytes (4GiB)")
