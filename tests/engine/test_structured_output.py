"""Structured output: grammars from specs, matchers, the sampler's grammar stage, the
engine on the real model (20 JSON schemas, greedy and sampled, alone and in one mixed batch;
regex and choice; prefill -> decode), and the gateway (400s naming the feature; tool calls forced
by ``tool_choice`` through the official client on the real mesh).
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import openai
import pytest
import torch

from deepinfer.engine.interface import EngineConfig, RequestError
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampler import sample
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import (GrammarCompiler, StructuredOutputError, allocate_bitmask, apply_bitmask,
                                         compile_grammar, spec_key)
from deepinfer.gateway.api.tools import ToolCallParser, strict_tool_call_grammar, tool_call_grammar
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model
from deepinfer.protocol import PrefillRequest, SamplingParams, pack, unpack

S = 12  # longest string in the schemas below: every leaf is bounded, so every instance fits max_tokens
STR = {"type": "string", "maxLength": S}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = {
    "flat": obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "nested_objects": obj({"person": obj({"first": STR, "last": STR}), "city": STR}),
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 2, "maxItems": 4},
    "string_enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "number_range": obj({"celsius": {"type": "number", "minimum": -50, "maximum": 50}}),
    "required_optional": obj({"id": SMALL, "label": STR, "score": SMALL}, required=["id"]),
    "any_of": obj({"value": {"anyOf": [SMALL, {"type": "string", "maxLength": 8}]}}),
    "string_pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "string_lengths": obj({"word": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "const": obj({"version": {"const": 2}, "kind": {"const": "point"}, "x": SMALL}),
    "boolean_null": obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    "array_of_objects": obj({"points": {"type": "array", "items": obj({"x": SMALL, "y": SMALL}),
                                        "minItems": 1, "maxItems": 3}}),
    "nested_arrays": obj({"grid": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    "refs": {**obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}}),
             "$defs": {"pt": obj({"x": SMALL, "y": SMALL})}},
    "mixed_enum": obj({"v": {"enum": ["a", 1, None, True]}}),
    "all_of": {"allOf": [obj({"a": SMALL}), {"required": ["a"]}]},
    "date_format": obj({"day": {"type": "string", "format": "date"}}),
    "nullable": obj({"nick": {"type": ["string", "null"], "maxLength": 8}}),
    "one_of": obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}}),
                                       obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}})]}}),
    "exclusive_bounds": obj({"level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                      "maxItems": 2}}),
}
MAX_TOKENS = 96
EOS = 2  # SmolLM2's <|im_end|>


def json_spec(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema}


# --- specs and grammars (no model) ----------------------------------------------------------


def test_every_spec_form_compiles_and_the_cache_is_keyed_by_canonical_json():
    specs = [{"type": "json_object"}, *[json_spec(s) for s in SCHEMAS.values()],
             {"type": "regex", "pattern": "[0-9]{3}-[a-z]+"}, {"type": "choice", "choices": ["yes", 'no "q"', "é\n"]},
             {"type": "grammar", "lark": 'start: "a" b\nb: %json {"type": "integer"}'}]
    for spec in specs:
        assert compile_grammar(spec)
    reordered = {"schema": SCHEMAS["flat"], "type": "json_schema"}
    assert spec_key(reordered) == spec_key(json_spec(SCHEMAS["flat"]))
    assert compile_grammar(reordered) is compile_grammar(json_spec(SCHEMAS["flat"]))  # one cache entry


@pytest.mark.parametrize("spec, named", [
    (json_spec({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (json_spec({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "not"),
    (json_spec({"if": {"type": "string"}, "then": {"maxLength": 3}}), "if"),
    (json_spec({"type": "string", "format": "ipv9"}), "ipv9"),
    (json_spec({"$ref": "#/$defs/missing"}), "/$defs/missing"),
    ({"type": "regex", "pattern": "(unclosed"}, "unclosed"),
    ({"type": "grammar", "lark": "start: undefined_rule"}, "undefined_rule"),
    ({"type": "choice", "choices": []}, "choices"),
    ({"type": "xml"}, "xml"),
])
def test_unsupported_or_malformed_specs_raise_naming_the_feature(spec, named):
    with pytest.raises(StructuredOutputError, match=re.escape(named)):
        compile_grammar(spec)


def test_sampling_params_carry_the_spec_over_msgpack():
    sp = SamplingParams(max_tokens=5, structured=json_spec(SCHEMAS["refs"]))
    req = PrefillRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sp, stream_subject="s")
    back = unpack(pack(req))
    assert back.sampling.structured == sp.structured and back.sampling == sp
    assert SamplingParams.from_dict(sp.to_dict()) == sp and SamplingParams().structured is None


def test_apply_bitmask_matches_a_bit_by_bit_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32; bit 31 (the sign bit) included
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab, generator=g)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    for r in range(3):
        for t in range(vocab):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert masked[r, t] == (logits[r, t] if allowed else float("-inf"))
    assert allocate_bitmask(2, 70).shape == (2, 3) and bool((allocate_bitmask(1, 5) == -1).all())


# --- the sampler's grammar stage (a stand-in matcher, synthetic logits) ------------------------


class AllowOnly:
    """A matcher stand-in: allows ``tokens`` next (what the sampler needs: ``fill_bitmask``)."""

    def __init__(self, *tokens):
        self.tokens = tokens

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self.tokens:
            bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(2**31)


def seq_with(**sampling) -> Sequence:
    return Sequence("r", [5, 6], 2, SamplingParams(**sampling))


def test_the_grammar_mask_comes_first_for_greedy_sampling_and_logprobs_row_by_row():
    logits = torch.arange(40, dtype=torch.float32).repeat(3, 1)  # token 39 is everyone's argmax
    seqs = [seq_with(temperature=0, logprobs=True, top_logprobs=3),
            seq_with(temperature=0),
            seq_with(temperature=1.0, logit_bias={39: 100.0})]  # bias cannot lift a masked token
    matchers = [AllowOnly(3, 7), None, AllowOnly(33)]
    out = sample(logits, seqs, [None] * 3, matchers=matchers)
    assert out.token_ids == [7, 39, 33]
    lp = out.logprobs[0]
    assert lp.top[:2] == [(7, pytest.approx(math.log(1 / (1 + math.e ** -4)), abs=1e-6)),
                          (3, pytest.approx(math.log(1 / (1 + math.e ** 4)), abs=1e-6))]
    assert lp.top[2][1] == float("-inf")  # fewer allowed tokens than top_logprobs: the rest are -inf
    for _ in range(50):
        assert sample(logits[2:], seqs[2:], [None], matchers=matchers[2:]).token_ids[0] == 33
    assert sample(logits, seqs, [None] * 3).token_ids[2] == 39  # no matchers: no grammar


def test_a_complete_grammar_wins_over_min_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]])
    # the grammar allows only EOS (2), min_tokens bans it: EOS anyway (an all -inf row has no answer)
    greedy = [seq_with(temperature=0, min_tokens=5)]
    assert sample(logits, greedy, [None], [2], [AllowOnly(2)]).token_ids == [2]
    # it still bans EOS while the grammar allows something else
    assert sample(logits, greedy, [None], [2], [AllowOnly(1, 2)]).token_ids == [1]


# --- matchers on the model's tokenizer (no weights) --------------------------------------------


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def compiler(model_dir):
    c = GrammarCompiler(model_dir, vocab_size=49152 + 40, eos_token_ids=[EOS])  # logits wider than the tokenizer
    yield c
    c.shutdown()


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask[row:row + 1])
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_matcher_accepts_rolls_back_and_ends_with_eos_only(compiler, tok):
    m = compiler.matcher(json_spec(obj({"a": SMALL})))
    ids = tok.encode('{"a": 42}')
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bitmask, 0)  # waits for the build
    first = allowed(bitmask, 0, compiler.vocab_size)
    assert ids[0] in first and all(t < 49152 for t in first)
    assert m.validate(ids + [EOS]) == len(ids) + 1 and m.num_tokens == 0
    assert m.accept(ids) and m.is_terminated and m.num_tokens == len(ids)
    m.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, compiler.vocab_size) == [EOS]  # complete: only EOS
    m.rollback(2)
    assert not m.is_terminated and m.num_tokens == len(ids) - 2
    assert m.try_accept(ids[-2:] + tok.encode("xyz")) == 2 and m.is_terminated and not m.is_error
    with pytest.raises(ValueError):
        m.rollback(len(ids) + 1)


def test_a_refused_token_puts_the_matcher_in_an_error_state_that_allows_only_eos(compiler, tok):
    m = compiler.matcher({"type": "choice", "choices": ["yes", "no"]})
    assert not m.accept(tok.encode("maybe")) and m.is_error and "maybe"[0] in m.error
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, compiler.vocab_size) == [EOS]


def test_draft_masks_follow_the_valid_drafts_and_leave_the_matcher_unchanged(compiler, tok):
    m = compiler.matcher({"type": "regex", "pattern": "[0-9]{4}"})
    digits = [tok.encode(d)[0] for d in "1234"]
    letter = tok.encode("x")[0]
    bitmask = allocate_bitmask(4, compiler.vocab_size)
    n = m.fill_bitmask_with_draft(bitmask, 0, [digits[0], letter, digits[1]])
    assert n == 1 and m.num_tokens == 0
    assert digits[0] in allowed(bitmask, 0, compiler.vocab_size) and letter not in allowed(bitmask, 0, 49192)
    assert letter not in allowed(bitmask, 1, compiler.vocab_size)  # the mask after the first draft
    assert bool((bitmask[2:] == -1).all())  # after the refused draft: never used, all allowed
    assert m.try_accept([digits[0], letter]) == 1 and m.num_tokens == 1


def test_prefix_tokens_are_consumed_at_build_and_a_narrower_bitmask_is_filled(compiler, tok):
    ids = tok.encode('{"a": 4')
    m = compiler.matcher(json_spec(obj({"a": SMALL})), ids)
    assert m.num_tokens == len(ids)
    narrow = allocate_bitmask(1, 49152)  # fewer words than the tokenizer side: filled through a scratch row
    m.fill_bitmask(narrow, 0)
    nxt = allowed(narrow, 0, 49152)
    assert tok.encode("}")[0] in nxt and tok.encode(",")[0] not in nxt


def test_tool_call_grammar_accepts_the_parsers_format_only(compiler, tok):
    params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
              "$defs": {"Loc": obj({"city": STR})}}
    spec = {"type": "grammar", "lark": tool_call_grammar([("get_weather", params), ("ping", None)], parallel=False)}
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"loc": {"city": "Paris"}}}\n</tool_call>'
    for text, ok in [(good, True), (good.replace("get_weather", "nope"), False),
                     (good.replace('"Paris"', "3"), False), (good + "\n" + good, False),
                     ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', True)]:
        ids = tok.encode(text)
        assert (compiler.matcher(spec).validate(ids + [EOS]) == len(ids) + 1) is ok, text
        if ok:
            assert [c.name for c in ToolCallParser().feed(text)[1]] == [json.loads(text.split("\n")[1])["name"]]


def test_strict_tools_not_forced_leave_text_free_and_constrain_each_call_started(compiler, tok):
    """tool_choice "auto" with a strict tool: any text, with or without calls; once ``<tool_call>`` is
    written the call is one of the tools', a strict tool's arguments an instance of its schema, a
    loose one's any object; text may follow a call."""
    city = {"type": "object", "properties": {"city": STR}, "required": ["city"]}
    spec = {"type": "grammar", "lark": strict_tool_call_grammar([("get_weather", city, True), ("loose", None, False)])}

    def call(name, args):
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"

    paris = call("get_weather", {"city": "Paris"})
    cases = [("Hello, no call.", True), ("", True), ("a <tool_ call> b", True), (f"Checking. {paris} Done.", True),
             (paris + "\n" + call("get_weather", {"city": "Oslo"}), True), (call("loose", {"any": [1]}), True),
             ("x " + call("get_weather", {"town": "Paris"}), False), ("x " + call("get_weather", {"city": 3}), False),
             (call("nope", {}), False), ("<tool_call>oops", False)]
    for text, ok in cases:
        ids = tok.encode(text)
        assert (compiler.matcher(spec).validate(ids + [EOS]) == len(ids) + 1) is ok, text
    calls = ToolCallParser().feed(f"Checking. {paris} Done.")[1]
    assert [(c.name, c.arguments_obj) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_tool_parameters_are_the_root_of_their_own_references_and_always_objects(compiler, tok):
    """``#`` and ``#/properties/...`` in a tool's parameters resolve inside those parameters (not the
    call around them); ``{}`` means any object, a non-object schema is refused."""
    tree = {"type": "object", "properties": {"label": {"type": "string"}, "children": {"type": "array",
            "items": {"$ref": "#"}}}, "required": ["label"], "additionalProperties": False}
    ptr = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}

    def accepts(tools, name, args) -> bool:
        spec = {"type": "grammar", "lark": tool_call_grammar(tools, parallel=False)}
        ids = tok.encode("<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>")
        return compiler.matcher(spec).validate(ids + [EOS]) == len(ids) + 1

    assert accepts([("t", tree)], "t", {"label": "r", "children": [{"label": "c", "children": []}]})
    assert not accepts([("t", tree)], "t", {"label": "r", "children": [{"name": "t", "arguments": {"label": "c"}}]})
    assert accepts([("p", ptr)], "p", {"a": 1, "b": 2}) and not accepts([("p", ptr)], "p", {"a": 1, "b": "x"})
    assert accepts([("e", {})], "e", {"any": [1]})
    for args in (None, "now", [1], 3):
        assert not accepts([("e", {})], "e", args), args
    for bad in ({"type": "string"}, True):
        with pytest.raises(StructuredOutputError, match="type 'object'"):
            tool_call_grammar([("e", bad)])


