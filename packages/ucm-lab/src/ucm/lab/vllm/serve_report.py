"""What a serving benchmark reports: percentiles of time to first token and latency, prompt
throughput and hit tokens per system, ratios between systems of one run, a table for the
docs and a plot of time to first token by round.  Pure, but for the plot (matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ucm.lab.vllm.serve_client import Record

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, interpolated between the closest ranks (as numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: Iterable[Record], rounds: Iterable[int] | None = None) -> dict[str, Any]:
    """TTFT and latency percentiles (seconds), prompt throughput (prompt tokens per second
    of the requests' span), hit tokens and failures, over ``rounds`` (all by default)."""
    wanted = None if rounds is None else set(rounds)
    chosen = [r for r in records if wanted is None or r.round in wanted]
    done = [r for r in chosen if r.ttft_s is not None and r.latency_s is not None]
    out: dict[str, Any] = {"requests": len(chosen), "failed": len(chosen) - len(done)}
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    latencies = [r.latency_s for r in done if r.latency_s is not None]
    for q in PERCENTILES:
        out[f"ttft_p{q}_s"] = percentile(ttfts, q)
        out[f"latency_p{q}_s"] = percentile(latencies, q)
    if done:
        span = max(r.started_s + (r.latency_s or 0.0) for r in done) - min(
            r.started_s for r in done
        )
        out["prompt_tokens_per_s"] = sum(r.prompt_tokens for r in done) / span if span else 0.0
    else:
        out["prompt_tokens_per_s"] = 0.0
    out["prompt_tokens"] = sum(r.prompt_tokens for r in done)
    out["cached_tokens"] = sum(r.cached_tokens for r in done)
    return out


def ttft_by_round(records: Iterable[Record], q: float = 50) -> dict[int, float]:
    """The ``q``-th percentile of time to first token of each round."""
    rounds: dict[int, list[float]] = {}
    for r in records:
        if r.ttft_s is not None:
            rounds.setdefault(r.round, []).append(r.ttft_s)
    return {k: percentile(v, q) for k, v in sorted(rounds.items())}


def ratios(
    summaries: Mapping[str, Mapping[str, Any]], baseline: str, keys: Sequence[str]
) -> dict[str, dict[str, float]]:
    """system -> key -> the system's figure over ``baseline``'s, for each system but it."""
    base = summaries[baseline]
    return {
        name: {k: _ratio(s[k], base[k]) for k in keys}
        for name, s in summaries.items()
        if name != baseline
    }


def _ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def markdown_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per system: TTFT p50/p90/p99, latency p50/p99, prompt throughput, hits."""
    head = (
        "| system | TTFT p50 | TTFT p90 | TTFT p99 | latency p50 | latency p99 "
        "| prompt tok/s | hit tokens | failed |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {name} | {s['ttft_p50_s']:.3f} s | {s['ttft_p90_s']:.3f} s | {s['ttft_p99_s']:.3f} s"
        f" | {s['latency_p50_s']:.3f} s | {s['latency_p99_s']:.3f} s"
        f" | {s['prompt_tokens_per_s']:.0f} | {s['cached_tokens']} | {s['failed']} |"
        for name, s in summaries.items()
    ]
    return head + "\n".join(rows) + "\n"


def plot_ttft_by_round(
    series: Mapping[str, Mapping[int, float]], path: str, title: str, restart_before: int | None
) -> None:
    """A PNG of each system's median time to first token by round (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, by_round in series.items():
        rounds = sorted(by_round)
        ax.plot([r + 1 for r in rounds], [by_round[r] for r in rounds], marker="o", label=name)
    if restart_before is not None:
        ax.axvline(restart_before + 0.5, color="grey", linestyle="--", label="server restart")
    ax.set_xlabel("round")
    ax.set_ylabel("time to first token, median (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
