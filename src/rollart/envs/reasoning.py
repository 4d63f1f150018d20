"""Single-turn verifiable tasks from the ``reasoning_gym`` package (optional dependency)."""

from __future__ import annotations

from typing import Any

from rollart.envs.base import HELDOUT_SEED_OFFSET

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
        size: number of training items; ``reset(seed)`` serves item ``seed % size``.
        heldout: items reserved for held-out evaluation (default 1000): a task seed from
            :data:`~rollart.envs.base.HELDOUT_SEED_OFFSET` on (the evaluation's) serves item
            ``size + (seed - offset) % heldout``, which no training seed serves. Items differ
            by index; a dataset with few distinct questions (one-digit sums) can still repeat
            a training question among them.
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
                 heldout: int = 1000, dataset_seed: int = 0, success_threshold: float = 0.99,
                 binary: bool = False, instruction: str | None = None) -> None:
        try:
            import reasoning_gym  # optional: the envs extra
        except ImportError as e:
            raise ImportError("the reasoning_gym env needs the reasoning-gym package: "
                              "pip install 'rollart[envs]'") from e
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"reasoning_gym arg 'size' must be a positive int, got {size!r}")
        if not isinstance(heldout, int) or isinstance(heldout, bool) or heldout < 1:
            raise ValueError(f"reasoning_gym arg 'heldout' must be a positive int, got {heldout!r}")
        if not isinstance(binary, bool):
            raise ValueError(f"reasoning_gym arg 'binary' must be true or false, got {binary!r}")
        if dataset_args is not None and not isinstance(dataset_args, dict):
            raise ValueError("reasoning_gym arg 'dataset_args' must be a mapping")
        try:
            self.dataset = reasoning_gym.create_dataset(dataset, seed=dataset_seed, size=size + heldout,
                                                        **(dataset_args or {}))
        except ValueError as e:
            if "not registered" in str(e):
                raise ValueError(f"reasoning_gym arg 'dataset': unknown dataset {dataset!r}") from e
            raise ValueError(f"reasoning_gym arg 'dataset_args' rejected by {dataset!r}: {e}") from e
        except (TypeError, AssertionError) as e:
            raise ValueError(f"reasoning_gym arg 'dataset_args' rejected by {dataset!r}: {e}") from e
        self.name = dataset
        self.size, self.heldout = size, heldout
        self.success_threshold, self.binary = success_threshold, binary
        self.instruction = instruction or INSTRUCTION
        self.entry: dict[str, Any] | None = None

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Serve item ``seed % size``, or a held-out one for an evaluation's seed (see the
        class docstring); deterministic."""
        held = seed >= HELDOUT_SEED_OFFSET
        index = self.size + (seed - HELDOUT_SEED_OFFSET) % self.heldout if held else seed % self.size
        self.entry = self.dataset[index]
        info = {"valid_action": True, "success": False, "answer": self.entry.get("answer"),
                "dataset": self.name, "index": index, "heldout": held}
        return self.entry["question"], info

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
