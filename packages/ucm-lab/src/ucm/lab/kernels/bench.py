"""Gather/scatter bandwidth against baselines measured in the same run.

On CUDA, for realistic shapes (32 layers, 8 KV heads, head 128 so C = 256 with K|V, bf16,
16- and 256-token engine blocks, 256-token store blocks, HND and NHD physical layouts):

* gather and scatter GB/s (payload bytes per second) of the device's work, every case
  timed the same way: calls queued while the GPU sleeps, then run back to back (the host
  prepares a call in about as long as the kernel of a 512 MiB transfer runs, so calls
  queued as they come would time the host); beside it, each call's host time and the
  GB/s of calls queued as they come;
* (a) a device-to-device ``copy_`` of one tensor of the same bytes: the kernel's ceiling.
  Target: >= 85 % of it when one layer's engine block is >= 256 KiB;
* (b) a per-layer ``index_select`` / ``index_copy_`` loop producing the same payload.
  Target: >= 1.5x;
* dump to / load from pinned host buffers through :class:`HostStager` (DMA and direct
  modes) against a plain ``copy_`` of the same bytes between the device and pinned memory.
  Target: >= 0.9.

On the CPU: the torch fallback (and the index loop) against a memcpy (``copy_``) of the same
bytes.  Every kernel result is checked against the index loop's before it is timed.

    python -m ucm.lab.kernels.bench [--device auto|cpu|cuda] [--quick] [--json] [--repeat N]

``--json`` prints, as the last line, a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from ucm.kernels.api import gather, scatter, triton_available
from ucm.kernels.spec import make_layout
from ucm.kernels.staging import HostStager, alloc_host_buffers
from ucm.kernels.validate import describe_caches

GIB = 2**30
MIB = 2**20


# --- timing --------------------------------------------------------------------------------
def _time_cpu(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


#: GPU clock cycles per second for ``torch.cuda._sleep``: no GPU clocks faster than this, so
#: a sleep of ``seconds * _SLEEP_CYCLES_PER_S`` cycles lasts at least ``seconds``
_SLEEP_CYCLES_PER_S = 2.0e9


def _time_cuda(
    fn: Callable[[], object], repeat: int, warmup: int = 3
) -> tuple[float, float, float]:
    """Seconds per call of ``fn`` on the device alone, on the host, and in calls queued as
    they come (the slower of the two, as in an engine).

    The calls are first queued as they come, which also times the host; then queued again
    while the GPU sleeps (twice as long as the host took), so the GPU runs their work back
    to back whatever the host's share and the events time the device alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def queued(sleep_s: float) -> tuple[float, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_s:
            torch.cuda._sleep(int(sleep_s * _SLEEP_CYCLES_PER_S) + 1_000_000)
        start.record()
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        host = time.perf_counter() - t
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat, host / repeat

    call, host = queued(0.0)
    device, _ = queued(2 * host * repeat)
    return device, host, call


