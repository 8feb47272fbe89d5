"""Mock engine: the real scheduler, block manager and prefix cache, with no model.

``MockEngine`` is an ``LLMEngine`` with two parts swapped: the model runner
(``MockRunner``: a tiny KV cache, no weights) and the sampler (deterministic
tokens). ``Sequence``, ``Scheduler``, ``BlockManager`` (prefix caching),
chunking by the cost model, async scheduling, KV export / import and
``load_prefix`` are the real engine's code, so a mock worker schedules,
caches, hands off and reports load as a real one would, while dozens of
them fit on one machine (no weights: ~no memory, no compute).

A step's "forward pass" sleeps for the time the timing model predicts for
its pieces (``StepCostModel.predict``: ``a + b·Σn +
d·Σn(c + n/2) + e·Σ(c + n)`` seconds), measured from the step's start, so
the mock's own bookkeeping is part of that time. The timing model's
coefficients come from ``MockConfig.cost``: the defaults below, given ones
(``--mock-cost a,b,d,e``), or a JSON file fitted from the real engine
(``--mock-cost-file``; write one with ``python -m deepinfer.engine.mock fit``).
The engine's own ``cost_model`` (what it chunks by and reports) starts at
the timing model when ``calibrate`` is on and is refitted online from the
measured (slept) steps, as the real one is.

KV cache (the real layout with 1 layer, 1 KV head, head_dim 1, float32)::

    kv_cache: [1, 2 (K, V), num_blocks, block_size, 1, 1]
    K[p] = s_p = (s_{p-1} * MIX + token_p + 1) mod STATE_MOD     (s_{-1} = 0; < 2**24, exact in float32)
    V[p] = token_p

``s_p`` is a rolling hash of the whole context up to position p, and the
token sampled after position p is a function of ``s_p`` alone, read from the
cache: outputs are deterministic (any temperature, any batch, any worker),
equal across a prefill -> decode handoff or a recompute, and wrong if a KV
block was lost or mixed up (as with a real model). Each step also checks
that ``V`` at the position before its first fed token holds that token
(``MockRunner.num_kv_mismatches`` counts misses). A block is 2·block_size
float32 (128 B at block size 16), so storage-tier files stay small.

Capacity is the real model's: ``num_blocks = kv_cache_bytes // (the real
model's bytes per block)`` from its ``config.json`` (no weights are read),
so preemption and admission behave as on the real engine. The mock's
``fingerprint`` differs from the real model's (its blocks have another
shape), so mock and real workers never share storage-tier blocks.

Tokens: ``allowed`` ids are the model's vocabulary without its special
tokens (``tokenizer.json``'s added special tokens) and EOS ids, so the
gateway can detokenize them; EOS is emitted only with
``MockConfig.eos_rate`` > 0 (that fraction of tokens, deterministically,
after ``min_tokens``). Logprobs, when asked: 0.0 for the emitted token; prompt logprobs
likewise 0.0 for each prompt token after the first (the prompt is computed whole, as the real
engine computes it).
Not mocked: hybrid sliding-window KV pools (a hybrid model is mocked as
full attention), batch invariance (outputs are batch-invariant anyway) and
structured output: the mock's tokens follow no grammar, so a request with
``SamplingParams.structured`` is refused (``RequestError``) rather than
answered unconstrained.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.interface import EngineConfig, RequestError
from deepinfer.engine.engine_core import _Step
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.sampler import SampleResult, TokenLogprobs
from deepinfer.engine.sequence import Sequence
from deepinfer.kvstore.hashing import model_fingerprint
from deepinfer.models.config import ModelConfig
from deepinfer.models.loader import DTYPES

# Fitted by ``LLMEngine.calibrate`` (``engine.calibration``) on SmolLM2-135M-Instruct, fp32, packed weights, the
# 2-core development CPU: a (s/step), b (s/token), d (s/token pair), e (s/key gathered).
DEFAULT_COST = (0.0116, 1.10e-3, 3.16e-7, 3.05e-5)

STATE_MOD = 16_777_213  # largest prime below 2**24: every state is exact in float32
MIX = 1_000_003


@dataclass
class MockConfig:
    """cost: timing model (a, b, d, e), seconds (see ``StepCostModel``).
    eos_rate: fraction of tokens that are EOS (0 = never; deterministic)."""

    cost: tuple[float, float, float, float] = DEFAULT_COST
    eos_rate: float = 0.0


def parse_cost(text: str) -> tuple[float, float, float, float]:
    """``"a,b,d,e"`` (seconds) -> a tuple; ValueError unless four non-negative numbers."""
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 4 or any(x < 0 for x in parts):
        raise ValueError(f"expected four non-negative numbers a,b,d,e, got {text!r}")
    return tuple(parts)


def load_cost_file(path: str | Path) -> tuple[float, float, float, float]:
    """Coefficients from a JSON file ``{"a": .., "b": .., "d": .., "e": ..}`` (``fit`` writes one)."""
    d = json.loads(Path(path).read_text())
    return parse_cost(",".join(str(d[k]) for k in "abde"))


def mock_fingerprint(model_dir: str | Path, block_size: int) -> str:
    """The mock's storage-tier fingerprint: the real model's, marked mock (blocks differ in shape)."""
    real = model_fingerprint(model_dir, "float32", block_size)
    return hashlib.sha256(f"mock/{real}".encode()).hexdigest()[:16]


def allowed_tokens(model_dir: str | Path, cfg: ModelConfig) -> array:
    """Token ids the mock may emit: the vocabulary minus special tokens and EOS ids."""
    vocab = cfg.vocab_size
    banned = set(cfg.eos_token_ids)
    tok_file = Path(model_dir) / "tokenizer.json"
    if tok_file.exists():
        tok = json.loads(tok_file.read_text())
        ids = tok.get("model", {}).get("vocab") or {}
        if isinstance(ids, dict) and ids:  # BPE / WordPiece: token -> id
            vocab = min(vocab, max(ids.values()) + 1)
        banned |= {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    return array("i", (i for i in range(vocab) if i not in banned))


def _mix64(x: int) -> int:
    """splitmix64's finaliser: spreads a context state over 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


