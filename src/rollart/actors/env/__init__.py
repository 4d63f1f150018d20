"""The EnvManager role: one environment per trajectory, from reset to ``rollout.completed``
(:mod:`.manager`); the pieces of a trajectory (:mod:`.trajectory`, :mod:`.chat`,
:mod:`.lockstep`) and the loop that drives a user's agent (:mod:`.agent_loop`)."""
