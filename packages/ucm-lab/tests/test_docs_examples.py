"""Every configuration the documentation shows is one the code takes: each JSON and YAML
block of the docs and the READMEs, each ``--kv-transfer-config`` of a shell block, and the
example configuration files, parsed and validated as the engine would at start-up.

A block is validated as what it configures: FastDeploy's backend on its page (and by
``ucm_config`` keys), a whole ``--kv-transfer-config`` where it names ``kv_connector``,
else the vLLM connector's settings (``kv_connector_extra_config``, which a ``config_file``
or ``UCM_CONFIG_FILE`` holds too).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from ucm.fastdeploy.config import load_config
from ucm.vllm.config import connector_config

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted(
    [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md"),
     *ROOT.glob("examples/**/*.md")]
)  # fmt: skip
FENCE = re.compile(r"^ *```(\w*)[^\n]*\n(.*?)^ *```", re.S | re.M)
TRANSFER = re.compile(r"--kv-transfer-config\s+'([^']*)'", re.S)
EXAMPLE_FILES = sorted(
    p for p in ROOT.glob("examples/**/*") if p.suffix in {".yaml", ".yml", ".json"}
)
# example files that configure no UCM setting (checked by the tests that use them)
NOT_SETTINGS = {"ucm-dashboard.json", "ucm-alerts.yaml"}


def blocks() -> list[tuple[str, str, str]]:
    """(where, language, text) of every JSON and YAML block, and of the JSON given to
    ``--kv-transfer-config`` in every shell block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            where = f"{page.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}"
            language, body = match.group(1), match.group(2)
            if language in {"json", "yaml", "yml"}:
                found.append((where, language, body))
            elif language in {"bash", "sh", "shell", "console"}:
                found += [
                    (where, "json", config)
                    for config in TRANSFER.findall(body)
                    if config.strip() != "..."  # a placeholder in prose about the command
                ]
    return found


BLOCKS = blocks()


def validate(where: str, data: object) -> None:
    assert isinstance(data, dict), f"{where}: not a mapping of settings"
    if where.startswith("docs/fastdeploy.md") or "ucm_config" in data:
        load_config(data.get("ucm_config", data), environ={})
    elif "kv_connector" in data:
        assert data["kv_connector"] == "UCMConnector", where
        assert data["kv_connector_module_path"] == "ucm.vllm", where
        assert data.get("kv_role") == "kv_both", where
        connector_config(data.get("kv_connector_extra_config"), environ={})
    else:
        connector_config(data, environ={})


def test_the_docs_show_configurations_of_every_kind():
    kinds = set()
    for _, _, text in BLOCKS:
        kinds |= set(re.findall(r'kind"?:\s*"?(\w+)', text))
    assert {"posix", "dram", "tiered", "mooncake"} <= kinds, kinds
    assert len(BLOCKS) >= 12, [w for w, _, _ in BLOCKS]


@pytest.mark.parametrize(("where", "language", "text"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_configuration_in_the_docs_is_valid(where, language, text):
    data = json.loads(text) if language == "json" else yaml.safe_load(text)
    validate(where, data)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_configuration_is_valid(path):
    data = (
        json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    )
    if path.name not in NOT_SETTINGS:
        validate(str(path.relative_to(ROOT)), data)


def test_a_wrong_setting_in_a_block_would_fail():
    # the check is not vacuous: a misspelt key or a bad value is refused
    with pytest.raises(Exception, match="capacity_gbb"):
        validate("x", {"store": {"kind": "posix", "capacity_gbb": 1}})
    with pytest.raises(Exception, match="block_tokens"):
        bad = {"block_tokens": 0}
        validate("x", {"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": bad})  # fmt: skip
