"""Tasks whose outcome is code that runs: envs, scorers and agents over :mod:`rollart.sandbox`.

:mod:`~rollart.code.execute` (one test program in a sandbox of the process's pool: passed or
not), :mod:`~rollart.code.humaneval` (the 164 HumanEval problems as an env),
:mod:`~rollart.code.pyexpr` (generated expression tasks within a tiny model's reach, with
their demonstrator) and :mod:`~rollart.code.scorer` (``code_tests``, the RewardService's
execution-based scorer for both). The envs run their tests in ``step`` on the env host, or
leave them to the reward service (``execute: false`` with ``scorer: code_tests``).
"""
