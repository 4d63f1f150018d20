"""Deployment helpers: ``rollart cluster init`` (the configs of a nats-server cluster)."""
