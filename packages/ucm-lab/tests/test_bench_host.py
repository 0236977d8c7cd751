"""``bench_host`` end to end, small: both cases run every block through the GPU route's host
calls (a run that lost a block raises; the FastDeploy run crosses a slice), the device's
work is back afterwards, and no shared memory is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ucm.kernels import staging
from ucm.lab.kernels.bench_host import main


def test_a_small_run_reports_both_cases_and_leaves_nothing_behind(capsys):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    pytest.importorskip("ucm.fastdeploy")
    before = set(Path("/dev/shm").glob("ucm-bench-host-*"))
    device_work = staging.execute, staging.copy_rows, staging.row_digests
    args = ["--block-kib", "512", "2048", "--mib", "64", "--batch-mib", "4", "--repeat", "1"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["block_bytes"] for row in report["rows"]] == [512 << 10, 2 << 20]
    for row in report["rows"]:
        assert row["fastdeploy"]["blocks"] == (64 << 20) // row["block_bytes"]
        assert row["worker"]["blocks"] == (4 << 20) // row["block_bytes"]
        for way in ("write", "read"):
            assert row["fastdeploy"][f"{way}_gbps"] > 0
        for way in ("dump", "load"):
            assert row["worker"][f"{way}_gbps"] > 0
    assert (staging.execute, staging.copy_rows, staging.row_digests) == device_work
    assert set(Path("/dev/shm").glob("ucm-bench-host-*")) == before


def test_a_block_of_part_tokens_is_refused():
    with pytest.raises(SystemExit):
        main(["--block-kib", "100"])
