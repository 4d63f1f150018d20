"""A verifiers (0.4, ``verifiers.v1``) taskset for the tests: ``verifiers:rollart_vf_tiny``
once this folder is on ``sys.path`` (verifiers imports a taskset id as a top-level module).

Each task asks to repeat a word; two rewards score the last reply: ``exact`` (weight 1) and
``letters`` (weight 0.5, the share of the word's letters the reply has). :func:`score` is
the same rubric as plain Python, for the tests to check the trace's reward against.
"""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano"]
WEIGHTS = {"exact": 1.0, "letters": 0.5}


def exact(reply: str, answer: str) -> float:
    return float(reply == answer)


def letters(reply: str, answer: str) -> float:
    want = set(answer)
    return len(want & set(reply)) / len(want)


def score(reply: str, answer: str) -> float:
    """The trace's reward for ``reply`` (stripped, as verifiers' ``last_reply`` is)."""
    return WEIGHTS["exact"] * exact(reply, answer) + WEIGHTS["letters"] * letters(reply, answer)


def prompt(i: int) -> str:
    return f"Repeat the word exactly: {WORDS[i % len(WORDS)]}"


class RepeatData(vf.TaskData):
    answer: str


class RepeatTaskConfig(vf.TaskConfig):
    broken: bool = False
    """The reward raises (an episode that fails in scoring)."""
    stall_s: float = 0.0
    """Scoring sleeps this long first (an episode outliving its trajectory's deadline)."""


class RepeatTask(vf.Task[RepeatData, vf.State, RepeatTaskConfig]):
    @vf.reward(weight=WEIGHTS["exact"])
    async def exact(self, trace: vf.Trace) -> float:
        if self.config.broken:
            raise ValueError("the rubric is broken")
        await asyncio.sleep(self.config.stall_s)
        return exact(trace.last_reply, self.data.answer)

    @vf.reward(weight=WEIGHTS["letters"])
    async def letters(self, trace: vf.Trace) -> float:
        return letters(trace.last_reply, self.data.answer)


class RepeatConfig(vf.TasksetConfig):
    num_tasks: int = 5
    task: RepeatTaskConfig = RepeatTaskConfig()


class RepeatTaskset(vf.Taskset[RepeatTask, RepeatConfig]):
    def load(self) -> list[RepeatTask]:
        return [RepeatTask(RepeatData(prompt=prompt(i), system_prompt="Be brief.",
                                      answer=WORDS[i % len(WORDS)]), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["RepeatTaskset"]