@dataclass
class MockStepInputs:
    """One step's inputs: per sequence (seq, first fed position, end, block table at
    launch); the fed tokens packed; placeholders as in ``StepInputs``."""

    pieces: list[tuple[Sequence, int, int, list[int]]]
    input_ids: list[int]
    placeholders: list


class MockRunner:
    """``ModelRunner``'s interface over the tiny KV cache described in the module docstring."""

    def __init__(self, block_size: int, num_blocks: int, allowed: array, eos_token_ids: list[int],
                 eos_rate: float = 0.0):
        self.block_size = block_size
        self.kv_cache = torch.zeros(1, 2, num_blocks, block_size, 1, 1, dtype=torch.float32)
        self._flat = self.kv_cache.view(2, num_blocks * block_size)  # [K/V, slot]
        self.allowed = allowed
        self.eos_token_ids = list(eos_token_ids)
        self.eos_rate = eos_rate
        self.num_kv_mismatches = 0

    def prepare(self, seqs: list[Sequence]) -> MockStepInputs:
        """Each sequence feeds its ``num_scheduled_tokens`` after its computed ones (as ``ModelRunner``)."""
        pieces, input_ids, placeholders = [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            known = seq.token_ids[start:end]
            for p in range(start + len(known), end):
                placeholders.append((len(input_ids) + p - start, seq, p))
            input_ids.extend(known)
            input_ids.extend([0] * (end - start - len(known)))
            pieces.append((seq, start, end, list(seq.block_table)))
        return MockStepInputs(pieces, input_ids, placeholders)

    fill = staticmethod(ModelRunner.fill)

    def execute(self, inputs: MockStepInputs) -> list[int]:
        """Write each fed token's K (context state) and V (token); the next token per sequence."""
        assert not inputs.placeholders, "fill() the placeholders first"
        bs, flat, out, j = self.block_size, self._flat, [], 0
        for seq, start, end, table in inputs.pieces:
            state = 0
            if start > 0:
                prev = table[(start - 1) // bs] * bs + (start - 1) % bs
                state = int(flat[0, prev])
                if int(flat[1, prev]) != seq.token_ids[start - 1] and not seq.status.is_finished:
                    self.num_kv_mismatches += 1
            tokens = inputs.input_ids[j : j + end - start]
            j += end - start
            states = []
            for tok in tokens:
                state = (state * MIX + tok + 1) % STATE_MOD
                states.append(state)
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])
            flat[0, slots] = torch.tensor(states, dtype=torch.float32)
            flat[1, slots] = torch.tensor(tokens, dtype=torch.float32)
            out.append(self.next_token(state, end - seq.num_prompt_tokens, seq))
        return out

    def next_token(self, state: int, output_index: int, seq: Sequence) -> int:
        """The token after a context whose state is ``state``; ``output_index``: its index in the output."""
        x = _mix64(state)
        if (self.eos_rate > 0 and self.eos_token_ids and output_index >= seq.sampling.min_tokens
                and (x >> 40) < self.eos_rate * (1 << 24)):
            return self.eos_token_ids[0]
        return self.allowed[x % len(self.allowed)]

    def run(self, seqs: list[Sequence]) -> list[int]:
        return self.execute(self.prepare(seqs))

    def read_blocks(self, seq: Sequence, n: int, start: int = 0) -> torch.Tensor:
        """The sequence's blocks ``start .. n-1``: [n - start, 1, 2, block_size, 1, 1] (``ModelRunner.read_blocks``' layout)."""
        return self.kv_cache[:, :, seq.block_table[start:n]].permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, seq: Sequence, blocks: torch.Tensor) -> None:
        """Copy blocks in (``read_blocks``' layout) to the sequence's first ``len(blocks)`` blocks."""
        n = blocks.shape[0]
        self.kv_cache[:, :, seq.block_table[:n]] = blocks.to(torch.float32).permute(1, 2, 0, 3, 4, 5)


