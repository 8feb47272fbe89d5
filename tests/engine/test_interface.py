"""Every engine backend implements ``interface.Engine``: the methods a worker service calls, with the
protocol's parameters in the same order, so the services hold one code path for all of them."""

from __future__ import annotations

import inspect

import pytest

from deepinfer.engine.interface import Engine, EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.mock import MockEngine
from deepinfer.engine.vllm_engine import VllmEngine
from deepinfer.models.convert import ensure_default_model

METHODS = [n for n, f in vars(Engine).items() if inspect.isfunction(f) and not n.startswith("_")]


def test_the_protocol_names_what_a_worker_calls():
    assert {"check_request", "add_request", "abort", "has_unfinished", "step", "fail_all",
            "cached_prefix_blocks", "load_fields", "kv_connector"} <= set(METHODS)


@pytest.mark.parametrize("cls", [LLMEngine, MockEngine, VllmEngine])
def test_each_backend_has_every_method_with_the_protocols_parameters(cls):
    for name in METHODS:
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}"
        want = [p for p in inspect.signature(getattr(Engine, name)).parameters.values()
                if p.kind is p.POSITIONAL_OR_KEYWORD]
        have = list(inspect.signature(impl).parameters)
        assert have[: len(want)] == [p.name for p in want], f"{cls.__name__}.{name}{inspect.signature(impl)}"
    assert cls.engine_kind in ("native", "mock", "vllm")


def test_a_built_engine_is_an_engine():
    engine = MockEngine(ensure_default_model(progress=False), EngineConfig(kv_cache_bytes=16 << 20))
    assert isinstance(engine, Engine)
    assert engine.engine_kind == "mock" and engine.num_steps == 0 and engine.fingerprint