def test_forced_arguments_have_exactly_the_declared_properties(compiler, tok):
    """Declared ``properties`` are all the arguments unless ``additionalProperties`` allows more: a
    function with no parameters (none given, or no properties) takes ``{}`` only."""
    def accepts(parameters, args) -> bool:
        spec = {"type": "grammar", "lark": tool_call_grammar([("f", parameters)], parallel=False)}
        ids = tok.encode(f"<tool_call>\n{json.dumps({'name': 'f', 'arguments': args})}\n</tool_call>")
        return compiler.matcher(spec).validate(ids + [EOS]) == len(ids) + 1

    for none in (None, {"type": "object", "properties": {}}, {"properties": {}}):
        assert accepts(none, {}) and not accepts(none, {"x": 1}), none
    city = {"type": "object", "properties": {"city": STR}}
    assert accepts(city, {"city": "Paris"}) and accepts(city, {})
    assert not accepts(city, {"city": "Paris", "country": "FR"})
    assert accepts({**city, "additionalProperties": True}, {"city": "Paris", "country": "FR"})
    assert accepts({**city, "additionalProperties": SMALL}, {"city": "Paris", "n": 3})


# --- the engine on the real model --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_dir):
    e = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=256 << 20))
    yield e
    e.structured.shutdown()


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def schema_prompt(tok, schema: dict) -> list[int]:
    return chat(tok, "Give an example JSON value for this schema: " + json.dumps(schema))


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """Run requests together to completion: request id -> (output tokens, finish reason)."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    out = {rid: [] for rid in requests}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step_async():
            out[o.request_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    return {rid: (out[rid], reasons[rid]) for rid in requests}


def check_instance(tok, name: str, tokens: list[int], reason: str) -> None:
    assert reason == "stop" and tokens[-1] == EOS, (name, reason, tok.decode(tokens))
    instance = json.loads(tok.decode(tokens[:-1]))
    jsonschema.validate(instance, SCHEMAS[name], format_checker=jsonschema.FormatChecker())


def sampling(name: str, greedy: bool, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else 1.0, seed=None if greedy else seed, max_tokens=MAX_TOKENS,
                          structured=json_spec(SCHEMAS[name]))


def test_schemas_alone_give_valid_instances_greedy_and_sampled(engine, tok):
    """A schema the only one in the engine (every row of the batch constrained): one greedy and
    one sampled request (temperature 1). A few structurally different schemas; every schema runs
    in the mixed batch below."""
    for i, name in enumerate(("flat", "nested_arrays", "one_of", "date_format")):
        prompt = schema_prompt(tok, SCHEMAS[name])
        out = run(engine, {"greedy": (prompt, sampling(name, True)), "sampled": (prompt, sampling(name, False, i))})
        for tokens, reason in out.values():
            check_instance(tok, name, tokens, reason)


def test_one_batch_of_mixed_schemas_greedy_and_sampled_regex_choice_and_free_text(engine, tok):
    requests = {}
    for i, name in enumerate(SCHEMAS):
        requests[f"{name}/greedy"] = (schema_prompt(tok, SCHEMAS[name]), sampling(name, True))
        requests[f"{name}/sampled"] = (schema_prompt(tok, SCHEMAS[name]), sampling(name, False, seed=100 + i))
    phone = {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"}
    choice = {"type": "choice", "choices": ["yes", "no", "maybe not"]}
    for k in range(2):  # n = 2: each its own matcher
        requests[f"phone/{k}"] = (chat(tok, "Give a phone number."),
                                  SamplingParams(temperature=1.0, seed=k, max_tokens=16, structured=phone))
        requests[f"choice/{k}"] = (chat(tok, "Is the sky blue?"),
                                   SamplingParams(temperature=1.0, seed=k, max_tokens=8, structured=choice))
    requests["free"] = (chat(tok, "Say hi."), SamplingParams(temperature=0.0, max_tokens=6))
    out = run(engine, requests)
    assert engine.peak_batch_size >= len(SCHEMAS) * 2, "not one batch"
    for rid, (tokens, reason) in out.items():
        kind = rid.split("/")[0]
        if kind in SCHEMAS:
            check_instance(tok, kind, tokens, reason)
        elif kind == "phone":
            assert reason == "stop" and re.fullmatch("[0-9]{3}-[0-9]{4}", tok.decode(tokens[:-1])), tok.decode(tokens)
        elif kind == "choice":
            assert reason == "stop" and tok.decode(tokens[:-1]) in choice["choices"]
    assert out["free"][1] == "length"  # unconstrained neighbours are untouched


def test_prefill_engine_masks_the_first_token_and_decode_continues_the_grammar(engine, model_dir, tok):
    spec = {"type": "choice", "choices": ["Paris is the capital", "London"]}
    prompt = chat(tok, "Capital of France?")
    pre = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=32 << 20, prefill_only=True))
    pre.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=20, structured=spec))
    first = []
    while pre.has_unfinished():
        first += [o for o in pre.step()]
    (out,) = first
    assert out.finish_reason == "handoff" and any(c.startswith(tok.decode(out.new_token_ids)) for c in spec["choices"])
    engine.add_request("d", prompt, SamplingParams(temperature=0.0, max_tokens=20, structured=spec),
                       output_token_ids=out.new_token_ids, kv_blocks=out.kv_blocks, num_kv_tokens=out.num_kv_tokens)
    rest = []
    while engine.has_unfinished():
        for o in engine.step():
            rest += o.new_token_ids
    assert tok.decode(out.new_token_ids + rest[:-1]) in spec["choices"] and rest[-1] == EOS


def test_ignore_eos_stops_when_the_grammar_is_complete(engine, tok):
    """Nothing may follow a complete grammar: an ``ignore_eos`` request ends there with "stop"."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                        structured={"type": "choice", "choices": ["yes", "no"]})
    tokens, reason = run(engine, {"r": (chat(tok, "Yes or no?"), sp)})["r"]
    assert reason == "stop" and tok.decode(tokens, skip_special_tokens=True) in ("yes", "no")


