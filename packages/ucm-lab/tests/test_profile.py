"""The sorting of a server's samples into vLLM's work and each connector's."""

from ucm.lab.vllm.profile import RATE, classify, connector_share, cpu_seconds

PROCS = 'process 10:"vllm serve";process 11:"VLLM::EngineCore";thread (0x7f01);'
STEP = "run_engine_core (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:400)"
LOAD = (
    f"{STEP};execute_model (vllm/v1/worker/gpu_model_runner.py:2000);"
    "start_load_kv (ucm/vllm/connector.py:173);load (ucm/vllm/worker.py:300)"
)
FORWARD = f"{STEP};execute_model (vllm/v1/worker/gpu_model_runner.py:2000);forward (llama.py:9)"
LOOKUP = (
    f"{STEP};schedule (vllm/v1/core/sched/scheduler.py:500);"
    "get_num_new_matched_tokens (ucm/vllm/connector.py:133);lookup (ucm/vllm/scheduler.py:90)"
)
COPY = "_worker (concurrent/futures/thread.py:83);work (ucm/core/store/dram/shared.py:216)"
LMCACHE = (
    f"{STEP};execute_model (vllm/v1/worker/gpu_model_runner.py:2000);"
    "wait_for_save (lmcache/integration/vllm/lmcache_mp_connector.py:700)"
)
BASE_HOOK = f"{STEP};wait_for_save (vllm/distributed/kv_transfer/kv_connector/v1/base.py:9)"


def test_a_stack_goes_under_the_connector_hook_vllm_called_first():
    assert classify(LOAD.split(";")) == "connector.start_load_kv"
    assert classify(LOOKUP.split(";")) == "connector.get_num_new_matched_tokens"
    assert classify(LMCACHE.split(";")) == "connector.wait_for_save"
    assert classify(FORWARD.split(";")) == "forward"
    assert classify(COPY.split(";")) == "store threads"
    # a hook of vLLM's own base class is not a connector's work
    assert classify(BASE_HOOK.split(";")) == "other"


def test_cpu_seconds_sums_samples_by_part_and_skips_what_is_not_a_sample():
    raw = "\n".join(
        [
            f"{PROCS}{LOAD} {RATE}",
            f"{PROCS}{LOAD} {RATE // 2}",
            f"{PROCS}{FORWARD} {3 * RATE}",
            f"{PROCS}{COPY} {RATE // 4}",
            "",
            "garbage",
        ]
    )
    seconds = cpu_seconds(raw)
    assert seconds == {
        "connector.start_load_kv": 1.5,
        "forward": 3.0,
        "store threads": 0.25,
    }
    assert connector_share(seconds) == 1.75
