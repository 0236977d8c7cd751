"""UCMStorage driven as FastDeploy's cache transfer manager drives its mooncake and file
backends: registered pinned-style host buffers, raw pointers, FastDeploy's string keys."""

from __future__ import annotations

import logging

import numpy as np
import paddle
import pytest
from ucm.fastdeploy import UCMStorage
from ucm.lab.testing.fastdeploy import WrappedStore, stored_files

STRIDE = 4096  # bytes of one block's K (or V) part of every layer
BLOCKS = 6


def _storage(store_path, **kwargs):
    return UCMStorage(ucm_config={"store": {"path": store_path}}, environ={}, **kwargs)


def _buffers(seed):
    """FastDeploy's write and read buffers: [K blocks | V blocks], registered."""
    rng = np.random.default_rng(seed)
    write = rng.integers(0, 256, 2 * BLOCKS * STRIDE, dtype=np.uint8)
    read = np.zeros_like(write)
    return write, read


def _keys(hashes, rank=0, prefix=""):
    k = [f"prefix{prefix}_{h}_{rank}_key" for h in hashes]
    v = [f"prefix{prefix}_{h}_{rank}_value" for h in hashes]
    return k, v


def _locations(buf, blocks):
    base = buf.ctypes.data
    half = BLOCKS * STRIDE
    return [base + i * STRIDE for i in blocks] + [base + half + i * STRIDE for i in blocks]


def test_write_back_then_prefetch_like_fastdeploy(store_path):
    write, read = _buffers(1)
    hashes = ["a1", "b2", "c3", "d4"]
    k, v = _keys(hashes)
    with _storage(store_path, namespace="model", tp_rank=0, tp_size=2) as fd:
        fd.register_buffer(write.ctypes.data, write.nbytes)
        fd.register_buffer(read.ctypes.data, read.nbytes)
        assert fd.query(k, v, None, None, 1.0) == 0
        codes = fd.batch_set(k + v, _locations(write, range(4)), [STRIDE] * 8)
        assert codes == [0] * 8
        assert fd.exists(k[:2] + ["prefix_zz_0_key"]) == {
            k[0]: True,
            k[1]: True,
            "prefix_zz_0_key": False,
        }
        assert fd.query(k + ["prefix_e5_0_key"], v + ["prefix_e5_0_value"]) == 4
    with _storage(store_path, namespace="model") as fd:  # a fresh process
        fd.register_buffer(read.ctypes.data, read.nbytes)
        got = fd.batch_get(k + v, _locations(read, [5, 4, 3, 2]), [STRIDE] * 8)
        assert got == [STRIDE] * 8
    half = BLOCKS * STRIDE
    for src, dst in zip(range(4), [5, 4, 3, 2]):
        for part in (0, half):
            a = write[part + src * STRIDE : part + (src + 1) * STRIDE]
            b = read[part + dst * STRIDE : part + (dst + 1) * STRIDE]
            assert np.array_equal(a, b)


