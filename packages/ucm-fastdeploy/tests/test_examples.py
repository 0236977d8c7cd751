"""examples/fastdeploy runs as its README says, on the CPU: a writing process, then a fresh
one that reads the KV back and prints the hits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "fastdeploy" / "run_backend.py"

EXPECTED = [
    "[write] req-A: 0 of 8 blocks already stored, wrote 8",
    "[write] req-B: 6 of 10 blocks already stored, wrote 4",
    "[read, fresh process] req-B: 10 of 10 blocks stored, read 10, bytes identical",
    "[read, fresh process] req-C (a prompt nobody wrote): 0 of 10 blocks stored",
    "hits: 10 of 10 blocks of req-B (160 of 163 prompt tokens) from the store",
]


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("UCM_", "AS_"))}
    clean["UCM_CACHE_DIR"] = str(tmp_path / "ucm-cache")  # the model's digests, kept here
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("backend", ["attention_store", "file"])
def test_run_backend_writes_then_a_fresh_process_reads(tmp_path, backend):
    out = _run(tmp_path, "--backend", backend, "--workdir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for line in EXPECTED:
        assert line in lines
    # the default settings: a posix store in the work folder, the model named by its files
    config = (tmp_path / "ucm.yaml").read_text()
    assert f"path: {tmp_path / 'store'}" in config
    assert f"model_path: {tmp_path / 'ERNIE-4.5-0.3B-Paddle'}" in config
    assert any((tmp_path / "store" / "blocks").rglob("*"))


def test_run_backend_with_the_users_config(tmp_path):
    """A YAML of one's own through --config (UCM_CONFIG_FILE), the model named by
    AS_MODEL_VERSION instead of model_path, slices of 3 blocks."""
    config = tmp_path / "mine.yaml"
    store = tmp_path / "my-store"
    config.write_text(f"store:\n  kind: posix\n  path: {store}\nslice_write:\n  slice_blocks: 3\n")
    out = _run(tmp_path, "--config", str(config), AS_MODEL_VERSION="ernie-4.5-0.3b-2025-06")
    assert out.returncode == 0, out.stdout + out.stderr
    for line in EXPECTED:
        assert line in out.stdout.splitlines()
    assert any((store / "blocks").rglob("*"))


def test_a_model_named_by_nothing_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "noname.yaml"
    config.write_text(f"store:\n  kind: posix\n  path: {tmp_path / 'store'}\n")
    out = _run(tmp_path, "--config", str(config))
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("run_backend.py:")]
    assert len(errors) == 1 and "FastDeploy's default 'v0'" in errors[0]
    assert "Traceback" not in out.stderr
