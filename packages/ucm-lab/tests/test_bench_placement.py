"""``bench_placement`` end to end, small: every case runs in a worker bound as vLLM binds
one, the spare case's store threads are on another CPU, every dump is stored, and no store
is left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ucm.lab.vllm.bench_placement import main


def test_a_small_run_reports_every_case(capsys):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    before = set(Path("/dev/shm").glob("ucm-bench-placement-*"))
    argv = ["--store", "dram", "--steps", "4", "--step-mib", "1", "--rounds", "1",
            "--hidden", "128", "--tokens", "16", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["all_ok"] and set(report["steps_s"]) == {"alone", "inherit", "spare"}
    assert report["store_cpus_spare"] not in ("as the worker", report["computing"])
    assert report["alone_over_inherit"] > 0 and report["alone_over_spare"] > 0
    assert set(Path("/dev/shm").glob("ucm-bench-placement-*")) == before
