"""Slice writes against a slow or failing store: the stored prefix never has holes."""

from __future__ import annotations

import logging
import re
import time

import pytest
from ucm.core.settings import ConfigError
from ucm.lab.testing.fastdeploy import (
    BLOCK,
    WrappedStore,
    make_store,
    random_caches,
    stored_files,
    tokens,
)

SLICING = "ucm.core.slicing"


def _slow(store_path, env, delay=0.05, **kwargs):
    store = WrappedStore(store_path, dump_delay=delay, **kwargs)
    fd = make_store(store_path, store=store, environ=env, ucm_config={"cancel_grace_s": 1.0})
    return store, fd


def test_total_timeout_stops_the_write_and_query_sees_exactly_the_prefix(store_path, caplog):
    blocks = 16
    k, v = random_caches(1, blocks=blocks)
    prompt = tokens(blocks * BLOCK, seed=1)
    env = {"AS_WRITE_TOTAL_TIMEOUT": "0.3", "AS_WRITE_SLICE_BLOCK_NUM": "3"}
    store, fd = _slow(store_path, env)
    with caplog.at_level(logging.DEBUG, logger=SLICING):
        t0 = time.monotonic()
        written = fd.write("w", k, v, prompt, list(range(blocks)), 0, timeout=30.0)
        elapsed = time.monotonic() - t0
    # 50 ms a block: about six blocks fit in 0.3 s (one more may finish in the grace)
    assert 2 <= written < blocks
    assert elapsed < 0.3 + 1.0  # the total timeout, plus the grace for blocks in flight
    assert fd.query("q", prompt, 0) == written
    # nothing past the prefix: the files are exactly the written blocks, even later
    time.sleep(0.15)
    assert len(stored_files(store_path)) == written
    assert fd.query("q", prompt, 0) == written
    assert store.dumped < blocks  # the slices after the cut were never handed to the store
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert re.search(rf"prefix cut short: written={written}/{blocks} seconds=\d", warnings[0].msg %
                     warnings[0].args)  # fmt: skip
    store.close()


def test_slice_timeout_stops_at_the_slow_slice(store_path):
    k, v = random_caches(2)
    prompt = tokens(12 * BLOCK, seed=2)
    env = {"AS_WRITE_SLICE_TIMEOUT": "0.12", "AS_WRITE_SLICE_BLOCK_NUM": "4"}
    store, fd = _slow(store_path, env, delay=0.05)
    written = fd.write("w", k, v, prompt, list(range(12)), 0)
    assert 1 <= written < 4  # the first slice of four could not finish in 0.12 s
    assert fd.query("q", prompt, 0) == written
    assert len(stored_files(store_path)) == written
    store.close()


def test_a_short_slice_stops_the_rest_and_leaves_no_holes(store_path):
    k, v = random_caches(3)
    prompt = tokens(12 * BLOCK, seed=3)
    # the 6th block handed to the store fails; the 7th and 8th are written
    store = WrappedStore(store_path, fail_dumps={5})
    fd = make_store(store_path, store=store, environ={"AS_WRITE_SLICE_BLOCK_NUM": "4"})
    assert fd.write("w", k, v, prompt, list(range(12)), 0) == 5
    assert store.dump_calls == 2  # slice [0, 4) and [4, 8); [8, 12) never started
    assert fd.query("q", prompt, 0) == 5
    keys = fd.keyspace.keys(prompt, 0, 12)
    assert store.inner.lookup(keys) == [True] * 5 + [False] * 7  # 6, 7 were removed
    # FastDeploy writes again from the match: the rest goes in, the prefix stays whole
    match = fd.query("q", prompt, 0)
    assert fd.write("w", k, v, prompt, list(range(12))[match:], match) == 12 - match
    assert fd.query("q", prompt, 0) == 12
    store.close()


def test_slice_logs(store_path, caplog):
    k, v = random_caches(4)
    prompt = tokens(10 * BLOCK, seed=4)
    fd = make_store(store_path, environ={"AS_WRITE_SLICE_BLOCK_NUM": "4"})
    with caplog.at_level(logging.DEBUG, logger=SLICING):
        assert fd.write("task-7", k, v, prompt, list(range(10)), 0) == 10
    lines = [r.getMessage() for r in caplog.records if r.name == SLICING]
    assert [r.levelno for r in caplog.records if r.name == SLICING] == [logging.DEBUG] * 4
    assert re.fullmatch(r"ucm slice write task_id=task-7: slice=\[0, 4\) written=4/4 "
                        r"seconds=\d+\.\d{3}", lines[0])  # fmt: skip
    assert "slice=[8, 10) written=2/2" in lines[2]
    assert re.fullmatch(r"ucm slice write task_id=task-7: written=10/10 seconds=\d+\.\d{3}",
                        lines[3])  # fmt: skip
    fd.close()


def test_settings_come_from_ucm_config_and_env_wins(store_path):
    fd = make_store(
        store_path,
        ucm_config={"slice_write": {"slice_blocks": 7, "slice_timeout_s": 2.5}},
        environ={"AS_WRITE_SLICE_TIMEOUT": "4"},
    )
    assert (fd.policy.slice_blocks, fd.policy.slice_timeout_s) == (7, 4.0)
    assert fd.policy.total_timeout_s is None  # the call's timeout
    fd.close()
    fd = make_store(store_path)
    assert (fd.policy.slice_blocks, fd.policy.slice_timeout_s) == (100, 10.0)
    fd.close()


@pytest.mark.parametrize(
    "var", ["AS_WRITE_TOTAL_TIMEOUT", "AS_WRITE_SLICE_BLOCK_NUM", "AS_WRITE_SLICE_TIMEOUT"]
)
@pytest.mark.parametrize("value", ["0", "-1", "-0.5", "ten", "", "nan", "inf", " "])
def test_bad_environment_values_are_refused_when_built(store_path, var, value):
    with pytest.raises(ConfigError, match=rf"^{var}: must be a positive (int|float)") as info:
        make_store(store_path, environ={var: value})
    assert info.value.key == var
    assert stored_files(store_path) == []


@pytest.mark.parametrize("value", ["1.5", "2e3", str(1 << 31)])
def test_slice_block_num_must_be_a_whole_number_in_range(store_path, value):
    with pytest.raises(ConfigError, match=r"^AS_WRITE_SLICE_BLOCK_NUM: must be"):
        make_store(store_path, environ={"AS_WRITE_SLICE_BLOCK_NUM": value})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"slice_blocks": 0}, r"ucm_config\.slice_write\.slice_blocks: must be an integer"),
        ({"slice_blocks": "100"}, r"ucm_config\.slice_write\.slice_blocks: must be an integer"),
        ({"slice_timeout_s": -1}, r"ucm_config\.slice_write\.slice_timeout_s: must be a positi"),
        ({"total_timeout_s": 0}, r"ucm_config\.slice_write\.total_timeout_s: must be a positi"),
        ({"slice_block": 3}, r"ucm_config\.slice_write\.slice_block: unknown setting"),
    ],
)
def test_bad_ucm_config_values_are_refused(store_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        make_store(store_path, ucm_config={"slice_write": settings})
