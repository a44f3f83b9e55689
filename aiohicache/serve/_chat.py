"""Chat messages to a prompt: the model's chat template, checked messages, clear errors.

A multi-turn chat is where a prefix cache pays: each turn's prompt is the last turn's
prompt, its answer and the new message, so the cache serves all but the new part.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from ..errors import ConfigError
from .engine import PromptError, Tokenizer

__all__ = ("ROLES", "chat_ids", "check_messages")

ROLES = ("system", "developer", "user", "assistant")


def check_messages(value: object) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` with text content (a list of text
    parts is joined by newlines, as vLLM does).

    Raises:
        PromptError: ``messages...: ...``, naming the message and what is wrong with it.
    """
    if not isinstance(value, list) or not value:
        raise PromptError("messages: a non-empty list of {role, content} objects")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, message: object) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise PromptError(f"{where}: an object with a role and a content")
    role = message.get("role")
    if role not in ROLES:
        raise PromptError(f"{where}.role: one of {', '.join(ROLES)} (got {role!r:.40})")
    content = message.get("content")
    if content is None and role == "assistant":  # an assistant turn may carry no text
        content = ""
    return {"role": role, "content": _text(f"{where}.content", content)}


def _text(where: str, content: object) -> str:
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise PromptError(f"{where}: only text parts ({{\"type\": \"text\", \"text\": "
                              f"...}}) are supported")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise PromptError(f"{where}: a string or a list of text parts")
    try:
        content.encode()
    except UnicodeEncodeError as exc:  # JSON can spell a lone surrogate: no tokenizer takes it
        raise PromptError(f"{where}: not valid Unicode text (a lone surrogate at character "
                          f"{exc.start})") from None
    return content


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt of `messages`: the tokenizer's chat template, ending with the start of the
    assistant's turn. May take milliseconds for a long chat (run it off the loop).

    Raises:
        PromptError: the model has no chat template, or its template refuses the messages
            (most refuse roles out of turn).
        ConfigError: the template does not parse (the server's fault).
    """
    render: Any = getattr(tokenizer, "render_chat", None)
    if render is not None:  # the byte tokenizer's own plain template
        return list(tokenizer.encode(render(messages)))
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("messages: this model's tokenizer has no chat template; send the "
                          "prompt to /v1/completions instead")
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateSyntaxError as exc:  # the server's template, not the client's messages
        raise ConfigError(f"chat template: does not parse: {exc}") from None
    except (TemplateError, ValueError, TypeError, KeyError) as exc:  # a template's own
        # `raise_exception` is a TemplateError; templates also index and compare what they get
        raise PromptError(f"messages: the chat template refused them: {exc}") from None
    return [int(i) for i in ids]
