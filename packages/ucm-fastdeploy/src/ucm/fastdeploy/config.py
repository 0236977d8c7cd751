"""The backend's settings: ``ucm_config`` (a dict or a YAML file) plus FastDeploy's variables.

Where the settings come from, first match wins:

1. the ``AS_WRITE_*`` environment variables (FastDeploy's own names for the slice write), so a
   deployment that already sets them keeps its behaviour;
2. ``ucm_config`` given to the constructor: a dict, or the path of a YAML file;
3. the YAML file named by ``UCM_CONFIG_FILE`` when ``ucm_config`` is not given;
4. the defaults below (the embedded posix store).

Every value is checked when the backend is built, never inside a write: an unknown key, a
value of the wrong type, 0, a negative number or text where a number belongs is a
``ConfigError`` naming the setting or the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
from ucm.core import DIGEST_MODES, SliceWritePolicy, policy_from_env
from ucm.core.config import (
    StoreSettings,
    cancel_grace_s_setting,
    digests_on_gpu_setting,
    pipeline_chunk_mb_setting,
    pipeline_depth_setting,
    store_setting,
    zero_copy_setting,
)
from ucm.core.settings import (
    ConfigError,
    from_dict,
    int_in_range,
    non_empty_str,
    one_of,
    optional,
    positive_number,
    setting,
    with_config_file,
)

CONFIG_FILE_ENV = "UCM_CONFIG_FILE"

#: FastDeploy's slice-write variables (seed 004), by field of :class:`SliceWritePolicy`.
SLICE_ENV = {
    "total_timeout_s": "AS_WRITE_TOTAL_TIMEOUT",
    "slice_blocks": "AS_WRITE_SLICE_BLOCK_NUM",
    "slice_timeout_s": "AS_WRITE_SLICE_TIMEOUT",
}


def _is_policy(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, SliceWritePolicy):
        raise ConfigError(attribute.name, f"must be slice-write settings, got {value!r}")


def _parse_policy(value: object, where: str) -> SliceWritePolicy:
    if isinstance(value, SliceWritePolicy):
        return value
    return from_dict(SliceWritePolicy, {} if value is None else value, where)


# what the configuration reference shows for this one
_is_policy.allowed = "the settings of [Slice writes](#slice-writes)"  # type: ignore[attr-defined]


@attrs.frozen
class FastDeployConfig:
    """Settings of ``ucm.fastdeploy.AttentionStore`` and ``UCMStorage`` (``ucm_config``)."""

    store: StoreSettings = store_setting()
    model_path: str | None = setting(
        "The folder of the model FastDeploy serves: the digests of its config.json and its "
        "weights name the model in every key (as vLLM's connector does), so two models, "
        "or new weights at an old path, never share blocks. null: the model is named by "
        "model_version (AS_MODEL_VERSION) alone, which must then be set to a name of these "
        "exact weights.",
        default=None,
        validator=optional(non_empty_str),
    )
    weights_digest: str = setting(
        "How model_path's weight files are read for their digest: 'sampled' (size, "
        "safetensors header and 64 pieces of each file) or 'full' (every byte).",
        default="sampled",
        validator=one_of(*DIGEST_MODES),
    )
    slice_write: SliceWritePolicy = setting(
        "How AttentionStore.write splits long writes; the variables AS_WRITE_SLICE_BLOCK_NUM, "
        "AS_WRITE_SLICE_TIMEOUT and AS_WRITE_TOTAL_TIMEOUT override these.",
        factory=SliceWritePolicy,
        validator=_is_policy,
        metadata={"parse": _parse_policy},
    )
    pipeline_chunk_mb: int = pipeline_chunk_mb_setting(32)
    pipeline_depth: int = pipeline_depth_setting(4)
    zero_copy: bool = zero_copy_setting()
    digests_on_gpu: bool = digests_on_gpu_setting()
    cancel_grace_s: float = cancel_grace_s_setting()
    residency_index_blocks: int = setting(
        "Blocks the flush_token_index residency index remembers; the least recently "
        "flushed are forgotten first.",
        default=1 << 16,
        validator=int_in_range(1, 1 << 26),
    )
    storage_timeout_s: float = setting(
        "Seconds one UCMStorage batch call may take; keys not done by then fail.",
        default=30.0,
        validator=positive_number,
    )


def load_config(
    ucm_config: Mapping[str, Any] | str | os.PathLike[str] | FastDeployConfig | None = None,
    environ: Mapping[str, str] | None = None,
) -> FastDeployConfig:
    """The settings from ``ucm_config`` (or ``UCM_CONFIG_FILE``) with the AS_WRITE_* overlay."""
    environ = os.environ if environ is None else environ
    if isinstance(ucm_config, FastDeployConfig):
        config = ucm_config
    else:
        config = from_dict(FastDeployConfig, _settings(ucm_config, environ), "ucm_config")
    return attrs.evolve(config, slice_write=_env_policy(config.slice_write, environ))


def _settings(ucm_config: object, environ: Mapping[str, str]) -> dict[str, Any]:
    if ucm_config is None:
        path = environ.get(CONFIG_FILE_ENV)
        if path is None:
            return {}
        if not path.strip():
            raise ConfigError(CONFIG_FILE_ENV, "is set but empty; name a YAML file or unset it")
        return _from_file(path, CONFIG_FILE_ENV)
    if isinstance(ucm_config, (str, os.PathLike)):
        return _from_file(os.fspath(ucm_config), "ucm_config")
    if isinstance(ucm_config, Mapping):
        return with_config_file(ucm_config)
    raise ConfigError(
        "ucm_config",
        f"must be a dict of settings or the path of a YAML file, got {type(ucm_config).__name__}",
    )


def _from_file(path: str, where: str) -> dict[str, Any]:
    try:
        return with_config_file({"config_file": path})
    except ConfigError as exc:  # name what pointed at the file, not an inner key
        raise ConfigError(where, exc.problem) from None


def _env_policy(base: SliceWritePolicy, environ: Mapping[str, str]) -> SliceWritePolicy:
    try:
        return policy_from_env(environ, SLICE_ENV, base)
    except ConfigError as exc:
        if exc.key in SLICE_ENV:  # a value in range for parse_positive but not for the policy
            raise ConfigError(SLICE_ENV[exc.key], exc.problem) from None
        raise


__all__ = [
    "CONFIG_FILE_ENV",
    "SLICE_ENV",
    "FastDeployConfig",
    "load_config",
]
