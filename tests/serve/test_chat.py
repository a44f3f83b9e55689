"""``POST /v1/chat/completions``: OpenAI chat over the model's chat template.

The messages become a prompt through the tokenizer's chat template (the tiny model's byte
tokenizer has a plain one of its own), ending where the assistant's answer begins; the rest
is a completion of that prompt, with the same sampling fields, stop strings and end of
sequence, answered as a chat completion (``message``, or streamed ``delta`` chunks). Each
turn of a chat extends the last, so the cache serves the earlier turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import aiohttp

from aiohicache.hf import tiny_llama
from aiohicache.serve import ByteTokenizer, Engine, EngineConfig, load_model, running_server

MODEL = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number between ten and twenty, please."}]
TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}"
            "{{ raise_exception('the first message may not be the assistant') }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def engine(tokenizer: Any = None) -> Engine:
    return Engine(tiny_llama(seed=5, **MODEL), tokenizer or ByteTokenizer(),
                  EngineConfig(page_size=16, device_tokens=2048, host_tokens=8192))


def word_tokenizer(eos: str | None = None, template: str | None = TEMPLATE) -> Any:
    """A real transformers tokenizer (a word-level one built in-process: nothing is
    downloaded) with a Jinja chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|system|>": 1, "<|user|>": 2, "<|assistant|>": 3}
    vocab.update({f"w{i}": i for i in range(4, 512)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token=eos)
    tok.chat_template = template
    return tok


async def post(session: aiohttp.ClientSession, url: str, path: str,
               body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{url}{path}", json=body) as resp:
        return {**await resp.json(), "status": resp.status}


async def chunks(session: aiohttp.ClientSession, url: str,
                 body: dict[str, Any]) -> list[dict[str, Any]]:
    async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        return [json.loads(line[6:]) async for line in r.content
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]


async def test_a_chat_is_a_completion_of_its_template_answered_as_a_message() -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        chat = await post(session, url, "/v1/chat/completions",
                          {"messages": CHAT, "max_tokens": 6, "temperature": 0})
        plain = await post(session, url, "/v1/completions",
                           {"prompt": ByteTokenizer().render_chat(CHAT), "max_tokens": 6,
                            "temperature": 0})
    assert chat["status"] == 200 and chat["object"] == "chat.completion"
    assert chat["id"].startswith("chatcmpl-") and chat["model"] == "tiny-llama"
    assert chat["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                "message": {"role": "assistant",
                                            "content": plain["choices"][0]["text"]}}]
    assert chat["aiohicache"]["token_ids"] == plain["aiohicache"]["token_ids"]
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


async def test_each_turn_of_a_chat_is_served_the_earlier_turns_from_the_cache() -> None:
    """Turn two's prompt is turn one's, its answer and the new message: the cache serves
    turn one's prompt (its whole pages) and computes only the rest."""
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        body = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
        first = await post(session, url, "/v1/chat/completions", body)
        answer = first["choices"][0]["message"]
        turn2 = [*CHAT, answer, {"role": "user", "content": "And one between 20 and 30?"}]
        second = await post(session, url, "/v1/chat/completions", {**body, "messages": turn2})
    prompt1 = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1 // 16 * 16 > 0


async def test_a_streamed_chat_sends_the_role_first_then_deltas_that_join_to_the_message(
        ) -> None:
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0,
            "stream_options": {"include_usage": True}}
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        whole = await post(session, url, "/v1/chat/completions",
                           {k: v for k, v in body.items() if k != "stream_options"})
        got = await chunks(session, url, body)
    tokens, finish, usage = got[:5], got[5], got[6]
    assert all(c["object"] == "chat.completion.chunk" for c in got)
    assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in tokens[1:])
    # the last chunk carries what was held back (here a character whose bytes are cut off)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in [*tokens, finish])
    assert text == whole["choices"][0]["message"]["content"]
    assert set(finish["choices"][0]["delta"]) <= {"content"}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


