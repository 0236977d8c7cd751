"""The store contract (:mod:`ucm.lab.testing.store_contract`) over tiered stores in front
of a Mooncake pool: shared memory, and a local disk."""

import pytest
from ucm.lab.testing.store_contract import *  # noqa: F403 - the contract's tests
from ucm.lab.testing.store_contract import OVER_MOONCAKE_KINDS


@pytest.fixture(params=OVER_MOONCAKE_KINDS)
def kind(request):
    return request.param
