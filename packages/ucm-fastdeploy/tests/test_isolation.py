"""Shards, namespaces, model versions and cache shapes never see each other's blocks; pods,
replicas and roles of one model and shard share them."""

from __future__ import annotations

import pytest
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
        {"model_version": "v1"},
        {"layer_num": 2},
        {"block_token_size": 8},
        {"bytes_per_shard_layer_per_block": 256},
    ],
)
def test_namespaces_versions_and_shapes_are_apart(store_path, other):
    _write(store_path, namespace="model-a", model_version="v0")
    with make_store(store_path, **{"namespace": "model-a", "model_version": "v0", **other}) as fd:
        assert fd.query("q", PROMPT, 0) == 0


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
