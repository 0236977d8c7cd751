import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session", autouse=True)
def weights_digest_cache(tmp_path_factory):
    """The engines' cache of weights digests, in the test run's own folder (inherited by
    the engine processes)."""
    import os

    os.environ["UCM_CACHE_DIR"] = str(tmp_path_factory.mktemp("ucm_cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from models import make_tiny_llama

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


def _cannot_make_cluster() -> str | None:
    from ucm.core.netlab import unavailable

    try:
        import mooncake.store  # noqa: F401
        from ucm.core.store.mooncake_master import master_binary

        master_binary()
        master_binary("mooncake_client")
    except (ImportError, OSError) as exc:
        return f"Mooncake's client is not installed (pip install 'ucm-core[mooncake]'): {exc}"
    reason = unavailable()
    return None if reason is None else f"cannot make hosts as network namespaces: {reason}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Hosts m, a and b (network namespaces on a bridge): a mooncake_master and a segment
    server (the pool's memory, so that blocks outlive the engine that wrote them) on m;
    yields (lab, master, segment server)."""
    reason = _cannot_make_cluster()
    if reason:
        pytest.skip(reason)
    from ucm.core.netlab import NetLab
    from ucm.core.store.mooncake_master import LocalMaster, SegmentServer

    logs = tmp_path_factory.mktemp("cluster")
    with NetLab(["m", "a", "b"]) as lab:
        master = LocalMaster(
            lab.address("m"), netns=lab.namespace("m"), log_path=str(logs / "master.log")
        ).start()
        segment = SegmentServer(
            master.address, 512, lab.address("m"), netns=lab.namespace("m"),
            log_path=str(logs / "segment.log"),
        ).start()  # fmt: skip
        try:
            yield lab, master, segment
        finally:
            segment.stop()
            master.stop()
