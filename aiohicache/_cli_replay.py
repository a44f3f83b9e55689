"""``aiohicache replay``: replay a serving trace through a real cache (docs/replay.md)."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import click
from click.core import ParameterSource
from tqdm import tqdm

from ._cli_common import (
    FiniteFloatRange,
    comma_list,
    evictions,
    l3_url,
    load_requests,
    loop_option,
    no_requests,
    run,
)
from ._lagprobe import StallSampler
from .config import KVSpec
from .errors import ConfigError, StorageError
from .replay import Request, stream_trace
from .replay.report import check_plot_path, format_result, format_sweep, plot_sweep, to_json
from .replay.runner import MODELS, ReplayConfig, ReplayResult, parse_capacity, sweep_configs
from .replay.runner import replay as run_replay
from .storage import FileBackend, PageFormat, backend_from_url

_POLICIES = ("write_through", "write_through_selective", "write_back")

_L3_CHECK_SECONDS = 10.0
"""How long `_check_l3` waits for the L3 to open (a host that drops packets never refuses)."""

Trace = Callable[[], "Sequence[Request] | AsyncIterator[Request]"]
"""Gives the requests of one replay: the loaded list, or a fresh stream of the file."""


def _options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options of ``replay``, in the order ``--help`` lists them."""
    options = [
        click.argument("trace", default="mooncake"),
        click.option("--limit", type=click.IntRange(min=1), default=None,
                     help="Replay only the first N requests."),
        click.option("--model", type=click.Choice(sorted(MODELS)), default="llama3-8b",
                     show_default=True, help="KV size per token from a model preset."),
        click.option("--layers", type=int, default=None, help="Explicit MHA spec: layers ..."),
        click.option("--kv-heads", type=int, default=None, help="... KV heads per layer ..."),
        click.option("--head-dim", type=int, default=None, help="... head dimension ..."),
        click.option("--dtype", default="bf16", show_default=True, help="... and dtype."),
        click.option("--kv-scale", type=click.IntRange(min=1), default=4096, show_default=True,
                     help="Divide bytes per token by this so production capacities fit a "
                          "laptop."),
        *_cache_options(),
        *_pacing_options(),
        *_output_options(),
        loop_option,
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _cache_options() -> list[Callable[[Any], Any]]:
    return [
        click.option("--l1", "l1", default="1M", show_default=True,
                     help="L1 capacity: tokens (256k, 1M) or model bytes (32GiB)."),
        click.option("--l2", "l2", default="4M", show_default=True,
                     help="L2 capacity: tokens or model bytes; 0 for a single tier."),
        click.option("--l3", "l3", default="tmp", show_default=True, callback=l3_url,
                     help="L3: 'tmp' (a temporary file store), 'none', or a URL (file:///dir, "
                          "redis://host:port/0, memory://)."),
        click.option("--prefetch-policy", default="wait_complete", show_default=True,
                     type=click.Choice(["wait_complete", "timeout", "best_effort"])),
        click.option("--page-size", type=click.IntRange(1, 256), default=256, show_default=True,
                     help="Tokens per page (L3 stores one object per page)."),
        click.option("--write-policy", type=click.Choice(_POLICIES), default="write_through",
                     show_default=True),
        click.option("--eviction", default="lru", show_default=True, callback=evictions,
                     help="Eviction policy: lru, lfu, arc, or opt (Belady's offline optimum); "
                          "L1:L2 for one per tier (arc:lru); comma-separated to compare "
                          "policies."),
        click.option("--host-layout", type=click.Choice(["page_first", "layer_first"]),
                     default="page_first", show_default=True),
    ]


def _pacing_options() -> list[Callable[[Any], Any]]:
    return [
        click.option("--time", "time_mode", type=click.Choice(["fast", "timestamps"]),
                     default="fast", show_default=True,
                     help="As fast as possible, or honour arrival times (the trace file is "
                          "then read as the replay proceeds)."),
        click.option("--speedup", type=float, default=1.0, show_default=True,
                     help="With --time timestamps: replay this many times faster than "
                          "recorded."),
        click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Requests in flight at once (1: sequential, deterministic); with "
                          "--time timestamps a cap on them, 1 meaning none."),
        click.option("--settle/--no-settle", default=True, show_default=True,
                     help="Sequential replays: let each request's copies settle before the "
                          "next (same numbers every run)."),
    ]


