"""MkDocs hooks for the rollart site: the config reference written at build time, and links
into the repository that work both on GitHub and on the site.

Two jobs on ``on_page_markdown``, so no generated file is ever committed, and one cosmetic on
``on_page_content``:

- ``config-reference.md`` holds a marker that is replaced by every config key, rendered from
  :func:`rollart.config.doc.iter_keys`: the same docstrings ``rollart config --doc`` prints,
  so the page cannot go stale.
- Pages link to files outside ``docs/`` (``../src/rollart/...``, ``../benchmarks/README.md``)
  with relative links, which GitHub resolves. MkDocs cannot: the hook checks that the target
  exists (a missing one fails the build, as a broken page link does under ``--strict``) and
  points the link at ``repo_url`` when mkdocs.yml has one (``ROLLART_REPO_URL``), else leaves
  the link text with the file's path beside it, unlinked.
- The API pages' docstrings use Sphinx roles (``:class:`X` ``): the role name is dropped, the
  code span stays.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = "<!-- rollart config --doc -->"
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


# -- links into the repository ------------------------------------------------------------


def _repo_link(text: str, target: str, anchor: str, page_dir: Path, repo_url: str | None,
               where: str) -> str | None:
    """The site's form of a link to a repository file outside docs/, or None when the link
    stays as MkDocs sees it (an external URL, or a page of the site)."""
    if "://" in target or target.startswith("mailto:"):
        return None
    path = (page_dir / target).resolve()
    if path.is_relative_to(DOCS):
        return None
    if not path.is_relative_to(ROOT):
        raise PluginError(f"{where} links {target}, outside the repository")
    if not path.exists():
        raise PluginError(f"{where} links {target}, which does not exist")
    rel = path.relative_to(ROOT).as_posix()
    if repo_url:
        kind = "tree" if path.is_dir() else "blob"
        return f"[{text}]({repo_url.rstrip('/')}/{kind}/main/{rel}{anchor or ''})"
    return text if text.startswith("`") else f"{text} (`{rel}`)"


def rewrite_repo_links(markdown: str, page_dir: Path, repo_url: str | None, where: str) -> str:
    """Every link of ``markdown`` that leaves docs/ for the repository, rewritten."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced:
            line = LINK.sub(lambda mt: _repo_link(mt[1], mt[2], mt[3], page_dir, repo_url, where)
                            or mt[0], line)
        out.append(line)
    return "\n".join(out)


# -- the config reference ------------------------------------------------------------------


def _cell(text: str | None) -> str:
    """A table cell: pipes escaped, newlines folded."""
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _code(text: str | None) -> str:
    return f"`{_cell(text)}`" if text else ""


def _table(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    out += [f"| {' | '.join(r)} |" for r in rows]
    return out + [""]


def config_reference() -> str:
    """Every key of a run config, one table per top-level section, then the arguments of
    each built-in env type: :mod:`rollart.config.doc`'s keys rendered as markdown."""
    try:  # the site's venv installs rollart (no extras), so its config classes import
        from rollart.config import doc
        from rollart.config.schema import RunConfig
    except ImportError as e:
        raise PluginError(f"the config reference needs rollart importable: {e}") from e

    keys = list(doc.iter_keys(RunConfig))
    nested = {k.path.split(".")[0] for k in keys if "." in k.path}
    sections: dict[str, list[Any]] = {"": []}  # "": the top-level keys without sub-keys
    for k in keys:
        top = k.path.split(".")[0]
        sections.setdefault(top if top in nested else "", []).append(k)
    lines: list[str] = []
    for name, keys in sections.items():
        lines += [f"## `{name}`" if name else "## Top level", ""]
        lines += _table([(_code(k.path), _cell(k.type), _code(k.default), _cell(k.allowed),
                          _cell(k.doc)) for k in keys])
    lines += ["## Built-in env types: `envs.<name>.args`", "",
              "Keyword arguments of each built-in `type:` (of a class of your own: its "
              "constructor's).", ""]
    for title, keys in doc.builtin_envs():  # the grouping --doc prints, one table each
        lines += [f"### `{title}`", ""]
        lines += _table([(_code(f"args.{k.path}"), _cell(k.type), _code(k.default),
                          _cell(k.allowed), _cell(k.doc)) for k in keys])
    return "\n".join(lines)


# -- Sphinx roles ----------------------------------------------------------------------------

ROLE = re.compile(r":(?:class|mod|func|meth|data|attr|exc|obj|const):(?=<code>)")
"""A Sphinx role left in front of the code span mkdocstrings made of its target: the
docstrings say ``:class:`X` `` for readers of the source; the site shows ``X`` alone."""


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Drop the Sphinx role names the API pages' docstrings carry."""
    return ROLE.sub("", html)


# -- the markdown ----------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the config reference, then rewrite the page's links into the repository."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_reference())
    src = Path(page.file.abs_src_path)
    return rewrite_repo_links(markdown, src.parent, config.get("repo_url"),
                              page.file.src_uri)
