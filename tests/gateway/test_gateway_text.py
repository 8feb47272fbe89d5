"""Gateway pieces without a mesh: detokenizer, stop strings, output processor, worker registry."""

from __future__ import annotations


import pytest
from tokenizers import Tokenizer

from deepinfer.gateway.pipeline.registry import WorkerRegistry
from deepinfer.gateway.stream.detokenizer import IncrementalDetokenizer
from deepinfer.gateway.stream.output import OutputProcessor
from deepinfer.gateway.stream.stop import StopStringMatcher
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import LoadReport, TokenChunk


MODEL_DIR = ensure_default_model(progress=False)  # converts once on a fresh machine


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


# --- detokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Grüße 🦙 from 東京! ✨", "plain ascii text", "🦙🦙🦙", "a\n\n  b\tc", "Ωμέγα"])
def test_incremental_detokenization_never_emits_partial_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tok.decode(ids)


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("Hi there", add_special_tokens=False).ids + [2]  # <|im_end|>
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "Hi there"


def test_unfinished_character_at_the_end_is_dropped_not_replaced(tok):
    """A generation cut mid-character (max_tokens) ends without U+FFFD."""
    ids = tok.encode("ok 🦙", add_special_tokens=False).ids
    assert len(ids) > 2
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:-1]) == "ok"
    assert detok.flush() == " "  # the space rides on the emoji's first token: complete, kept


# --- stop strings ---------------------------------------------------------------------


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for p in pieces:
        text, stopped = matcher.add(p)
        out += text
        if stopped:
            return out, True
    return out + matcher.flush(), False


@pytest.mark.parametrize(
    "stops, pieces, expected, stopped",
    [
        (["STOP"], ["Hello ST", "OP there"], "Hello ", True),
        (["STOP"], ["Hello S", "T", "O", "P"], "Hello ", True),
        (["STOP"], ["Hello ST", "ART"], "Hello START", False),
        (["ab", "b"], ["xab"], "x", True),  # both complete at once: the one starting first wins
        (["abcd", "bc"], ["abcd"], "a", True),  # earliest completing match wins, as char by char
        (["abcd", "bc"], ["a", "b", "c", "d"], "a", True),
        (["abc"], ["ab"], "ab", False),  # held back, flushed at the end
        ([], ["anything"], "anything", False),
        ([""], ["empty stop strings are ignored"], "empty stop strings are ignored", False),
    ],
)
def test_stop_strings_with_hold_back(stops, pieces, expected, stopped):
    assert feed(StopStringMatcher(stops), pieces) == (expected, stopped)


def test_hold_back_keeps_only_a_possible_stop_prefix():
    m = StopStringMatcher(["<end>"])
    assert m.add("text <e") == ("text ", False)
    assert m.add("x") == ("<ex", False)


# --- output processor ------------------------------------------------------------------


def test_output_processor_streams_what_it_would_return_whole(tok):
    text = "Grüße 🦙 ok STOP ignored"
    ids = tok.encode(text, add_special_tokens=False).ids
    proc = OutputProcessor(tok, ["STOP"])
    out = []
    for n, i in enumerate(ids):
        d = proc.process(TokenChunk("r", [i], "decode", "w", "stop" if n == len(ids) - 1 else None))
        out.append(d.text)
        if d.finish_reason:
            break
    assert "".join(out) == "Grüße 🦙 ok "
    assert proc.finish_reason == "stop" and proc.stopped_by_string


# --- registry ---------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_worker_is_dead_after_three_intervals_but_never_before_three_seconds():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    reg.observe(LoadReport(role="decode", worker_id="fast", interval_s=0.1))
    reg.observe(LoadReport(role="decode", worker_id="slow", interval_s=2.0))
    clock.t += 2.9
    assert reg.is_alive("fast") and reg.is_alive("slow")
    clock.t += 0.2
    assert not reg.is_alive("fast") and reg.is_alive("slow")
    clock.t += 3.0
    assert not reg.is_alive("slow")


def test_unknown_worker_gets_a_grace_period_from_when_it_was_first_watched():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    since = clock.t
    clock.t += 2.0
    assert reg.is_alive("new", since=since)
    clock.t += 1.5
    assert not reg.is_alive("new", since=since)


def test_counts_skip_dead_and_draining_workers():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    reg.observe(LoadReport(role="prefill", worker_id="p1"))
    reg.observe(LoadReport(role="prefill", worker_id="p2", draining=True))
    reg.observe(LoadReport(role="decode", worker_id="d1"))
    clock.t += 2
    reg.observe(LoadReport(role="tokenizer", worker_id="t1"))
    assert reg.counts() == {"prefill": 1, "decode": 1, "tokenizer": 1}
    clock.t += 2
    assert reg.counts() == {"tokenizer": 1}
