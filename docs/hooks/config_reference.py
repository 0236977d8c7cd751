"""The configuration reference, generated from the attrs classes of the settings.

The reference lives in ``docs/configuration.md`` itself, between the markers
``<!-- config-reference:begin -->`` and ``<!-- config-reference:end -->``, so that it reads
on GitHub and its links work without a site build.  It holds one section per class of
``ucm.core.config.DOCUMENTED_CLASSES``, then the slice-write policy and the settings of the
engine adapters: a table of every field with its default, the values it allows (and so its
type) and the ``doc`` from its metadata.

Three ways in:

* ``python docs/hooks/config_reference.py --write`` rewrites the section from the code
  (``--check``: exit 1 when it is stale); run it after changing a setting;
* as an mkdocs hook (``mkdocs.yml``), it checks the section when the site is built: a stale
  section, or a validator this module cannot describe, is a warning, so ``mkdocs build
  --strict`` fails rather than publish a reference that differs from the code;
* ``packages/ucm-core/tests/test_docs_reference.py`` runs the same check with the tests.

It needs ucm-core and attrs, not mkdocs: the adapters' settings are read from their source
files in this repository (they import only ucm-core), so every environment that has ucm-core
renders the same text.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import re
import sys
import types
import typing
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

try:
    from ucm.core import config as ucm_config
    from ucm.core.slicing import SliceWritePolicy
except ImportError as exc:  # pragma: no cover - a set-up problem, not a docs problem
    raise ImportError(
        "the configuration reference needs ucm-core: pip install -e packages/ucm-core"
    ) from exc

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"
REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"
#: what a reader is told to run when the committed reference is stale
REFRESH = "python docs/hooks/config_reference.py --write"
log = logging.getLogger("mkdocs.hooks.config_reference")

#: Factories whose result depends on the machine building the docs: shown as a rule instead.
FACTORY_TEXT: dict[Callable[[], object], str] = {
    ucm_config.default_store_path: "`$XDG_CACHE_HOME/ucm` (or `~/.cache/ucm`)",
    ucm_config.default_shared_memory_path: "`/dev/shm/ucm-<uid>` (one folder per user)",
}
TYPE_NAMES: dict[object, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}
#: the engine adapters' settings: (section title, source file in this repository, class)
ADAPTERS = (
    (
        "vLLM connector (kv_connector_extra_config)",
        "packages/ucm-vllm/src/ucm/vllm/config.py",
        "ConnectorConfig",
    ),
    (
        "FastDeploy backend (ucm_config)",
        "packages/ucm-fastdeploy/src/ucm/fastdeploy/config.py",
        "FastDeployConfig",
    ),
)


def slugify(title: str, separator: str = "-") -> str:
    """The anchor of a heading, as Python-Markdown's ``toc`` extension makes it (mkdocs
    uses it; GitHub's anchors agree for these titles)."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(rf"[{separator}\s]+", separator, text)


def _sections() -> list[tuple[str, type]]:
    sections = list(ucm_config.DOCUMENTED_CLASSES)
    if all(cls is not SliceWritePolicy for _, cls in sections):
        sections.append(("Slice writes", SliceWritePolicy))
    for title, source, name in ADAPTERS:
        sections.append((title, _adapter_class(source, name)))
    return sections


def _adapter_class(source: str, name: str) -> type:
    """Class ``name`` of an adapter's settings module, executed from its source file under a
    private module name: the adapter need not be installed, and an installed copy (which may
    be older than the tree) is not what the tree's docs describe."""
    module_name = "_ucm_docs_reference_" + Path(source).parts[1].replace("-", "_")
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, REPO / source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # attrs resolves the annotations through it
        spec.loader.exec_module(module)
    cls = getattr(module, name)
    assert isinstance(cls, type)
    return cls


