import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ucm.core.settings import ConfigError
from ucm.core.slicing import (
    SliceWritePolicy,
    parse_positive,
    plan_slices,
    policy_from_env,
    write_sliced,
)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 120))
def test_plan_covers_the_range_in_order(start, length, size):
    slices = plan_slices(start, start + length, size)
    assert [i for s, e in slices for i in range(s, e)] == list(range(start, start + length))
    assert all(0 < e - s <= size for s, e in slices)


def test_complete_write():
    calls = []

    def write(s, e, timeout):
        calls.append((s, e, timeout))
        return e - s

    report = write_sliced(SliceWritePolicy(slice_blocks=100, slice_timeout_s=5), 3, 253, write)
    assert calls == [(3, 103, 5), (103, 203, 5), (203, 253, 5)]
    assert report.complete and report.written == 250 and report.stopped is None


def test_incomplete_slice_stops_the_rest(caplog):
    written = []

    def write(s, e, timeout):
        n = (e - s) // 2 if s == 10 else e - s
        written.extend(range(s, s + n))
        return n

    with caplog.at_level(logging.WARNING):
        report = write_sliced(SliceWritePolicy(slice_blocks=10), 0, 50, write)
    assert report.written == 15 and written == list(range(15))
    assert "wrote 5 of 10" in report.stopped and "cut short" in caplog.text


def test_timed_out_slice_stops_the_rest():
    clock = FakeClock()

    def write(s, e, timeout):
        if s == 20:
            raise TimeoutError
        clock.now += 1
        return e - s

    report = write_sliced(SliceWritePolicy(slice_blocks=10), 0, 50, write, clock=clock)
    assert report.written == 20 and "timed out" in report.stopped


def test_total_timeout_bounds_every_slice():
    clock = FakeClock()
    budgets = []

    def write(s, e, timeout):
        budgets.append(timeout)
        clock.now += 4
        return e - s

    policy = SliceWritePolicy(slice_blocks=1, slice_timeout_s=5, total_timeout_s=10)
    report = write_sliced(policy, 0, 10, write, clock=clock)
    assert budgets == [5, 5, 2]  # the third slice gets only what is left...
    # ...and overran it: its blocks are written and counted, and nothing follows
    assert report.written == 3 and report.slices == 3 and "took" in report.stopped


def test_call_timeout_is_the_default_total():
    clock = FakeClock()

    def write(s, e, timeout):
        clock.now += 1
        return e - s

    report = write_sliced(
        SliceWritePolicy(slice_blocks=1), 0, 10, write, call_timeout_s=3, clock=clock
    )
    assert report.written == 3 and "total timeout" in report.stopped


def test_a_raising_store_is_a_stop_not_a_crash():
    def write(s, e, timeout):
        raise OSError("store gone")

    report = write_sliced(SliceWritePolicy(), 0, 5, write)
    assert report.written == 0 and "store gone" in report.stopped


ENV = {
    "slice_blocks": "AS_WRITE_SLICE_BLOCK_NUM",
    "slice_timeout_s": "AS_WRITE_SLICE_TIMEOUT",
    "total_timeout_s": "AS_WRITE_TOTAL_TIMEOUT",
}


def test_env_overlay():
    policy = policy_from_env(
        {"AS_WRITE_SLICE_BLOCK_NUM": " 64 ", "AS_WRITE_TOTAL_TIMEOUT": "2.5"}, ENV
    )
    assert policy == SliceWritePolicy(slice_blocks=64, total_timeout_s=2.5)


@pytest.mark.parametrize("var", list(ENV.values()))
@pytest.mark.parametrize("raw", ["0", "-3", "abc", "", "nan", "inf", "1e400"])
def test_bad_env_values_name_the_variable(var, raw):
    with pytest.raises(ConfigError, match=var):
        policy_from_env({var: raw}, ENV)


def test_fractional_block_count_refused():
    with pytest.raises(ConfigError, match="positive int"):
        parse_positive("AS_WRITE_SLICE_BLOCK_NUM", "2.5", int)


@pytest.mark.parametrize(
    "field, value", [("slice_blocks", 0), ("slice_timeout_s", -1), ("total_timeout_s", 0)]
)
def test_bad_policy_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        SliceWritePolicy(**{field: value})