def test_the_engine_refuses_an_unsupported_spec_and_the_mock_engine_any_spec(engine, model_dir):
    with pytest.raises(RequestError, match="uniqueItems"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=json_spec({"type": "array",
                                                                                   "uniqueItems": True})))
    from deepinfer.engine.mock import MockEngine

    with pytest.raises(RequestError, match="mock engine"):
        MockEngine(model_dir, EngineConfig(kv_cache_bytes=1 << 20)).check_request(
            [1, 2], sampling=SamplingParams(structured={"type": "json_object"}))


# --- the gateway on the real mesh --------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": obj({"city": STR, "unit": {"enum": ["C", "F"]}})}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                         "parameters": obj({"city": STR})}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client_chat(client, **kw):
    kw.setdefault("max_tokens", 64)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=kw.pop("messages", ASK), **kw)


def test_forced_tool_calls_and_auto_through_the_official_client(openai_client):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = _client_chat(openai_client, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.content is None, c
        (call,) = c.message.tool_calls
        if choice != "required":
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    # streamed, parallel calls allowed: every call validates
    stream = _client_chat(openai_client, tools=[WEATHER], tool_choice="required", stream=True, max_tokens=96)
    calls, reasons, text = [], [], ""
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            reasons.append(ch.finish_reason)
            text += ch.delta.content or ""
    assert calls and reasons[-1] in ("tool_calls", "length")
    assert text == ""  # no content around the calls (a call cut by max_tokens is dropped)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name["get_weather"])
    # auto: this model writes text (its template does not show tools), so no call and "stop"/"length"
    r = _client_chat(openai_client, tools=[WEATHER], tool_choice="auto", max_tokens=24)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


PING = {"type": "function", "function": {"name": "ping", "description": "Check that the service is up"}}
RESET = {"type": "function", "function": {"name": "reset", "description": "Reset the counter",
                                          "parameters": {"type": "object", "properties": {}}}}


def test_a_forced_call_of_a_function_without_parameters_has_arguments_empty(openai_client):
    for tools, choice in (([PING], "required"), ([RESET], "required"),
                          ([WEATHER, RESET], {"type": "function", "function": {"name": "reset"}})):
        r = _client_chat(openai_client, tools=tools, tool_choice=choice, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
            (tools[-1]["function"]["name"], "{}")]
    stream = _client_chat(openai_client, tools=[RESET], tool_choice="required", parallel_tool_calls=False,
                          stream=True)
    calls, reasons = [], []
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            reasons.append(ch.finish_reason)
    assert [(t.function.name, t.function.arguments) for t in calls] == [("reset", "{}")]
    assert reasons[-1] == "tool_calls"


def test_response_format_and_guided_fields_through_the_mesh_and_400_naming_the_feature(openai_client):
    schema = SCHEMAS["flat"]
    r = _client_chat(openai_client, messages=[{"role": "user", "content": "A person as JSON."}], n=2,
                     temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                     response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                              "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    r = openai_client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The answer is", max_tokens=8,
                                         temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        _client_chat(openai_client, response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "array", "uniqueItems": True}}})
    err = e.value.body
    assert err["param"] == "response_format" and "uniqueItems" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        _client_chat(openai_client, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}], tool_choice="required")
    assert e.value.body["param"] == "tools" and '"not"' in e.value.body["message"]


