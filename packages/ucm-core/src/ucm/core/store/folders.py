"""What ``ucm store stats|verify|gc`` asks of a store kind whose blocks lie in a folder.

A kind names its :class:`StoreFolder` in its settings' ``FOLDER`` (see
:mod:`ucm.core.store.kinds`); the command finds which kind a folder holds by asking each,
and never branches on the kind itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from ucm.core.signing import BlockSigner


class FolderError(Exception):
    """A folder that cannot be inspected, said in one line (the command exits 1)."""


class StoreFolder(Protocol):
    """One store's folder, opened for maintenance by ``ucm store``."""

    #: what marks a folder as this kind's, for the error naming what a folder lacks
    MARK: str
    #: the folder
    root: str

    @staticmethod
    def holds_store(folder: str) -> bool:
        """Whether ``folder`` is a store of this kind (cheap: no lock, no scan)."""

    def __init__(self, folder: str) -> None: ...

    def stats(self) -> dict[str, Any]:
        """``path``, ``kind``, ``blocks``, ``bytes``, ``capacity_bytes`` (None: no limit),
        ``capacity_used`` (None: no limit), ``foreign_files``, and the kind's own keys."""

    def describe(self, stats: dict[str, Any]) -> list[str]:
        """The kind's own lines of ``ucm store stats``, after the common ones."""

    def verify(self, signer: BlockSigner | None, remove: bool) -> int:
        """Check every block, printing a line per problem and a verdict; 1 when a corrupt
        block is left."""

    def gc(
        self, capacity_bytes: int | None, other_versions: bool, dry_run: bool, label: str
    ) -> None:
        """Evict down to ``capacity_bytes`` (None: leave the size) and, with
        ``other_versions``, remove blocks of other format versions; print what was done."""


def human(n: float) -> str:
    """A size in bytes as people read it (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
