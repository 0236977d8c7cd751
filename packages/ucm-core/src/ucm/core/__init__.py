"""UCM core: engine-neutral KV-cache persistence.

Nothing here imports an inference engine.  The adapters (``ucm.vllm``, ``ucm.fastdeploy``)
translate an engine's types into the names defined here.
"""

from ucm.core.block_format import BlockFormatError
from ucm.core.keys import Namespace, block_keys
from ucm.core.settings import ConfigError
from ucm.core.store import KeyResult, Status, Store, Task, create_store

__all__ = [
    "BlockFormatError",
    "ConfigError",
    "KeyResult",
    "Namespace",
    "Status",
    "Store",
    "Task",
    "block_keys",
    "create_store",
]
