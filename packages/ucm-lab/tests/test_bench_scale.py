"""``ucm bench scale`` end to end on a small store: both cases run, the full one evicts,
and nothing is left behind."""

from __future__ import annotations

import json

from ucm.lab.core.bench_scale import main


def test_a_small_scale_run_reports_both_stores_and_cleans_up(tmp_path, capsys):
    assert main(["--blocks", "3000", "--dumps", "640", "--path", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["empty"]["evicted"] == 0 and report["full"]["evicted"] > 0
    assert report["full"]["blocks_after"] <= 3000  # held at its capacity
    for row in ("dump_batch_p99_ms", "lookup_512_p50_ms", "peak_rss_mib", "first_dump_s"):
        assert row in out
    assert list(tmp_path.iterdir()) == []  # the run's stores are removed
