"""Run one vLLM engine in this process and print its outputs as JSON (used by the tests).

    python -m ucm.lab.testing.vllm.run_engine SPEC_JSON

SPEC: model, prompts (token id lists), max_tokens, store (a store dict or null: no
connector), extra (more kv_connector_extra_config), engine (more LLM kwargs), adapters
(per prompt, a LoRA adapter as [name, id, path] or null), images (per prompt, the seed of a
random 112-pixel image for the prompt's image token, or null), together (send the prompts
in one ``generate`` call; by default they go one at a time), processes ("one": the engine
core and its worker in this process, the default for one rank; "split": vLLM's default, the
engine core and each worker a process of its own, as ``vllm serve`` and ``LLM`` run by
default), fresh_prefix_cache (empty vLLM's
own prefix cache before each request, so that a repeat is served by the store), pause_after
and pause_dir (before request pause_after[k], create PAUSE_DIR/paused-k and wait for
PAUSE_DIR/resume-k: the test makes or mends a fault meanwhile), reload_before and
weights_path (before request reload_before, load the weights of weights_path into the
running engine in place, as reinforcement-learning loops do, then reset vLLM's prefix cache,
with the connector's unless reset_connector is false).
Every run computes on one thread a rank (pinned in a worker process, ../shared/DESIGN.md
section 3; vLLM's own limit in one process), so outputs of runs with and without the
connector are comparable bit for bit, as long as the requests go one at a time: vLLM CPU's
numerics move with the shape of the batch (logprobs by ~0.05).
"""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    engine = spec.get("engine", {})
    one_process = spec.get("processes", "one") == "one" and all(
        engine.get(k, 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size")
    )
    if one_process:
        # the engine core and its worker in this process (vLLM's in-process mode): half the
        # start-up of three processes each importing torch and vLLM (20 s against 50 here)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine = {"distributed_executor_backend": "uni", **engine}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        gpu_memory_utilization=0.3,
        seed=0,
        max_model_len=4096,
        disable_log_stats=False,
    )
    kw.update(engine)
    if isinstance(kw.get("kv_events_config"), dict):
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**kw["kv_events_config"])
    if spec.get("store") is not None:
        extra = {"store": spec["store"], **spec.get("extra", {})}
        kw["kv_transfer_config"] = {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(**kw)
    # the top two logprobs: the margin between them says how decisive each greedy pick was
    params = SamplingParams(
        temperature=0, max_tokens=spec.get("max_tokens", 8), logprobs=2, detokenize=False
    )
    images = spec.get("images") or [None] * len(spec["prompts"])
    prompts = [
        TokensPrompt(prompt_token_ids=p)
        if seed is None
        else TokensPrompt(prompt_token_ids=p, multi_modal_data={"image": _image(seed)})
        for p, seed in zip(spec["prompts"], images)
    ]
    together = bool(spec.get("together", False))
    loras = [_lora(a) for a in spec.get("adapters") or [None] * len(prompts)]
    t0 = time.perf_counter()
    took = [None] * len(prompts)
    resets = []
    if together:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    else:
        outputs = []
        for i, (p, lora) in enumerate(zip(prompts, loras)):
            if i in spec.get("pause_after", ()):
                _pause(spec["pause_dir"], spec["pause_after"].index(i))
            if i == spec.get("reload_before"):
                llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["weights_path"]})
                resets.append(_reset(llm, spec.get("reset_connector", True)))
            if spec.get("fresh_prefix_cache"):
                llm.reset_prefix_cache()
            started = time.perf_counter()
            outputs.append(llm.generate([p], params, use_tqdm=False, lora_request=lora)[0])
            took[i] = time.perf_counter() - started
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "together": together, "outputs": [], "resets": resets}
    for out, request_seconds in zip(outputs, took):
        completion = out.outputs[0]
        result["outputs"].append(
            {
                "seconds": request_seconds,
                "tokens": list(completion.token_ids),
                "logprobs": [
                    lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs)
                ],
                "margins": [_margin(lp) for lp in completion.logprobs],
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    result["metrics"] = _metrics(llm) if spec.get("store") is None else _settled(llm)
    print("RESULT " + json.dumps(result), flush=True)


def _reset(llm, connector: bool) -> list[bool]:
    """Reset vLLM's prefix cache, with the connector's if ``connector``, as an RL loop does
    after a weight update: vLLM's own fails while finished requests' blocks wait for their
    dumps, so the engine steps (the workers report the dumps) until it succeeds, at most
    ~10 s.  [vLLM's own reset, the one with the connector's]."""
    own = False
    for _ in range(1000):
        own = llm.reset_prefix_cache()
        if own:
            break
        llm.llm_engine.step()
        time.sleep(0.01)
    return [own, llm.reset_prefix_cache(reset_connector=True) if connector else own]


def _metrics(llm) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:ucm_") or metric.name == "vllm:num_preemptions":
            # summed over labels: a counter by cause is a series per cause
            value = getattr(metric, "value", None)
            if value is not None:
                metrics[metric.name] = metrics.get(metric.name, 0) + value
    return metrics


def _settled(llm, rounds: int = 25) -> dict[str, float]:
    """The metrics once the last dumps are counted.  A dump that ends after the engine's
    last step reaches the metrics only with a later step, so one-token requests (shorter
    than a block: nothing to look up, load or dump) step the engine until the dump counters
    hold still twice in a row (at most ``rounds`` of them)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tiny = TokensPrompt(prompt_token_ids=[1])
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)

    def dumps(metrics: dict[str, float]) -> tuple[float, float]:
        return metrics.get("vllm:ucm_dumped_blocks", 0), metrics.get("vllm:ucm_dump_errors", 0)

    metrics, still = _metrics(llm), 0
    for _ in range(rounds):
        time.sleep(0.1)
        llm.generate([tiny], params, use_tqdm=False)
        latest = _metrics(llm)
        still = still + 1 if dumps(latest) == dumps(metrics) else 0
        metrics = latest
        if still == 2:
            break
    return metrics


def _pause(folder: str, k: int) -> None:
    open(os.path.join(folder, f"paused-{k}"), "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(folder, f"resume-{k}")):
        if time.monotonic() > deadline:
            raise TimeoutError("no resume within 300 s")
        time.sleep(0.05)


def _image(seed: int):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _lora(adapter: list | None):
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    name, int_id, path = adapter
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def _margin(logprobs: dict) -> float:
    """The gap between the best and the second-best logprob at one position."""
    ranked = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


if __name__ == "__main__":
    main()
