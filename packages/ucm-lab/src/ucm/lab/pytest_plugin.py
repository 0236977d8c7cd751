"""The pytest plugin every package's tests share (loaded through the ``pytest11`` entry
point wherever ucm-lab is installed): the markers, the fixtures that start something
outside the test process, and ``shm_dir`` (a fresh folder in /dev/shm).

Markers (``-m "not engine"`` and so on; the quick tier deselects the first three):

- ``engine``: runs a real engine (vLLM or a server), seconds to minutes a test;
- ``root``: needs root (network namespaces, mounts);
- ``mooncake``: needs Mooncake's client and daemons;
- ``stress``: many thousands of operations or random kills, tens of seconds: the code they
  drive is the interpreter-independent code that quicker tests cover, so ``nox -s tests``
  runs them on the main Python only.

Every test also gets the marker of the distribution whose ``tests`` folder holds it:
``ucm_core``, ``ucm_kernels``, ``ucm_vllm``, ``ucm_fastdeploy``, ``ucm_lab`` (``nox -s
tests`` runs ucm-core's every-Python tests on other Pythons than the rest with
``-m "not (ucm_core and not root and not stress)"``).

Tests that use a fixture below get its marker without writing it.  Where Mooncake is
missing, its tests skip, except under ``UCM_REQUIRE_MOONCAKE=1`` (what the nox sessions
set): there they fail, so a CI machine without Mooncake cannot pass by skipping them.

Run side by side (pytest-xdist, ``-n``, a module to a worker), each worker's engines
compute on a core of their own (``VLLM_CPU_OMP_THREADS_BIND``), so that two engines never
share one: vLLM CPU computes on one thread either way, and outputs compared within a module
come from one worker.  Tests that run engines go first, the quick ones fill the gaps at the
end.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MARKERS = {
    "engine": "runs a real engine (vLLM, a vLLM server): slow",
    "root": "needs root (network namespaces, mounts)",
    "mooncake": "needs Mooncake's client and daemons",
    "stress": "thousands of operations or random kills: runs on the main Python only",
}
# the distributions, each marking the tests of its ``packages/<name>/tests`` folder
DISTRIBUTIONS = ("ucm-core", "ucm-kernels", "ucm-vllm", "ucm-fastdeploy", "ucm-lab")
# fixture -> the markers a test using it gets
FIXTURE_MARKERS = {
    "mooncake_master": ("mooncake",),
    "mooncake_pool": ("mooncake",),
    "mooncake_hosts": ("mooncake", "root"),
    "mooncake_ha_hosts": ("mooncake", "root"),
    "tmpfs": ("root",),
}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    for name in DISTRIBUTIONS:
        config.addinivalue_line("markers", f"{name.replace('-', '_')}: a test of {name}")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


def distribution_marker(path: Path) -> str | None:
    """The marker of the distribution whose tests ``path`` is among (``.../packages/ucm-core
    /tests/test_x.py``: ``ucm_core``), or None."""
    parts = path.parts
    for at in range(len(parts) - 3, -1, -1):
        if parts[at] == "packages" and parts[at + 1] in DISTRIBUTIONS and parts[at + 2] == "tests":
            return parts[at + 1].replace("-", "_")
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marker = distribution_marker(item.path)
        if marker is not None:
            item.add_marker(marker)
        for fixture in getattr(item, "fixturenames", ()):
            for marker in FIXTURE_MARKERS.get(fixture, ()):
                item.add_marker(marker)
    # the long ones first (a stable sort: each module's own order is kept)
    items.sort(key=lambda item: item.get_closest_marker("engine") is None)


def mooncake_missing(*binaries: str) -> str | None:
    """Why Mooncake cannot run here (its client, or one of ``binaries``), or None."""
    try:
        import mooncake.store  # noqa: F401
        from ucm.lab.mooncake import master_binary

        for binary in binaries or ("mooncake_master",):
            master_binary(binary)
    except (ImportError, OSError) as exc:
        return f"Mooncake's client is not installed (pip install 'ucm-core[mooncake]'): {exc}"
    return None


def require_mooncake(*binaries: str) -> None:
    """Skip the calling test where Mooncake is missing, or fail it under
    ``UCM_REQUIRE_MOONCAKE=1``."""
    reason = mooncake_missing(*binaries)
    if reason is None:
        return
    if os.environ.get("UCM_REQUIRE_MOONCAKE") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def require_namespaces() -> None:
    """Skip the calling test where network namespaces cannot be made (not root, no ip)."""
    from ucm.lab.netlab import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"cannot make hosts as network namespaces: {reason}")


def require_etcd() -> None:
    """Skip the calling test where etcd is missing (highly available masters elect their
    leader through it), or fail it under ``UCM_REQUIRE_MOONCAKE=1``."""
    from ucm.lab.mooncake import etcd_binary

    try:
        etcd_binary()
    except FileNotFoundError as exc:
        if os.environ.get("UCM_REQUIRE_MOONCAKE") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh folder in /dev/shm (a host-scope dram store's medium), removed afterwards;
    skips where the host has no shared-memory filesystem."""
    from ucm.core.store.dram.shared import MEMORY_FILESYSTEMS, mount_of

    found = mount_of("/dev/shm") if Path("/dev/shm").is_dir() else None
    if found is None or found[1] not in MEMORY_FILESYSTEMS:
        pytest.skip("no memory filesystem at /dev/shm")
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``mooncake_master`` on loopback for the session's tests (each names its keys with
    a prefix of its own); tests that kill their master start their own."""
    require_mooncake()
    from ucm.lab.mooncake import LocalMaster

    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with LocalMaster(log_path=str(log)) as master:
        yield master


@pytest.fixture(scope="session")
def mooncake_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A master and a segment server (the pool's memory, so that blocks outlive the client
    that wrote them) on loopback: (master, segment server)."""
    require_mooncake("mooncake_master", "mooncake_client")
    from ucm.lab.mooncake import LocalMaster, SegmentServer

    logs = tmp_path_factory.mktemp("mooncake_pool")
    master = LocalMaster(log_path=str(logs / "master.log"))
    with master, SegmentServer(master.address, 256, log_path=str(logs / "segment.log")) as seg:
        yield master, seg


@pytest.fixture(scope="module")
def mooncake_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    """Hosts m, a and b (network namespaces on a bridge) with a master and a segment
    server on m: (lab, master, segment server)."""
    require_mooncake("mooncake_master", "mooncake_client")
    require_namespaces()
    from ucm.lab.mooncake import LocalMaster, SegmentServer
    from ucm.lab.netlab import NetLab

    logs = tmp_path_factory.mktemp("mooncake_hosts")
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


@pytest.fixture(scope="module")
def mooncake_ha_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """Highly available Mooncake on hosts as network namespaces: etcd on e, masters on m1
    and m2 (m1 leads), a segment server on p, and host b for an engine: (lab, HaCluster)."""
    require_mooncake("mooncake_master", "mooncake_client")
    require_namespaces()
    require_etcd()
    from ucm.lab.mooncake import HaCluster
    from ucm.lab.netlab import NetLab

    logs = tmp_path_factory.mktemp("mooncake_ha_hosts")
    with NetLab(["e", "m1", "m2", "p", "b"]) as lab, HaCluster(str(logs), lab=lab) as cluster:
        yield lab, cluster
