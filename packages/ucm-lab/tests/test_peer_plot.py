"""The figure of a bench_peer report: what it draws from the report, and the figure itself
where matplotlib is installed."""

from __future__ import annotations

import json

import pytest
from ucm.lab.vllm import peer_plot


def _row(system, length, concurrency, p50, p90=None, p99=None):
    return {"system": system, "length": length, "concurrency": concurrency,
            "ttft_p50_s": p50, "ttft_p90_s": p90 or p50, "ttft_p99_s": p99 or p50}  # fmt: skip


def _report():
    return {
        "settings": {"prefixes": 8, "suffix": 64, "rounds": 3, "dtype": "bfloat16",
                     "machine": "2-CPU test host"},
        "against_vllm-floor": [
            _row("vllm", 512, 1, 9.0, 8.7, 8.4), _row("ucm-dram", 512, 1, 0.7, 0.7, 0.8),
            _row("lmcache", 512, 1, 1.0, 1.1, 1.2), _row("ucm-dram", 512, 4, 0.5),
            _row("vllm", 2048, 4, 31.0, 40.0, 106.5), _row("ucm-dram", 2048, 1, 0.6),
        ],
    }  # fmt: skip


def test_each_cell_holds_each_system_but_the_cold_one_in_order_of_concurrency_then_length():
    got = peer_plot.cells(_report())
    assert list(got) == [(512, 1), (2048, 1), (512, 4)]
    assert got[(512, 1)] == {"ucm-dram": (0.7, 0.7, 0.8), "lmcache": (1.0, 1.1, 1.2)}
    assert "vllm" not in {name for cell in got.values() for name in cell}


def test_the_note_says_what_is_off_the_scale_and_where_it_ran():
    assert peer_plot.off_scale(_report()) == {"vllm": (8.4, 106.5)}
    title, note = peer_plot.caption(_report())
    assert "floor" in title
    assert "on 2-CPU test host" in note and "vLLM alone: 8-106x, off this scale" in note


def test_a_report_without_runs_beside_the_floor_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"settings": {}}))
    with pytest.raises(SystemExit):
        peer_plot.main(["--plot-from", str(path), "--plot", str(tmp_path / "p.png")])
    assert "not a bench_peer report" in capsys.readouterr().err


def test_the_figure_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "peer.png"
    peer_plot.plot(_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
