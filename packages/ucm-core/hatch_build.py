"""Build ucm-core's one compiled part (``native/``): the block digest, the dram store's
sealed copies, pins, write books, lock and loads, and the posix store's digested reads.

It is a plain shared library loaded with ctypes, not a Python extension, so one wheel serves
every Python version of a platform (``py3-none-<platform>``).  Where no C compiler is found,
or it fails, the wheel is built without it, pure Python, and says why: digests are then
computed with numpy and the stores copy and read through Python, correct and slower
(``ucm.core.digest``, ``ucm.core.store.dram.sealing``), rather than an install failing for
want of a speed-up.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

LIBRARY = "ucm/core/libucm_native.so"
SOURCES = [
    "native/digest.c",
    "native/sealed_moves.c",
    "native/arena_pins.c",
    "native/arena_books.c",
    "native/arena_lock.c",
    "native/arena_loads.c",
    "native/file_reads.c",
]
FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden"]


class CompiledMoves(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        out = root / "src" / LIBRARY  # beside its module: an editable install finds it there
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not compiler:
            return self._without("no C compiler was found (cc, gcc or $CC)")
        command = [*shlex.split(compiler), *FLAGS, "-o", str(out), *SOURCES]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True)
        if done.returncode:
            return self._without(f"{shlex.join(command)} failed:\n{done.stderr}")
        if version != "editable":
            build_data["force_include"][str(out)] = LIBRARY
            build_data["pure_python"] = False
            tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
            build_data["tag"] = f"py3-none-{tag}"

    def _without(self, why: str) -> None:
        self.app.display_warning(
            f"ucm-core: {why}\nThe wheel is pure Python: block digests and the dram store's "
            "copies run in Python, slower (install gcc and the C library's headers, then "
            "rebuild)."
        )
