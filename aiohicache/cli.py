"""The ``aiohicache`` command: ``replay``, ``bench ...``, ``serve``, ``demo`` (``python -m
aiohicache``).

Subcommands are thin: they parse options, pick an event loop and call into the package;
``replay`` lives in `_cli_replay`, ``demo`` in `_cli_demo`, shared options in `_cli_common`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any, cast

import click
import torch
from click.core import ParameterSource

from . import __version__
from ._cli_common import (
    int_list,
    load_requests,
    loop_factory,
    loop_option,
    run,
    serve_tier_options,
)
from ._cli_demo import demo
from ._cli_replay import replay
from .bench import FULL, QUICK, run_core
from .bench.tree import bench_tree, format_tree
from .errors import ConfigError
from .memory._pools import _ID_BYTES, _physical_memory
from .radix._policy import PolicyName
from .replay.runner import parse_capacity

__all__ = ("cli", "loop_factory", "loop_option", "main")

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aiohicache")
def cli() -> None:
    """aiohicache: an asyncio-native hierarchical KV-cache manager for LLM serving."""


@cli.group()
def bench() -> None:
    """Benchmarks: numbers next to their targets.

    Never pass/fail: the targets are design goals, and the numbers depend on the machine.
    """


@bench.command("core")
@click.option("--quick", is_flag=True, help="Small sizes: seconds, for smoke tests.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, not tables.")
@click.option("--torch-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch.set_num_threads() first; 1 matches the CPU engine's copy threads.")
@loop_option
def bench_core(quick: bool, as_json: bool, torch_threads: int, loop: str) -> None:
    """Copy GB/s, loop lag under load, hit overhead.

    Three sections in one run: CPU page copy (gather/scatter) against one contiguous copy;
    event-loop lag while load-back and write-through run flat out; fetch->commit overhead of
    an all-L1 hit.
    """
    sizes = QUICK if quick else FULL
    factory = loop_factory(loop)
    torch.set_num_threads(torch_threads)
    if not as_json:
        run_core(sizes, loop_factory=factory, echo=click.echo)
        return
    report = run_core(sizes, loop_factory=factory)
    click.echo(json.dumps(dataclasses.asdict(report), indent=2))


@bench.command("storage")
@click.option("--quick", is_flag=True, help="Small sizes: seconds, for smoke tests.")
@click.option("--in-flight", type=click.IntRange(min=1), default=1, show_default=True,
              help="Store calls in flight at once (1: each awaited before the next).")
def bench_storage_cmd(quick: bool, in_flight: int) -> None:
    """File L3 vs raw sequential disk I/O of the same bytes; page-key hashing tokens/s."""
    from .bench.storage import run_storage_bench
    click.echo(run_storage_bench(quick, in_flight))


@bench.command("redis")
@click.option("--quick", is_flag=True, help="Small sizes: seconds, for smoke tests.")
def bench_redis_cmd(quick: bool) -> None:
    """Redis L3 vs a raw redis-py pipeline of the same payloads (starts its own server)."""
    from ._redis_server import RedisServerError
    from .bench.redis import run_redis_bench
    try:
        report = run_redis_bench(quick)
    except RedisServerError as exc:  # redis-server missing, or it did not start
        raise click.ClickException(str(exc)) from exc
    click.echo(report)


@bench.command("tp")
@click.option("--ranks", default="2,4", show_default=True, callback=int_list(2, 64),
              help="TP sizes, comma-separated.")
@click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Fetches per scheduler step.")
def bench_tp_cmd(ranks: list[int], steps: int, batch: int) -> None:
    """Consensus tick overhead per scheduler step, TP (gloo processes) vs one rank."""
    from .bench.tp import bench_tp, format_tp
    click.echo(format_tp(bench_tp(ranks, steps=steps, batch=batch)))


@bench.command("transfer")
@click.option("--pages", default="1,16,64,256", show_default=True, callback=int_list(1, 256),
              help="Page sizes (tokens), comma-separated.")
@click.option("--ctas", default="1,2,4,8,16,32", show_default=True,
              callback=int_list(1, 1024), help="CTA budgets of the kernel path, comma-separated.")
@click.option("--total-mb", type=click.IntRange(min=1), default=64, show_default=True,
              help="MiB (2**20 bytes) moved per copy.")
@click.option("--repeat", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--layout", type=click.Choice(["page_first", "layer_first"]),
              default="page_first", show_default=True, help="Host pool layout.")
def bench_transfer_cmd(pages: list[int], ctas: list[int], total_mb: int, repeat: int,
                       layout: str) -> None:
    """GPU page copies: kernel and direct paths vs one contiguous pinned copy (needs CUDA)."""
    from .bench.transfer import bench_transfer, format_transfer
    try:
        report = bench_transfer(page_sizes=pages, ctas=ctas, total_mb=total_mb,
                                repeat=repeat, layout=layout,  # type: ignore[arg-type]
                                echo=click.echo)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_transfer(report, ctas))


@bench.command("serve")
@click.argument("trace", default="mooncake")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=120,
              show_default=True, help="The trace's first N requests.")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sessions in flight at once.")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=4, show_default=True,
              help="Tokens generated per request.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=1, show_default=True,
              help="Token ids per trace block (scales the trace's prompts down; at most "
                   "the trace's block size).")
@serve_tier_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_serve_cmd(trace: str, num_requests: int, concurrency: int, max_tokens: int,
                    block_tokens: int, l1: int, l2: int, l3: str, as_json: bool) -> None:
    """TTFT and throughput over HTTP, with the cache vs recompute only, on one trace.

    Starts `aiohicache serve` twice on this machine (the tiny random Llama): with the cache,
    then with --no-cache, and sends both the same multi-turn sessions from TRACE ("mooncake",
    a Mooncake .jsonl or a kv-cache-tester .jsonl.gz) with real concurrency.
    """
    from .bench.serve import ServeBenchConfig, bench_modes, format_serve, sessions_from_trace

    try:
        requests = load_requests(trace, limit=num_requests)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if block_tokens > (smallest := min(r.block_size for r in requests)):
        # it scales prompts down: past the trace's blocks they would only grow (to TiB)
        raise click.BadParameter(f"{block_tokens} is more than the trace's blocks of "
                                 f"{smallest} tokens", param_hint="'--block-tokens'")
    sessions = sessions_from_trace(requests, block_tokens=block_tokens, vocab_size=32000)
    prompts = [len(p) for s in sessions for p in s]
    title = (f"aiohicache bench serve: {trace}, {len(prompts)} requests in {len(sessions)} "
             f"sessions, {concurrency} at once, prompts {min(prompts)}..{max(prompts)} tokens "
             f"(mean {sum(prompts) / len(prompts):.0f}), {max_tokens} generated each; cache "
             f"L1={l1} L2={l2} tokens, L3={l3}")
    config = ServeBenchConfig(concurrency=concurrency, max_tokens=max_tokens,
                              block_tokens=block_tokens,
                              server_args=("--l1", str(l1), "--l2", str(l2), "--l3", l3))
    click.echo(format_serve(bench_modes(sessions, config), title=title, as_json=as_json))


@bench.command("tree")
@click.argument("trace", default="mooncake")
@click.option("--limit", type=click.IntRange(min=1), default=None)
@click.option("--capacity", default="10.24M", show_default=True, help="Tokens.")
@click.option("--page-size", type=click.IntRange(1, 256), default=16, show_default=True)
@click.option("--eviction", type=click.Choice(["lru", "lfu", "arc"]), default="lru",
              show_default=True, help="The tree's eviction policy (its bookkeeping is timed).")
def bench_tree_cmd(trace: str, limit: int | None, capacity: str, page_size: int,
                   eviction: str) -> None:
    """Radix-tree bookkeeping per request on a trace (no transfers)."""
    try:
        tokens = _tree_capacity(capacity, page_size)
        requests = load_requests(trace, limit=limit)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(format_tree(bench_tree(requests, capacity_tokens=tokens, page_size=page_size,
                                      eviction=cast(PolicyName, eviction))))


def _tree_capacity(capacity: str, page_size: int) -> int:
    """``bench tree --capacity`` in tokens: at least one page, and page ids (`PageAllocator`'s)
    that fit this machine's memory, not numpy's error once allocating.

    Raises:
        ConfigError: ``capacity: ...``, a size in bytes included.
    """
    if capacity.strip()[-1:] in ("b", "B"):
        # NOTE: parse_capacity takes 4GiB too, but the bare tree stores no KV: with one byte
        # a token, "4GiB" would quietly be 4Gi tokens.
        raise ConfigError(f"capacity: {capacity!r} is bytes; bench tree stores no KV, give "
                          "tokens (10.24M, 512k)")
    tokens = parse_capacity(capacity, bytes_per_token=1, field_name="capacity")
    if tokens < page_size:
        raise ConfigError(f"capacity: {tokens:,} is less than one page ({page_size} tokens)")
    pages, ram = tokens // page_size, _physical_memory()
    if ram is not None and pages * _ID_BYTES > ram:
        raise ConfigError(f"capacity: {pages:,} pages need {pages * _ID_BYTES:,} bytes of page "
                          f"ids; this process may use {ram:,} bytes (RAM, or its cgroup's limit)")
    return tokens


def _served_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A name, if given: an empty one was the default name, unsaid."""
    if value is not None and not value.strip():
        raise click.BadParameter("must be a name (not empty)")
    return value


def _cache_options(ctx: click.Context, param: click.Parameter,
                   values: tuple[str, ...]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs as a dict, each value read as JSON (a number, true, a list: as a
    tuple), else kept as the string it is (``eviction=arc``)."""
    options: dict[str, Any] = {}
    for item in values:
        name, eq, text = item.partition("=")
        if not eq or not name.strip():
            raise click.BadParameter(f"{item!r} is not NAME=VALUE")
        if name.strip() in options:
            raise click.BadParameter(f"{name.strip()!r} is given twice")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        # NOTE: JSON has no tuple: a list is one (eviction's (L1, L2) pair was refused)
        options[name.strip()] = tuple(value) if isinstance(value, list) else value
    return options


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="0: any free port (the URL is printed).")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False),
              default=None, help="A local HF checkpoint directory (default: a tiny random "
                                 "Llama built in-process; nothing is downloaded).")
@click.option("--served-model-name", default=None, callback=_served_name,
              help="The name requests' `model` must give, and /v1/models lists (default: "
                   "the checkpoint directory's name, or tiny-llama).")
@click.option("--page-size", type=click.IntRange(1, 256), default=16, show_default=True)
@serve_tier_options
@click.option("--no-cache", is_flag=True,
              help="No cache at all: every prompt is recomputed (a baseline to compare).")
@click.option("--cache-option", "cache_options", multiple=True, callback=_cache_options,
              metavar="NAME=VALUE", help="A further HiCacheConfig field for the cache, e.g. "
              "eviction=arc, write_policy=write_back, prefetch_threshold=64 (VALUE read as "
              "JSON, else as a string); repeatable.")
@click.option("--compute-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Forward passes that run at once.")
@click.option("--max-running", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests generating at once; more wait before touching the cache.")
@click.option("--max-waiting", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Requests that may wait for a turn (reading, tokenizing or queued); one "
                   "more gets a 503 (Retry-After).")
@click.option("--torch-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch's intra-op threads (the CPU copy engine sets 1 process-wide anyway).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights of the tiny random model.")
@click.option("--shutdown-timeout", type=click.FloatRange(0, 3600), default=5.0,
              show_default=True, help="Seconds requests in flight get to finish on Ctrl-C "
                                      "or SIGTERM before they are cancelled.")
@click.option("--stall-timeout", type=click.FloatRange(0, 3600, min_open=True), default=30.0,
              show_default=True, help="Seconds a streaming client may take none of its "
                                      "stream before it is cut off (its turn and pages let "
                                      "go).")
@click.option("--read-timeout", type=click.FloatRange(0, 3600, min_open=True), default=60.0,
              show_default=True, help="Seconds a client may take to send a request's "
                                      "headers (an idle connection is closed then), and as "
                                      "long again for its body (then a 408).")
@click.option("--max-connections", type=click.IntRange(min=1), default=None,
              help="Connections open at once; one more closes the one idle longest, or "
                   "with none idle, gets a 503 (default: half the open-file limit).")
@loop_option
def serve(host: str, port: int, model_path: str | None, served_model_name: str | None,
          page_size: int, l1: int, l2: int,
          l3: str, no_cache: bool, cache_options: dict[str, Any], compute_threads: int,
          max_running: int, max_waiting: int, torch_threads: int, seed: int,
          shutdown_timeout: float, stall_timeout: float, read_timeout: float,
          max_connections: int | None, loop: str) -> None:
    """OpenAI-compatible completions server: an HF model generating through the cache.

    POST /v1/completions and /v1/chat/completions (streaming and not), GET /metrics
    (Prometheus), /health, /v1/models.
    Needs the serve extra: pip install 'aiohicache[serve]'.
    """
    from .serve import EngineConfig
    from .serve import serve as run_server

    if no_cache:
        _refuse_with_no_cache()
    with tempfile.TemporaryDirectory(prefix="aiohicache-l3-") as tmp:
        storage = None if l3 == "none" else f"file://{tmp}" if l3 == "tmp" else l3
        try:
            config = EngineConfig(page_size=page_size, device_tokens=l1, host_tokens=l2,
                                  storage=storage, use_cache=not no_cache,
                                  cache_options=cache_options,
                                  compute_threads=compute_threads, max_running=max_running,
                                  max_waiting=max_waiting, torch_threads=torch_threads)
        except ConfigError as exc:  # the tiers: named by their flags
            flag = {"device_tokens": "--l1", "host_tokens": "--l2",
                    "cache_options": "--cache-option", "storage": "--l3"}
            field_name, _, why = str(exc).partition(": ")
            why = why.replace("host_tokens 0", "--l2 0")  # the flag the user gave
            raise click.BadParameter(why, param_hint=f"'{flag.get(field_name, field_name)}'") \
                from None

        engine, name = _serve_engine(model_path, seed, config, served_model_name)

        def ready(url: str) -> None:
            mode = "no cache (recompute)" if no_cache else f"cache L1={l1} L2={l2} tokens, L3={l3}"
            click.echo(f"aiohicache serve: {name} on {url} ({mode})")  # echo flushes

        _serve_until_stopped(functools.partial(run_server, engine, host, port, on_ready=ready,
                                               shutdown_timeout=shutdown_timeout,
                                               stall_timeout=stall_timeout,
                                               read_timeout=read_timeout,
                                               max_connections=max_connections), loop)


def _refuse_with_no_cache() -> None:
    """The cache's options with ``--no-cache`` are a usage error: the user meant a cache
    the server would not have (they were ignored, unsaid)."""
    ctx = click.get_current_context()
    for name in ("page_size", "l1", "l2", "l3", "cache_options"):
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT,
                                                  ParameterSource.DEFAULT_MAP):
            flag = "cache-option" if name == "cache_options" else name.replace("_", "-")
            raise click.UsageError(f"'--{flag}' sets up the cache: --no-cache has none")


def _serve_engine(model_path: str | None, seed: int, config: Any,
                  served_name: str | None) -> tuple[Any, str]:
    """The model loaded and its engine (not opened), and the name it is served under."""
    from .serve import Engine, load_model

    try:
        model, tokenizer, name = load_model(model_path, seed=seed)
        name = served_name or name
        return Engine(model, tokenizer, config, name=name), name
    except ConfigError as exc:
        field_name, _, why = str(exc).partition(": ")
        if field_name == "storage":  # the cache's config: an --l3 it cannot use
            raise click.BadParameter(why, param_hint="'--l3'") from None
        raise click.UsageError(str(exc)) from exc


def _serve_until_stopped(serving: Callable[[], Awaitable[None]], loop: str) -> None:
    """Run `serving` until Ctrl-C or SIGTERM; a host or port it cannot listen on is one line.

    SIGTERM (a supervisor, `bench serve`) stops it as Ctrl-C does: requests drain, the
    cache closes and the `--l3 tmp` directory is removed (killed, it stayed).
    """
    import asyncio
    import signal

    import anyio

    from .serve import ListenError

    async def until_stopped() -> None:
        with anyio.CancelScope() as scope:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, scope.cancel)
            await serving()

    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: drained, cache closed
            run(until_stopped, loop=loop)
    except ListenError as exc:
        raise click.ClickException(str(exc)) from None
    except ConfigError as exc:  # the engine opening: a store that refuses its --l3 URL
        field_name, _, why = str(exc).partition(": ")
        if field_name == "storage":
            raise click.BadParameter(why, param_hint="'--l3'") from None
        raise click.UsageError(str(exc)) from None


cli.add_command(demo)
cli.add_command(replay)


def main() -> None:
    """Console entry point (``aiohicache``, ``python -m aiohicache``)."""
    cli(prog_name="aiohicache")
