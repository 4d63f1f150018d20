"""The actor kernel: how any actor runs, below every role.

Handlers and their settings (:mod:`.base`; one merge of a role's config, :mod:`.settings`),
delivery loops and dead letters (:mod:`.runtime`), request/reply services and their callers
(:mod:`.service`, :mod:`.service_client`, :mod:`.replica_pins`, :mod:`.batching`), payloads
through the object store (:mod:`.payloads`), typed KV records (:mod:`.records`,
:mod:`.run_end`), the policy a holder follows (:mod:`.policy`, :mod:`.policy_gate`),
cancellations (:mod:`.cancelled`) and pool liveness (:mod:`.pool_watch`). Nothing here
imports a role.
"""
