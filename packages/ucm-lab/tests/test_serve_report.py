"""What the serving benchmark reports, from records made by hand."""

from __future__ import annotations

import math

import pytest
from ucm.lab.vllm.serve_client import Record
from ucm.lab.vllm.serve_report import (
    markdown_table,
    percentile,
    ratios,
    summarize,
    ttft_by_round,
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
    table = markdown_table({"vllm": summarize(records)})
    assert table.splitlines()[2].startswith("| vllm | 1.000 s |")
