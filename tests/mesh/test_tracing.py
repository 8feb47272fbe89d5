"""One request is one trace across the mesh's processes, and its log lines share it.

The services write their spans to one JSON-lines file (``DEEPINFER_TRACES_FILE``, the
in-process ``JsonLinesExporter``) and their logs as JSON lines to the launcher's log files.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest

from deepinfer.telemetry.tracing import JsonLinesExporter, configure_tracing  # noqa: F401

FAST_START = ["--no-calibrate", "--kv-cache-gb", "0.25"]
SERVICES = {"gateway", "tokenizer", "kvindex", "prefill", "decode"}


def _spans(path, trace_id: str) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["trace_id"] == trace_id:
            out.append(rec)
    return out


def _service(rec: dict) -> str:
    return rec["service"].removeprefix("deepinfer-")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A private mesh writing spans to a file, and one chat request sent under a known trace id."""
    import openai

    from deepinfer.launcher import Mesh

    workdir = tmp_path_factory.mktemp("mesh-traced")
    spans_file = workdir / "spans.jsonl"
    mesh = Mesh(workdir=workdir, env={"DEEPINFER_TRACES_FILE": str(spans_file)},
                extra_args={"prefill": FAST_START, "decode": FAST_START})
    mesh.start(timeout=300)
    try:
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="test", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0.0,
            messages=[{"role": "user", "content": "Name three colours of the rainbow, please."}],
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        client.close()
        # decode ends its span before the last chunk reaches the gateway, the gateway its own
        # after the reply: wait until every stage is in the file
        deadline, spans = time.monotonic() + 20, []
        while time.monotonic() < deadline:
            spans = _spans(spans_file, trace_id)
            if {"POST /v1/chat/completions", "decode.generate", "prefill.handoff"} <= {s["name"] for s in spans}:
                break
            time.sleep(0.2)
        yield {"mesh": mesh, "trace_id": trace_id, "client_span": client_span, "spans": spans, "reply": reply}
    finally:
        mesh.stop()


def test_one_request_is_one_trace_across_the_services_processes(traced):
    spans = traced["spans"]
    by_service: dict[str, set[int]] = {}
    for s in spans:
        by_service.setdefault(_service(s), set()).add(s["pid"])
    assert SERVICES <= set(by_service), f"services in the trace: {sorted(by_service)}"
    pids = [next(iter(by_service[name])) for name in SERVICES]
    assert len(set(pids)) == len(SERVICES)  # each service its own process
    names = {s["name"] for s in spans}
    for stage in ("gateway.tokenize", "tokenizer.encode_chat", "gateway.admission", "prefill.submit",
                  "prefill.load", "kvindex.lookup", "prefill.queue", "prefill.forward", "prefill.store",
                  "prefill.handoff", "decode.submit", "decode.load", "decode.generate", "gateway.detokenize"):
        assert stage in names, f"no {stage} span; spans: {sorted(names)}"


def test_spans_are_correctly_parented(traced):
    spans = traced["spans"]
    by_id = {s["span_id"]: s for s in spans}
    (root,) = [s for s in spans if s["parent_id"] == traced["client_span"]]
    assert root["name"] == "POST /v1/chat/completions" and _service(root) == "gateway"
    for s in spans:  # no orphan: every other span's parent is in the trace
        assert s is root or s["parent_id"] in by_id, f"{s['name']} has a parent outside the trace"

    def parent(name: str) -> str:
        """The span's parent, past FastAPI's own spans (``fastapi.endpoint`` and the like)."""
        (s,) = [s for s in spans if s["name"] == name] or [None]
        p = by_id[s["parent_id"]]
        while p["name"].startswith("fastapi.") and p is not root:
            p = by_id[p["parent_id"]]
        return p["name"]

    assert parent("gateway.tokenize") == root["name"]
    assert parent("tokenizer.encode_chat") == "gateway.tokenize"
    assert parent("prefill.submit") == root["name"]
    assert parent("prefill.load") == "prefill.submit"
    assert parent("prefill.handoff") == "prefill.submit"
    assert parent("decode.submit") == "prefill.handoff"
    assert parent("decode.load") == "decode.submit"
    assert parent("decode.generate") == "decode.submit"
    assert parent("gateway.detokenize") == root["name"]
    for s in spans:
        if s["name"] in ("prefill.forward", "prefill.queue"):
            assert by_id[s["parent_id"]]["name"] == "prefill.submit"
        if s["name"] == "kvindex.lookup":
            assert by_id[s["parent_id"]]["name"] in ("prefill.load", "gateway.admission")
        if s["name"] in ("tokenizer.encode_chat", "prefill.submit", "prefill.load", "kvindex.lookup"):
            assert _service(s) == s["name"].split(".")[0]
    # child spans lie within the request's span (one clock: all processes on this machine)
    for s in spans:
        assert root["start_ns"] <= s["start_ns"] <= s["end_ns"] <= root["end_ns"] + 50_000_000, s["name"]


