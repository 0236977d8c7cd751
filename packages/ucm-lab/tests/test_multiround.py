"""The multi-round QA workload: conversations that grow round by round, the same for every
system under test."""

from __future__ import annotations

import pytest
from ucm.core.settings import ConfigError, from_dict
from ucm.lab.vllm.multiround import FIRST_TOKEN, LAST_TOKEN, MultiRoundWorkload

SETTINGS = dict(users=3, rounds=4, system_tokens=50, user_tokens=20, question_tokens=7)
SMALL = MultiRoundWorkload(**SETTINGS, answer_tokens=5)


def test_each_round_extends_the_last_by_its_answer_and_the_next_question():
    w = SMALL
    for user in range(w.users):
        for r in range(1, w.rounds):
            before, now = w.prompt(user, r - 1), w.prompt(user, r)
            assert now[: len(before)] == before  # the whole earlier prompt is a prefix
            assert now[len(before) :] == w.answer(user, r - 1) + w.question(user, r)
            assert len(now) == w.prompt_tokens(r)


def test_users_share_the_system_prompt_and_nothing_after_it():
    w = SMALL
    a, b = w.prompt(0, 2), w.prompt(1, 2)
    assert a[:50] == b[:50] == w.system_prompt()
    assert a[50:70] == w.user_context(0) and b[50:70] == w.user_context(1)
    assert a[50:70] != b[50:70]
    assert a[70:77] != b[70:77]  # questions differ too
    assert all(FIRST_TOKEN <= t < LAST_TOKEN for t in a)


def test_the_same_settings_give_the_same_tokens_and_another_seed_others():
    again = MultiRoundWorkload(**SETTINGS, answer_tokens=5)
    assert again.prompt(2, 3) == SMALL.prompt(2, 3)
    other = MultiRoundWorkload(**SETTINGS, answer_tokens=5, seed=1)
    assert other.prompt(2, 3) != SMALL.prompt(2, 3)


def test_order_is_round_by_round_with_users_in_turn():
    assert list(SMALL.order())[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert len(list(SMALL.order())) == 12


def test_kv_blocks_hold_a_share_of_the_histories_but_at_least_one_request():
    w = SMALL
    # each user: the last prompt (50 + 20 + 3 * 12 + 7) and its answer, the system prompt once
    assert w.history_tokens() == 50 + 3 * (20 + 3 * 12 + 7 + 5)
    assert w.kv_blocks(1.0, 16) == -(-w.history_tokens() // 16)
    longest = w.prompt_tokens(3) + 5
    assert w.kv_blocks(0.01, 16) == -(-longest // 16) + 1  # and vLLM's null block
    with pytest.raises(ValueError):
        w.kv_blocks(0, 16)


@pytest.mark.parametrize(
    "settings,key",
    [({"users": 0}, "users"), ({"request_rate": 0}, "request_rate"), ({"userz": 1}, "userz")],
)
def test_bad_settings_name_the_key(settings, key):
    with pytest.raises(ConfigError) as caught:
        from_dict(MultiRoundWorkload, settings, "workload")
    assert caught.value.key == f"workload.{key}"