def _output_options() -> list[Callable[[Any], Any]]:
    return [
        click.option("--sweep", default=None, callback=comma_list,
                     help="Comma-separated L1 capacities: print the hit-ratio curve."),
        click.option("--plot", type=click.Path(dir_okay=False), default=None,
                     help="With --sweep: write the curve as an image (.png, .svg or .pdf)."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables."),
        click.option("--no-progress", is_flag=True, help="No progress bar."),
        click.option("--stalls", type=FiniteFloatRange(min=0.1), default=None, metavar="MS",
                     help="Also find where the loop stalls longer than MS milliseconds "
                          "(StallSampler): the most frequent stacks go to stderr."),
    ]


@click.command()
@_options
def replay(trace: str, limit: int | None, l3: str, eviction: list[str], time_mode: str,
           sweep: list[str] | None, plot: str | None, as_json: bool, no_progress: bool,
           stalls: float | None, loop: str, **spec_and_tiers: Any) -> None:
    """Replay a serving trace through a real cache and report what each tier served.

    TRACE is "mooncake" (a bundled 2,000-request slice of the Mooncake conversation trace),
    "synthetic", a Mooncake-format .jsonl file, or a kv-cache-tester .jsonl.gz file.
    Several --eviction policies replay one after another and print side by side.
    """
    _refuse_ignored_options(sweep=sweep, time_mode=time_mode, l3=l3, **spec_and_tiers)
    try:
        base = _base_config(l3=l3, eviction=eviction[0], time_mode=time_mode,
                            **spec_and_tiers)
        configs = sweep_configs(base, [base.device_tokens] if sweep is None else
                                _sweep_tokens(sweep, base), eviction)
        requests = _trace(trace, limit, streamed=time_mode == "timestamps")
        _check_outputs(plot, l3, loop)
        results = [_replay_one(c, requests, loop, total=limit, stalls=stalls,
                               progress=not (no_progress or as_json)) for c in configs]
        if results[0].requests == 0:  # a streamed trace: known empty only once read
            raise no_requests(trace)
    except ConfigError as exc:  # also a pool larger than the machine: device_pages from --l1
        field_name, _, why = str(exc).partition(": ")
        if field_name in _TIER_FLAGS:  # the tiers: named by their flags, as serve does
            raise click.BadParameter(why, param_hint=f"'{_TIER_FLAGS[field_name]}'") from None
        raise click.UsageError(str(exc)) from exc
    _print_replay(results, trace, as_json=as_json, swept=sweep is not None or len(eviction) > 1)
    if plot is not None:
        _write_plot(results, plot, trace, as_json=as_json)


_TIER_FLAGS = {"device_tokens": "--l1", "host_tokens": "--l2"}
"""`ReplayConfig` fields a user gives as options: their errors name the option."""


def _refuse_ignored_options(*, sweep: list[str] | None, time_mode: str, l3: str,
                            **spec_and_tiers: Any) -> None:
    """An option given where it has no effect is a usage error: the user meant something
    the replay would not do (``--dtype fp8`` on a preset model replays bf16)."""
    ctx = click.get_current_context()
    given = {name for name in ctx.params if ctx.get_parameter_source(name)
             not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}
    explicit = any(spec_and_tiers[n] is not None for n in ("layers", "kv_heads", "head_dim"))
    rules = [
        ("plot", sweep is None, "draws the curve of a sweep: give --sweep too"),
        ("speedup", time_mode != "timestamps", "paces --time timestamps only"),
        ("dtype", not explicit, "goes with --layers, --kv-heads and --head-dim (a --model "
                                "preset has its own)"),
        ("model", explicit, "and --layers/--kv-heads/--head-dim both name the model: give "
                            "one"),
        ("settle", time_mode != "fast" or spec_and_tiers["concurrency"] > 1,
         "applies to sequential replays only (--time fast, --concurrency 1)"),
        ("write_policy", _no_l2(spec_and_tiers["l2"]), "moves L1 pages to L2: --l2 0 has none"),
        ("host_layout", _no_l2(spec_and_tiers["l2"]), "lays out L2: --l2 0 has none"),
        ("prefetch_policy", l3 == "none", "paces reads from L3: --l3 none has none"),
        ("l3", _no_l2(spec_and_tiers["l2"]) and l3 != "none",
         "is read into L2 and written from it: --l2 0 has none"),
    ]
    for name, ignored, why in rules:
        if ignored and name in given:
            raise click.UsageError(f"'--{name.replace('_', '-')}' {why}")


def _no_l2(l2: str) -> bool:
    """``--l2`` names no tier (any unit: zero is zero whatever a token weighs)."""
    try:
        return parse_capacity(l2, bytes_per_token=1, field_name="l2") == 0
    except ConfigError:  # reported, with the model's size, where the config is made
        return False


def _check_outputs(plot: str | None, l3: str, loop: str) -> None:
    """What the replay writes to, checked before it starts: a plot it could not write, or
    an L3 it could not open, would fail (or count every L3 access a miss) only after it ran.

    Raises:
        click.BadParameter: naming ``--plot`` or ``--l3``.
    """
    if plot is not None:
        try:
            check_plot_path(plot)
        except ConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix("plot: "),
                                     param_hint="'--plot'") from None
    if l3 not in ("tmp", "none"):
        try:
            run(_check_l3, l3, loop=loop)
        except (ConfigError, StorageError) as exc:  # the message names the store, safely
            raise click.BadParameter(str(exc).removeprefix("storage: "),
                                     param_hint="'--l3'") from None
        except TimeoutError:  # NOTE: not the URL: it may hold a password
            raise click.BadParameter(f"no answer within {_L3_CHECK_SECONDS:g} s",
                                     param_hint="'--l3'") from None


