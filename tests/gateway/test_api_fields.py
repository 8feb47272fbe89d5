"""Every request field of each API, as the official clients define it, is honoured or refused.

The walk reads the request types of the installed ``openai`` and ``anthropic`` clients. Each of
their fields must be in the API's ``honoured`` table, naming the test that shows its effect (for a
no-op: that it changes nothing, and the table says why that is what the field means here), or in
its ``refused`` table with a plausible value that asks for something this server does not do, which
must be a 400 naming the field. A field a newer client adds fails the walk until it is put in one
of them. Requests go to the fake-worker gateway of ``gateway_harness``.
"""

from __future__ import annotations

import ast
import collections.abc
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import anthropic
import openai
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.responses.response_create_params as response_params
import anthropic.types.message_create_params as message_params
import pytest
import typing_extensions
from pydantic import BaseModel, ValidationError

from deepinfer.gateway.api import messages, openai_schema, responses
from deepinfer.gateway.api.unsupported import Refused
from deepinfer.protocol import subjects
from gateway_harness import client, gateway, nats_url, script, sse_events, workers  # noqa: F401
from test_gateway import TOKENIZER, assert_openai_error, stream_events
from waiting import eventually

TESTS = Path(__file__).resolve().parents[1]  # tests/: the test files named below are in its folders
HELLO = [{"role": "user", "content": "Say hello"}]


def noop(test: str, why: str) -> tuple[str, str]:
    """A field honoured by doing nothing, with the reason that is its documented meaning here."""
    return test, why


CHAT_NOOPS = "test_api_fields.py::test_chat_no_op_fields_change_nothing"
RESPONSES_NOOPS = "test_api_fields.py::test_responses_no_op_fields_change_nothing"
MESSAGES_NOOPS = "test_api_fields.py::test_anthropic_no_op_fields_change_nothing"
SINGLE_TENANT = "an id or tag about the caller's end user; one tenant, nothing here bills, ranks or audits by it"
CACHE_HINT = ("a caching hint: the prefix cache caches every prompt's blocks by itself and keeps them by LRU, "
              "so the output and what is cached are what the hint asks for or better")

CHAT = {
    "path": "/v1/chat/completions",
    "module": chat_params,
    "model": openai_schema.ChatCompletionRequest,
    "body": lambda model: {"model": model, "messages": HELLO},
    "honoured": {
        "messages": "test_gateway.py::test_text_content_parts_are_joined",
        "model": "test_gateway.py::test_unknown_model_is_404_model_not_found",
        "max_tokens": "test_gateway.py::test_sampling_defaults_and_extensions_reach_prefill",
        "max_completion_tokens": "test_gateway.py::test_sampling_defaults_and_extensions_reach_prefill",
        "temperature": "test_gateway.py::test_sampling_defaults_and_extensions_reach_prefill",
        "top_p": "test_gateway.py::test_sampling_defaults_and_extensions_reach_prefill",
        "seed": "test_gateway.py::test_sampling_defaults_and_extensions_reach_prefill",
        "n": "test_gateway_sampling.py::test_n_choices_are_independent_requests_with_derived_seeds",
        "frequency_penalty": "test_gateway_sampling.py::test_every_sampling_knob_reaches_prefill",
        "presence_penalty": "test_gateway_sampling.py::test_every_sampling_knob_reaches_prefill",
        "logit_bias": "test_gateway_sampling.py::test_every_sampling_knob_reaches_prefill",
        "logprobs": "test_gateway_sampling.py::test_logprobs_have_openais_exact_shape",
        "top_logprobs": "test_gateway_sampling.py::test_logprobs_have_openais_exact_shape",
        "stop": "test_gateway.py::test_stop_strings_cut_text_identically_when_streaming",
        "stream": "test_gateway.py::test_streamed_text_equals_non_streamed_text_across_split_utf8",
        "stream_options": "test_gateway.py::test_usage_block_counts_prompt_completion_and_cached_tokens",
        "tools": "test_gateway.py::test_tool_calls_are_parsed_streaming_and_not_with_the_official_client",
        "tool_choice": "test_structured_output.py::test_forced_tool_calls_and_auto_through_the_official_client",
        "parallel_tool_calls": "test_api_fields.py::test_parallel_tool_calls_off_ends_the_turn_at_the_first_call",
        "response_format":
            "test_structured_output.py::test_response_format_and_guided_fields_through_the_mesh_and_400_naming_the_feature",
        "user": noop(CHAT_NOOPS, SINGLE_TENANT),
        "safety_identifier": noop(CHAT_NOOPS, SINGLE_TENANT),
        "metadata": noop(CHAT_NOOPS, "tags for filtering stored completions in OpenAI's dashboard; there is none"),
        "prompt_cache_key": noop(CHAT_NOOPS, CACHE_HINT),
        "prompt_cache_retention": noop(CHAT_NOOPS, CACHE_HINT),
        "prediction": noop(CHAT_NOOPS, "a Predicted Output only makes OpenAI faster; the output is the same "
                                       "without it, which is what this server gives"),
    },
    "refused": {
        "audio": {"voice": "alloy", "format": "wav"},
        "function_call": "auto",
        "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}],
        "modalities": ["text", "audio"],
        "moderation": {"model": "omni-moderation-latest"},
        "prompt_cache_options": {"mode": "explicit"},
        "reasoning_effort": "high",
        "service_tier": "flex",
        "store": True,
        "verbosity": "low",
        "web_search_options": {"search_context_size": "low"},
    },
}

COMPLETIONS = {
    "path": "/v1/completions",
    "module": completion_params,
    "model": openai_schema.CompletionRequest,
    "body": lambda model: {"model": model, "prompt": "Once upon a time"},
    "honoured": {
        "prompt": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
        "max_tokens": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
        "stop": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
        "stream": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
        "stream_options": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
        "echo": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
        "logprobs": "test_gateway_sampling.py::test_completions_logprobs_have_the_legacy_shape",
        "model": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "n": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "seed": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "temperature": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "top_p": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "frequency_penalty": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "presence_penalty": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "logit_bias": "test_api_fields.py::test_completions_sampling_fields_reach_prefill",
        "user": noop("test_api_fields.py::test_completions_sampling_fields_reach_prefill", SINGLE_TENANT),
    },
    "refused": {
        "suffix": "\n    return x",
        "best_of": 3,
    },
}

