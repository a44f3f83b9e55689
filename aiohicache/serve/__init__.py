"""`aiohicache serve`: an OpenAI-compatible completions and chat server over an HF model and a
HiCache.

    model, tokenizer, name = load_model()              # the tiny random Llama
    async with Engine(model, tokenizer, EngineConfig(), name=name) as engine, \
            running_server(engine, "127.0.0.1", 8000) as url:
        ...                                # POST {url}/v1/completions, /v1/chat/completions

Needs the ``serve`` extra (aiohttp, transformers, jinja2).
"""

from .app import ListenError, build_app, running_server, serve
from .engine import (
    ByteTokenizer,
    Engine,
    EngineBusy,
    EngineConfig,
    Metrics,
    PromptError,
    SamplingParams,
    Usage,
    cache_config,
)
from .model import load_model

__all__ = ("ByteTokenizer", "Engine", "EngineBusy", "EngineConfig", "ListenError", "Metrics",
           "PromptError", "SamplingParams", "Usage", "build_app", "cache_config", "load_model",
           "running_server", "serve")
