"""Emulated hardware: latency models behind the extension points a user has, so the real
actors (scheduler, EnvManagers, LLMProxy, Trainer), admission and the bus run unchanged while
the expensive parts (GPU generation, GPU training, env simulation) are replaced by sleeps.

Never used by the default path; for benchmarks (``benchmarks/emulate.py``, issue 26):

- generation: ``actors.generate.type: rollart.emulate.engine:EmulatedLLMProxy`` with
  ``actors.generate.args.emulate: {profile: h800, time_scale: ...}``
  (:class:`~rollart.emulate.engine.EmulatedEngine`: continuous batching, per-hardware prefill
  and decode times, drawn output lengths);
- envs: ``envs.<name>.type: rollart.emulate.env:EmulatedEnv`` (reset and step latency,
  Gaussian or lognormal; reset failures; a drawn reward);
- reward: ``actors.reward.type: rollart.emulate.reward:EmulatedRewardService`` with an env
  ``scorer: emulated`` (:class:`~rollart.emulate.reward.RewardDevice`: batched judge passes,
  one device per replica or one shared by several jobs);
- training: ``actors.trainer.type: rollart.emulate.trainer:EmulatedTrainer``
  (:class:`~rollart.emulate.trainer.EmulatedTrainBackend`: step time per token, publish time
  per GB of declared model size);
- sites: ``actors.generate.type: rollart.emulate.link:SiteLLMProxy`` (a generator at another
  site, its versions fetched through :class:`~rollart.emulate.link.DelayRelay`, a user-space
  TCP relay with a one-way delay and a paced rate; ``benchmarks/sites.py``).

Every latency is a *modelled* time in seconds; the sleep is that times ``time_scale`` (one
global knob, :data:`rollart.emulate.profiles.TIME_SCALE_ENV`), so an experiment of modelled
minutes runs in seconds here. Everything an emulated component does is recorded
(:data:`rollart.emulate.records.RECORDS`) so that a benchmark can compute the critical path of
the very draws a run made. Every table built on it must say "emulated".
"""

from rollart.emulate.profiles import PROFILES, HardwareProfile, time_scale

__all__ = ["PROFILES", "HardwareProfile", "time_scale"]
