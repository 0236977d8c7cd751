"""mkdocs hook: the configuration reference, generated from the attrs classes of ucm.core.

A page holding the marker ``<!-- config-reference -->`` gets, in its place, one section per
class of ``ucm.core.config.DOCUMENTED_CLASSES`` (then the slice-write policy): a table of
every field with its type, default, allowed values and the ``doc`` from its metadata.  A
validator this hook cannot describe is a warning, so ``mkdocs build --strict`` fails
rather than publish a reference with a gap.
"""

from __future__ import annotations

import inspect
import logging
import types
import typing
from collections.abc import Callable
from typing import Any

import attrs
from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

try:
    from ucm.core import config as ucm_config
    from ucm.core.slicing import SliceWritePolicy
except ImportError as exc:  # pragma: no cover - a set-up problem, not a docs problem
    raise ImportError(
        "the docs hook needs ucm-core: pip install -e packages/ucm-core (nox -s docs does)"
    ) from exc

MARKER = "<!-- config-reference -->"
log = logging.getLogger("mkdocs.hooks.config_reference")

#: Factories whose result depends on the machine building the docs: shown as a rule instead.
FACTORY_TEXT: dict[Callable[[], object], str] = {
    ucm_config.default_store_path: "`$XDG_CACHE_HOME/ucm` (or `~/.cache/ucm`)",
}
TYPE_NAMES: dict[object, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _sections() -> list[tuple[str, type]]:
    sections = list(ucm_config.DOCUMENTED_CLASSES)
    if all(cls is not SliceWritePolicy for _, cls in sections):
        sections.append(("Slice writes", SliceWritePolicy))
    try:  # the adapters' settings, where their packages are installed
        from ucm.vllm.config import ConnectorConfig
    except ImportError:
        log.warning("config reference: ucm-vllm is not installed; its settings are missing")
    else:
        sections.append(("vLLM connector (kv_connector_extra_config)", ConnectorConfig))
    sections.append(("FastDeploy backend (ucm_config)", _fastdeploy_config()))
    return sections


def _fastdeploy_config() -> type:
    """ucm.fastdeploy's settings; read from the source tree when the package is not installed
    (its config module needs only ucm-core, so the docs build needs no paddle)."""
    try:
        from ucm.fastdeploy.config import FastDeployConfig
    except ImportError:
        import sys
        from pathlib import Path

        src = Path(__file__).resolve().parents[2] / "packages" / "ucm-fastdeploy" / "src"
        sys.path.append(str(src))  # ucm is a namespace package: ucm.fastdeploy joins it
        from ucm.fastdeploy.config import FastDeployConfig
    return FastDeployConfig


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
        default = factory()
    return _literal(default)


def _allowed(field: attrs.Attribute[Any], anchors: dict[type, tuple[str, str]]) -> str:
    return "" if field.validator is None else _describe(field.validator, field.name, anchors)


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
        out += ["| Setting | Type | Default | Allowed | Meaning |", "|---|---|---|---|---|"]
        for field in attrs.fields(cls):
            row = [
                f"`{field.name}`",
                _type(field.type, anchors),
                _default(field, anchors),
                _allowed(field, anchors),
                field.metadata.get("doc", ""),
            ]
            if not row[-1]:
                log.warning("config reference: %s.%s has no doc", cls.__name__, field.name)
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, **_kwargs: object) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_reference())
