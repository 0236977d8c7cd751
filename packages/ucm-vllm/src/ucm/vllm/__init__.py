"""UCM for vLLM: ``UCMConnector``, a KV connector loaded with ``kv_connector_module_path``."""

from ucm.vllm.connector import UCMConnector

__all__ = ["UCMConnector"]
