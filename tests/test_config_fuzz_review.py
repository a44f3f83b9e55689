"""Configuration and input validation, fuzzed (a review): bad input is a `ConfigError` (or a
click usage error) naming what is wrong, at construction, before anything is allocated; good
input works end to end.

The property tests draw field values from wide strategies (negative, zero, 2**63, 10**400,
NaN/inf, bools, numpy scalars and arrays, strings, wrong types) and combinations of valid
values (layouts, dtypes, MLA, tiny host pools, thresholds past the capacities, memory and file
L3 with their URL options); the regression tests under them are the defects the fuzzing found.
Example counts stay small: the file runs in seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiohicache import HiCache, HiCacheConfig, KVSpec
from aiohicache._tokens import as_tokens
from aiohicache.cli import cli
from aiohicache.errors import ConfigError
from aiohicache.replay.runner import MODELS, ReplayConfig, parse_capacity
from aiohicache.serve import EngineConfig
from aiohicache.storage import PageFormat, backend_from_url, check_url
from aiohicache.storage.factory import parse_size

from .kvcheck import KVChecker

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
"""Derandomized: the same examples on every run (CI must not find a new one by chance)."""

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=4, dtype="fp16")
BASE: dict[str, Any] = {"spec": SPEC, "page_size": 4, "device_pages": 8, "host_pages": 16}
FIELDS = sorted(f.name for f in dataclasses.fields(HiCacheConfig) if f.init)

WEIRD = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 2**63, -2**63, 2**64, 10**400, 0.0, -0.5,
                     0.5, math.nan, math.inf, -math.inf, 1e308, "", "4", "lru", "cpu",
                     "opt", b"lru", (), ("lru", "lru"), ("lru", "lfu", "arc"), [], ["lru"],
                     {}, 1 + 2j]),
    st.integers(), st.floats(), st.text(max_size=8),
    st.builds(np.int64, st.integers(-2**63, 2**63 - 1)), st.builds(np.float64, st.floats()),
    st.sampled_from([np.bool_(True), np.str_("lru"), np.array("arc"), np.array(["lru", "lfu"]),
                     np.array([1, 2]), torch.tensor(3), torch.tensor([1, 2]), object()]),
)
"""Anything a caller might hand a field by mistake."""


def _names_a_field(message: str) -> bool:
    """The message starts with a field's name (flat, or ``spec``/``storage`` inside)."""
    head = message.partition(":")[0]
    return head in FIELDS or head in ("spec", "storage", "host_ratio", "eviction")


# ---------------------------------------------------------------------- HiCacheConfig fields


@pytest.mark.parametrize("field", [f for f in FIELDS if f != "extra"])
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(value=WEIRD)
def test_fuzz_any_field_value_is_accepted_or_a_config_error_naming_it(field: str,
                                                                      value: object) -> None:
    """One field set to anything: the config is made, or a ConfigError names the field (never
    a TypeError, ValueError or OverflowError from inside the check)."""
    try:
        HiCacheConfig(**{**BASE, field: value})
    except ConfigError as exc:
        assert str(exc).startswith(field) or _names_a_field(str(exc)), str(exc)


@FUZZ
@given(field=st.sampled_from(["kind", "num_layers", "dtype", "num_kv_heads", "head_dim",
                              "kv_lora_rank", "rope_dim"]),
       kind=st.sampled_from(["mha", "mla"]),
       value=st.one_of(WEIRD, st.sampled_from([torch.float64, torch.bool, torch.int32,
                                               "float64", "torch.bfloat16", "fp8"])))
def test_fuzz_kvspec_field_is_accepted_or_a_config_error_naming_it(field: str, kind: str,
                                                                   value: object) -> None:
    fields: dict[str, Any] = {"kind": kind, "num_layers": 2, "dtype": "fp16",
                              "num_kv_heads": 1, "head_dim": 4, "kv_lora_rank": 4,
                              "rope_dim": 2}
    try:
        KVSpec(**{**fields, field: value})
    except ConfigError as exc:
        assert str(exc).startswith(field), str(exc)


# ---------------------------------------------------------------------- valid configs, end to end

