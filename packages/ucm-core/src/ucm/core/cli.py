"""The ``ucm`` command line: inspect, verify and trim a store (a posix store's folder, a host
dram store's arena); name a model's weights.
Other distributions add commands through the ``ucm.commands`` entry points (ucm-lab adds
``ucm bench``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from tqdm import tqdm
from ucm.core.block_format import FORMAT_VERSION
from ucm.core.model_identity import DIGEST_MODES, WEIGHT_SUFFIXES
from ucm.core.settings import GIB, MAX_GIB, ConfigError
from ucm.core.signing import BlockSigner, signer_for
from ucm.core.sizing import DEFAULT_BLOCK_TOKENS, KV_CACHE_DTYPES
from ucm.core.store.dram.arena import ARENA_FILE, Arena
from ucm.core.store.dram.shared import verify_arena
from ucm.core.store.posix import (
    BLOCKS_DIR,
    NEEDS_SECRET,
    evict_lru,
    read_marker,
    scan_store,
    verify_block_file,
)
from ucm.core.store.posix.fileio import open_dir, unlink_in
from ucm.core.store.posix.layout import OTHER_VERSION, block_relative, block_version
from ucm.core.store.posix.usage import SharedUsage
from ucm.core.store.split import FA_SUBDIR, WA_SUBDIR


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class CliError(Exception):
    """A problem the command reports in one line (``--json``: one JSON object) and exit 1."""


def _stores(path: str) -> list[str]:
    """The posix store at ``path``, or the two of a hybrid model's root (``fa/``, ``wa/``)."""
    root = os.path.abspath(os.path.expanduser(path))
    if not os.path.lexists(root):
        raise CliError(f"{path}: no such folder")
    if not os.path.isdir(root):
        raise CliError(f"{path} is not a folder, so not a UCM posix store")
    if _is_store(root):
        return [root]
    groups = [os.path.join(root, g) for g in (FA_SUBDIR, WA_SUBDIR)]
    found = [g for g in groups if _is_store(g)]
    if found:
        return found
    raise CliError(
        f"{path} is not a UCM store (no {BLOCKS_DIR}/ folder of a posix store, no "
        f"{ARENA_FILE} of a dram store, nor a hybrid model's {FA_SUBDIR}/ and {WA_SUBDIR}/)"
    )


def _is_store(folder: str) -> bool:
    """A posix store's folder, or a host dram store's (its arena file)."""
    return os.path.isdir(os.path.join(folder, BLOCKS_DIR)) or _is_arena(folder)


def _is_arena(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ARENA_FILE))


def _arena(root: str) -> Arena:
    arena = Arena.attach(root, capacity_bytes=1 << 62)
    if arena is None:
        raise CliError(f"{root}/{ARENA_FILE} is not an arena this build reads, or not yours")
    return arena


def _arena_stats(root: str) -> dict[str, object]:
    arena = _arena(root)
    try:
        with arena.locked():  # a dead holder's leftovers are mended first
            found = arena.stats()
    finally:
        arena.close()
    capacity = found["slots"] * found["slot_bytes"]
    return {
        "path": root,
        "kind": "dram",
        "blocks": found["blocks"],
        "bytes": found["bytes"],
        "capacity_bytes": capacity,
        "capacity_used": found["blocks"] / found["slots"],
        "foreign_files": 0,
        "arena": found,
    }


def _stats(root: str) -> dict[str, object]:
    if _is_arena(root):
        return _arena_stats(root)
    scan = scan_store(root)
    marked = read_marker(root).get("capacity_bytes")
    capacity = marked if isinstance(marked, int) and marked > 0 else None
    return {
        "path": root,
        "blocks": len(scan.blocks),
        "bytes": scan.bytes,
        "capacity_bytes": capacity,
        "capacity_used": scan.bytes / capacity if capacity else None,
        "foreign_files": len(scan.foreign),
        "stale_temp_files_removed": scan.temps_removed,
    }


def cmd_stats(args: argparse.Namespace) -> int:
    found = [_stats(root) for root in _stores(args.path)]
    if args.json:
        print(json.dumps(found[0] if len(found) == 1 else {"stores": found}))
        return 0
    for stats in found:
        _print_stats(stats)
    return 0


