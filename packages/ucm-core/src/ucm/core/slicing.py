"""The slice-write policy: write a long run of blocks in slices, never leaving holes.

A request's blocks are keyed by prefix, so a stored block is useful only if every block
before it is stored too.  A write of blocks ``[start, end)`` is therefore split into
slices of ``slice_blocks``; each slice gets ``slice_timeout_s`` (and no more than what is
left of ``total_timeout_s``); the first slice that times out or writes fewer blocks than
asked stops the write, so what is stored is always a prefix.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import attrs
from ucm.core.settings import (
    ConfigError,
    int_in_range,
    optional_positive_number,
    positive_number,
    setting,
)

log = logging.getLogger(__name__)


@attrs.frozen
class SliceWritePolicy:
    slice_blocks: int = setting(
        "Blocks per slice.", default=100, validator=int_in_range(1, 1 << 30)
    )
    slice_timeout_s: float = setting(
        "Seconds one slice may take.", default=10.0, validator=positive_number
    )
    total_timeout_s: float | None = setting(
        "Seconds the whole write may take; null: the caller's timeout.",
        default=None,
        validator=optional_positive_number,
    )


def parse_positive(name: str, raw: object, kind: type[int] | type[float]) -> int | float:
    """A positive int or float from a setting or an environment string, or a ConfigError."""
    value: int | float
    if isinstance(raw, bool):
        raise ConfigError(name, f"must be a positive {kind.__name__}, got {raw!r}")
    try:
        if isinstance(raw, str):
            value = int(raw.strip()) if kind is int else float(raw.strip())
        elif kind is int and isinstance(raw, int):
            value = raw
        elif kind is float and isinstance(raw, (int, float)):
            value = float(raw)
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(name, f"must be a positive {kind.__name__}, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(name, f"must be a positive {kind.__name__}, got {raw!r}")
    return value


def policy_from_env(
    environ: Mapping[str, str], names: Mapping[str, str], base: SliceWritePolicy | None = None
) -> SliceWritePolicy:
    """Overlay environment variables on ``base``: ``names`` maps a policy field to a variable."""
    base = base or SliceWritePolicy()
    kinds = {"slice_blocks": int, "slice_timeout_s": float, "total_timeout_s": float}
    changes = {
        field: parse_positive(var, environ[var], kinds[field])
        for field, var in names.items()
        if var in environ
    }
    return attrs.evolve(base, **changes)  # type: ignore[arg-type]


def plan_slices(start: int, end: int, slice_blocks: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ranges of at most ``slice_blocks``."""
    if slice_blocks <= 0:
        raise ValueError(f"slice_blocks must be positive, got {slice_blocks}")
    return [(s, min(s + slice_blocks, end)) for s in range(start, end, slice_blocks)]


@attrs.frozen
class SliceWriteReport:
    requested: int
    written: int
    slices: int  # slices attempted
    stopped: str | None  # why the write stopped early, None when complete
    seconds: float

    @property
    def complete(self) -> bool:
        return self.written == self.requested


#: ``write_slice(start, end, timeout_s) -> blocks written from start``; may raise TimeoutError.
WriteSlice = Callable[[int, int, float], int]


def write_sliced(
    policy: SliceWritePolicy,
    start: int,
    end: int,
    write_slice: WriteSlice,
    *,
    call_timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    label: str = "",
) -> SliceWriteReport:
    """Write blocks ``[start, end)`` slice by slice; stop at the first short slice."""
    total = policy.total_timeout_s if policy.total_timeout_s is not None else call_timeout_s
    began = clock()
    written = 0
    stopped = None
    slices = 0
    for s, e in plan_slices(start, end, policy.slice_blocks):
        left = math.inf if total is None else total - (clock() - began)
        if left <= 0:
            stopped = f"total timeout {total:g}s reached"
            break
        slices += 1
        budget = min(policy.slice_timeout_s, left)
        t0 = clock()
        try:
            done = write_slice(s, e, budget)
        except TimeoutError:
            done, stopped = 0, f"slice [{s}, {e}) timed out after {budget:g}s"
        except Exception as exc:  # noqa: BLE001 - a failing store must not fail the engine
            done, stopped = 0, f"slice [{s}, {e}) failed: {exc}"
        done = max(0, min(done, e - s))
        written += done
        log.debug(
            "ucm slice write %s: slice=[%d, %d) written=%d/%d seconds=%.3f",
            label,
            s,
            e,
            done,
            e - s,
            clock() - t0,
        )
        if stopped is None and clock() - t0 > budget:
            stopped = f"slice [{s}, {e}) took {clock() - t0:.3f}s, over {budget:g}s"
        if stopped is None and done < e - s:
            stopped = f"slice [{s}, {e}) wrote {done} of {e - s} blocks"
        if stopped:
            break
    report = SliceWriteReport(end - start, written, slices, stopped, clock() - began)
    if report.complete:
        log.debug(
            "ucm slice write %s: written=%d/%d seconds=%.3f",
            label,
            written,
            end - start,
            report.seconds,
        )
    else:
        log.warning(
            "ucm slice write %s: prefix cut short: written=%d/%d seconds=%.3f reason=%s",
            label,
            written,
            end - start,
            report.seconds,
            stopped,
        )
    return report