async def test_a_checkpoints_own_template_and_end_of_sequence_are_used(tmp_path: Path) -> None:
    """A local checkpoint with a transformers tokenizer: its Jinja chat template makes the
    prompt (its `apply_chat_template`, token for token) and its end-of-sequence token ends
    the answer (``finish_reason: "stop"``, the token not in the text)."""
    model = tiny_llama(seed=5, **MODEL)
    async with engine(word_tokenizer()) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        body = {"messages": [{"role": "user", "content": "w10 w11 w12"}], "max_tokens": 8,
                "temperature": 0}
        free = await post(session, url, "/v1/chat/completions", body)
    ids = free["aiohicache"]["token_ids"]
    assert free["usage"]["prompt_tokens"] == 5  # <|user|> w10 w11 w12 <|assistant|>
    end = next(i for i, t in enumerate(ids) if i >= 1 and t >= 4 and t not in ids[:i])
    model.save_pretrained(tmp_path / "ckpt")
    word_tokenizer(eos=f"w{ids[end]}").save_pretrained(tmp_path / "ckpt")
    loaded, tokenizer, name = load_model(str(tmp_path / "ckpt"))
    async with Engine(loaded, tokenizer, EngineConfig(page_size=16, device_tokens=2048),
                      name=name) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        got = await post(session, url, "/v1/chat/completions", body)
    assert got["aiohicache"]["token_ids"] == ids[:end + 1]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["choices"][0]["message"]["content"] == tokenizer.decode(ids[:end])


@pytest.mark.parametrize(("messages", "message"), [
    (None, "messages: a non-empty list"),
    ([], "messages: a non-empty list"),
    (["hi"], "messages[0]: an object"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role: one of"),
    ([{"role": "user", "content": 5}], "messages[0].content: a string"),
    ([{"role": "user", "content": None}], "messages[0].content: a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content: only text parts"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}],
     "messages[1].content: not valid Unicode"),
])
async def test_bad_messages_get_a_400_naming_the_message(messages: object, message: str) -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        got = await post(session, url, "/v1/chat/completions",
                         {"messages": messages, "max_tokens": 1})
    assert got["status"] == 400 and got["error"]["message"].startswith(message), got


async def test_text_parts_and_an_empty_assistant_turn_are_taken() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None}, {"role": "user", "content": "c"}]
    joined = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""},
              {"role": "user", "content": "c"}]
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        got = await post(session, url, "/v1/chat/completions",
                         {"messages": parts, "max_tokens": 1})
    assert got["status"] == 200
    assert got["usage"]["prompt_tokens"] == len(ByteTokenizer().render_chat(joined))


@pytest.mark.parametrize(("tokenizer", "message"), [
    (lambda: word_tokenizer(template=None), "has no chat template"),
    (word_tokenizer, "the chat template refused them: the first message may not be"),
], ids=["no-template", "template-raises"])
async def test_a_chat_the_template_cannot_render_is_a_400(tokenizer: Any, message: str) -> None:
    async with engine(tokenizer()) as eng, running_server(eng) as url, \
            aiohttp.ClientSession() as session:
        got = await post(session, url, "/v1/chat/completions",
                         {"messages": [{"role": "assistant", "content": "w5"}]})
    assert got["status"] == 400 and message in got["error"]["message"], got


async def test_a_chat_template_that_does_not_parse_is_the_servers_error() -> None:
    """A 500 naming the template: the server's set-up, not the client's messages."""
    async with engine(word_tokenizer(template="{% for m in messages %}")) as eng, \
            running_server(eng) as url, aiohttp.ClientSession() as session:
        got = await post(session, url, "/v1/chat/completions", {"messages": CHAT})
    assert got["status"] == 500 and "chat template: does not parse" in got["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("logprobs", True), ("n", 2),
])
async def test_chat_fields_the_server_does_not_implement_are_refused_by_name(
        field: str, value: object) -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        got = await post(session, url, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 1, field: value})
        neutral = await post(session, url, "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 1, "tools": [], "n": 1,
                              "logprobs": False, "response_format": {"type": "text"}})
    assert got["status"] == 400 and got["error"]["message"].startswith(f"{field}:")
    assert neutral["status"] == 200


async def test_max_completion_tokens_sets_the_length_and_stop_strings_apply() -> None:
    async with engine() as eng, running_server(eng) as url, aiohttp.ClientSession() as session:
        long = await post(session, url, "/v1/chat/completions",
                          {"messages": CHAT, "max_completion_tokens": 3, "max_tokens": 9,
                           "temperature": 0})
        bad = await post(session, url, "/v1/chat/completions",
                         {"messages": CHAT, "max_completion_tokens": 0})
    assert long["usage"]["completion_tokens"] == 3
    assert bad["status"] == 400 and bad["error"]["message"].startswith("max_completion_tokens")
