"""The store contract (:mod:`ucm.lab.testing.store_contract`) over a Mooncake pool: the
mooncake store, plain and signed."""

import pytest
from ucm.lab.testing.store_contract import *  # noqa: F403 - the contract's tests
from ucm.lab.testing.store_contract import MOONCAKE_KINDS


@pytest.fixture(params=MOONCAKE_KINDS)
def kind(request):
    return request.param
