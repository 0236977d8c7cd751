"""The configuration reference committed in docs/configuration.md is the one the code makes.

The reference is generated from the settings classes by docs/hooks/config_reference.py and
committed, so that it reads (and its links work) on GitHub without a site build; these
tests fail when a setting changed and the reference was not written again
(``python docs/hooks/config_reference.py --write``), and when a link into it leads nowhere.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
GENERATOR = REPO / "docs" / "hooks" / "config_reference.py"
PAGE = REPO / "docs" / "configuration.md"

pytestmark = pytest.mark.skipif(
    not GENERATOR.is_file(), reason="not run from a checkout (no docs/ beside the packages)"
)


def load_generator(name: str = "_ucm_test_config_reference") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return load_generator()


def test_the_committed_reference_is_the_one_the_code_makes(generator, caplog):
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.config_reference"):
        problem = generator.stale(PAGE.read_text())
    assert problem is None, f"docs/configuration.md: {problem}"
    # a setting the generator cannot describe would leave a gap in the table
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_changed_setting_makes_the_reference_stale_and_write_mends_it(generator):
    page = PAGE.read_text()
    start = page.index(generator.BEGIN)
    row = "| `block_tokens` | `256` |"
    assert row in page[start:]
    edited = page[:start] + page[start:].replace(row, row.replace("256", "512"), 1)
    assert edited != page
    assert "differs from the code" in generator.stale(edited)
    assert generator.refreshed(edited) == page
    with pytest.raises(ValueError, match="marker"):
        generator.refreshed(page.replace(generator.END, ""))


def test_the_generator_needs_no_mkdocs(monkeypatch):
    # None in sys.modules makes an import fail: the test and `--write` run without mkdocs
    for name in ("mkdocs", "markdown", "material", "pymdownx"):
        monkeypatch.setitem(sys.modules, name, None)
    module = load_generator("_ucm_test_config_reference_alone")
    assert "### store (kind: mooncake)" in module.render_reference()


def test_headings_get_the_anchors_the_site_and_github_give_them(generator):
    assert generator.slugify("vLLM connector (kv_connector_extra_config)") == (
        "vllm-connector-kv_connector_extra_config"
    )
    assert generator.slugify("store (kind: mooncake)") == "store-kind-mooncake"
    assert generator.slugify("`config_file`") == "config_file"


LINK = re.compile(r"\]\(((?:[\w./-]*/)?configuration\.md)?#([\w-]+)\)")


def test_every_link_into_the_configuration_page_finds_its_heading(generator):
    text = PAGE.read_text()
    # headings outside fenced code
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors = {generator.slugify(h) for h in re.findall(r"^#{1,6} (.+)$", outside, re.M)}
    pages = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    links = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            if target or page == PAGE:
                links.append((page.relative_to(REPO), anchor))
    assert links, "no link into docs/configuration.md found: the pattern is wrong"
    broken = [f"{page}: #{anchor}" for page, anchor in links if anchor not in anchors]
    assert not broken, broken
