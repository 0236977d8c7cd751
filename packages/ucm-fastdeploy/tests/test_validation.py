"""Bad arguments get a clear error before any byte is written (store or caches)."""

from __future__ import annotations

import paddle
import pytest
from ucm.lab.testing.fastdeploy import (
    BLOCK,
    BLOCKS,
    LAYERS,
    all_bytes,
    make_store,
    random_caches,
    random_scales,
    stored_files,
    tokens,
    zeros_like,
)

PROMPT = tokens(3 * BLOCK, seed=1)


def _bf16(shape):
    return paddle.zeros(shape, dtype="bfloat16")


def _cases():
    k, v = random_caches(1)
    ks, vs = random_scales(2), random_scales(3)
    ok = {"key_cache": k, "val_cache": v, "token_ids": PROMPT, "gpu_block_ids": [0, 1, 2]}

    def case(message, error=ValueError, **changes):
        return pytest.param({**ok, **changes}, error, message, id=message[:40])

    short_v = [*v[:-1], _bf16([BLOCKS, 2, BLOCK, 4])]
    return [
        case("key_cache has 2 tensors, the store was built for layer_num=3", key_cache=k[:2]),
        case("val_cache has 4 tensors", val_cache=[*v, v[0]]),
        case("key_cache must be a list", TypeError, key_cache=k[0]),
        case(
            r"val_cache\[2\] is \[16, 2, 4, 4\] paddle.bfloat16|val_cache\[2\] is \[16, 2, 4, 4\]",
            val_cache=short_v,
        ),  # fmt: skip
        case(
            r"val_cache\[0\] is \[16, 2, 4, 8\] torch.float16",
            val_cache=[t.astype("float16") for t in v],
        ),  # fmt: skip
        case(
            "expected \\[num_blocks, kv_heads, block_size, head_dim\\]",
            key_cache=[t[0] for t in k],
            val_cache=[t[0] for t in v],
        ),  # fmt: skip
        case(
            "holds 8 tokens per block",
            key_cache=[_bf16([4, 2, 8, 4])] * LAYERS,
            val_cache=[_bf16([4, 2, 8, 4])] * LAYERS,
        ),
        case(
            "bytes_per_shard_layer_per_block=128",
            key_cache=[_bf16([4, 2, 4, 4])] * LAYERS,
            val_cache=[_bf16([4, 2, 4, 4])] * LAYERS,
        ),
        case(
            r"gpu_block_ids\[1\] = 16 is out of range: the caches hold 16 blocks",
            gpu_block_ids=[0, 16, 2],
        ),  # fmt: skip
        case(r"gpu_block_ids\[0\] = -1 is out of range", gpu_block_ids=[-1]),
        case(r"gpu_block_ids\[2\] must be an int", TypeError, gpu_block_ids=[0, 1, 2.0]),
        case(r"gpu_block_ids\[0\] must be an int", TypeError, gpu_block_ids=[True]),
        case("gpu_block_ids must be a list of ints", TypeError, gpu_block_ids="012"),
        case("token ids must be in", token_ids=[-1] * (3 * BLOCK)),
        case("token ids must be in", token_ids=[1 << 32] * (3 * BLOCK)),
        case("token ids must be integers", TypeError, token_ids=[0.5] * (3 * BLOCK)),
        case("key_scales and val_scales go together", key_scales=ks),
        case(
            r"key_scales\[0\] has shape \[8, 2, 4\]",
            key_scales=[s[:8] for s in ks],
            val_scales=[s[:8] for s in vs],
        ),  # fmt: skip
        case("val_scales has 2 tensors", key_scales=ks, val_scales=vs[:2]),
    ]


@pytest.mark.parametrize(("args", "error", "message"), _cases())
def test_bad_arguments_raise_before_any_byte(store_path, args, error, message):
    with make_store(store_path) as fd:
        with pytest.raises(error, match=message):
            fd.write("w", start_write_block_idx=0, **args)
        targets = [*args["key_cache"], *args["val_cache"]]
        before = all_bytes(targets) if all(hasattr(t, "shape") for t in targets) else None
        with pytest.raises(error, match=message.replace("gpu_block_ids[2] must", "")):
            fd.read("r", start_read_block_idx=0, **args)
        if before is not None:
            assert all_bytes(targets) == before
    assert stored_files(store_path) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"start": -1}, ValueError, "start_write_block_idx must be >= 0, got -1"),
        ({"start": 1.0}, TypeError, "start_write_block_idx must be an int >= 0, got 1.0"),
        ({"start": True}, TypeError, "start_write_block_idx must be an int"),
        ({"timeout": 0}, ValueError, "timeout must be a positive, finite number"),
        ({"timeout": -3.0}, ValueError, "timeout must be a positive"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a positive"),
        ({"timeout": "30"}, TypeError, "timeout must be a number of seconds"),
    ],
)
def test_bad_indices_and_timeouts(store_path, kwargs, error, message):
    k, v = random_caches(2)
    with make_store(store_path) as fd:
        with pytest.raises(error, match=message):
            fd.write("w", k, v, PROMPT, [0, 1, 2], kwargs.get("start", 0),
                     kwargs.get("timeout", 30.0))  # fmt: skip
        read_message = message.replace("write", "read")
        with pytest.raises(error, match=read_message):
            fd.read("r", k, v, PROMPT, [0, 1, 2], kwargs.get("start", 0),
                    kwargs.get("timeout", 30.0))  # fmt: skip
        if "start" in kwargs:
            with pytest.raises(error, match=message.replace("write_block", "match_block")):
                fd.query("q", PROMPT, kwargs["start"])
    assert stored_files(store_path) == []


def test_read_refuses_a_block_listed_twice(store_path):
    k, v = random_caches(3)
    with make_store(store_path) as fd:
        assert fd.write("w", k, v, PROMPT, [5, 5, 5], 0) == 3  # a write may repeat a block
        k2, v2 = zeros_like(k), zeros_like(v)
        with pytest.raises(ValueError, match="gpu_block_ids lists block 4 twice"):
            fd.read("r", k2, v2, PROMPT, [4, 4, 1], 0)
        assert all_bytes(k2) == all_bytes(zeros_like(k))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_id": 2, "shard_num": 2}, r"shard_id: must be in \[0, shard_num\)"),
        ({"shard_num": 0}, "shard_num: must be an integer >= 1, got 0"),
        ({"layer_num": -1}, "layer_num: must be an integer >= 1"),
        ({"block_token_size": 0}, "block_token_size: must be an integer >= 1"),
        ({"bytes_per_shard_layer_per_block": "1024"}, "bytes_per_shard_layer_per_block: must"),
        ({"namespace": ""}, "namespace: must be a non-empty string"),
        ({"model_version": None}, "model_version: must be a non-empty string"),
        ({"dp_id": True}, "dp_id: must be an integer >= 0, got True"),
    ],
)
def test_bad_constructor_arguments(store_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_store(store_path, **kwargs)