_DTYPES = ["fp16", "bf16", "fp32", "uint8"]  # KVChecker's exact dtypes
SPECS = st.one_of(
    st.builds(lambda layers, heads, dim, dtype: KVSpec.mha(
        num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype),
        st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.sampled_from(_DTYPES)),
    st.builds(lambda layers, rank, rope, dtype: KVSpec.mla(
        num_layers=layers, kv_lora_rank=rank, rope_dim=rope, dtype=dtype),
        st.integers(1, 3), st.integers(1, 6), st.integers(0, 3), st.sampled_from(_DTYPES)),
)


@st.composite
def cache_configs(draw: st.DrawFn, tmp: str) -> dict[str, Any]:
    """Valid-looking combinations: tiny or no host pools, policies, layouts, thresholds past
    every capacity, zero timeouts, a memory or file L3 with its URL options."""
    storage = draw(st.sampled_from([None, "memory://", "memory://?max_bytes=1",
                                    "memory://?max_bytes=1K", f"file://{tmp}/l3",
                                    f"file://{tmp}/l3s?segment_bytes=1&max_bytes=64K"
                                    "&max_concurrency=1&fsync=0"]))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 7]))
    return {
        "spec": draw(SPECS),
        "page_size": page_size,
        "device_pages": -(-26 // page_size) + draw(st.integers(0, 4)),  # two prompts' worth
        "host_pages": draw(st.sampled_from([None, 0, 1, 2, 5, 40])),
        "host_ratio": draw(st.sampled_from([1e-9, 0.5, 2.0])),
        "host_layout": draw(st.sampled_from(["layer_first", "page_first"])),
        "write_policy": draw(st.sampled_from(["write_through", "write_through_selective",
                                              "write_back"])),
        "write_through_threshold": draw(st.sampled_from([None, 1, 3, 2**62])),
        "load_back_threshold": draw(st.sampled_from([0, 1, 9, 2**62])),
        "eviction": draw(st.sampled_from(["lru", "lfu", "arc", ("arc", "lru"), ("lfu", "arc")])),
        "max_inflight_loads": draw(st.sampled_from([1, 64])),
        "max_inflight_writes": draw(st.sampled_from([1, 64])),
        "storage": storage,
        "prefetch_policy": draw(st.sampled_from(["best_effort", "wait_complete", "timeout"])),
        "prefetch_threshold": draw(st.sampled_from([0, 1, 2**62])),
        "prefetch_timeout_base": draw(st.sampled_from([0.0, 2.0])),
        "prefetch_host_fraction": draw(st.sampled_from([1e-9, 0.5, 1.0])),
        "storage_miss_ttl": draw(st.sampled_from([0.0, 5.0])),
        "storage_miss_max_entries": draw(st.sampled_from([0, 1, 4096])),
        "backup_threshold": draw(st.sampled_from([1, 2, 2**62])),
        "backup_max_inflight_bytes": draw(st.sampled_from([1, 256 << 20])),
        "namespace": draw(st.text(min_size=1, max_size=6)),
    }


async def _serve_small_requests(config: HiCacheConfig) -> None:
    """Three prompts (two sharing a prefix), each served twice: every hit holds exactly its
    prefix's KV (`KVChecker`), and the cache closes with its invariants whole."""
    prompts = [list(range(10)), [*range(10), 77, 78, 79], [5000 + i for i in range(9)]]
    async with HiCache(config) as cache:
        kv = KVChecker(cache)
        for _ in range(2):
            for tokens in prompts:
                async with cache.fetch(tokens) as hit:
                    await kv.verify_prefix(hit, tokens)
                    new = len(tokens) - hit.num_cached_tokens
                    if new:
                        slots = await hit.allocate(new)
                        kv.fill(slots, tokens, hit.num_cached_tokens)
                        await hit.commit(tokens, slots)
            await cache.drain()
        cache.check_invariants()


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_valid_combinations_serve_right_and_close(tmp_path_factory: pytest.TempPathFactory,
                                                       data: st.DataObject) -> None:
    tmp = str(tmp_path_factory.mktemp("l3"))
    fields = data.draw(cache_configs(tmp))
    try:
        config = HiCacheConfig(**fields)
    except ConfigError as exc:  # a combination refused: at construction, named
        assert _names_a_field(str(exc)), str(exc)
        return
    asyncio.run(asyncio.wait_for(_serve_small_requests(config), 20))


# ---------------------------------------------------------------------- storage URLs

_URL_PIECES = st.sampled_from([
    *"ab:/@?&=#[],.%0123456789 ", "max_bytes", "fsync", "segment_bytes", "max_concurrency",
    "\x00", "\udcff", "é", "²", "\u0661", "localhost", "::1", "65536", "0", "K", "G", "1e3",
    "nan", "-1", "true"])
_FMT = PageFormat.make(namespace="fuzz", spec_fingerprint="s", page_size=4, payload_bytes=64)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(scheme=st.sampled_from(["memory", "file", "redis", "rediss", "redis+cluster",
                               "rediss+cluster", "MEMORY", "File", "bogus", ""]),
       sep=st.sampled_from(["://", ":", ":///", "://h:1", ":rel/dir", ":///abs/dir"]),
       tail=st.lists(_URL_PIECES, max_size=10).map("".join))
def test_fuzz_storage_url_is_checked_or_refused_never_a_crash(scheme: str, sep: str,
                                                              tail: str) -> None:
    """`check_url` raises only ``storage: ...`` ConfigErrors; for memory and file URLs, what
    it passes the backend accepts and what it refuses the backend refuses (nothing is
    opened: the file store touches its directory only when opened)."""
    url = scheme + sep + tail
    try:
        check_url(url)
        passed = True
    except ConfigError as exc:
        assert str(exc).startswith("storage: "), str(exc)
        passed = False
    if scheme.lower() not in ("memory", "file"):
        return  # redis: construction needs no server, but its query goes to redis-py
    try:
        backend_from_url(url, _FMT)
        built = True
    except ConfigError:
        built = False
    assert built == passed, f"check_url {'passed' if passed else 'refused'} {url!r}, the " \
                            f"backend {'was built' if built else 'refused it'}"


@FUZZ
@given(text=st.one_of(st.text(max_size=12), st.from_regex(
    r"\A\s?[0-9]{0,25}\.?[0-9]{0,4}\s?([kKmMgGtT]i?)?[bB]?(tok|tokens)?\s?\Z")))
def test_fuzz_sizes_parse_or_refuse(text: str) -> None:
    """Capacities (``10.24M``, ``80GiB``) and store sizes (``64K``): an int, or ConfigError."""
    try:
        assert parse_capacity(text, bytes_per_token=3, field_name="l1") >= 0
    except ConfigError as exc:
        assert str(exc).startswith("l1: ")
    try:
        assert parse_size(text) >= 1
    except ConfigError as exc:
        assert str(exc).startswith("storage: ")


# ---------------------------------------------------------------------- token inputs

_TOKEN_ITEMS = st.one_of(st.integers(-2**64, 2**64), st.booleans(), st.floats(),
                         st.builds(np.int64, st.integers(-2**63, 2**63 - 1)),
                         st.builds(np.uint64, st.integers(0, 2**64 - 1)),
                         st.builds(np.int8, st.integers(-128, 127)), st.none(), st.text(max_size=2))
_TOKEN_INPUTS = st.one_of(
    st.lists(_TOKEN_ITEMS, max_size=6), st.lists(st.integers(-2**63, 2**63 - 1), max_size=6),
    st.lists(_TOKEN_ITEMS, max_size=4).map(tuple),
    st.sampled_from([np.int16, np.uint32, np.uint64, np.float32, np.bool_, np.int64]).flatmap(
        lambda dt: st.lists(st.integers(0, 100), max_size=6).map(lambda x: np.array(x, dt))),
    st.sampled_from([torch.int8, torch.int32, torch.int64, torch.uint8, torch.float16,
                     torch.bool]).flatmap(lambda dt: st.lists(st.integers(0, 100), max_size=6)
                                          .map(lambda x: torch.tensor(x, dtype=dt))),
    st.sampled_from([torch.arange(12)[::3], torch.arange(12).reshape(3, 4).t()[0],
                     torch.arange(6).reshape(2, 3), torch.zeros(3, dtype=torch.int64,
                                                                device="meta"),
                     torch.tensor([1, 2, 3]).to_sparse(), np.arange(12)[::2], np.array(5),
                     "123", b"123", 5, None, {1: 2}, range(4)]),
)


@FUZZ
@given(tokens=_TOKEN_INPUTS)
def test_fuzz_token_inputs_are_ids_or_a_config_error(tokens: Any) -> None:
    """Any token input: a fresh copy of exactly the ids given (int32 if every id fits, else
    int64: never wrapped), or ConfigError."""
    try:
        arr = as_tokens(tokens)
    except ConfigError as exc:
        assert str(exc).startswith("tokens: "), str(exc)
        return
    given_ids = tokens.tolist() if isinstance(tokens, np.ndarray | torch.Tensor) else \
        [int(x) for x in tokens]
    fits = all(-(2**31) <= int(x) < 2**31 for x in given_ids)
    assert arr.dtype == (np.int32 if fits else np.int64) and arr.ndim == 1
    assert arr.tolist() == [int(x) for x in given_ids]


# ---------------------------------------------------------------------- ReplayConfig, EngineConfig


@FUZZ
@given(field=st.sampled_from(["kv_scale", "device_tokens", "host_tokens", "page_size",
                              "write_policy", "eviction", "host_layout", "time_mode",
                              "speedup", "concurrency", "storage", "prefetch_policy", "spec"]),
       value=WEIRD)
def test_fuzz_replay_config_is_checked_whole_at_construction(field: str, value: object) -> None:
    """A `ReplayConfig` that constructs makes its cache's config; one that does not raises a
    ConfigError naming a field."""
    fields: dict[str, Any] = {"spec": MODELS["tiny"], "device_tokens": 64, "host_tokens": 64,
                              "page_size": 16, "storage": None}
    try:
        config = ReplayConfig(**{**fields, field: value})
    except ConfigError as exc:
        assert re.match(r"^[a-z_0-9]+: ", str(exc)), str(exc)
        return
    config.cache_config()


@FUZZ
@given(field=st.sampled_from(["page_size", "device_tokens", "host_tokens", "compute_threads",
                              "max_running", "torch_threads"]), value=WEIRD)
def test_fuzz_engine_config_int_fields(field: str, value: object) -> None:
    """The engine's int settings: accepted only as what they will be used as."""
    try:
        config = EngineConfig(**{field: value})
    except ConfigError as exc:
        assert str(exc).startswith(field), str(exc)
        return
    if field == "torch_threads" and value is not None:  # set when the engine opens
        assert isinstance(config.torch_threads, int) and config.torch_threads >= 1


# ---------------------------------------------------------------------- defects found


def test_a_float_field_given_an_int_past_float_range_is_a_config_error() -> None:
    """``math.isfinite(10**400)`` raised OverflowError out of `check_number`."""
    with pytest.raises(ConfigError, match="^storage_cooldown: "):
        HiCacheConfig(**BASE, storage_cooldown=10**400)
    with pytest.raises(ConfigError, match="^speedup: "):
        ReplayConfig(spec=MODELS["tiny"], speedup=10**400)


def test_a_choice_field_given_a_numpy_array_is_a_config_error() -> None:
    """``array in (names)`` compared elementwise and raised ValueError ("truth value of an
    array ... is ambiguous")."""
    for field in ("host_layout", "write_policy", "io_backend", "prefetch_policy", "eviction"):
        with pytest.raises(ConfigError, match=f"^{field}: "):
            HiCacheConfig(**BASE, **{field: np.array(["lru", "page_first"])})
    with pytest.raises(ConfigError, match="^kind: "):
        KVSpec(kind=np.array(["mha", "mla"]), num_layers=1, num_kv_heads=1, head_dim=4,
               dtype="fp16")


def test_eviction_given_a_0d_array_is_refused_by_the_config_not_by_the_cache() -> None:
    """A 0-d array equals its name, so the config took it; `HiCache()` then allocated both
    pools and failed in the tree with "TypeError: iteration over a 0-d array"."""
    with pytest.raises(ConfigError, match="^eviction: "):
        HiCacheConfig(**BASE, eviction=np.array("arc"))


def test_a_file_url_max_concurrency_of_unicode_digits_is_a_config_error() -> None:
    """``'²'.isdigit()`` is True, ``int('²')`` a ValueError: `check_url` (and so HiCacheConfig,
    and ``--l3``) raised it."""
    with pytest.raises(ConfigError, match="^storage: .*max_concurrency"):
        check_url("file:///tmp/l3?max_concurrency=²")


def test_a_file_url_the_backend_refuses_is_refused_by_the_config(tmp_path: Any) -> None:
    """``max_concurrency=0`` passed `check_url` and HiCacheConfig; `HiCache()` allocated the
    pools, then the file store refused it (and ``serve --l3 ...`` loaded the model, then died
    with a traceback)."""
    url = f"file://{tmp_path}/l3?max_concurrency=0"
    with pytest.raises(ConfigError, match="^storage: .*max_concurrency"):
        check_url(url)
    with pytest.raises(ConfigError, match="^storage: .*max_concurrency"):
        HiCacheConfig(**BASE, storage=url)


@pytest.mark.parametrize("command", ["replay", "serve"])
def test_cli_l3_with_a_bad_option_value_is_a_usage_error(command: str, tmp_path: Any) -> None:
    """Before anything starts: no model loaded, no traceback."""
    for value in ("0", "²"):
        url = f"file://{tmp_path}/l3?max_concurrency={value}"
        result = CliRunner().invoke(cli, [command, "--l3", url])
        assert result.exit_code == 2, (result.output, result.exception)
        assert "'--l3'" in result.output and "max_concurrency" in result.output


def test_a_namespace_that_is_not_utf8_text_is_a_config_error() -> None:
    """A lone surrogate (``os.fsdecode`` of a non-UTF-8 name makes one) passed the config;
    a cache with L3 then failed in `HiCache()` with UnicodeEncodeError (the page format
    hashes the namespace's UTF-8)."""
    with pytest.raises(ConfigError, match="^namespace: "):
        HiCacheConfig(**BASE, namespace="model-\udcff", storage="memory://")


@pytest.mark.parametrize("tokens", [
    torch.zeros(3, dtype=torch.int64, device="meta"),
    torch.tensor([1, 2, 3]).to_sparse(),
], ids=["meta", "sparse"])
async def test_token_tensors_without_dense_data_are_a_config_error(tokens: torch.Tensor) -> None:
    """NotImplementedError ("Cannot copy out of meta tensor") and TypeError ("can't convert
    Sparse layout tensor to numpy") came out of `fetch`."""
    async with HiCache(HiCacheConfig(**BASE)) as cache:
        with pytest.raises(ConfigError, match="^tokens: "):
            cache.fetch(tokens)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_engine_config_torch_threads_is_checked_at_construction(value: object) -> None:
    """It was taken, and the engine's open raised torch's RuntimeError
    (``set_num_threads expects a positive integer``) with the model loaded."""
    with pytest.raises(ConfigError, match="^torch_threads: "):
        EngineConfig(torch_threads=value)


@pytest.mark.parametrize(("field", "value"), [
    ("page_size", 0), ("page_size", "16"), ("write_policy", "bogus"),
    ("host_layout", "rows"), ("prefetch_policy", "never"), ("storage", "bogus://x"),
    ("storage", "file:///tmp/x?max_concurrency=0"), ("spec", "llama3-8b"),
])
def test_replay_config_checks_every_field_at_construction(field: str, value: object) -> None:
    """They were checked only when the replay ran (`cache_config`): ``page_size=0`` was a
    ZeroDivisionError, ``page_size="16"`` a TypeError, a bad policy or URL a ConfigError
    after the temporary L3 was made."""
    fields: dict[str, Any] = {"spec": MODELS["tiny"], "device_tokens": 64}
    with pytest.raises(ConfigError, match=f"^{field}: "):
        ReplayConfig(**{**fields, field: value})
