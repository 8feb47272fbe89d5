"""``deepinfer economics``: what a day of traffic earns and costs, and what the cache needs to keep.

    deepinfer economics --tokens-per-day 155T --cache-hit 0.96 --accelerators 24000 \\
        --accelerator-cost-hour 7 --capex-per-accelerator 60000
    deepinfer economics --from-bench bench-out/serve.json ...   # the measured hit share and mix

Definitions (``M`` = one million tokens, a day = 24 hours):

    input tokens/day   = tokens/day x (1 - output share)
    output tokens/day  = tokens/day x output share
    cached tokens/day  = input tokens/day x cache-hit share
    blended $/M        = (1 - output share) x (hit x cached $/M + (1 - hit) x uncached $/M)
                         + output share x output $/M
    revenue/day        = tokens/day / 1e6 x blended $/M
    revenue per accelerator-hour = revenue/day / (accelerators x 24)
    cost/day           = accelerators x 24 x $/accelerator-hour + storage TB x $/TB-month / 30
    margin             = (revenue/day - cost/day) / revenue/day
    payback (days)     = accelerators x capex per accelerator / (revenue/day - cost/day)
    KV written/day     = uncached input tokens/day x KV bytes per token
    storage needed     = KV written/day x retention days

The storage estimate counts every prefix computed within the retention window once:
a block expires its class's retention after its last use (``kvindex.maintenance``), so blocks
still in use live longer and blocks shared inside the window count once. The cache
discount is what cached tokens would have paid at the uncached price.

Defaults are the seeds' scenario (docs/benchmarks.md): 155 T tokens/day, 96 % input cache
hits, DeepSeek's V3.2 list prices ($0.28 uncached, $0.028 cached, $0.42 output per M)
with 27 % output tokens (the mix at which those prices give the seeds' blended
≈ $0.14/M), 24,000 accelerators (≈ $0.9 M/hour at the seeds' ≈ $38 per
accelerator-hour), a full cost of $7 per accelerator-hour (storage included, so no
separate storage cost), $60,000 capital per accelerator, DeepSeek-V3's MLA KV cache
(70,272 bytes per token in BF16) kept 7 days. docs/benchmarks.md has the derivation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HOURS_PER_DAY = 24
DAYS_PER_MONTH = 30


@dataclass(frozen=True)
class Inputs:
    """Traffic, prices and costs. Units: tokens/day; shares 0..1; prices $ per million tokens;
    $ per accelerator-hour; $ per accelerator; bytes per token; days; TB (1e12 bytes); $ per TB-month."""

    tokens_per_day: float
    output_share: float
    cache_hit: float
    price_input: float
    price_cached: float
    price_output: float
    accelerators: int
    accelerator_cost_hour: float
    capex_per_accelerator: float = 0.0
    kv_bytes_per_token: float = 0.0
    retention_days: float = 0.0
    storage_tb: float | None = None  # None: exactly what the retention window needs
    storage_cost_tb_month: float = 0.0


@dataclass(frozen=True)
class Economics:
    """The results, same units as ``Inputs`` ($ and $/day; storage in TB)."""

    input_tokens_per_day: float
    output_tokens_per_day: float
    cached_tokens_per_day: float
    blended_price: float
    revenue_per_day: float
    revenue_per_hour: float
    revenue_per_accelerator_hour: float
    accelerator_cost_per_day: float
    storage_cost_per_day: float
    cost_per_day: float
    margin: float
    payback_days: float
    cache_discount_per_day: float
    kv_written_tb_per_day: float
    storage_needed_tb: float
    storage_tb: float


def compute(i: Inputs) -> Economics:
    """The day's economics of ``i`` (formulas in the module docstring). ValueError on impossible inputs."""
    for name in ("output_share", "cache_hit"):
        if not 0 <= getattr(i, name) <= 1:
            raise ValueError(f"{name} must be in [0, 1]")
    if i.accelerators < 1 or i.tokens_per_day <= 0:
        raise ValueError("tokens_per_day must be > 0 and accelerators >= 1")
    inp = i.tokens_per_day * (1 - i.output_share)
    out = i.tokens_per_day * i.output_share
    cached = inp * i.cache_hit
    input_price = i.cache_hit * i.price_cached + (1 - i.cache_hit) * i.price_input
    blended = (1 - i.output_share) * input_price + i.output_share * i.price_output
    revenue = i.tokens_per_day / 1e6 * blended
    written_tb = (inp - cached) * i.kv_bytes_per_token / 1e12
    needed_tb = written_tb * i.retention_days
    storage_tb = needed_tb if i.storage_tb is None else i.storage_tb
    accel_cost = i.accelerators * HOURS_PER_DAY * i.accelerator_cost_hour
    storage_cost = storage_tb * i.storage_cost_tb_month / DAYS_PER_MONTH
    cost = accel_cost + storage_cost
    profit = revenue - cost
    return Economics(
        input_tokens_per_day=inp, output_tokens_per_day=out, cached_tokens_per_day=cached, blended_price=blended,
        revenue_per_day=revenue, revenue_per_hour=revenue / HOURS_PER_DAY,
        revenue_per_accelerator_hour=revenue / (i.accelerators * HOURS_PER_DAY),
        accelerator_cost_per_day=accel_cost, storage_cost_per_day=storage_cost, cost_per_day=cost,
        margin=profit / revenue if revenue > 0 else -math.inf,
        payback_days=i.accelerators * i.capex_per_accelerator / profit if profit > 0 else math.inf,
        cache_discount_per_day=cached / 1e6 * (i.price_input - i.price_cached),
        kv_written_tb_per_day=written_tb, storage_needed_tb=needed_tb, storage_tb=storage_tb)


