"""Tasks whose outcome is code that runs: envs, scorers and agents over :mod:`rollart.sandbox`."""