class MockEngine(LLMEngine):
    """``LLMEngine`` without a model: reads only ``config.json`` (and ``tokenizer.json``) of ``model_dir``.

    ``model_config`` is the real config with the mock's KV geometry (1 layer,
    1 KV head, head_dim 1), which is what callers size KV staging buffers by.
    ``timing`` is the fixed timing model the steps sleep by; ``cost_model``
    is the engine's fitted estimate, as in the real engine.
    """

    engine_kind = "mock"

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, mock: MockConfig | None = None):
        self.config = config = config or EngineConfig()
        self.mock = mock = mock or MockConfig()
        if config.speculative is not None and not config.prefill_only:
            raise ValueError("the mock engine does not speculate (its tokens are not a model's)")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        real = ModelConfig.from_dir(model_dir)
        self.model = None
        self.model_config = dataclasses.replace(real, num_hidden_layers=1, num_key_value_heads=1, head_dim=1)
        self.max_model_len = min(config.max_model_len or real.max_position_embeddings, real.max_position_embeddings)
        self.fingerprint = mock_fingerprint(model_dir, config.block_size)
        self.block_bytes = ModelRunner.block_bytes(  # modelled ("auto": fp32)
            real, config.block_size, DTYPES.get(config.dtype, torch.float32))
        num_blocks = max(2, config.kv_cache_bytes // self.block_bytes)
        self.runner = MockRunner(config.block_size, num_blocks, allowed_tokens(model_dir, real),
                                 real.eos_token_ids, mock.eos_rate)
        self.timing = StepCostModel(*mock.cost)
        # no window layers, so no SWA state cache: a hybrid model is mocked as full attention
        self._init_scheduling(BlockManager(num_blocks, config.block_size, self.fingerprint,
                                           config.enable_prefix_caching), None, real.eos_token_ids)
        if config.calibrate:
            self.calibrate()

    def check_request(self, prompt_token_ids: list[int], output_token_ids: list[int] = (),
                      sampling=None) -> None:
        """``LLMEngine.check_request``, and RequestError for a structured-output request."""
        if sampling is not None and sampling.structured is not None:
            raise RequestError("structured output needs a real model: the mock engine cannot enforce a grammar")
        super().check_request(prompt_token_ids, output_token_ids, sampling)

    def calibrate(self) -> None:
        """No timed passes: the cost model starts at the timing model (a perfect calibration)."""
        cm = self.cost_model
        cm.a, cm.b, cm.d, cm.e = self.timing.a, self.timing.b, self.timing.d, self.timing.e

    def _execute(self, step: _Step) -> SampleResult:
        """The mock forward pass: KV and next tokens, then sleep until the predicted step time."""
        self.runner.fill(step.inputs)
        t0 = step.started = time.perf_counter()
        if self._forward_end is not None:
            self.step_gaps.append(t0 - self._forward_end)
        next_tokens = self.runner.execute(step.inputs)
        delay = t0 + self.timing.predict(step.pieces) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        step.ended = time.perf_counter()
        self.last_step_s = step.ended - t0
        self.busy_s_total += self.last_step_s
        self.cost_model.observe(step.pieces, self.last_step_s)
        tokens, logprobs = [], []
        for i in step.sampling:
            tok, sp = next_tokens[i], step.seqs[i].sampling
            tokens.append(tok)
            top = [(tok, 0.0)][: sp.top_logprobs]
            logprobs.append(TokenLogprobs(tok, 0.0, top) if sp.logprobs else None)
        self._forward_end = time.perf_counter()
        return SampleResult(tokens, logprobs, self._prompt_logprobs(step.inputs))

    @staticmethod
    def _prompt_logprobs(inputs: MockStepInputs) -> list:
        """``SampleResult.prompt_logprobs`` of the step's fed prompt positions: 0.0 for the next token."""
        out = []
        for seq, start, end, _ in inputs.pieces:
            last = min(end, seq.num_prompt_tokens - 1)
            if seq.prompt_logprobs is None or last <= start:
                continue
            k = seq.sampling.prompt_logprobs
            tokens = seq.token_ids[start + 1 : last + 1]
            out.append((seq, start, [TokenLogprobs(t, 0.0, [(t, 0.0)][:k]) for t in tokens]))
        return out


def fit_cost(model_dir: str | Path, config: EngineConfig | None = None) -> dict:
    """Calibrate the real engine on ``model_dir`` (a few seconds of forward passes) and
    return its coefficients ``{"a", "b", "d", "e"}`` (seconds) for ``load_cost_file``."""
    config = dataclasses.replace(config or EngineConfig(), calibrate=True)
    cm = LLMEngine(model_dir, config).cost_model
    return {"a": cm.a, "b": cm.b, "d": cm.d, "e": cm.e, "model": str(model_dir), "dtype": config.dtype}


def main(argv: list[str] | None = None) -> None:
    """``python -m deepinfer.engine.mock fit [--model DIR] [--out FILE]``: print / write fitted coefficients."""
    from deepinfer.models.convert import resolve_model

    p = argparse.ArgumentParser(prog="python -m deepinfer.engine.mock")
    p.add_argument("command", choices=["fit"])
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    args = p.parse_args(argv)
    text = json.dumps(fit_cost(resolve_model(args.model), EngineConfig(dtype=args.dtype)), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
