"""Where the settings come from: ucm_config (dict or YAML), UCM_CONFIG_FILE, defaults."""

from __future__ import annotations

import os

import pytest
from ucm.core.config import DramStoreConfig, PosixStoreConfig, default_store_path
from ucm.core.settings import ConfigError
from ucm.fastdeploy import FastDeployConfig, load_config


def test_defaults_are_the_embedded_posix_store():
    config = load_config(None, {})
    assert config == FastDeployConfig()
    assert isinstance(config.store, PosixStoreConfig)
    assert config.store.path == default_store_path()
    assert (config.slice_write.slice_blocks, config.slice_write.slice_timeout_s) == (100, 10.0)
    assert config.slice_write.total_timeout_s is None


def test_dict_yaml_path_and_env_file_agree(tmp_path):
    settings = {
        "store": {"kind": "dram", "capacity_gb": 0.5},
        "slice_write": {"slice_blocks": 8, "total_timeout_s": 12},
        "pipeline_depth": 2,
    }
    path = tmp_path / "ucm.yaml"
    path.write_text(
        "store: {kind: dram, capacity_gb: 0.5}\n"
        "slice_write: {slice_blocks: 8, total_timeout_s: 12}\n"
        "pipeline_depth: 2\n"
    )
    from_dict = load_config(settings, {})
    assert isinstance(from_dict.store, DramStoreConfig)
    assert load_config(str(path), {}) == from_dict
    assert load_config(path, {}) == from_dict
    assert load_config(None, {"UCM_CONFIG_FILE": str(path)}) == from_dict
    # config_file inside the dict, overridden key by key
    mixed = load_config({"config_file": str(path), "pipeline_depth": 3}, {})
    assert mixed.pipeline_depth == 3 and mixed.slice_write.slice_blocks == 8
    # an explicit ucm_config wins over UCM_CONFIG_FILE
    assert load_config({}, {"UCM_CONFIG_FILE": str(path)}) == FastDeployConfig()


@pytest.mark.parametrize(
    ("ucm_config", "environ", "message"),
    [
        ({"pipline_depth": 2}, {}, r"^ucm_config\.pipline_depth: unknown setting; allowed: "),
        ({"store": {"kind": "nfs"}}, {}, r"^ucm_config\.store\.kind: must be one of"),
        ({"pipeline_depth": 0}, {}, r"^ucm_config\.pipeline_depth: must be an integer"),
        ({"cancel_grace_s": "2"}, {}, r"^ucm_config\.cancel_grace_s: must be a positive"),
        ({"slice_write": 5}, {}, r"^ucm_config\.slice_write: expected a mapping"),
        (42, {}, r"^ucm_config: must be a dict of settings or the path of a YAML file"),
        ("/nonexistent/ucm.yaml", {}, r"^ucm_config: cannot read '/nonexistent/ucm.yaml'"),
        (None, {"UCM_CONFIG_FILE": "/nonexistent.yaml"}, r"^UCM_CONFIG_FILE: cannot read"),
        (None, {"UCM_CONFIG_FILE": ""}, r"^UCM_CONFIG_FILE: is set but empty"),
    ],
)
def test_bad_settings_name_the_setting(ucm_config, environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ucm_config, environ)


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("store: [unclosed\n")
    with pytest.raises(ConfigError, match=r"^ucm_config: .*is not valid YAML"):
        load_config(str(path), {})
    path.write_text("slice_write:\n  slice_blocks: -4\n")
    with pytest.raises(ConfigError, match=r"ucm_config\.slice_write\.slice_blocks"):
        load_config(str(path), {})


def test_process_environment_is_read_by_default(monkeypatch, tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text("pipeline_chunk_mb: 8\n")
    monkeypatch.setenv("UCM_CONFIG_FILE", str(path))
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "33")
    config = load_config()
    assert config.pipeline_chunk_mb == 8 and config.slice_write.slice_blocks == 33
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "0")
    with pytest.raises(ConfigError, match="^AS_WRITE_SLICE_BLOCK_NUM"):
        load_config()
    assert os.environ["AS_WRITE_SLICE_BLOCK_NUM"] == "0"


def test_a_store_that_cannot_hold_one_block_is_refused_when_built():
    from ucm.lab.testing.fastdeploy import make_store

    # 3 layers x 2 (K, V) x 1 MiB = 6 MiB a block, in a 4 MiB DRAM store
    with pytest.raises(ConfigError) as caught:
        make_store(
            "unused",
            bytes_per_shard_layer_per_block=1 << 20,
            ucm_config={"store": {"kind": "dram", "capacity_gb": 4 / 1024, "scope": "process"}},
        )
    assert caught.value.key == "store.capacity_gb"
    assert "cannot hold one block" in str(caught.value)
