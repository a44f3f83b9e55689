"""Hugging Face transformers adapter: prefill a decoder-only model over a cached prefix.

    adapter = HFAdapter(model, cache)          # cache built with kv_spec(model.config)
    async with cache.fetch(tokens) as hit:
        out = await adapter.prefill(hit, tokens)
        next_token = int(out.logits[0, -1].argmax())

The prefix's KV goes to the model through its own cache API: a `PoolCache` (a
`transformers.DynamicCache`) whose layer ``i`` is filled from the device pool after
``await hit.layer_ready(i)``, while the forward pass runs on a worker thread; the KV the model
computes for the new tokens is written into the slots leased for them, then committed.
Works for models whose attention layers call ``past_key_values.update(k, v, layer_idx)`` with
``[batch, kv_heads, seq, head_dim]`` tensors: Llama, Qwen2/3, Mistral and their kin.
Needs the ``hf`` extra (``pip install aiohicache[hf]``).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from . import ConfigError, FetchContext, HiCache, KVSpec
from ._concurrency import Promise, finish_then_cancel, submit_to_thread

__all__ = ("HFAdapter", "PoolCache", "Prefill", "cache_kwarg", "forward", "kv_spec", "layer_kv",
           "tiny_llama")


def tiny_llama(*, seed: int = 0, vocab_size: int = 32000, hidden_size: int = 128,
               num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
               max_positions: int = 32768) -> PreTrainedModel:
    """A small Llama with random weights (seeded), built in-process: nothing is downloaded.

    Float32 on the CPU, in eval mode, SDPA attention. Its outputs are noise, but its compute
    and KV are a real Llama's, so cache hits and recomputation can be compared exactly. It
    has no end-of-sequence token (``generation_config.eos_token_id`` is None).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 3, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_positions, "attn_implementation": "sdpa"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**fields))
    model.train(False)
    # its outputs are noise, with no end: a generation runs to its length (LlamaConfig's
    # default end-of-sequence id 2 would end one wherever byte 2 came up)
    model.generation_config.eos_token_id = None
    return model


def kv_spec(config: PretrainedConfig, dtype: torch.dtype | str | None = None) -> KVSpec:
    """The `KVSpec` of a decoder-only model's attention KV, from its config.

    Args:
        config: the model's config (``model.config``); reads ``num_hidden_layers``,
            ``num_key_value_heads`` (default: ``num_attention_heads``) and ``head_dim``
            (default: ``hidden_size // num_attention_heads``).
        dtype: the KV dtype; default the config's ``dtype`` (float32 if unset).

    Raises:
        ConfigError: the config lacks the fields of a decoder-only attention model, sets
            them per layer, or is multi-head latent attention (a cached latent).
    """
    text = config.get_text_config(decoder=True)
    # NOTE: a heterogeneous config (Gemma 4: ``head_dim`` per layer) raised transformers'
    # RuntimeError on reading these fields; the pool holds one KV shape for every layer
    varying = sorted(_READ_FIELDS & set(getattr(text, "per_layer_attributes", None) or ()))
    if varying:
        raise ConfigError(f"config: {', '.join(varying)} set per layer (per_layer_config): "
                          f"only one KV shape and attention kind for every layer is supported")
    if getattr(text, "kv_lora_rank", None):
        # NOTE: transformers caches MLA's latent (K: the compressed KV, V: the shared rope
        # key, one head): a spec of its heads passed, and every request was refused at the
        # model's first layer, as a spec that "does not describe this model"
        raise ConfigError(f"config: multi-head latent attention (kv_lora_rank="
                          f"{text.kv_lora_rank}) caches a latent, not per-head K/V: not "
                          f"supported by the transformers adapter")
    try:
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        layers = int(text.num_hidden_layers)
    except AttributeError as exc:
        raise ConfigError(f"config: not a decoder-only attention model ({exc})") from None
    return KVSpec.mha(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                      dtype=dtype or getattr(text, "dtype", None) or torch.float32)


_READ_FIELDS = frozenset({
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "layer_types", "sliding_window", "use_sliding_window", "attention_chunk_size",
    "rope_parameters", "rope_scaling"})
