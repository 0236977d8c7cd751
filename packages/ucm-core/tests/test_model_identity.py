"""Model identity from content: the same weights anywhere name the same keys, other weights
at the same path never do, and a start-up on a model seen before reads none of it."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from ucm.core import model_identity
from ucm.core.model_identity import config_digest, weight_files, weights_digest


def safetensors(path: Path, payload: bytes, names: str = "w") -> Path:
    header = json.dumps(
        {names: {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return path


def model(directory: Path, seed: int, size: int = 3 << 20) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"hidden_size": 8}))
    payload = _bytes(seed, size)
    safetensors(directory / "model-00001-of-00002.safetensors", payload)
    safetensors(directory / "model-00002-of-00002.safetensors", payload[::-1])
    return directory


def _bytes(seed: int, size: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def test_the_same_weights_at_another_path_have_the_same_digest(tmp_path, cache):
    a = model(tmp_path / "a", seed=1)
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert weights_digest(a, cache_dir=cache) == weights_digest(b, cache_dir=cache)


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_weights_rewritten_in_place_change_the_digest(tmp_path, cache, mode):
    a = model(tmp_path / "a", seed=1)
    before = weights_digest(a, mode, cache_dir=cache)
    # new weights of the same shapes: the same headers and sizes, other bytes
    model(tmp_path / "a", seed=2)
    assert weights_digest(a, mode, cache_dir=cache) != before


def test_one_changed_sample_changes_the_sampled_digest(tmp_path, cache):
    a = model(tmp_path / "a", seed=1)
    before = weights_digest(a, cache_dir=cache)
    shard = a / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last byte is always read
    shard.write_bytes(bytes(data))
    assert weights_digest(a, cache_dir=cache) != before


def test_a_model_seen_before_is_not_read_again(tmp_path, cache, monkeypatch):
    a = model(tmp_path / "a", seed=1)
    first = weights_digest(a, cache_dir=cache)
    reads = []
    real = model_identity.file_digest
    monkeypatch.setattr(model_identity, "file_digest", lambda f, m: reads.append(f) or real(f, m))
    assert weights_digest(a, cache_dir=cache) == first
    assert reads == []
    # touched (same bytes): read again, the same digest
    os.utime(a / "model-00002-of-00002.safetensors")
    assert weights_digest(a, cache_dir=cache) == first
    assert [f.name for f in reads] == ["model-00002-of-00002.safetensors"]
    entries = json.loads((cache / "weights-digests.json").read_text())
    assert len(entries) == 2  # the stale entry of the touched file is gone


def test_unwritable_cache_still_gives_the_digest(tmp_path):
    a = model(tmp_path / "a", seed=1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert weights_digest(a, cache_dir=blocker / "cache") == weights_digest(
        a, cache_dir=tmp_path / "c"
    )


def test_hub_snapshot_files_are_named_by_their_blob(tmp_path, cache, monkeypatch):
    # a hub cache: snapshots/<commit>/file -> ../../blobs/<sha256 of the content>
    repo = tmp_path / "models--org--m"
    blob = repo / "blobs" / ("ab" * 32)
    blob.parent.mkdir(parents=True)
    safetensors(blob, _bytes(1, 1 << 20))
    snap = repo / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(Path("../../blobs") / blob.name)
    monkeypatch.setattr(model_identity, "_sample_offsets", lambda size: pytest.fail("read"))
    digest = weights_digest(snap, cache_dir=cache)
    assert digest is not None
    assert (
        model_identity.file_digest(snap / "model.safetensors", "sampled") == "sha256:" + "ab" * 32
    )


def test_weight_files_are_found_by_suffix_and_hidden_folders_skipped(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".cache").mkdir()
    for name in ["a.safetensors", "b.bin", "sub/c.pt", ".cache/d.safetensors", "tok.json"]:
        (tmp_path / name).write_bytes(b"x")
    assert [f.relative_to(tmp_path).as_posix() for f in weight_files(tmp_path)] == [
        "a.safetensors",
        "b.bin",
        "sub/c.pt",
    ]
    assert weights_digest(tmp_path / "nothing-here") is None


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sampled"):
        weights_digest(tmp_path, "fast")


def test_config_digest_ignores_where_it_was_written():
    base = {"hidden_size": 8, "text_config": {"layers": 2}}
    moved = {
        "_name_or_path": "/elsewhere",
        "transformers_version": "9.9",
        "text_config": {"layers": 2, "_name_or_path": "x"},
        "hidden_size": 8,
    }
    assert config_digest(base) == config_digest(moved)
    assert config_digest(base) != config_digest({**base, "hidden_size": 16})
