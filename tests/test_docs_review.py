"""The documentation as a specification (from a docs review): code samples run as written,
and the names, defaults, errors, metrics and options the docs state are the code's. Each
test reads the doc it checks, so a doc and the code cannot drift apart unnoticed.
tests/test_contract_review.py runs the README's sample; tests/testing/test_plugin.py runs
docs/testing.md's."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import aiohicache
from aiohicache import ConfigError, HiCacheConfig
from aiohicache.controller import page_format
from aiohicache.storage import MemoryBackend, backend_from_url, check_url
from aiohicache.storage.factory import URL_OPTIONS

from .conftest import make_cache, make_config, make_tokens, prefill

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def between(text: str, start: str, end: str) -> str:
    """The part of `text` after `start` and before the next `end`."""
    assert start in text, f"the doc no longer says {start!r}"
    return text.split(start, 1)[1].split(end, 1)[0]


def python_block_after(text: str, marker: str) -> str:
    return between(between(text, marker, "\n```\n") + "\n```\n", "```python\n", "```")


# ------------------------------------------------------------------------------ samples

async def test_the_streaming_replay_sample_runs_as_written(tmp_path: Path) -> None:
    """docs/replay.md: "`replay()` takes the stream directly". The sample built
    `ReplayConfig(time_mode="timestamps", speedup=100.0)`, whose defaults are the model's full
    size (kv_scale 1: 1M tokens of Llama-3-8B KV, 128 GiB of L1): it raised
    `ConfigError("device_pages: 62,500 pages need 131,072,562,500 bytes ...")` on any machine
    short of 640 GiB. It now sizes the cache as the CLI does."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 1024,
                                         "output_length": 1, "hash_ids": [0, 1]}) + "\n"
                             for i in range(3)))
    code = python_block_after(doc("replay.md"), "`replay()` takes the stream directly")
    assert '"trace.jsonl"' in code, "the sample no longer reads trace.jsonl"
    code = code.replace('"trace.jsonl"', repr(str(trace)))
    namespace: dict[str, Any] = {}
    exec(compile("async def sample():\n" + textwrap.indent(code, "    ") +
                 "    return result\n", "docs/replay.md", "exec"), namespace)
    result = await namespace["sample"]()
    assert result.requests == 3 and result.prompt_tokens == 3 * 1024
    assert result.l1_tokens == 2 * 1024  # the two repeats hit their 4 whole pages of 256


# ------------------------------------------------------------------------------ names

NOT_NAMES = {"aiohicache.cached_tiers", "aiohicache.token_ids"}
"""Fields of the server's JSON response (docs/serving.md), not Python names."""


def top_level_names(module: Path) -> set[str]:
    """Names a module's source defines or imports at its top level (read, not imported:
    importing `aiohicache.hf` alone takes seconds, transformers)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target)
                         if isinstance(n, ast.Name))
    return names


def exists(dotted: str) -> bool:
    """Whether `dotted` (``aiohicache.x.y``) names a module of the package or a name one of
    them defines; `aiohicache._kernels` is the data package the install makes of kernels/."""
    if dotted == "aiohicache._kernels":
        return (ROOT / "kernels").is_dir()
    path, parts = ROOT / "aiohicache", dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if (path / part / "__init__.py").is_file():
            path = path / part
        elif (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
        else:
            module = path / "__init__.py" if path.is_dir() else path
            return i == len(parts) - 1 and part in top_level_names(module)
        if path.suffix == ".py" and i < len(parts) - 1:
            return len(parts) - i == 2 and parts[-1] in top_level_names(path)
    return True


def test_every_dotted_name_the_docs_mention_exists() -> None:
    """docs/storage.md told users to build a store object's format with
    `aiohicache.l3.page_format(config)`: there is no `aiohicache.l3` (it is
    `aiohicache.controller.page_format`). Every `aiohicache.x.y` a doc names must exist."""
    named = {(m.group(0), path.name) for path in DOCS
             for m in re.finditer(r"\baiohicache(?:\.[A-Za-z_]\w*)+", path.read_text())}
    assert len(named) > 30
    missing = [f"{where}: {dotted}" for dotted, where in sorted(named)
               if dotted not in NOT_NAMES and not exists(dotted)]
    assert not missing, "\n".join(missing)


def error_tree() -> list[tuple[str, str | None, str | None]]:
    """docs/api.md's error tree: (name, parent, builtin base) per line."""
    block = between(doc("api.md"), "## Errors\n\n```\n", "```")
    rows, parents = [], {}
    for line in block.splitlines():
        m = re.match(r"^([ │├└─]*)(\w+)(?: \((\w+)\))?", line)
        assert m is not None, line
        depth = len(m.group(1)) // 4
        parents[depth] = m.group(2)
        rows.append((m.group(2), parents[depth - 1] if depth else None, m.group(3)))
    return rows


def test_every_error_of_the_api_reference_is_exported_with_its_bases() -> None:
    """docs/api.md: "Everything public is re-exported from `aiohicache`", and its error tree
    lists `TPError`, `RankTimeoutError` and `DivergenceError`, the errors every rank of a TP
    cache raises when it stops serving. They were only in `aiohicache.errors`:
    `except aiohicache.RankTimeoutError` was an AttributeError raised while handling one."""
    rows = error_tree()
    assert len(rows) >= 15
    for name, parent, builtin in rows:
        assert name in aiohicache.__all__, f"{name} is not in aiohicache.__all__"
        cls = getattr(aiohicache, name)
        if parent is not None:
            assert cls.__bases__[0] is getattr(aiohicache, parent), name
        if builtin is not None:
            assert issubclass(cls, getattr(builtins, builtin)), name