"""Config fields `kv_spec` and `HFAdapter` read as one value for the whole model."""


def forward(model: PreTrainedModel, tokens: list[int], past: DynamicCache, *,
            all_logits: bool = False) -> torch.Tensor:
    """One forward pass of `tokens` after what `past` holds (which it extends); blocking.
    A pass that raises leaves `past` as it was (each layer's KV cut back to its length).

    Returns ``[1, q, vocab]`` logits: the last position's, or every position's. A
    `PoolCache` records the tokens (`HFAdapter.commit_decoded` checks them).
    """
    ids = torch.tensor([tokens], dtype=torch.int64, device=model.device)
    # NOTE: recorded only after the tokens it knows: past a pass made around it (the model
    # called on the cache) the tokens are at other positions than recorded
    record = past.tokens if isinstance(past, PoolCache) and \
        len(past.tokens) == past.get_seq_length() else None
    lengths = [_length(layer) for layer in past.layers]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1,
                        **{cache_kwarg(model): past})
    except BaseException:
        # NOTE: a pass that raised part-way (a layer's hook, out of memory) had extended the
        # layers before it only: a retry then ran each layer over other positions (wrong
        # logits, unsaid) and the tokens were never recorded again (nothing committable)
        _truncate(past, lengths)
        raise
    if record is not None:
        record.extend(int(t) for t in tokens)
    logits: torch.Tensor = out.logits
    return logits


def _length(layer: object) -> int:
    """Tokens of KV a cache layer holds (0 for a layer of another kind)."""
    return layer.get_seq_length() if isinstance(layer, DynamicLayer) else 0


def _truncate(past: DynamicCache, lengths: list[int]) -> None:
    """Cut each KV layer of `past` back to its length in `lengths` (0: a layer added since)."""
    for i, layer in enumerate(past.layers):
        extra = _length(layer) - (lengths[i] if i < len(lengths) else 0)
        if extra > 0 and isinstance(layer, DynamicLayer):
            layer.crop(-extra)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The keyword `model`'s forward takes its KV cache by: ``cache`` in recent
    transformers, ``past_key_values`` before.

    NOTE: transformers 5.24 renamed it; the old name warns (an error under the tests'
    warning filter: every cached pass failed) and goes in 5.40.
    """
    cls = type(model)
    kwarg = _CACHE_KWARGS.get(cls)
    if kwarg is None:
        kwarg = "cache" if "cache" in inspect.signature(cls.forward).parameters else \
            "past_key_values"
        _CACHE_KWARGS[cls] = kwarg
    return kwarg


_CACHE_KWARGS: dict[type, str] = {}


def layer_kv(past: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V tensors (``[batch, kv_heads, seq, head_dim]``) of one layer of `past`."""
    cached = past.layers[layer]
    assert isinstance(cached, DynamicLayer) and cached.keys is not None \
        and cached.values is not None, f"layer {layer} of the cache holds no KV: {cached!r}"
    return cached.keys, cached.values


def _rope_types(config: PretrainedConfig) -> set[str]:
    """The RoPE types a config names: ``rope_parameters`` (``rope_scaling`` before
    transformers 5), one dict or one per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    found = [params] if "rope_type" in params or "type" in params else list(params.values())
    return {str(p.get("rope_type", p.get("type"))) for p in found if isinstance(p, dict)}


class _LayerGates:
    """One event per layer, set on the loop once the layer's prefix is on the device, waited
    on by the forward pass's thread. `abort` releases every waiter with an error."""

    def __init__(self, num_layers: int) -> None:
        self._events = [threading.Event() for _ in range(num_layers)]
        self._aborted = False

    def open(self, layer: int) -> None:
        self._events[layer].set()

    def open_all(self) -> None:
        for event in self._events:
            event.set()

    def abort(self) -> None:
        self._aborted = True
        self.open_all()

    def wait(self, layer: int) -> None:
        self._events[layer].wait()
        if self._aborted:
            raise _Aborted


