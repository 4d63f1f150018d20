"""Envs as users write them elsewhere: reset/step only, no ``instruction`` attribute."""

from __future__ import annotations


class GymStyleEnv:
    """Guess the parity of a number; the episode ends after one step. No instruction."""

    def reset(self, seed):
        self.n = seed
        return f"Number: {seed}", {}

    def step(self, action):
        ok = action.strip() == ("E" if self.n % 2 == 0 else "O")
        return "", float(ok), True, False, {"success": ok}


class ConstrainedStyleEnv(GymStyleEnv):
    """The same with legal actions (so the check takes a step too)."""

    def legal_actions(self):
        return ["E", "O"]


class BadInstructionEnv(GymStyleEnv):
    instruction = 42
