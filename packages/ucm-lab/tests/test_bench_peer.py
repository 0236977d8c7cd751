"""The peer-client benchmark: what vLLM's client is given, what is read from its results,
the reuse check and the ratios; and a small run of it against real servers."""

from __future__ import annotations

import json
import sys

import pytest
from ucm.lab.vllm import bench_peer
from ucm.lab.vllm.bench_peer import (
    Starters,
    check_reuse,
    client_args,
    dtype,
    forked_client,
    kv_space_gib,
    ratios,
    read_result,
    reused_tokens,
)


def _args(**kw):
    return bench_peer.argparse.Namespace(
        **{"prefixes": 3, "suffix": 64, "output": 4, "seed": 7, **kw}
    )


def test_the_client_runs_without_its_readiness_probe_or_warm_up_and_saves_each_request(tmp_path):
    argv = client_args("http://h:1", "/tok", 2048, _args(), 4, tmp_path / "r.json")
    flag = {a: b for a, b in zip(argv, [*argv[1:], ""]) if a.startswith("--")}
    # a probe or a warm-up request would compute a prompt of the run before it is timed
    assert flag["--ready-check-timeout-sec"] == "0" and flag["--num-warmups"] == "0"
    assert flag["--dataset-name"] == "prefix_repetition"
    assert flag["--prefix-repetition-prefix-len"] == "2048"
    assert flag["--num-prompts"] == flag["--prefix-repetition-num-prefixes"] == "3"
    assert flag["--max-concurrency"] == "4"
    assert flag["--seed"] == str(7 + 2048)  # a length's prompts: the same in both passes
    assert "--save-detailed" in argv and flag["--metric-percentiles"] == "50,90,99"


def test_a_result_gives_ttft_percentiles_in_seconds(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({
        "completed": 3, "failed": 0, "mean_ttft_ms": 20.0, "p50_ttft_ms": 10.0,
        "p90_ttft_ms": 30.0, "p99_ttft_ms": 40.0, "ttfts": [0.01, 0.02, 0.04],
    }))  # fmt: skip
    got = read_result(path)
    assert (got["ttft_p50_s"], got["ttft_p90_s"], got["ttft_p99_s"]) == (0.01, 0.03, 0.04)
    assert got["completed"] == 3 and got["failed"] == 0 and got["ttfts_s"] == [0.01, 0.02, 0.04]


def _run(system, length=512, concurrency=1, reused=0, p50=1.0):
    return {"system": system, "length": length, "concurrency": concurrency,
            "reused_tokens": reused, "ttft_p50_s": p50, "ttft_p90_s": 2 * p50,
            "ttft_p99_s": 3 * p50}  # fmt: skip


def test_every_system_but_the_cold_one_must_reuse_what_the_floor_reuses():
    runs = [_run("vllm", reused=0), _run("vllm-floor", reused=4000),
            _run("ucm-dram", reused=4000), _run("lmcache", reused=3968)]  # fmt: skip
    assert check_reuse(runs, prefixes=3) == [
        "lmcache reused 3968 tokens of 512-token prefixes at concurrency 1, the floor 4000"
    ]
    assert (
        reused_tokens(
            {"vllm:prefix_cache_hits_total": 10.0},
            {"vllm:prefix_cache_hits_total": 30.0, "vllm:external_prefix_cache_hits_total": 5.0},
        )
        == 25
    )


def test_ratios_are_per_length_and_concurrency():
    runs = [_run("vllm-floor", p50=0.1), _run("ucm-dram", p50=0.11),
            _run("ucm-dram", concurrency=4, p50=0.5)]  # fmt: skip
    got = ratios(runs, "vllm-floor")
    assert len(got) == 1 and got[0]["system"] == "ucm-dram"
    assert got[0]["ttft_p50_s"] == pytest.approx(1.1) == got[0]["ttft_p99_s"]
    assert "| 512 | 1 | UCM, dram | 0.110 s" in bench_peer.markdown(runs)