class _Aborted(Exception):
    """The request stopped (an error or a cancellation on the loop) mid forward pass."""


@dataclass(slots=True)
class _PoolLink:
    """Where one prefill reads its prefix and writes its new KV in the device pool."""

    cache: HiCache
    prefix_slots: torch.Tensor
    """Slots of the prefix handed to the model (its first ``len`` cached tokens)."""
    new_slots: torch.Tensor | None
    """Slots leased for the tokens after the cached prefix (None: nothing new to store)."""
    skip: int
    """Computed tokens whose KV is cached already (the last token of a full hit)."""
    gates: _LayerGates


class PoolCache(DynamicCache):
    """A `DynamicCache` over the device pool for one prefill.

    Each layer starts as a placeholder of the prefix's length (so the model sees the right
    sequence length and positions before any KV is there). The first ``update`` of layer ``i``
    waits for that layer's gate, copies the prefix's K/V from the pool into the placeholder,
    and writes the new tokens' K/V into their leased slots. After `detach` it is a plain
    `DynamicCache` (decode steps grow it as usual).

    Attributes:
        tokens: the tokens whose KV it holds, in order, as far as known: the prefix, then
            those of every pass through `forward` (`HFAdapter.decode`); a pass made another
            way adds none, nor does any pass after it. `crop` and `reset` drop the tokens
            they drop from the cache.
    """

    def __init__(self, config: PretrainedConfig, link: _PoolLink,
                 prefix: Sequence[int] = ()) -> None:
        n, spec = len(link.prefix_slots), link.cache.config.spec
        super().__init__(config=config)
        _check_layers(self.layers, "its cache has")
        if n:
            pool = link.cache.device_pool
            shape = (1, spec.num_kv_heads, n, spec.head_dim)
            for layer in self.layers:
                assert isinstance(layer, DynamicLayer)  # for mypy: checked just above
                layer.update(torch.empty(shape, dtype=spec.dtype, device=pool.device),
                             torch.empty(shape, dtype=spec.dtype, device=pool.device))
        self._link: _PoolLink | None = link
        self._filled = [n == 0] * spec.num_layers
        self._updated = [False] * spec.num_layers
        self.tokens = [int(t) for t in prefix]

    def detach(self) -> None:
        """Stop reading from and writing to the pool (the prefill is over)."""
        self._link = None

    def layers_not_updated(self) -> list[int]:
        """Layers whose KV no pass handed to the cache while it was attached to the pool."""
        return [i for i, done in enumerate(self._updated) if not done]

    def crop(self, *args: Any, **kwargs: Any) -> None:
        # NOTE: speculative decoding crops rejected drafts: recorded still, they shifted the
        # tokens fed after them, and every commit was refused (or, with as many tokens fed
        # around the adapter, committed those tokens' KV under the cropped ones)
        super().crop(*args, **kwargs)
        del self.tokens[self.get_seq_length():]

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]
        self.tokens.clear()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        link = self._link
        if link is not None:
            _check_kv(link.cache.config.spec, layer_idx, key_states, value_states)
            # NOTE: every layer, gated or not: where a stopped request's pass ends (a miss
            # has no gate to wait for, and its cancelled pass ran the whole prompt on)
            link.gates.wait(layer_idx)
            if not self._filled[layer_idx]:
                self._fill(link, layer_idx)
            self._store(link, layer_idx, key_states, value_states)
            self._updated[layer_idx] = True
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return keys, values

    def _fill(self, link: _PoolLink, layer: int) -> None:
        pool, idx = link.cache.device_pool, link.prefix_slots
        keys, values = layer_kv(self, layer)
        keys[0].copy_(pool.k_buffer(layer)[idx].transpose(0, 1))
        values[0].copy_(pool.v_buffer(layer)[idx].transpose(0, 1))
        self._filled[layer] = True

    @staticmethod
    def _store(link: _PoolLink, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if link.new_slots is None:
            return
        pool, slots = link.cache.device_pool, link.new_slots
        pool.k_buffer(layer)[slots] = k[0, :, link.skip:].transpose(0, 1)
        pool.v_buffer(layer)[slots] = v[0, :, link.skip:].transpose(0, 1)


def _check_updated(model: PreTrainedModel, past: PoolCache) -> None:
    """Refuse a pass whose layers did not hand their KV to `past` (nothing of theirs stored).

    NOTE: a forward that took the cache and dropped it (remote code, a wrapper losing the
    keyword) had its leased slots committed unwritten, stale memory as the prompt's KV, and
    on a hit computed the suffix without the prefix: other logits, unsaid.
    """
    if missed := past.layers_not_updated():
        raise ConfigError(f"model: layers {missed} never passed their KV through the cache "
                          f"given as `{cache_kwarg(model)}` (its forward does not use it): "
                          f"nothing is committed")
    _check_layers(past.layers, "its pass left the cache with")


def _check_fed(past: PoolCache, ids: list[int]) -> None:
    """Refuse to commit `ids` over KV that is not theirs."""
    # NOTE: a layer swapped for a sliding one while decoding kept its last tokens only: the
    # decoded KV was read at their absolute positions from it, other positions' KV
    _check_layers(past.layers, "the cache decoded on has")
    held = past.get_seq_length()
    if len(ids) > held:
        # NOTE: the pool's indexed write broadcast the one row there was into two slots:
        # the last decoded token got the KV of the one before, committed with its page
        raise ConfigError(f"tokens: {len(ids)} given, the model's cache holds the KV of "
                          f"{held} (a decoded token has none until it is fed back)")
    if len(ids) > len(past.tokens):
        raise ConfigError(f"past: holds the KV of {held} tokens, {len(past.tokens)} of them "
                          f"fed through HFAdapter.decode or hf.forward: the others are unknown")
    if (at := _first_difference(ids, past.tokens)) is not None:
        # NOTE: committed as given: a sampled token replaced after it was fed (a stop
        # sequence rewritten, a token edited) put the fed token's KV under another's
        raise ConfigError(f"tokens: position {at} is {ids[at]}, the model was fed "
                          f"{past.tokens[at]} there")


def _check_layers(layers: Sequence[object], where: str) -> None:
    """Refuse a cache with a layer other than transformers' full-attention `DynamicLayer`.

    NOTE: the pool holds every position's K/V. A sliding or chunked layer keeps its last
    tokens only (a hit past its window crashed the pass; `commit_decoded` stored other
    positions' KV), a shared one none. They are its subclasses: the type must be exact.
    """
    odd: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if type(layer) is not DynamicLayer:
            odd.setdefault(_describe(layer), []).append(i)
    if odd:
        found = "; ".join(f"layers {idx} {kind}" for kind, idx in odd.items())
        raise ConfigError(f"model: {where} {found}: only full-attention layers (DynamicLayer) "
                          f"are supported, the pool holds every position's KV")


def _describe(layer: object) -> str:
    window = getattr(layer, "sliding_window", None)
    name = type(layer).__name__
    return f"{name} (a sliding window of {window} tokens)" if window is not None else name


def _first_difference(ids: list[int], known: list[int]) -> int | None:
    """The first position where `ids` and `known` differ (up to the shorter's end)."""
    return next((i for i, (a, b) in enumerate(zip(ids, known, strict=False)) if a != b), None)


def _check_kv(spec: KVSpec, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse KV the pool cannot hold as is.

    NOTE: a config that misstates the KV (Falcon-7B's ``multi_query``: one KV head, which
    `kv_spec` cannot see) passed the adapter's spec check; the pool's indexed write then
    broadcast the one head into all, unsaid, and committed it.
    """
    want = (1, spec.num_kv_heads, k.shape[2], spec.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or {k.dtype, v.dtype} != {spec.dtype}:
        raise ConfigError(
            f"model: layer {layer} computes KV of shape {tuple(k.shape)} and "
            f"{tuple(v.shape)} ({k.dtype}), the cache's spec holds {want} ({spec.dtype}): "
            f"kv_spec(config) does not describe this model")


@dataclass(slots=True)
class Prefill:
    """What `HFAdapter.prefill` returns."""

    logits: torch.Tensor
    """``[1, q, vocab]``: the last computed position's logits (``q = 1``), or every computed
    position's with ``all_logits=True``."""
    past_key_values: PoolCache
    """The model's cache for decoding on (detached from the pool)."""
    num_reused_tokens: int
    """Prompt tokens whose KV came from the cache (not computed)."""
    num_prompt_tokens: int
    tail_slots: torch.Tensor
    """Slots of the prompt's partial last page (leased to the context, empty if none); after
    `HFAdapter.commit_decoded`, those leased to the context from the committed sequence's
    last page's start (its partial page, and slots leased for tokens not committed yet)."""
    num_committed_tokens: int
    """Tokens whose KV the context holds: the prompt, then what `commit_decoded` committed."""
    context: FetchContext | None = field(default=None, repr=False, compare=False)
    """The context it ran in: `commit_decoded` writes into its leased slots, no other's."""
    committing: bool = field(default=False, repr=False, compare=False)
    """A `commit_decoded` of it is under way (they run one at a time)."""


class HFAdapter:
    """Runs a transformers causal LM over a `HiCache`'s device pool.

    Args:
        model: a decoder-only ``PreTrainedModel`` in eval mode, on the cache's device.
        cache: an open `HiCache` whose spec is ``kv_spec(model.config, model.dtype)``.
        executor: where forward passes run (default: a thread pool all adapters share). A
            one-thread executor runs them one at a time, as one accelerator would.

    Raises:
        ConfigError: the cache's KV spec or device does not fit the model, its forward
            takes no KV cache, or the cache transformers builds for its config has a layer
            other than a full-attention `DynamicLayer` (sliding, chunked, shared, linear).
    """

    def __init__(self, model: PreTrainedModel, cache: HiCache, *,
                 executor: Executor | None = None) -> None:
        want = kv_spec(model.config, model.dtype)
        if cache.config.spec != want:
            raise ConfigError(f"spec: the cache holds {cache.config.spec.fingerprint()}, the "
                              f"model needs {want.fingerprint()} (use hf.kv_spec(config))")
        if cache.device_pool.device != model.device:
            raise ConfigError(f"device: the cache is on {cache.device_pool.device}, the model "
                              f"on {model.device}")
        params = inspect.signature(type(model).forward).parameters
        if "cache" not in params and "past_key_values" not in params:
            # NOTE: GPT-1's forward swallows the keyword (``**kwargs``): a hit ran the suffix
            # alone, and a miss committed slots nothing had written
            raise ConfigError(f"model: {type(model).__name__}.forward takes no KV cache "
                              f"(neither `cache` nor `past_key_values`)")
        text = model.config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None)
        if types is not None and set(types) != {"full_attention"}:
            raise ConfigError(f"model: only full-attention layers are supported, the model "
                              f"has {sorted(set(types))}")
        # NOTE: the layers transformers builds for the config, not its fields: without
        # `layer_types` a `sliding_window` (Mistral-7B-v0.1; also beside
        # `use_sliding_window: false`) or an `attention_chunk_size` makes sliding layers, and
        # KV sharing (Gemma 4) empty ones, past a check of `layer_types`
        _check_layers(DynamicCache(config=model.config).layers, "the cache for its config has")
        dynamic = sorted(t for t in _rope_types(text) if "dynamic" in t or t == "longrope")
        if dynamic:
            # NOTE: they pick every position's frequencies by the pass's longest position:
            # a prefix cached by a short prompt served a long one other KV than it computes
            raise ConfigError(f"model: its RoPE ({', '.join(dynamic)}) rescales every "
                              f"position with the sequence's length, so a prefix's KV "
                              f"depends on what follows it; only fixed RoPE is supported")
        _claim(cache, model)
        self.model = model
        self.cache = cache
        self.executor = executor

    async def prefill(self, hit: FetchContext, tokens: Sequence[int], *,
                      all_logits: bool = False) -> Prefill:
        """Compute `tokens` past the cached prefix of `hit`, store their KV, commit them.

        The forward pass runs on the executor; layer ``i`` of the prefix is handed to it once
        ``hit.layer_ready(i)`` returns. A prompt cached whole still computes its last token
        (for its logits) over the rest.

        Raises:
            ConfigError: `tokens` are not the fetched tokens, a prefill completed in `hit`
                already or is under way there, or the model computes KV of another shape
                or dtype than the cache's spec, or its layers never hand their KV to the
                cache or leave it with layers other than full-attention ones (nothing is
                committed).
            TransferError: loading the prefix failed.
            CapacityError: no device slots for the new tokens.

        Cancellation: the forward pass is stopped at its next layer and waited for (it writes
        into leased slots), then the cancellation propagates; nothing is committed.
        """
        ids = [int(t) for t in tokens]
        if len(ids) != len(hit.tokens) or ids != hit.tokens.tolist():
            raise ConfigError("tokens: must be the tokens the context fetched")
        if hit in _PREFILLED:
            # NOTE: a second one leased the slots after the first one's partial page (a
            # page's middle) and was refused after its whole pass, as "slots: must cover
            # whole pages in order"
            raise ConfigError("hit: prefilled already, or a prefill is under way in it (one "
                              "prefill per context: decode on its Prefill, or fetch again)")
        # NOTE: marked before any await: a second one at once passed the test above, and
        # was refused after its whole pass as "slots: need one slot per token ..."
        _PREFILLED.add(hit)
        try:
            return await self._prefill(hit, ids, all_logits)
        except BaseException:
            _PREFILLED.discard(hit)  # none completed: a retry may run
            raise

    async def _prefill(self, hit: FetchContext, ids: list[int], all_logits: bool) -> Prefill:
        cached = hit.num_cached_tokens
        reuse = min(cached, len(ids) - 1)
        slots = await _new_slots(hit, len(ids) - cached)
        link = _PoolLink(self.cache, hit.device_indices[:reuse], slots, cached - reuse,
                         _LayerGates(self.cache.config.spec.num_layers))
        past = PoolCache(self.model.config, link, ids[:reuse])
        try:
            logits = await self._run_gated(hit, link, past, ids[reuse:], all_logits)
            past.detach()
            _check_updated(self.model, past)
            if slots is not None:
                await hit.commit(ids, slots)
        except BaseException:
            # NOTE: those past what it committed: cancelled after its commit (queueing the
            # write-through), the partial page's slots were kept by none, and a retry leased
            # the slots after them (a page's middle): its commit was refused
            done = hit.num_cached_tokens - cached
            if slots is not None and len(slots) > done:
                _UNCOMMITTED[hit] = slots[done:]
            raise
        tail = len(ids) % self.cache.config.page_size
        return Prefill(logits, past, reuse, len(ids),
                       slots[len(slots) - tail:] if slots is not None and tail else
                       torch.empty(0, dtype=torch.int64), len(ids), hit)

    async def _run_gated(self, hit: FetchContext, link: _PoolLink, past: PoolCache,
                         new: list[int], all_logits: bool) -> torch.Tensor:
        work = self._submit(new, past, all_logits)
        try:
            if len(link.prefix_slots):
                for layer in range(self.cache.config.spec.num_layers):
                    await hit.layer_ready(layer)
                    link.gates.open(layer)
            else:
                link.gates.open_all()
            return await work.wait()  # a cancelled wait leaves the pass running
        except BaseException:
            link.gates.abort()  # the thread writes into our leased slots: let it stop first
            await finish_then_cancel(work.settled())
            raise

    def _submit(self, new: list[int], past: DynamicCache, all_logits: bool,
                ) -> Promise[torch.Tensor]:
        # NOTE: the caller's executor (`executor=`), not anyio.to_thread: which thread runs a
        # model is the caller's choice (the serving engine passes its single compute thread,
        # which bounds cached and uncached passes together).
        return submit_to_thread(self._executor(), self._forward, new, past, all_logits)

    def _executor(self) -> Executor:
        return self.executor if self.executor is not None else _shared_pool()

    def _forward(self, new: list[int], past: DynamicCache, all_logits: bool) -> torch.Tensor:
        return forward(self.model, new, past, all_logits=all_logits)

    async def decode(self, past: DynamicCache, token: int) -> torch.Tensor:
        """One decode step: feed `token`, return the next position's logits ``[vocab]``.

        Cancellation: the step finishes on its thread (it mutates `past`), then the
        cancellation propagates.
        """
        logits = await finish_then_cancel(self._submit([token], past, False).wait())
        return logits[0, -1]

    async def commit_decoded(self, hit: FetchContext, prefill: Prefill,
                             tokens: Sequence[int]) -> None:
        """Store and commit the KV of decoded tokens, so a next turn can hit it.

        May be called again as decoding goes on: each call commits what was fed since the
        last one (`prefill` keeps track), also after a call that failed or was cancelled.

        Args:
            hit: the context `prefill` ran in (still open).
            prefill: its result; its ``past_key_values`` has been decoded on since, through
                `decode` or `forward` (which record the tokens fed).
            tokens: the prompt followed by the tokens fed to the model since (each decoded
                token but the last, whose KV was never computed).

        Raises:
            ConfigError: another call for `prefill` is under way; `hit` is not the context
                `prefill` ran in, or it committed other tokens since; `tokens` run past the
                KV the model's cache holds (the last decoded token, never fed back) or are
                not the tokens fed (a sampled token replaced) or differ from those committed
                (the cache cropped below them); or the cache was fed another way than
                `decode`/`forward`, so its tokens are unknown, or it holds a layer other
                than a full-attention one. Nothing is written.
            ClosedError: the context's block has ended (nothing is written).

        Cancellation: as `FetchContext.allocate` and `commit`; a copy into the pool under
        way finishes on its thread first. The slots leased stay `prefill`'s for a next call.
        """
        if prefill.committing:
            # NOTE: two at once each leased from the same partial page's end: one was
            # refused with a misleading error, and `prefill` kept the other's stale slots
            # and count, so every later call was refused (the output never cached)
            raise ConfigError("prefill: another `commit_decoded` of it is under way: await "
                              "it first (each call continues where the last one ended)")
        prefill.committing = True
        try:
            await self._commit_decoded(hit, prefill, [int(t) for t in tokens])
        finally:
            prefill.committing = False

    async def _commit_decoded(self, hit: FetchContext, prefill: Prefill,
                              ids: list[int]) -> None:
        done = prefill.num_committed_tokens
        if prefill.context is not hit:
            # NOTE: the prefill's partial page is its own context's: given a new context of
            # the same prompt (the old one exited, the page freed and leased again) the
            # decoded KV was written over another prefix's committed page
            raise ConfigError("hit: not the context `prefill` ran in (its partial page's "
                              "slots are that context's lease)")
        if (at := _first_difference(ids, hit.tokens[:done].tolist())) is not None:
            # NOTE: a cache cropped below what was committed, then decoded on: the new
            # branch was dropped unsaid (no longer than the committed) or refused only
            # after its KV was written
            raise ConfigError(f"tokens: position {at} is {ids[at]}, the context committed "
                              f"{int(hit.tokens[at])} there (cropped below the committed "
                              f"tokens? commit another branch from its own context)")
        if len(ids) <= done:
            return
        _check_fed(prefill.past_key_values, ids)
        # NOTE: the partial page's slots are ours only while the context still leases them:
        # once a commit took that page (and freed it as a duplicate) they may be another
        # prefix's; a second call with the prompt's tail slots wrote into them.
        ps = self.cache.config.page_size
        start = done - done % ps
        if hit.num_cached_tokens != start:
            raise ConfigError(f"hit: holds {hit.num_cached_tokens} committed tokens, the "
                              f"prefill {start}: not its context, or it committed since")
        # NOTE: ClosedError once the context's block has ended: slots a failed call left in
        # `prefill` were freed then (maybe another prompt's committed pages now), and a call
        # that needed no new slot wrote the decoded KV into them before its commit raised
        await hit.ready()
        slots = await self._lease(hit, prefill, len(ids) - start)
        # NOTE: on the executor, as the passes: every layer's K/V of the decoded tokens
        # (2k tokens of a Llama-8B-sized spec on CPU: about 90 ms) held the loop
        await finish_then_cancel(submit_to_thread(
            self._executor(), self._store_decoded, prefill.past_key_values, slots,
            slice(start, len(ids))).wait())
        try:
            await hit.commit(ids, slots)
        finally:
            if len(hit.tokens) >= len(ids):  # committed (a cancellation may come after)
                prefill.tail_slots = prefill.tail_slots[len(ids) // ps * ps - start:]
                prefill.num_committed_tokens = len(ids)

    async def _lease(self, hit: FetchContext, prefill: Prefill, count: int) -> torch.Tensor:
        """Slots for `count` tokens from the committed prefix's end: those `prefill` holds,
        then more of the context's.

        NOTE: kept in `prefill` as soon as they are leased: the context hands out each slot
        once, so a call cancelled past its `allocate` left the next one the slots after them
        (not a page's start), and its commit was refused: the output never cached.
        """
        held = prefill.tail_slots.to(self.cache.device_pool.device)
        if count > len(held):
            held = torch.cat([held, await hit.allocate(count - len(held))])
            prefill.tail_slots = held
        return held[:count]

    def _store_decoded(self, past: DynamicCache, slots: torch.Tensor, span: slice) -> None:
        pool = self.cache.device_pool
        for layer in range(len(past.layers)):
            keys, values = layer_kv(past, layer)
            pool.k_buffer(layer)[slots] = keys[0, :, span].transpose(0, 1)
            pool.v_buffer(layer)[slots] = values[0, :, span].transpose(0, 1)


async def _new_slots(hit: FetchContext, count: int) -> torch.Tensor | None:
    """Slots for a prefill's `count` new tokens: those a prefill that raised in `hit` left
    leased, else new ones (None: no new tokens).

    NOTE: the context hands out each slot once: run again, a prefill got the slots after
    the first one's (a page's middle), and its commit was refused after the whole pass.
    """
    held = _UNCOMMITTED.get(hit)
    if count <= 0 or held is None or len(held) != count:
        _UNCOMMITTED.pop(hit, None)
        return await hit.allocate(count) if count > 0 else None
    await hit.layer_ready(0)  # ClosedError once the context has ended: its slots are freed
    # NOTE: taken only now: taken before the await and cancelled there, they were lost to
    # the retry after, which leased the slots after them (its commit refused)
    del _UNCOMMITTED[hit]
    return held


_PREFILLED: weakref.WeakSet[FetchContext] = weakref.WeakSet()
"""Contexts a prefill completed or runs in."""

_UNCOMMITTED: weakref.WeakKeyDictionary[FetchContext, torch.Tensor] = \
    weakref.WeakKeyDictionary()
"""Slots a prefill leased in a context and did not commit (it raised or was cancelled)."""

_MODELS: weakref.WeakKeyDictionary[HiCache, weakref.ref[PreTrainedModel]] = \
    weakref.WeakKeyDictionary()
"""The model each cache an adapter was made for holds the KV of."""


def _claim(cache: HiCache, model: PreTrainedModel) -> None:
    """Tie `cache` to `model`: its pages are that model's KV, whoever asks.

    NOTE: the tree matches tokens, not models: a second model of the same KV shape (a
    fine-tune, another seed) adapted to the same cache was served the first one's KV.
    """
    served = _MODELS.get(cache)
    if served is None:
        _MODELS[cache] = weakref.ref(model)
    elif served() is not model:
        raise ConfigError("cache: it holds the KV of another model (a cache's pages are the "
                          "first adapted model's, matched by tokens alone): give each model "
                          "its own HiCache")


@functools.cache
def _shared_pool() -> ThreadPoolExecutor:
    """Where adapters made without an executor run their passes: one pool for all of them,
    as asyncio's default executor was (its threads end with the process)."""
    return ThreadPoolExecutor(thread_name_prefix="aiohicache-hf")
