import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from models import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny_llama"))