async def _check_l3(url: str) -> None:
    """Open the L3 `url` names, look up one key, close it: the replay's first lookup,
    which would otherwise fail as a miss (logged) and leave the replay without an L3.

    Cancellation: the backend is closed.
    """
    fmt = PageFormat.make(namespace="aiohicache replay --l3 check", spec_fingerprint="none",
                          page_size=1, payload_bytes=1)
    backend = backend_from_url(url, fmt)
    if isinstance(backend, FileBackend):
        # NOTE: opening it reads every journal (seconds for a big store, then once more for
        # the replay, and past the check's time limit): only its directory is checked
        await anyio.to_thread.run_sync(_check_dir, backend.root_dir)
        return
    try:
        with anyio.fail_after(_L3_CHECK_SECONDS):
            await backend.exists(["0" * 32])
    finally:
        with anyio.CancelScope(shield=True):
            await backend.aclose()


def _write_plot(results: list[ReplayResult], plot: str, trace: str, *, as_json: bool) -> None:
    """`plot_sweep`; a write that fails anyway (`_check_outputs` passed: the disk filled, the
    directory went) is one error line, with nothing left at `plot`."""
    try:
        plot_sweep(results, plot, title=f"aiohicache replay: {os.path.basename(trace)}")
    except OSError as exc:
        raise click.ClickException(f"cannot write the plot to {plot}: {exc.strerror or exc}"
                                   ) from None
    if not as_json:
        click.echo(f"plot written to {plot}")


def _base_config(*, model: str, layers: int | None, kv_heads: int | None,
                 head_dim: int | None, dtype: str, l1: str, l2: str, l3: str,
                 **rest: Any) -> ReplayConfig:
    """The replay's config from the command's options (`ReplayConfig` checks the rest)."""
    spec = _replay_spec(model, layers, kv_heads, head_dim, dtype)
    return ReplayConfig(
        spec=spec,
        device_tokens=parse_capacity(l1, bytes_per_token=spec.bytes_per_token,
                                     field_name="l1"),
        host_tokens=parse_capacity(l2, bytes_per_token=spec.bytes_per_token, field_name="l2"),
        # NOTE: no L3 under a single tier, not the default's temporary store: no page would
        # reach it, and the report would name it
        storage=None if l3 == "none" or _no_l2(l2) else l3, **rest)


