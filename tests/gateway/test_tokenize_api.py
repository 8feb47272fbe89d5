"""POST /tokenize and /detokenize (vLLM's) through the real mesh, with httpx, against transformers'
tokenizer: a raw prompt as ``tokenizer(prompt)`` encodes it, chat messages as
``apply_chat_template`` renders them (the tokenizer service's recipe), ids back to text as
``tokenizer.decode``; errors in OpenAI's shape.
"""

from __future__ import annotations

import httpx
import pytest

from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model

MODEL = DEFAULT_MODEL_NAME
CONTEXT = 8192
CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Ünïcode 東京 🦊"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_default_model(progress=False))


@pytest.fixture
def http(mesh):
    with httpx.Client(base_url=mesh.gateway_url, timeout=60) as c:
        yield c


def template_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                   return_dict=True)["input_ids"]


def test_tokenize_a_prompt_as_the_tokenizer_does(http, tok):
    text = "<|im_start|>user\nThe quick brown fox, naïve café 東京 🦊"
    want = tok(text)["input_ids"]
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(want), "max_model_len": CONTEXT, "tokens": want}
    assert want[0] == tok.convert_tokens_to_ids("<|im_start|>")  # a raw prompt's special tokens are parsed
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_as_the_chat_template_renders_them(http, tok, add_generation_prompt):
    r = http.post("/tokenize", json={"model": MODEL, "messages": CHAT, "add_generation_prompt": add_generation_prompt})
    assert r.status_code == 200, r.text
    want = template_ids(tok, CHAT, add_generation_prompt)
    assert r.json() == {"count": len(want), "max_model_len": CONTEXT, "tokens": want}


def test_tokenize_counts_what_chat_completions_bills(http, openai_client):
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    counted = http.post("/tokenize", json={"messages": CHAT, "tools": tools}).json()["count"]
    r = openai_client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, max_tokens=1)
    assert r.usage.prompt_tokens == counted


def test_detokenize_is_the_tokenizers_decode_and_round_trips(http, tok):
    ids = template_ids(tok, CHAT, True)
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)}  # special tokens included, as vLLM returns them
    assert http.post("/tokenize", json={"prompt": r.json()["prompt"]}).json()["tokens"] == ids


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-17", "tokens": [1]}, 404, "model"),
])
def test_errors_have_the_openai_shape(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
