"""The ``ucm`` command line: inspect, verify and trim a posix store; name a model's weights.
Other distributions add commands through the ``ucm.commands`` entry points (ucm-lab adds
``ucm bench``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points

from tqdm import tqdm
from ucm.core.model_identity import DIGEST_MODES, WEIGHT_SUFFIXES
from ucm.core.settings import GIB, MAX_GIB, ConfigError
from ucm.core.signing import signer_for
from ucm.core.store.posix import (
    BLOCKS_DIR,
    NEEDS_SECRET,
    evict_lru,
    read_marker,
    scan_store,
    verify_block_file,
)
from ucm.core.store.posix.fileio import open_dir, unlink_in
from ucm.core.store.posix.layout import block_relative
from ucm.core.store.posix.usage import SharedUsage


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _require_store(path: str) -> str:
    root = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(os.path.join(root, BLOCKS_DIR)):
        raise SystemExit(f"ucm: {path!r} is not a UCM posix store (no {BLOCKS_DIR}/ directory)")
    return root


def cmd_stats(args: argparse.Namespace) -> int:
    root = _require_store(args.path)
    scan = scan_store(root)
    marked = read_marker(root).get("capacity_bytes")
    capacity = marked if isinstance(marked, int) and marked > 0 else None
    used = scan.bytes / capacity if capacity else None
    stats = {
        "path": root,
        "blocks": len(scan.blocks),
        "bytes": scan.bytes,
        "capacity_bytes": capacity,
        "capacity_used": used,
        "foreign_files": len(scan.foreign),
        "stale_temp_files_removed": scan.temps_removed,
    }
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"store     {root}")
    print(f"blocks    {stats['blocks']}")
    print(f"bytes     {_human(scan.bytes)} ({scan.bytes})")
    if capacity and used is not None:
        print(f"capacity  {_human(capacity)}, {100 * used:.1f}% used")
    else:
        print("capacity  unlimited")
    if scan.foreign:
        print(f"foreign   {len(scan.foreign)} files that are not UCM blocks")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    root = _require_store(args.path)
    signer = signer_for(args.secret, "--secret")
    scan = scan_store(root)
    corrupt: list[tuple[str, str]] = []
    unchecked = 0
    for block in tqdm(scan.blocks, desc="verify", unit="block", disable=None, file=sys.stderr):
        problem = verify_block_file(block.path, signer)
        if problem == NEEDS_SECRET:
            unchecked += 1
        elif problem:
            corrupt.append((block.name, problem))
    root_fd = open_dir(root)
    try:
        for name, problem in corrupt:
            print(f"CORRUPT {os.path.join(root, block_relative(name))}: {problem}")
            if args.remove:
                try:
                    unlink_in(root_fd, block_relative(name))
                except OSError as exc:
                    print(f"  cannot remove: {exc.strerror}")
    finally:
        os.close(root_fd)
    for path in scan.foreign:
        print(f"FOREIGN {path}: not a UCM block (ignored by the store)")
    if unchecked:
        print(f"UNCHECKED {unchecked} signed blocks: {NEEDS_SECRET}")
    verdict = "FAILED" if corrupt else "OK"
    removed = " (removed)" if args.remove and corrupt else ""
    print(
        f"{verdict}: {len(scan.blocks) - unchecked} blocks checked, {len(corrupt)} corrupt"
        f"{removed}, {len(scan.foreign)} foreign files, {scan.temps_removed} stale temporary "
        "files removed"
    )
    return 1 if corrupt else 0


def _capacity_gb(text: str) -> float:
    """``--capacity-gb``: a positive, finite number of GiB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_GIB):
        raise argparse.ArgumentTypeError(f"must be a number in (0, {MAX_GIB:g}], got {text}")
    return value


