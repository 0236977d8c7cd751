"""``bench_tier`` end to end on the CPU, small: every case runs, a round trip through the
tier in place equals the cache, and no shared memory is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ucm.lab.kernels.bench_tier import main


def test_a_small_run_reports_every_case_and_leaves_no_arena(capsys):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    before = set(Path("/dev/shm").glob("ucm-bench-tier-*"))
    assert main(["--device", "cpu", "--total-mib", "4", "--repeat", "1", "--json", "--stages"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert [c["block_bytes"] for c in report["cases"]] == [256 << 10, 2 << 20]
    for case in report["cases"]:
        assert not case["registered"]  # nothing to register on a CPU
        assert {"d2h", "h2d", "dump", "load"} <= set(case["ratios"])
        assert {"dump_digested_over_pinned", "load_checked_over_pinned"} <= set(case["ratios"])
        assert all(v > 0 for v in case["gb_s"].values())
        assert {"copy alone", "copy and digest", "commit (book)", "checked load"} <= set(
            case["stages_ms"]
        )
    assert "slots out of order" in out
    assert set(Path("/dev/shm").glob("ucm-bench-tier-*")) == before
