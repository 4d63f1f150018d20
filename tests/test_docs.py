"""The design a user needs is in the repo, and the docs' relative links resolve inside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_relative_links_stay_in_the_repo_and_exist(doc):
    path = ROOT / doc
    links = [u for u in LINK.findall(path.read_text()) if "://" not in u and not u.startswith("mailto:")]
    assert links, doc
    for u in links:
        target = (path.parent / u).resolve()
        assert target.is_relative_to(ROOT), f"{doc} links {u}, outside the repository"
        assert target.exists(), f"{doc} links {u}, which does not exist"


def test_readme_links_the_design():
    text = (ROOT / "README.md").read_text()
    assert "(docs/design.md)" in text and "shared/DESIGN" not in text


def test_design_names_every_subject_and_kv_key():
    from rollart import messages as m

    text = (ROOT / "docs" / "design.md").read_text()
    for name in m.SUBJECTS:
        assert f"`{name}" in text, name
    for key in (m.POLICY_KEY, m.LEDGER_KEY, getattr(m, "RUN_END_KEY", m.POLICY_KEY)):
        assert f"`{key}`" in text, key
    assert "tensors-sha256:" in text and "live + 1 <= (a + α + 1) * B" in text
