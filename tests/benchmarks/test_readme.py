"""``benchmarks/README.md`` is data rendered: every section comes from ``results/`` through the
one table renderer and the templates in ``benchmarks/prose/``, so the README, the templates and
the section renderers cannot drift apart unnoticed. Fast (no benchmark runs): in ``make test``."""

from __future__ import annotations

import pytest

from tests.bench_module import BENCHMARKS, load_bench


@pytest.fixture(scope="module")
def common():
    return load_bench("common")


def test_table_right_aligns_number_columns_and_shows_none_as_a_dash(common):
    text = common.table(["name", "wall (s)", "ratio"],
                        [["plain", 1.5, "2.10x"], ["routed", None, "0.9x"]])
    assert text.splitlines() == ["| name | wall (s) | ratio |", "|---|---:|---:|",
                                 "| plain | 1.5 | 2.10x |", "| routed | - | 0.9x |"]


def test_table_refuses_a_row_of_another_width(common):
    with pytest.raises(ValueError, match="2 cells under 3 columns"):
        common.table(["a", "b", "c"], [[1, 2]])


def test_a_template_placeholder_without_a_value_is_an_error(common):
    with pytest.raises(KeyError):
        common.render("routing", table="| a |")  # the template also asks for ratio, pick, ...


def test_every_template_is_used_and_filled(common):
    readme = load_bench("readme").build()
    assert "{{" not in readme and "}}" not in readme
    for template in (BENCHMARKS / "prose").glob("*.md"):
        assert f"<!-- {template.stem}:begin -->" in readme, f"{template.name} is no section"


def test_the_readme_is_what_the_results_render_to():
    """A section edited by hand, or a renderer or template changed without
    ``python benchmarks/readme.py``, fails here."""
    assert (BENCHMARKS / "README.md").read_text() == load_bench("readme").build()