def _print_stats(stats: dict[str, object]) -> None:
    size, capacity, used = stats["bytes"], stats["capacity_bytes"], stats["capacity_used"]
    print(f"store     {stats['path']}")
    print(f"blocks    {stats['blocks']}")
    print(f"bytes     {_human(size)} ({size})")  # type: ignore[arg-type]
    if capacity and used is not None:
        print(f"capacity  {_human(capacity)}, {100 * used:.1f}% used")  # type: ignore[arg-type,operator]
    else:
        print("capacity  unlimited")
    if "arena" in stats:
        arena = stats["arena"]
        print(
            f"slots     {arena['slots']} of {_human(arena['slot_bytes'])} in shared memory, "  # type: ignore[index]
            f"{arena['evicted']} evicted so far"  # type: ignore[index]
        )
    if stats["foreign_files"]:
        print(f"foreign   {stats['foreign_files']} files that are not UCM blocks")


def cmd_verify(args: argparse.Namespace) -> int:
    signer = signer_for(args.secret, "--secret")
    return max(_verify(root, signer, args.remove) for root in _stores(args.path))


def _verify(root: str, signer: BlockSigner | None, remove: bool) -> int:
    """Verify one store; 1 if a corrupt block is left in it."""
    if _is_arena(root):
        return _verify_arena(root, signer, remove)
    scan = scan_store(root)
    corrupt: list[tuple[str, str]] = []
    unchecked = 0
    for block in tqdm(scan.blocks, desc="verify", unit="block", disable=None, file=sys.stderr):
        problem = verify_block_file(block.path, signer)
        if problem == NEEDS_SECRET or (problem or "").startswith(OTHER_VERSION):
            unchecked += 1  # not known to be bad: another secret's or another build's
            if problem != NEEDS_SECRET:
                print(f"OTHER VERSION {block.path}: {problem} (ucm store gc --other-versions)")
        elif problem:
            corrupt.append((block.name, problem))
    left = len(corrupt)
    root_fd = open_dir(root)
    try:
        for name, problem in corrupt:
            print(f"CORRUPT {os.path.join(root, block_relative(name))}: {problem}")
            if remove:
                try:
                    unlink_in(root_fd, block_relative(name))
                    left -= 1
                except OSError as exc:
                    print(f"  cannot remove: {exc.strerror}")
    finally:
        os.close(root_fd)
    for path in scan.foreign:
        print(f"FOREIGN {path}: not a UCM block (ignored by the store)")
    if unchecked:
        print(f"UNCHECKED {unchecked} blocks: signed (give --secret) or of another version")
    verdict = "FAILED" if left else ("REPAIRED" if corrupt else "OK")
    removed = f" ({len(corrupt) - left} removed)" if remove and corrupt else ""
    print(
        f"{verdict}: {len(scan.blocks) - unchecked} blocks checked, {len(corrupt)} corrupt"
        f"{removed}, {len(scan.foreign)} foreign files, {scan.temps_removed} stale temporary "
        "files removed"
    )
    return 1 if left else 0


def _verify_arena(root: str, signer: BlockSigner | None, remove: bool) -> int:
    arena = _arena(root)
    try:
        checked, corrupt = verify_arena(arena, signer, remove)
        problems = arena.check()
    finally:
        arena.close()
    for problem in problems:
        print(f"INCONSISTENT {root}/{ARENA_FILE}: {problem}")
    left = 0 if remove else corrupt
    verdict = "FAILED" if left or problems else ("REPAIRED" if corrupt else "OK")
    removed = f" ({corrupt} removed)" if remove and corrupt else ""
    print(f"{verdict}: {checked} blocks checked, {corrupt} corrupt{removed}")
    return 1 if left or problems else 0


