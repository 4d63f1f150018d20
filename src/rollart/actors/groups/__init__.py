"""What the scheduler and the trainer share: what a group is and how it may move
(:mod:`.group`), the book of training groups (:mod:`.ledger`) and the admission record a
completion is checked against (:mod:`.admission`). The only package two roles may both
import."""
