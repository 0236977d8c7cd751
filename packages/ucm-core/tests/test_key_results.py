"""Which loaded blocks count: the rule every engine adapter applies to a load's results."""

from ucm.core.store import KeyResult, Status, first_problem, verified_prefix

OK = KeyResult(Status.OK)
MISS = KeyResult(Status.MISS)
CORRUPT = KeyResult(Status.CORRUPT, "payload checksum mismatch")


def test_a_block_counts_only_if_it_and_every_block_before_it_verified():
    assert verified_prefix([OK, OK, OK]) == 3
    assert verified_prefix([OK, CORRUPT, OK]) == 1
    assert verified_prefix([OK, None, OK]) == 1  # no answer is a failure
    assert verified_prefix([]) == 0
    # several groups per block: block 1 of the second group failed
    assert verified_prefix([OK, OK, OK, MISS, OK], blocks=[0, 0, 1, 1, 2]) == 1
    # a load that starts past blocks the engine holds: block numbers, not positions
    assert verified_prefix([OK, OK], blocks=[5, 6]) == 7
    assert verified_prefix([OK, MISS], blocks=[5, 6]) == 6


def test_the_first_problem_is_named():
    assert first_problem([OK, CORRUPT, MISS]) == "payload checksum mismatch"
    assert first_problem([OK, MISS]) == "miss"
    assert first_problem([OK, None]) == "timed out"
    assert first_problem([OK]) == ""
