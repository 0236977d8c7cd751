"""The figure of a ``bench_peer`` report: each system's time to first token over the
floor's, p50 / p90 / p99, a panel per prefix length and concurrency, with the floor (1.0)
and the 1.1x a store must stay within.  Pure, but for the figure (matplotlib, the lab's
``plot`` extra).  Drawn from a stored report, without running the benchmark again::

    python -m ucm.lab.vllm.peer_plot --plot-from docs/bench_peer.json \\
        --plot docs/img/bench_peer.png
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ucm.lab.vllm.serve_report import PERCENTILES, STYLES, label, read_report

#: what a store must stay within, over the floor (issue 44's target)
TARGET = 1.1
#: the cold system is 10-100x the floor: drawn, it would flatten every other bar
OFF_SCALE = ("vllm",)


def cells(
    report: Mapping[str, Any],
) -> dict[tuple[int, int], dict[str, tuple[float, ...]]]:
    """``(length, concurrency)`` -> system -> its ratios to the floor at ``PERCENTILES``,
    in the order the report has them, the cold system left out (see ``off_scale``)."""
    out: dict[tuple[int, int], dict[str, tuple[float, ...]]] = {}
    for row in report["against_vllm-floor"]:
        if row["system"] in OFF_SCALE:
            continue
        out.setdefault((row["length"], row["concurrency"]), {})[row["system"]] = _ratios(row)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def off_scale(report: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """The systems left out of the panels: the least and the most of their ratios."""
    seen: dict[str, list[float]] = {}
    for row in report["against_vllm-floor"]:
        if row["system"] in OFF_SCALE:
            seen.setdefault(row["system"], []).extend(_ratios(row))
    return {name: (min(v), max(v)) for name, v in seen.items()}


def _ratios(row: Mapping[str, Any]) -> tuple[float, ...]:
    return tuple(float(row[f"ttft_p{p}_s"]) for p in PERCENTILES)


def caption(report: Mapping[str, Any]) -> tuple[str, str]:
    """The figure's title and the note under it: what ran, where, and what is off scale."""
    s = report["settings"]
    title = "Time to first token over vLLM's own cache (the floor), by vLLM's own client"
    layers = s.get("model", {}).get("num_hidden_layers")
    ran = (
        f"{s['prefixes']} prompts a length, a {s['suffix']}-token suffix each, "
        f"{s['rounds']} rounds a cell, each beside one of the floor's; "
        + (f"a model of {layers} layers" if layers else "the model") + f" in {s['dtype']}"
        + (f", on {s['machine']}" if s.get("machine") else "")
    )  # fmt: skip
    far = "; ".join(f"{label(n)}: {lo:.0f}-{hi:.0f}x, off this scale"
                    for n, (lo, hi) in off_scale(report).items())  # fmt: skip
    return title, ran + (f"\n{far}" if far else "")


def peer_figure(report: Mapping[str, Any]) -> Any:
    """A matplotlib Figure of :func:`cells`: a row of panels per concurrency, a panel per
    prefix length; in each, a system's three bars (p50, p90, p99, lighter to darker) in its
    colour.  Sized for a page about 700 pixels wide."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_cell = cells(report)
    lengths = sorted({n for n, _ in by_cell})
    flights = sorted({c for _, c in by_cell})
    systems = list(dict.fromkeys(name for cell in by_cell.values() for name in cell))
    top = max((v for cell in by_cell.values() for r in cell.values() for v in r), default=1.0)
    y_max = max(2.0, math.ceil(top * 1.05 / 0.25) * 0.25)
    fig, axes = plt.subplots(
        len(flights), len(lengths), figsize=(7.2, 1.1 + 2.5 * len(flights) + 1.2),
        sharey=True, squeeze=False, facecolor="white",
    )  # fmt: skip
    width = 0.8 / len(PERCENTILES)
    shades = (0.45, 0.7, 1.0)  # p50 light, p99 dark
    for i, flight in enumerate(flights):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            cell = by_cell.get((length, flight), {})
            for x, name in enumerate(systems):
                colour = STYLES.get(name, (None,))[0]
                for k, value in enumerate(cell.get(name, ())):
                    ax.bar(x + (k - 1) * width, value, width, color=colour, alpha=shades[k],
                           edgecolor="white", linewidth=0.3)  # fmt: skip
            ax.axhline(1.0, color="black", linewidth=1.0)
            ax.axhline(TARGET, color="#b00000", linestyle="--", linewidth=1.0)
            ax.set_ylim(0, y_max)
            ax.set_xticks(range(len(systems)))
            ax.set_xticklabels([])
            ax.grid(True, axis="y", alpha=0.35)
            ax.set_title(f"{length:,} tokens, {flight} in flight", fontsize="medium")
            if j == 0:
                ax.set_ylabel("TTFT / floor's")
    handles = [Patch(color=STYLES.get(n, (None,))[0], label=label(n)) for n in systems]
    handles += [
        Patch(facecolor="grey", alpha=a, label=f"p{p}") for a, p in zip(shades, PERCENTILES)
    ]
    handles.append(plt.Line2D([], [], color="#b00000", linestyle="--", label=f"{TARGET}x"))
    title, note = caption(report)
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False,
               bbox_to_anchor=(0.5, 0.07), fontsize="small")  # fmt: skip
    fig.suptitle(textwrap.fill(title, 62), fontsize="large")
    fig.text(0.5, 0.01, "\n".join(textwrap.fill(line, 120) for line in note.split("\n")),
             ha="center", va="bottom", fontsize="x-small", color="#333333")  # fmt: skip
    fig.subplots_adjust(left=0.1, right=0.98, top=0.88, bottom=0.2, hspace=0.35, wspace=0.08)
    return fig


def plot(report: Mapping[str, Any], path: str) -> None:
    """A PNG of :func:`peer_figure` at ``path``."""
    import matplotlib.pyplot as plt

    fig = peer_figure(report)
    fig.savefig(path, dpi=150, facecolor="white")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Draw the figure of a stored bench_peer report.")
    p.add_argument("--plot-from", required=True, help="a report bench_peer wrote (--json)")
    p.add_argument("--plot", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    report = read_report(p, args.plot_from, "bench_peer", "against_vllm-floor")
    if not cells(report):
        p.error(f"{args.plot_from}: no system was run beside the floor")
    plot(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
