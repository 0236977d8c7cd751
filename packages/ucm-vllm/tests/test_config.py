import pytest

pytest.importorskip("vllm")

from ucm.core.config import DramStoreConfig, PosixStoreConfig  # noqa: E402
from ucm.core.settings import ConfigError
from ucm.vllm.config import connector_config  # noqa: E402


def test_defaults_and_store():
    config = connector_config({"store": {"kind": "dram", "capacity_gb": 1}})
    assert config.store == DramStoreConfig(capacity_gb=1)
    assert config.block_tokens == 256 and config.recompute_on_load_error
    assert isinstance(connector_config(None).store, PosixStoreConfig)


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"block_tokenz": 128}, "kv_connector_extra_config.block_tokenz"),
        ({"block_tokens": 0}, "kv_connector_extra_config.block_tokens"),
        ({"load_tokens_threshold": -1}, "kv_connector_extra_config.load_tokens_threshold"),
        ({"store": {"kind": "s3"}}, "kv_connector_extra_config.store.kind"),
        (
            {"store": {"path": "/x", "capacity_gb": "big"}},
            "kv_connector_extra_config.store.capacity_gb",
        ),
        ({"model_fingerprint": ""}, "kv_connector_extra_config.model_fingerprint"),
        ({"recompute_on_load_error": "yes"}, "kv_connector_extra_config.recompute_on_load_error"),
        ({"store_cpus": "4-2"}, "kv_connector_extra_config.store_cpus"),
        ({"store_cpus": "all"}, "kv_connector_extra_config.store_cpus"),
        ({"store_cpus": 3}, "kv_connector_extra_config.store_cpus"),
        # a store private to one process: vLLM's scheduler would never see the workers' blocks
        ({"store": {"kind": "dram", "scope": "process"}}, "kv_connector_extra_config.store.scope"),
    ],
)
def test_bad_settings_name_the_key(extra, key):
    with pytest.raises(ConfigError) as info:
        connector_config(extra)
    assert str(info.value).startswith(key)


def test_config_file(tmp_path):
    f = tmp_path / "ucm.yaml"
    f.write_text("store:\n  kind: posix\n  path: /data/ucm\nblock_tokens: 512\n")
    config = connector_config({"config_file": str(f), "block_tokens": 128})
    assert config.block_tokens == 128 and config.store == PosixStoreConfig(path="/data/ucm")


def test_ucm_config_file_names_the_settings_when_the_extra_config_has_none(tmp_path, caplog):
    f = tmp_path / "ucm.yaml"
    f.write_text("block_tokens: 64\nstore: {kind: dram, capacity_gb: 1}\n")
    env = {"UCM_CONFIG_FILE": str(f)}
    config = connector_config(None, env)
    assert config.block_tokens == 64 and isinstance(config.store, DramStoreConfig)
    assert connector_config({}, env).block_tokens == 64
    # settings of its own win, and the user is told that the file is ignored
    assert connector_config({"block_tokens": 32}, env).block_tokens == 32
    assert "UCM_CONFIG_FILE" in caplog.text and "ignored" in caplog.text
    with pytest.raises(ConfigError, match="UCM_CONFIG_FILE: is set but empty"):
        connector_config(None, {"UCM_CONFIG_FILE": " "})
    with pytest.raises(ConfigError, match="no_such.yaml"):
        connector_config(None, {"UCM_CONFIG_FILE": str(tmp_path / "no_such.yaml")})
    f.write_text("block_tokenz: 64\n")
    with pytest.raises(ConfigError, match="block_tokenz: unknown setting"):
        connector_config(None, env)


def test_block_tokens_must_cover_whole_engine_blocks(tmp_path):
    from ucm.lab.testing.vllm.scheduler import full_attention_kv_cache_config, make_vllm_config
    from ucm.vllm.config import ConnectorConfig
    from ucm.vllm.layout import describe

    model = tmp_path / "m"
    model.mkdir()
    from ucm.lab.testing.vllm.models import tiny_llama_config

    (model / "config.json").write_text(__import__("json").dumps(tiny_llama_config()))
    vc = make_vllm_config(model)
    kv = full_attention_kv_cache_config(num_blocks=64, block_size=32)
    layout = describe(vc, kv, ConnectorConfig(block_tokens=256), 0, 2)
    assert layout.hybrid.blocks_per_boundary(layout.stored_groups[0].index) == 8
    assert layout.scope(layout.groups[0], 0) != layout.scope(layout.groups[0], 1)
    with pytest.raises(ValueError, match="block_tokens: 48 is not a multiple of the block size 32"):
        describe(vc, kv, ConnectorConfig(block_tokens=48), 0, 1)


def test_replicated_caches_split_their_writes_across_ranks():
    from ucm.vllm.layout import GroupLayout, ModelLayout

    def group(index, kind, replicated):
        window = 128 if kind == "window" else 0
        return GroupLayout(index, (f"l{index}",), 64, kind, replicated, "d", window_tokens=window)

    groups = (group(0, "full", True), group(1, "window", True), group(2, "full", False))
    ranks = [ModelLayout("m", 256, rank, 2, groups) for rank in range(2)]
    for key in range(6):
        # a replicated block (and the window tail that goes with it) has one writer
        assert [r.writes(groups[0], key) for r in ranks].count(True) == 1
        assert [r.writes(groups[1], key) for r in ranks] == [
            r.writes(groups[0], key) for r in ranks
        ]
        assert all(r.writes(groups[2], key) for r in ranks)  # a shard: every rank its own
    # replicated scopes are shared by every rank, sharded ones are not
    assert ranks[0].scope(groups[0], 0) == ranks[1].scope(groups[0], 1)
    assert ranks[0].scope(groups[2], 0) != ranks[1].scope(groups[2], 1)
