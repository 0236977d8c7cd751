"""UCM for vLLM: ``UCMConnector``, a KV connector loaded with ``kv_connector_module_path``.

The connector is imported on first use, so that ``ucm.vllm.config`` (the settings) can be
read without vLLM installed, e.g. by the documentation build.
"""

from typing import Any

__all__ = ["UCMConnector"]


def __getattr__(name: str) -> Any:
    if name == "UCMConnector":
        from ucm.vllm.connector import UCMConnector

        return UCMConnector
    raise AttributeError(f"module 'ucm.vllm' has no attribute {name!r}")
