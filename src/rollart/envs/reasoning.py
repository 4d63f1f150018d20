"""Single-turn verifiable tasks from the ``reasoning_gym`` package (optional dependency)."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from rollart.envs.base import HELDOUT_SEED_OFFSET, is_heldout_seed

#: Items scanned past the training range, per held-out item wanted, to find held-out questions.
HELDOUT_SCAN = 50
#: Training items tried from ``seed % size`` on before giving up on finding one whose question
#: is not held out.
TRAIN_TRIES = 1000


_HELD: dict[tuple, _HeldOut] = {}  # one per dataset configuration, shared by its envs
_HELD_LOCK = threading.Lock()


class _HeldOut:
    """The held-out items of one dataset configuration, found as far as asked for: the
    ``j``-th item past the training range whose question is held out and not asked by an
    earlier one (a generator that repeats questions would otherwise fill the evaluation
    with a few frequent ones: sums of 0-99 draw a one-digit number half the time)."""

    def __init__(self, start: int, limit: int) -> None:
        self.found: list[int] = []
        self.questions: set[str] = set()
        self.start = self.next = start
        self.limit = limit

    def item(self, j: int, dataset: Any, is_heldout) -> int:
        while len(self.found) <= j and self.next < self.limit:
            q = dataset[self.next]["question"]
            if q not in self.questions and is_heldout(q):
                self.found.append(self.next)
                self.questions.add(q)
            self.next += 1
        if len(self.found) > j:
            return self.found[j]
        if not self.found:
            raise ValueError(
                f"reasoning_gym: none of the {self.limit - self.start} items "
                f"past the training range asks a held-out question: raise 'heldout_share'")
        return self.found[j % len(self.found)]  # fewer distinct held-out items than asked


def heldout_bucket(question: str) -> float:
    """Where ``question`` falls in [0, 1): a hash of its text, the same in every process and
    for every dataset seed and size. Questions below ``heldout_share`` are held out."""
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


INSTRUCTION = (
    "Solve the task. Think briefly if needed, then give only the final answer inside "
    "<answer></answer>, e.g. <answer>42</answer>."
)


class ReasoningGymEnv:
    """One question per episode from a ``reasoning_gym`` procedural dataset.

    Args:
        dataset: a reasoning_gym dataset name, e.g. ``"basic_arithmetic"``, ``"chain_sum"``,
            ``"countdown"``.
        dataset_args: keyword arguments for the dataset config (difficulty knobs).
        size: number of training items; ``reset(seed)`` serves item ``seed % size``, or the
            next one whose question is not held out.
        heldout: held-out items for evaluation (default 1000): a task seed in the held-out
            window (:func:`~rollart.envs.base.is_heldout_seed`, the evaluation's) serves the
            ``(seed - offset) % n``-th item past the training range that asks a held-out
            question no earlier one asks (n: how many of those a scan of ``heldout * 50``
            items finds, at most ``heldout``).
        heldout_share: the share of the question space held out (default 0.1): a question is
            held out when a hash of its text falls below it (:func:`heldout_bucket`). Training
            never asks a held-out question, so evaluation measures questions never seen, even
            for a generator that repeats questions (one-digit sums have 100).
        dataset_seed: seed of the dataset itself (items are generated lazily from it).
        success_threshold: a score at or above this counts as success (default 0.99).
        binary: reward 1.0 for a success and 0.0 otherwise, instead of the verifier's score
            (default false). Some verifiers give partial credit that a policy learns to
            farm: ``basic_arithmetic`` scores a reply that contains the answer with
            len(answer) / len(reply), so "88" earns 0.5 on every sum that is 8.
        instruction: override the instruction text.

    ``reset`` returns the question and ``info["answer"]`` (a reference answer, for
    debugging: never show it to the policy). ``step(answer)`` scores the answer with the
    dataset's own verifier: reward = score in [0, 1] (``binary``: 0 or 1), always terminated. ``legal_actions``
    is None (free text).
    """

    def __init__(self, *, dataset: str, dataset_args: dict[str, Any] | None = None, size: int = 100_000,
                 heldout: int = 1000, heldout_share: float = 0.1, dataset_seed: int = 0,
                 success_threshold: float = 0.99, binary: bool = False,
                 instruction: str | None = None) -> None:
        try:
            import reasoning_gym  # optional: the envs extra
        except ImportError as e:
            raise ImportError("the reasoning_gym env needs the reasoning-gym package: "
                              "pip install 'rollart[envs]'") from e
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"reasoning_gym arg 'size' must be a positive int, got {size!r}")
        if not isinstance(heldout, int) or isinstance(heldout, bool) or heldout < 1:
            raise ValueError(f"reasoning_gym arg 'heldout' must be a positive int, got {heldout!r}")
        if isinstance(heldout_share, bool) or not isinstance(heldout_share, (int, float)) \
                or not 0.0 < heldout_share < 1.0:
            raise ValueError(f"reasoning_gym arg 'heldout_share' must be a number in (0, 1), "
                             f"got {heldout_share!r}")
        if not isinstance(binary, bool):
            raise ValueError(f"reasoning_gym arg 'binary' must be true or false, got {binary!r}")
        if dataset_args is not None and not isinstance(dataset_args, dict):
            raise ValueError("reasoning_gym arg 'dataset_args' must be a mapping")
        try:
            self.dataset = reasoning_gym.create_dataset(dataset, seed=dataset_seed,
                                                        size=size + heldout * HELDOUT_SCAN,
                                                        **(dataset_args or {}))
        except ValueError as e:
            if "not registered" in str(e):
                raise ValueError(f"reasoning_gym arg 'dataset': unknown dataset {dataset!r}") from e
            raise ValueError(f"reasoning_gym arg 'dataset_args' rejected by {dataset!r}: {e}") from e
        except (TypeError, AssertionError) as e:
            raise ValueError(f"reasoning_gym arg 'dataset_args' rejected by {dataset!r}: {e}") from e
        self.name = dataset
        self.size, self.heldout, self.heldout_share = size, heldout, float(heldout_share)
        self._held_key = (dataset, repr(sorted((dataset_args or {}).items())), dataset_seed, size,
                          heldout, self.heldout_share)
        self.success_threshold, self.binary = success_threshold, binary
        self.instruction = instruction or INSTRUCTION
        self.entry: dict[str, Any] | None = None

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Serve a training item, or a held-out one for an evaluation's seed (see the class
        docstring); deterministic."""
        held = is_heldout_seed(seed)
        if held:
            with _HELD_LOCK:  # found once per process and configuration, as far as asked
                found = _HELD.get(self._held_key)
                if found is None:
                    found = _HELD[self._held_key] = _HeldOut(
                        self.size, self.size + self.heldout * HELDOUT_SCAN)
                index = found.item((seed - HELDOUT_SEED_OFFSET) % self.heldout, self.dataset,
                                   self.is_heldout)
            self.entry = self.dataset[index]
        else:
            index = seed % self.size
            for _ in range(TRAIN_TRIES):
                self.entry = self.dataset[index]
                if not self.is_heldout(self.entry["question"]):
                    break
                index = (index + 1) % self.size
            else:
                raise ValueError(
                    f"reasoning_gym: {TRAIN_TRIES} training items from item {seed % self.size} on "
                    f"all ask held-out questions: lower 'heldout_share' ({self.heldout_share})")
        info = {"valid_action": True, "success": False, "answer": self.entry.get("answer"),
                "dataset": self.name, "index": index, "heldout": held}
        return self.entry["question"], info

    def is_heldout(self, question: str) -> bool:
        """Whether ``question`` is held out (never asked in training)."""
        return heldout_bucket(question) < self.heldout_share

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Score ``action`` as the final answer; the episode always ends."""
        if self.entry is None:
            raise RuntimeError("reasoning_gym: step() before reset() or after the episode ended")
        entry, self.entry = self.entry, None
        valid = isinstance(action, str)
        try:
            score = float(self.dataset.score_answer(answer=action if valid else None, entry=entry))
        except Exception:  # a verifier that chokes on odd text scores it as wrong
            score = 0.0
        score = min(max(score, 0.0), 1.0)
        success = score >= self.success_threshold
        info = {"valid_action": valid, "success": success, "score": score, "answer": entry.get("answer")}
        return "", (float(success) if self.binary else score), True, False, info

    def legal_actions(self) -> None:
        """Free text."""
        return None
