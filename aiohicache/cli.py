"""The ``aiohicache`` command: ``replay``, ``bench core``, ``demo`` (``python -m aiohicache``).

Subcommands are thin: they parse options, pick an event loop and call into the package.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

import click
import torch
from tqdm import tqdm

from . import __version__
from .api import FetchContext, HiCache
from .bench import FULL, QUICK, run_core
from .bench.tree import bench_tree, format_tree
from .config import HiCacheConfig, KVSpec
from .errors import ConfigError
from .replay import Request, load_trace
from .replay.report import format_result, format_sweep, plot_sweep, to_json
from .replay.runner import (
    MODELS,
    ReplayConfig,
    ReplayResult,
    eviction_tiers,
    parse_capacity,
    sweep_configs,
)
from .replay.runner import replay as run_replay
from .storage import check_url

__all__ = ("cli", "loop_factory", "loop_option", "main")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
F = TypeVar("F", bound=Callable[..., Any])

LOOPS = ("asyncio", "uvloop")


def loop_factory(name: str) -> LoopFactory:
    """The event loop constructor named by ``--loop``."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            raise click.BadParameter("uvloop is not installed (pip install uvloop)",
                                     param_hint="--loop") from exc
        return uvloop.new_event_loop
    return asyncio.new_event_loop


def loop_option(f: F) -> F:
    """``--loop asyncio|uvloop``, shared by every subcommand that runs a loop."""
    return click.option("--loop", "loop", type=click.Choice(LOOPS), default="asyncio",
                        show_default=True, help="Event loop to run on.")(f)


def _comma_list(ctx: click.Context, param: click.Parameter, text: str | None) -> list[str] | None:
    """Callback of a comma-separated option: its items; an empty or blank item (``1,,2``,
    ``,``, ``""``) is a usage error naming the option."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise click.BadParameter(f"comma-separated values, none empty, got {text!r}")
    return items


def _int_list(lo: int, hi: int) -> Callable[[click.Context, click.Parameter, str], list[int]]:
    """Callback of a comma-separated option of ints in ``lo..hi``."""
    def parse(ctx: click.Context, param: click.Parameter, text: str) -> list[int]:
        try:
            values = [int(x) for x in _comma_list(ctx, param, text) or []]
        except ValueError:
            raise click.BadParameter(f"comma-separated ints, got {text!r}") from None
        if not all(lo <= v <= hi for v in values):
            raise click.BadParameter(f"ints in {lo}..{hi}, got {text!r}")
        return values
    return parse


def _evictions(ctx: click.Context, param: click.Parameter, text: str) -> list[str]:
    """Callback of ``replay --eviction``: policies (or L1:L2 pairs), comma-separated."""
    items = _comma_list(ctx, param, text) or []
    for item in items:
        try:
            eviction_tiers(item)
        except ConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix("eviction: ")) from None
    return items


def _l3_url(ctx: click.Context, param: click.Parameter, text: str) -> str:
    """Callback of ``--l3``: a malformed URL is a usage error before anything starts."""
    if text not in ("tmp", "none"):
        try:
            check_url(text)
        except ConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix("storage: ")) from None
    return text


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
def bench_storage_cmd(quick: bool) -> None:
    """File L3 vs raw sequential disk I/O of the same bytes; page-key hashing tokens/s."""
    from .bench.storage import run_storage_bench
    click.echo(run_storage_bench(quick))


@bench.command("redis")
@click.option("--quick", is_flag=True, help="Small sizes: seconds, for smoke tests.")
def bench_redis_cmd(quick: bool) -> None:
    """Redis L3 vs a raw redis-py pipeline of the same payloads (starts its own server)."""
    from .bench.redis import run_redis_bench
    click.echo(run_redis_bench(quick))


@bench.command("tp")
@click.option("--ranks", default="2,4", show_default=True, callback=_int_list(2, 64),
              help="TP sizes, comma-separated.")
@click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Fetches per scheduler step.")
def bench_tp_cmd(ranks: list[int], steps: int, batch: int) -> None:
    """Consensus tick overhead per scheduler step, TP (gloo processes) vs one rank."""
    from .bench.tp import bench_tp, format_tp
    click.echo(format_tp(bench_tp(ranks, steps=steps, batch=batch)))


@bench.command("transfer")
@click.option("--pages", default="1,16,64,256", show_default=True, callback=_int_list(1, 256),
              help="Page sizes (tokens), comma-separated.")
@click.option("--ctas", default="1,2,4,8,16,32", show_default=True,
              callback=_int_list(1, 1024), help="CTA budgets of the kernel path, comma-separated.")
@click.option("--total-mb", type=click.IntRange(min=1), default=64, show_default=True,
              help="Bytes moved per copy.")
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


def _serve_tier_options(f: F) -> F:
    """``--l1``/``--l2`` (tokens) and ``--l3`` of a server's cache (serve, bench serve)."""
    f = click.option("--l3", "l3", default="none", show_default=True, callback=_l3_url,
                     help="L3: a URL (file:///dir, redis://host:port/0, memory://), 'tmp' (a "
                          "temporary file store) or 'none'.")(f)
    f = click.option("--l2", "l2", type=click.IntRange(min=0), default=65536,
                     show_default=True, help="L2 (host pool) capacity in tokens; 0 for none.")(f)
    return click.option("--l1", "l1", type=click.IntRange(min=1), default=16384,
                        show_default=True, help="L1 (device pool) capacity in tokens.")(f)