def cmd_gc(args: argparse.Namespace) -> int:
    root = _require_store(args.path)
    target = int(args.capacity_gb * GIB)
    root_fd = open_dir(root)
    try:
        usage = SharedUsage(root_fd)
    except OSError:
        usage = None  # a store that cannot be written: nothing will be removed either
    try:
        counted = usage.read() if usage is not None else (0, 0)
        scan = scan_store(root)
        before = scan.bytes
        remaining, count = evict_lru(scan, target, root_fd)
        if usage is not None:  # the engines' count follows what gc removed
            removed = (before - remaining, len(scan.blocks) - count)
            usage.resync((remaining, count), counted, removed)
    finally:
        if usage is not None:
            usage.close()
        os.close(root_fd)
    print(
        f"gc: {len(scan.blocks) - count} blocks removed, {_human(before)} -> {_human(remaining)} "
        f"(capacity {_human(target)}), {scan.temps_removed} stale temporary files removed"
    )
    return 0


def cmd_model_id(args: argparse.Namespace) -> int:
    import time

    from ucm.core.model_identity import weight_files, weights_digest

    files = weight_files(args.path)
    if not files:
        raise SystemExit(f"ucm: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {args.path!r}")
    started = time.perf_counter()
    digest = weights_digest(args.path, args.weights_digest)
    seconds = time.perf_counter() - started
    size = sum(f.stat().st_size for f in files)
    if args.json:
        print(
            json.dumps({"weights": digest, "files": len(files), "bytes": size, "seconds": seconds})
        )
        return 0
    print(f"weights   {digest}")
    print(f"files     {len(files)}, {_human(size)}")
    print(f"seconds   {seconds:.3f} ({args.weights_digest})")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ucm-core")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


# commands that other distributions add through this entry-point group: each entry is a
# function given the subparsers; ucm-lab, the project's harness, adds ``ucm bench``
COMMANDS_GROUP = "ucm.commands"
# commands of the harness, named in the error that says where they come from
LAB_COMMANDS = ("bench",)


def _plugin_commands() -> list[EntryPoint]:
    return list(entry_points(group=COMMANDS_GROUP))


def build_parser(plugins: Sequence[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The command line; ``plugins``: the entry points that add commands (default: the
    installed ones)."""
    parser = argparse.ArgumentParser(
        prog="ucm", description="UCM: KV-cache persistence for LLM inference"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    store = sub.add_parser("store", help="inspect and maintain a posix store directory")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    stats = store_sub.add_parser("stats", help="blocks, bytes and capacity use")
    stats.add_argument("path")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=cmd_stats)
    verify = store_sub.add_parser("verify", help="check every block; exit 1 if any is corrupt")
    verify.add_argument("path")
    verify.add_argument("--remove", action="store_true", help="delete the corrupt blocks")
    verify.add_argument(
        "--secret",
        metavar="env:NAME|file:PATH",
        help="the store's secret, to check signed blocks (else they are counted unchecked)",
    )
    verify.set_defaults(func=cmd_verify)
    gc = store_sub.add_parser("gc", help="evict least recently used blocks down to a capacity")
    gc.add_argument("path")
    gc.add_argument("--capacity-gb", type=_capacity_gb, required=True, help="GiB to keep")
    gc.set_defaults(func=cmd_gc)

    model_id = sub.add_parser(
        "model-id",
        help="the digest naming a model's weights in keys (hosts that print the same one "
        "share blocks)",
    )
    model_id.add_argument("path", help="the model's folder (or one weight file)")
    model_id.add_argument(
        "--weights-digest", choices=DIGEST_MODES, default="sampled", help="default: sampled"
    )
    model_id.add_argument("--json", action="store_true", help="print one JSON object")
    model_id.set_defaults(func=cmd_model_id)

    for plugin in _plugin_commands() if plugins is None else plugins:
        plugin.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    plugins = _plugin_commands()
    if argv and argv[0] in LAB_COMMANDS and argv[0] not in {p.name for p in plugins}:
        raise SystemExit(
            f"ucm: '{argv[0]}' comes with ucm-lab, the project's benchmarks and demos, which "
            "is not published: from a checkout, pip install ./packages/ucm-lab"
        )
    args = build_parser(plugins).parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ucm: invalid configuration: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
