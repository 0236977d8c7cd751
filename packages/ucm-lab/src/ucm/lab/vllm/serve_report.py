"""What a serving benchmark reports: percentiles of time to first token and latency, prompt
throughput and hit tokens per system, ratios between systems of one run, a table for the
docs and a plot of time to first token by round.  Pure, but for the plot (matplotlib).

The plot is re-rendered from a stored report, without running the benchmark again::

    python -m ucm.lab.vllm.serve_report --plot-from docs/bench_serve.json \
        --plot docs/img/bench_serve.png [--machine "2-vCPU AMD EPYC ..."]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ucm.lab.vllm.serve_client import Record

PERCENTILES = (50, 90, 99)

#: each system as the tables of docs/benchmarks.md name it (the plot and the tables agree)
SYSTEM_LABELS = {
    "vllm": "vLLM alone",
    "ucm-posix": "UCM, posix",
    "ucm-dram": "UCM, dram",
    "ucm-tiered": "UCM, tiered",
    "lmcache": "LMCache",
    "offloading": "vLLM's OffloadingConnector",
    "vllm-floor": "floor",
}


def label(system: str) -> str:
    """How the report names ``system`` to a reader (its own name where it has no label)."""
    return SYSTEM_LABELS.get(system, system)


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
        f"| {label(name)} | {s['ttft_p50_s']:.3f} s | {s['ttft_p90_s']:.3f} s"
        f" | {s['ttft_p99_s']:.3f} s | {s['latency_p50_s']:.3f} s | {s['latency_p99_s']:.3f} s"
        f" | {s['prompt_tokens_per_s']:.0f} | {s['cached_tokens']} | {s['failed']} |"
        for name, s in summaries.items()
    ]
    return head + "\n".join(rows) + "\n"


def describe_model(config: Mapping[str, Any]) -> str:
    """A model's config.json in a few words: architecture, size, KV heads, dtype."""
    arch = str(config.get("model_type", "model")).capitalize()
    parts = [arch]
    for key, unit in (
        ("hidden_size", "hidden {}"),
        ("num_hidden_layers", "{} layers"),
        ("num_key_value_heads", "{} KV heads"),
        ("torch_dtype", "{}"),
    ):
        if key in config:
            parts.append(unit.format(config[key]))
    return ", ".join(parts)


def caption(report: Mapping[str, Any], machine: str | None = None) -> tuple[str, str]:
    """The plot's title and the lines under it, from a report's settings: the workload, the
    model and the machine (``machine`` where the report does not record one)."""
    settings = report["settings"]
    work = settings["workload"]
    title = (
        "Median time to first token by round\n"
        f"multi-round QA through vllm serve, {work['users']} users, {work['rounds']} rounds"
    )
    model = describe_model(settings["model"])
    served = [" ".join(r.get("serve_args", [])) for r in report.get("ran", {}).values()]
    if served and all("--load-format dummy" in args for args in served):
        model += ", dummy weights"
    where = settings.get("machine") or machine or "machine not recorded"
    lines = [f"Model: {model}.", f"Machine: {where}."]
    restart = settings.get("restart_after_round")
    if restart is not None and restart < work["rounds"]:
        lines.append(
            f"Dotted line: every server is stopped and a fresh one started before round"
            f" {restart + 1}, except the floor (vLLM alone with room for every history)."
        )
    return title, "\n".join(lines)


#: the log axis: labelled ticks from the band a store's hit lies in (tens of milliseconds)
#: up to a prefill (seconds, tens of them on a CPU without bf16 instructions), and
#: unlabelled ones between them for the grid
LOG_TICKS = (0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0,
             15.0, 20.0, 30.0)  # fmt: skip
LOG_MINOR_TICKS = (0.06, 0.08, 0.09, 0.4, 0.6, 0.8, 0.9, 4.0, 6.0, 8.0, 9.0)
#: the linear panel shows the systems whose rounds 2+ all lie under this, or under a
#: quarter of the slowest system's (the ones that hit, on a slower machine)
ZOOM_BELOW_S = 0.5
#: the linear panel's tick steps: the finest that keeps its labels apart
ZOOM_STEPS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
STYLES = {  # colour, marker, line style: UCM's stores in blue, green and purple; the others apart
    "vllm": ("#555555", "s", "-"),
    "ucm-posix": ("#1f77b4", "o", "-"),
    "ucm-dram": ("#2ca02c", "D", "-"),
    "ucm-tiered": ("#9467bd", "^", "-"),
    "lmcache": ("#d95f02", "v", "-"),
    "offloading": ("#8c564b", "P", "-"),
    "vllm-floor": ("#000000", "x", "--"),
}