def _literal(value: object) -> str:
    """A value as it is written in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _link(cls: type, anchors: dict[type, tuple[str, str]]) -> str:
    title, slug = anchors[cls]
    return f"[{title}](#{slug})"


def _members(tp: object) -> tuple[object, ...]:
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return typing.get_args(tp) if is_union else (tp,)


def _type(tp: object, anchors: dict[type, tuple[str, str]]) -> str:
    names = ["mapping" if m in anchors else TYPE_NAMES.get(m, str(m)) for m in _members(tp)]
    return " or ".join(dict.fromkeys(names))


def _default(field: attrs.Attribute[Any], anchors: dict[type, tuple[str, str]]) -> str:
    default: object = field.default
    if default is attrs.NOTHING:
        return "required"
    factory = getattr(default, "factory", None)  # an attrs.Factory
    if callable(factory):
        if factory in FACTORY_TEXT:
            return FACTORY_TEXT[factory]
        if factory in anchors:
            return f"the defaults of {_link(factory, anchors)}"
        if inspect.isfunction(factory):  # its result may depend on the machine
            log.warning(
                "config reference: %s's default comes from %s(): add it to FACTORY_TEXT",
                field.name,
                factory.__qualname__,
            )
        default = factory()
    return _literal(default)


def _allowed(field: attrs.Attribute[Any], anchors: dict[type, tuple[str, str]]) -> str:
    """What a field takes, saying what kind of value where its rule alone does not (the
    table has no column of types: the site has no room for five)."""
    kind = _type(field.type, anchors)
    if field.validator is None:
        return kind
    rule = _describe(field.validator, field.name, anchors)
    first = kind.split(" or ")[0]
    if rule.startswith("non-empty"):
        return "a non-empty string" + rule[len("non-empty") :]
    if first == "number" and rule.startswith((">", "≥", "between")):
        return f"a number {rule}"
    if first == "string" and rule.startswith("at most"):
        return f"a string of {rule}"
    return rule or kind


def _describe(check: Any, name: str, anchors: dict[type, tuple[str, str]]) -> str:
    if isinstance(getattr(check, "allowed", None), str):  # a validator that describes itself
        return str(check.allowed)  # type: ignore[union-attr]
    outer = getattr(check, "__qualname__", "").split(".")[0]
    bound = inspect.getclosurevars(check).nonlocals if inspect.isfunction(check) else {}
    if outer == "optional":
        return _describe(bound["check"], name, anchors) + ", or `null`"
    if outer == "one_of":
        choices = [_literal(c) for c in bound["choices"]]
        return choices[0] if len(choices) == 1 else "one of " + ", ".join(choices)
    if outer == "int_in_range":
        low, high = bound["low"], bound["high"]
        return f"integer ≥ {low}" if high >= 1 << 30 else f"integer, {low} to {high}"
    if outer == "instance_of":
        classes = bound["cls"] if isinstance(bound["cls"], tuple) else (bound["cls"],)
        if all(c in anchors for c in classes):
            return "the settings of " + " or ".join(_link(c, anchors) for c in classes)
        if classes == (str,):
            return "a string"
    fixed = {
        "non_negative_number": "≥ 0",
        "positive_number": "> 0",
        "fraction": "between 0 and 1 (exclusive)",
        "boolean": "`true` or `false`",
        "non_empty_str": "non-empty",
    }
    if outer in fixed:
        return fixed[outer]
    log.warning("config reference: cannot describe the validator %r of %s", check, name)
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference() -> str:
    """Markdown for every documented class: a heading, its docstring and a table."""
    sections = _sections()
    anchors = {cls: (title, slugify(title, "-")) for title, cls in sections}
    out: list[str] = []
    for title, cls in sections:
        attrs.resolve_types(cls)
        out += [f"### {title}", ""]
        if cls.__doc__:
            out += [inspect.cleandoc(cls.__doc__).split("\n\n")[0], ""]
        out += ["| Setting | Default | Allowed | Meaning |", "|---|---|---|---|"]
        for field in attrs.fields(cls):
            row = [
                f"`{field.name}`",
                _default(field, anchors),
                _allowed(field, anchors),
                field.metadata.get("doc", ""),
            ]
            if not row[-1]:
                log.warning("config reference: %s.%s has no doc", cls.__name__, field.name)
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        out.append("")
    return "\n".join(out)


def stale(page_text: str) -> str | None:
    """Why the reference in ``page_text`` differs from the code, or None when it is current."""
    if page_text.count(BEGIN) != 1 or page_text.count(END) != 1:
        return f"it needs one {BEGIN} and one {END} marker"
    start = page_text.index(BEGIN) + len(BEGIN)
    if page_text.index(END) < start:
        return f"{END} comes before {BEGIN}"
    if page_text[start : page_text.index(END)] != _block():
        return f"the reference differs from the code; run {REFRESH}"
    return None


def refreshed(page_text: str) -> str:
    """``page_text`` with the reference between its markers generated again."""
    problem = stale(page_text)
    if problem is not None and "differs" not in problem:
        raise ValueError(problem)
    start = page_text.index(BEGIN) + len(BEGIN)
    return page_text[:start] + _block() + page_text[page_text.index(END) :]


def _block() -> str:
    return "\n\n" + render_reference().rstrip("\n") + "\n\n"


#: pages holding the reference (their ``src_uri``), given ``TABLE_STYLE`` when rendered
_PAGES: set[str] = set()
#: the site's tables break inline code anywhere to fit; a setting's name stays whole
TABLE_STYLE = "<style>.md-typeset td:first-child code { white-space: nowrap; }</style>\n"


def on_page_markdown(markdown: str, page: Any = None, **_kwargs: object) -> str:
    """mkdocs: check the committed reference (a warning fails a strict build)."""
    if BEGIN not in markdown and END not in markdown:
        return markdown
    where = getattr(getattr(page, "file", None), "src_uri", "a page")
    _PAGES.add(where)
    problem = stale(markdown)
    if problem is not None:
        log.warning("config reference in %s: %s", where, problem)
    return markdown


def on_page_content(html: str, page: Any = None, **_kwargs: object) -> str:
    """mkdocs: the reference's tables keep each setting's name on one line."""
    if getattr(getattr(page, "file", None), "src_uri", None) in _PAGES:
        return TABLE_STYLE + html
    return html


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write or check the configuration reference.")
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite it from the code")
    action.add_argument("--check", action="store_true", help="exit 1 when it is stale")
    p.add_argument("page", nargs="?", default=str(PAGE), help="default: docs/configuration.md")
    args = p.parse_args(argv)
    path = Path(args.page)
    text = path.read_text()
    if args.check:
        problem = stale(text)
        if problem is not None:
            print(f"{path}: {problem}", file=sys.stderr)
            return 1
        return 0
    new = refreshed(text)
    if new != text:
        path.write_text(new)
        print(f"{path}: reference rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(message)s")
    raise SystemExit(main())