# ------------------------------------------------------------------------------ config

def test_the_config_table_of_the_api_reference_has_the_dataclass_defaults() -> None:
    """docs/api.md's `HiCacheConfig` table: every field it names exists with the default it
    states ("required" for fields without one)."""
    table = between(doc("api.md"), "### `HiCacheConfig`", "## `HiCache(")
    fields = {f.name: f for f in dataclasses.fields(HiCacheConfig) if f.init}
    checked = 0
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`(\w+)`", cells[0])
        defaults = [d.strip().strip("`") for d in cells[1].split(" / ")]
        assert len(names) == len(defaults), line
        for name, stated in zip(names, defaults, strict=True):
            default = fields[name].default
            if stated == "required":
                assert default is dataclasses.MISSING, name
            else:
                assert repr(default).replace("'", '"') == stated, (name, default, stated)
            checked += 1
    assert checked >= 20


# ------------------------------------------------------------------------------ storage

async def test_the_key_rule_of_the_storage_doc_is_the_backends() -> None:
    """docs/storage.md said keys are 32 lowercase hex characters and backends reject anything
    else; they take 16-128 (the SGLang plug-in stores 64-character keys). The stated range
    is the one enforced, at both ends."""
    m = re.search(r"Keys are (\d+)-(\d+) lowercase hex characters", doc("storage.md"))
    assert m is not None, "docs/storage.md no longer states the key rule as a range"
    low, high = int(m.group(1)), int(m.group(2))
    async with MemoryBackend(page_format(make_config())) as store:
        for n in (low, 32, 64, high):
            assert await store.exists(["a" * n]) == 0, n  # a valid key, absent
        for key in ("a" * (low - 1), "a" * (high + 1), "A" * 32):
            with pytest.raises(ConfigError, match="storage key"):
                await store.exists([key])


def test_the_url_options_the_storage_doc_lists_are_the_factorys() -> None:
    """docs/storage.md lists the query options of memory and file URLs; the factory's
    `URL_OPTIONS` are exactly those."""
    text = between(doc("storage.md"), "Memory and file URLs take their options", "Redis and")
    listed = set(re.findall(r"`(\w+)=", text)) | set(re.findall(r"\(`(\w+)` with", text))
    assert listed == set(URL_OPTIONS["file"]), listed
    assert set(URL_OPTIONS["memory"]) <= listed


def test_the_file_store_sizing_advice_can_be_followed_by_url(tmp_path: Path) -> None:
    """docs/storage.md, "Sizing the file store": raise `compact_dead_fraction` toward 0.8 to
    trade compaction copying for disk. A store made from a URL (`--l3`,
    `HiCacheConfig(storage=...)`, the SGLang plug-in's `storage_url`) could not: the option
    was refused ("file URLs take the options [...]"). Now a URL sets it, checked as the store
    checks it."""
    fmt = page_format(make_config())
    store = backend_from_url(f"file://{tmp_path}?max_bytes=200G&compact_dead_fraction=0.8", fmt)
    assert store.compact_dead_fraction == 0.8  # type: ignore[attr-defined]
    for bad in ("1.5", "-0.1", "nan", "x", ""):
        with pytest.raises(ConfigError, match="storage: compact_dead_fraction"):
            check_url(f"file://{tmp_path}?compact_dead_fraction={bad}")
    with pytest.raises(ConfigError, match="take the options"):
        check_url("memory://?compact_dead_fraction=0.8")  # a file store's knob only


def test_the_url_rules_of_the_api_reference_accept_the_storage_docs_urls() -> None:
    """docs/api.md called "anything after `memory://`" and "a `file:` URL with a ... query"
    malformed, while docs/storage.md configures stores with `memory://?max_bytes=4G` and
    `file:///var/kv?max_bytes=200G`, which `check_url` takes. The examples pass, and the
    reference no longer names a query as malformed."""
    for url in ("memory://?max_bytes=4G", "file:///var/kv?max_bytes=200G"):
        assert url in doc("storage.md")
        check_url(url)
    rules = between(doc("api.md"), "**Malformed storage URLs.**", "\n\n")
    assert "host, port, query" not in rules
    assert "anything after `memory://`," not in rules


# ------------------------------------------------------------------------------ metrics

async def test_the_metrics_table_is_what_a_scrape_prints() -> None:
    """docs/observability.md's table: every family a cache with L3 prints, with its type and
    labels, and nothing else (the TP tick summary needs `tp_size > 1`, the server's evicted
    keys a Redis store: tests/test_l3_evictions_review.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    from aiohicache.metrics import render

    table = between(doc("observability.md"), "| metric | type | labels | meaning |", "\n\n")
    stated = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`").removesuffix("_total")
        kind = cells[1].split()[0]
        stated[name] = (kind, set(re.findall(r"`(\w+)`\s*=", cells[2])) or
                        set(re.findall(r"^`(\w+)`$", cells[2])))
    async with make_cache(storage="memory://?max_bytes=1M") as cache:
        await prefill(cache, make_tokens(8))
        text = render(cache).decode()
    printed = {f.name: (f.type, {k for s in f.samples for k in s.labels} - {"le"})
               for f in text_string_to_metric_families(text)}
    assert set(stated) - set(printed) == {"aiohicache_tp_tick_seconds",
                                          "aiohicache_storage_server_evicted_keys"}
    assert set(printed) <= set(stated), set(printed) - set(stated)
    for name, (kind, labels) in printed.items():
        assert stated[name] == (kind, labels), name
