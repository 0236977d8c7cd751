"""``vllm serve`` with UCMConnector, driven over HTTP by an OpenAI client as users drive it.
Its posix servers are started by ``examples/vllm/serve_posix.sh``, and the metric names of
docs/vllm.md and of the Grafana dashboard are checked against what they serve.

The model is the tiny Llama with seeded random weights, its tokenizer a word-level one made
locally with a chat template.  The reference is a server without the connector; every
comparison sends its requests one at a time (vLLM CPU's numerics move with the batch).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from ucm.lab.testing.vllm.engine import mooncake_store, run_engine, shared_prefix_prompts
from ucm.lab.testing.vllm.models import make_word_tokenizer, words
from ucm.lab.testing.vllm.serve import Server, assert_same, chat, complete
from ucm.lab.vllm.serve_process import sample_values, serve_command

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[3]
POSIX_EXAMPLE = ROOT / "examples" / "vllm" / "serve_posix.sh"
DASHBOARD = ROOT / "examples" / "grafana" / "ucm-dashboard.json"
ALERTS = ROOT / "examples" / "grafana" / "ucm-alerts.yaml"
DOCS = ROOT / "docs" / "vllm.md"
METRIC = re.compile(r"vllm:[a-z_:]+")

PROMPTS = shared_prefix_prompts(3, prefix=1000, tail=100, seed=4)
# the chat: a 600-word system prompt (2 store blocks of 256 tokens with the template)
SYSTEM = shared_prefix_prompts(1, prefix=600, tail=0, seed=6)[0]
QUESTION = shared_prefix_prompts(1, prefix=40, tail=0, seed=7)[0]
MESSAGES = [
    {"role": "system", "content": words(SYSTEM)},
    {"role": "user", "content": words(QUESTION)},
]
FILLER = 9  # a token no prompt holds: what follows a primer's cached part
# prompts sent together, in flight when the server is stopped
LATE = shared_prefix_prompts(4, prefix=1200, tail=300, seed=5)
# SIGTERM lets the requests in flight finish for this long: with vLLM's default (0) they
# are aborted, and vLLM 0.32's HTTP server was seen waiting for their clients to give up
# before it exits
DRAIN_S = 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(make_word_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_logs")


@pytest.fixture(scope="module")
def reference(tiny_model, tokenizer, logs):
    """The answers of a server without the connector, computed as each run compared with
    them computes: ``cold`` is the first server's sequence; for ``warm``, vLLM's own prefix
    cache holds exactly the store's hit before each request, computed as the first server
    computed it.

    That is what makes an exact comparison hold: a prefill that starts after a cached
    prefix runs another attention path than one from token 0, and KV computed in a prefill
    of another length differs in its last bits; either moves a logprob by up to ~1e-2 here.
    So each warm answer is primed by the same prefills that the first server ran to write
    the blocks the warm server loads, with the tokens after the hit replaced by FILLER."""
    from transformers import AutoTokenizer

    words_tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    text = words_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = words_tokenizer.encode(text, add_special_tokens=False)  # as vLLM tokenizes it
    server = Server(
        tiny_model, tokenizer, logs / "reference.log", env={"VLLM_SERVER_DEV_MODE": "1"}
    ).wait_ready()
    try:
        client = server.client()

        def primed(before: list[list[int]], prompt: list[int], hit: int) -> None:
            server.reset_prefix_cache()
            for earlier in before:
                complete(client, earlier, max_tokens=1)
            complete(client, prompt[:hit] + [FILLER] * (len(prompt) - hit), max_tokens=1)

        cold = {
            "completions": [complete(client, p) for p in PROMPTS],
            "chat": chat(client, MESSAGES),
        }
        warm: dict = {"completions": []}
        # the first server wrote prompt 0 from token 0, prompts 1 and 2 after prompt 0's
        # 992 tokens (31 engine blocks) cached; the warm server loads 4 store blocks each
        for i, prompt in enumerate(PROMPTS):
            primed(PROMPTS[:1] if i else [], prompt, 1024)
            warm["completions"].append(complete(client, prompt))
        primed([], chat_ids, 512)  # the chat's 2 store blocks, written from token 0
        warm["chat"] = chat(client, MESSAGES)
        assert [a["cached_tokens"] for a in warm["completions"]] == [1024] * 3, warm
        assert warm["chat"]["cached_tokens"] == 512, warm["chat"]
        return {"cold": cold, "warm": warm}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ucm_store"))


def posix_example(tiny_model, tokenizer, log, store_dir, args=()) -> Server:
    """The server of ``examples/vllm/serve_posix.sh`` on ``store_dir``, as a user starts it:
    this module's posix servers are the example's (its test is here)."""
    return Server(
        tiny_model, tokenizer, log, args=args, launcher=["bash", str(POSIX_EXAMPLE)],
        env={"UCM_STORE": store_dir, "UCM_CAPACITY": "1", "VLLM_SERVE": " ".join(serve_command())},
    ).wait_ready()  # fmt: skip


@pytest.fixture(scope="module")
def cold(tiny_model, tokenizer, logs, store_dir):
    server = posix_example(
        tiny_model, tokenizer, logs / "cold.log", store_dir, ["--shutdown-timeout", str(DRAIN_S)]
    )
    yield server
    server.kill()


@pytest.fixture(scope="module")
def served():
    """What the warm posix server served on /metrics, for the checks of the names."""
    return {}


def wait_for_metric(server: Server, name: str, at_least: float, timeout: float = 30) -> dict:
    """The metrics once ``name`` reaches ``at_least`` (vLLM publishes them after a step)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if metrics.get(name, 0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def test_completions_chat_and_streaming_match_vllm_alone(cold, reference):
    client = cold.client()
    for prompt, want in zip(PROMPTS, reference["cold"]["completions"]):
        assert_same(want, complete(client, prompt))
    answer = chat(client, MESSAGES)
    assert_same(reference["cold"]["chat"], answer)
    assert answer["text"].split() == [f"w{t - 8}" for t in answer["tokens"]]
    # streaming: the same text in pieces, and the usage at the end
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces, usage = [], None
    for chunk in stream:
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == reference["cold"]["completions"][0]["text"]
    assert len(pieces) > 1
    # a repeat is vLLM's own prefix-cache hit (31 engine blocks of 32 tokens)
    assert usage.prompt_tokens_details.cached_tokens >= 992
    # 4 store blocks of 256 tokens per prompt (3 shared) and 2 for the chat
    metrics = wait_for_metric(cold, "vllm:ucm_dumped_blocks_total", 3 + 3 + 2)
    assert metrics["vllm:ucm_dumped_blocks_total"] >= 3 + 3 + 2, metrics
    assert metrics.get("vllm:ucm_dump_errors_total", 0) == 0


def test_sigterm_with_dumps_in_flight_exits_clean_and_leaves_valid_blocks(cold, store_dir):
    before = cold.metrics().get("vllm:ucm_dumped_blocks_total", 0)
    client = cold.client()
    answers: list = []

    def send(prompt: list[int]) -> None:
        try:
            answers.append(complete(client, prompt, max_tokens=16))
        except Exception as exc:  # the server going away mid-request
            answers.append(exc)

    finished_before = cold.metrics().get("vllm:request_success_total", 0)
    threads = [threading.Thread(target=send, args=(p,), daemon=True) for p in LATE]
    for thread in threads:
        thread.start()
    # stop once the first blocks of these prompts are handed to the store (each store block
    # is dumped as the prefill completes it), while the rest are still being computed, and
    # once every request has reached the engine: vLLM's server never answers one that
    # arrives after SIGTERM, nor exits while it waits
    deadline = time.monotonic() + 120
    while True:
        metrics = cold.metrics()
        arrived = (
            metrics.get("vllm:num_requests_running", 0)
            + metrics.get("vllm:num_requests_waiting", 0)
            + metrics.get("vllm:request_success_total", 0)
            - finished_before
        )
        dumping = metrics.get("vllm:ucm_dumped_blocks_total", 0) > before
        if (dumping and arrived >= len(LATE)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metrics["vllm:ucm_dumped_blocks_total"] > before, "no dump started"
    assert arrived >= len(LATE), metrics
    running = metrics.get("vllm:num_requests_running", 0) + metrics.get(
        "vllm:num_requests_waiting", 0
    )
    code, seconds = cold.stop(timeout=30)
    print(f"SIGTERM with {running:g} requests in flight: exit {code} in {seconds:.2f} s")
    assert code == 0, cold.log()[-4000:]
    assert seconds < 30
    for thread in threads:
        thread.join(10)
    print("answers:", [a if isinstance(a, Exception) else len(a["tokens"]) for a in answers])
    files = [f for f in Path(store_dir, "blocks").rglob("*") if f.is_file()]
    # vLLM stops its workers at once after the last request: a write cut short leaves a
    # temporary file, never a block
    torn = [f for f in files if f.name.startswith(".")]
    print(f"{len(files) - len(torn)} blocks published, {len(torn)} writes cut short")
    assert len(files) - len(torn) >= 3 + 3 + 2 + 1
    verify = subprocess.run(
        [str(Path(sys.executable).parent / "ucm"), "store", "verify", store_dir],
        capture_output=True, text=True,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_fresh_server_on_the_same_store_hits_and_matches(
    tiny_model, tokenizer, logs, store_dir, reference, cold, served
):
    assert cold.proc.poll() is not None  # the first server is gone
    # vLLM configures only its own logger: UCM's start-up line must reach its log anyway
    assert "UCMConnector active: store posix at " in cold.log()
    server = posix_example(tiny_model, tokenizer, logs / "warm.log", store_dir)
    try:
        client = server.client()
        for prompt, want in zip(PROMPTS, reference["warm"]["completions"]):
            answer = complete(client, prompt)
            assert_same(want, answer)
            assert answer["cached_tokens"] == 1024, answer  # 4 store blocks
        answer = chat(client, MESSAGES)
        assert_same(reference["warm"]["chat"], answer)
        assert answer["cached_tokens"] == 512, answer
        # prompt 0 loads 4 store blocks; prompts 1 and 2 only the last (vLLM holds prompt
        # 0's 992 shared tokens itself); the chat 2
        metrics = wait_for_metric(server, "vllm:ucm_loaded_blocks_total", 4 + 1 + 1 + 2)
        assert metrics["vllm:ucm_loaded_blocks_total"] >= 4 + 1 + 1 + 2, metrics
        assert metrics["vllm:ucm_lookup_hit_tokens_total"] >= 1024 + 32 + 32 + 512
        assert metrics.get("vllm:ucm_load_errors_total", 0) == 0
        served["text"] = server.metrics_text()
    finally:
        code, _ = server.stop()
    assert code == 0


def test_the_documented_metrics_are_what_the_server_serves(served):
    if "text" not in served:
        pytest.skip("the warm server did not run")
    names = {n for n in served_names(served["text"]) if n.startswith("vllm:ucm_")}
    serving = {n for n in names if not n.endswith("_created")}
    documented = {n for n in METRIC.findall(DOCS.read_text()) if n.startswith("vllm:ucm_")}
    assert documented == serving, (
        f"documented, not served: {sorted(documented - serving)}; "
        f"served, not documented: {sorted(serving - documented)}"
    )
    # the gauges of a posix store with a capacity, and the requests it looked up
    values = sample_values(served["text"])
    assert values["vllm:ucm_store_up"] == 1
    assert values["vllm:ucm_store_bytes"] > 0 and values["vllm:ucm_store_blocks"] >= 10
    assert values["vllm:ucm_store_capacity_bytes"] == 2**30
    assert values["vllm:ucm_lookup_requests_total"] >= 4
    assert values["vllm:ucm_lookup_tokens_total"] >= values["vllm:ucm_lookup_hit_tokens_total"]


def test_every_metric_of_the_grafana_dashboard_and_alerts_is_served(served):
    if "text" not in served:
        pytest.skip("the warm server did not run")
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 8, exprs
    rules = yaml.safe_load(ALERTS.read_text())
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    named = {n for expr in exprs for n in METRIC.findall(expr)}
    missing = named - served_names(served["text"])
    assert not missing, f"the dashboard names metrics the server does not serve: {missing}"
    ucm = {n for n in named if n.startswith("vllm:ucm_")}
    assert ucm <= set(METRIC.findall(DOCS.read_text())), ucm


def served_names(text: str) -> set[str]:
    """Every sample name of a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


# A client gives up while its prefix is still being read from a slow store.
SLOW = shared_prefix_prompts(1, prefix=2800, tail=200, seed=8)[0]  # 11 store blocks, 2.75 MiB


def engine_busy(server: Server) -> tuple[float, float, float]:
    """(requests running or waiting, KV-cache usage, steps taken so far)."""
    m = server.metrics()
    return (
        m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0),
        m.get("vllm:kv_cache_usage_perc", 0),
        m.get("vllm:iteration_tokens_total_count", 0),
    )


def test_a_client_that_leaves_while_its_kv_loads_is_released(
    mooncake_hosts, tiny_model, tokenizer, logs
):
    lab, master, _ = mooncake_hosts
    store = mooncake_store(master, timeout_s=30.0)
    run_engine({"model": tiny_model, "prompts": [SLOW], "store": store, "processes": "split"},
               prefix=lab.command("a", []))  # fmt: skip
    cpu = max(os.sched_getaffinity(0))  # the store's threads run there (store_cpus)
    server = Server(
        tiny_model, tokenizer, logs / "slow.log", store=store,
        extra={"load_mode": "async", "store_cpus": str(cpu)},
        host=lab.address("b"), prefix=lab.command("b", []),
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
    ).wait_ready()  # fmt: skip
    try:
        assert f"the store's threads run on CPUs {cpu} (this worker computes on" in server.log()
        lab.throttle("m", 2_000)  # the pool's host sends 2 Mbit/s: the load takes ~10 s
        try:
            with pytest.raises(Exception, match="(?i)time"):
                complete(server.client(timeout=3), SLOW)  # the client gives up after 3 s
            loading = wait_for_metric(server, "vllm:ucm_loaded_blocks_total", 1, timeout=0)
            assert loading.get("vllm:ucm_loaded_blocks_total", 0) == 0  # still loading
            deadline = time.monotonic() + 20
            while engine_busy(server)[:2] != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.5)
            pending, usage, steps = engine_busy(server)
            assert (pending, usage) == (0, 0), "the aborted request still holds its blocks"
            time.sleep(2)
            assert engine_busy(server)[2] == steps, "the engine keeps stepping with no request"
        finally:
            lab.throttle("m", None)
        # The store and the engine serve on: the same prompt loads again once the link is
        # back.  A transfer Mooncake saw stall may hold its client until its own timeout
        # (30 s without progress): a request meanwhile waits load_timeout_s and is computed.
        deadline = time.monotonic() + 120
        while True:
            server.reset_prefix_cache()  # a hit can only come from the store
            answer = complete(server.client(), SLOW)
            if answer["cached_tokens"] >= 2816 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert answer["cached_tokens"] >= 2816, answer
    finally:
        code, _ = server.stop()
    assert code == 0


def _post(server: Server, path: str, body: dict | None = None) -> dict:
    import urllib.request

    data = json.dumps(body or {}).encode()
    ask = urllib.request.Request(f"{server.url}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(ask, timeout=120) as answer:
        text = answer.read().decode()
    return json.loads(text) if text else {}


def _cached_by_source(server: Server) -> dict[str, float]:
    """vllm:prompt_tokens_cached_by_source by its source label."""
    out: dict[str, float] = {}
    for line in server.metrics_text().splitlines():
        found = re.match(r'vllm:prompt_tokens_cached_by_source_total\{.*source="(\w+)".*\} (\S+)',
                         line)  # fmt: skip
        if found:
            out[found[1]] = out.get(found[1], 0.0) + float(found[2])
    return out


def _reset(server: Server, external: bool) -> None:
    """POST /reset_prefix_cache until vLLM's own cache lets go (the blocks of finished
    requests come back once their dumps are reported, a step or two)."""
    path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
    deadline = time.monotonic() + 30
    while not _post(server, path)["success"]:
        assert time.monotonic() < deadline, "vLLM's prefix cache was never reset"
        time.sleep(0.2)


def test_hits_by_tier_and_a_weight_update_with_the_reset_endpoint(
    tiny_model, tokenizer, logs, tmp_path, shm_dir
):
    """A tiered store: blocks still in host memory count as host hits in
    ``vllm:prompt_tokens_cached_by_source``, those only on its disk as disk hits.  Then an
    RL-style weight update over HTTP (``/collective_rpc reload_weights``) and ``POST
    /reset_prefix_cache?reset_external=true``: the same prompt loads nothing stored before
    and is computed anew; what the new weights store then hits."""
    from ucm.lab.testing.vllm.models import make_tiny_llama

    on_disk, in_memory = (shared_prefix_prompts(1, prefix=1000, tail=100, seed=s)[0]
                          for s in (11, 12))  # fmt: skip
    disk = {"kind": "posix", "path": str(tmp_path / "disk")}
    run_engine({"model": tiny_model, "prompts": [on_disk], "store": disk})
    new_weights = make_tiny_llama(tmp_path / "new_weights", seed=1)
    store = {"kind": "tiered", "dram": {"capacity_gb": 0.0625, "path": str(shm_dir)},
             "backing": disk}  # fmt: skip
    server = Server(tiny_model, tokenizer, logs / "tiers.log", store=store,
                    env={"VLLM_SERVER_DEV_MODE": "1"}).wait_ready()  # fmt: skip
    try:
        client = server.client()
        complete(client, in_memory)  # stored in both tiers
        _reset(server, external=False)  # vLLM's own cache: the store serves the repeats
        assert complete(client, on_disk)["cached_tokens"] == 1024
        assert complete(client, in_memory)["cached_tokens"] == 1024
        by_source = _cached_by_source(server)
        assert by_source.get("disk") == 1024 and by_source.get("host") == 1024, by_source

        before = complete(client, on_disk)  # vLLM's own cache: the same KV, old weights
        _post(
            server,
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(new_weights)}},
        )
        _reset(server, external=True)
        loaded = server.metrics()["vllm:ucm_loaded_blocks_total"]
        fresh = complete(client, on_disk)
        assert fresh["cached_tokens"] == 0  # nothing stored before the reset is loaded
        assert server.metrics()["vllm:ucm_loaded_blocks_total"] == loaded
        assert fresh["logprobs"] != before["logprobs"]  # the new weights answer
        _reset(server, external=False)
        again = complete(client, on_disk)  # stored after the reset: loads
        assert again["cached_tokens"] == 1024
    finally:
        code, _ = server.stop()
    assert code == 0
