"""``ucm store stats|verify|gc`` on a posix store's folder (see :mod:`ucm.core.store.folders`)."""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm import tqdm
from ucm.core.block_format import FORMAT_VERSION
from ucm.core.signing import BlockSigner
from ucm.core.store.folders import human
from ucm.core.store.posix.fileio import open_dir, unlink_in
from ucm.core.store.posix.layout import (
    BLOCKS_DIR,
    NEEDS_SECRET,
    OTHER_VERSION,
    block_relative,
    block_version,
    evict_lru,
    read_marker,
    scan_store,
    verify_block_file,
)
from ucm.core.store.posix.usage import SharedUsage


class PosixFolder:
    """A posix store's folder: one file a block under ``blocks/``."""

    MARK = f"{BLOCKS_DIR}/ folder of a posix store"

    @staticmethod
    def holds_store(folder: str) -> bool:
        return os.path.isdir(os.path.join(folder, BLOCKS_DIR))

    def __init__(self, folder: str) -> None:
        self.root = folder

    def stats(self) -> dict[str, Any]:
        scan = scan_store(self.root)
        marked = read_marker(self.root).get("capacity_bytes")
        capacity = marked if isinstance(marked, int) and marked > 0 else None
        return {
            "path": self.root,
            "kind": "posix",
            "blocks": len(scan.blocks),
            "bytes": scan.bytes,
            "capacity_bytes": capacity,
            "capacity_used": scan.bytes / capacity if capacity else None,
            "foreign_files": len(scan.foreign),
            "stale_temp_files_removed": scan.temps_removed,
        }

    def describe(self, stats: dict[str, Any]) -> list[str]:
        return []

    def verify(self, signer: BlockSigner | None, remove: bool) -> int:
        scan = scan_store(self.root)
        corrupt: list[tuple[str, str]] = []
        unchecked = 0
        blocks = tqdm(scan.blocks, desc="verify", unit="block", disable=None, file=sys.stderr)
        for block in blocks:
            problem = verify_block_file(block.path, signer)
            if problem == NEEDS_SECRET or (problem or "").startswith(OTHER_VERSION):
                unchecked += 1  # not known to be bad: another secret's or another build's
                if problem != NEEDS_SECRET:
                    print(f"OTHER VERSION {block.path}: {problem} (ucm store gc --other-versions)")
            elif problem:
                corrupt.append((block.name, problem))
        left = len(corrupt)
        root_fd = open_dir(self.root)
        try:
            for name, problem in corrupt:
                print(f"CORRUPT {os.path.join(self.root, block_relative(name))}: {problem}")
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
            f"{removed}, {len(scan.foreign)} foreign files, {scan.temps_removed} stale "
            "temporary files removed"
        )
        return 1 if left else 0

    def gc(
        self, capacity_bytes: int | None, other_versions: bool, dry_run: bool, label: str
    ) -> None:
        if other_versions:
            self._gc_other_versions(dry_run, label)
        if capacity_bytes is not None:
            self._gc(capacity_bytes, dry_run, label)

    def _gc_other_versions(self, dry_run: bool, label: str) -> None:
        """Remove the blocks of other format versions (left alone by the stores: a build
        that reads them may still share the folder)."""
        scan = scan_store(self.root, remove_temps=not dry_run)
        other = [b for b in scan.blocks if block_version(b.path) not in (None, FORMAT_VERSION)]
        if not dry_run and other:
            root_fd = open_dir(self.root)
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
        print(f"{label}: {what} {len(other)} blocks of other format versions ({human(size)})")

    def _gc(self, target: int, dry_run: bool, label: str) -> None:
        root_fd = open_dir(self.root)
        usage = None
        try:
            if not dry_run:
                try:
                    usage = SharedUsage(root_fd)
                except OSError:
                    pass  # a store that cannot be written: nothing will be removed either
            counted = usage.read() if usage is not None else (0, 0)
            scan = scan_store(self.root, remove_temps=not dry_run)
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
            f"{label}: {what}, {human(before)} -> {human(remaining)} (capacity "
            f"{human(target)}), {scan.temps_removed} stale temporary files removed"
        )
