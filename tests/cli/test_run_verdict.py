"""When a finished run did not learn what its config expects (``trainer.expect_success``)."""

from __future__ import annotations

import pytest

from rollart.app.launch import below_expected, below_expected_line
from rollart.config import ConfigError, RunConfig, convert


def _cfg(**trainer) -> RunConfig:
    return convert({"run": "r", "run_dir": "runs", "trainer": {"steps": 100, **trainer}}, RunConfig)


def test_below_the_expectation_records_what_and_how_to_go_on():
    below = below_expected(_cfg(expect_success=0.9), {"steps": 100, "greedy_success": 0.25},
                           [0.1 * i for i in range(15)])
    assert below == {"expected": 0.9, "greedy_success": 0.25,
                     "last_sampled_success": [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4],
                     "continue": "rollart run --resume runs/r --steps 200"}
    line = below_expected_line(below)
    assert line.startswith("this run did not learn: greedy success 0.25 is below the 0.90")
    assert line.endswith("train it further with: rollart run --resume runs/r --steps 200")


@pytest.mark.parametrize("trainer,summary", [
    ({"expect_success": 0.9}, {"greedy_success": 0.9}),  # met
    ({}, {"greedy_success": 0.0}),  # nothing expected
    ({"expect_success": 0.9}, {"interrupted": True}),  # no evaluation
    ({"expect_success": 0.9}, {"greedy_success": 0.0, "failed": "every group failed"}),  # stopped
])
def test_no_verdict_when_met_unset_or_without_an_evaluation(trainer, summary):
    assert below_expected(_cfg(**trainer), summary, [0.0]) is None


def test_the_expectation_is_a_success_rate():
    with pytest.raises(ConfigError, match=r"trainer.expect_success must be in \[0, 1\]"):
        _cfg(expect_success=1.5)