def _measure(fns: dict[str, Callable[[], object]], device: str, repeat: int) -> dict[str, float]:
    """Median seconds per call of each function.  On the CPU the candidates take turns, one
    call each per round, so that a noisy neighbour slows them all alike.  On a GPU: device
    seconds per call (see :func:`_time_cuda`), with ``<name>:host`` (host seconds to
    queue a call) and ``<name>:call`` (seconds per call of calls queued as they come)."""
    if device != "cpu":
        out: dict[str, float] = {}
        for name, fn in fns.items():
            out[name], out[name + ":host"], out[name + ":call"] = _time_cuda(fn, repeat)
        return out
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def _time_host(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """Wall time of a call that returns once its work is done (synchronises itself)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _time_cpu(fn, repeat, warmup=0)


# --- workloads -----------------------------------------------------------------------------
def _caches(layers, blocks, heads, block_size, channels, dtype, layout, device):
    """``layers`` logical ``[B, H, N, C]`` views over HND or NHD physical tensors."""
    out = []
    for i in range(layers):
        if layout == "HND":
            t = torch.empty(blocks, heads, block_size, channels, dtype=dtype, device=device)
        else:  # NHD: [B, N, H, C] seen as [B, H, N, C]
            t = torch.empty(blocks, block_size, heads, channels, dtype=dtype, device=device)
            t = t.permute(0, 2, 1, 3)
        t.view(torch.uint8 if t.element_size() == 1 else torch.int16).random_(0, 100 + i)
        out.append(t)
    return out


def _index_loop_gather(caches, ids_flat, out, count, k):
    """Baseline (b): per layer an index_select, then a permuted copy into the payload."""
    _, h, n, c = caches[0].shape
    for layer, cache in enumerate(caches):
        got = cache.index_select(0, ids_flat)  # [S*k, H, N, C]
        out[:, layer].view(count, h, k, n, c).copy_(
            got.view(count, k, h, n, c).permute(0, 2, 1, 3, 4)
        )


def _index_loop_scatter(caches, ids_flat, src, count, k):
    _, h, n, c = caches[0].shape
    for layer, cache in enumerate(caches):
        vals = src[:, layer].view(count, h, k, n, c).permute(0, 2, 1, 3, 4)
        cache.index_copy_(0, ids_flat, vals.reshape(count * k, h, n, c))


def _case(
    layers,
    heads,
    head_dim,
    block_size,
    store_tokens,
    count,
    dtype,
    layout,
    device,
    backend,
    repeat,
    results,
):
    k = store_tokens // block_size
    channels = 2 * head_dim  # K|V
    blocks = 2 * count * k + 1
    caches = _caches(layers, blocks, heads, block_size, channels, dtype, layout, device)
    gen = torch.Generator().manual_seed(0)
    ids = (torch.randperm(blocks - 1, generator=gen)[: count * k] + 1).view(count, k)
    lay = make_layout(describe_caches(caches), k)
    nbytes = lay.nbytes * count
    item = torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(count, lay.data_numel, dtype=dtype, device=device)
    ref = torch.empty_like(buf)
    ids_dev = ids.reshape(-1).to(device)
    view = (count, layers, heads, store_tokens, channels)

    # check once against the baseline before timing
    _index_loop_gather(caches, ids_dev, ref.view(view), count, k)
    ran = gather(caches, ids, buf, backend=backend)
    if not torch.equal(buf.view(torch.uint8), ref.view(torch.uint8)):
        raise AssertionError(f"{ran} gather differs from the index_select baseline")

    chunk = heads * block_size * channels * item
    tag = dict(
        layout=layout,
        block_tokens=block_size,
        layer_block_kib=chunk // 1024,
        payload_mib=round(nbytes / MIB, 1),
        backend=ran,
    )
    # filled: an untouched source reads the shared zero page and flatters the copy
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    copy_name = "memcpy" if device == "cpu" else "d2d_copy"
    t = _measure(
        {
            copy_name: lambda: dst.copy_(src),
            "gather": lambda: gather(caches, ids, buf, backend=backend),
            "scatter": lambda: scatter(caches, ids, buf, backend=backend),
            "index_loop_gather": lambda: _index_loop_gather(
                caches, ids_dev, ref.view(view), count, k
            ),
            "index_loop_scatter": lambda: _index_loop_scatter(
                caches, ids_dev, buf.view(view), count, k
            ),
        },
        device,
        repeat,
    )
    results.append(dict(name=copy_name, gbps=nbytes / t[copy_name] / 1e9, **tag))
    for name in ("index_loop_gather", "index_loop_scatter"):
        results.append(dict(name=name, gbps=nbytes / t[name] / 1e9, **tag))
    big = chunk >= 256 * 1024
    for name in ("gather", "scatter"):
        row = dict(
            name=name,
            gbps=nbytes / t[name] / 1e9,
            vs_copy=t[copy_name] / t[name],
            vs_loop=t["index_loop_" + name] / t[name],
            **tag,
        )
        if device != "cpu":
            row["target_vs_copy"] = 0.85 if big else None
            row["target_vs_loop"] = 1.5
            row["host_us"] = 1e6 * t[name + ":host"]
            row["call_gbps"] = nbytes / t[name + ":call"] / 1e9
        results.append(row)
    return caches, ids, lay, count


def _staging(caches, ids, lay, count, repeat, results, direct):
    host = alloc_host_buffers(lay, count)
    stager = HostStager(caches[0].device, direct=direct)
    nbytes = lay.nbytes * count
    dev = torch.empty(nbytes, dtype=torch.uint8, device=caches[0].device)
    flat = host.view(-1)

    def d2h():
        flat.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        dev.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()

    t_d2h = _time_host(d2h, repeat)
    t_h2d = _time_host(h2d, repeat)
    t_dump = _time_host(lambda: stager.dump(caches, ids, host).wait(), repeat)
    t_load = _time_host(lambda: stager.load(caches, ids, host).wait(), repeat)
    mode = "direct" if direct else "dma"
    tag = dict(block_tokens=lay.cache.block_size, payload_mib=round(nbytes / MIB, 1), mode=mode)
    results += [
        dict(name="d2h_copy", gbps=nbytes / t_d2h / 1e9, **tag),
        dict(name="h2d_copy", gbps=nbytes / t_h2d / 1e9, **tag),
        dict(
            name="dump_to_pinned",
            gbps=nbytes / t_dump / 1e9,
            vs_copy=t_d2h / t_dump,
            target_vs_copy=0.9,
            **tag,
        ),
        dict(
            name="load_from_pinned",
            gbps=nbytes / t_load / 1e9,
            vs_copy=t_h2d / t_load,
            target_vs_copy=0.9,
            **tag,
        ),
    ]


def run(device: str, quick: bool, repeat: int) -> dict:
    results: list[dict] = []
    dtype = torch.bfloat16
    if device == "cpu":
        layers, heads, head_dim, count = (4, 2, 64, 1) if quick else (32, 8, 128, 2)
        for layout in ("HND", "NHD"):
            _case(
                layers,
                heads,
                head_dim,
                16,
                256,
                count,
                dtype,
                layout,
                "cpu",
                "torch",
                repeat,
                results,
            )
        backend = "torch"
    else:
        layers, heads, head_dim, count = (4, 8, 128, 4) if quick else (32, 8, 128, 16)
        backend = "triton" if triton_available(device) else "torch"
        for block_size in (16, 256):
            for layout in ("HND", "NHD"):
                caches, ids, lay, n = _case(
                    layers,
                    heads,
                    head_dim,
                    block_size,
                    256,
                    count,
                    dtype,
                    layout,
                    device,
                    backend,
                    repeat,
                    results,
                )
                if layout == "HND":
                    for direct in (False, True):
                        try:
                            _staging(caches, ids, lay, n, repeat, results, direct)
                        except Exception as exc:  # direct mode is experimental
                            results.append(
                                dict(name="staging_error", mode=direct, error=str(exc), gbps=0.0)
                            )
                del caches
                torch.cuda.empty_cache()
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(device),
        "backend": backend,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(dtype),
        "results": results,
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _print(report: dict) -> None:
    print(
        f"ucm.kernels benchmark on {report['device']} (backend {report['backend']}, "
        f"torch {report['torch']}, triton {report['triton']}, {report['dtype']})"
    )
    for r in report["results"]:
        where = " ".join(
            f"{k}={r[k]}"
            for k in ("layout", "block_tokens", "layer_block_kib", "mode", "payload_mib")
            if k in r
        )
        line = f"  {r['name']:<20} {r['gbps']:8.2f} GB/s  {where}"
        for key, label in (("vs_copy", "x copy"), ("vs_loop", "x index loop")):
            if key in r:
                target = r.get("target_" + key)
                mark = ""
                if target is not None:
                    mark = " (target {:.2f}: {})".format(
                        target, "met" if r[key] >= target else "MISSED"
                    )
                line += f"  {r[key]:.2f}{label}{mark}"
        if "host_us" in r:
            line += f"  host {r['host_us']:.0f} us a call, {r['call_gbps']:.0f} GB/s in calls"
        if "error" in r:
            line += f"  error: {r['error']}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ucm.lab.kernels.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--device", default="auto", help="auto (cuda when there is one), cpu or cuda[:N]"
    )
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    parser.add_argument("--json", action="store_true", help="print a JSON report as the last line")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions (median)")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    repeat = args.repeat or (3 if args.quick else (15 if device == "cpu" else 20))
    report = run(device, args.quick, repeat)
    _print(report)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
