"""PNG plots of serving benchmark runs (matplotlib, imported lazily, Agg backend: no display).

- ``plot_latency_cdfs``: the empirical CDF of TTFT, TPOT, ITL and E2E, one line per run.
- ``plot_throughput``: output tokens/s over time (``metrics.throughput_series``) and the
  requests in flight, one line per run, time in seconds since each run's first send.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer.bench.metrics import RequestResult, throughput_series


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _latencies(results: list[RequestResult]) -> dict[str, list[float]]:
    done = [r for r in results if r.ok]
    return {"TTFT": [r.ttft for r in done], "TPOT": [t for r in done if (t := r.tpot) is not None],
            "ITL": [g for r in done for g in r.itls], "E2E": [r.e2e for r in done]}


def plot_latency_cdfs(runs: list[tuple[str, list[RequestResult]]], path: Path, title: str = "") -> None:
    """PNG at ``path``: a 2x2 grid of latency CDFs (milliseconds, log scale), a line per labelled run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=100)
    for ax, metric in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E")):
        for label, results in runs:
            xs = sorted(1000 * v for v in _latencies(results)[metric])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric} (ms, log scale)")
        ax.set_ylabel("fraction of requests" if metric != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "Latency CDFs")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_throughput(runs: list[tuple[str, list[RequestResult]]], path: Path, title: str = "",
                    bin_s: float | None = None) -> None:
    """PNG at ``path``: output tokens/s per ``bin_s`` bin (default: 1/50 of the longest run, at least
    0.1 s) and requests in flight over time, a line per labelled run."""
    plt = _pyplot()
    spans = [max(r.end for r in res) - min(r.sent for r in res) for _, res in runs if res]
    if bin_s is None:
        bin_s = max(0.1, max(spans, default=1.0) / 50)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), dpi=100, sharex=True)
    for label, results in runs:
        if not results:
            continue
        t0 = min(r.sent for r in results)
        xs, ys = throughput_series(results, bin_s, t0)
        # each bin drawn over its whole width: the last one too
        top.step([x - t0 for x in xs] + [xs[-1] + bin_s - t0], ys + ys[-1:], where="post", label=label)
        events = sorted([(r.sent - t0, 1) for r in results] + [(r.end - t0, -1) for r in results])
        level, ts, ns = 0, [0.0], [0]
        for t, d in events:
            level += d
            ts.append(t)
            ns.append(level)
        bottom.step(ts, ns, where="post", label=label)
    top.set_ylabel(f"output tokens/s ({bin_s:.2g} s bins)")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("time since the run's first request (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or "Throughput over time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
