"""Hybrid models keep their full-attention (FA) and window (WA) blocks in two stores made
from the one configured: each store kind's ``split`` names them (``fa``/``wa`` folders or
key prefixes) and shares its capacity with :func:`split_gb`."""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import Any

import attrs
from ucm.core.settings import ConfigError

FA_SUBDIR = "fa"
WA_SUBDIR = "wa"


def split_gb(capacity_gb: float, wa_fraction: float) -> tuple[float, float]:
    """(FA, WA) capacities, both > 0, whose exact sum is at most ``capacity_gb``."""
    wa = capacity_gb * wa_fraction
    fa = capacity_gb - wa
    while fa > 0 and Fraction(fa) + Fraction(wa) > Fraction(capacity_gb):  # rounded up
        fa = math.nextafter(fa, 0.0)
    if fa <= 0 or wa <= 0:
        raise ConfigError(
            "wa_capacity_fraction",
            f"{wa_fraction!r} of {capacity_gb!r} GiB leaves one of the two stores nothing",
        )
    return fa, wa


def in_subfolders(config: Any, fa_gb: float | None, wa_gb: float | None) -> tuple[Any, Any]:
    """``config`` as two stores in the folders ``fa`` and ``wa`` of its ``path``, with the
    capacities given (the stores that keep their blocks in a folder: posix, dram)."""
    return (
        attrs.evolve(config, path=os.path.join(config.path, FA_SUBDIR), capacity_gb=fa_gb),
        attrs.evolve(config, path=os.path.join(config.path, WA_SUBDIR), capacity_gb=wa_gb),
    )