RESPONSES = {
    "path": "/v1/responses",
    "module": response_params,
    "model": responses.ResponsesRequest,
    "body": lambda model: {"model": model, "input": "Say hello", "store": False},
    "honoured": {
        "input": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "instructions": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "temperature": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "top_p": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "max_output_tokens": "test_gateway_responses.py::test_max_output_tokens_makes_the_response_incomplete",
        "model": "test_gateway_responses.py::test_server_is_healthy_after_the_malformed_suite",
        "stream": "test_gateway_responses.py::test_stream_event_sequence_and_text_equal_the_non_streamed_response",
        "tools": "test_gateway_responses.py::test_function_calls_streamed_and_not",
        "store": "test_gateway_responses.py::test_unstored_unknown_and_deleted_responses_are_404",
        "previous_response_id": "test_gateway_responses.py::test_previous_response_id_continues_the_conversation",
        "tool_choice": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "parallel_tool_calls": "test_api_fields.py::test_parallel_tool_calls_off_ends_the_turn_at_the_first_call",
        "text": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "metadata": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "user": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "safety_identifier": noop(RESPONSES_NOOPS, SINGLE_TENANT),
        "prompt_cache_key": noop(RESPONSES_NOOPS, CACHE_HINT),
        "prompt_cache_retention": noop(RESPONSES_NOOPS, CACHE_HINT),
        "max_tool_calls": noop(RESPONSES_NOOPS, "it bounds calls of built-in tools; there are none here "
                                                "(only function tools, which it does not count)"),
    },
    "refused": {
        "access_programs": {"cyber": "daybreak_blue"},
        "background": True,
        "background_options": {"completion_window": "2h"},
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "conversation": "conv_123",
        "image": {"context_compression": "enabled"},
        "include": ["message.output_text.logprobs"],
        "moderation": {"model": "omni-moderation-latest"},
        "prompt": {"id": "pmpt_123"},
        "prompt_cache_options": {"prewarm": True},
        "reasoning": {"effort": "high"},
        "service_tier": "priority",
        "stream_options": {"include_obfuscation": True},
        "top_logprobs": 5,
        "truncation": "auto",
    },
}

MESSAGES = {
    "path": "/v1/messages",
    "module": message_params,
    "model": messages.MessagesRequest,
    "body": lambda model: {"model": model, "max_tokens": 50, "messages": HELLO},
    "honoured": {
        "model": "test_gateway_anthropic.py::test_server_is_healthy_after_the_malformed_suite",
        "max_tokens": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "messages": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "system": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "temperature": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "top_p": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "top_k": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "stop_sequences":
            "test_gateway_anthropic.py::test_stop_sequence_cuts_the_text_reports_it_and_aborts_the_worker",
        "stream": "test_gateway_anthropic.py::test_stream_event_sequence_and_text_equal_the_non_streamed_message",
        "tools": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "tool_choice": "test_gateway_anthropic.py::test_tool_choice_none_sends_no_tools_and_parses_nothing",
        "output_config": "test_structured_output.py::test_anthropic_output_config_format_through_the_mesh",
        "metadata": noop(MESSAGES_NOOPS, SINGLE_TENANT),
        "service_tier": noop(MESSAGES_NOOPS, "one tier serves every request: 'auto' finds no priority capacity "
                                             "and uses standard, which is what 'standard_only' asks"),
        "cache_control": noop(MESSAGES_NOOPS, CACHE_HINT),
        # the client sends these two as headers (anthropic-user-profile-id, anthropic-workspace-id)
        "user_profile_id": noop(MESSAGES_NOOPS, SINGLE_TENANT),
        "workspace_id": noop(MESSAGES_NOOPS, "it picks among a credential's workspaces; this server has one "
                                             "and no credentials (x-api-key is not checked either)"),
    },
    "refused": {
        "container": "container_123",
        "diagnostics": {"previous_message_id": "msg_123"},
        "inference_geo": "eu",
        "speed": "fast",
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    },
}

