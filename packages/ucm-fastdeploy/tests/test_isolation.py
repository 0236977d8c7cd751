"""Shards, namespaces, model versions and cache shapes never see each other's blocks; pods,
replicas and roles of one model and shard share them."""

from __future__ import annotations

import random

import pytest
from ucm.core.settings import ConfigError
from ucm.lab.testing.fastdeploy import (
    BLOCK,
    make_store,
    random_caches,
    stored_files,
    tokens,
    zeros_like,
)

PROMPT = tokens(4 * BLOCK, seed=3)


def _write(store_path, **kwargs):
    k, v = random_caches(sum(map(ord, repr(sorted(kwargs.items())))))
    with make_store(store_path, **kwargs) as fd:
        assert fd.write("w", k, v, PROMPT, [0, 1, 2, 3], 0) == 4
    return k, v


def test_tensor_parallel_shards_keep_their_own_blocks(store_path):
    shards = [_write(store_path, shard_id=i, shard_num=2) for i in range(2)]
    assert len(stored_files(store_path)) == 8
    for i, (k, v) in enumerate(shards):
        with make_store(store_path, shard_id=i, shard_num=2) as fd:
            assert fd.query("q", PROMPT, 0) == 4
            k2, v2 = zeros_like(k), zeros_like(v)
            assert fd.read("r", k2, v2, PROMPT, [4, 5, 6, 7], 0) == 4
        from ucm.lab.testing.fastdeploy import block_bytes

        assert all(block_bytes(a, 4 + j) == block_bytes(b, j) for a, b in zip(k2, k)
                   for j in range(4))  # fmt: skip
    # a world of another size is another cache
    with make_store(store_path, shard_id=0, shard_num=4) as fd:
        assert fd.query("q", PROMPT, 0) == 0
    with make_store(store_path) as fd:  # shard_num=1
        assert fd.query("q", PROMPT, 0) == 0


@pytest.mark.parametrize(
    "other",
    [
        {"namespace": "another-model"},
        {"model_version": "v2"},
        {"layer_num": 2},
        {"block_token_size": 8},
        {"bytes_per_shard_layer_per_block": 256},
    ],
)
def test_namespaces_versions_and_shapes_are_apart(store_path, other):
    _write(store_path, namespace="model-a", model_version="v1")
    with make_store(store_path, **{"namespace": "model-a", "model_version": "v1", **other}) as fd:
        assert fd.query("q", PROMPT, 0) == 0


def test_a_model_is_never_named_by_the_default_version_alone(store_path):
    with pytest.raises(ConfigError, match="model_path") as caught:
        make_store(store_path, model_version="v0")
    assert caught.value.key == "model_version"


def _model(folder, seed: int, config: str = '{"hidden_size": 64}'):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(random.Random(seed).randbytes(8192))
    return str(folder)


def test_model_path_names_the_model_by_its_content(store_path, tmp_path):
    """Two fine-tunes with the same cache shape and the same operator strings (even the
    default version) exchange no blocks; the same files at another path share them."""
    a = _model(tmp_path / "a", 1)
    _write(store_path, model_version="v0", ucm_config={"model_path": a})
    same = _model(tmp_path / "copy-of-a", 1)
    with make_store(store_path, model_version="v0", ucm_config={"model_path": same}) as fd:
        assert fd.query("q", PROMPT, 0) == 4
    for other in (_model(tmp_path / "b", 2), _model(tmp_path / "c", 1, '{"hidden_size": 65}')):
        with make_store(store_path, model_version="v0", ucm_config={"model_path": other}) as fd:
            assert fd.query("q", PROMPT, 0) == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json and no weight files") as caught:
        make_store(store_path, ucm_config={"model_path": str(tmp_path / "empty")})
    assert caught.value.key == "ucm_config.model_path"


def test_namespace_and_version_are_not_mixed_up(store_path):
    _write(store_path, namespace="a/b", model_version="c")
    with make_store(store_path, namespace="a", model_version="b/c") as fd:
        assert fd.query("q", PROMPT, 0) == 0


@pytest.mark.parametrize(
    "same",
    [
        {"pod_name": "pod-2"},
        {"dp_id": 3},
        {"device_id": 5},
        {"splitwise_role": "decode"},
    ],
)
def test_pods_replicas_and_roles_share_blocks(store_path, same):
    _write(store_path, namespace="m", splitwise_role="prefill")
    with make_store(store_path, namespace="m", **same) as fd:
        assert fd.query("q", PROMPT, 0) == 4


def test_fastdeploy_environment_overrides(store_path):
    _write(store_path, namespace="from-env", model_version="v9")
    env = {"AS_NAMESPACE": "from-env", "AS_MODEL_VERSION": "v9", "AS_POD_NAME": "p"}
    with make_store(store_path, namespace="ignored", environ=env, dp_id=2) as fd:
        assert fd.query("q", PROMPT, 0) == 4
        assert fd.config.pod_name == "p_mixed_2"  # FastDeploy's ENABLE_EP_DP_IN_FD default
    with make_store(store_path, environ={"ENABLE_EP_DP_IN_FD": "0"}) as fd:
        assert fd.config.pod_name == "default_pod"
    with pytest.raises(ValueError, match="ENABLE_EP_DP_IN_FD: must be 0 or 1"):
        make_store(store_path, environ={"ENABLE_EP_DP_IN_FD": "yes"})
