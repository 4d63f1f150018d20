"""rollart: async, event-driven RL training for LLM agents over NATS JetStream."""

__version__ = "0.1.0"