def test_anthropic_output_config_format_through_the_mesh(mesh):
    """Anthropic structured outputs (``output_config.format``) through the official client: the text
    is an instance of the schema, streamed and not; the client's ``parse`` helper reads it back."""
    import anthropic
    from pydantic import BaseModel

    schema = SCHEMAS["nested_objects"]
    ask = [{"role": "user", "content": "A person and their city as JSON."}]
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    with anthropic.Anthropic(base_url=mesh.gateway_url, api_key="unused", max_retries=0, timeout=120) as client:
        msg = client.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=MAX_TOKENS, messages=ask,
                                     output_config=fmt)  # sampled (temperature 1)
        assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"], msg
        jsonschema.validate(json.loads(msg.content[0].text), schema)
        with client.messages.stream(model=DEFAULT_MODEL_NAME, max_tokens=MAX_TOKENS, messages=ask, output_config=fmt,
                                    extra_body={"temperature": 0}) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.stop_reason == "end_turn" and final.content[0].text == text
        jsonschema.validate(json.loads(text), schema)

        class Reading(BaseModel):
            celsius: int
            city: str

        parsed = client.messages.parse(model=DEFAULT_MODEL_NAME, max_tokens=MAX_TOKENS, output_format=Reading,
                                       messages=[{"role": "user", "content": "The temperature in Oslo as JSON."}],
                                       extra_body={"temperature": 0})
        assert isinstance(parsed.parsed_output, Reading), parsed
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=8, messages=ask, output_config={
                "format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}})
        err = e.value.body["error"]
        assert err["type"] == "invalid_request_error" and "output_config.format" in err["message"]
        assert "uniqueItems" in err["message"]


def test_verification_passes_its_own_draft_masks(compiler, tok):
    """Speculative verification: the row after a draft token is masked as after that draft."""
    from deepinfer.engine.sampler import apply_logits_processors

    spec = {"type": "regex", "pattern": "[ab][cd]"}
    s, m = seq_with(temperature=0), compiler.matcher(spec)
    a = tok.encode("a")[0]
    bitmask = allocate_bitmask(2, 49152)
    assert m.fill_bitmask_with_draft(bitmask, 0, [a]) == 1 and m.num_tokens == 0
    logits = apply_logits_processors(torch.zeros(2, 49152), [s, s], [EOS], grammar_bitmask=bitmask)
    after_a = compiler.matcher(spec)
    assert after_a.accept([a])
    expected = allocate_bitmask(2, 49152)
    m.fill_bitmask(expected, 0)
    after_a.fill_bitmask(expected, 1)
    for row in range(2):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == allowed(expected, row, 49152)
    assert a in allowed(expected, 0, 49152) and a not in allowed(expected, 1, 49152)
