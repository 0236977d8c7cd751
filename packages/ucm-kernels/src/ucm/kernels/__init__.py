"""ucm.kernels: move KV data between an engine's paged KV cache and store-block buffers.

``gather`` (dump side) copies engine blocks of many layers into one contiguous buffer per
store block, in the canonical layout of :mod:`ucm.kernels.spec`; ``scatter`` (load side) is
the reverse.  A Triton kernel runs on a GPU; a torch fallback runs everywhere else.
:func:`block_segments` gives a payload as views of the cache memory instead, where the
layout makes it one (on the CPU: then a store reads and writes the caches in place).
:class:`HostStager` moves the same payloads between a GPU and pinned host buffers on a side
stream; :class:`PinnedRegions` registers a store's own host memory with the CUDA driver, so
that those copies go straight into and out of it.  :mod:`ucm.kernels.mover` is what the
engine adapters drive: one mover of blocks between their caches and a store, the route of
each batch chosen by one rule.
"""

from ucm.kernels.api import (
    BACKENDS,
    execute,
    gather,
    payload_layout,
    payload_nbytes,
    resolve_backend,
    scatter,
    triton_available,
)
from ucm.kernels.layouts import logical_view
from ucm.kernels.pinning import PinnedRegions, dump_into
from ucm.kernels.reference import gather_reference, scatter_reference
from ucm.kernels.segments import BlockSegments, block_segments
from ucm.kernels.spec import SUPPORTED_DTYPES, CacheSpec, PayloadLayout, make_layout
from ucm.kernels.staging import IN_PLACE_MIN_BYTES, HostStager, TransferHandle, alloc_host_buffers
from ucm.kernels.validate import TransferPlan, build_plan, describe_caches

__all__ = [
    "BACKENDS",
    "BlockSegments",
    "SUPPORTED_DTYPES",
    "CacheSpec",
    "HostStager",
    "IN_PLACE_MIN_BYTES",
    "PayloadLayout",
    "PinnedRegions",
    "TransferHandle",
    "TransferPlan",
    "alloc_host_buffers",
    "block_segments",
    "build_plan",
    "describe_caches",
    "dump_into",
    "execute",
    "gather",
    "gather_reference",
    "logical_view",
    "make_layout",
    "payload_layout",
    "payload_nbytes",
    "resolve_backend",
    "scatter",
    "scatter_reference",
    "triton_available",
]
