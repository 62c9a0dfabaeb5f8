"""A chat template asked for (vLLM's --chat-template, engine option chat_template) renders
every conversation instead of the tokenizer's: chat completions, /tokenize and LLM.chat (also
per call, as vLLM's LLM.chat takes one)."""

from __future__ import annotations

import httpx

from tests.server.conftest import start_server
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}ANSWER:{% endif %}")


def test_the_asked_template_renders_conversations(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=100,
                                    chat_template=str(file))
    tok = engine.tokenizer
    expected = tok.encode("<<user: Hi there>>ANSWER:", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi there"}]
    for srv in start_server(engine, "m"):
        tokens = httpx.post(f"{srv.base_url}/tokenize", json={"messages": messages}).json()
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "max_tokens": 2, "temperature": 0})
        srv.wait_idle()
    assert tokens["tokens"] == expected
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)


def test_llm_chat_takes_the_engine_s_template_or_its_own(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, max_model_len=512, num_kv_blocks=64, chat_template=TEMPLATE)
    params = SamplingParams(temperature=0, max_tokens=2)
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, params, use_tqdm=False)[0]
    assert out.prompt == "<<user: Hi>>ANSWER:"
    own = llm.chat(messages, params, use_tqdm=False, chat_template="[{{ messages[0]['content'] }}]")
    assert own[0].prompt == "[Hi]"


def test_continue_final_message_and_a_request_s_own_template(tiny_model):
    """vLLM's continue_final_message (the last message left open: the answer continues it;
    not with add_generation_prompt) and a request's chat_template (only on a server started
    with --trust-request-chat-template; refused by name otherwise)."""
    from tokenmill.server.serving_common import ServingOptions

    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=100,
                                    chat_template=TEMPLATE)
    tok = engine.tokenizer
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]

    def post(srv, **body):
        return httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", "max_tokens": 2, "temperature": 0, **body})

    for srv in start_server(engine, "m"):
        cont = post(srv, messages=prefill, continue_final_message=True,
                    add_generation_prompt=False)
        both = post(srv, messages=prefill, continue_final_message=True)
        own = post(srv, messages=prefill[:1], chat_template="[{{ messages[0]['content'] }}]")
        srv.wait_idle()
    # (the engine's template, cut right after the last message's text: it stays open)
    assert cont.json()["usage"]["prompt_tokens"] == len(
        tok.encode("<<user: Hi>><<assistant: Well", add_special_tokens=False))
    assert cont.json()["choices"][0]["message"]["role"] == "assistant"
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]
    assert own.status_code == 400
    assert own.json()["error"]["param"] == "chat_template"
    for srv in start_server(engine, "m", answers=ServingOptions(trust_request_chat_template=True)):
        own = post(srv, messages=prefill[:1], chat_template="[{{ messages[0]['content'] }}]")
        srv.wait_idle()
    assert own.status_code == 200
    assert own.json()["usage"]["prompt_tokens"] == len(tok.encode("[Hi]",
                                                                  add_special_tokens=False))


def test_documents_and_special_tokens(tiny_model):
    """vLLM's chat fields `documents` (for a template that renders them; refused by name by
    one that does not) and `add_special_tokens` (the tokenizer's BOS on top of the
    template's)."""
    from tokenmill.server.serving_common import ServingOptions

    path, _ = tiny_model("llama")
    rag = ("{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
           + TEMPLATE)
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=100)
    tok = engine.tokenizer
    tok.add_bos_token = True  # (SmolLM2's tokenizer adds none of its own)
    messages = [{"role": "user", "content": "Hi"}]
    docs = [{"title": "A", "text": "alpha"}]

    def tokens(srv, **body) -> httpx.Response:
        return httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "max_tokens": 1, **body})

    for srv in start_server(engine, "m", answers=ServingOptions(trust_request_chat_template=True)):
        with_docs = tokens(srv, chat_template=rag, documents=docs)
        refused = tokens(srv, chat_template=TEMPLATE, documents=docs)
        bos = tokens(srv, chat_template=TEMPLATE, add_special_tokens=True)
        plain = tokens(srv, chat_template=TEMPLATE)
        srv.wait_idle()
    text = "[A: alpha]<<user: Hi>>ANSWER:"
    assert with_docs.json()["usage"]["prompt_tokens"] == len(
        tok.encode(text, add_special_tokens=False))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
    assert bos.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + 1