APIS = {"chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES, "messages": MESSAGES}
SENT_AS_HEADERS = {"user_profile_id", "workspace_id"}  # by the anthropic client, not in the body


def client_fields(module) -> set[str]:
    """The request fields of a client's ``create`` params (the base TypedDict and its streaming forms)."""
    names: set[str] = set()
    for name in dir(module):
        if name.endswith(("ParamsBase", "ParamsStreaming", "ParamsNonStreaming")):
            names |= set(getattr(module, name).__annotations__)
    assert names, f"no request params found in {module.__name__}"
    return names


def defined_tests(file: str) -> set[str]:
    tree = ast.parse(next(TESTS.rglob(file)).read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


# --- the walk ---------------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_every_client_field_is_honoured_or_refused(api):
    spec = APIS[api]
    fields = client_fields(spec["module"])
    honoured, refused = spec["honoured"], spec["refused"]
    unclassified = sorted(fields - set(honoured) - set(refused))
    assert not unclassified, (
        f"{api}: the {spec['module'].__name__} request has fields this gateway neither honours nor refuses: "
        f"{unclassified}. Implement each (and add it to 'honoured' with the test of its effect) or refuse it "
        f"(gateway.api.unsupported.refused; add it to 'refused' with a value the server cannot honour).")
    assert not set(honoured) & set(refused)
    for field, ref in honoured.items():
        test = ref[0] if isinstance(ref, tuple) else ref
        file, name = test.split("::")
        assert name in defined_tests(file), f"{api}.{field}: no test {test}"
        if isinstance(ref, tuple):
            assert ref[1], f"{api}.{field}: a no-op needs its reason"
        if field not in SENT_AS_HEADERS:  # declared, or the request model would refuse it as unknown
            assert field in spec["model"].model_fields, f"{api}.{field} is honoured but not declared"
    for field in refused:
        assert field in spec["model"].model_fields, f"{api}.{field}: refused fields are declared, with their reason"


# --- the nested walk -------------------------------------------------------------------------------
#
# Below the top level, the client's types are unions of TypedDicts told apart by a ``type`` (or
# ``role``) literal: content parts, message roles, tool kinds. The walk pairs each with the request
# model's class that takes the same tag. A member no class takes must fail validation at its tag
# (refused as a whole: ``input_audio`` parts, ``web_search`` tools). In a member that is taken, a
# field the class does not declare is refused as an unknown field (every class forbids extras), a
# field declared ``unsupported.refused`` is refused with its reason, and every other declared field
# must be in ``NESTED``: honoured (the test of its effect), or a no-op with its reason. A field the
# class takes as free-form JSON (a JSON schema) must be in ``FREE_FORM``.

PARTS = "test_gateway.py::test_text_content_parts_are_joined"
CHAT_TOOLS = "test_gateway.py::test_tool_calls_are_parsed_streaming_and_not_with_the_official_client"
RESPONSES_TOOLS = "test_gateway_responses.py::test_function_call_outputs_go_back_as_tool_messages"
MESSAGES_TOOLS = "test_gateway_anthropic.py::test_tool_results_go_back_as_tool_messages"
NESTED_NOOPS = "test_api_fields.py::test_nested_no_op_fields_change_nothing"
NESTED_REFUSALS = "test_api_fields.py::test_refused_nested_fields_are_400_naming_their_path"
FORCED = "test_structured_output.py::test_forced_tool_calls_and_auto_through_the_official_client"
STRICT = "test_api_fields.py::test_strict_tools_not_forced_constrain_the_calls_on_every_api"
ROUND_TRIP = "test_api_fields.py::test_earlier_outputs_sent_back_as_input_are_taken"

NESTED = {
    "chat": {
        "messages.content": PARTS,
        "messages.content.text": PARTS,
        "messages.name": NESTED_REFUSALS,  # tool messages take it (the template renders it); others: 400
        "messages.tool_calls": CHAT_TOOLS,
        "messages.tool_calls.id": CHAT_TOOLS,
        "messages.tool_calls.function":
            CHAT_TOOLS,
        "messages.tool_calls.function.name":
            CHAT_TOOLS,
        "messages.tool_calls.function.arguments":
            CHAT_TOOLS,
        "messages.tool_call_id": CHAT_TOOLS,
        "messages.content.image_url": "test_gateway_images.py::test_openai_client_sends_an_image",
        "messages.content.image_url.url": "test_gateway_images.py::test_openai_client_sends_an_image",
        "prediction.content": noop(NESTED_NOOPS, "inside a no-op field"),
        "prediction.content.text": noop(NESTED_NOOPS, "inside a no-op field"),
        "response_format.json_schema": FORCED,
        "response_format.json_schema.schema": FORCED,
        "response_format.json_schema.name": noop(NESTED_NOOPS, "a label of the schema"),
        "response_format.json_schema.description": noop(
            NESTED_NOOPS, "it tells the model what the format is for; the grammar makes the output an instance "
                          "of the schema whatever it says"),
        "response_format.json_schema.strict": noop(
            NESTED_NOOPS, "the schema is always enforced, strict or not (as vLLM does)"),
        "stream_options.include_usage": "test_gateway.py::test_usage_block_counts_prompt_completion_and_cached_tokens",
        "tool_choice.function": FORCED,
        "tool_choice.function.name": FORCED,
        "tools.function": "test_gateway.py::test_tool_calls_are_parsed_streaming_and_not_with_the_official_client",
        "tools.function.name": FORCED,
        "tools.function.description":
            "test_gateway.py::test_tool_calls_are_parsed_streaming_and_not_with_the_official_client",
        "tools.function.parameters": FORCED,
        "tools.function.strict": STRICT,
    },
    "completions": {
        "stream_options.include_usage": "test_gateway.py::test_completions_with_the_official_client_streaming_and_not",
    },
    "responses": {
        "input.content": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "input.content.text": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "input.role": "test_gateway_responses.py::test_response_with_instructions_and_usage_through_the_sdk",
        "input.content.image_url": "test_gateway_images.py::test_responses_input_image_with_the_openai_client",
        "input.content.file_id": NESTED_REFUSALS,
        "input.id": noop(ROUND_TRIP, "the id of an earlier output item; only its content is read"),
        "input.status": noop(ROUND_TRIP, "the status of an earlier output item"),
        "input.arguments": RESPONSES_TOOLS,
        "input.call_id": RESPONSES_TOOLS,
        "input.name": RESPONSES_TOOLS,
        "input.id": noop(ROUND_TRIP, "the id of an earlier output item; call_id pairs it"),
        "input.status": noop(ROUND_TRIP, "the status of an earlier output item"),
        "input.output": RESPONSES_TOOLS,
        "input.output.text": ROUND_TRIP,

        "input.id": noop(ROUND_TRIP, "an item id; call_id pairs the output"),
        "input.status": noop(ROUND_TRIP, "the status of an item"),
        "text.format": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "text.format.schema": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "text.format.name": noop(NESTED_NOOPS, "a label of the schema (echoed)"),
        "text.format.description": noop(NESTED_NOOPS, "the grammar makes the output an instance of the schema"),
        "text.format.strict": noop(NESTED_NOOPS, "the schema is always enforced, strict or not"),
        "tool_choice.name": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "tools.name": "test_gateway_responses.py::test_function_calls_streamed_and_not",
        "tools.description": "test_gateway_responses.py::test_function_calls_streamed_and_not",
        "tools.parameters": "test_api_fields.py::test_responses_text_format_forced_calls_and_echoed_fields",
        "tools.strict": STRICT,
    },
    "messages": {
        "messages.content": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "messages.content.text": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "messages.content.id": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "messages.content.input": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "messages.content.name": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "messages.content.tool_use_id": MESSAGES_TOOLS,
        "messages.content.content": MESSAGES_TOOLS,
        "messages.content.content.text": ROUND_TRIP,
        "messages.content.is_error": MESSAGES_TOOLS,
        "messages.content.source": "test_gateway_images.py::test_anthropic_image_blocks",
        "messages.content.source.data": "test_gateway_images.py::test_anthropic_image_blocks",
        "messages.content.source.media_type": "test_gateway_images.py::test_anthropic_image_blocks",
        "messages.content.source.url": "test_gateway_images.py::test_anthropic_image_blocks",
        "metadata.user_id": noop(MESSAGES_NOOPS, SINGLE_TENANT),
        "output_config.format": "test_structured_output.py::test_anthropic_output_config_format_through_the_mesh",
        "output_config.format.schema": "test_structured_output.py::test_anthropic_output_config_format_through_the_mesh",
        "system.text": "test_gateway_anthropic.py::test_message_with_system_and_usage_through_the_sdk",
        "tool_choice.name": "test_gateway_anthropic.py::test_tool_choice_none_sends_no_tools_and_parses_nothing",
        "tool_choice.disable_parallel_tool_use":
            "test_api_fields.py::test_parallel_tool_calls_off_ends_the_turn_at_the_first_call",
        "tools.name": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "tools.description": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "tools.input_schema": "test_gateway_anthropic.py::test_tool_use_blocks_streamed_and_not",
        "tools.strict": STRICT,
    },
}
# fields of any path, by name: cache hints (the prefix cache caches every prompt's blocks by itself)
NESTED_ANYWHERE = {
    "prompt_cache_breakpoint": noop(NESTED_NOOPS, CACHE_HINT),
    "cache_control": noop(MESSAGES_NOOPS, CACHE_HINT),
    "cache_control.ttl": noop(MESSAGES_NOOPS, CACHE_HINT),
}
FREE_FORM = {  # taken as any JSON object, by design
    "messages": {"tools.input_schema": "a JSON schema (its own keywords are checked by llguidance)"},
    "chat": {}, "responses": {}, "completions": {},  # (cache hints are no-ops wherever they are)
}
TAG_KEYS = ("type", "role")
_WRAPPERS = {typing.Required, typing.NotRequired, typing_extensions.Required, typing_extensions.NotRequired,
             typing_extensions.ReadOnly}
_SEQUENCES = {list, collections.abc.Iterable, collections.abc.Sequence}


def _leaves(ann) -> list:
    """The member types of an annotation, through Optional / unions, lists, Required and Annotated."""
    origin = get_origin(ann)
    if origin is Annotated or origin in _WRAPPERS:
        return _leaves(get_args(ann)[0])
    if origin is Union or origin is types.UnionType or origin in _SEQUENCES:
        return [leaf for a in get_args(ann) for leaf in _leaves(a)]
    return [ann]


def _hints(td) -> dict:
    return typing.get_type_hints(td, include_extras=True)


def _tag(td) -> tuple[str, str] | None:
    """A client TypedDict's tag: its ``type`` (else ``role``) literal, or None."""
    hints = _hints(td)
    for key in TAG_KEYS:
        literals = [a for a in _leaves(hints.get(key)) if get_origin(a) is Literal]
        if literals:
            return key, get_args(literals[0])[0]
    return None


def _fields(model: type[BaseModel]) -> dict:
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _takes(model: type[BaseModel], tag: tuple[str, str] | None) -> bool:
    if tag is None:
        return True
    info = _fields(model).get(tag[0])
    return info is not None and any(tag[1] in get_args(a) for a in _leaves(info.annotation)
                                    if get_origin(a) is Literal)


def _walk(client_ann, our_ann, path: str, out: list, seen: frozenset = frozenset()) -> None:
    ours = [t for t in _leaves(our_ann) if isinstance(t, type) and issubclass(t, BaseModel)]
    for td in _leaves(client_ann):
        if not typing_extensions.is_typeddict(td) or td in seen:
            continue
        tag = _tag(td)
        here = f"{path}[{tag[0]}={tag[1]}]" if tag else path
        models = [m for m in ours if _takes(m, tag)]
        if not ours:
            out.append(("free", here))
            continue
        if not models:
            out.append(("member refused", here, ours, tag))
            continue
        model = models[0]
        fields = _fields(model)
        for name, ann in _hints(td).items():
            info = fields.get(name)
            if info is None:
                out.append(("unknown refused" if model.model_config.get("extra") == "forbid" else "IGNORED",
                            f"{here}.{name}"))
            elif not (tag and name == tag[0]) and not any(isinstance(m, Refused) for m in info.metadata):
                out.append(("declared", f"{here}.{name}"))
                _walk(ann, info.annotation, f"{here}.{name}", out, seen | {td})


def nested_findings(api: str) -> list[tuple]:
    """What the walk finds below each top-level field the API takes (refused ones are refused whole)."""
    spec, out = APIS[api], []
    top = {}
    for name in dir(spec["module"]):
        if name.endswith(("ParamsBase", "ParamsStreaming", "ParamsNonStreaming")):
            top.update(_hints(getattr(spec["module"], name)))
    fields = _fields(spec["model"])
    for name, ann in top.items():
        info = fields.get(name)
        if info is None or any(isinstance(m, Refused) for m in info.metadata):
            continue
        _walk(ann, info.annotation, name, out)
    return out


def _classified(table: dict, path: str):
    """The entry for ``path`` without its tags (``[type=...]``), else by its last names."""
    untagged = ".".join(part.split("[")[0] for part in path.split("."))
    if untagged in table:
        return table[untagged]
    parts = untagged.split(".")
    for n in (2, 1):
        if ".".join(parts[-n:]) in NESTED_ANYWHERE:
            return NESTED_ANYWHERE[".".join(parts[-n:])]
    return None


@pytest.mark.parametrize("api", APIS)
def test_every_nested_client_field_is_honoured_or_refused(api):
    findings = nested_findings(api)
    assert findings, api
    assert not [f for f in findings if f[0] == "IGNORED"], "nested classes must forbid fields they do not declare"
    unclassified = [f[1] for f in findings if f[0] == "declared" and _classified(NESTED[api], f[1]) is None]
    assert not unclassified, f"{api}: declared nested fields with no honoured / no-op entry: {unclassified}"
    free = [f[1] for f in findings if f[0] == "free" and _classified(FREE_FORM[api], f[1]) is None]
    assert not free, f"{api}: nested objects taken as free-form JSON without a reason: {free}"
    for path in {f[1] for f in findings if f[0] == "declared"}:
        ref = _classified(NESTED[api], path)
        file, name = (ref[0] if isinstance(ref, tuple) else ref).split("::")
        assert name in defined_tests(file), f"{api}.{path}: no test {ref}"
    for kind, path, *rest in findings:
        if kind != "member refused":
            continue
        models, (key, value) = rest
        for model in models:  # no class of the request takes this tag: it fails there
            with pytest.raises(ValidationError) as e:
                model.model_validate_json(json.dumps({key: value}))
            assert any(err["loc"] == (key,) and err["type"] == "literal_error" for err in e.value.errors()), (
                api, path, model, e.value.errors())
    if api != "completions":  # the walk did reach into unions (its only nested field is stream_options)
        assert "member refused" in {f[0] for f in findings}, api


REFUSALS = [(api, field, value) for api, spec in APIS.items() for field, value in spec["refused"].items()]


def assert_refused(r, api: str, field: str) -> None:
    if api == "messages":
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert field in err["error"]["message"], err
    else:
        err = assert_openai_error(r, 400, param=field)
        assert field in err["message"], err


@pytest.mark.parametrize("api, field, value", REFUSALS, ids=[f"{a}-{f}" for a, f, _ in REFUSALS])
async def test_refused_fields_are_400_naming_them(client, gateway, workers, api, field, value):
    spec = APIS[api]
    before = len(workers.prefill_requests), len(workers.tokenizer_requests)
    for stream in (False, True):
        r = await client.post(spec["path"], json={**spec["body"](gateway.model), "stream": stream, field: value})
        assert not r.headers["content-type"].startswith("text/event-stream")
        assert_refused(r, api, field)
    assert (len(workers.prefill_requests), len(workers.tokenizer_requests)) == before  # nothing was run


@pytest.mark.parametrize("api", APIS)
async def test_a_field_the_api_does_not_define_is_400_naming_it(client, gateway, workers, api):
    spec = APIS[api]
    before = len(workers.prefill_requests)
    r = await client.post(spec["path"], json={**spec["body"](gateway.model), "frobnicate": True})
    assert_refused(r, api, "frobnicate")
    assert "unknown parameter" in r.text
    assert len(workers.prefill_requests) == before


@pytest.mark.parametrize("api, body, field", [
    ("chat", {"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ("completions", {"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ("responses", {"text": {"verbosity": "high"}}, "text.verbosity"),
    ("messages", {"output_config": {"effort": "low"}}, "output_config.effort"),
    ("messages", {"output_config": {"format": {"type": "json_schema", "schema": {}, "strict": True}}},
     "output_config.format.strict"),
    # fields a nested class does not declare, and declared ones refused for a value
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ("chat", {"messages": [*HELLO, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     "messages[1].tool_call_id"),
    ("chat", {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("chat", {"stop": ["", "x"]}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "frobnicate": 1}]}, "messages[0].frobnicate"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"}}]}]},
     "messages[0].content[0].image_url.detail"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]"),
    ("chat", {"messages": [*HELLO, {"role": "assistant", "content": None, "refusal": "I can't"}]},
     "messages[1].refusal"),
    ("chat", {"messages": [*HELLO, {"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}]},
     "messages[1].annotations"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools[0].function.x"),
    ("chat", {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "f", "strict": True}}},
     "tool_choice.function.strict"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
     "response_format.json_schema.x"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0]"),
    ("responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "high"}]}]},
     "input[0].content[0].detail"),
    ("responses", {"input": [{"role": "assistant", "content": [
        {"type": "output_text", "text": "x", "annotations": [{"type": "url_citation"}]}]}]},
     "input[0].content[0].annotations"),
    ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                              "caller": {"type": "program", "caller_id": "p"}}]}, "input[0].caller"),
    ("responses", {"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0].defer_loading"),
    ("responses", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("responses", {"text": {"format": {"type": "text", "name": "a"}}}, "text.format.name"),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "citations": [{"type": "char_location"}]}]}]}, "messages.0.content.0.citations"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0"),
    ("messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{"a": 1}]}]},
     "tools.0.input_examples"),
    ("messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}}],
                  "tool_choice": {"type": "auto", "name": "f"}}, "tool_choice.name"),
    ("messages", {"metadata": {"user_id": "u", "team": "a"}}, "metadata.team"),
])
async def test_refused_nested_fields_are_400_naming_their_path(client, gateway, api, body, field):
    spec = APIS[api]
    r = await client.post(spec["path"], json={**spec["body"](gateway.model), **body})
    assert_refused(r, api, field)


