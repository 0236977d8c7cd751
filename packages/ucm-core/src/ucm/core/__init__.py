"""UCM core: engine-neutral KV-cache persistence.

Nothing here imports an inference engine.  The adapters (``ucm.vllm``, ``ucm.fastdeploy``)
and the copy kernels (``ucm.kernels``) translate an engine's types into the names this
front exports, and import nothing else of ucm.core but two public modules: the settings
users write (:mod:`ucm.core.config`) and the toolkit settings classes are made with
(:mod:`ucm.core.settings`).  Every other module is internal: it may change between
releases without notice.
"""

from ucm.core.block_format import BlockFormatError
from ucm.core.hybrid import (
    FULL,
    WINDOW,
    BlockRef,
    HybridLayout,
    KVGroup,
    plan_load,
    usable_hit,
    wa_lookup_boundaries,
)
from ucm.core.hybrid_store import key_rank, plan_dump, split_store_config
from ucm.core.keys import Namespace, block_keys, placed_extras, scoped_keys
from ucm.core.lifecycle import DumpTracker
from ucm.core.model_identity import DIGEST_MODES, config_digest, model_digest, weights_digest
from ucm.core.settings import ConfigError
from ucm.core.slicing import SliceWritePolicy, policy_from_env, write_sliced
from ucm.core.store import (
    KeyResult,
    Status,
    Store,
    Task,
    create_store,
    first_problem,
    verified_prefix,
)
from ucm.core.store.payload import Payload, address_of
from ucm.core.store.reads import SlotReads
from ucm.core.store.writes import SlotWrites
from ucm.core.threads import (
    format_cpus,
    memory_nodes,
    parse_cpus,
    place_store_threads,
    spare_cpus,
    store_pool,
)

__all__ = [
    "DIGEST_MODES",
    "FULL",
    "WINDOW",
    "BlockFormatError",
    "BlockRef",
    "ConfigError",
    "DumpTracker",
    "HybridLayout",
    "KVGroup",
    "KeyResult",
    "Namespace",
    "Payload",
    "SliceWritePolicy",
    "SlotReads",
    "SlotWrites",
    "Status",
    "Store",
    "Task",
    "address_of",
    "block_keys",
    "config_digest",
    "create_store",
    "first_problem",
    "format_cpus",
    "key_rank",
    "memory_nodes",
    "model_digest",
    "parse_cpus",
    "place_store_threads",
    "placed_extras",
    "plan_dump",
    "plan_load",
    "policy_from_env",
    "scoped_keys",
    "spare_cpus",
    "split_store_config",
    "store_pool",
    "usable_hit",
    "verified_prefix",
    "wa_lookup_boundaries",
    "weights_digest",
    "write_sliced",
]
