"""The benchmark runs end to end on small shapes and prints its JSON last."""

from __future__ import annotations

import json
from pathlib import Path

from ucm.core.store.posix import scan_store
from ucm.lab.fastdeploy.bench import main


def test_quick_bench_prints_json_last(tmp_path, capsys):
    store_path = str(tmp_path / "bench")
    assert main(["--quick", "--json", "--path", store_path]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for key in ("write_ratio", "read_ratio", "slice_ratio", "raw_write_gbps", "write_gbps",
                "sliced_write_gbps"):  # fmt: skip
        assert summary[key] > 0
    assert summary["blocks"] == 16 and summary["target_ratio"] == 0.85
    # one timed round (--quick): every case has one time, and a round's ratio is its median
    assert all(len(t) == 1 for t in summary["seconds"].values())
    raw, write = summary["seconds"]["raw_write"][0], summary["seconds"]["write"][0]
    assert abs(summary["write_ratio_median"] - raw / write) < 1e-9
    assert any(line.startswith("write / raw:") for line in out)
    # every round removes what it wrote: the page cache and the disk are left as found
    assert scan_store(f"{store_path}/posix").blocks == []
    assert not (Path(store_path) / "raw" / "raw.bin").exists()
