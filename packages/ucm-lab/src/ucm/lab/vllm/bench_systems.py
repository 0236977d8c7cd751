"""The systems ``bench_serve`` compares, and how each is started.

A system is what a ``vllm serve`` is given to make it that system (its
``--kv-transfer-config``), the interpreter that runs it (LMCache lives in an environment of
its own, so that its pins never decide ours), and a service it needs beside it for the whole
run (LMCache's cache server), which outlives the vLLM restart as a store does.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
from ucm.lab.daemon import Daemon, free_port
from ucm.lab.vllm.serve_process import connector_config

SYSTEMS = ("vllm", "ucm-posix", "ucm-dram", "ucm-tiered", "lmcache", "offloading", "vllm-floor")

#: what every system's processes get: no usage reports (nothing leaves this host)
QUIET_ENV = {
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
}

#: host memory every system that keeps KV in host memory may use
HOST_CACHE_GB = 4
#: where this run's host-memory stores live (one folder per system)
HOST_STORES = f"/dev/shm/ucm-bench-{os.getpid()}"


@attrs.frozen
class System:
    """How to start one system under test."""

    name: str
    serve_args: list[str]  # added to the common ``vllm serve`` arguments
    python: str = sys.executable  # the interpreter ``vllm serve`` runs on
    sidecar: Sidecar | None = None  # started before the first server, stopped after the last
    # vLLM alone with room for every history and no restart: its own prefix cache then hits
    # wherever any store could, at no transfer cost, the floor no store can go under
    floor: bool = False
    # where the system's store keeps blocks on disk: a run warms their page cache first
    # (a disk store is measured "on a warm page cache": ucm.lab.page_cache)
    disk: str | None = None


class Sidecar(Protocol):
    """A service a system needs beside ``vllm serve`` for the whole run."""

    command: list[str]

    def start(self) -> None: ...

    def stop(self) -> None: ...


class LMCacheServer(Daemon):
    """``lmcache server`` (LMCache's multi-process mode, the one that serves vLLM on the CPU)
    with its L1 cache in shared memory, as LMCache advises for the fastest transfers: the
    engine's workers copy blocks to and from that segment themselves (``engine_driven``)."""

    def __init__(
        self, python: str, log_path: str, chunk_tokens: int, l1_gb: int = HOST_CACHE_GB
    ) -> None:
        super().__init__(log_path=log_path, env=QUIET_ENV)
        self.shm_name = f"ucm-bench-lmcache-{os.getpid()}"
        self.command = [
            str(Path(python).parent / "lmcache"), "server",
            "--host", self.host, "--port", str(self.port),
            "--http-host", self.host, "--http-port", str(free_port()),
            "--chunk-size", str(chunk_tokens), "--l1-size-gb", str(l1_gb),
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name,
        ]  # fmt: skip

    def _command(self) -> list[str]:
        return self.command

    def connector(self) -> dict[str, Any]:
        """``--kv-transfer-config`` of the vLLM servers that use this cache server: LMCache's
        own connector module (the one released with the server)."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{self.host}",
                "lmcache.mp.port": self.port,
            },
        }

    def start(self, timeout: float = 180.0) -> LMCacheServer:
        return super().start(timeout)

    def stop(self) -> None:
        super().stop()
        # the L1 segment outlives the server unless removed
        Path("/dev/shm", f"lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)


def make_system(
    name: str,
    work: str,
    block_tokens: int,
    chunk_tokens: int,
    lmcache_python: str | None = None,
    store_cpus: str = "spare",
    ucm_settings: Mapping[str, Any] | None = None,
) -> System:
    """``name``'s system, its files under ``work``; ``block_tokens``: UCM's stored block,
    ``chunk_tokens``: LMCache's chunk, in tokens (each store's hits come in these);
    ``store_cpus``: where UCM's store threads run; ``ucm_settings``: more of UCM's
    settings (``kv_connector_extra_config``)."""
    if name == "vllm":
        return System(name, [])
    if name == "vllm-floor":
        return System(name, [], floor=True)
    if name.startswith("ucm-"):
        store = _ucm_store(name[len("ucm-") :], work)
        settings = {"block_tokens": block_tokens, "store_cpus": store_cpus, **(ucm_settings or {})}
        config = connector_config(store, settings)
        on_disk = store.get("backing", store)
        disk = on_disk["path"] if on_disk.get("kind") == "posix" else None
        return System(name, ["--kv-transfer-config", config], disk=disk)
    if name == "lmcache":
        if lmcache_python is None:
            raise ValueError(
                "system 'lmcache' needs an environment with LMCache (--lmcache-python; "
                "nox -s bench_serve builds one)"
            )
        log = os.path.join(work, "lmcache-server.log")
        server = LMCacheServer(lmcache_python, log, chunk_tokens)
        args = ["--kv-transfer-config", json.dumps(server.connector())]
        return System(name, args, python=lmcache_python, sidecar=server)
    if name == "offloading":
        config = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": HOST_CACHE_GB << 30},
        }
        return System(name, ["--kv-transfer-config", json.dumps(config)])
    raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")


def run_each(
    names: Sequence[str], work: str, args: Any, run: Callable[[System], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Each system of ``names`` made (``make_system`` with ``args``' block_tokens,
    lmcache_chunk_tokens, lmcache_python, store_cpus and ucm_settings where it has them)
    and run by ``run``, in order: name -> its result, or why it was refused."""
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"[{name}]", file=sys.stderr)
        try:
            system = make_system(
                name, work, args.block_tokens, args.lmcache_chunk_tokens, args.lmcache_python,
                args.store_cpus, getattr(args, "ucm_settings", None),
            )  # fmt: skip
        except ValueError as exc:
            results[name] = {"system": name, "refused": str(exc)}
            continue
        results[name] = run(system)
    return results


def _ucm_store(kind: str, work: str) -> Mapping[str, Any]:
    """A store of the system's own: no system may find blocks another one stored."""
    posix = {"kind": "posix", "path": os.path.join(work, f"ucm-{kind}-posix")}
    dram = {"path": f"{HOST_STORES}-{kind}", "capacity_gb": HOST_CACHE_GB}
    if kind == "posix":
        return posix
    if kind == "dram":
        return {"kind": "dram", **dram}
    if kind == "tiered":
        return {"kind": "tiered", "dram": dram, "backing": posix}
    raise ValueError(f"unknown system 'ucm-{kind}'; known: {', '.join(SYSTEMS)}")


def remove_host_stores() -> None:
    """What the UCM systems left in shared memory."""
    for path in glob.glob(f"{HOST_STORES}-*"):
        shutil.rmtree(path, ignore_errors=True)


def describe(system: System, common: Sequence[str]) -> dict[str, Any]:
    """What was run, for the report: the serve command's arguments, the sidecar's command."""
    out: dict[str, Any] = {"python": system.python, "serve_args": [*common, *system.serve_args]}
    if system.sidecar is not None:
        out["sidecar"] = system.sidecar.command
    return out
