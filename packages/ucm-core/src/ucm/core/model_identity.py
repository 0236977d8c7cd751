"""What names a model in every key: digests of its configuration and of its weights' content.

A model's path names nothing.  The same weights are mounted at different paths on different
hosts (their blocks must be shared), and new weights get written over an old path (their
blocks must never be). So keys are seeded by the content that decides the KV: the model's
configuration and its weights.

Weights are named cheaply and surely:

* a file of a hub snapshot is a link to a blob named by the SHA-256 of its content: that name
  is taken, nothing is read;
* any other file is read in part (``sampled``: its size, a safetensors file's header with every
  tensor's name, dtype, shape and offsets, and 64 pieces of 64 KiB spread over the whole
  file, so any retraining or fine-tuning changes it) or whole (``full``: every byte);
* digests are kept in a small cache keyed by the file's path, size, inode, modification and
  change times, so a start-up on a model seen before only stats its files.  The change time
  moves on every write and cannot be set back, so a file rewritten in place is read again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

log = logging.getLogger(__name__)

#: files that hold weights, as the engines load them
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: read modes of weight files (see the module docstring)
DIGEST_MODES = ("sampled", "full")
SAMPLES = 64
SAMPLE_BYTES = 64 << 10
_PIECE = 8 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")
#: configuration entries that name where or by what a configuration was written, not the model
VOLATILE_CONFIG_KEYS = frozenset(
    {"_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation_autoset"}
)
_CACHE_FILE = "weights-digests.json"


def default_cache_dir() -> Path:
    """``$UCM_CACHE_DIR``, else ``$XDG_CACHE_HOME/ucm``, else ``~/.cache/ucm``."""
    own = os.environ.get("UCM_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucm"


def config_digest(config: Mapping[str, Any]) -> str:
    """A digest of a model configuration (a parsed config.json): canonical JSON, without
    the entries that name where or by which library version it was written."""
    canonical = json.dumps(_strip(config), sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    return value


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a model: ``path`` itself if it is one, else those in the folder
    and its sub-folders (two levels, hidden ones skipped), in name order."""
    root = Path(path)
    if root.is_file():
        return [root] if root.name.endswith(WEIGHT_SUFFIXES) else []
    found = []
    for depth in ("*", "*/*", "*/*/*"):
        for file in root.glob(depth):
            relative = file.relative_to(root).parts
            if any(part.startswith(".") for part in relative):
                continue
            if file.name.endswith(WEIGHT_SUFFIXES) and file.is_file():
                found.append(file)
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def weights_digest(
    path: str | os.PathLike[str],
    mode: str = "sampled",
    cache_dir: str | os.PathLike[str] | None = None,
) -> str | None:
    """A digest of the content of a model's weight files (``None``: there are none).

    ``mode``: ``sampled`` or ``full`` (see the module docstring); ``cache_dir``: where the
    per-file digests are kept (default :func:`default_cache_dir`; unwritable: not kept).
    """
    if mode not in DIGEST_MODES:
        raise ValueError(f"weights digest mode must be one of {DIGEST_MODES}, got {mode!r}")
    files = weight_files(path)
    if not files:
        return None
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    cache = _DigestCache(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    whole = xxhash.xxh3_128()
    for file in files:
        name = file.relative_to(root).as_posix().encode()
        whole.update(len(name).to_bytes(4, "little") + name)
        whole.update(cache.digest(file, mode).encode())
    cache.save()
    return whole.hexdigest()


def model_digest(
    path: str | os.PathLike[str],
    mode: str = "sampled",
    cache_dir: str | os.PathLike[str] | None = None,
) -> str:
    """What names the model in a folder: ``config:<digest>|weights:<digest>``, from its
    ``config.json`` and its weight files.  ``ValueError`` when the folder has neither."""
    parts = []
    config = Path(path, "config.json")
    if config.is_file():
        try:
            parts.append("config:" + config_digest(json.loads(config.read_text())))
        except ValueError as exc:
            raise ValueError(f"{config} is not valid JSON: {exc}") from None
    weights = weights_digest(path, mode, cache_dir)
    if weights is not None:
        parts.append("weights:" + weights)
    if not parts:
        raise ValueError(
            f"{path} holds no config.json and no weight files ({', '.join(WEIGHT_SUFFIXES)})"
        )
    return "|".join(parts)


def file_digest(file: Path, mode: str) -> str:
    """The digest of one weight file, computed (see :func:`weights_digest` for the cache)."""
    blob = _hub_blob(file)
    if blob is not None:
        return f"sha256:{blob}"
    hasher = xxhash.xxh3_128()
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hasher.update(size.to_bytes(8, "little"))
        if mode == "full":
            for piece in iter(lambda: f.read(_PIECE), b""):
                hasher.update(piece)
            return f"full:{hasher.hexdigest()}"
        if file.name.endswith(".safetensors"):
            hasher.update(_safetensors_header(f, size))
        for offset in _sample_offsets(size):
            f.seek(offset)
            hasher.update(f.read(SAMPLE_BYTES))
    return f"sampled:{hasher.hexdigest()}"


def _hub_blob(file: Path) -> str | None:
    """The content hash a hub cache names a file's blob by, if it is a link to one."""
    if not file.is_symlink():
        return None
    target = file.resolve()
    if target.parent.name == "blobs" and _HUB_BLOB.fullmatch(target.name):
        return target.name
    return None


def _safetensors_header(f: BinaryIO, size: int) -> bytes:
    head = f.read(8)
    if len(head) < 8:
        return head
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, _MAX_SAFETENSORS_HEADER):
        return head  # not a safetensors header: the samples still cover the file
    return head + f.read(length)


def _sample_offsets(size: int) -> Iterable[int]:
    if size <= SAMPLES * SAMPLE_BYTES:
        return range(0, size, SAMPLE_BYTES)  # small: every byte
    last = size - SAMPLE_BYTES
    return sorted({last * i // (SAMPLES - 1) for i in range(SAMPLES)})


class _DigestCache:
    """Per-file digests kept between start-ups, keyed by what changes when a file does."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / _CACHE_FILE
        self.entries: dict[str, str] = {}
        self.changed = False
        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict):
                self.entries = {str(k): str(v) for k, v in loaded.items()}
        except (OSError, ValueError):
            pass  # no cache yet, or an unreadable one: start afresh

    def digest(self, file: Path, mode: str) -> str:
        st = file.stat()
        name = f"{file.resolve()}|{mode}|"
        key = f"{name}{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"
        found = self.entries.get(key)
        if found is None:
            # the file changed: what was kept for its earlier content is of no more use
            for stale in [k for k in self.entries if k.startswith(name)]:
                del self.entries[stale]
            found = self.entries[key] = file_digest(file, mode)
            self.changed = True
        return found

    def save(self) -> None:
        if not self.changed:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("ucm: weights digests not cached in %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
