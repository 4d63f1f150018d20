"""The RolloutScheduler role: admission control for α, groups and redundancy
(:class:`rollart.actors.scheduler.actor.RolloutScheduler`)."""
