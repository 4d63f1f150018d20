"""``docs/hooks.py``: links from a page into the repository outside docs/ are checked (a
missing file fails the build) and pointed at ``repo_url`` when there is one; page links stay."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed: `make docs-check` runs this "
                                     "test in .venv-docs (the docs extra)")
from mkdocs.exceptions import PluginError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
spec = importlib.util.spec_from_file_location("rollart_docs_hooks", DOCS / "hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def test_links_into_the_repository_point_at_it():
    md = "See [the ledger](../src/rollart/actors/groups/ledger.py#L1) and [tests](tests.md)."
    out = hooks.rewrite_repo_links(md, DOCS, "https://example.org/rollart", "p.md")
    assert out == ("See [the ledger](https://example.org/rollart/blob/main/src/rollart/actors/"
                   "groups/ledger.py#L1) and [tests](tests.md).")
    out = hooks.rewrite_repo_links(md, DOCS, None, "p.md")
    assert out == "See the ledger (`src/rollart/actors/groups/ledger.py`) and [tests](tests.md)."


def test_a_missing_or_outside_target_fails_the_build():
    with pytest.raises(PluginError, match="does not exist"):
        hooks.rewrite_repo_links("[x](../src/rollart/no_such.py)", DOCS, None, "p.md")
    with pytest.raises(PluginError, match="outside the repository"):
        hooks.rewrite_repo_links("[x](../../../etc/passwd)", DOCS, None, "p.md")


def test_code_blocks_and_images_are_left_alone():
    md = "```\n[x](../no_such.py)\n```\n![pic](img/gantt.png)"
    assert hooks.rewrite_repo_links(md, DOCS, None, "p.md") == md
