"""The sorting of a server's samples into vLLM's work and each connector's."""

from ucm.lab.vllm.profile import RATE, classify, connector_share, cpu_seconds

SITE = "/venv/lib/python3.11/site-packages"
PROCS = 'process 10:"vllm serve";process 11:"VLLM::EngineCore";'
STEP = f"run_engine_core ({SITE}/vllm/v1/engine/core.py:900);step ({SITE}/vllm/v1/engine/core.py:4)"
RUN = f"{STEP};CPUModelRunner.execute_model ({SITE}/vllm/v1/worker/cpu_model_runner.py:20)"
LOAD = (
    f"{RUN};UCMConnector.start_load_kv ({SITE}/ucm/vllm/connector.py:173);"
    f"Worker.start_load_kv ({SITE}/ucm/vllm/worker.py:300)"
)
FORWARD = f"{RUN};LlamaModel.forward ({SITE}/vllm/model_executor/models/llama.py:9)"
LOOKUP = (
    f"{STEP};Scheduler.schedule ({SITE}/vllm/v1/core/sched/scheduler.py:500);"
    f"UCMConnector.get_num_new_matched_tokens ({SITE}/ucm/vllm/connector.py:133)"
)
COPY = (
    "Thread._bootstrap (/usr/lib/python3.11/threading.py:995);"
    f"work ({SITE}/ucm/core/store/dram/shared.py:216)"
)
LMCACHE = (
    f"{RUN};LMCacheMPConnector.wait_for_save "
    f"({SITE}/lmcache/integration/vllm/lmcache_mp_connector.py:700)"
)
# a hook of vLLM's own base class, in a repository checked out under a folder named ucm
BASE_HOOK = f"{STEP};KVConnectorBase_V1.wait_for_save (/home/ucm/vllm/kv_connector/v1/base.py:9)"


def test_a_stack_goes_under_the_connector_hook_vllm_called_first():
    assert classify(LOAD.split(";")) == "connector.start_load_kv"
    assert classify(LOOKUP.split(";")) == "connector.get_num_new_matched_tokens"
    assert classify(LMCACHE.split(";")) == "connector.wait_for_save"
    assert classify(FORWARD.split(";")) == "forward"
    assert classify(COPY.split(";")) == "store threads"
    assert classify(BASE_HOOK.split(";")) == "other"  # not a connector's own work


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