def test_return_conventions_for_misses_and_bad_targets(store_path, caplog):
    write, read = _buffers(2)
    k, v = _keys(["x"])
    with _storage(store_path) as fd:
        fd.register_buffer(read.ctypes.data, read.nbytes)
        # missing key: negative; an unregistered pointer: negative, nothing stored
        assert fd.batch_get(k, _locations(read, [0])[:1], [STRIDE]) == [-1]
        with caplog.at_level(logging.ERROR):
            assert fd.batch_set(k, [write.ctypes.data], [STRIDE]) == [-3]
        assert "not inside a buffer given to register_buffer" in caplog.text
        assert stored_files(store_path) == []
        fd.register_buffer(write.ctypes.data, write.nbytes)
        assert fd.set(k[0], write.ctypes.data, STRIDE) == 0
        # a target size that differs from the stored block: refused, target untouched
        assert fd.get(k[0], read.ctypes.data, STRIDE // 2) == -3
        assert not read.any()
        assert fd.get(k[0], read.ctypes.data, STRIDE) == STRIDE
        # a range running past the registered buffer is refused
        end = read.ctypes.data + read.nbytes - 10
        assert fd.batch_get(k, [end], [STRIDE]) == [-3]
        assert fd.batch_set(k, [write.ctypes.data], [0]) == [-3]
        with pytest.raises(ValueError, match="the lengths must match"):
            fd.batch_set(k + v, [write.ctypes.data], [STRIDE])
        with pytest.raises(ValueError, match="target_locations and target_sizes are required"):
            fd.batch_get(k)
        with pytest.raises(TypeError, match="keys must be non-empty strings"):
            fd.exists([None])
        with pytest.raises(ValueError, match="null or empty buffer"):
            fd.register_buffer(0, 10)


def test_buffers_and_tensors_as_targets(store_path):
    data = paddle.to_tensor(np.arange(256, dtype=np.uint8))
    out = paddle.zeros([256], dtype="uint8")
    raw = bytearray(256)
    with _storage(store_path) as fd:
        assert fd.set("t", data, 256) == 0
        assert fd.get("t", out, 256) == 256
        assert fd.get("t", raw, 256) == 256
    assert np.array_equal(out.numpy(), np.arange(256, dtype=np.uint8))
    assert raw == bytes(range(256))


def test_query_with_scale_keys_and_partial_blocks(store_path):
    write, _ = _buffers(3)
    k, v = _keys(["p", "q", "r"])
    ks = [x + "_scale" for x in k]
    vs = [x + "_scale" for x in v]
    with _storage(store_path) as fd:
        fd.register_buffer(write.ctypes.data, write.nbytes)
        fd.batch_set(k + v, _locations(write, range(3)), [STRIDE] * 6)
        fd.batch_set(ks[:2] + vs[:2], _locations(write, range(2)), [STRIDE] * 4)
        assert fd.query(k, v) == 3
        assert fd.query(k, v, ks, vs) == 2
        assert fd.delete(v[0])
        assert fd.query(k, v) == 0
        with pytest.raises(ValueError, match="same length"):
            fd.query(k, v[:2])


def test_namespaces_and_clear(store_path):
    write, _ = _buffers(4)
    k, v = _keys(["n"])
    with _storage(store_path, namespace="a") as a, _storage(store_path, namespace="b") as b:
        for fd in (a, b):
            fd.register_buffer(write.ctypes.data, write.nbytes)
            assert fd.batch_set(k + v, _locations(write, [0]), [STRIDE] * 2) == [0, 0]
        assert len(stored_files(store_path)) == 4
        assert a.clear() is True
        assert a.exists(k + v) == {k[0]: False, v[0]: False}
        assert b.exists(k + v) == {k[0]: True, v[0]: True}  # another namespace: untouched


def test_slow_store_times_out_per_key(store_path):
    write, read = _buffers(5)
    k, v = _keys(["s1", "s2", "s3"])
    store = WrappedStore(store_path, dump_delay=0.1)
    fd = UCMStorage(store=store, ucm_config={"storage_timeout_s": 0.15}, environ={})
    fd.register_buffer(write.ctypes.data, write.nbytes)
    codes = fd.batch_set(k, _locations(write, range(3))[:3], [STRIDE] * 3)
    assert codes[0] == 0 and -4 in codes
    store.close()


def test_failing_store_returns_negative_codes(store_path):
    write, read = _buffers(6)
    store = WrappedStore(store_path, raise_on={"dump", "load", "lookup"})
    fd = UCMStorage(store=store, environ={})
    fd.register_buffer(write.ctypes.data, write.nbytes)
    fd.register_buffer(read.ctypes.data, read.nbytes)
    assert fd.batch_set(["k"], [write.ctypes.data], [STRIDE]) == [-3]
    assert fd.batch_get(["k"], [read.ctypes.data], [STRIDE]) == [-3]
    assert fd.exists(["k"]) == {"k": False}
    assert fd.query(["k"], ["v"]) == 0
    store.close()
