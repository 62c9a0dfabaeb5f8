"""vLLM's --chat-template-content-format: a template that loops over a message's content gets
it as text parts ("openai"; read from its syntax tree under "auto"), others the text
("string"); the server, /tokenize and LLM.chat render with it, and a parts template given a
string would have printed nothing of it."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill import LLM, SamplingParams
from tokenmill.engine.chat_content import as_content, content_format
from tokenmill.engine.llm_engine import LLMEngine

PARTS = ("{% for message in messages %}<{{ message['role'] }}:"
         "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}>{% endfor %}"
         "{% if add_generation_prompt %}A:{% endif %}")
ALIASED = ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
           "{% set content = m.content %}{% for p in content | list %}{{ p.text }}{% endfor %}"
           "{% endfor %}")
STRING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
GUARDED = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
           "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}"
           "{% endfor %}")


@pytest.mark.parametrize("template, fmt", [
    (PARTS, "openai"), (ALIASED, "openai"), (GUARDED, "openai"), (STRING, "string"),
    ("{{ messages[0]['content'] }}", "string"), ("{% for x in y %}{{ x }}{% endfor %}",
                                                 "string"),
])
def test_the_format_is_read_from_the_template(template, fmt):
    assert content_format(template) == fmt
    assert content_format(template, "string") == "string"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        content_format(template, "parts")


def test_content_in_either_format():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert as_content("hi", "openai") == [{"type": "text", "text": "hi"}]
    assert as_content(parts, "openai") == parts and as_content(parts, "string") == "a\nb"
    assert as_content(None, "openai") is None and as_content("hi", "string") == "hi"
    with pytest.raises(ValueError, match="text parts"):
        as_content([{"type": "image_url", "image_url": {}}], "string")


def test_a_parts_template_renders_the_text(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=64,
                                    chat_template=PARTS)
    expected = engine.tokenizer.encode("<user:Hi there>A:", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi there"}]
    for srv in start_server(engine, "m"):
        tokens = httpx.post(f"{srv.base_url}/tokenize", json={"messages": messages}).json()
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Hi there"}]}], "max_tokens": 1})
        srv.wait_idle()
    assert tokens["tokens"] == expected
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)


def test_llm_chat_renders_in_the_format_asked(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, max_model_len=512, num_kv_blocks=64, chat_template=PARTS)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1)
    messages = [{"role": "user", "content": "Hi there"}]
    (auto,) = llm.chat(messages, params, use_tqdm=False)
    assert auto.prompt_token_ids == tok.encode("<user:Hi there>A:", add_special_tokens=False)
    (forced,) = llm.chat(messages, params, use_tqdm=False,
                         chat_template_content_format="string")
    assert forced.prompt_token_ids == tok.encode("<user:>A:", add_special_tokens=False)
    string = LLM(path, max_model_len=512, num_kv_blocks=64, chat_template=STRING,
                 chat_template_content_format="openai")
    (parts,) = string.chat(messages, params, use_tqdm=False)
    assert "'text': 'Hi there'" in tok.decode(parts.prompt_token_ids)  # as asked: parts
    string.engine.shutdown()
    llm.engine.shutdown()
