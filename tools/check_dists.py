"""Check the built distributions of every package: what a user installs must hold every
module of the source tree and nothing else, under the project's version, with the
dependencies and extras its pyproject.toml names (its siblings at its own version) and the
repository's LICENSE.  The library distributions hold no harness module (benchmarks, demos,
test helpers: those live in ucm-lab) and depend only on what their modules import; ucm-lab
is marked never to be uploaded.

    python tools/check_dists.py DIST_DIR        (needs ``packaging``)

Exits 1 naming every problem found.
"""

from __future__ import annotations

import ast
import re
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
LAB = "ucm-lab"  # the harness: every other distribution is library
# module names that are harness wherever they sit: a library wheel must hold none of them
HARNESS = re.compile(
    r"(bench|demo)(_\w+)?|serve_\w+|testing|netlab|daemon|multiround|mooncake_master"
)
# what a wheel holds beside its sources: the libraries its build hook compiles (hatch_build.py)
COMPILED = {"ucm-core": {"ucm/core/libucm_native.so"}}
# a distribution's name -> the top-level module it is imported as, where the two differ
# the repository's licence, which every distribution ships (a copy beside each pyproject.toml:
# an sdist cannot hold a file from outside its project)
LICENSE = (ROOT / "LICENSE").read_bytes()
IMPORT_NAMES = {"pyyaml": "yaml", "ucm-core": "ucm.core", "ucm-kernels": "ucm.kernels"}


def source_files(package: Path) -> set[str]:
    """What the wheel must hold: every file under src/, as installed (no caches, and no
    library an editable install compiled there)."""
    src = package / "src"
    return {
        f.relative_to(src).as_posix()
        for f in src.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so")
    }


def normalized(requirement: str) -> str:
    """One spelling of a requirement (name, version specifiers in order, marker)."""
    req = Requirement(requirement)
    specifiers = ",".join(sorted(str(s) for s in req.specifier))
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    marker = f";{req.marker}" if req.marker else ""
    return f"{canonicalize_name(req.name)}{extras}{specifiers}{marker}"


def with_extra(requirement: str, extra: str) -> str:
    """A requirement of an extra as the metadata writes it (its own marker kept)."""
    req = Requirement(requirement)
    only = f'extra == "{extra}"'
    req.marker = Marker(f"({req.marker}) and {only}" if req.marker else only)
    return str(req)


def imported(package: Path) -> set[str]:
    """Every module name the package's source imports (``ucm.x`` kept two levels deep)."""
    names: set[str] = set()
    for file in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found = [node.module]
            else:
                continue
            names |= {".".join(n.split(".")[:2]) if n.startswith("ucm.") else n.split(".")[0]
                      for n in found}  # fmt: skip
    return names


def check_library(package: Path, name: str, held: set[str], project: dict) -> list[str]:
    """A library wheel: no harness module, and no dependency its modules never import."""
    problems = [
        f"{name}: the wheel holds {n}, a harness module (it belongs in ucm-lab)"
        for n in sorted(held)
        if n.endswith(".py") and HARNESS.fullmatch(Path(n).stem) or n.startswith("ucm/lab/")
    ]
    uses = imported(package)
    for dependency in project.get("dependencies", []):
        dist_name = canonicalize_name(Requirement(dependency).name)
        module = IMPORT_NAMES.get(dist_name, dist_name.replace("-", "_"))
        if module not in uses:
            problems.append(f"{name}: depends on {dist_name}, which none of its modules imports")
    return problems


def check(package: Path, dist: Path, version: str) -> list[str]:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    name = project["name"]
    stem = f"{name.replace('-', '_')}-{version}"
    problems: list[str] = []
    compiled = COMPILED.get(name, set())
    # a wheel with a compiled library serves one platform, every Python of it
    wheels = sorted(dist.glob(f"{stem}-py3-none-{'*' if compiled else 'any'}.whl"))
    sdist = dist / f"{stem}.tar.gz"
    if len(wheels) != 1:
        problems.append(f"{name}: {len(wheels)} wheels tagged py3-none were built, not one")
    if not sdist.is_file():
        problems.append(f"{name}: {sdist.name} was not built")
    if problems:
        return problems
    wheel = wheels[0]
    if compiled and wheel.name.endswith("-any.whl"):
        problems.append(f"{name}: {wheel.name} is pure Python: its library was not compiled")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = Parser().parsestr(zf.read(f"{stem}.dist-info/METADATA").decode())
    held = {n for n in names if not n.startswith(f"{stem}.dist-info/")}
    for missing in sorted((source_files(package) | compiled) - held):
        problems.append(f"{name}: the wheel lacks {missing}")
    for extra in sorted(held - source_files(package) - compiled):
        problems.append(f"{name}: the wheel holds {extra}, which is not in src/")
    if any("/tests/" in n or n.startswith("tests/") for n in names):
        problems.append(f"{name}: the wheel holds tests")
    if name == LAB:
        if "Private :: Do Not Upload" not in (metadata.get_all("Classifier") or []):
            problems.append(f"{name}: lacks the classifier 'Private :: Do Not Upload'")
    else:
        problems += check_library(package, name, held, project)
    if metadata["Version"] != version:
        problems.append(f"{name}: version {metadata['Version']}, the project's is {version}")
    required = {normalized(r) for r in metadata.get_all("Requires-Dist") or []}
    wanted = {normalized(r) for r in project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        wanted |= {normalized(with_extra(r, extra)) for r in reqs}
    for lost in sorted(wanted - required):
        problems.append(f"{name}: the metadata lacks the requirement {lost}")
    for odd in sorted(required - wanted):
        problems.append(f"{name}: the metadata requires {odd}, which pyproject.toml does not")
    for requirement in sorted(required):  # the siblings come at this very version
        sibling = Requirement(requirement)
        if sibling.name.startswith("ucm-") and str(sibling.specifier) != f"=={version}":
            problems.append(
                f"{name}: requires {sibling.name}{sibling.specifier}, not =={version} "
                "(a sibling of another version breaks at import)"
            )
    extras = set(metadata.get_all("Provides-Extra") or [])
    if extras != set(project.get("optional-dependencies", {})):
        problems.append(f"{name}: extras {sorted(extras)}, pyproject.toml names others")
    with tarfile.open(sdist) as tf:
        inside = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for needed in ("pyproject.toml", "README.md", *(f"src/{f}" for f in source_files(package))):
        if needed not in inside:
            problems.append(f"{name}: the sdist lacks {needed}")
    for binary in sorted(n for n in inside if n.endswith(".so")):
        problems.append(f"{name}: the sdist holds {binary}, a compiled file")
    with zipfile.ZipFile(wheel) as zf, tarfile.open(sdist) as tf:
        member = tf.extractfile(f"{stem}/LICENSE") if "LICENSE" in inside else None
        licences = {
            "the wheel": _read(zf, f"{stem}.dist-info/licenses/LICENSE"),
            "the sdist": member.read() if member else None,
            "packages/" + package.name: (package / "LICENSE").read_bytes(),
        }
    for where, text in licences.items():
        if text != LICENSE:
            problems.append(f"{name}: {where} lacks the repository's LICENSE (or differs)")
    return problems


def _read(zf: zipfile.ZipFile, member: str) -> bytes | None:
    return zf.read(member) if member in zf.namelist() else None


def main() -> int:
    dist = Path(sys.argv[1])
    version = (ROOT / "VERSION").read_text().strip()
    problems = [p for package in PACKAGES for p in check(package, dist, version)]
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"{len(PACKAGES)} packages, version {version}: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
