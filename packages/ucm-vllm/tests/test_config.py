import os
import subprocess
import sys

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


# -- a store kind from another distribution ----------------------------------------------

PLUGIN = '''
import attrs
from ucm.core.settings import one_of, setting, size_gib
from ucm.core.store.kinds import StoreSettings
from ucm.core.store.dram import DramStore, DramStoreConfig


@attrs.frozen
class MemoSettings(StoreSettings):
    """A store kind of a throwaway distribution: this process's memory, under its own name."""

    STORE = "ucm_memo:open_memo"
    kind: str = setting("Store kind.", default="memo", validator=one_of("memo"))
    capacity_gb: float = setting("GiB.", default=0.01, validator=size_gib)


def open_memo(settings):
    return DramStore(DramStoreConfig(scope="process", capacity_gb=settings.capacity_gb))
'''

USE = """
import numpy as np
from ucm.core.config import kind_names
from ucm.core.settings import ConfigError
from ucm.core.store import create_store
from ucm.vllm.config import connector_config
from ucm.vllm.stores import ConnectorStores
from ucm_memo import MemoSettings

config = connector_config({"store": {"kind": "memo", "capacity_gb": 0.02}})
assert config.store == MemoSettings(capacity_gb=0.02), config.store
assert "memo" in kind_names()
stores = ConnectorStores.open(config.store, hybrid=False, wa_fraction=0.5)
key, block = b"k" * 16, np.arange(4096, dtype=np.uint8)
store = stores.full
assert store.wait(store.dump([key], [block]))[0].ok and store.lookup([key]) == [True]
out = np.zeros_like(block)
assert store.wait(store.load([key], [out]))[0].ok and (out == block).all()
try:  # a kind that does not say how to split refuses a hybrid model by name
    ConnectorStores.open(config.store, hybrid=True, wa_fraction=0.5)
except ConfigError as exc:
    assert "a memo store cannot hold a hybrid model" in str(exc), exc
else:
    raise AssertionError("a hybrid model was given a store that cannot split")
try:  # its settings are checked as UCM's own are
    connector_config({"store": {"kind": "memo", "capacity_gb": "big"}})
except ConfigError as exc:
    assert str(exc).startswith("kv_connector_extra_config.store.capacity_gb"), exc
else:
    raise AssertionError("bad settings of a plug-in kind were taken")
print("used")
"""


def test_a_store_kind_from_another_distribution_is_named_in_vllms_config(tmp_path):
    # a distribution as pip installs one: the module and a .dist-info naming its kind in the
    # ucm.stores entry points; nothing of UCM's is told about it
    site = tmp_path / "site"
    site.mkdir()
    (site / "ucm_memo.py").write_text(PLUGIN)
    info = site / "ucm_memo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ucm-memo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ucm.stores]\nmemo = ucm_memo:MemoSettings\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", USE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "used", done.stderr[-3000:]
    # without the distribution the kind is unknown, and the error says how kinds are added
    with pytest.raises(ConfigError, match="ucm.stores entry points"):
        connector_config({"store": {"kind": "memo"}})