@pytest.mark.parametrize("api", APIS)
async def test_json_nested_deeper_than_any_request_is_a_400(client, gateway, workers, api):
    """1,000 nested arrays: the parser's depth limit is the client's error (a 400 in the API's
    shape), not a server error, and the connection stays usable."""
    spec = APIS[api]
    body = json.dumps(spec["body"](gateway.model))[:-1] + ', "messages": ' + "[" * 1000 + "]" * 1000 + "}"
    r = await client.post(spec["path"], content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()
    assert (err["type"] == "error") if api == "messages" else ("param" in err["error"]), err
    assert (await client.get("/health")).status_code == 200


# --- no-ops change nothing ------------------------------------------------------------------------


async def same_run(client, workers, path: str, body: dict, extra: dict, text_of) -> None:
    """``body`` with ``extra`` runs exactly as ``body``: same prompt, sampling and output, streamed too."""
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    want = workers.prefill_requests[-1]
    for stream in (False, True):
        r = await client.post(path, json={**body, **extra, "stream": stream})
        assert r.status_code == 200, r.text
        got = workers.prefill_requests[-1]
        assert got.request_id != want.request_id
        assert (got.prompt_token_ids, got.sampling) == (want.prompt_token_ids, want.sampling)
        if not stream:
            assert text_of(r.json()) == "Hello there!"


async def test_chat_no_op_fields_change_nothing(client, gateway, workers, script):
    script()
    no_ops = {"user": "u-1", "safety_identifier": "hash-1", "metadata": {"team": "a"}, "prompt_cache_key": "k",
              "prompt_cache_retention": "24h", "prediction": {"type": "content", "content": "Hello there!"},
              # the values of refused fields that ask for what the server does anyway
              "store": False, "service_tier": "default", "modalities": ["text"], "reasoning_effort": "none",
              "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
              "stream_options": {"include_obfuscation": False}}
    await same_run(client, workers, CHAT["path"], CHAT["body"](gateway.model), no_ops,
                   lambda b: b["choices"][0]["message"]["content"])
    # the official client sends them as they are
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    r = await sdk.chat.completions.create(model=gateway.model, messages=HELLO, service_tier="auto", store=False,
                                          safety_identifier="h", prompt_cache_key="k", user="u", metadata={"a": "b"})
    assert r.choices[0].message.content == "Hello there!"
    await sdk.close()


async def test_responses_no_op_fields_change_nothing(client, gateway, workers, script):
    script()
    no_ops = {"safety_identifier": "hash-1", "prompt_cache_key": "k", "prompt_cache_retention": "in_memory",
              "max_tool_calls": 2, "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
              # the values of refused fields that ask for what the server does anyway
              "background": False, "truncation": "disabled", "reasoning": {"effort": "none", "summary": None},
              "service_tier": "auto", "top_logprobs": 0, "stream_options": {"include_obfuscation": False},
              "prompt_cache_options": {"mode": "implicit"}, "image": {"context_compression": "auto"},
              "context_management": []}
    await same_run(client, workers, RESPONSES["path"], RESPONSES["body"](gateway.model), no_ops,
                   lambda b: b["output"][0]["content"][0]["text"])


async def test_anthropic_no_op_fields_change_nothing(client, gateway, workers, script):
    script()
    no_ops = {"metadata": {"user_id": "u-1"}, "service_tier": "standard_only",
              "cache_control": {"type": "ephemeral", "ttl": "1h"},
              # the values of refused fields that ask for what the server does anyway
              "thinking": {"type": "disabled"}, "speed": "standard"}
    await same_run(client, workers, MESSAGES["path"], MESSAGES["body"](gateway.model), no_ops,
                   lambda b: b["content"][0]["text"])
    want = workers.prefill_requests[-1]
    sdk = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    msg = await sdk.messages.create(model=gateway.model, max_tokens=50, messages=HELLO, service_tier="auto",
                                    user_profile_id="prof-1", workspace_id="wrkspc_1", metadata={"user_id": "u"})
    assert msg.content[0].text == "Hello there!"
    got = workers.prefill_requests[-1]
    assert (got.prompt_token_ids, got.sampling) == (want.prompt_token_ids, want.sampling)
    await sdk.close()


async def test_nested_no_op_fields_change_nothing(client, gateway, workers, script):
    """Cache breakpoints on parts and blocks, and a JSON schema's label, description and strictness,
    change neither the prompt nor the sampling."""
    script()
    point = {"mode": "explicit", "ttl": "30m"}
    ephemeral = {"type": "ephemeral", "ttl": "1h"}
    schema = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    labelled = {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": "answer", "strict": True,
                                                       "description": "the answer"}}
    chat = {**CHAT["body"](gateway.model), "response_format": schema}
    await same_run(client, workers, CHAT["path"], chat, {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello", "prompt_cache_breakpoint": point}]}],
        "prediction": {"type": "content", "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": point}]},
        "response_format": labelled}, lambda b: b["choices"][0]["message"]["content"])
    fmt = {"type": "json_schema", "schema": SCHEMA}
    responses = {**RESPONSES["body"](gateway.model), "input": [{"role": "user", "content": "Say hello"}],
                 "text": {"format": fmt}}
    await same_run(client, workers, RESPONSES["path"], responses, {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello",
                                                "prompt_cache_breakpoint": point}]}],
        "text": {"format": {**fmt, "name": "answer", "strict": True, "description": "the answer"}}},
        lambda b: b["output"][0]["content"][0]["text"])
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    messages = {**MESSAGES["body"](gateway.model), "system": [{"type": "text", "text": "Be brief."}], "tools": [tool],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]}
    await same_run(client, workers, MESSAGES["path"], messages, {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": ephemeral}],
        "tools": [{**tool, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello", "cache_control": ephemeral}]}]},
        lambda b: b["content"][0]["text"])


async def test_strict_tools_not_forced_constrain_the_calls_on_every_api(client, gateway, workers, script):
    """A strict tool under tool_choice "auto" (or none given) makes the worker constrain each call the
    model starts (free text otherwise); no strict tool, or tool_choice "none", leaves the output free;
    with a response format the format applies (its output holds no call)."""
    script(text=CALL.format("Paris"))

    def strict(tool: dict, on: bool) -> dict:
        return {**tool, "function": {**tool["function"], "strict": on}}

    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
    anthropic_tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}

    async def spec_of(path, body):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        return workers.prefill_requests[-1].sampling.structured

    def constrains_calls(spec) -> bool:
        return spec is not None and "open[lazy]" in spec["lark"] and "get_weather" in spec["lark"]

    chat = CHAT["body"](gateway.model)
    for extra, want in (({"tools": [strict(chat_tool, True)]}, True),
                        ({"tools": [strict(chat_tool, True)], "tool_choice": "auto"}, True),
                        ({"tools": [strict(chat_tool, False)]}, False), ({"tools": [chat_tool]}, False),
                        ({"tools": [strict(chat_tool, True)], "tool_choice": "none"}, False)):
        assert constrains_calls(await spec_of(CHAT["path"], {**chat, **extra})) is want, extra
    spec = await spec_of(CHAT["path"], {**chat, "tools": [strict(chat_tool, True)],
                                        "response_format": {"type": "json_object"}})
    assert spec == {"type": "json_object"}
    messages = MESSAGES["body"](gateway.model)
    for extra, want in (({"tools": [{**anthropic_tool, "strict": True}]}, True),
                        ({"tools": [{**anthropic_tool, "strict": True}], "tool_choice": {"type": "auto"}}, True),
                        ({"tools": [anthropic_tool]}, False),
                        ({"tools": [{**anthropic_tool, "strict": True}], "tool_choice": {"type": "none"}}, False)):
        assert constrains_calls(await spec_of(MESSAGES["path"], {**messages, **extra})) is want, extra
    # the calls are parsed as ever (the official client)
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    r = await sdk.chat.completions.create(model=gateway.model, messages=HELLO, tools=[strict(chat_tool, True)])
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"city": "Paris"}]
    await sdk.close()


