import os

import pytest
from ucm.core.config import (
    DramStoreConfig,
    PosixStoreConfig,
    TieredStoreConfig,
    default_store_path,
    parse_store_config,
)
from ucm.core.settings import ConfigError, load_yaml, with_config_file
from ucm.core.store import DramStore, PosixStore, SharedMemoryStore, TieredStore, create_store


def test_default_is_posix_under_xdg_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = parse_store_config(None)
    assert isinstance(config, PosixStoreConfig)
    assert config.path == os.path.join(str(tmp_path), "ucm")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_store_path() == os.path.join(os.path.expanduser("~"), ".cache", "ucm")


def test_each_kind_builds_its_store(tmp_path, shm_dir):
    posix = create_store({"kind": "posix", "path": str(tmp_path / "p"), "capacity_gb": 1})
    shared = create_store({"kind": "dram", "capacity_gb": 0.5, "path": str(shm_dir / "d")})
    private = create_store({"kind": "dram", "capacity_gb": 0.5, "scope": "process"})
    tiered = create_store(
        {"kind": "tiered", "dram": {"capacity_gb": 0.1, "path": str(shm_dir / "t")},
         "backing": {"path": str(tmp_path / "t")}}
    )  # fmt: skip
    assert isinstance(posix, PosixStore) and posix.usage().capacity_bytes == 1 << 30
    assert isinstance(shared, SharedMemoryStore) and shared.usage().capacity_bytes == 1 << 29
    assert isinstance(private, DramStore) and private.usage().capacity_bytes == 1 << 29
    assert isinstance(tiered, TieredStore)
    for store in (posix, shared, private, tiered):
        store.close()


def test_io_threads_follow_the_cores_unless_set(monkeypatch, tmp_path):
    for cores, threads in ((1, 2), (2, 2), (6, 6), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert PosixStoreConfig(path=str(tmp_path)).io_thread_count == threads
    assert PosixStoreConfig(path=str(tmp_path), io_threads=5).io_thread_count == 5
    assert parse_store_config({"path": str(tmp_path), "io_threads": None}).io_threads is None


def test_kind_defaults_to_posix(tmp_path):
    config = parse_store_config({"path": str(tmp_path)})
    assert isinstance(config, PosixStoreConfig) and config.path == str(tmp_path)


def test_tiered_nested(tmp_path):
    config = parse_store_config(
        {"kind": "tiered", "dram": {"capacity_gb": 2}, "backing": {"kind": "posix", "path": "/x"}}
    )
    assert isinstance(config, TieredStoreConfig)
    assert config.dram == DramStoreConfig(capacity_gb=2)
    assert config.backing == PosixStoreConfig(path="/x")


INVALID = [
    ({"kind": "nfs"}, "store.kind", "dram, mooncake, posix, tiered"),
    ({"kind": 3}, "store.kind", "must be one of"),
    ({"kind": None}, "store.kind", "must be one of"),
    ({"kind": "posix", "pathh": "/x"}, "store.pathh", "allowed: capacity_gb"),
    ({"kind": "posix", "path": ""}, "store.path", "non-empty"),
    ({"kind": "posix", "path": 5}, "store.path", "non-empty string"),
    ({"kind": "posix", "capacity_gb": 0}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "capacity_gb": -1}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "capacity_gb": "10"}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "capacity_gb": True}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "capacity_gb": float("nan")}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "capacity_gb": float("inf")}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "fsync": "sometimes"}, "store.fsync", "'never', 'data', 'full'"),
    ({"kind": "posix", "fsync": True}, "store.fsync", "must be one of"),
    ({"kind": "posix", "io_threads": 0}, "store.io_threads", r"\[1, 256\]"),
    ({"kind": "posix", "io_threads": 1000}, "store.io_threads", "integer"),
    ({"kind": "posix", "io_threads": 2.0}, "store.io_threads", "integer"),
    ({"kind": "posix", "o_direct": "yes"}, "store.o_direct", "true or false"),
    ({"kind": "posix", "o_direct": 1}, "store.o_direct", "true or false"),
    ({"kind": "posix", "evict_fraction": 0}, "store.evict_fraction", "between 0 and 1"),
    ({"kind": "posix", "evict_fraction": 1.5}, "store.evict_fraction", "between 0 and 1"),
    ({"kind": "posix", "stale_temp_seconds": -5}, "store.stale_temp_seconds", r"\[60, "),
    ({"kind": "posix", "stale_temp_seconds": 1e-9}, "store.stale_temp_seconds", r"\[60, "),
    ({"kind": "posix", "capacity_gb": 1e300}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "dram", "capacity_gb": 1e300}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "posix", "shared": True}, "store.secret", "shared store needs a secret"),
    ({"kind": "posix", "secret": "hunter2hunter2hunter2"}, "store.secret", "not shown"),
    ({"kind": "posix", "secret": "env:"}, "store.secret", "env:NAME"),
    ({"kind": "dram", "scope": "process", "secret": "env:S"}, "store.secret", "host"),
    ({"kind": "dram"}, None, None),  # valid: defaults
    ({"kind": "dram", "capacity_gb": None}, "store.capacity_gb", r"number in \(0, "),
    ({"kind": "dram", "size": 1}, "store.size", "unknown setting; allowed: capacity_gb, kind"),
    ({"kind": "tiered", "dram": 4}, "store.dram", "mapping"),
    ({"kind": "tiered", "dram": {"capacity_gb": -2}}, "store.dram.capacity_gb", r"\(0, "),
    ({"kind": "tiered", "dram": {"kind": "posix"}}, "store.dram.kind", "'dram'"),
    ({"kind": "tiered", "local": {"kind": "dram"}}, "store.local.kind", "'posix'"),
    (
        {"kind": "tiered", "local": {"path": "/x"}, "dram": {"capacity_gb": 2}},
        "store.local",
        "local or dram",
    ),
    (
        {"kind": "tiered", "local": {"path": "/x/y"}, "backing": {"path": "/x/y/"}},
        "store.local.path",
        "share a path",
    ),
    ({"kind": "tiered", "backing": {"kind": "tiered"}}, "store.backing.kind", "tiered"),
    (
        {"kind": "tiered", "backing": {"kind": "posix", "fsync": "x"}},
        "store.backing.fsync",
        "never",
    ),
    ({"kind": "tiered", "bakcing": {}}, "store.bakcing", "allowed: backing, dram, kind"),
    (["posix"], "store", "mapping"),
    ("posix", "store", "mapping"),
]


