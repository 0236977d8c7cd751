"""What the connector says when it starts: the store it uses, and a warning outside the vLLM
releases it is tested with."""

import logging

import pytest
from ucm.vllm.support import TESTED_VLLM, loads_refused, version_warning


def test_supported_releases_start_quietly_and_others_are_warned_about():
    assert TESTED_VLLM == ("0.30", "0.31", "0.32")
    for version in ("0.30.0", "0.31.2+cpu", "0.32.1rc1", "0.33.0"):
        assert version_warning(version) is None, version
    for version in ("0.29.1", "0.34.0", "1.0.0", "unknown"):
        warning = version_warning(version)
        assert warning is not None and version in warning and "0.30 to 0.33" in warning


def test_the_scheduler_logs_that_ucm_is_active(tmp_path, caplog):
    from ucm.lab.testing.vllm.scheduler import SchedulerHarness

    transfer = {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"kind": "posix", "path": str(tmp_path / "s")}},
    }
    with caplog.at_level(logging.INFO, logger="ucm.vllm.connector"):
        SchedulerHarness.create(tmp_path, kv_transfer_config=transfer)
    active = [r.getMessage() for r in caplog.records if "UCMConnector active" in r.getMessage()]
    assert len(active) == 1 and f"posix at {tmp_path / 's'}" in active[0], active


@pytest.mark.parametrize(
    "cpu, mla, prefix_caching, refused",
    [
        (True, True, False, True),  # vLLM CPU's reference MLA backend
        (True, True, True, False),  # AMX hosts keep prefix caching: they attend to cached KV
        (True, False, False, False),  # the user turned prefix caching off; loads still work
        (False, True, False, False),  # GPUs
    ],
)
def test_loads_are_refused_only_where_the_engine_cannot_prefill_on_cached_kv(
    cpu, mla, prefix_caching, refused
):
    reason = loads_refused(cpu=cpu, mla=mla, prefix_caching=prefix_caching)
    assert (reason is not None) == refused
    if refused:
        assert "MLA" in reason and "loads none" in reason
