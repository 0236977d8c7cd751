"""The stores' fault harness, a short run (10 s; ``nox -s stress`` runs it for 10 minutes):
every rule it checks holds while processes are killed, stopped and resumed and bytes are
flipped."""

from __future__ import annotations

import pytest
from ucm.lab.core.stress import failures, run


@pytest.mark.stress
def test_a_short_run_of_the_fault_harness_finds_nothing_wrong(shm_dir):
    summary = run(seconds=10, seed=7, workers=4, folder=None, lease_s=0.5)
    assert failures(summary) == [], summary
    # it did what it says: every kind of operation and fault happened
    assert summary["kills"] and summary["stops"], summary
    assert summary["dram_flips"] + summary["posix_flips"], summary
    ops = summary["by_op"]
    for op in ("dram_dump", "dram_load", "dram_writes", "dram_reads", "posix_dump", "posix_load"):
        assert ops.get(op), (op, ops)
