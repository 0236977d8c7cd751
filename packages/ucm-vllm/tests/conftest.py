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


@pytest.fixture(scope="module")
def prompts():
    """Three prompts sharing a 1000-token prefix (a module may define its own)."""
    from ucm.lab.testing.vllm.engine import shared_prefix_prompts

    return shared_prefix_prompts(3, prefix=1000, tail=100)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """vLLM alone on ``prompts``, one request at a time: the oracle of a module's runs."""
    from ucm.lab.testing.vllm.engine import run_engine

    return run_engine({"model": tiny_model, "prompts": prompts})


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