def _ms(seconds: float, _pos: object = None) -> str:
    """A time as a reader takes it in: ``70 ms``, ``1.5 s``."""
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def ttft_figure(
    series: Mapping[str, Mapping[int, float]],
    title: str,
    note: str = "",
    restart_before: int | None = None,
) -> Any:
    """A matplotlib Figure of each system's median TTFT by round (0-based rounds, drawn from
    1): every round on a log axis, and below it rounds 2+ on a linear axis for the systems
    that hit (under ``ZOOM_BELOW_S`` there), where a few milliseconds apart must be read.
    Sized for a page about 700 pixels wide: there its text is as large as the page's."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, MultipleLocator, NullFormatter

    # inches, top to bottom: title, log panel, its x label and the next title, linear panel,
    # its x label, legend, note
    width, left, right = 7.2, 1.0, 0.25
    top, panel, between, below = 0.8, 3.0, 0.8, 1.75
    height = top + panel + between + panel + below
    fig = plt.figure(figsize=(width, height), facecolor="white")
    axes_w = (width - left - right) / width

    def place(from_top: float) -> Any:
        bottom = (height - from_top - panel) / height
        return fig.add_axes((left / width, bottom, axes_w, panel / height))

    full, zoom = place(top), place(top + panel + between)
    hits: list[float] = []
    off_scale = 0
    slowest = max((v for s in series.values() for r, v in s.items() if r >= 1), default=0.0)
    zoom_below = max(ZOOM_BELOW_S, slowest / 4)
    for name, by_round in series.items():
        rounds = sorted(by_round)
        colour, marker, line = STYLES.get(name, (None, "o", "-"))
        style = {"color": colour, "marker": marker, "linestyle": line, "label": label(name)}
        full.plot([r + 1 for r in rounds], [by_round[r] for r in rounds], **style)
        after = [by_round[r] for r in rounds if r >= 1]
        if after and max(after) < zoom_below:
            zoom.plot([r + 1 for r in rounds if r >= 1], after, **style)
            hits += after
        elif after:  # named in the panel, so that its absence is not read as no data
            zoom.text(
                0.98, 0.03 + 0.07 * off_scale,
                f"{label(name)}: {_ms(min(after))} to {_ms(max(after))}, off this scale",
                transform=zoom.transAxes, ha="right", va="bottom", fontsize="small", color=colour,
            )  # fmt: skip
            off_scale += 1
    values = [v for by_round in series.values() for v in by_round.values()]
    full.set_yscale("log")
    full.set_ylim(min([0.045, *values]) * 0.95, max([2.2, *values]) * 1.05)
    full.yaxis.set_major_locator(FixedLocator(LOG_TICKS))
    full.yaxis.set_major_formatter(FuncFormatter(_ms))
    full.yaxis.set_minor_locator(FixedLocator(LOG_MINOR_TICKS))
    full.yaxis.set_minor_formatter(NullFormatter())
    full.set_title("every round (log scale)", fontsize="medium")
    step = ZOOM_STEPS[0]
    if hits:  # whole steps, at most about 16 of them, with room below for the off-scale notes
        span = max(hits) - min(hits)
        step = next((s for s in ZOOM_STEPS if span / s <= 14), ZOOM_STEPS[-1])
        low = (math.floor(min(hits) / step) - 1 - off_scale) * step
        zoom.set_ylim(max(low, 0.0), (math.ceil(max(hits) / step) + 1) * step)
    zoom.yaxis.set_major_locator(MultipleLocator(step))
    zoom.yaxis.set_major_formatter(FuncFormatter(_ms))
    zoom.set_title("rounds 2 and after, the systems that hit (linear scale)", fontsize="medium")
    for ax in (full, zoom):
        ax.set_xlabel("round")
        ax.set_ylabel("time to first token, median")
        ax.xaxis.set_major_locator(MultipleLocator(1))
        ax.grid(True, which="both", alpha=0.35)
        if restart_before is not None:
            ax.axvline(restart_before + 0.5, color="grey", linestyle=":", linewidth=1.5)
            ax.annotate(
                "restart", (restart_before + 0.5, 1.0), xycoords=("data", "axes fraction"),
                xytext=(4, -13), textcoords="offset points", color="grey", fontsize="small",
            )  # fmt: skip
    handles, labels = full.get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper center", ncol=min(len(labels), 3), frameon=False,
        bbox_to_anchor=(0.5, (below - 0.45) / height),
    )  # fmt: skip
    heading = "\n".join(textwrap.fill(line, 62) for line in title.split("\n"))
    fig.suptitle(heading, fontsize="large", y=1 - 0.12 / height, va="top")
    if note:
        lines = [textwrap.fill(part, 96) for part in note.split("\n")]
        fig.text(0.5, 0.1 / height, "\n".join(lines), ha="center", va="bottom",
                 fontsize="small", color="#333333")  # fmt: skip
    return fig


def plot_ttft_by_round(
    series: Mapping[str, Mapping[int, float]],
    path: str,
    title: str,
    restart_before: int | None,
    note: str = "",
) -> None:
    """A PNG of each system's median time to first token by round (see ``ttft_figure``)."""
    import matplotlib.pyplot as plt

    fig = ttft_figure(series, title, note, restart_before)
    fig.savefig(path, dpi=150, facecolor="white")
    plt.close(fig)


def plot_report(report: Mapping[str, Any], path: str, machine: str | None = None) -> None:
    """The plot of a benchmark's report (as ``bench_serve`` writes it, or read back from its
    JSON, whose round numbers are strings)."""
    series = {
        name: {int(r): float(v) for r, v in by_round.items()}
        for name, by_round in report["ttft_p50_by_round"].items()
    }
    title, note = caption(report, machine)
    plot_ttft_by_round(series, path, title, report["settings"].get("restart_after_round"), note)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Re-render the TTFT-by-round plot of a stored bench_serve report."
    )
    p.add_argument("--plot-from", required=True, help="a report bench_serve wrote (--json)")
    p.add_argument("--plot", required=True, help="the PNG to write")
    p.add_argument(
        "--machine", default=None, help="the machine it ran on, where the report has none"
    )
    args = p.parse_args(argv)
    report = read_report(p, args.plot_from, "bench_serve", "ttft_p50_by_round")
    plot_report(report, args.plot, args.machine)
    return 0


def read_report(p: argparse.ArgumentParser, path: str, writer: str, key: str) -> dict[str, Any]:
    """The report at ``path`` that ``writer`` wrote (``--json``), one with ``key``; where it
    is not, ``p``'s error names the file and what is wrong."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        p.error(f"cannot read {path}: {exc}")
    if not isinstance(report, dict) or key not in report:
        p.error(f"{path}: not a {writer} report (no {key})")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
