"""``ucm store stats|verify|gc`` on a host dram store's folder, its arena in shared memory
(see :mod:`ucm.core.store.folders`)."""

from __future__ import annotations

import os
from typing import Any

from ucm.core.signing import BlockSigner
from ucm.core.store.dram.arena import ARENA_FILE, Arena
from ucm.core.store.dram.shared import verify_arena
from ucm.core.store.folders import FolderError, human


class ArenaFolder:
    """A host dram store's folder: its arena file of fixed slots."""

    MARK = f"{ARENA_FILE} of a dram store"

    @staticmethod
    def holds_store(folder: str) -> bool:
        return os.path.isfile(os.path.join(folder, ARENA_FILE))

    def __init__(self, folder: str) -> None:
        self.root = folder

    def _arena(self) -> Arena:
        arena = Arena.attach(self.root, capacity_bytes=1 << 62)
        if arena is None:
            raise FolderError(
                f"{self.root}/{ARENA_FILE} is not an arena this build reads, or not yours"
            )
        return arena

    def stats(self) -> dict[str, Any]:
        arena = self._arena()
        try:
            with arena.locked():  # a dead holder's leftovers are mended first
                found = arena.stats()
        finally:
            arena.close()
        return {
            "path": self.root,
            "kind": "dram",
            "blocks": found["blocks"],
            "bytes": found["bytes"],
            "capacity_bytes": found["slots"] * found["slot_bytes"],
            "capacity_used": found["blocks"] / found["slots"],
            "foreign_files": 0,
            "arena": found,
        }

    def describe(self, stats: dict[str, Any]) -> list[str]:
        arena = stats["arena"]
        return [
            f"slots     {arena['slots']} of {human(arena['slot_bytes'])} in shared memory, "
            f"{arena['evicted']} evicted so far"
        ]

    def verify(self, signer: BlockSigner | None, remove: bool) -> int:
        arena = self._arena()
        try:
            checked, corrupt = verify_arena(arena, signer, remove)
            problems = arena.check()
        finally:
            arena.close()
        for problem in problems:
            print(f"INCONSISTENT {self.root}/{ARENA_FILE}: {problem}")
        left = 0 if remove else corrupt
        verdict = "FAILED" if left or problems else ("REPAIRED" if corrupt else "OK")
        removed = f" ({corrupt} removed)" if remove and corrupt else ""
        print(f"{verdict}: {checked} blocks checked, {corrupt} corrupt{removed}")
        return 1 if left or problems else 0

    def gc(
        self, capacity_bytes: int | None, other_versions: bool, dry_run: bool, label: str
    ) -> None:
        # one format version: an arena of another is refused whole when it is opened
        if capacity_bytes is None:
            return
        arena = self._arena()
        try:
            before = arena.stats()
            over = max(0, before["blocks"] - capacity_bytes // arena.geometry.slot_bytes)
            gone = over if dry_run else arena.evict(over) if over else 0
            after = before["bytes"] if dry_run else arena.stats()["bytes"]
        finally:
            arena.close()
        what = f"would remove {gone} blocks" if dry_run else f"{gone} blocks removed"
        print(
            f"{label}: {what}, {human(before['bytes'])} -> {human(after)} (capacity "
            f"{human(capacity_bytes)})"
        )