def _trace(trace: str, limit: int | None, *, streamed: bool) -> Trace:
    """The requests of each replay. With ``--time timestamps`` the trace is streamed: every
    replay reads the file afresh as it proceeds (`stream_trace`), which reports a bad line
    when it is reached; otherwise it is loaded (and checked) once, before any replay."""
    if streamed:
        return functools.partial(stream_trace, trace, limit=limit)
    requests = load_requests(trace, limit=limit)
    return lambda: requests


def _sweep_tokens(sweep: list[str], base: ReplayConfig) -> list[int]:
    """The L1 capacities of ``--sweep``, each a different number of pages (two replays of
    one L1 size would print the same numbers twice)."""
    try:
        tokens = [parse_capacity(x, bytes_per_token=base.spec.bytes_per_token,
                                 field_name="sweep") for x in sweep]
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("sweep: "),
                                 param_hint="'--sweep'") from None
    seen: dict[int, str] = {}
    for text, n in zip(sweep, tokens, strict=True):
        pages = n // base.page_size
        if pages == 0:
            raise click.BadParameter(f"{text!r} is less than one page ({base.page_size} "
                                     "tokens)", param_hint="'--sweep'")
        if pages in seen:
            raise click.BadParameter(f"{seen[pages]!r} and {text!r} are one L1 size ({pages:,} "
                                     f"pages of {base.page_size} tokens)",
                                     param_hint="'--sweep'")
        seen[pages] = text
    return tokens


def _replay_spec(model: str, layers: int | None, kv_heads: int | None,
                 head_dim: int | None, dtype: str) -> KVSpec:
    explicit = (layers, kv_heads, head_dim)
    if all(x is None for x in explicit):
        return MODELS[model]
    if any(x is None for x in explicit):
        raise ConfigError("spec: --layers, --kv-heads and --head-dim go together")
    return KVSpec.mha(num_layers=layers, num_kv_heads=kv_heads,  # type: ignore[arg-type]
                      head_dim=head_dim, dtype=dtype)  # type: ignore[arg-type]


def _replay_one(config: ReplayConfig, trace: Trace, loop: str, *, total: int | None,
                stalls: float | None, progress: bool) -> ReplayResult:
    requests = trace()
    if isinstance(requests, Sequence):
        total = len(requests)
    with tqdm(total=total, unit="req", disable=not progress, leave=False,
              desc=f"replay {config.eviction} L1={config.device_tokens:,} tokens") as bar:

        def advance(n: int) -> None:
            bar.update(n)

        replay = functools.partial(run_replay, config, requests, progress=advance)
        if stalls is None:
            return run(replay, loop=loop)
        return run(_sampled, replay, stalls / 1e3, loop=loop)


async def _sampled(replay: Callable[[], Awaitable[ReplayResult]],
                   threshold: float) -> ReplayResult:
    """`replay()` under a `StallSampler`; its report goes to stderr (``--json`` stays
    parseable). Cancellation: the replay is cancelled and the sampler stopped."""
    async with StallSampler(threshold=threshold) as sampler:
        result = await replay()
    click.echo(sampler.report(), err=True)
    return result


def _print_replay(results: list[ReplayResult], trace: str, *, as_json: bool,
                  swept: bool) -> None:
    if as_json:
        click.echo(to_json(results, listed=swept))
        return
    for r in results if not swept else results[:0]:
        click.echo(format_result(r, title=f"aiohicache replay: {trace}"))
    if swept:
        click.echo(f"aiohicache replay: {trace}, hit ratio vs L1 capacity and eviction\n"
                   if len({r.eviction for r in results}) > 1 else
                   f"aiohicache replay: {trace}, hit ratio vs L1 capacity\n")
        click.echo(format_sweep(results))


def _check_dir(root: str) -> None:
    """`root` is (or can be made) a directory this process can write.

    Raises:
        StorageError: naming it and why not.
    """
    try:
        os.makedirs(root, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        raise StorageError(f"storage: cannot open the file store {root}: "
                           f"{exc.strerror or exc}") from exc