def test_rounds_pool_their_requests_and_each_system_is_set_against_the_floor_beside_it():
    def run(system, ttfts, beside=None):
        out = {**_run(system, p50=ttfts[0]), "ttfts_s": ttfts}
        return out if beside is None else {**out, "beside": beside}

    # the machine ran at half speed while LMCache and the floor beside it were measured
    raw = [
        run("vllm-floor", [0.10, 0.10], "ucm-dram"), run("ucm-dram", [0.11, 0.11]),
        run("vllm-floor", [0.10, 0.10], "ucm-dram"), run("ucm-dram", [0.11, 0.11]),
        run("vllm-floor", [0.20, 0.20], "lmcache"), run("lmcache", [0.24, 0.24]),
    ]  # fmt: skip
    pooled = {r["system"]: r for r in bench_peer.rows(raw)}
    assert pooled["ucm-dram"]["rounds"] == 2 and len(pooled["ucm-dram"]["ttfts_s"]) == 4
    assert pooled["vllm-floor"]["rounds"] == 3
    floor = {r["system"]: r["ttft_p50_s"] for r in ratios(raw, "vllm-floor")}
    assert floor == pytest.approx({"ucm-dram": 1.1, "lmcache": 1.2})
    # against LMCache through the floor: 1.1 / 1.2, not 0.11 / 0.24
    against = {r["system"]: r["ttft_p50_s"] for r in ratios(raw, "lmcache")}
    assert against == pytest.approx({"ucm-dram": 1.1 / 1.2, "vllm-floor": 1 / 1.2})
    assert "| 512 | 1 | UCM, dram | 0.110 s | 0.110 s | 0.110 s | 1.10, 1.10, 1.10 | 0.92" in (
        bench_peer.markdown(raw)
    )
    # percentiles over every request of the rounds, as vLLM's client computes them
    assert bench_peer.pool([run("x", [1.0, 2.0]), run("x", [3.0, 4.0])])["ttft_p50_s"] == 2.5


def test_the_dtype_follows_the_cpu_and_the_floor_holds_every_prompt():
    assert dtype("auto", {"avx512f", "amx_bf16"}) == "bfloat16"
    assert dtype("auto", {"avx512f", "avx2"}) == "float32"  # bf16 matmuls 3x slower there
    assert dtype("float32", {"amx_bf16"}) == "float32"
    # 16 KiB a token in float32: 100,000 tokens are 1.5 GiB, and a fifth more
    assert kv_space_gib(bench_peer.MODEL, "float32", 100_000) == 2
    assert kv_space_gib(bench_peer.MODEL, "bfloat16", 1000) == 1


@pytest.mark.engine
def test_a_small_run_reuses_what_the_floor_reuses_across_a_restart(tmp_path, capsys):
    """Real servers and vLLM's own client: the floor, and UCM tiered (dram over posix)
    across a restart, its disk's files read into the page cache before its run."""
    from ucm.lab.testing.zygote import forked
    from ucm.lab.vllm.serve_process import ServeProcess, serve_command

    def from_the_zygote(*args, python=sys.executable, **kwargs):
        return ServeProcess(*args, python=python, launcher=forked(serve_command()), **kwargs)

    report_path = tmp_path / "report.json"
    # the client as a real run starts it: forked from a process that imported it once
    with forked_client() as client:
        assert client[1:] == ["-m", "ucm.lab.vllm.vllm_bench_serve"]
        code = bench_peer.main(
            ["--systems", "vllm-floor,ucm-tiered", "--lengths", "256", "--prefixes", "2",
             "--concurrency", "2", "--output", "2", "--dtype", "float32", "--rounds", "1",
             "--json", str(report_path)],
            Starters(server=from_the_zygote, client=client),
        )  # fmt: skip
    report = json.loads(report_path.read_text())
    assert code == 0, report
    assert not report["refused"] and not report["reuse_differs"]
    runs = {r["system"]: r for r in report["runs"]}
    assert runs.keys() == {"vllm-floor", "ucm-tiered"}
    # 2 prompts of 256 + 64 tokens: vLLM's own cache hits 9 whole blocks of 32 (the last
    # token is computed); the connector is asked for all but the last token
    assert runs["vllm-floor"]["reused_tokens"] == 2 * 288
    assert runs["ucm-tiered"]["reused_tokens"] == 2 * 319
    assert runs["ucm-tiered"]["rounds"] == 1 and len(runs["ucm-tiered"]["ttfts_s"]) == 2
    # UCM's run follows one of the floor's, on the floor's server kept up (a round: the
    # pooling of several is checked above, without servers)
    assert [(r["system"], r.get("beside")) for r in report["rounds"]] == [
        ("vllm-floor", "ucm-tiered"), ("ucm-tiered", None)]  # fmt: skip
    assert [r["system"] for r in report["against_vllm-floor"]] == ["ucm-tiered"]
    assert 0.0 <= report["rounds"][1]["page_cache_before"] <= 1.0
    assert "| 256 | 2 | UCM, tiered |" in capsys.readouterr().err


def test_a_cold_run_reuses_nothing_and_is_not_held_to_the_floor():
    runs = [_run("vllm", reused=0), _run("vllm-floor", reused=576)]
    assert check_reuse(runs, prefixes=2) == []
    assert check_reuse([*runs, _run("ucm-posix", reused=638)], prefixes=2) == []
    assert check_reuse([*runs, _run("ucm-posix", reused=700)], prefixes=2) != []
