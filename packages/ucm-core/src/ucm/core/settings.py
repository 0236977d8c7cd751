"""The settings toolkit: frozen attrs classes validated on construction, built from dicts
or YAML, every setting declared once with its type, default, constraint and a one-line
``doc`` (the documentation's configuration reference is generated from them).  A dict with
an unknown key, a value of the wrong type or out of range is refused with a
:class:`ConfigError` naming the key (as a dotted path) and what is allowed.

The store kinds declare their settings beside their stores (``ucm.core.store.<kind>.config``)
and :mod:`ucm.core.config` gathers what users write; both build on the validators here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid configuration: ``key`` is the dotted path of the offending setting."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem

    def under(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.problem)


# --- validators: each raises ConfigError naming the attribute --------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def optional(
    check: Callable[[object, attrs.Attribute[Any], object], None],
) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """``check``, letting ``None`` (null) through."""

    def check_optional(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            check(inst, attribute, value)

    return check_optional


def positive_number(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
        raise ConfigError(attribute.name, f"must be a positive number, got {value!r}")


optional_positive_number = optional(positive_number)

#: the largest size in GiB a setting takes (an exbibyte): beyond it, bytes overflow a float
MAX_GIB = float(1 << 30)
#: the longest time in seconds a setting takes (11 days): beyond it, waits overflow
MAX_SECONDS = 1e6


def number_up_to(
    high: float, *, low: float = 0.0, zero: bool = False, unit: str = ""
) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A number in (``low``, ``high``] (``[low, high]`` with ``zero``)."""
    shown = f" {unit}" if unit else ""
    opening = "[" if zero else "("
    allowed = f"{opening}{low:g}, {high:g}]{shown}"

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if (
            not _is_number(value)
            or not math.isfinite(value)  # type: ignore[arg-type]
            or not (low <= value if zero else low < value)  # type: ignore[operator]
            or value > high  # type: ignore[operator]
        ):
            raise ConfigError(attribute.name, f"must be a number in {allowed}, got {value!r}")

    check.allowed = f"a number in {allowed}"  # type: ignore[attr-defined]  # docs reference
    return check


#: a size in GiB, > 0
size_gib = number_up_to(MAX_GIB, unit="GiB")
#: a time in seconds, > 0
seconds = number_up_to(MAX_SECONDS, unit="s")


def int_in_range(low: int, high: int) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(
                attribute.name, f"must be an integer in [{low}, {high}], got {value!r}"
            )

    return check


def check_int(name: str, value: object, low: int) -> int:
    """``value`` if it is an integer >= ``low``, else a ``ConfigError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")
    return value


def int_at_least(low: int) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_int(attribute.name, value, low)

    return check


def fraction(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_number(value) or not 0 < value < 1:  # type: ignore[operator]
        raise ConfigError(attribute.name, f"must be a number between 0 and 1, got {value!r}")


def one_of(*choices: object) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(attribute.name, f"must be one of {allowed}, got {value!r}")

    return check


def boolean(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be true or false, got {value!r}")


def non_empty_str(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(attribute.name, f"must be a non-empty string, got {value!r}")


def instance_of(
    cls: type | tuple[type, ...],
) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, cls):
            names = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
            raise ConfigError(attribute.name, f"must be a {names}, got {value!r}")

    return check


def setting(doc: str, **kwargs: Any) -> Any:
    """An attrs field carrying its documentation (read by the docs generator)."""
    metadata = dict(kwargs.pop("metadata", {}))
    metadata["doc"] = doc
    return attrs.field(metadata=metadata, **kwargs)


# --- generic construction from plain data ---------------------------------------------------


def from_dict(cls: type[T], data: object, where: str = "") -> T:
    """Build ``cls`` from a mapping, refusing unknown keys; nested settings recurse.

    A field whose metadata holds ``parse`` is built with ``parse(value, dotted_path)``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"expected a mapping of settings, got {type(data).__name__}")
    fields = attrs.fields_dict(cls)  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        allowed = ", ".join(sorted(fields))
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(key, f"unknown setting; allowed: {allowed}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        parse = fields[name].metadata.get("parse")
        kwargs[name] = parse(value, f"{where}.{name}" if where else name) if parse else value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.under(where) if where else exc from None


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML configuration file as a dict; a missing, unreadable or non-mapping file is refused."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config_file", f"cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("config_file", f"{str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config_file", f"{str(path)!r} must hold a mapping of settings")
    return data


def with_config_file(data: Mapping[str, Any]) -> dict[str, Any]:
    """Resolve ``config_file``: the file's settings, overridden key by key by the others."""
    merged = dict(data)
    path = merged.pop("config_file", None)
    if path is None:
        return merged
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError("config_file", f"must be a path to a YAML file, got {path!r}")
    loaded = load_yaml(path)
    if "config_file" in loaded:
        raise ConfigError("config_file", f"{str(path)!r} may not name another config_file")
    loaded.update(merged)
    return loaded


def non_negative_number(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        raise ConfigError(attribute.name, f"must be a number >= 0, got {value!r}")


GIB = 1 << 30


def gib_to_bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * GIB)
