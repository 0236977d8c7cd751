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


@pytest.fixture
def shm_dir():
    """A fresh folder in /dev/shm (a host-scope dram store's medium), removed afterwards;
    skips where the host has no shared-memory filesystem."""
    import shutil
    import uuid

    from ucm.core.store.shm import MEMORY_FILESYSTEMS, mount_of

    found = mount_of("/dev/shm") if Path("/dev/shm").is_dir() else None
    if found is None or found[1] not in MEMORY_FILESYSTEMS:
        pytest.skip("no memory filesystem at /dev/shm")
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
