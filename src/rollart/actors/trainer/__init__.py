"""The Trainer role: completed trajectories become gradient steps (:mod:`.actor`,
:mod:`.steps`, :mod:`.batch`), checkpoints (:mod:`.checkpoint`, :mod:`.files`,
:mod:`.checkpoint_store`) and what it announces (:mod:`.publish`)."""