def test_request_span_has_gen_ai_attributes(traced):
    (root,) = [s for s in traced["spans"] if s["parent_id"] == traced["client_span"]]
    a, usage = root["attributes"], traced["reply"].usage
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == traced["reply"].model
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [traced["reply"].choices[0].finish_reason]
    assert a["http.response.status_code"] == 200
    forwards = [s for s in traced["spans"] if s["name"] == "prefill.forward"]
    assert sum(s["attributes"]["deepinfer.chunk.tokens"] for s in forwards) == usage.prompt_tokens


def test_log_lines_of_the_request_share_its_trace_id(traced):
    mesh, trace_id = traced["mesh"], traced["trace_id"]
    lines = []
    for log_file in (mesh.workdir / "logs").glob("*.log"):
        for line in log_file.read_text(errors="replace").splitlines():
            if "\r" in line:  # a progress bar (the default model's conversion): not a log line
                continue
            rec = json.loads(line)  # every log line is JSON, libraries' (uvicorn, ...) too
            assert rec["service"] and "event" in rec, line
            if rec.get("trace_id") == trace_id:
                lines.append(rec)
    assert SERVICES <= {rec["service"] for rec in lines}, {rec["service"] for rec in lines}
    for rec in lines:
        assert rec["worker_id"] and len(rec["span_id"]) == 16
    request_ids = {rec["request_id"] for rec in lines if "request_id" in rec}
    assert len(request_ids) == 1, request_ids  # the request's lines name it, and only it
    assert {rec["service"] for rec in lines if "request_id" in rec} >= {"gateway", "tokenizer", "prefill", "decode"}


def test_jsonlines_exporter_and_exporter_choice(tmp_path, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from deepinfer.telemetry import tracing

    path = tmp_path / "s.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(str(path))))
    with provider.get_tracer("t").start_as_current_span("outer"):
        with provider.get_tracer("t").start_as_current_span("inner", attributes={"k": 1}):
            pass
    inner, outer = [json.loads(line) for line in path.read_text().splitlines()]
    assert inner["parent_id"] == outer["span_id"] and inner["trace_id"] == outer["trace_id"]
    assert inner["attributes"] == {"k": 1} and outer["parent_id"] is None
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "DEEPINFER_TRACES_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert tracing._exporters() == []  # nothing configured: no exporter, no processor
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    (exp, batched), = tracing._exporters()
    assert type(exp).__name__ == "OTLPSpanExporter" and batched
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing._exporters() == []
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing._exporters() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin,console")  # an unknown name is skipped, not fatal
    (exp, batched), = tracing._exporters()
    assert type(exp).__name__ == "ConsoleSpanExporter"


def test_health_checks_and_scrapes_are_not_recorded(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from deepinfer.telemetry import tracing

    path = tmp_path / "s.jsonl"
    provider = TracerProvider(sampler=tracing._QuietSampler())
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(str(path))))
    t = provider.get_tracer("t")
    with t.start_as_current_span("GET", attributes={"url.path": "/health"}):  # FastAPI's first name
        with t.start_as_current_span("kvindex.lookup"):  # a child of a quiet span: not recorded either
            pass
    with t.start_as_current_span("kvindex.health"):
        pass
    with t.start_as_current_span("GET", attributes={"url.path": "/v1/chat/completions"}):
        pass
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()] == ["GET"]


def test_log_lines_go_to_the_stderr_of_the_moment_not_the_one_at_configuration(monkeypatch):
    """A worker's main configures logging; a later stderr (a test runner's capture, a redirect)
    gets the lines, and a closed earlier one breaks nothing."""
    import io
    import logging
    import sys

    from deepinfer.telemetry import configure_logging, get_logger

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("decode", "d-1")
    get_logger("t").info("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    get_logger("t").info("two")
    logging.getLogger("some.library").warning("three")
    lines = [json.loads(line) for line in second.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["two", "three"]
    assert all(line["service"] == "decode" and line["worker_id"] == "d-1" for line in lines)