def positive_number(kind: type, high: float) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` in (0, ``high``] (so never inf or nan)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(f"must be a number in (0, {high:g}], got {text}")
        return value

    return parse


#: ``--capacity-gb``: a positive, finite number of GiB
_capacity_gb = positive_number(float, MAX_GIB)


def cmd_gc(args: argparse.Namespace) -> int:
    if args.capacity_gb is None and not args.other_versions:
        raise CliError("say what to remove: --capacity-gb, --other-versions, or both")
    roots = _stores(args.path)
    for root in roots:
        label = f"gc {os.path.basename(root)}" if len(roots) > 1 else "gc"
        if _is_arena(root):
            if args.capacity_gb is not None:
                _gc_arena(root, int(args.capacity_gb * GIB), args.dry_run, label)
            continue  # one format version: the arena's geometry and version are checked
        if args.other_versions:
            _gc_other_versions(root, args.dry_run, label)
        if args.capacity_gb is not None:
            _gc(root, int(args.capacity_gb * GIB), args.dry_run, label)
    return 0


def _gc_other_versions(root: str, dry_run: bool, label: str) -> None:
    """Remove the blocks of other format versions (left alone by the stores: a build that
    reads them may still share the folder)."""
    scan = scan_store(root, remove_temps=not dry_run)
    other = [b for b in scan.blocks if block_version(b.path) not in (None, FORMAT_VERSION)]
    if not dry_run and other:
        root_fd = open_dir(root)
        try:
            usage = SharedUsage(root_fd)
            try:
                for block in other:
                    if unlink_in(root_fd, block_relative(block.name), block.inode):
                        usage.add(-block.size, -1)
            finally:
                usage.close()
        finally:
            os.close(root_fd)
    what = "would remove" if dry_run else "removed"
    size = sum(b.size for b in other)
    print(f"{label}: {what} {len(other)} blocks of other format versions ({_human(size)})")


def _gc(root: str, target: int, dry_run: bool, label: str) -> None:
    root_fd = open_dir(root)
    usage = None
    try:
        if not dry_run:
            try:
                usage = SharedUsage(root_fd)
            except OSError:
                pass  # a store that cannot be written: nothing will be removed either
        counted = usage.read() if usage is not None else (0, 0)
        scan = scan_store(root, remove_temps=not dry_run)
        before = scan.bytes
        remaining, count = evict_lru(scan, target, root_fd, dry_run=dry_run)
        if usage is not None:  # the engines' count follows what gc removed
            removed = (before - remaining, len(scan.blocks) - count)
            usage.resync((remaining, count), counted, removed)
    finally:
        if usage is not None:
            usage.close()
        os.close(root_fd)
    gone = len(scan.blocks) - count
    what = f"would remove {gone} blocks" if dry_run else f"{gone} blocks removed"
    print(
        f"{label}: {what}, {_human(before)} -> {_human(remaining)} (capacity "
        f"{_human(target)}), {scan.temps_removed} stale temporary files removed"
    )


def _gc_arena(root: str, target: int, dry_run: bool, label: str) -> None:
    arena = _arena(root)
    try:
        before = arena.stats()
        over = max(0, before["blocks"] - target // arena.geometry.slot_bytes)
        gone = over if dry_run else arena.evict(over) if over else 0
        after = before["bytes"] if dry_run else arena.stats()["bytes"]
    finally:
        arena.close()
    what = f"would remove {gone} blocks" if dry_run else f"{gone} blocks removed"
    print(
        f"{label}: {what}, {_human(before['bytes'])} -> {_human(after)} (capacity {_human(target)})"
    )


def cmd_model_id(args: argparse.Namespace) -> int:
    import time

    from ucm.core.model_identity import weight_files, weights_digest

    if args.size:
        return _model_size(args)
    given = [f"--{o.replace('_', '-')}" for o in SIZE_OPTIONS if getattr(args, o) is not None]
    if given:
        raise CliError(f"{', '.join(given)}: only with --size")
    files = weight_files(args.path)
    if not files:
        raise CliError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {args.path!r}")
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


#: the options of ``model-id --size`` (None: not given)
SIZE_OPTIONS = ("kv_cache_dtype", "tensor_parallel_size", "block_tokens", "capacity_gb")


def _model_size(args: argparse.Namespace) -> int:
    """``model-id --size``: a model's KV bytes per token and block, from its config.json,
    and what a capacity holds."""
    from ucm.core.sizing import SizingError, model_kv_size

    try:
        size = model_kv_size(
            args.path,
            kv_cache_dtype=args.kv_cache_dtype or "auto",
            tensor_parallel_size=args.tensor_parallel_size or 1,
            block_tokens=args.block_tokens or DEFAULT_BLOCK_TOKENS,
        )
        capacity_gb = args.capacity_gb if args.capacity_gb is not None else 1.0
        holding = size.holds(int(capacity_gb * GIB))
    except SizingError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(size.as_dict(holding)))
        return 0
    shape, tp = size.shape, size.tensor_parallel_size
    layers = f"{shape.full_layers} layers"
    if shape.window_layers:
        layers = (
            f"{shape.full_layers + shape.window_layers} layers: {shape.full_layers} full "
            f"attention, {shape.window_layers} with a {shape.window_tokens}-token window"
        )
    if shape.attention == "MLA":
        lora, rope = shape.mla_dims or (0, 0)
        kv = f"MLA, one latent of {lora} + {rope} values per token and layer"
    else:
        kv = f"{shape.attention}, {shape.kv_heads} KV heads of {shape.head_dim}"
        if tp > 1:
            kv += f", {size.kv_heads_per_rank} per rank"
    per_token = f"{size.bytes_per_token} B ({_human(size.bytes_per_token)})"
    if size.writers > 1:
        per_token += f" per rank, {size.writers * size.bytes_per_token} B on {tp} ranks"
    elif tp > 1:
        per_token += f" on every rank, stored once for all {tp}"
    print(f"model      {shape.model}, {layers}")
    print(f"kv         {kv}")
    print(f"dtype      {size.kv_cache_dtype}, {size.dtype_bytes} B per value")
    print(f"per token  {per_token}")
    print(
        f"block      {size.block_tokens} tokens: {size.block_payload_bytes} B payload + "
        f"{size.block_bytes - size.block_payload_bytes} B header = {size.block_bytes} B "
        f"({_human(size.block_bytes)})" + (" per rank" if size.writers > 1 else "")
    )
    if size.tail_bytes:
        print(
            f"tail       {size.tail_tokens} tokens of the window layers, {size.tail_bytes} B "
            f"({_human(size.tail_bytes)}) at each block boundary"
            + (" per rank" if size.writers > 1 else "")
        )
    blocks = f"{holding.blocks} blocks"
    if size.writers > 1:
        blocks += f" ({holding.blocks // size.writers} per rank)"
    share = (
        f" (the full-attention share, {_human(holding.full_capacity_bytes)})"
        if size.tail_bytes
        else ""
    )
    print(
        f"capacity   {_human(holding.capacity_bytes)} holds {blocks}{share}: "
        f"{holding.tokens} tokens"
    )
    if size.tail_bytes:
        window = _human(holding.window_capacity_bytes)
        print(f"           and {holding.tails} window tails in {window}")
    for note in size.notes:
        print(f"note       {note}")
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

    store = sub.add_parser(
        "store", help="inspect and maintain a posix store's folder or a dram store's shared memory"
    )
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
    gc = store_sub.add_parser(
        "gc",
        help="evict least recently used blocks down to a capacity, or remove blocks of "
        "other format versions",
    )
    gc.add_argument("path")
    gc.add_argument("--capacity-gb", type=_capacity_gb, help="GiB to keep")
    gc.add_argument(
        "--other-versions",
        action="store_true",
        help=f"remove the blocks of format versions other than this build's ({FORMAT_VERSION})",
    )
    gc.add_argument(
        "--dry-run", action="store_true", help="say what would be removed; remove nothing"
    )
    gc.set_defaults(func=cmd_gc)

    model_id = sub.add_parser(
        "model-id",
        help="the digest naming a model's weights in keys (hosts that print the same one "
        "share blocks); with --size, its KV bytes per token and what a capacity holds",
    )
    model_id.add_argument(
        "path", help="the model's folder (or one weight file; with --size, or its config.json)"
    )
    model_id.add_argument(
        "--weights-digest", choices=DIGEST_MODES, default="sampled", help="default: sampled"
    )
    model_id.add_argument("--json", action="store_true", help="print one JSON object")
    model_id.add_argument(
        "--size",
        action="store_true",
        help="print the KV bytes per token and per stored block, from the folder's "
        "config.json, and what a capacity holds (reads no weights)",
    )
    model_id.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="with --size: vLLM's --kv-cache-dtype (default: auto, the model's dtype)",
    )
    model_id.add_argument(
        "--tensor-parallel-size",
        type=positive_number(int, 1 << 16),
        metavar="N",
        help="with --size: ranks the KV heads are split across (default: 1)",
    )
    model_id.add_argument(
        "--block-tokens",
        type=positive_number(int, 1 << 20),
        metavar="N",
        help=f"with --size: tokens per stored block (default: {DEFAULT_BLOCK_TOKENS})",
    )
    model_id.add_argument(
        "--capacity-gb",
        type=_capacity_gb,
        metavar="GIB",
        help="with --size: the store's capacity (default: 1)",
    )
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
        return _fail(args, f"invalid configuration: {exc}", 2)
    except (CliError, OSError) as exc:
        return _fail(args, str(exc), 1)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """Report ``message`` in one line: JSON on standard output with ``--json``."""
    if getattr(args, "json", False):
        print(json.dumps({"error": message}))
    else:
        print(f"ucm: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    # run as ucm.core.cli, not __main__: the commands' modules raise ucm.core.cli.CliError
    from ucm.core.cli import main as installed_main

    sys.exit(installed_main())
