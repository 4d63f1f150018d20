"""The docs a user needs are in the repo and read on GitHub as they are: the README is a landing
page that links into ``docs/``, every page is in the site's navigation, relative links resolve
inside the repository, and the design names every subject and KV key. The site itself (built
strict, opened in a browser, the config reference filled in) is tested by ``tests/docs_site``
in ``make docs-check``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NAV_PAGE = re.compile(r"^\s*-\s*[^:]+:\s*(\S+\.md)\s*$", re.M)
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md"))
TUTORIALS = ["quickstart.md", "your-env.md", "your-agent.md", "code.md", "warm-start.md", "many-hosts.md",
             "security.md", "gpus-and-engines.md", "watching.md", "asynchrony.md",
             "failures.md", "tests.md", "benchmarks.md"]
"""The pages in the order a user meets them (issue 44)."""


def _nav() -> list[str]:
    return NAV_PAGE.findall((ROOT / "mkdocs.yml").read_text())


@pytest.mark.parametrize("doc", ["README.md", *PAGES])
def test_relative_links_stay_in_the_repo_and_exist(doc):
    path = ROOT / doc
    text = path.read_text()
    links = [u for u in LINK.findall(text) if "://" not in u and not u.startswith("mailto:")]
    if doc in ("README.md", "docs/index.md", "docs/design.md"):
        assert links, doc
    for u in links:
        target = (path.parent / u).resolve()
        assert target.is_relative_to(ROOT), f"{doc} links {u}, outside the repository"
        assert target.exists(), f"{doc} links {u}, which does not exist"


def test_readme_links_the_design():
    text = (ROOT / "README.md").read_text()
    assert "(docs/design.md)" in text and "shared/DESIGN" not in text


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make run" in text and "make test" in text and "make docs" in text
    assert "python -m pytest -q -n 3" in text  # the exact command `make test` runs
    assert "![" in text and "(docs/img/" in text  # a picture of a run
    for page in TUTORIALS:
        assert f"(docs/{page}" in text, f"README does not link docs/{page}"


def test_every_page_is_in_the_navigation_in_the_users_order():
    nav = _nav()
    in_docs = sorted(p.removeprefix("docs/") for p in PAGES)
    assert sorted(nav) == in_docs, "mkdocs.yml's nav and the pages under docs/ differ"
    assert nav[0] == "index.md" and "design.md" in nav
    assert [p for p in nav if p in TUTORIALS] == TUTORIALS


def test_pages_have_a_title_and_no_dated_diary():
    for page in PAGES + ["README.md"]:
        text = (ROOT / page).read_text()
        assert text.startswith("# "), f"{page} does not start with its title"
        if page != "docs/design.md":
            dated = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
            assert not dated, f"{page} dates its text ({dated}): history belongs in git"


def test_config_reference_is_generated_not_committed():
    text = (DOCS / "config-reference.md").read_text()
    assert "<!-- rollart config --doc -->" in text
    assert "| key |" not in text and "`trainer.lr`" not in text  # the table comes at build time
    assert re.search(r"^hooks:\n\s+- docs/hooks\.py$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_design_names_every_subject_and_kv_key():
    from rollart import messages as m

    text = (ROOT / "docs" / "design.md").read_text()
    for name in m.SUBJECTS:
        assert f"`{name}" in text, name
    for key in (m.POLICY_KEY, m.LEDGER_KEY, getattr(m, "RUN_END_KEY", m.POLICY_KEY)):
        assert f"`{key}`" in text, key
    assert "tensors-sha256:" in text and "live + 1 <= (a + α + 1) * B" in text
