"""UCM for FastDeploy: an AttentionStore and a KVCacheStorage backend over UCM stores.

``AttentionStore`` implements FastDeploy's AttentionStore contract (query, write in slices,
read, flush_token_index); ``UCMStorage`` the ``KVCacheStorage`` contract of its mooncake and
file backends.  Names are imported on first use, so ``ucm.fastdeploy.config`` (and the docs
build) need neither torch nor paddle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionStore": "ucm.fastdeploy.attention_store",
    "AttentionStoreConfig": "ucm.fastdeploy.attention_store",
    "FastDeployConfig": "ucm.fastdeploy.config",
    "UCMStorage": "ucm.fastdeploy.storage",
    "load_config": "ucm.fastdeploy.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ucm.fastdeploy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