@bench.command("serve")
@click.argument("trace", default="mooncake")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=120,
              show_default=True, help="The trace's first N requests.")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sessions in flight at once.")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=4, show_default=True,
              help="Tokens generated per request.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=1, show_default=True,
              help="Token ids per trace block (scales the trace's prompts down).")
@_serve_tier_options
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
        requests = load_trace(trace, limit=num_requests)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
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
def bench_tree_cmd(trace: str, limit: int | None, capacity: str, page_size: int) -> None:
    """Radix-tree bookkeeping per request on a trace (no transfers)."""
    try:
        tokens = parse_capacity(capacity, bytes_per_token=1, field_name="capacity")
        requests = load_trace(trace, limit=limit)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(format_tree(bench_tree(requests, capacity_tokens=tokens, page_size=page_size)))


@cli.command()
@loop_option
def demo(loop: str) -> None:
    """A short end-to-end tour on CPU.

    Shows fetch/allocate/commit, write-through, eviction, load-back with layer_ready, and
    stats().
    """
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(_demo(click.echo))


_POLICIES = ("write_through", "write_through_selective", "write_back")


@cli.command()
@click.argument("trace", default="mooncake")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests.")
@click.option("--model", type=click.Choice(sorted(MODELS)), default="llama3-8b",
              show_default=True, help="KV size per token from a model preset.")
