"""The benchmark runs end to end on small shapes and prints its JSON last."""

from __future__ import annotations

import json

from ucm.fastdeploy.bench import main


def test_quick_bench_prints_json_last(store_path, capsys):
    assert main(["--quick", "--json", "--path", store_path]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for key in ("write_ratio", "read_ratio", "slice_ratio", "raw_write_gbps", "write_gbps"):
        assert summary[key] > 0
    assert summary["blocks"] == 16 and summary["target_ratio"] == 0.85
    assert any(line.startswith("write / raw:") for line in out)
