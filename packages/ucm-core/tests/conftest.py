"""Fixtures of ucm-core's tests (the Mooncake ones come from ucm.lab's pytest plugin)."""

from pathlib import Path

import pytest


@pytest.fixture
def shm_dir():
    """A fresh folder in /dev/shm (a host-scope dram store's medium), removed afterwards;
    skips where the host has no shared-memory filesystem."""
    import shutil
    import uuid

    from ucm.core.store.dram.shared import MEMORY_FILESYSTEMS, mount_of

    found = mount_of("/dev/shm") if Path("/dev/shm").is_dir() else None
    if found is None or found[1] not in MEMORY_FILESYSTEMS:
        pytest.skip("no memory filesystem at /dev/shm")
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
