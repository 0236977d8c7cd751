"""Fixtures shared by ucm-core's tests: a real ``mooncake_master`` for the mooncake store."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from core_helpers import mooncake_available  # noqa: E402


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """One master for the session's tests; tests that kill theirs start their own."""
    reason = mooncake_available()
    if reason:
        pytest.skip(reason)
    from ucm.core.store.mooncake_master import LocalMaster

    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with LocalMaster(log_path=str(log)) as master:
        yield master
