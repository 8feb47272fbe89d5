"""Terminal tables of serving benchmark summaries (``metrics.summarize``): one column per run,
and with ``ratio`` a last column ``last / first`` (the comparison of two endpoints)."""

from __future__ import annotations

import math

# (row label, summary key, sub-key or None, scale, decimals)
ROWS: list[tuple[str, str, str | None, float, int]] = [
    ("duration (s)", "duration_s", None, 1, 1),
    ("request throughput (req/s)", "request_throughput", None, 1, 2),
    ("output throughput (tok/s)", "output_throughput", None, 1, 1),
    ("total token throughput (tok/s)", "total_token_throughput", None, 1, 1),
    ("goodput (req/s)", "goodput", None, 1, 2),
    ("cached-token share (%)", "cached_share", None, 100, 1),
    ("mean prompt tokens", "mean_prompt_tokens", None, 1, 1),
    ("mean output tokens", "mean_output_tokens", None, 1, 1),
] + [(f"{name} {stat} (ms)", key, stat, 1000, 1)
     for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
     for stat in ("mean", "median", "p90", "p99")]


def _value(summary: dict, key: str, sub: str | None) -> float:
    if key.startswith("mean_"):
        n = summary["requests"]["completed"]
        total = summary["prompt_tokens" if key == "mean_prompt_tokens" else "output_tokens"]
        return total / n if n else math.nan
    v = summary.get(key, math.nan) if sub is None else summary[key][sub]
    return math.nan if v is None else float(v)


def _cell(x: float, decimals: int) -> str:
    return "-" if math.isnan(x) else f"{x:,.{decimals}f}"


def format_summaries(columns: list[tuple[str, dict]], ratio: bool = False, title: str = "") -> str:
    """``columns``: (label, summary) pairs; a summary needs ``duration_s`` besides ``summarize``'s keys.
    Latencies in milliseconds. With ``ratio``, a column ``last/first`` of the first and last runs."""
    labels = [c[0] for c in columns] + ([f"{columns[-1][0]}/{columns[0][0]}"] if ratio else [])
    width = max(12, *(len(x) + 2 for x in labels))
    head = f"{'':<32}" + "".join(f"{x:>{width}}" for x in labels)
    lines = [title or "Serving benchmark", "=" * len(head), head, "-" * len(head)]
    counts = [f"{s['requests']['completed']}/{s['requests']['sent']}" for _, s in columns]
    lines.append(f"{'completed / sent requests':<32}" + "".join(f"{c:>{width}}" for c in counts))
    for label, key, sub, scale, dec in ROWS:
        vals = [_value(s, key, sub) * scale for _, s in columns]
        cells = [_cell(v, dec) for v in vals]
        if ratio:
            a, b = vals[0], vals[-1]
            cells.append("-" if math.isnan(a) or math.isnan(b) or a == 0 else f"{b / a:.2f}x")
        lines.append(f"{label:<32}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append("=" * len(head))
    slo = columns[0][1].get("slo") if columns else None
    if slo:
        given = ", ".join(f"{k[:-2].upper()} <= {v:g} s" for k, v in slo.items() if v is not None)
        lines.append(f"goodput SLOs: {given or 'none (every completed request counts)'}")
    return "\n".join(lines)