@click.option("--layers", type=int, default=None, help="Explicit MHA spec: layers ...")
@click.option("--kv-heads", type=int, default=None, help="... KV heads per layer ...")
@click.option("--head-dim", type=int, default=None, help="... head dimension ...")
@click.option("--dtype", default="bf16", show_default=True, help="... and dtype.")
@click.option("--kv-scale", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Divide bytes per token by this so production capacities fit a laptop.")
@click.option("--l1", "l1", default="1M", show_default=True,
              help="L1 capacity: tokens (256k, 1M) or model bytes (32GiB).")
@click.option("--l2", "l2", default="4M", show_default=True,
              help="L2 capacity: tokens or model bytes; 0 for a single tier.")
@click.option("--l3", "l3", default="tmp", show_default=True, callback=_l3_url,
              help="L3: 'tmp' (a temporary file store), 'none', or a URL (file:///dir, "
                   "redis://host:port/0, memory://).")
@click.option("--prefetch-policy", type=click.Choice(["wait_complete", "timeout", "best_effort"]),
              default="wait_complete", show_default=True)
@click.option("--page-size", type=click.IntRange(1, 256), default=256, show_default=True,
              help="Tokens per page (L3 stores one object per page).")
@click.option("--write-policy", type=click.Choice(_POLICIES), default="write_through",
              show_default=True)
@click.option("--eviction", default="lru", show_default=True, callback=_evictions,
              help="Eviction policy: lru, lfu, arc, or opt (Belady's offline optimum); "
                   "L1:L2 for one per tier (arc:lru); comma-separated to compare policies.")
@click.option("--host-layout", type=click.Choice(["page_first", "layer_first"]),
              default="page_first", show_default=True)
@click.option("--time", "time_mode", type=click.Choice(["fast", "timestamps"]), default="fast",
              show_default=True, help="As fast as possible, or honour arrival times.")
@click.option("--speedup", type=float, default=1.0, show_default=True,
              help="With --time timestamps: replay this many times faster than recorded.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests in flight at once (1: sequential, deterministic).")
@click.option("--settle/--no-settle", default=True, show_default=True,
              help="Sequential replays: let each request's copies settle before the next "
                   "(same numbers every run).")
@click.option("--sweep", default=None, callback=_comma_list,
              help="Comma-separated L1 capacities: print the hit-ratio curve.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="With --sweep: write the curve as a PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@loop_option
def replay(trace: str, limit: int | None, model: str, layers: int | None,
           kv_heads: int | None, head_dim: int | None, dtype: str, kv_scale: int, l1: str,
           l2: str, l3: str, prefetch_policy: str, page_size: int, write_policy: str,
           eviction: list[str], host_layout: str,
           time_mode: str, speedup: float, concurrency: int, settle: bool,
           sweep: list[str] | None,
           plot: str | None, as_json: bool, no_progress: bool, loop: str) -> None:
    """Replay a serving trace through a real cache and report what each tier served.

    TRACE is "mooncake" (a bundled 2,000-request slice of the Mooncake conversation trace),
    "synthetic", a Mooncake-format .jsonl file, or a kv-cache-tester .jsonl.gz file.
    Several --eviction policies replay one after another and print side by side.
    """
    try:
        spec = _replay_spec(model, layers, kv_heads, head_dim, dtype)
        base = ReplayConfig(
            spec=spec, kv_scale=kv_scale, page_size=page_size,
            device_tokens=parse_capacity(l1, bytes_per_token=spec.bytes_per_token,
                                         field_name="l1"),
            host_tokens=parse_capacity(l2, bytes_per_token=spec.bytes_per_token,
                                       field_name="l2"),
            write_policy=write_policy, eviction=eviction[0],  # type: ignore[arg-type]
            host_layout=host_layout, time_mode=time_mode,  # type: ignore[arg-type]
            speedup=speedup, concurrency=concurrency, settle=settle,
            storage=None if l3 == "none" else l3,
            prefetch_policy=prefetch_policy)  # type: ignore[arg-type]
        configs = sweep_configs(base, [base.device_tokens] if sweep is None else
                                _sweep_tokens(sweep, spec.bytes_per_token), eviction)
        requests = load_trace(trace, limit=limit)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        results = [_replay_one(c, requests, loop, progress=not (no_progress or as_json))
                   for c in configs]
    except ConfigError as exc:  # e.g. a pool larger than the machine: device_pages from --l1
        raise click.UsageError(str(exc)) from exc
    _print_replay(results, trace, as_json=as_json, swept=sweep is not None or len(eviction) > 1)
    if plot is not None:
        plot_sweep(results, plot, title=f"aiohicache replay: {os.path.basename(trace)}")
        if not as_json:
            click.echo(f"plot written to {plot}")


def _sweep_tokens(sweep: list[str], bytes_per_token: int) -> list[int]:
    try:
        return [parse_capacity(x, bytes_per_token=bytes_per_token, field_name="sweep")
                for x in sweep]
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("sweep: "),
                                 param_hint="'--sweep'") from None


def _replay_spec(model: str, layers: int | None, kv_heads: int | None,
                 head_dim: int | None, dtype: str) -> KVSpec:
    explicit = (layers, kv_heads, head_dim)
    if all(x is None for x in explicit):
        return MODELS[model]
    if any(x is None for x in explicit):
        raise ConfigError("spec: --layers, --kv-heads and --head-dim go together")
    return KVSpec.mha(num_layers=layers, num_kv_heads=kv_heads,  # type: ignore[arg-type]
                      head_dim=head_dim, dtype=dtype)  # type: ignore[arg-type]


def _replay_one(config: ReplayConfig, requests: list[Request], loop: str, *,
                progress: bool) -> ReplayResult:
    with tqdm(total=len(requests), unit="req", disable=not progress, leave=False,
              desc=f"replay {config.eviction} L1={config.device_tokens:,} tokens") as bar, \
            asyncio.Runner(loop_factory=loop_factory(loop)) as runner:

        def advance(n: int) -> None:
            bar.update(n)

        return runner.run(run_replay(config, requests, progress=advance))


def _print_replay(results: list[ReplayResult], trace: str, *, as_json: bool,
                  swept: bool) -> None:
    if as_json:
        click.echo(to_json(results))
        return
    for r in results if not swept else results[:0]:
        click.echo(format_result(r, title=f"aiohicache replay: {trace}"))
    if swept:
        click.echo(f"aiohicache replay: {trace}, hit ratio vs L1 capacity and eviction\n"
                   if len({r.eviction for r in results}) > 1 else
                   f"aiohicache replay: {trace}, hit ratio vs L1 capacity\n")
        click.echo(format_sweep(results))


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="0: any free port (the URL is printed).")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False),
              default=None, help="A local HF checkpoint directory (default: a tiny random "
                                 "Llama built in-process; nothing is downloaded).")
