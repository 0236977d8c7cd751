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

from ucm.core.block_format import FORMAT_VERSION
from ucm.core.model_identity import DIGEST_MODES, WEIGHT_SUFFIXES
from ucm.core.settings import GIB, MAX_GIB, ConfigError
from ucm.core.signing import signer_for
from ucm.core.sizing import DEFAULT_BLOCK_TOKENS, KV_CACHE_DTYPES
from ucm.core.store.folders import FolderError, StoreFolder, human
from ucm.core.store.kinds import kind_names, load, settings_class
from ucm.core.store.split import FA_SUBDIR, WA_SUBDIR


class CliError(Exception):
    """A problem the command reports in one line (``--json``: one JSON object) and exit 1."""


def _folder_kinds() -> list[type[StoreFolder]]:
    """What ``ucm store`` can open: the folder tools of every kind that has them."""
    found = []
    for kind in kind_names():
        settings = settings_class(kind)
        if settings is not None and settings.FOLDER is not None:
            found.append(load(settings.FOLDER))
    return found


def _stores(path: str) -> list[StoreFolder]:
    """The store at ``path``, or the two of a hybrid model's root (``fa/``, ``wa/``)."""
    root = os.path.abspath(os.path.expanduser(path))
    if not os.path.lexists(root):
        raise CliError(f"{path}: no such folder")
    if not os.path.isdir(root):
        raise CliError(f"{path} is not a folder, so not a UCM store")
    kinds = _folder_kinds()
    here = _store_in(root, kinds)
    if here is not None:
        return [here]
    groups = [_store_in(os.path.join(root, g), kinds) for g in (FA_SUBDIR, WA_SUBDIR)]
    found = [g for g in groups if g is not None]
    if found:
        return found
    marks = ", no ".join(kind.MARK for kind in kinds)
    raise CliError(
        f"{path} is not a UCM store (no {marks}, nor a hybrid model's {FA_SUBDIR}/ and "
        f"{WA_SUBDIR}/)"
    )


def _store_in(folder: str, kinds: list[type[StoreFolder]]) -> StoreFolder | None:
    """The store of the first kind that recognises ``folder`` as its own."""
    for kind in kinds:
        if kind.holds_store(folder):
            return kind(folder)
    return None


def cmd_stats(args: argparse.Namespace) -> int:
    stores = _stores(args.path)
    found = [store.stats() for store in stores]
    if args.json:
        print(json.dumps(found[0] if len(found) == 1 else {"stores": found}))
        return 0
    for store, stats in zip(stores, found):
        _print_stats(stats, store.describe(stats))
    return 0


def _print_stats(stats: dict[str, Any], own: list[str]) -> None:
    size, capacity, used = stats["bytes"], stats["capacity_bytes"], stats["capacity_used"]
    print(f"store     {stats['path']}")
    print(f"blocks    {stats['blocks']}")
    print(f"bytes     {human(size)} ({size})")
    if capacity and used is not None:
        print(f"capacity  {human(capacity)}, {100 * used:.1f}% used")
    else:
        print("capacity  unlimited")
    for line in own:
        print(line)
    if stats["foreign_files"]:
        print(f"foreign   {stats['foreign_files']} files that are not UCM blocks")


def cmd_verify(args: argparse.Namespace) -> int:
    signer = signer_for(args.secret, "--secret")
    return max(store.verify(signer, args.remove) for store in _stores(args.path))


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
    stores = _stores(args.path)
    capacity = None if args.capacity_gb is None else int(args.capacity_gb * GIB)
    for store in stores:
        label = f"gc {os.path.basename(store.root)}" if len(stores) > 1 else "gc"
        store.gc(capacity, args.other_versions, args.dry_run, label)
    return 0


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
    print(f"files     {len(files)}, {human(size)}")
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
    per_token = f"{size.bytes_per_token} B ({human(size.bytes_per_token)})"
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
        f"({human(size.block_bytes)})" + (" per rank" if size.writers > 1 else "")
    )
    if size.tail_bytes:
        print(
            f"tail       {size.tail_tokens} tokens of the window layers, {size.tail_bytes} B "
            f"({human(size.tail_bytes)}) at each block boundary"
            + (" per rank" if size.writers > 1 else "")
        )
    blocks = f"{holding.blocks} blocks"
    if size.writers > 1:
        blocks += f" ({holding.blocks // size.writers} per rank)"
    share = (
        f" (the full-attention share, {human(holding.full_capacity_bytes)})"
        if size.tail_bytes
        else ""
    )
    print(
        f"capacity   {human(holding.capacity_bytes)} holds {blocks}{share}: {holding.tokens} tokens"
    )
    if size.tail_bytes:
        window = human(holding.window_capacity_bytes)
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
    except (CliError, FolderError, OSError) as exc:
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
