from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def weights_digest_cache(tmp_path_factory):
    """The engines' cache of weights digests, in the test run's own folder (inherited by
    the engine processes)."""
    import os

    os.environ["UCM_CACHE_DIR"] = str(tmp_path_factory.mktemp("ucm_cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from ucm.lab.testing.vllm.models import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny_llama"))


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a fresh tmpfs mounted under tmp_path (a real small or read-only
    filesystem); skips where mounting is not permitted."""
    import os
    import shutil
    import subprocess

    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command here")
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not os.path.ismount(mnt):
            pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