@click.option("--page-size", type=click.IntRange(1, 256), default=16, show_default=True)
@_serve_tier_options
@click.option("--no-cache", is_flag=True,
              help="No cache at all: every prompt is recomputed (a baseline to compare).")
@click.option("--compute-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Forward passes that run at once.")
@click.option("--max-running", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests generating at once; more wait before touching the cache.")
@click.option("--torch-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch's intra-op threads (the CPU copy engine sets 1 process-wide anyway).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights of the tiny random model.")
@loop_option
def serve(host: str, port: int, model_path: str | None, page_size: int, l1: int, l2: int,
          l3: str, no_cache: bool, compute_threads: int, max_running: int,
          torch_threads: int, seed: int, loop: str) -> None:
    """OpenAI-compatible completions server: an HF model generating through the cache.

    POST /v1/completions (streaming and not), GET /metrics (Prometheus), /health, /v1/models.
    Needs the serve extra: pip install 'aiohicache[serve]'.
    """
    from .serve import Engine, EngineConfig, load_model
    from .serve import serve as run_server

    with tempfile.TemporaryDirectory(prefix="aiohicache-l3-") as tmp:
        storage = None if l3 == "none" else f"file://{tmp}" if l3 == "tmp" else l3
        config = EngineConfig(page_size=page_size, device_tokens=l1, host_tokens=l2,
                              storage=storage, use_cache=not no_cache,
                              compute_threads=compute_threads, max_running=max_running,
                              torch_threads=torch_threads)
        try:
            model, tokenizer, name = load_model(model_path, seed=seed)
            engine = Engine(model, tokenizer, config, name=name)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc

        def ready(url: str) -> None:
            mode = "no cache (recompute)" if no_cache else f"cache L1={l1} L2={l2} tokens, L3={l3}"
            click.echo(f"aiohicache serve: {name} on {url} ({mode})")  # echo flushes

        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner, \
                contextlib.suppress(KeyboardInterrupt):
            runner.run(run_server(engine, host, port, on_ready=ready))


def main() -> None:
    """Console entry point (``aiohicache``, ``python -m aiohicache``)."""
    cli(prog_name="aiohicache")


# ---------------------------------------------------------------------- the demo


_DEMO_SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=4, dtype="fp16")


