"""``ucm bench``: the store benchmark, added to the ``ucm`` command by this distribution
(the ``ucm.commands`` entry point), so that the library's command carries no harness."""

from __future__ import annotations

import argparse

from ucm.core.cli import positive_number


def cmd_bench_store(args: argparse.Namespace) -> int:
    from ucm.lab.core.bench import run_store_bench

    return run_store_bench(args)


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from ucm.lab.core.bench_scale import main

    return main(args.args)


def add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bstore = bench_sub.add_parser(
        "store", help="store throughput against raw I/O, memcpy or Mooncake's own client"
    )
    bstore.add_argument(
        "--path",
        help="directory to benchmark in: the run's files go in a new folder in it, removed "
        "at the end (default: beside the default store)",
    )
    bstore.add_argument(
        "--total-gb",
        type=positive_number(float, 1 << 20),
        default=1.0,
        help="GiB moved per store and block size (default 1)",
    )
    bstore.add_argument(
        "--block-kib",
        type=positive_number(int, 1 << 22),
        nargs="+",
        default=[2048, 256],
        help="block sizes in KiB (default 2048 256)",
    )
    bstore.add_argument(
        "--repeat",
        type=positive_number(int, 1000),
        default=3,
        help="runs per case, best kept (default 3)",
    )
    bstore.add_argument(
        "--kind",
        choices=["local", "mooncake"],
        default="local",
        help="local: posix and dram against file I/O and memcpy (default); mooncake: the "
        "mooncake store against Mooncake's own client",
    )
    bstore.add_argument(
        "--master",
        help="with --kind mooncake: the master, HOST:PORT (default: one started for the run)",
    )
    bstore.add_argument(
        "--signed",
        action="store_true",
        help="also measure the posix and shared-memory stores signing their blocks with a "
        "secret (keyed BLAKE3), against the same baselines",
    )
    bstore.add_argument("--json", action="store_true", help="end with one line of JSON")
    bstore.set_defaults(func=cmd_bench_store)
    bscale = bench_sub.add_parser(
        "scale",
        help="the posix store with a million blocks against an empty one: dumps while it "
        "evicts, lookups, memory, start-up",
        add_help=False,
    )
    bscale.add_argument("args", nargs=argparse.REMAINDER, help="see ucm bench scale --help")
    bscale.set_defaults(func=cmd_bench_scale)