def bench_shares(path: Path) -> tuple[float, float]:
    """(cache-hit share, output share) measured by a ``bench serve`` (serve.json: summed over its
    runs) or ``bench replay`` (replay.json) result: cached / prompt tokens, output / all tokens."""
    try:
        doc = json.loads(Path(path).read_text())
        summaries = [r["summary"] for r in doc["runs"]] if "runs" in doc else [doc["summary"]]
        prompt = sum(s["prompt_tokens"] for s in summaries)
        cached = sum(s["cached_tokens"] for s in summaries)
        output = sum(s.get("output_tokens", 0) for s in summaries)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a bench serve or bench replay result ({type(e).__name__}: {e})") from None
    if prompt <= 0:
        raise ValueError(f"{path}: no completed request with prompt tokens")
    return cached / prompt, output / (prompt + output)


# ------------------------------------------------------------------------------ command line

SUFFIXES = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12, "P": 1e15}


def quantity(text: str) -> float:
    """A number >= 0, optionally with an SI suffix: 155T = 155e12 (K, M, G or B, T, P)."""
    t = text.strip()
    scale = SUFFIXES.get(t[-1:].upper(), 1.0) if t else 1.0
    try:
        x = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 155e12 or 155T)") from None
    if not x >= 0 or math.isinf(x):
        raise argparse.ArgumentTypeError("must be a finite number >= 0")
    return x


def share(text: str) -> float:
    x = quantity(text)
    if x > 1:
        raise argparse.ArgumentTypeError("must be a fraction in [0, 1] (0.96, not 96)")
    return x


def count(text: str) -> int:
    x = quantity(text)
    if x < 1 or x != int(x):
        raise argparse.ArgumentTypeError("must be a whole number >= 1")
    return int(x)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traffic")
    g.add_argument("--tokens-per-day", type=quantity, default=155e12, metavar="TOKENS",
                   help="tokens served per day, input + output (tokens/day; K/M/G/T suffixes; default 155T)")
    g.add_argument("--output-share", type=share, default=None, metavar="FRACTION",
                   help="output tokens / all tokens (0..1; default 0.27, or measured by --from-bench)")
    g.add_argument("--cache-hit", type=share, default=None, metavar="FRACTION",
                   help="cached input tokens / input tokens (0..1; default 0.96, or measured by --from-bench)")
    g.add_argument("--from-bench", type=Path, default=None, metavar="JSON",
                   help="take the cache-hit share and output share measured by a 'deepinfer bench serve' "
                        "(serve.json) or 'bench replay' (replay.json) run, unless given above")
    g = p.add_argument_group("prices")
    g.add_argument("--price-input", type=quantity, default=0.28, metavar="USD",
                   help="uncached input tokens ($ per million tokens; default 0.28)")
    g.add_argument("--price-cached", type=quantity, default=0.028, metavar="USD",
                   help="cached input tokens ($ per million tokens; default 0.028)")
    g.add_argument("--price-output", type=quantity, default=0.42, metavar="USD",
                   help="output tokens ($ per million tokens; default 0.42)")
    g = p.add_argument_group("accelerators")
    g.add_argument("--accelerators", type=count, default=24000, metavar="N",
                   help="accelerators serving the traffic (count; default 24000)")
    g.add_argument("--accelerator-cost-hour", type=quantity, default=7.0, metavar="USD",
                   help="full running cost of one accelerator ($ per accelerator-hour; default 7)")
    g.add_argument("--capex-per-accelerator", type=quantity, default=60000.0, metavar="USD",
                   help="capital to buy and install one accelerator, for the payback ($ per accelerator; "
                        "default 60000)")
    g = p.add_argument_group("cache storage")
    g.add_argument("--kv-bytes-per-token", type=quantity, default=70272.0, metavar="BYTES",
                   help="KV cache stored per token (bytes/token; default 70272: DeepSeek-V3 MLA, BF16)")
    g.add_argument("--retention-days", type=quantity, default=7.0, metavar="DAYS",
                   help="how long a prefix is kept after its last use (days; default 7)")
    g.add_argument("--storage-tb", type=quantity, default=None, metavar="TB",
                   help="storage provisioned for the cache (TB = 1e12 bytes; default: what the retention needs)")
    g.add_argument("--storage-cost-tb-month", type=quantity, default=0.0, metavar="USD",
                   help="storage cost ($ per TB-month; default 0: included in the accelerator-hour cost)")
    p.add_argument("--json", action="store_true", help="print inputs and results as JSON instead of a table")