async def _demo(echo: Callable[[str], None]) -> None:
    """Three prompts of three pages on a device of eight pages: the third evicts the first,
    whose next fetch loads it back from the host layer by layer.

    Cancellation: the cache closes (shielded); nothing else is left running.
    """
    config = HiCacheConfig(spec=_DEMO_SPEC, page_size=4, device_pages=6, host_pages=32)
    a, b, c = (list(range(base, base + 12)) for base in (100, 200, 300))
    echo(f"KV spec {config.spec.fingerprint()}, page {config.page_size} tokens, device "
         f"{config.device_pages} pages, host {config.host_capacity_pages} pages, "
         f"{config.write_policy}\n")
    async with HiCache(config) as cache:
        echo("1. prompt A: a miss; allocate slots, compute its KV, commit")
        await _prefill(cache, a, echo)
        await cache.drain()
        echo(f"   write-through settled: {cache.stats().host_pages_used} host pages used\n")
        echo("2. prompt A again: every token is on the device (L1 hit)")
        await _prefill(cache, a, echo)
        echo("\n3. prompts B and C: the device has 6 pages, so C evicts A (LRU) to host-only")
        for tokens in (b, c):
            await _prefill(cache, tokens, echo)
            await cache.drain()
        echo(f"   {cache!r}\n")
        echo("4. prompt A once more: an L2 hit, loaded back while we wait layer by layer")
        await _load_back(cache, a, echo)
        await cache.drain()
        echo(f"   B, now the least recently used, went to host-only to make room: {cache!r}")
        cache.check_invariants()
        echo("\n5. stats()")
        echo(_format_stats(cache))


async def _prefill(cache: HiCache, tokens: list[int], echo: Callable[[str], None]) -> None:
    async with cache.fetch(tokens) as hit:
        new = len(tokens) - hit.num_cached_tokens
        echo(f"   fetch: {hit.num_device_hit_tokens} L1 + {hit.num_host_hit_tokens} L2 "
             f"cached of {len(tokens)} tokens")
        if new == 0:
            return
        slots = await hit.allocate(new)
        _compute_kv(cache, slots, tokens[hit.num_cached_tokens:])
        await hit.commit(tokens, slots)
        writing = "" if cache.controller.idle else "; write-through to the host started"
        echo(f"   allocate({new}) -> slots {slots.tolist()}; commit{writing}")


async def _load_back(cache: HiCache, tokens: list[int], echo: Callable[[str], None]) -> None:
    async with cache.fetch(tokens) as hit:
        echo(f"   fetch: {hit.num_device_hit_tokens} L1 + {hit.num_host_hit_tokens} L2 "
             f"cached of {len(tokens)} tokens")
        for layer in range(cache.config.spec.num_layers):
            await hit.layer_ready(layer)
            same = _check_kv(cache, hit, layer)
            echo(f"   layer_ready({layer}): K/V of layer {layer} on the device, "
                 f"{'identical to' if same else 'DIFFERENT from'} what was computed")


def _expected_kv(tokens: list[int], layer: int, kv: int) -> torch.Tensor:
    """Stand-in KV of a forward pass: a value per (token, layer, K/V), exact in fp16."""
    values = torch.tensor(tokens, dtype=torch.float32) % 997 + layer * 10 + kv
    return values.to(_DEMO_SPEC.dtype)


def _compute_kv(cache: HiCache, slots: torch.Tensor, tokens: list[int]) -> None:
    pool = cache.device_pool
    for layer in range(_DEMO_SPEC.num_layers):
        for kv, buf in enumerate((pool.k_buffer(layer), pool.v_buffer(layer))):
            buf[slots] = _expected_kv(tokens, layer, kv)[:, None, None].expand(
                -1, *buf.shape[1:])


def _check_kv(cache: HiCache, hit: FetchContext, layer: int) -> bool:
    pool, slots = cache.device_pool, hit.device_indices
    tokens = list(hit.tokens[:len(slots)])
    return all(torch.equal(buf[slots][:, 0, 0], _expected_kv(tokens, layer, kv))
               for kv, buf in enumerate((pool.k_buffer(layer), pool.v_buffer(layer))))


def _format_stats(cache: HiCache) -> str:
    stats = cache.stats()
    items = [(f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats)]
    items.append(("hit_ratio", f"{stats.hit_ratio:.2f}"))
    return "\n".join(f"   {name:<22} {value}" for name, value in items)
