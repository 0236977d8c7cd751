"""The ``store`` every store test uses: one store of each kind of ``kind``'s parameters (the
contract suite's list; a kind's own test file narrows ``kind`` to its kinds)."""

import pytest
from ucm.core.store import create_store
from ucm.lab.testing.core import store_config
from ucm.lab.testing.store_contract import KINDS


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def store(kind, tmp_path, request):
    s = create_store(store_config(kind, tmp_path, request))
    yield s
    s.close()
