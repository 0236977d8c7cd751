"""The import hook swaps FastDeploy's classes without touching FastDeploy's files.

FastDeploy is not installable here, so a stand-in package with its module path and the
cache transfer manager's import line plays it, in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from ucm.fastdeploy.hook import install_from_env


def _fake_fastdeploy(root):
    pkg = root / "fastdeploy" / "cache_manager" / "transfer_factory"
    pkg.mkdir(parents=True)
    for d in (root / "fastdeploy", root / "fastdeploy" / "cache_manager"):
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(
        "class AttentionStore: pass\nclass FileStore: pass\nclass MooncakeStore: pass\n"
    )


def _run(root, env_value, code):
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("UCM_FASTDEPLOY_BACKENDS", None)
    if env_value is not None:
        env["UCM_FASTDEPLOY_BACKENDS"] = env_value
    prelude = "import ucm.fastdeploy.hook as h; h.install_from_env()\n"  # what the .pth runs
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("value", "attention", "file"),
    [
        ("attention_store", "ucm.fastdeploy.attention_store", "fastdeploy"),
        ("attention_store,file", "ucm.fastdeploy.attention_store", "ucm.fastdeploy.storage"),
        (None, "fastdeploy", "fastdeploy"),
    ],
)
def test_transfer_factory_classes_are_swapped(tmp_path, value, attention, file):
    _fake_fastdeploy(tmp_path)
    code = """
        import sys
        assert "torch" not in sys.modules  # installing the hook is cheap
        from fastdeploy.cache_manager.transfer_factory import AttentionStore, FileStore
        print(AttentionStore.__module__, FileStore.__module__)
    """
    out = _run(tmp_path, value, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        attention if attention != "fastdeploy" else "fastdeploy.cache_manager.transfer_factory",
        file if file != "fastdeploy" else "fastdeploy.cache_manager.transfer_factory",
    ]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="UCM_FASTDEPLOY_BACKENDS: unknown backend 'mooncake'"):
        install_from_env({"UCM_FASTDEPLOY_BACKENDS": "attention_store,mooncake"})
    assert install_from_env({}) is False
