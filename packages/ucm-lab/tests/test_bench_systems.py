"""The serving benchmark's systems and a whole run of it, small: what each system is given,
and that the harness drives real servers to a report."""

from __future__ import annotations

import json
import sys

import pytest
from ucm.lab.vllm.bench_systems import SYSTEMS, describe, make_system
from ucm.vllm.config import connector_config


def transfer_config(system):
    args = system.serve_args
    assert args[0] == "--kv-transfer-config"
    return json.loads(args[1])


@pytest.mark.parametrize("name", ["ucm-posix", "ucm-dram", "ucm-tiered"])
def test_ucm_systems_are_settings_the_connector_accepts(name, tmp_path):
    system = make_system(name, str(tmp_path), block_tokens=64, chunk_tokens=32)
    config = transfer_config(system)
    assert (config["kv_connector"], config["kv_connector_module_path"]) == (
        "UCMConnector",
        "ucm.vllm",
    )
    settings = connector_config(config["kv_connector_extra_config"])  # validated as at start-up
    assert settings.block_tokens == 64
    assert system.python == sys.executable and system.sidecar is None and not system.floor


def test_each_ucm_system_has_stores_of_its_own(tmp_path):
    paths = {}
    for name in ("ucm-posix", "ucm-dram", "ucm-tiered"):
        store = transfer_config(make_system(name, str(tmp_path), 32, 32))
        store = store["kv_connector_extra_config"]["store"]
        tiers = [store["dram"], store["backing"]] if store["kind"] == "tiered" else [store]
        paths[name] = {tier["path"] for tier in tiers}
    assert not paths["ucm-tiered"] & (paths["ucm-posix"] | paths["ucm-dram"])
    assert not paths["ucm-posix"] & paths["ucm-dram"]


def test_vllm_alone_and_the_floor_take_no_connector():
    plain, floor = make_system("vllm", "/w", 32, 32), make_system("vllm-floor", "/w", 32, 32)
    assert plain.serve_args == floor.serve_args == []
    assert floor.floor and not plain.floor
    assert plain.disk is floor.disk is None


def test_a_system_names_its_store_s_folder_on_disk_where_it_has_one(tmp_path):
    # (a run warms that folder's page cache before timing the system: bench_peer)
    for name in ("ucm-posix", "ucm-tiered", "ucm-dram"):
        system = make_system(name, str(tmp_path), 32, 32)
        store = transfer_config(system)["kv_connector_extra_config"]["store"]
        on_disk = {"ucm-posix": store, "ucm-tiered": store.get("backing")}.get(name)
        assert system.disk == (on_disk["path"] if on_disk else None), name


def test_lmcache_runs_its_own_server_and_connector_from_its_own_environment(tmp_path):
    python = str(tmp_path / "env" / "bin" / "python")
    system = make_system(
        "lmcache", str(tmp_path), block_tokens=64, chunk_tokens=32, lmcache_python=python
    )
    assert system.python == python
    server = system.sidecar
    command = server.command
    assert command[:2] == [str(tmp_path / "env" / "bin" / "lmcache"), "server"]
    flag = dict(zip(command[2::2], command[3::2]))
    assert flag["--chunk-size"] == "32"
    assert flag["--supported-transfer-mode"] == "engine_driven"
    assert flag["--shm-name"] and flag["--host"] == "127.0.0.1"
    config = transfer_config(system)
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_extra_config"]["lmcache.mp.port"] == int(flag["--port"])
    assert describe(system, ["--a"])["sidecar"] == command


def test_lmcache_without_an_environment_and_unknown_systems_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--lmcache-python"):
        make_system("lmcache", str(tmp_path), 32, 32)
    with pytest.raises(ValueError, match="unknown system 'ucm-nvme'"):
        make_system("ucm-nvme", str(tmp_path), 32, 32)
    with pytest.raises(ValueError, match="unknown system 'sglang'"):
        make_system("sglang", str(tmp_path), 32, 32)
    assert set(SYSTEMS) >= {"vllm", "ucm-dram", "lmcache", "vllm-floor"}


@pytest.mark.engine
def test_a_small_run_reports_every_system_with_hits_after_the_restart(tmp_path, monkeypatch):
    """Real servers: UCM on dram across a restart, and the floor; the report's figures."""
    from ucm.lab.testing.zygote import forked
    from ucm.lab.vllm import bench_serve
    from ucm.lab.vllm.serve_process import ServeProcess, serve_command

    def from_the_zygote(*args, python=sys.executable, **kwargs):
        """The bench's servers as the tests' own: children of the zygote (vLLM imported)."""
        if python == sys.executable:
            kwargs["launcher"] = forked(serve_command())
        return ServeProcess(*args, python=python, **kwargs)

    monkeypatch.setattr(bench_serve, "ServeProcess", from_the_zygote)
    report_path = tmp_path / "report.json"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    code = bench_serve.main(
        [
            "--systems", "ucm-dram,vllm-floor,lmcache", "--users", "2", "--rounds", "2",
            "--system-tokens", "64", "--user-tokens", "320", "--question-tokens", "8",
            "--answer-tokens", "4", "--rate", "20", "--json", str(report_path),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(report_path.read_text())
    assert "--lmcache-python" in report["refused"]["lmcache"]
    ucm = report["rounds_after_the_first"]["ucm-dram"]
    # round 2 follows the restart: vLLM's own cache is empty, every hit comes from the store
    assert ucm["requests"] == 2 and ucm["failed"] == 0
    assert ucm["cached_tokens"] >= 2 * 384
    assert report["counters"]["ucm-dram"]["vllm:ucm_loaded_blocks_total"] >= 20
    floor = report["rounds_after_the_first"]["vllm-floor"]
    assert floor["failed"] == 0 and floor["cached_tokens"] >= 2 * 384
    assert set(report["against_vllm-floor"]) == {"ucm-dram"}
    assert len(report["records"]["ucm-dram"]) == 4
