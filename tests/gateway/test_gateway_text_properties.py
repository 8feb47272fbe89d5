"""Property tests of streaming text (detokenization, stop strings): random multi-byte texts, random
token chunkings, random cuts (max_tokens), random stop strings; the incremental
path must equal a one-shot decode and cut, and never show U+FFFD or part of a
stop string. Two decoders: SmolLM2 (byte-level BPE) and Gemma-3 (SentencePiece
BPE with byte fallback).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from deepinfer.gateway.stream.detokenizer import IncrementalDetokenizer
from deepinfer.gateway.stream.output import OutputProcessor
from deepinfer.gateway.stream.stop import StopStringMatcher
from deepinfer.models.convert import ModelNotFound, ensure_default_model, ensure_gemma3_270m
from deepinfer.protocol import TokenChunk

FFFD = "\ufffd"
PIECES = ["東京", "中文字", "한국어", "日本語の", "🦙", "👨‍👩‍👧", "🇫🇷", "🫠", "𠜎𠀀", "é", "ß", "Ωμέγα", "—", "…",
          " ", "  ", "\n", "\t", "a", "the ", "STOP", "<end>", "x=1;", "42", ".", "!"]


def _gemma():
    try:
        return Tokenizer.from_file(str(ensure_gemma3_270m(progress=False) / "tokenizer.json"))
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["smol", "gemma"])
def tok(request):
    if request.param == "gemma":
        return _gemma()
    return Tokenizer.from_file(str(ensure_default_model(progress=False) / "tokenizer.json"))


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[i : i + n])
        i += n
    return out


def one_shot(tok, ids: list[int]) -> str:
    """What the stream must add up to: the whole decode without an unfinished character at the end."""
    complete = ""
    for j in range(len(ids), -1, -1):
        complete = tok.decode(ids[:j], skip_special_tokens=True)
        if not complete.endswith(FFFD):
            break
    stripped = tok.decode(ids, skip_special_tokens=True).rstrip(FFFD)
    return stripped if len(stripped) > len(complete) and stripped.startswith(complete) else complete


def test_incremental_detokenization_equals_one_shot_on_random_multibyte_text(tok):
    rng = random.Random(1)
    specials = [i for i, t in tok.get_added_tokens_decoder().items() if t.special][:8]
    cut_mid_character = 0
    for _ in range(300):
        ids = tok.encode(random_text(rng), add_special_tokens=False).ids
        for _ in range(rng.randint(0, 2)):  # chat markers / EOS in the middle are skipped
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        ids = ids[: rng.randint(1, len(ids))]  # max_tokens cuts anywhere, also inside a character
        cut_mid_character += tok.decode(ids).endswith(FFFD)
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(c) for c in random_chunks(rng, ids)] + [detok.flush()]
        assert not any(FFFD in p for p in pieces), pieces
        assert "".join(pieces) == one_shot(tok, ids)
    assert cut_mid_character > 20  # the cuts really split characters


def test_stop_matcher_equals_one_shot_cut_on_random_pieces():
    """The cut is at the earliest completing match, whatever the chunking (overlapping stops included)."""
    rng = random.Random(2)
    for _ in range(2000):
        text = random_text(rng)
        stops = [text[i : i + rng.randint(1, 6)] for i in rng.sample(range(len(text)), min(2, len(text)))]
        stops += rng.sample(["STOP", "<end>", "🦙中", "zz"], rng.randint(0, 2))
        hits = sorted((text.find(s) + len(s), text.find(s)) for s in stops if s in text)
        expected = text[: hits[0][1]] if hits else text  # cut at the earliest completing match
        m = StopStringMatcher(stops)
        out, pos, stopped = "", 0, False
        while pos < len(text) and not stopped:
            n = rng.randint(1, 4)
            piece, stopped = m.add(text[pos : pos + n])
            out += piece
            pos += n
            assert expected.startswith(out)  # nothing past the cut, no part of a stop string, ever
        if not stopped:
            out += m.flush()
        assert (out, stopped) == (expected, bool(hits))


def test_hold_back_is_never_longer_than_the_longest_stop_minus_one():
    rng = random.Random(3)
    for _ in range(500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(2)]
        m = StopStringMatcher(stops)
        for _ in range(20):
            _, stopped = m.add(rng.choice("abc"))
            if stopped:
                break
            assert len(m.pending) <= max(map(len, stops)) - 1


def test_streamed_deltas_equal_the_non_streamed_text_with_stops_across_tokens(tok):
    """OutputProcessor fed in random chunks == one-shot decode, cut at the earliest stop string."""
    rng = random.Random(4)
    spanning = 0
    for _ in range(300):
        ids = tok.encode(random_text(rng), add_special_tokens=False).ids
        ids = ids[: rng.randint(1, len(ids))]
        full = one_shot(tok, ids)
        stops = []
        if full and rng.random() < 0.8:
            i = rng.randrange(len(full))
            stops.append(full[i : i + rng.randint(1, 5)])
        stops += rng.sample(["STOP", "東京", "🦙", "\n\n", "zz"], rng.randint(0, 2))
        hits = sorted((full.find(s) + len(s), full.find(s)) for s in stops if s and s in full)
        expected = full[: hits[0][1]] if hits else full
        spanning += any(len(tok.encode(s, add_special_tokens=False).ids) > 1 for s in stops if s in full)

        proc = OutputProcessor(tok, stops)
        chunks = random_chunks(rng, ids)
        streamed = ""
        for n, c in enumerate(chunks):
            d = proc.process(TokenChunk("r", c, "decode", "w", "length" if n == len(chunks) - 1 else None))
            assert FFFD not in d.text
            streamed += d.text
            assert expected.startswith(streamed)
            if d.finish_reason:
                break
        assert streamed == expected
        assert proc.finish_reason == ("stop" if hits else "length")
        assert proc.stopped_by_string == bool(hits)
    assert spanning > 30  # many stop strings really span token boundaries
