"""The documentation as a specification, second pass (a new user trying what the README and
docs/*.md say, after the day's changes): the configuration reference lists every field, the
README names what `make test` needs beyond Python, the transformers adapter's sample and its
rollback run as written, and the docs name every family the server's `/metrics` prints.
tests/test_docs_review.py holds the first pass."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from aiohicache import HiCacheConfig

from .conftest import make_cache, make_tokens, prefill
from .test_docs_review import between, doc, python_block_after

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ config

def test_the_config_reference_lists_every_field() -> None:
    """docs/api.md's `HiCacheConfig` table stopped at `tp_tick_interval`: `storage` and the
    L3 fields (`prefetch_*`, `storage_*`, `backup_*`) were in no table, so a user reading the
    reference could not learn that L3 is configured there, nor its defaults. Every field is
    now named (`extra`, the plug-ins' dict, below the table); test_docs_review checks the
    defaults stated."""
    table = between(doc("api.md"), "### `HiCacheConfig`", "## `HiCache(")
    named = {name for line in table.splitlines() if line.startswith("| `")
             for name in re.findall(r"`(\w+)`", line.split("|")[1])}
    fields = {f.name for f in dataclasses.fields(HiCacheConfig) if f.init}
    assert "`extra`" in table
    assert fields - {"extra"} <= named, sorted(fields - {"extra"} - named)


# ------------------------------------------------------------------------------ README

def test_the_readme_names_the_programs_make_test_needs() -> None:
    """README: "Both work on a fresh machine with Python >= 3.11". `make test` runs the Redis,
    Redis Cluster and TLS tests, which start `redis-server` and `redis-cli --cluster create`
    themselves and fail (never skip) without them; `.ci/run` installs both, the README named
    neither, so `make test` on a fresh machine failed every Redis test."""
    fresh = between((ROOT / "README.md").read_text(), "Both work on a fresh machine", "\n\n")
    ci = (ROOT / ".ci" / "run").read_text()
    needed = set(re.findall(r"command -v (redis-\w+)", ci))
    assert needed == {"redis-server", "redis-cli"}, needed
    for program in sorted(needed):
        assert f"`{program}`" in fresh, f"the README does not say make test needs {program}"


# ------------------------------------------------------------------------------ serving

def words(n: int, *, seed: int = 0) -> list[int]:
    """`n` token ids of the tiny model's 256 (distinct seeds: distinct first tokens)."""
    return [(seed * 31 + i * 7) % 256 for i in range(n)]


def adapter_sample() -> str:
    return python_block_after(doc("serving.md"), "## The transformers adapter")


async def test_the_adapter_sample_and_its_rollback_run_as_written() -> None:
    """docs/serving.md's adapter sample runs as written (a tiny model in place of `model`),
    and its crop, "`past.crop(...)` (speculative decoding's rollback)", is the form
    transformers 5 takes: the doc said `past.crop(n)`, and a length `n` (transformers 4's
    form) is a `ValueError` there. Cropped as the doc says, what is left commits."""
    pytest.importorskip("transformers")
    from aiohicache.hf import tiny_llama

    model = tiny_llama(seed=3, vocab_size=256, hidden_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1)
    code = adapter_sample()
    for big, small in (("device_pages=4096", "device_pages=64"),):
        assert big in code, f"the sample no longer says {big!r}"
        code = code.replace(big, small)
    namespace: dict[str, Any] = {"model": model, "prompt": words(20)}
    exec(compile("async def sample():\n" + textwrap.indent(code, "    ") +
                 "    return cache, adapter\n", "docs/serving.md", "exec"), namespace)
    cache, adapter = await namespace["sample"]()
    assert cache.stats().requests == 1

    m = re.search(r"`past\.crop\((-?)(\w+)\)` \(speculative decoding's rollback",
                  doc("serving.md"))
    assert m is not None, "docs/serving.md no longer shows the rollback's crop"
    assert m.group(1) == "-", f"crop({m.group(2)}) is a length: transformers 5 refuses it"
    prompt = words(20, seed=4)
    async with make_cache_for(model) as cache:
        adapter = type(adapter)(model, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            past = out.past_key_values
            drafts = [7, 8, 9]
            for token in drafts:
                await adapter.decode(past, token)
            with pytest.raises(ValueError):
                past.crop(len(prompt) + 1)  # a length: not what transformers 5 takes
            past.crop(-2)  # the doc's form: two drafts rejected
            await adapter.commit_decoded(hit, out, prompt + drafts[:1])
        cache.check_invariants()


def make_cache_for(model: Any) -> Any:
    from aiohicache.hf import kv_spec

    return make_cache(spec=kv_spec(model.config, model.dtype), page_size=4, device_pages=32)


def named_families(text: str) -> set[str]:
    """Metric names a doc passage gives (`_x` short for `aiohicache_x`, labels dropped)."""
    names = set()
    for token in re.findall(r"`(aiohicache_\w+|_\w+)(?:\{[^}]*\})?`", text):
        names.add(token if token.startswith("aiohicache_") else "aiohicache" + token)
    return names


def test_the_docs_name_every_family_the_server_prints_itself() -> None:
    """docs/observability.md listed the server's own families as "its own
    `aiohicache_server_*` request counters, `aiohicache_requests_running`,
    `_generated_tokens_total`, `_uncached_fallbacks_total` and `_ttft_seconds`": the
    admission queue's `aiohicache_requests_waiting` and `aiohicache_busy_rejections_total`
    were missing. Both docs now name each family `/metrics` prints before the cache's."""
    pytest.importorskip("aiohttp")
    from aiohicache.serve.engine import Metrics

    printed = set(re.findall(r"^# TYPE (\w+) ", Metrics().render(None), flags=re.M))
    assert len(printed) == 9, printed
    observability = between(doc("observability.md"), "The server's `GET /metrics`", "\n\n")
    serving = between(doc("serving.md"), "| `GET /metrics` |", "\n")
    for where, text in (("observability.md", observability), ("serving.md", serving)):
        missing = printed - named_families(text)
        assert not missing, f"docs/{where} does not name {sorted(missing)}"


# ------------------------------------------------------------------------------ metrics

async def test_the_prometheus_samples_run_as_written() -> None:
    """docs/observability.md's two registry samples run as written: one cache with a
    constant label, several caches through one `MultiCacheCollector`."""
    pytest.importorskip("prometheus_client")
    text = doc("observability.md")
    one = python_block_after(text, "## Prometheus")
    several = python_block_after(text, "`MultiCacheCollector`, each with labels")
    async with make_cache() as a, make_cache() as b:
        await prefill(a, make_tokens(8))
        namespace: dict[str, Any] = {"cache": a, "caches": [a, b]}
        exec(compile(one, "docs/observability.md", "exec"), namespace)
        page = namespace["generate_latest"](namespace["registry"]).decode()
        assert 'aiohicache_requests_total{pod="a"} 1.0' in page
        namespace["registry"] = namespace["CollectorRegistry"]()
        exec(compile(several, "docs/observability.md", "exec"), namespace)
        page = namespace["generate_latest"](namespace["registry"]).decode()
        assert 'aiohicache_requests_total{rank="0"} 1.0' in page
        assert 'aiohicache_requests_total{rank="1"} 0.0' in page


def test_a_checkpoint_loads_as_the_serving_doc_says(tmp_path: Path) -> None:
    """docs/serving.md: `--model DIR` is "a local checkpoint: read with local_files_only,
    float32 on the CPU; no tokenizer there: bytes", served under the directory's name. (The
    doc said only "a checkpoint and its tokenizer": a user could not tell that a bf16
    checkpoint runs in float32 on the CPU, nor what a directory without one gets.)"""
    pytest.importorskip("aiohttp")
    import torch

    from aiohicache.hf import tiny_llama
    from aiohicache.serve import ByteTokenizer, load_model

    said = " ".join(between(doc("serving.md"), "# a local checkpoint:", "\naiohicache serve")
                    .replace("#", " ").split())
    assert "float32 on the CPU" in said and "no tokenizer there: bytes" in said, said
    saved = tiny_llama(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1).bfloat16()
    saved.save_pretrained(tmp_path / "my-model")
    model, tokenizer, name = load_model(str(tmp_path / "my-model"))
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert isinstance(tokenizer, ByteTokenizer) and name == "my-model"