def inputs_from_args(args: argparse.Namespace) -> tuple[Inputs, str]:
    """The ``Inputs`` and where the shares came from."""
    hit, out, source = args.cache_hit, args.output_share, "given"
    if args.from_bench is not None:
        measured_hit, measured_out = bench_shares(args.from_bench)
        source = f"measured by {args.from_bench}" + (" (hit share)" if out is not None else "")
        hit = measured_hit if hit is None else hit
        out = measured_out if out is None else out
    return Inputs(args.tokens_per_day, 0.27 if out is None else out, 0.96 if hit is None else hit,
                  args.price_input, args.price_cached, args.price_output, args.accelerators,
                  args.accelerator_cost_hour, args.capex_per_accelerator, args.kv_bytes_per_token,
                  args.retention_days, args.storage_tb, args.storage_cost_tb_month), source


def _money(x: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"${x / scale:,.2f} {unit}"
    return f"${x:,.2f}"


def _tokens(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f}"


def _storage(tb: float) -> str:
    for unit, scale in (("EB", 1e6), ("PB", 1e3)):
        if tb >= scale:
            return f"{tb / scale:,.2f} {unit}"
    return f"{tb:,.2f} TB"


def _provisioned(i: Inputs, e: Economics) -> str:
    if i.storage_tb is None:
        return ""
    if i.storage_tb >= e.storage_needed_tb:
        return f"; {_storage(i.storage_tb)} provisioned: enough"
    return f"; {_storage(i.storage_tb)} provisioned: holds {i.storage_tb / e.kv_written_tb_per_day:,.1f} days"


def format_report(i: Inputs, e: Economics, source: str = "given") -> str:
    rows = [
        ("traffic", f"{_tokens(i.tokens_per_day)} tokens/day: {_tokens(e.input_tokens_per_day)} input "
                    f"({i.cache_hit:.1%} cached, {source}), {_tokens(e.output_tokens_per_day)} output "
                    f"({i.output_share:.1%})"),
        ("prices ($/M tokens)", f"uncached input {i.price_input:g}, cached input {i.price_cached:g}, "
                                f"output {i.price_output:g}"),
        ("blended price", f"${e.blended_price:.4f} per million tokens"),
        ("revenue", f"{_money(e.revenue_per_day)}/day, {_money(e.revenue_per_hour)}/hour"),
        ("revenue per accelerator-hour", f"${e.revenue_per_accelerator_hour:,.2f} ({i.accelerators:,} accelerators)"),
        ("cost", f"{_money(e.cost_per_day)}/day (accelerators {_money(e.accelerator_cost_per_day)} at "
                 f"${i.accelerator_cost_hour:g}/accelerator-hour, storage {_money(e.storage_cost_per_day)})"),
        ("margin", f"{e.margin:.1%}"),
        ("payback", "never (no profit)" if math.isinf(e.payback_days) else
         f"{e.payback_days:,.1f} days on {_money(i.accelerators * i.capex_per_accelerator)} of accelerators"),
        ("cache discount given", f"{_money(e.cache_discount_per_day)}/day "
                                 f"({_tokens(e.cached_tokens_per_day)} cached tokens/day not recomputed)"),
        ("KV written", f"{_storage(e.kv_written_tb_per_day)}/day ({i.kv_bytes_per_token:,.0f} bytes/token "
                       "x uncached input tokens)"),
        ("storage for retention", f"{_storage(e.storage_needed_tb)} for {i.retention_days:g} days"
                                  + _provisioned(i, e)),
    ]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k + ':':<{width}}{v}" for k, v in rows)


def cli(args: argparse.Namespace) -> int:
    try:
        inputs, source = inputs_from_args(args)
        e = compute(inputs)
    except (ValueError, OSError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.json:
        results = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(e).items()}
        print(json.dumps({"inputs": asdict(inputs), "shares": source, "results": results}, indent=1))
    else:
        print(format_report(inputs, e, source))
    return 0


DESCRIPTION = ("Revenue, margin, payback and cache storage of a day of traffic, from its volume, input/output "
               "mix, cache-hit share (given or measured by a bench run), prices and accelerator and storage "
               "costs. Defaults: the seeds' scenario (docs/benchmarks.md).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deepinfer economics", description=DESCRIPTION)
    add_arguments(p)
    return cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
