"""Test set-up: paddle on the CPU, the kernels' Triton path in the interpreter, helpers."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

if "TRITON_INTERPRET" not in os.environ:  # before ucm.kernels imports triton
    os.environ["TRITON_INTERPRET"] = "1"

with warnings.catch_warnings():  # paddle warns at import that ccache is missing: irrelevant
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle

paddle.set_device("cpu")

_SCRATCH = Path(os.path.expanduser("~/.cache/ucm-test-tmp"))


@pytest.fixture
def store_path(tmp_path: Path):
    """A fresh store directory: under ~/.cache/ucm-test-tmp when possible (files are created
    much faster there than in /tmp on the development machine), else pytest's tmp_path."""
    try:
        _SCRATCH.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="fd-", dir=_SCRATCH))
    except OSError:
        yield str(tmp_path / "store")
        return
    try:
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_fastdeploy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables the backend reads come only from the test that sets them."""
    for var in (
        "UCM_CONFIG_FILE",
        "AS_WRITE_TOTAL_TIMEOUT",
        "AS_WRITE_SLICE_BLOCK_NUM",
        "AS_WRITE_SLICE_TIMEOUT",
        "AS_NAMESPACE",
        "AS_POD_NAME",
        "AS_MODEL_VERSION",
        "ENABLE_EP_DP_IN_FD",
    ):
        monkeypatch.delenv(var, raising=False)