async def test_earlier_outputs_sent_back_as_input_are_taken(gateway, workers, script):
    """What each official client returns, sent back as the next turn's input as its docs show
    (``message.model_dump()``, Responses' output items, Anthropic's content blocks), with the null or
    empty fields those objects carry, is taken: each turn's text and calls reach the template."""
    script(text="Checking. " + CALL.format("Paris"))
    oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
    first = await oai.chat.completions.create(model=gateway.model, messages=HELLO, tools=[chat_tool])
    message = first.choices[0].message
    sent = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(sent)  # nulls the next turn carries
    await oai.chat.completions.create(model=gateway.model, tools=[chat_tool], messages=[
        *HELLO, sent, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                       "content": [{"type": "text", "text": "sunny"}]}])
    got = workers.tokenizer_requests[-1].messages
    assert got[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert got[2]["content"] == "sunny"

    first = await oai.responses.create(model=gateway.model, input="Weather?", tools=[WEATHER], store=False)
    items = [o.model_dump(exclude_unset=True) for o in first.output]
    assert [o["type"] for o in items] == ["message", "function_call"]
    assert items[0]["content"][0]["annotations"] == [] and items[0]["content"][0]["logprobs"] == []
    call = first.output[1]
    await oai.responses.create(model=gateway.model, tools=[WEATHER], store=False, input=[
        {"role": "user", "content": "Weather?"}, *items,
        {"type": "function_call_output", "call_id": call.call_id, "output": [{"type": "input_text", "text": "sunny"}]}])
    got = workers.tokenizer_requests[-1].messages
    assert "Checking." in json.dumps(got) and got[-1]["content"] == "sunny"
    await oai.close()

    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    first = await claude.messages.create(model=gateway.model, max_tokens=50, messages=HELLO, tools=[tool])
    use = [b for b in first.content if b.type == "tool_use"][0]
    await claude.messages.create(model=gateway.model, max_tokens=50, tools=[tool], messages=[
        *HELLO, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny"}]}]}])
    got = workers.tokenizer_requests[-1].messages
    assert got[-1]["content"] == "sunny" and "Checking." in json.dumps(got)
    await claude.close()


# --- effects not shown elsewhere ------------------------------------------------------------------


async def test_completions_sampling_fields_reach_prefill(client, gateway, workers, script):
    script(text="ok")
    body = {"model": gateway.model, "prompt": "Once", "n": 2, "seed": 11, "temperature": 0.3, "top_p": 0.7,
            "frequency_penalty": 0.4, "presence_penalty": -0.2, "logit_bias": {"7": -5}, "max_tokens": 5}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    first, second = workers.prefill_requests[-2:]
    assert first.prompt_token_ids == TOKENIZER.encode("Once").ids
    s = first.sampling
    assert (s.temperature, s.top_p, s.frequency_penalty, s.presence_penalty, s.max_tokens) == (0.3, 0.7, 0.4, -0.2, 5)
    assert s.logit_bias == {7: -5.0}
    assert sorted([first.sampling.seed, second.sampling.seed]) == [11, 12]  # n choices: seed + i
    # user: an end-user id, nothing changes
    r = await client.post("/v1/completions", json={**body, "n": 1, "user": "u-1"})
    assert r.status_code == 200 and workers.prefill_requests[-1].sampling == s
    r = await client.post("/v1/completions", json={**body, "model": "gpt-nope"})
    assert_openai_error(r, 404, param="model", code="model_not_found")


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


async def test_responses_text_format_forced_calls_and_echoed_fields(client, gateway, workers, script):
    script(text='{"answer": "hi"}')
    r = await client.post("/v1/responses", json={
        "model": gateway.model, "input": "Answer as JSON", "store": False, "metadata": {"run": "7"}, "user": "u-1",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert workers.prefill_requests[-1].sampling.structured == {"type": "json_schema", "schema": SCHEMA}
    assert json.loads(body["output"][0]["content"][0]["text"]) == {"answer": "hi"}
    assert (body["metadata"], body["user"]) == ({"run": "7"}, "u-1")  # echoed, as OpenAI does

    script(text='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    forced = []
    for choice, parallel in (("required", False), ({"type": "function", "name": "get_weather"}, True)):
        r = await client.post("/v1/responses", json={
            "model": gateway.model, "input": "Weather in Paris?", "store": False, "tools": [WEATHER],
            "tool_choice": choice, "parallel_tool_calls": parallel})
        assert r.status_code == 200, r.text
        assert [o["type"] for o in r.json()["output"]] == ["function_call"]
        spec = workers.prefill_requests[-1].sampling.structured
        assert spec["type"] == "grammar" and "get_weather" in spec["lark"]
        forced.append(spec["lark"])
    one, many = forced
    assert one.startswith("start: call\n") and many.startswith('start: call ("\\n" call)*')
    # not forced: a tool with strict true has each call the model starts constrained; left out or false,
    # the output is free (calls parsed as written)
    for tool, strict in (({**WEATHER, "strict": True}, True), (WEATHER, False), ({**WEATHER, "strict": False}, False)):
        r = await client.post("/v1/responses", json={"model": gateway.model, "input": "hi", "store": False,
                                                     "tools": [tool], "tool_choice": "auto"})
        assert r.status_code == 200, r.text
        spec = workers.prefill_requests[-1].sampling.structured
        assert (spec is not None and "open[lazy]" in spec["lark"] and "get_weather" in spec["lark"]) is strict


async def test_ignore_eos_reaches_the_workers_on_responses_and_messages(client, gateway, workers, script):
    script()
    for path, body in ((RESPONSES["path"], RESPONSES["body"](gateway.model)),
                       (MESSAGES["path"], MESSAGES["body"](gateway.model))):
        for flag in (True, False):
            r = await client.post(path, json={**body, "ignore_eos": flag})
            assert r.status_code == 200, r.text
            assert workers.prefill_requests[-1].sampling.ignore_eos is flag


async def test_anthropic_output_config_format_reaches_the_workers(client, gateway, workers, script):
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    for stream in (False, True):
        script(text='{"answer": "hi"}')
        body = {**MESSAGES["body"](gateway.model), **fmt}
        if stream:
            events = await sse_events(client, "/v1/messages", {**body, "stream": True})
            text = "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
        else:
            r = await client.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["content"][0]["text"]
        assert json.loads(text) == {"answer": "hi"}
        assert workers.prefill_requests[-1].sampling.structured == {"type": "json_schema", "schema": SCHEMA}
    # tools offered but not to be used: the schema applies
    script(text='{"answer": "hi"}')
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    r = await client.post("/v1/messages", json={**MESSAGES["body"](gateway.model), **fmt, "tools": [tool],
                                                "tool_choice": {"type": "none"}})
    assert r.status_code == 200 and workers.prefill_requests[-1].sampling.structured["type"] == "json_schema"
    before = len(workers.prefill_requests)
    bad = [({"tools": [tool]}, "output_config"),
           ({"tools": [tool], "tool_choice": {"type": "any"}}, "output_config"),
           ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}}},
            "uniqueItems"),
           ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type")]
    for extra, named in bad:
        r = await client.post("/v1/messages", json={**MESSAGES["body"](gateway.model), **fmt, **extra})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert named in r.json()["error"]["message"], r.text
    assert len(workers.prefill_requests) == before


CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
TWO_CALLS = "Checking. " + CALL.format("Paris") + "\n" + CALL.format("Oslo") + " Done."


async def test_parallel_tool_calls_off_ends_the_turn_at_the_first_call(client, gateway, workers, script):
    """Tools offered, nothing forced: with parallel calls off the output stops at its first call (the
    worker is aborted there, as for a stop string); with them on every call is returned."""
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}

    def chat_calls(body):  # (text, calls' cities, finish reason) of a chat completion
        choice = body["choices"][0]
        calls = [json.loads(c["function"]["arguments"])["city"] for c in choice["message"].get("tool_calls") or []]
        return choice["message"]["content"], calls, choice["finish_reason"]

    def chat_stream_calls(events):
        deltas = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
        text = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [json.loads(c["function"]["arguments"])["city"] for d in deltas for c in d["delta"].get("tool_calls") or []]
        return text or None, calls, deltas[-1]["finish_reason"]

    async def chat(parallel, stream):
        body = {"model": gateway.model, "messages": HELLO, "tools": [chat_tool], "stream": stream}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        if stream:
            return chat_stream_calls(await stream_events(client, body))
        r = await client.post(CHAT["path"], json=body)
        assert r.status_code == 200, r.text
        return chat_calls(r.json())

    async def responses(parallel, stream):
        body = {"model": gateway.model, "input": "Weather?", "store": False, "tools": [WEATHER],
                "parallel_tool_calls": parallel}
        if stream:
            events = await sse_events(client, RESPONSES["path"], {**body, "stream": True})
            out = [d for name, d in events if name in ("response.completed", "response.incomplete")][0]["response"]
        else:
            r = await client.post(RESPONSES["path"], json=body)
            assert r.status_code == 200, r.text
            out = r.json()
        text = "".join(p["text"] for o in out["output"] if o["type"] == "message" for p in o["content"])
        calls = [json.loads(o["arguments"])["city"] for o in out["output"] if o["type"] == "function_call"]
        return text or None, calls, out["status"]

    async def messages(parallel, stream):
        body = {**MESSAGES["body"](gateway.model), "tools": [tool],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": not parallel}}
        if stream:
            events = await sse_events(client, MESSAGES["path"], {**body, "stream": True})
            blocks, text, calls = {}, "", []
            for name, d in events:
                if name == "content_block_start":
                    blocks[d["index"]] = d["content_block"]["type"]
                elif name == "content_block_delta" and d["delta"]["type"] == "text_delta":
                    text += d["delta"]["text"]
                elif name == "content_block_delta":
                    calls.append(json.loads(d["delta"]["partial_json"])["city"])
            reason = [d for name, d in events if name == "message_delta"][0]["delta"]["stop_reason"]
            return text or None, calls, reason
        r = await client.post(MESSAGES["path"], json=body)
        assert r.status_code == 200, r.text
        msg = r.json()
        text = "".join(b["text"] for b in msg["content"] if b["type"] == "text")
        return text or None, [b["input"]["city"] for b in msg["content"] if b["type"] == "tool_use"], msg["stop_reason"]

    # chat keeps text exactly ("Checking. "); Responses and Messages have text blocks around calls
    cases = [(chat, False, ("Checking. ", ["Paris"], "tool_calls")),
             (chat, None, ("Checking.  Done.", ["Paris", "Oslo"], "tool_calls")),
             (responses, False, ("Checking.", ["Paris"], "completed")),
             (responses, True, ("Checking.Done.", ["Paris", "Oslo"], "completed")),
             (messages, False, ("Checking.", ["Paris"], "tool_use")),
             (messages, True, ("Checking.Done.", ["Paris", "Oslo"], "tool_use"))]
    for run, parallel, want in cases:
        for stream in (False, True):
            script(text=TWO_CALLS, tokens_per_chunk=3, delay_s=0.002)
            got = await run(parallel, stream)
            assert got == want, (run.__name__, parallel, stream, got)
            rid = workers.prefill_requests[-1].request_id
            if parallel is False:  # the worker is stopped at the call
                await eventually(lambda: (subjects.DECODE_ABORT_ANY, rid) in workers.aborts)
            else:  # it finished by itself
                assert (subjects.DECODE_ABORT_ANY, rid) not in workers.aborts