@pytest.mark.parametrize("data, key, message", INVALID)
def test_invalid_store_settings_are_refused_by_name(data, key, message):
    if key is None:
        parse_store_config(data)
        return
    with pytest.raises(ConfigError, match=message) as info:
        parse_store_config(data)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")


def test_direct_construction_validates_too():
    with pytest.raises(ConfigError, match="capacity_gb"):
        PosixStoreConfig(capacity_gb=-3)
    with pytest.raises(ConfigError, match="dram"):
        TieredStoreConfig(dram="big")  # type: ignore[arg-type]


def test_yaml_file(tmp_path):
    f = tmp_path / "ucm.yaml"
    f.write_text(
        "store:\n  kind: posix\n  path: /data/ucm\n  capacity_gb: 100\nblock_tokens: 256\n"
    )
    merged = with_config_file({"config_file": str(f), "block_tokens": 128})
    assert merged["block_tokens"] == 128  # keys beside config_file override the file
    assert parse_store_config(merged["store"]) == PosixStoreConfig(
        path="/data/ucm", capacity_gb=100
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("store: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "mapping"),
        ("config_file: x.yaml\n", "another"),
    ],
)
def test_bad_yaml_files(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        with_config_file({"config_file": str(f)})


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="config_file"):
        with_config_file({"config_file": 42})


def test_unusable_store_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot use .* as a UCM store"):
        PosixStore(PosixStoreConfig(path=str(blocker / "sub")))


def test_the_store_is_named_with_where_it_is_and_its_size():
    posix = parse_store_config({"kind": "posix", "path": "/data/ucm", "capacity_gb": 100})
    assert posix.summary() == "posix at /data/ucm (capacity 100 GiB)"
    unlimited = parse_store_config({"kind": "posix", "path": "/data/ucm", "capacity_gb": None})
    assert "no capacity limit" in unlimited.summary()
    auto = parse_store_config({"kind": "posix", "path": "/data/ucm"})
    assert "capacity auto" in auto.summary()
    signed = parse_store_config({"kind": "posix", "path": "/x", "secret": "env:S"})
    assert signed.summary().endswith(", signed)")
    mooncake = parse_store_config({"kind": "mooncake", "master": "10.0.0.1:50051"})
    assert mooncake.summary() == "mooncake at 10.0.0.1:50051 (1 GiB given to the pool)"
    tiered = parse_store_config(
        {"kind": "tiered", "dram": {"path": "/dev/shm/u", "capacity_gb": 2},
         "backing": {"kind": "posix", "path": "/d", "capacity_gb": None}}
    )  # fmt: skip
    assert tiered.summary() == (
        "tiered: dram at /dev/shm/u (capacity 2 GiB) -> posix at /d (no capacity limit)"
    )
