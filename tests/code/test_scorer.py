"""The ``code_tests`` scorer reads its suite and task from another process's request: they
are decoded typed and bounded, and a bad one is refused by name (never run, never scored)."""

from __future__ import annotations

import pytest

from rollart.actors.reward.actor import RULES

code_tests = RULES["code_tests"]


@pytest.mark.parametrize("metadata, why", [
    ({}, "suite"),
    ({"suite": "shell", "task": "x"}, "suite"),
    ({"suite": "humaneval", "task": "HumanEval/" + "9" * 100}, "task"),
    ({"suite": "humaneval", "task": "../../etc/passwd"}, "task"),
    ({"suite": "humaneval", "task": "HumanEval/999"}, "unknown humaneval task"),
    ({"suite": "pyexpr", "task": "add:99"}, "unknown pyexpr task"),
])
def test_bad_metadata_is_refused_by_name(metadata, why):
    with pytest.raises(ValueError, match=why):
        code_tests("x + 1", "", metadata)


def test_a_response_that_is_no_answer_scores_zero_without_running():
    assert code_tests("", "", {"suite": "humaneval", "task": "HumanEval/0"}) == 0.0
    assert code_tests("x" * 70_000, "", {"suite": "humaneval", "task": "HumanEval/0"}) == 0.0
    assert code_tests("import os", "", {"suite": "pyexpr", "task": "add:1"}) == 0.0
    assert code_tests("x + 1", "", {"suite": "pyexpr", "task": "add:1", "seed": "3"}) == 1.0
